"""The DeepSeek V4 tokenizer and chat prompts.

>>> tok = ds4.Tokenizer.from_gguf("model.gguf")          # or .from_json("tokenizer.json")
>>> prompt = ds4.render_chat([{"role": "user", "content": "Hi"}], thinking=False)
>>> ids = tok.encode(prompt, allow_special=True)          # the prompt starts with the BOS text
>>> tok.decode(ids) == prompt
True
>>> d = tok.stream_decoder()
>>> "".join(d.feed([i]) for i in ids) + d.flush() == prompt
True

The tokenizer is byte-level BPE read from ``tokenizer.ggml.*`` metadata (``model = "gpt2"``,
``pre = "joyai-llm"``/``"deepseek-v3"`` or ``"gpt-2"``) or from a Hugging Face
``tokenizer.json``; its ids are those of Hugging Face ``tokenizers`` on the same vocabulary.

**Special tokens.** Added tokens are matched in the text before anything else. Special ones
(GGUF type 3 "control", ``special: true`` in ``tokenizer.json``: BOS, EOS, pad, placeholders)
only with ``allow_special=True``; otherwise their text is encoded as ordinary text, so user
text cannot smuggle in a BOS. The other added tokens (type 4 "user-defined",
``special: false``), among them DeepSeek's ``<｜User｜>``, ``<｜Assistant｜>``, ``<think>`` and
``</think>``, always match as one token. ``encode`` never adds BOS or EOS itself.

**Decoding.** ``decode`` renders invalid UTF-8 (a token sequence cut inside a character) as
U+FFFD; :meth:`Tokenizer.stream_decoder` returns a :class:`StreamDecoder` whose ``feed`` emits
only complete characters, so the concatenation of its outputs and ``flush()`` equals
``decode`` of all the ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from . import _ds4
from ._ds4 import StreamDecoder, Tokenizer

__all__ = ["ROLES", "StreamDecoder", "Tokenizer", "render_chat"]

#: The message roles :func:`render_chat` accepts.
ROLES = ("system", "user", "assistant")


def _text(m: Mapping[str, Any], key: str, i: int) -> str | None:
    v = m.get(key)
    if v is None or isinstance(v, str):
        return v
    raise TypeError(f"messages[{i}][{key!r}] must be a str, not {type(v).__name__}")


def render_chat(messages: Iterable[Mapping[str, Any]], thinking: bool = False,
                add_generation_prompt: bool = True) -> str:
    """The DeepSeek V4 prompt of a conversation, as the official chat template renders it.

    ``messages`` are ``{"role": "system" | "user" | "assistant", "content": str}`` dicts; an
    assistant message may carry ``"reasoning_content"``. ``BOS [system] <｜User｜>text
    <｜Assistant｜>`` then ``<think>`` (``thinking``) or ``</think>``; history assistant turns
    are ``<｜Assistant｜></think>content<｜end▁of▁sentence｜>`` (their reasoning is dropped).
    Encode the result with ``allow_special=True``. An unknown role raises ``ValueError``.
    """
    triples: list[tuple[str, str, str | None]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, not {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        triples.append((str(role), _text(m, "content", i) or "", _text(m, "reasoning_content", i)))
    return _ds4.render_chat(triples, thinking=thinking, add_generation_prompt=add_generation_prompt)
