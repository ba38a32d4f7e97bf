//! The DeepSeek V4 tokenizer: byte-level BPE read from GGUF metadata or a Hugging Face
//! `tokenizer.json`, with ids identical to `tokenizers` on the same vocabulary.
//!
//! Encoding runs in three steps, as in `tokenizers`:
//!
//! 1. **Added tokens** are cut out of the text first and map straight to their ids. They are
//!    matched leftmost-longest, in two passes: first the tokens that are not "normalized"
//!    (`normalized: false` in `tokenizer.json`; GGUF type 3, control), then, in the text left
//!    between those, the normalized ones (`normalized: true`; GGUF type 4, user-defined).
//!    With `allow_special = false`, special tokens (`special: true`; GGUF type 3: BOS, EOS,
//!    ...) are skipped when matched, so their text is encoded as ordinary text (this is
//!    `tokenizers`' `encode_special_tokens = true`). Non-special added tokens, DeepSeek's role
//!    and think tokens (`<｜User｜>`, `<｜Assistant｜>`, `<think>`, `</think>`, ...), always
//!    match. `allow_special = true` is `tokenizers`' default `encode`: needed for a prompt
//!    rendered by [`render_chat`], which starts with the BOS text.
//! 2. The rest is cut into pieces by the [`PreTokenizer`].
//! 3. Each piece's UTF-8 bytes are merged by [`bpe::Bpe`].
//!
//! `encode` never adds BOS or EOS by itself. [`Tokenizer::decode`] maps each token to its bytes
//! (a token string made only of byte-level chars stands for those bytes, any other token, such
//! as `<｜User｜>`, for its own UTF-8) and renders invalid UTF-8 as U+FFFD; a
//! [`StreamDecoder`] does the same incrementally, emitting only whole characters.
//!
//! GGUF files carry no "normalized" flag, so type 3 tokens are taken as non-normalized and
//! type 4 as normalized; for the DeepSeek V4 vocabulary no added token overlaps another (bar
//! one pair that resolves the same either way), so the two passes give the same ids as
//! `tokenizer.json`. Which tokens are special follows the file: `ds4.convert_tokenizer` writes
//! `tokenizer.json`'s flags (role tokens type 4), while llama.cpp's converter marks every
//! `<｜...｜>` token type 3, so in its files the role tokens too need `allow_special` (a
//! rendered chat prompt is encoded with it anyway, and gets the same ids from either file).

pub mod bpe;
pub mod chat;
mod json;
pub mod pretokenize;

use std::path::Path;
use std::sync::Arc;

use crate::gguf::GgufFile;
use crate::{Error, Result};
use bpe::{Bpe, FxMap, Scratch};

pub use chat::{render_chat, ChatMessage, Role};
pub use pretokenize::PreTokenizer;

/// `<｜begin▁of▁sentence｜>`, DeepSeek's BOS.
pub const BOS_TEXT: &str = "<｜begin▁of▁sentence｜>";
/// `<｜end▁of▁sentence｜>`, DeepSeek's EOS.
pub const EOS_TEXT: &str = "<｜end▁of▁sentence｜>";

/// GGUF token types (`tokenizer.ggml.token_type`).
pub mod token_type {
    pub const NORMAL: i64 = 1;
    pub const UNKNOWN: i64 = 2;
    pub const CONTROL: i64 = 3;
    pub const USER_DEFINED: i64 = 4;
    pub const UNUSED: i64 = 5;
    pub const BYTE: i64 = 6;
}

/// A token matched in the raw text before pre-tokenization.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddedToken {
    pub id: u32,
    pub content: String,
    /// Matched only with `allow_special` (BOS, EOS, ...).
    pub special: bool,
    /// Matched in the second pass (see the module documentation).
    pub normalized: bool,
}

/// The raw material of a tokenizer, as read from a file.
pub(crate) struct Parts {
    /// id -> token string (byte-level form); `None` for an id nothing names.
    pub tokens: Vec<Option<String>>,
    /// Merge pairs in rank order.
    pub merges: Vec<(String, String)>,
    pub added: Vec<AddedToken>,
    pub pre: PreTokenizer,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub ignore_merges: bool,
    /// Where the data came from, for error messages ("tokenizer.ggml.merges", ...).
    pub merges_key: String,
}

/// A byte-level BPE tokenizer. Immutable and `Sync`: one instance serves any number of
/// threads.
pub struct Tokenizer {
    tokens: Vec<Option<String>>,
    /// id -> bytes it decodes to.
    bytes: Vec<Box<[u8]>>,
    ids: FxMap<String, u32>,
    bpe: Bpe,
    pre: PreTokenizer,
    added: Vec<AddedToken>,
    first_pass: Matcher,
    second_pass: Matcher,
    special: Vec<bool>,
    bos: Option<u32>,
    eos: Option<u32>,
    /// With `ignore_merges` (tokenizer.json): pieces that are whole vocabulary tokens.
    whole_words: Option<FxMap<Box<[u8]>, u32>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("merges", &self.bpe.n_merges())
            .field("added", &self.added.len())
            .field("pre", &self.pre)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// The tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        Self::build(parts_from_gguf(file)?)
    }

    /// Opens `path` and reads its tokenizer (see [`Tokenizer::from_gguf`]).
    pub fn from_gguf_path(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// A Hugging Face `tokenizer.json`. BOS and EOS come from `tokenizer_config.json` beside
    /// it when present, else from DeepSeek's BOS/EOS strings if the vocabulary has them.
    pub fn from_json_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let read = |p: &Path| std::fs::read_to_string(p).map_err(|source| Error::Io { path: p.to_path_buf(), source });
        let text = read(path)?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config = if config_path.is_file() { Some(read(&config_path)?) } else { None };
        Self::from_json_str(&text, config.as_deref())
    }

    /// A `tokenizer.json` (and optionally `tokenizer_config.json`) given as text.
    pub fn from_json_str(tokenizer_json: &str, tokenizer_config: Option<&str>) -> Result<Self> {
        Self::build(json::parts_from_json(tokenizer_json, tokenizer_config)?)
    }

    fn build(p: Parts) -> Result<Self> {
        let n = p.tokens.len();
        if u32::try_from(n).is_err() {
            return Err(Error::model(format!("{}: too many tokens ({n})", p.merges_key)));
        }
        let mut ids: FxMap<String, u32> = FxMap::default();
        for (i, t) in p.tokens.iter().enumerate() {
            if let Some(t) = t {
                ids.entry(t.clone()).or_insert(i as u32);
            }
        }
        let bpe = {
            let vocab: FxMap<&str, u32> = ids.iter().map(|(k, &v)| (k.as_str(), v)).collect();
            Bpe::new(&vocab, p.merges.iter().map(|(a, b)| (a.as_str(), b.as_str())))
                .map_err(|(_, msg)| Error::model(format!("{}: {msg}", p.merges_key)))?
        };
        let mut special = vec![false; n];
        for a in &p.added {
            special[a.id as usize] = a.special;
            // an added token's string names it, whatever the vocabulary says
            ids.insert(a.content.clone(), a.id);
        }
        let first_pass = Matcher::new(p.added.iter().filter(|a| !a.normalized));
        let second_pass = Matcher::new(p.added.iter().filter(|a| a.normalized));
        let bytes = p
            .tokens
            .iter()
            .map(|t| t.as_deref().map(bpe::token_bytes).unwrap_or_default().into_boxed_slice())
            .collect();
        let whole_words = p.ignore_merges.then(|| {
            let added: std::collections::HashSet<u32> = p.added.iter().map(|a| a.id).collect();
            p.tokens
                .iter()
                .enumerate()
                .filter(|(i, _)| !added.contains(&(*i as u32)))
                .filter_map(|(i, t)| {
                    let t = t.as_deref()?;
                    let b: Option<Vec<u8>> = t.chars().map(bpe::char_to_byte).collect();
                    Some((b?.into_boxed_slice(), i as u32))
                })
                .collect()
        });
        Ok(Tokenizer {
            tokens: p.tokens,
            bytes,
            ids,
            bpe,
            pre: p.pre,
            added: p.added,
            first_pass,
            second_pass,
            special,
            bos: p.bos,
            eos: p.eos,
            whole_words,
        })
    }

    /// Number of token ids (the largest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// The added tokens, in file order.
    pub fn added_tokens(&self) -> &[AddedToken] {
        &self.added
    }

    /// The id of a token given in its stored (byte-level) form, e.g. `"Ġhello"`, `"<｜User｜>"`.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.ids.get(token).copied()
    }

    /// The stored (byte-level) form of token `id`.
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize)?.as_deref()
    }

    /// Whether `id` is a special added token (matched only with `allow_special`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The pieces the pre-tokenizer cuts `text` into (added tokens are not looked for).
    pub fn pre_tokenize<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut v = Vec::new();
        self.pre.split(text, &mut |p| v.push(p));
        v
    }

    /// The token ids of `text` (see the module documentation for `allow_special`).
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut st = EncodeState::default();
        let skip = |id: u32| !allow_special && self.special[id as usize];
        self.first_pass.split(text, &skip, &mut |seg| match seg {
            Segment::Token(id) => out.push(id),
            Segment::Text(t) => self.second_pass.split(t, &skip, &mut |seg| match seg {
                Segment::Token(id) => out.push(id),
                Segment::Text(t) => self.pre.split(t, &mut |piece| self.encode_piece(piece, &mut out, &mut st)),
            }),
        });
        out
    }

    fn encode_piece<'a>(&self, piece: &'a str, out: &mut Vec<u32>, st: &mut EncodeState<'a>) {
        let b = piece.as_bytes();
        if let Some(w) = &self.whole_words {
            if let Some(&id) = w.get(b) {
                out.push(id);
                return;
            }
        }
        if b.len() > CACHE_MAX_BYTES {
            self.bpe.encode_word(b, out, &mut st.scratch);
            return;
        }
        if let Some(&(start, len)) = st.cache.get(b) {
            out.extend_from_slice(&st.arena[start as usize..(start + len) as usize]);
            return;
        }
        let start = out.len();
        self.bpe.encode_word(b, out, &mut st.scratch);
        let toks = &out[start..];
        st.cache.insert(b, (st.arena.len() as u32, toks.len() as u32));
        st.arena.extend_from_slice(toks);
    }

    /// The bytes of a token sequence. Errors on an id outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(ids.len() * 4);
        self.append_bytes(ids, &mut out)?;
        Ok(out)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| self.id_to_token(id).is_none()) {
            Some(id) => Err(Error::invalid(format!("token id {id} is not in the vocabulary of {}", self.vocab_size()))),
            None => Ok(()),
        }
    }

    fn append_bytes(&self, ids: &[u32], out: &mut Vec<u8>) -> Result<()> {
        self.check_ids(ids)?;
        for &id in ids {
            out.extend_from_slice(&self.bytes[id as usize]);
        }
        Ok(())
    }

    /// The text of a token sequence; invalid UTF-8 becomes U+FFFD (one per maximal invalid
    /// sequence, as `String::from_utf8_lossy`). Errors on an id outside the vocabulary.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let b = self.decode_bytes(ids)?;
        Ok(match String::from_utf8(b) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

/// Pieces longer than this are not cached during one `encode`.
const CACHE_MAX_BYTES: usize = 64;

#[derive(Default)]
struct EncodeState<'a> {
    scratch: Scratch,
    /// piece -> (start, len) in `arena`.
    cache: FxMap<&'a [u8], (u32, u32)>,
    arena: Vec<u32>,
}

enum Segment<'a> {
    Text(&'a str),
    Token(u32),
}

/// Leftmost-longest matching of a set of strings (a byte trie).
#[derive(Debug, Default)]
struct Matcher {
    /// children of node i: (byte, node), sorted by byte.
    edges: Vec<Vec<(u8, u32)>>,
    token: Vec<u32>,
    first: Box<[bool]>,
}

impl Matcher {
    fn new<'a>(tokens: impl Iterator<Item = &'a AddedToken>) -> Self {
        let mut m =
            Matcher { edges: vec![Vec::new()], token: vec![NO_TOKEN], first: vec![false; 256].into_boxed_slice() };
        for t in tokens {
            let Some(&b0) = t.content.as_bytes().first() else { continue };
            m.first[b0 as usize] = true;
            let mut node = 0usize;
            for &b in t.content.as_bytes() {
                node = match m.edges[node].binary_search_by_key(&b, |e| e.0) {
                    Ok(k) => m.edges[node][k].1 as usize,
                    Err(k) => {
                        let new = m.edges.len();
                        m.edges[node].insert(k, (b, new as u32));
                        m.edges.push(Vec::new());
                        m.token.push(NO_TOKEN);
                        new
                    }
                };
            }
            // a later duplicate of the same string wins, as in a map
            m.token[node] = t.id;
        }
        m
    }

    fn is_empty(&self) -> bool {
        self.edges[0].is_empty()
    }

    /// The longest token starting at `s[0]`: (length, id).
    fn longest(&self, s: &[u8]) -> Option<(usize, u32)> {
        let mut node = 0usize;
        let mut best = None;
        for (i, &b) in s.iter().enumerate() {
            match self.edges[node].binary_search_by_key(&b, |e| e.0) {
                Ok(k) => node = self.edges[node][k].1 as usize,
                Err(_) => break,
            }
            if self.token[node] != NO_TOKEN {
                best = Some((i + 1, self.token[node]));
            }
        }
        best
    }

    /// Cuts `text` at the non-overlapping leftmost-longest matches. A match whose id `skip`
    /// rejects stays text, and the search resumes after it (as `tokenizers` does).
    fn split<'a>(&self, text: &'a str, skip: &impl Fn(u32) -> bool, f: &mut impl FnMut(Segment<'a>)) {
        if self.is_empty() {
            if !text.is_empty() {
                f(Segment::Text(text));
            }
            return;
        }
        let b = text.as_bytes();
        let mut i = 0;
        let mut last = 0;
        while i < b.len() {
            if !self.first[b[i] as usize] {
                i += 1;
                continue;
            }
            match self.longest(&b[i..]) {
                Some((len, id)) if skip(id) => i += len,
                Some((len, id)) => {
                    // tokens are valid UTF-8 and text is, so i and i + len are char boundaries
                    if last < i {
                        f(Segment::Text(&text[last..i]));
                    }
                    f(Segment::Token(id));
                    i += len;
                    last = i;
                }
                None => i += 1,
            }
        }
        if last < b.len() {
            f(Segment::Text(&text[last..]));
        }
    }
}

const NO_TOKEN: u32 = u32::MAX;

/// Decodes tokens one batch at a time, emitting only complete UTF-8 characters: the bytes of a
/// character split across tokens are held until it is complete. Bytes that can never become
/// valid UTF-8 are emitted as U+FFFD at once. The concatenation of every `feed` and the final
/// `flush` equals [`Tokenizer::decode`] of all the ids.
#[derive(Debug)]
pub struct StreamDecoder {
    tokenizer: Arc<Tokenizer>,
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        StreamDecoder { tokenizer, pending: Vec::new() }
    }

    /// The text completed by `ids`. Errors (and consumes nothing) on an id outside the
    /// vocabulary.
    pub fn feed(&mut self, ids: &[u32]) -> Result<String> {
        self.tokenizer.append_bytes(ids, &mut self.pending)?;
        Ok(self.drain(false))
    }

    /// The bytes still held (an incomplete character) as U+FFFD, or "" when none are held.
    pub fn flush(&mut self) -> String {
        self.drain(true)
    }

    /// The bytes held back, waiting for the rest of their character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    fn drain(&mut self, end: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, tail) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("valid prefix"));
                    match e.error_len() {
                        Some(k) => {
                            out.push('\u{FFFD}');
                            rest = &tail[k..];
                        }
                        None if end => {
                            out.push('\u{FFFD}');
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = tail;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let n = self.pending.len();
        self.pending.drain(..n - keep);
        out
    }
}

fn gguf_err(key: &str, msg: impl std::fmt::Display) -> Error {
    Error::model(format!("{key}: {msg}"))
}

fn gguf_strings<'a>(file: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let v = file.get(key).ok_or_else(|| gguf_err(key, "missing"))?;
    let items = v.as_array().ok_or_else(|| gguf_err(key, "not an array"))?;
    items
        .iter()
        .enumerate()
        .map(|(i, x)| x.as_str().ok_or_else(|| gguf_err(key, format!("element {i} is not a string"))))
        .collect()
}

fn gguf_token_id(file: &GgufFile, key: &str, n: usize) -> Result<Option<u32>> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) if (id as usize) < n => Ok(Some(id as u32)),
            Some(id) => Err(gguf_err(key, format!("token id {id} is outside the vocabulary of {n}"))),
            None => Err(gguf_err(key, "not an integer")),
        },
    }
}

fn parts_from_gguf(file: &GgufFile) -> Result<Parts> {
    const MODEL: &str = "tokenizer.ggml.model";
    const PRE: &str = "tokenizer.ggml.pre";
    const TOKENS: &str = "tokenizer.ggml.tokens";
    const TYPES: &str = "tokenizer.ggml.token_type";
    const MERGES: &str = "tokenizer.ggml.merges";
    match file.get(MODEL).map(|v| v.as_str()) {
        None => return Err(gguf_err(MODEL, "missing: the file has no tokenizer")),
        Some(Some("gpt2")) => {}
        Some(Some(m)) => {
            return Err(gguf_err(MODEL, format!("{m:?} is not supported (only \"gpt2\", byte-level BPE)")))
        }
        Some(None) => return Err(gguf_err(MODEL, "not a string")),
    }
    let pre = match file.get(PRE).map(|v| v.as_str()) {
        None => return Err(gguf_err(PRE, "missing")),
        Some(Some(name)) => PreTokenizer::from_gguf_name(name).ok_or_else(|| {
            gguf_err(PRE, format!("{name:?} is not supported (only \"joyai-llm\", \"deepseek-v3\" and \"gpt-2\")"))
        })?,
        Some(None) => return Err(gguf_err(PRE, "not a string")),
    };
    let tokens = gguf_strings(file, TOKENS)?;
    let n = tokens.len();
    let types: Vec<i64> = match file.get(TYPES) {
        None => vec![token_type::NORMAL; n],
        Some(v) => {
            let items = v.as_array().ok_or_else(|| gguf_err(TYPES, "not an array"))?;
            if items.len() != n {
                return Err(gguf_err(TYPES, format!("{} entries for {n} tokens", items.len())));
            }
            items
                .iter()
                .enumerate()
                .map(|(i, x)| x.as_i64().ok_or_else(|| gguf_err(TYPES, format!("element {i} is not an integer"))))
                .collect::<Result<_>>()?
        }
    };
    let merges = gguf_strings(file, MERGES)?
        .iter()
        .enumerate()
        .map(|(i, m)| match m.split_once(' ') {
            Some((a, b)) if !a.is_empty() && !b.is_empty() && !b.contains(' ') => Ok((a.to_string(), b.to_string())),
            _ => Err(gguf_err(MERGES, format!("element {i} ({m:?}) is not two tokens separated by a space"))),
        })
        .collect::<Result<Vec<_>>>()?;
    let added = tokens
        .iter()
        .zip(&types)
        .enumerate()
        .filter(|(_, (_, &t))| t == token_type::CONTROL || t == token_type::USER_DEFINED)
        .map(|(i, (s, &t))| AddedToken {
            id: i as u32,
            content: s.to_string(),
            special: t == token_type::CONTROL,
            normalized: t == token_type::USER_DEFINED,
        })
        .collect();
    let tokens: Vec<Option<String>> = tokens.iter().map(|s| Some(s.to_string())).collect();
    let by_text = |s: &str| tokens.iter().position(|t| t.as_deref() == Some(s)).map(|i| i as u32);
    let bos = gguf_token_id(file, "tokenizer.ggml.bos_token_id", n)?.or_else(|| by_text(BOS_TEXT));
    let eos = gguf_token_id(file, "tokenizer.ggml.eos_token_id", n)?.or_else(|| by_text(EOS_TEXT));
    Ok(Parts { tokens, merges, added, pre, bos, eos, ignore_merges: false, merges_key: MERGES.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny vocabulary: the 256 byte chars, a few merges, two added tokens.
    pub(super) fn toy() -> Tokenizer {
        let bl = bpe::byte_to_char();
        let mut tokens: Vec<Option<String>> = (0..256).map(|b| Some(bl[b].to_string())).collect();
        let merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w")];
        for (a, b) in merges {
            tokens.push(Some(format!("{a}{b}")));
        }
        tokens.push(Some("<s>".into()));
        tokens.push(Some("<｜User｜>".into()));
        let n = tokens.len() as u32;
        let parts = Parts {
            tokens,
            merges: merges.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
            added: vec![
                AddedToken { id: n - 2, content: "<s>".into(), special: true, normalized: false },
                AddedToken { id: n - 1, content: "<｜User｜>".into(), special: false, normalized: true },
            ],
            pre: PreTokenizer::Gpt2,
            bos: Some(n - 2),
            eos: None,
            ignore_merges: false,
            merges_key: "test".into(),
        };
        Tokenizer::build(parts).unwrap()
    }

    #[test]
    fn encode_decode() {
        let t = toy();
        let hello = t.token_to_id("hello").unwrap();
        let ids = t.encode("hello world", false);
        assert_eq!(ids[0], hello);
        assert_eq!(t.decode(&ids).unwrap(), "hello world");
        let user = t.token_to_id("<｜User｜>").unwrap();
        let bos = t.bos_id().unwrap();
        // role token always atomic, BOS only with allow_special
        assert_eq!(t.encode("<｜User｜>", false), [user]);
        assert_eq!(t.encode("<s>hello", true), [bos, hello]);
        assert_eq!(t.encode("<s>", false), [b'<' as u32, b's' as u32, b'>' as u32]);
        assert_eq!(t.decode(&[bos, user]).unwrap(), "<s><｜User｜>");
        assert!(t.decode(&[t.vocab_size() as u32]).is_err());
    }

    /// The golden toy tokenizer, as llama.cpp wrote it into a GGUF and as tokenizer.json.
    #[test]
    fn golden_toy_gguf_and_json_agree() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-l");
        let a = Tokenizer::from_gguf_path(dir.join("llamacpp-f32.gguf")).unwrap();
        let b = Tokenizer::from_json_path(dir.join("tokenizer.json")).unwrap();
        assert_eq!((a.pre_tokenizer(), a.bos_id(), a.eos_id()), (PreTokenizer::Gpt2, Some(0), Some(1)));
        assert_eq!((b.pre_tokenizer(), b.bos_id(), b.eos_id()), (PreTokenizer::Gpt2, Some(0), Some(1)));
        let text = "<｜begin▁of▁sentence｜>Hello world, it's 2024!\n\n  fn main() { x >= 10; }\r\n中文 🙂<｜User｜>";
        for allow_special in [false, true] {
            let ids = a.encode(text, allow_special);
            assert_eq!(ids, b.encode(text, allow_special));
            assert_eq!(a.decode(&ids).unwrap(), text);
            assert_eq!(ids.first() == Some(&0), allow_special);
        }
    }

    #[test]
    fn stream_decoder_holds_partial_chars() {
        let t = Arc::new(toy());
        let ids = t.encode("é€🙂", false); // one token per byte here
        assert_eq!(ids.len(), 2 + 3 + 4);
        let mut d = StreamDecoder::new(t.clone());
        let mut out = String::new();
        for (k, id) in ids.iter().enumerate() {
            let s = d.feed(&[*id]).unwrap();
            if [1, 4, 8].contains(&k) {
                assert_eq!(s.chars().count(), 1);
            } else {
                assert_eq!(s, "");
            }
            out += &s;
        }
        assert_eq!(out + &d.flush(), "é€🙂");
        // an invalid byte is emitted at once; an incomplete char at the end on flush
        let xff = t.token_to_id(&bpe::byte_to_char()[0xFF].to_string()).unwrap();
        let xe2 = t.token_to_id(&bpe::byte_to_char()[0xE2].to_string()).unwrap();
        assert_eq!(d.feed(&[xff, xe2]).unwrap(), "\u{FFFD}");
        assert_eq!(d.pending(), [0xE2]);
        assert_eq!(d.flush(), "\u{FFFD}");
        assert_eq!(t.decode(&[xff, xe2]).unwrap(), "\u{FFFD}\u{FFFD}");
    }

    /// A tokenizer.json whose ids run far past its tokens' count is refused before its table
    /// is made (an id of 4294967294 would ask for about 100 GB); ids a little past it are fine.
    #[test]
    fn sparse_ids_far_past_the_count_are_refused() {
        let json = |id: u64| {
            format!(
                r#"{{"model":{{"type":"BPE","vocab":{{"a":0,"b":{id}}},"merges":[]}},"pre_tokenizer":{{"type":"ByteLevel"}}}}"#
            )
        };
        let e = Tokenizer::from_json_str(&json(4_294_967_294), None).unwrap_err();
        assert!(matches!(e, Error::UnsupportedModel(_)) && e.to_string().contains("ids up to"), "{e}");
        assert!(Tokenizer::from_json_str(&json(1_000), None).is_ok());
    }
}
