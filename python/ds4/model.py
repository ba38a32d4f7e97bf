"""Models and sessions.

>>> model = ds4.Model.load("model.gguf")
>>> session = model.session(ctx=4096)
>>> logits = session.eval([0, 42, 7])      # float32 [3, vocab]; the session advances
>>> snap = session.snapshot()
>>> session.eval([9]); session.restore(snap)  # back, bit for bit
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from . import _ds4

__all__ = ["Model", "Session", "Snapshot"]

Snapshot = _ds4.Snapshot


class Model:
    """A DeepSeek V4 model loaded from a GGUF file (memory-mapped; weights are not copied).

    The configuration comes from the file's ``deepseek4.*`` metadata. A file that is not a
    V4 model, or lacks a tensor, or has one of the wrong shape, raises
    :class:`ds4.UnsupportedModelError` naming it.
    """

    def __init__(self, native: _ds4.Model, path: str) -> None:
        self._native = native
        self.path = path
        self._config: dict[str, Any] | None = None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Model:
        """Opens and validates ``path`` and binds every tensor."""
        p = os.fspath(path)
        return cls(_ds4.Model(p), p)

    @property
    def config(self) -> dict[str, Any]:
        """The model configuration (sizes, layer kinds, routing, ...)."""
        if self._config is None:
            self._config = self._native.config()
        return self._config

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    def decode_weight_bytes(self) -> int:
        """Bytes of weights read to decode one token (active experts only)."""
        return self._native.decode_weight_bytes()

    def session(self, ctx: int = 4096, *, kv: Literal["f32", "f16", "fp8"] = "f32") -> Session:
        """A new session that holds at most ``ctx`` tokens.

        ``kv`` is how the attention state is stored: "f32" (exact, the default), "f16"
        (rounded to half precision) or "fp8" (the official model's FP8 KV rows and FP4
        indexer keys, simulated)."""
        return Session(self._native.session(ctx, kv), self.vocab_size)

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.path!r}, layers={c['num_layers']}, hidden={c['hidden_size']}, "
                f"experts={c['num_experts']}, vocab={c['vocab_size']})")


class Session:
    """One sequence being decoded: its position, tokens and decode state."""

    def __init__(self, native: _ds4.Session, vocab_size: int) -> None:
        self._native = native
        self._vocab = vocab_size

    def eval(self, tokens: Sequence[int] | npt.ArrayLike,
             logits: Literal["all", "last", "none"] = "all") -> npt.NDArray[np.float32]:
        """Evaluates ``tokens`` after what the session holds and returns their logits,
        float32 ``[len(tokens), vocab]`` (``[1, vocab]`` for ``logits="last"``, ``[0, vocab]``
        for ``"none"``). Raises :class:`ds4.ContextOverflowError` if they do not fit and
        ``ValueError`` for a token outside the vocabulary; then nothing changes.
        The GIL is released while computing."""
        ids = [int(t) for t in np.asarray(tokens, dtype=np.int64).reshape(-1)]
        if any(t < 0 for t in ids):
            raise ValueError("token ids must be non-negative")
        out = np.frombuffer(self._native.eval(ids, logits), dtype="<f4")
        return out.reshape(-1, self._vocab)

    @property
    def position(self) -> int:
        """Number of tokens processed."""
        return self._native.position

    @property
    def context(self) -> int:
        """The most tokens this session holds."""
        return self._native.context

    @property
    def tokens(self) -> list[int]:
        """The tokens processed so far."""
        return self._native.tokens

    def state_bytes(self) -> int:
        """Bytes held by the decode state."""
        return self._native.state_bytes()

    def snapshot(self) -> Snapshot:
        """Saves the decode state (cheap: compressed rows are shared, not copied)."""
        return self._native.snapshot()

    def restore(self, snapshot: Snapshot) -> None:
        """Returns to ``snapshot``, bit for bit."""
        self._native.restore(snapshot)

    def reset(self) -> None:
        """Back to an empty context."""
        self._native.reset()

    def __repr__(self) -> str:
        return f"Session(position={self.position}, context={self.context})"
