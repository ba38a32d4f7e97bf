//! Pre-tokenizers: how text is cut into pieces before byte-level BPE runs on each piece.
//!
//! Two are supported, each written out as a hand-made matcher that reproduces exactly what the
//! Oniguruma regexes of Hugging Face `tokenizers` (and llama.cpp) do, backtracking included:
//!
//! * [`PreTokenizer::DeepSeek`] (`tokenizer.ggml.pre = "joyai-llm"` or `"deepseek-v3"`): three
//!   ordered `Split{behavior: Isolated}` passes, each re-splitting the pieces of the previous one
//!   (so a match never crosses an earlier cut, and `(?!\S)` sees the end of the piece):
//!   1. `\p{N}{1,3}`
//!   2. `[一-龥぀-ゟ゠-ヿ]+`
//!   3. `[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
//!      ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//!
//!   "Isolated" keeps the text between matches as pieces of its own.
//! * [`PreTokenizer::Gpt2`] (`"gpt-2"`, or a `ByteLevel{use_regex: true}` in `tokenizer.json`):
//!   `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//!
//! Character classes are Unicode general categories (and `\s` = the White_Space property) from
//! `regex-syntax`'s tables, Unicode 16.0, the version the Oniguruma inside `tokenizers` 0.23
//! uses; `tests/test_tokenizer.py` checks every code point against it.

use std::sync::OnceLock;

const L: u8 = 1; // \p{L}
const M: u8 = 2; // \p{M}
const N: u8 = 4; // \p{N}
const P: u8 = 8; // \p{P}
const S: u8 = 16; // \p{S}
const W: u8 = 32; // \s (White_Space)

/// Which pre-tokenizer a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// DeepSeek V3/V4 (`"joyai-llm"`, `"deepseek-v3"`): the three-pass split described above.
    DeepSeek,
    /// The GPT-2 regex (`"gpt-2"`).
    Gpt2,
}

impl PreTokenizer {
    /// The pre-tokenizer named by `tokenizer.ggml.pre`, if supported.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "joyai-llm" | "deepseek-v3" => Some(PreTokenizer::DeepSeek),
            "gpt-2" | "gpt2" => Some(PreTokenizer::Gpt2),
            _ => None,
        }
    }

    /// Its `tokenizer.ggml.pre` name.
    pub fn gguf_name(self) -> &'static str {
        match self {
            PreTokenizer::DeepSeek => "joyai-llm",
            PreTokenizer::Gpt2 => "gpt-2",
        }
    }

    /// Calls `f` with each piece of `text`, in order. The pieces are non-empty and concatenate
    /// to `text`.
    pub fn split<'a>(self, text: &'a str, f: &mut impl FnMut(&'a str)) {
        let classes = classes();
        match self {
            PreTokenizer::DeepSeek => split_isolated(text, &mut |p| match_digits(classes, p), &mut |a| {
                split_isolated(a, &mut |p| match_cjk(p), &mut |b| {
                    split_isolated(b, &mut |p| match_deepseek(classes, p), f)
                })
            }),
            PreTokenizer::Gpt2 => split_isolated(text, &mut |p| match_gpt2(classes, p), f),
        }
    }
}

/// The class bits of every code point (1.1 MB, built once).
fn classes() -> &'static [u8] {
    static TABLE: OnceLock<Box<[u8]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0u8; 0x11_0000].into_boxed_slice();
        for (pattern, bit) in
            [(r"\p{L}", L), (r"\p{M}", M), (r"\p{N}", N), (r"\p{P}", P), (r"\p{S}", S), (r"\p{White_Space}", W)]
        {
            for (lo, hi) in unicode_ranges(pattern) {
                for c in lo..=hi {
                    t[c as usize] |= bit;
                }
            }
        }
        t
    })
}

/// The code point ranges of a Unicode class such as `\p{L}`, from regex-syntax's tables.
fn unicode_ranges(pattern: &str) -> Vec<(u32, u32)> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::ParserBuilder::new().build().parse(pattern).expect("valid Unicode class");
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c.ranges().iter().map(|r| (r.start() as u32, r.end() as u32)).collect(),
        other => unreachable!("{pattern} parsed to {other:?}"),
    }
}

/// The class bits of `c` (exposed for tests that compare them with Oniguruma).
pub fn char_class(c: char) -> u8 {
    classes()[c as usize]
}

#[inline]
fn class_of(t: &[u8], c: char) -> u8 {
    // a char is below 0x110000, the table's length: the bounds check never fails
    t[c as usize]
}

#[inline]
fn first(s: &str) -> Option<char> {
    s.chars().next()
}

/// Byte length of the longest prefix of `s` whose chars satisfy `pred`.
#[inline]
fn run(s: &str, mut pred: impl FnMut(char) -> bool) -> usize {
    s.char_indices().find(|&(_, c)| !pred(c)).map_or(s.len(), |(i, _)| i)
}

/// `Split{behavior: Isolated}`: every match is a piece and so is every stretch of text between
/// matches. `m(rest)` is the byte length of the match of the regex anchored at the start of
/// `rest` (the regex tried at that position), or `None`; this yields exactly what a leftmost
/// `find_iter` yields.
fn split_isolated<'a>(s: &'a str, m: &mut impl FnMut(&str) -> Option<usize>, f: &mut impl FnMut(&'a str)) {
    let mut i = 0;
    let mut last = 0;
    while i < s.len() {
        match m(&s[i..]) {
            Some(n) if n > 0 => {
                if last < i {
                    f(&s[last..i]);
                }
                f(&s[i..i + n]);
                i += n;
                last = i;
            }
            _ => i += s[i..].chars().next().map_or(1, char::len_utf8),
        }
    }
    if last < s.len() {
        f(&s[last..]);
    }
}

/// `\p{N}{1,3}`
fn match_digits(t: &[u8], s: &str) -> Option<usize> {
    let mut n = 0;
    let mut len = 0;
    for c in s.chars() {
        if n == 3 || class_of(t, c) & N == 0 {
            break;
        }
        n += 1;
        len += c.len_utf8();
    }
    (n > 0).then_some(len)
}

#[inline]
fn is_cjk(c: char) -> bool {
    matches!(c, '\u{4E00}'..='\u{9FA5}' | '\u{3040}'..='\u{309F}' | '\u{30A0}'..='\u{30FF}')
}

/// `[一-龥぀-ゟ゠-ヿ]+`
fn match_cjk(s: &str) -> Option<usize> {
    let n = run(s, is_cjk);
    (n > 0).then_some(n)
}

#[inline]
fn is_crlf(c: char) -> bool {
    c == '\r' || c == '\n'
}

/// The `\s`-based tail shared by both regexes, at a whitespace char:
/// `\s+(?!\S)|\s+` (GPT-2), preceded by `\s*[\r\n]+` when `newlines` (DeepSeek).
fn match_space(t: &[u8], s: &str, newlines: bool) -> usize {
    // j: end of the whitespace run; last: start of its last char; nl: end of its last CR/LF.
    let mut j = 0;
    let mut last = 0;
    let mut count = 0;
    let mut nl = None;
    for (i, c) in s.char_indices() {
        if class_of(t, c) & W == 0 {
            break;
        }
        last = i;
        j = i + c.len_utf8();
        count += 1;
        if is_crlf(c) {
            nl = Some(j);
        }
    }
    if newlines {
        // `\s*` backtracks from the whole run to the last CR/LF; `[\r\n]+` then takes it.
        if let Some(e) = nl {
            return e;
        }
    }
    if j == s.len() || count == 1 {
        // at the end of the piece `(?!\S)` holds; a single space char followed by \S is `\s+`
        j
    } else {
        // `\s+(?!\S)` backtracks one char so that a whitespace char follows
        last
    }
}

const ASCII_PUNCT: &[u8] = b"!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~";

/// Pass 3 of the DeepSeek pre-tokenizer (see the module documentation).
fn match_deepseek(t: &[u8], s: &str) -> Option<usize> {
    let c = first(s)?;
    let cl = class_of(t, c);
    let rest = &s[c.len_utf8()..];
    let next = first(rest);
    let ncl = next.map_or(0, |n| class_of(t, n));
    // [ASCII punct][A-Za-z]+
    if c.is_ascii() && ASCII_PUNCT.contains(&(c as u8)) && next.is_some_and(|n| n.is_ascii_alphabetic()) {
        return Some(1 + run(rest, |x| x.is_ascii_alphabetic()));
    }
    // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
    let lm = |x: char| class_of(t, x) & (L | M) != 0;
    if !is_crlf(c) && cl & (L | P | S) == 0 && ncl & (L | M) != 0 {
        return Some(c.len_utf8() + run(rest, lm));
    }
    if cl & (L | M) != 0 {
        return Some(run(s, lm));
    }
    //  ?[\p{P}\p{S}]+[\r\n]*
    let ps = |x: char| class_of(t, x) & (P | S) != 0;
    let ps_start = if c == ' ' && ncl & (P | S) != 0 {
        Some(1)
    } else if cl & (P | S) != 0 {
        Some(0)
    } else {
        None
    };
    if let Some(k) = ps_start {
        let e = k + run(&s[k..], ps);
        return Some(e + run(&s[e..], is_crlf));
    }
    // \s*[\r\n]+|\s+(?!\S)|\s+
    if cl & W != 0 {
        return Some(match_space(t, s, true));
    }
    None
}

/// The GPT-2 regex (see the module documentation). Every char starts a match.
fn match_gpt2(t: &[u8], s: &str) -> Option<usize> {
    let c = first(s)?;
    let cl = class_of(t, c);
    let rest = &s[c.len_utf8()..];
    let ncl = first(rest).map_or(0, |n| class_of(t, n));
    // 's|'t|'re|'ve|'m|'ll|'d
    if c == '\'' {
        let b = rest.as_bytes();
        match b {
            [b's' | b't' | b'm' | b'd', ..] => return Some(2),
            [b'r' | b'v', b'e', ..] | [b'l', b'l', ..] => return Some(3),
            _ => {}
        }
    }
    //  ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+, tried in this order
    let has_next = !rest.is_empty();
    let alternatives: [fn(u8) -> bool; 3] = [|x| x & L != 0, |x| x & N != 0, |x| x & (W | L | N) == 0];
    for pred in alternatives {
        let k = if c == ' ' && has_next && pred(ncl) {
            1
        } else if pred(cl) {
            0
        } else {
            continue;
        };
        return Some(k + run(&s[k..], |x| pred(class_of(t, x))));
    }
    if cl & W != 0 {
        return Some(match_space(t, s, false));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(p: PreTokenizer, s: &str) -> Vec<String> {
        let mut v = Vec::new();
        p.split(s, &mut |x| v.push(x.to_string()));
        v
    }

    #[test]
    fn deepseek_examples() {
        // checked against Hugging Face tokenizers on the DeepSeek V4 tokenizer.json
        let d = PreTokenizer::DeepSeek;
        assert_eq!(pieces(d, "a\n \n x"), ["a", "\n \n", " x"]);
        assert_eq!(pieces(d, "x  \t y"), ["x", "  \t", " y"]);
        assert_eq!(pieces(d, "foo();\n\nbar"), ["foo", "();\n\n", "bar"]);
        assert_eq!(pieces(d, " \u{301}a"), [" \u{301}a"]);
        assert_eq!(pieces(d, "\u{200d}\u{200d} a"), ["\u{200d}\u{200d}", " a"]);
        assert_eq!(pieces(d, "12345 ab"), ["123", "45", " ab"]);
        assert_eq!(pieces(d, "  123"), ["  ", "123"]);
        assert_eq!(pieces(d, "你好world"), ["你好", "world"]);
        assert_eq!(pieces(d, "it's"), ["it", "'s"]);
    }

    #[test]
    fn gpt2_examples() {
        let g = PreTokenizer::Gpt2;
        assert_eq!(pieces(g, "Hello world's  end!!\n"), ["Hello", " world", "'s", " ", " end", "!!", "\n"]);
        assert_eq!(pieces(g, "a  b"), ["a", " ", " b"]);
        assert_eq!(pieces(g, " 12 x"), [" 12", " x"]);
    }

    #[test]
    fn pieces_concatenate() {
        let s = "Zoë's 3.14159 — 日本語テキスト🙂\r\n\t  x;\n";
        for p in [PreTokenizer::DeepSeek, PreTokenizer::Gpt2] {
            assert_eq!(pieces(p, s).concat(), s);
        }
    }
}
