//! Generation: sampling tokens after a prompt, decoding them to text, stopping on EOS, stop
//! strings, a token budget or a full context.
//!
//! A [`Generation`] holds only what belongs to one request (the stream decoder, the text not
//! yet released, counters, timings); the session it drives is passed to every call, so a
//! caller can hold the session under a lock only while a step runs.
//!
//! Stop strings are matched on the decoded text across token boundaries: text that could
//! still be the start of a stop string is held back until it cannot; a matched stop string
//! and everything after it are never released. The token that finishes a generation (EOS,
//! the one completing a stop string, the last of the budget) is returned but not evaluated:
//! the session then holds the prompt and every generated token but the last.

use std::sync::Arc;
use std::time::Instant;

use crate::model::Logits;
use crate::sampling::SamplingParams;
use crate::session::Session;
use crate::tokenizer::{StreamDecoder, Tokenizer};
use crate::{Error, Result};

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was sampled.
    Eos,
    /// A stop string appeared in the text.
    Stop,
    /// The token budget or the context ran out.
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Eos => "eos",
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// What a request asks for.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop strings (non-empty).
    pub stop: Vec<String>,
    /// Token ids that end the generation (usually EOS).
    pub stop_tokens: Vec<u32>,
}

/// New text and the token that produced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub text: String,
    pub tokens: Vec<u32>,
}

/// One request in progress.
pub struct Generation {
    opts: GenerateOptions,
    decoder: StreamDecoder,
    /// Decoded text not yet released (it may be the start of a stop string).
    held: String,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    pub prompt_tokens: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
}

impl Generation {
    /// Validates the request, evaluates `prompt` on `session` and gets ready to sample. On
    /// error the session is unchanged.
    pub fn start(
        session: &mut Session,
        tokenizer: Arc<Tokenizer>,
        prompt: &[u32],
        opts: GenerateOptions,
    ) -> Result<Self> {
        opts.sampling.validate()?;
        if opts.stop.iter().any(String::is_empty) {
            return Err(Error::invalid("stop strings must not be empty"));
        }
        if prompt.is_empty() {
            // The logits of the session's last token are not kept, so there is nothing to
            // sample from without at least one new token.
            return Err(Error::invalid("the prompt is empty: generation needs at least one new token"));
        }
        if tokenizer.vocab_size() > session.model().config.vocab {
            return Err(Error::invalid(format!(
                "the tokenizer has {} tokens, more than the model's vocabulary of {}",
                tokenizer.vocab_size(),
                session.model().config.vocab
            )));
        }
        session.check(prompt)?;
        let t0 = Instant::now();
        let logits = session.eval(prompt, Logits::Last)?;
        session.use_sampling(&opts.sampling)?;
        Ok(Generation {
            opts,
            decoder: StreamDecoder::new(tokenizer),
            held: String::new(),
            logits,
            tokens: Vec::new(),
            finish: None,
            prompt_tokens: prompt.len(),
            prefill_seconds: t0.elapsed().as_secs_f64(),
            decode_seconds: 0.0,
        })
    }

    /// Samples the next token and returns the text it releases, or `None` once finished.
    pub fn step(&mut self, session: &mut Session) -> Result<Option<Chunk>> {
        if self.finish.is_some() {
            return Ok(None);
        }
        let t0 = Instant::now();
        let token = session.sample(&self.logits)?;
        self.tokens.push(token);
        let mut chunk = Chunk { text: String::new(), tokens: vec![token] };
        if self.opts.stop_tokens.contains(&token) {
            self.finish = Some(FinishReason::Eos);
        } else {
            self.held.push_str(&self.decoder.feed(&[token])?);
            if let Some(at) = self.opts.stop.iter().filter_map(|s| self.held.find(s.as_str())).min() {
                self.held.truncate(at);
                chunk.text = std::mem::take(&mut self.held);
                self.finish = Some(FinishReason::Stop);
            } else if self.tokens.len() >= self.opts.max_tokens || session.position() + 1 > session.context() {
                self.finish = Some(FinishReason::Length);
            } else {
                let keep = self.held.len() - held_back(&self.held, &self.opts.stop);
                chunk.text = self.held.drain(..keep).collect();
                self.logits = session.eval(&[token], Logits::Last)?;
            }
        }
        if matches!(self.finish, Some(FinishReason::Eos | FinishReason::Length)) {
            // Release what was held back for stop strings, and any bytes the decoder kept.
            chunk.text = std::mem::take(&mut self.held) + &self.decoder.flush();
        }
        self.decode_seconds += t0.elapsed().as_secs_f64();
        Ok(Some(chunk))
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// Bytes at the end of `text` that could begin one of `stops` (to hold back). Always on a
/// character boundary.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for s in stops {
        // The longest proper prefix of s that is a suffix of text.
        for (i, _) in s.char_indices().skip(1) {
            if i > best && text.ends_with(&s[..i]) {
                best = i;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</answer>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </ans", &stops), 5);
        assert_eq!(held_back("hello ST", &stops), 2);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("é<", &["<é>".to_string()]), 1);
    }
}
