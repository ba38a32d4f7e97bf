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

use crate::backend::Greedy;
use crate::model::Logits;
use crate::sampling::SamplingParams;
use crate::session::Session;
use crate::spec::schedule::Scheduler;
use crate::spec::{Draft, Drafter, SpecStats};
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

/// New text and the tokens that produced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub text: String,
    pub tokens: Vec<u32>,
}

/// Speculative decoding settings of a request.
pub struct Speculation {
    pub drafter: Box<dyn Drafter>,
    pub scheduler: Scheduler,
}

/// One request in progress.
pub struct Generation {
    opts: GenerateOptions,
    decoder: StreamDecoder,
    /// Decoded text not yet released (it may be the start of a stop string).
    held: String,
    /// Logits of the session's last evaluated token (when no token is pending).
    logits: Vec<f32>,
    /// A token already chosen by the target but not evaluated yet: speculative cycles end
    /// with one (the correction or the bonus), and greedy steps with the argmax of their last
    /// row (see [`eval_last`]).
    pending: Option<u32>,
    tokens: Vec<u32>,
    finish: Option<FinishReason>,
    spec: Option<Speculation>,
    failed: bool,
    /// The session's change count after this generation's last evaluation
    /// ([`Session::changes`]): another eval, verify, restore or reset in between leaves the
    /// pending token and logits stale.
    changes: u64,
    pub stats: SpecStats,
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
        mut spec: Option<Speculation>,
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
        let (logits, pending) = eval_last(session, prompt, opts.sampling.is_greedy())?;
        session.use_sampling(&opts.sampling)?;
        if let Some(sp) = spec.as_mut() {
            sp.drafter.rewind(session.tokens());
        }
        Ok(Generation {
            opts,
            decoder: StreamDecoder::new(tokenizer),
            held: String::new(),
            logits,
            pending,
            tokens: Vec::new(),
            finish: None,
            spec,
            failed: false,
            changes: session.changes(),
            stats: SpecStats::default(),
            prompt_tokens: prompt.len(),
            prefill_seconds: t0.elapsed().as_secs_f64(),
            decode_seconds: 0.0,
        })
    }

    /// Adds a token the target chose to the output, `pos` the position it is evaluated at (the
    /// session's, or in a cycle the draft's own, whatever the verify left the session at); true
    /// if it ends the generation.
    fn emit(&mut self, token: u32, pos: usize, ctx: usize, chunk: &mut Chunk) -> Result<bool> {
        self.tokens.push(token);
        chunk.tokens.push(token);
        if self.opts.stop_tokens.contains(&token) {
            self.finish = Some(FinishReason::Eos);
        } else {
            self.held.push_str(&self.decoder.feed(&[token])?);
            if let Some(at) = self.opts.stop.iter().filter_map(|s| self.held.find(s.as_str())).min() {
                self.held.truncate(at);
                chunk.text += &std::mem::take(&mut self.held);
                self.finish = Some(FinishReason::Stop);
                return Ok(true);
            }
            // The token must be evaluated before the next one can follow it.
            if self.tokens.len() >= self.opts.max_tokens || pos + 1 > ctx {
                self.finish = Some(FinishReason::Length);
            } else {
                let keep = self.held.len() - held_back(&self.held, &self.opts.stop);
                chunk.text.extend(self.held.drain(..keep));
                return Ok(false);
            }
        }
        // Release what was held back for stop strings, and any bytes the decoder kept.
        chunk.text += &std::mem::take(&mut self.held);
        chunk.text += &self.decoder.flush();
        Ok(true)
    }

    /// Runs one step (one token, or one speculative cycle) and returns what it released,
    /// or `None` once finished. If a step fails, the session is put back as it was before the
    /// step (its state, and its random stream) and the generation cannot continue: the token
    /// the step had taken was never evaluated.
    pub fn step(&mut self, session: &mut Session) -> Result<Option<Chunk>> {
        if self.failed {
            return Err(Error::invalid("this generation failed earlier and cannot continue"));
        }
        if self.finish.is_some() {
            return Ok(None);
        }
        if session.changes() != self.changes {
            return Err(Error::invalid(
                "the session changed (an eval, verify, restore or reset) since this generation's last step",
            ));
        }
        let rng = session.sampler_mut()?.state();
        match self.try_step(session) {
            Ok(chunk) => {
                self.changes = session.changes();
                Ok(Some(chunk))
            }
            Err(e) => {
                self.failed = true;
                session.sampler_mut()?.set_state(rng)?;
                Err(e)
            }
        }
    }

    /// [`Generation::step`]'s work; an error leaves the session's state as it was (the random
    /// stream is `step`'s to put back).
    fn try_step(&mut self, session: &mut Session) -> Result<Chunk> {
        let t0 = Instant::now();
        let mut chunk = Chunk { text: String::new(), tokens: Vec::new() };
        let a = match self.pending.take() {
            Some(t) => t,
            None => session.sample(&self.logits)?,
        };
        if !self.emit(a, session.position(), session.context(), &mut chunk)? {
            // Room left for drafts: the budget after `a`, context after evaluating `a`, and a
            // verify's most rows after the anchor (`Session::max_verify`: on a GPU, one device
            // step's, so that every verified row is bitwise a plain decode's).
            let room = (self.opts.max_tokens - self.tokens.len())
                .min(session.context() - session.position() - 1)
                .min(session.max_verify()?.saturating_sub(1));
            if self.spec.is_none() || room == 0 {
                self.plain_step(session, a)?;
            } else {
                self.cycle(session, a, room, &mut chunk)?;
            }
        }
        self.decode_seconds += t0.elapsed().as_secs_f64();
        Ok(chunk)
    }

    /// Evaluates the pending token `a` alone (and tells the scheduler and drafter, if any).
    fn plain_step(&mut self, session: &mut Session, a: u32) -> Result<()> {
        let t = Instant::now();
        (self.logits, self.pending) = eval_last(session, &[a], self.opts.sampling.is_greedy())?;
        if let Some(sp) = self.spec.as_mut() {
            sp.scheduler.record_cost(1, t.elapsed().as_secs_f64());
            sp.drafter.observe(&[a]);
            self.stats.record(0, 0);
        }
        Ok(())
    }

    /// One speculative cycle after the pending token `a` (already emitted).
    fn cycle(&mut self, session: &mut Session, a: u32, room: usize, chunk: &mut Chunk) -> Result<()> {
        let sp = self.spec.as_mut().expect("speculation is on");
        if !sp.scheduler.would_speculate(room) {
            // Not worth drafting this cycle: the scheduler books a plain cycle.
            sp.scheduler.block(0);
            return self.plain_step(session, a);
        }
        // The anchor's position: draft j is evaluated at pos0 + 1 + j.
        let pos0 = session.position();
        let mut history = session.tokens().to_vec();
        history.push(a);
        let t_draft = Instant::now();
        // A drafter whose tokens cost a step each drafts the block the scheduler chooses, not
        // the most it may (the choice reads nothing of the drafts: they carry no survival).
        let (mut draft, l) = if sp.drafter.drafts_one_at_a_time() {
            let want = sp.scheduler.block(room);
            if want == 0 {
                return self.plain_step(session, a);
            }
            let draft = sp.drafter.propose_in(session, &history, a, want)?;
            let l = draft.tokens.len().min(want);
            (draft, l)
        } else {
            let draft = sp.drafter.propose_in(session, &history, a, room)?;
            let l = cycle_block(&mut sp.scheduler, &draft, room);
            (draft, l)
        };
        let draft_seconds = t_draft.elapsed().as_secs_f64();
        draft.tokens.truncate(l);
        if let Some(q) = draft.dists.as_mut() {
            q.truncate(l);
        }
        if l == 0 {
            return self.plain_step(session, a);
        }
        let mut batch = Vec::with_capacity(l + 1);
        batch.push(a);
        batch.extend_from_slice(&draft.tokens);
        let t = Instant::now();
        // At temperature 0 the verdict reads only each row's argmax (accept.rs): the rows'
        // greedy tokens are all that comes back.
        let (rows, log) = if self.opts.sampling.is_greedy() {
            session.verify_argmax(&batch)?
        } else {
            let (logits, log) = session.verify(&batch)?;
            (Greedy::Logits(logits), log)
        };
        sp.scheduler.record_cost(l + 1, t.elapsed().as_secs_f64() + draft_seconds);
        let vocab = session.model().config.vocab;
        let verdict = match rows {
            Greedy::Ids(ids) => crate::spec::accept::verify_greedy(&ids, &draft),
            Greedy::Logits(rows) => crate::spec::accept::verify(session.sampler_mut()?, &rows, vocab, &draft),
        };
        let verdict = match verdict {
            Ok(v) => v,
            Err(e) => {
                session.keep(log, 0)?;
                return Err(e);
            }
        };
        let k = verdict.accepted;
        sp.scheduler.record_outcome(l, k);
        self.stats.record(l, k);
        // Emit the accepted drafts; one of them may end the generation, and a finishing
        // token is not kept in the session (as in plain decoding).
        let mut kept = k + 1;
        let ctx = session.context();
        for (j, &d) in draft.tokens[..k].iter().enumerate() {
            match self.emit(d, pos0 + 1 + j, ctx, chunk) {
                Ok(false) => {}
                Ok(true) => {
                    kept = j + 1;
                    break;
                }
                Err(e) => {
                    // Put the session back as it was before the cycle.
                    session.keep(log, 0)?;
                    return Err(e);
                }
            }
        }
        session.keep(log, kept)?;
        let sp = self.spec.as_mut().expect("speculation is on");
        sp.drafter.observe(&batch[..kept]);
        if self.finish.is_none() {
            self.pending = Some(verdict.next);
        }
        Ok(())
    }

    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.finish
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// The block a cycle verifies of `draft` (at most `room` tokens). The scheduler may read the
/// drafter's survival estimates only when the drafts are point masses (greedy): sampled drafts
/// are accepted by the rejection rule, which is exact only if each verified draft is
/// distributed as its q, and DSpark's survival at position i reads the draft sampled before
/// it, so cutting the block on it would choose which sampled drafts get verified by their
/// values (at temperature > 0 that biased the output).
fn cycle_block(scheduler: &mut Scheduler, draft: &Draft, room: usize) -> usize {
    let survival = if draft.dists.is_some() { None } else { draft.survival.as_deref() };
    scheduler.block_with(draft.tokens.len().min(room), survival)
}

/// Evaluates `tokens` on `session` and returns what the next step samples from: the last
/// row's logits, or with a greedy sampler the token it takes from them as the pending token
/// (the argmax is taken where the logits are: [`Session::eval_argmax`]), unless that row has
/// no greedy token (its logits then come back for the sampler to report).
fn eval_last(session: &mut Session, tokens: &[u32], greedy: bool) -> Result<(Vec<f32>, Option<u32>)> {
    if !greedy {
        return Ok((session.eval(tokens, Logits::Last)?, None));
    }
    Ok(match session.eval_argmax(tokens)? {
        Greedy::Ids(ids) => (Vec::new(), ids.last().copied()),
        Greedy::Logits(logits) => (logits, None),
    })
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
    use crate::model::Model;
    use crate::sampling::Sampler;
    use crate::session::tests::{tiny_l, tiny_l_with_decoder, Seen};
    use crate::spec::ngram::NgramDrafter;
    use crate::spec::schedule::{Policy, Scheduler};
    use crate::spec::Draft;
    use crate::state::KvPrecision;
    use std::sync::atomic::Ordering;

    /// `n` tokens after `prompt` the way generation took them before the argmax path: the
    /// last row's logits from `Session::eval`, a token from them with a sampler of `params`.
    fn reference(model: &Arc<Model>, prompt: &[u32], n: usize, params: SamplingParams) -> Vec<u32> {
        let mut s = Session::new(Arc::clone(model), 512, KvPrecision::F32).unwrap();
        let mut sampler = Sampler::new(params).unwrap();
        let mut logits = s.eval(prompt, Logits::Last).unwrap();
        let mut out = Vec::new();
        loop {
            out.push(sampler.sample(&logits).unwrap());
            if out.len() == n {
                return out;
            }
            logits = s.eval(&out[out.len() - 1..], Logits::Last).unwrap();
        }
    }

    /// A generation of `n` tokens (no stop strings or tokens), stepped until it ends or
    /// fails: its tokens, and the error's message if it failed.
    fn generate(
        model: &Arc<Model>,
        prompt: &[u32],
        n: usize,
        params: SamplingParams,
        spec: Option<Speculation>,
    ) -> (Vec<u32>, Option<String>) {
        let mut s = Session::new(Arc::clone(model), 512, KvPrecision::F32).unwrap();
        let tokenizer = Arc::new(Tokenizer::from_gguf(model.file()).unwrap());
        let opts = GenerateOptions { max_tokens: n, sampling: params, stop: Vec::new(), stop_tokens: Vec::new() };
        let mut g = Generation::start(&mut s, tokenizer, prompt, opts, spec).unwrap();
        loop {
            match g.step(&mut s) {
                Ok(Some(_)) => {}
                Ok(None) => return (g.tokens().to_vec(), None),
                Err(e) => return (g.tokens().to_vec(), Some(e.to_string())),
            }
        }
    }

    /// Proposes the true continuation (`full` = prompt + the reference tokens), wrong at some
    /// depths of some cycles, so that cycles accept every prefix length.
    struct Oracle {
        full: Vec<u32>,
        calls: usize,
    }

    impl Drafter for Oracle {
        fn name(&self) -> &str {
            "oracle"
        }

        fn propose(&mut self, history: &[u32], max: usize) -> Result<Draft> {
            self.calls += 1;
            let n = history.len().min(self.full.len());
            let mut out = self.full[n..(n + max).min(self.full.len())].to_vec();
            for (i, t) in out.iter_mut().enumerate() {
                if (self.calls + i) % 5 == 3 {
                    *t = (*t + 1 + i as u32) % 300;
                }
            }
            Ok(Draft::point(out))
        }
    }

    fn speculation(drafter: Box<dyn Drafter>, policy: Policy) -> Option<Speculation> {
        Some(Speculation { drafter, scheduler: Scheduler::new(policy).unwrap() })
    }

    /// Greedy generation, plain and speculative (every block size, an oracle with errors and
    /// the n-gram drafter), gives the tokens of taking the argmax of the logits on the host,
    /// on the host pass and through a device decoder, whose every pass is then an argmax pass
    /// (no logits come back).
    #[test]
    fn greedy_generation_through_the_argmax_is_the_plain_greedy_output() {
        let greedy = SamplingParams::greedy();
        let host = Arc::new(tiny_l());
        let prompt: Vec<u32> = vec![3, 40, 77, 40];
        let n = 40;
        let want = reference(&host, &prompt, n, greedy);
        let full = [prompt.clone(), want.clone()].concat();
        let oracle = || Box::new(Oracle { full: full.clone(), calls: 0 }) as Box<dyn Drafter>;
        let seen = Seen::new();
        let device = tiny_l_with_decoder(&seen);
        for model in [&host, &device] {
            assert_eq!(generate(model, &prompt, n, greedy, None), (want.clone(), None));
            for k in [1, 2, 3, 4, 7, 16] {
                let got = generate(model, &prompt, n, greedy, speculation(oracle(), Policy::Fixed(k)));
                assert_eq!(got, (want.clone(), None), "oracle, block {k}");
            }
            let adaptive = speculation(oracle(), Policy::Adaptive { max: 8 });
            assert_eq!(generate(model, &prompt, n, greedy, adaptive), (want.clone(), None));
            let ngram = speculation(Box::new(NgramDrafter::new(1, 3).unwrap()), Policy::Fixed(3));
            assert_eq!(generate(model, &prompt, n, greedy, ngram), (want.clone(), None));
        }
        // The decoder (at most 4 rows a pass, so drafts of at most 3 whatever the block: a
        // longer verify would be refused, `Session::max_verify`) ran plain steps and verifies,
        // all as argmax passes: one forward each.
        let argmaxes = seen.argmaxes.load(Ordering::Relaxed);
        assert!(seen.argmax_all.load(Ordering::Relaxed) > 20);
        assert_eq!(seen.forwards.load(Ordering::Relaxed), argmaxes);
    }

    /// At temperature > 0 generation reads the logits as before (no argmax pass).
    #[test]
    fn sampled_generation_reads_the_logits() {
        let params = SamplingParams { temperature: 0.8, top_p: 0.95, seed: 7, ..SamplingParams::default() };
        let seen = Seen::new();
        let device = tiny_l_with_decoder(&seen);
        let prompt: Vec<u32> = vec![3, 40, 77, 40];
        let want = reference(&device, &prompt, 24, params);
        assert_eq!(generate(&device, &prompt, 24, params, None), (want.clone(), None));
        let full = [prompt.clone(), want].concat();
        let spec = speculation(Box::new(Oracle { full, calls: 0 }), Policy::Fixed(3));
        let (tokens, err) = generate(&device, &prompt, 24, params, spec);
        assert!(tokens.len() == 24 && err.is_none());
        assert_eq!(seen.argmaxes.load(Ordering::Relaxed), 0);
    }

    /// Logits with no greedy token (a NaN) fail greedy generation where and as they did when
    /// the host sampled every row: the step that samples from them (a plain step's row), or
    /// the verdict of the verify that reads them, with the sampler's message.
    #[test]
    fn a_row_without_a_greedy_token_fails_as_before() {
        let greedy = SamplingParams::greedy();
        let seen = Seen::new();
        let device = tiny_l_with_decoder(&seen);
        let prompt: Vec<u32> = vec![3, 40, 77, 40];
        let want = reference(&device, &prompt, 10, greedy);
        let mut poisoned = vec![0.5f32; device.config.vocab];
        poisoned[7] = f32::NAN;
        let message = Sampler::new(greedy).unwrap().sample(&poisoned).unwrap_err().to_string();
        // Pass 0 is the prompt's, pass i step i's: step 4 samples from pass 3's row.
        seen.forwards.store(0, Ordering::Relaxed);
        seen.poison_at.store(3, Ordering::Relaxed);
        let (tokens, err) = generate(&device, &prompt, 10, greedy, None);
        assert_eq!(tokens, want[..3]);
        assert_eq!(err, Some(message.clone()));
        // The first verify (pass 1) with a NaN in its first row.
        let full = [prompt.clone(), want.clone()].concat();
        seen.forwards.store(0, Ordering::Relaxed);
        seen.poison_at.store(1, Ordering::Relaxed);
        let spec = speculation(Box::new(Oracle { full, calls: 0 }), Policy::Fixed(2));
        let (tokens, err) = generate(&device, &prompt, 10, greedy, spec);
        assert_eq!(tokens, want[..1]);
        assert_eq!(err, Some(message));
    }

    /// A generation of up to `n` tokens in a session of `ctx` positions, stepped until it
    /// ends: its tokens, how it finished and the session's digest.
    fn generate_in(
        model: &Arc<Model>,
        ctx: usize,
        prompt: &[u32],
        n: usize,
        spec: Option<Speculation>,
    ) -> (Vec<u32>, Option<FinishReason>, u64) {
        let mut s = Session::new(Arc::clone(model), ctx, KvPrecision::F32).unwrap();
        let tokenizer = Arc::new(Tokenizer::from_gguf(model.file()).unwrap());
        let opts = GenerateOptions {
            max_tokens: n,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            stop_tokens: Vec::new(),
        };
        let mut g = Generation::start(&mut s, tokenizer, prompt, opts, spec).unwrap();
        while g.step(&mut s).unwrap().is_some() {}
        (g.tokens().to_vec(), g.finish_reason(), s.digest())
    }

    /// At the end of the context a speculative generation stops where plain decoding does,
    /// with the same state, for every block size: an accepted draft's room is judged at its
    /// own position, not at the one the verify left the session at (which ended generations
    /// early when the block reached the context's end).
    #[test]
    fn speculation_ends_at_the_context_where_plain_decoding_does() {
        let seen = Seen::new();
        for model in [Arc::new(tiny_l()), tiny_l_with_decoder(&seen)] {
            let prompt: Vec<u32> = vec![3, 40, 77, 40];
            let ctx = 40;
            let want = generate_in(&model, ctx, &prompt, 1000, None);
            assert_eq!(want.1, Some(FinishReason::Length));
            let full = [prompt.clone(), want.0.clone()].concat();
            for k in [1, 2, 3, 4, 8, 16] {
                // The oracle (wrong at some depths), blocks reaching the context's end.
                let oracle = Box::new(Oracle { full: full.clone(), calls: 2 });
                let got = generate_in(&model, ctx, &prompt, 1000, speculation(oracle, Policy::Fixed(k)));
                assert_eq!(got, want, "block {k}");
            }
        }
    }

    /// A plain step whose evaluation fails ends the generation and puts the session back as
    /// it was before the step, its random stream too; it never goes on from a token it took
    /// but did not evaluate.
    #[test]
    fn a_failed_plain_step_ends_the_generation_and_changes_nothing() {
        let params = SamplingParams { temperature: 0.8, seed: 7, ..SamplingParams::default() };
        let seen = Seen::new();
        let model = tiny_l_with_decoder(&seen);
        let prompt: Vec<u32> = vec![3, 40, 77, 40];
        let mut s = Session::new(Arc::clone(&model), 512, KvPrecision::F32).unwrap();
        let tokenizer = Arc::new(Tokenizer::from_gguf(model.file()).unwrap());
        let opts = GenerateOptions { max_tokens: 12, sampling: params, stop: Vec::new(), stop_tokens: Vec::new() };
        let mut g = Generation::start(&mut s, tokenizer, &prompt, opts, None).unwrap();
        for _ in 0..3 {
            g.step(&mut s).unwrap();
        }
        let (digest, rng) = (s.digest(), s.sampler_mut().unwrap().state());
        seen.fail_at.store(seen.forwards.load(Ordering::Relaxed), Ordering::Relaxed);
        assert!(matches!(g.step(&mut s), Err(Error::Backend(_))));
        seen.fail_at.store(usize::MAX, Ordering::Relaxed);
        assert_eq!((s.digest(), s.sampler_mut().unwrap().state()), (digest, rng));
        let e = g.step(&mut s).unwrap_err();
        assert!(e.to_string().contains("failed earlier"), "{e}");
        assert_eq!(s.digest(), digest);
    }

    /// A generation stepped after its session changed under it (an eval, a reset, a restore)
    /// is refused, rather than going on from a pending token and logits that are no longer the
    /// session's; the session is untouched.
    #[test]
    fn a_generation_refuses_to_step_after_its_session_changed() {
        let model = Arc::new(tiny_l());
        let tokenizer = Arc::new(Tokenizer::from_gguf(model.file()).unwrap());
        let opts = || GenerateOptions {
            max_tokens: 8,
            sampling: SamplingParams::greedy(),
            stop: Vec::new(),
            stop_tokens: Vec::new(),
        };
        let changes: [fn(&mut Session); 3] = [
            |s| drop(s.eval(&[9], Logits::Last).unwrap()),
            |s| s.reset(),
            |s| {
                let snap = s.snapshot();
                s.restore(&snap).unwrap()
            },
        ];
        for change in changes {
            let mut s = Session::new(Arc::clone(&model), 512, KvPrecision::F32).unwrap();
            let mut g = Generation::start(&mut s, Arc::clone(&tokenizer), &[3, 40, 77], opts(), None).unwrap();
            g.step(&mut s).unwrap();
            change(&mut s);
            let digest = s.digest();
            let e = g.step(&mut s).unwrap_err();
            assert!(e.to_string().contains("session changed"), "{e}");
            assert_eq!(s.digest(), digest);
        }
    }

    /// The true continuation a token at a time (as MTP drafts), counting the tokens asked for.
    struct Stepwise {
        full: Vec<u32>,
        asked: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl Drafter for Stepwise {
        fn name(&self) -> &str {
            "stepwise"
        }

        fn propose(&mut self, history: &[u32], max: usize) -> Result<Draft> {
            self.asked.fetch_add(max, Ordering::Relaxed);
            let n = history.len().min(self.full.len());
            Ok(Draft::point(self.full[n..(n + max).min(self.full.len())].to_vec()))
        }

        fn drafts_one_at_a_time(&self) -> bool {
            true
        }
    }

    /// A drafter whose tokens cost a step each is asked for the block the scheduler chose,
    /// so every token it drafts is verified (it once drafted the most and the scheduler then
    /// verified a few), and the output is plain decoding's.
    #[test]
    fn a_stepwise_drafter_drafts_only_the_chosen_block() {
        let greedy = SamplingParams::greedy();
        let model = Arc::new(tiny_l());
        let prompt: Vec<u32> = vec![3, 40, 77, 40];
        let want = reference(&model, &prompt, 30, greedy);
        let full = [prompt.clone(), want.clone()].concat();
        for policy in [Policy::Adaptive { max: 8 }, Policy::Fixed(3)] {
            let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let mut s = Session::new(Arc::clone(&model), 512, KvPrecision::F32).unwrap();
            let tokenizer = Arc::new(Tokenizer::from_gguf(model.file()).unwrap());
            let opts = GenerateOptions { max_tokens: 30, sampling: greedy, stop: Vec::new(), stop_tokens: Vec::new() };
            let drafter = Stepwise { full: full.clone(), asked: Arc::clone(&asked) };
            let mut g =
                Generation::start(&mut s, tokenizer, &prompt, opts, speculation(Box::new(drafter), policy)).unwrap();
            while g.step(&mut s).unwrap().is_some() {}
            assert_eq!(g.tokens(), &want[..], "{policy:?}");
            assert!(g.stats.num_draft_tokens > 0);
            assert_eq!(asked.load(Ordering::Relaxed) as u64, g.stats.num_draft_tokens, "{policy:?}");
        }
    }

    /// The survival estimates of sampled drafts do not reach the scheduler; those of point
    /// masses do. (A state of the adaptive scheduler in which they would change the block:
    /// verifies cost little more than a step, and the estimates say nothing survives.)
    #[test]
    fn sampled_drafts_are_not_cut_by_their_survival() {
        let mut sched = Scheduler::new(Policy::Adaptive { max: 4 }).unwrap();
        for rows in 1..=5 {
            sched.record_cost(rows, 1.0 + 0.05 * rows as f64);
        }
        for _ in 0..8 {
            sched.record_outcome(4, 4);
        }
        let point = crate::sampling::Distribution::point_mass(7);
        let draft = |sampled: bool| Draft {
            tokens: vec![7; 4],
            dists: sampled.then(|| vec![point.clone(); 4]),
            survival: Some(vec![0.0; 4]),
        };
        let without = sched.clone().block_with(4, None);
        let with = sched.clone().block_with(4, Some(&[0.0; 4]));
        assert_ne!(without, with, "a state where the estimates would matter");
        assert_eq!(cycle_block(&mut sched.clone(), &draft(true), 4), without);
        assert_eq!(cycle_block(&mut sched.clone(), &draft(false), 4), with);
    }

    #[test]
    fn holds_back_possible_stop_prefixes() {
        let stops = vec!["</answer>".to_string(), "STOP".to_string()];
        assert_eq!(held_back("hello </ans", &stops), 5);
        assert_eq!(held_back("hello ST", &stops), 2);
        assert_eq!(held_back("hello", &stops), 0);
        assert_eq!(held_back("é<", &["<é>".to_string()]), 1);
    }
}
