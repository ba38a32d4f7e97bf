//! Reading a Hugging Face `tokenizer.json` (byte-level BPE only).
//!
//! Accepted: `model.type = "BPE"` without dropout, byte fallback, subword prefix or suffix;
//! no normalizer (or an empty `Sequence`); the pre-tokenizer of DeepSeek V3/V4 (three `Split`
//! passes then `ByteLevel{use_regex: false}`) or GPT-2's (`ByteLevel{use_regex: true}`), both
//! without `add_prefix_space`; a `ByteLevel` decoder; added tokens without `lstrip`, `rstrip`
//! or `single_word`. Anything else is [`Error::UnsupportedModel`] naming the key. The
//! post-processor is ignored: `encode` never adds tokens.

use serde_json::Value as J;

use super::{AddedToken, Parts, PreTokenizer, BOS_TEXT, EOS_TEXT};
use crate::{Error, Result};

/// The DeepSeek V3/V4 `Split` regexes, in order (as written in `tokenizer.json`).
const DEEPSEEK_SPLITS: [&str; 3] = [
    r"\p{N}{1,3}",
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
];

fn err(key: &str, msg: impl std::fmt::Display) -> Error {
    Error::model(format!("tokenizer.json: {key}: {msg}"))
}

fn is_null_or(v: Option<&J>, ok: impl Fn(&J) -> bool) -> bool {
    v.is_none_or(|v| v.is_null() || ok(v))
}

fn flag(v: &J, key: &str) -> bool {
    v.get(key).and_then(J::as_bool).unwrap_or(false)
}

fn byte_level(v: &J, key: &str, use_regex: bool) -> Result<()> {
    if v.get("type").and_then(J::as_str) != Some("ByteLevel") {
        return Err(err(key, "expected ByteLevel"));
    }
    if flag(v, "add_prefix_space") {
        return Err(err(&format!("{key}.add_prefix_space"), "true is not supported"));
    }
    // `use_regex` defaults to true in tokenizers
    if v.get("use_regex").and_then(J::as_bool).unwrap_or(true) != use_regex {
        return Err(err(&format!("{key}.use_regex"), format!("expected {use_regex}")));
    }
    Ok(())
}

fn pre_tokenizer(v: Option<&J>) -> Result<PreTokenizer> {
    const KEY: &str = "pre_tokenizer";
    let v = v.filter(|v| !v.is_null()).ok_or_else(|| err(KEY, "missing (a byte-level pre-tokenizer is required)"))?;
    match v.get("type").and_then(J::as_str) {
        Some("ByteLevel") => {
            byte_level(v, KEY, true)?;
            Ok(PreTokenizer::Gpt2)
        }
        Some("Sequence") => {
            let parts = v
                .get("pretokenizers")
                .and_then(J::as_array)
                .ok_or_else(|| err(KEY, "Sequence without pretokenizers"))?;
            if parts.len() != DEEPSEEK_SPLITS.len() + 1 {
                return Err(err(KEY, "only the DeepSeek V3/V4 Split sequence and ByteLevel are supported"));
            }
            for (i, (p, want)) in parts.iter().zip(DEEPSEEK_SPLITS).enumerate() {
                let key = format!("{KEY}.pretokenizers[{i}]");
                let ok = p.get("type").and_then(J::as_str) == Some("Split")
                    && p.pointer("/pattern/Regex").and_then(J::as_str) == Some(want)
                    && p.get("behavior").and_then(J::as_str) == Some("Isolated")
                    && !flag(p, "invert");
                if !ok {
                    return Err(err(&key, "not the DeepSeek V3/V4 Split (only that sequence is supported)"));
                }
            }
            byte_level(
                &parts[DEEPSEEK_SPLITS.len()],
                &format!("{KEY}.pretokenizers[{}]", DEEPSEEK_SPLITS.len()),
                false,
            )?;
            Ok(PreTokenizer::DeepSeek)
        }
        other => Err(err(KEY, format!("{other:?} is not supported"))),
    }
}

fn token_content(v: Option<&J>) -> Option<&str> {
    match v? {
        J::String(s) => Some(s),
        o => o.get("content")?.as_str(),
    }
}

pub(super) fn parts_from_json(text: &str, config: Option<&str>) -> Result<Parts> {
    let root: J =
        serde_json::from_str(text).map_err(|e| Error::model(format!("tokenizer.json: not valid JSON: {e}")))?;
    let model = root.get("model").ok_or_else(|| err("model", "missing"))?;
    if model.get("type").and_then(J::as_str).is_some_and(|t| t != "BPE") {
        return Err(err("model.type", "only BPE is supported"));
    }
    for key in ["dropout", "continuing_subword_prefix", "end_of_word_suffix", "unk_token"] {
        if !is_null_or(model.get(key), |_| false) {
            return Err(err(&format!("model.{key}"), "must be null"));
        }
    }
    if flag(model, "byte_fallback") {
        return Err(err("model.byte_fallback", "true is not supported"));
    }
    if !is_null_or(root.get("normalizer"), |n| {
        n.get("type").and_then(J::as_str) == Some("Sequence")
            && n.get("normalizers").and_then(J::as_array).is_some_and(|a| a.is_empty())
    }) {
        return Err(err("normalizer", "only none (or an empty Sequence) is supported"));
    }
    let pre = pre_tokenizer(root.get("pre_tokenizer"))?;
    if let Some(d) = root.get("decoder").filter(|d| !d.is_null()) {
        if d.get("type").and_then(J::as_str) != Some("ByteLevel") {
            return Err(err("decoder", "only ByteLevel is supported"));
        }
    }

    let vocab =
        model.get("vocab").and_then(J::as_object).ok_or_else(|| err("model.vocab", "missing or not an object"))?;
    let mut entries: Vec<(u32, &str)> = Vec::with_capacity(vocab.len());
    for (s, id) in vocab {
        let id = id
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| err("model.vocab", format!("{s:?}: bad id {id}")))?;
        entries.push((id, s));
    }
    let mut added = Vec::new();
    for (i, a) in root.get("added_tokens").and_then(J::as_array).map(Vec::as_slice).unwrap_or(&[]).iter().enumerate() {
        let key = format!("added_tokens[{i}]");
        let id = a
            .get("id")
            .and_then(J::as_u64)
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| err(&key, "bad or missing id"))?;
        let content = a.get("content").and_then(J::as_str).ok_or_else(|| err(&key, "missing content"))?;
        for k in ["lstrip", "rstrip", "single_word"] {
            if flag(a, k) {
                return Err(err(&format!("{key}.{k}"), format!("true is not supported ({content:?})")));
            }
        }
        added.push(AddedToken {
            id,
            content: content.to_string(),
            special: flag(a, "special"),
            // tokenizers' default for an added token is normalized = !special
            normalized: a.get("normalized").and_then(J::as_bool).unwrap_or(!flag(a, "special")),
        });
    }
    let n = entries.iter().map(|e| e.0).chain(added.iter().map(|a| a.id)).max().map_or(0, |m| m as usize + 1);
    // The table has a slot for every id up to the largest: ids far past the tokens' count (a
    // file's {"a": 4294967294}) would ask for gigabytes before anything else is checked.
    let count = entries.len() + added.len();
    if n > 2 * count + 1024 {
        return Err(err("model.vocab", format!("ids up to {} for {count} tokens", n - 1)));
    }
    let mut tokens: Vec<Option<String>> = vec![None; n];
    for (id, s) in entries {
        tokens[id as usize] = Some(s.to_string());
    }
    let mut merges = Vec::new();
    for (i, m) in model
        .get("merges")
        .and_then(J::as_array)
        .ok_or_else(|| err("model.merges", "missing or not a list"))?
        .iter()
        .enumerate()
    {
        let pair = match m {
            J::String(s) => s.split_once(' ').filter(|(a, b)| !a.is_empty() && !b.is_empty() && !b.contains(' ')),
            J::Array(p) if p.len() == 2 => p[0].as_str().zip(p[1].as_str()),
            _ => None,
        };
        let (a, b) = pair.ok_or_else(|| err(&format!("model.merges[{i}]"), "not a pair of tokens"))?;
        merges.push((a.to_string(), b.to_string()));
    }
    // the merges run over the model vocabulary; an added token's string does not take part
    // unless the model has it too (it then has the same id in practice)
    for a in &added {
        if tokens[a.id as usize].is_none() {
            tokens[a.id as usize] = Some(a.content.clone());
        }
    }

    let config: Option<J> = match config {
        Some(c) => Some(
            serde_json::from_str(c).map_err(|e| Error::model(format!("tokenizer_config.json: not valid JSON: {e}")))?,
        ),
        None => None,
    };
    let lookup = |s: &str| -> Option<u32> {
        added
            .iter()
            .rev()
            .find(|a| a.content == s)
            .map(|a| a.id)
            .or_else(|| tokens.iter().position(|t| t.as_deref() == Some(s)).map(|i| i as u32))
    };
    let special = |key: &str, fallback: &str| -> Option<u32> {
        match config.as_ref().and_then(|c| token_content(c.get(key))) {
            Some(s) => lookup(s),
            None => lookup(fallback),
        }
    };
    let bos = special("bos_token", BOS_TEXT);
    let eos = special("eos_token", EOS_TEXT);
    Ok(Parts {
        tokens,
        merges,
        added,
        pre,
        bos,
        eos,
        ignore_merges: flag(model, "ignore_merges"),
        merges_key: "tokenizer.json: model.merges".to_string(),
    })
}
