"""Models and sessions.

>>> model = ds4.Model.load("model.gguf")
>>> session = model.session(ctx=4096)
>>> logits = session.eval([0, 42, 7])      # float32 [3, vocab]; the session advances
>>> snap = session.snapshot()
>>> session.eval([9]); session.restore(snap)  # back, bit for bit
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from . import _ds4
from ._progress import Progress
from .sampling import Sampling
from .speculative import SpecStats, Speculative

__all__ = ["Chunk", "Generation", "Model", "Proposal", "Session", "Snapshot", "Stream", "Verification"]

Snapshot = _ds4.Snapshot


@dataclass(frozen=True)
class Chunk:
    """A piece of a generation: the text it released (possibly empty while a stop string
    might be starting, or a multi-byte character is incomplete) and its token ids."""

    text: str
    tokens: list[int]


@dataclass(frozen=True)
class Generation:
    """A finished generation."""

    text: str
    tokens: list[int]
    #: "eos" (end-of-sequence sampled), "stop" (a stop string appeared; it is not in
    #: ``text``) or "length" (``max_tokens`` reached or the context is full).
    finish_reason: str
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    #: Speculation counters (all zero without speculation).
    stats: SpecStats

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("inf")

    @property
    def decode_tokens_per_second(self) -> float:
        return len(self.tokens) / self.decode_seconds if self.decode_seconds > 0 else float("inf")


class Stream(Iterator[Chunk]):
    """Chunks of a generation as they are produced (the GIL is released while each token is
    computed, and Ctrl+C is honoured between tokens). After the last chunk,
    :attr:`finish_reason` is set and :meth:`generation` summarises the run."""

    def __init__(self, native: _ds4.Stream) -> None:
        self._native = native
        self._text: list[str] = []
        self._tokens: list[int] = []

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        item = next(self._native)
        chunk = Chunk(item[0], list(item[1]))
        self._text.append(chunk.text)
        self._tokens.extend(chunk.tokens)
        return chunk

    @property
    def finish_reason(self) -> str | None:
        """None while running, then "eos", "stop" or "length"."""
        return self._native.finish_reason

    def generation(self) -> Generation:
        """Runs the stream to its end and returns the whole generation."""
        for _ in self:
            pass
        prompt, prefill_s, _, decode_s = self._native.timings
        reason = self.finish_reason
        assert reason is not None
        drafts, draft_tokens, accepted, per_pos, plain = self._native.stats
        stats = SpecStats(drafts, draft_tokens, accepted, list(per_pos), plain)
        return Generation("".join(self._text), list(self._tokens), reason, prompt, prefill_s, decode_s, stats)


@dataclass(frozen=True)
class Proposal:
    """What a model drafter proposes (see :meth:`Session.propose`)."""

    #: Proposed tokens; the first follows the anchor.
    tokens: list[int]
    #: float32 ``[len(tokens), vocab]``: the logits each token was chosen from (after the
    #: Markov bias for DSpark).
    logits: npt.NDArray[np.float32]
    #: DSpark's confidence logit per token (sigmoid: predicted acceptance), else None.
    confidence: npt.NDArray[np.float32] | None = None
    #: DSpark: the logits before the Markov bias.
    base_logits: npt.NDArray[np.float32] | None = None
    #: DSpark: the unnormalized hidden row of each token (the HC head's output).
    hidden: npt.NDArray[np.float32] | None = None


def _token_ids(tokens: Sequence[int] | npt.ArrayLike) -> list[int]:
    """Token ids as a list of ints (any sequence or array of integers, flattened);
    ``ValueError`` for anything else (floats, strings, booleans) and for an id outside
    0..2**32-1, rather than a silent conversion (``3.9`` read as 3)."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return []
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, not {arr.dtype}")
    ids = [int(t) for t in arr.reshape(-1)]
    if any(t < 0 or t > 0xFFFFFFFF for t in ids):
        raise ValueError("token ids must be in 0..2**32-1")
    return ids


class Verification:
    """The rows of a speculative verify (see :meth:`Session.verify`): their logits, or their
    greedy tokens, and :meth:`keep` to cut the session back to a prefix of them."""

    def __init__(self, native: _ds4.Verification, logits: npt.NDArray[np.float32] | None,
                 ids: list[int] | None) -> None:
        self._native = native
        #: float32 ``[rows, vocab]``: every row's logits (row ``i`` predicts the token after
        #: the verified token ``i``); None for a greedy verify whose rows all have a greedy token.
        self.logits = logits
        #: A greedy verify's greedy token after each row (the lowest id of the largest logit,
        #: as greedy decoding takes it); None otherwise, and when some row has none (NaN or
        #: infinite logits: then :attr:`logits` holds every row).
        self.ids = ids

    @property
    def rows(self) -> int:
        """The verified tokens."""
        return self._native.rows

    def keep(self, n: int) -> None:
        """Keeps the first ``n`` verified tokens: the session is then bit for bit as if only
        those had been evaluated (without it, it keeps all of them). Once per verify, and
        only before the session changes again (another evaluation, verify, restore or reset):
        otherwise ``ValueError``, and nothing changes."""
        if n < 0:
            raise ValueError("keep takes a non-negative row count")
        self._native.keep(n)


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
        self.tokenizer: _ds4.Tokenizer | None = native.tokenizer()
        """The tokenizer stored in the model file (None if it has none)."""

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, draft: str | os.PathLike[str] | Literal[False] | None = None,
             mtp_pairing: Literal["deepseek", "ds4"] = "deepseek",
             backend: Literal["cpu", "cuda", "auto"] = "cpu", progress: bool = True) -> Model:
        """Opens and validates ``path`` and binds every tensor.

        ``draft`` is a drafter support file: MTP (``mtp.0.*``) or DSpark (``dspark.*`` metadata,
        ``mtp.S.*`` tensors), as written by :func:`ds4.convert_draft` or ds4. Without it, an MTP
        block stored in the model file itself (ds4's ``mtp.0.*`` or llama.cpp's
        ``blk.N.nextn.*``) is used; ``draft=False`` loads no drafter (sessions then skip the
        drafter's per-token upkeep). A drafter that does not fit the model raises
        :class:`ds4.DraftMismatchError` naming what differs. ``mtp_pairing`` picks which
        trunk state the MTP block pairs with a token: "deepseek" (``h_t`` with ``x_{t+1}``, as
        trained) or "ds4" (``h_t`` with ``x_t``, upstream ds4's).

        ``backend`` computes the matrix products: "cpu" (the reference), "cuda" (the first
        GPU: the weights are copied to its memory once, with a progress bar on a terminal when
        ``progress``; :class:`ds4.BackendUnavailable` if no GPU or driver is usable) or "auto"
        (CUDA when usable, else the CPU)."""
        p = os.fspath(path)
        d = None if draft is None or draft is False else os.fspath(draft)
        if backend not in ("cpu", "cuda", "auto"):
            raise ValueError(f"backend must be 'cpu', 'cuda' or 'auto', got {backend!r}")
        bar: list[Progress] = []

        def report(done: int, total: int) -> None:
            if not bar or bar[-1].done > done:  # a new file's copy
                if bar:
                    bar[-1].close()
                bar.append(Progress(total, f"ds4 copying weights to the GPU ({os.path.basename(p)})",
                                    enabled=progress))
            bar[-1].update(done - bar[-1].done)

        try:
            native = _ds4.Model(p, d, mtp_pairing, draft is not False, backend, report)
        finally:
            if bar:
                bar[-1].close()
        return cls(native, p)

    @property
    def backend(self) -> str:
        """The backend computing the matrix products: "cpu" or "cuda"."""
        return self._native.backend

    @property
    def draft_method(self) -> str | None:
        """The drafter this model carries: "mtp", "dspark" or None."""
        return self._native.draft_method

    @property
    def draft_config(self) -> dict[str, Any] | None:
        """The drafter's settings (method, layout or block size, Markov rank, ...) or None."""
        return self._native.draft_config()

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
        if ctx < 1:
            # (The engine says so for 0; a negative size would not even convert.)
            raise ValueError(f"the context size must be at least 1, got {ctx}")
        return Session(self._native.session(ctx, kv), self.vocab_size, self.tokenizer,
                       self.config.get("eos_id"))

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({self.path!r}, layers={c['num_layers']}, hidden={c['hidden_size']}, "
                f"experts={c['num_experts']}, vocab={c['vocab_size']})")


class Session:
    """One sequence being decoded: its position, tokens and decode state."""

    def __init__(self, native: _ds4.Session, vocab_size: int, tokenizer: _ds4.Tokenizer | None = None,
                 eos_id: int | None = None) -> None:
        self._native = native
        self._vocab = vocab_size
        self._tokenizer = tokenizer
        self._eos = {t for t in (eos_id, tokenizer.eos_id if tokenizer else None) if t is not None}

    def eval(self, tokens: Sequence[int] | npt.ArrayLike,
             logits: Literal["all", "last", "none"] = "all") -> npt.NDArray[np.float32]:
        """Evaluates ``tokens`` after what the session holds and returns their logits,
        float32 ``[len(tokens), vocab]`` (``[1, vocab]`` for ``logits="last"``, ``[0, vocab]``
        for ``"none"``). Raises :class:`ds4.ContextOverflowError` if they do not fit and
        ``ValueError`` for a token outside the vocabulary; then nothing changes.
        The GIL is released while computing."""
        out = np.frombuffer(self._native.eval(_token_ids(tokens), logits), dtype="<f4")
        return out.reshape(-1, self._vocab)

    def verify(self, tokens: Sequence[int] | npt.ArrayLike, *, greedy: bool = False) -> Verification:
        """Evaluates 1 to :attr:`max_verify` ``tokens`` (17; 16 on the GPU) as a speculative
        verify: every row is bitwise the row a plain decode computes, keeping what is needed to
        cut the session back to any prefix of them with :meth:`Verification.keep`. With
        ``greedy``, each row's greedy token comes back instead of its logits (on the GPU, one id
        a row is downloaded): a temperature-0 verify. The building block of a speculative loop:
        verify the anchor and the draft, keep the tokens up to the first the target disagrees
        with. Raises as :meth:`eval` does, and ``ValueError`` for more than :attr:`max_verify`
        tokens; then nothing changes. The GIL is released while computing."""
        native, logits, greedy_ids = self._native.verify(_token_ids(tokens), greedy)
        rows = None if logits is None else np.frombuffer(logits, dtype="<f4").reshape(-1, self._vocab)
        return Verification(native, rows, greedy_ids)

    @property
    def position(self) -> int:
        """Number of tokens processed."""
        return self._native.position

    @property
    def forward_kind(self) -> Literal["device", "host"]:
        """Where the forward pass runs: ``"device"`` (CUDA backend: the whole pass on the GPU,
        the attention state mirrored in device memory; ``DS4_DEVICE_DECODE=0`` turns it off)
        or ``"host"`` (the CPU, with the matrix products on the model's backend)."""
        return "device" if self._native.forward_kind == "device" else "host"

    @property
    def max_verify(self) -> int:
        """The most tokens one :meth:`verify` takes: 17 on the host, 16 on the GPU (one device
        step, so that every row is bitwise a single decode's; a generation drafts at most 15
        there)."""
        return self._native.max_verify

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
        """Returns to ``snapshot``, bit for bit. ``ValueError`` (and nothing changes) for a
        snapshot of another model (one of another config, or with a drafter, loaded apart), of
        another state precision (``kv``), or at a position past this session's context."""
        self._native.restore(snapshot)

    def reset(self) -> None:
        """Back to an empty context."""
        self._native.reset()

    def propose(self, *, anchor: int | None = None, k: int | None = None) -> Proposal:
        """What the model's drafter would propose from the committed state; nothing changes.

        ``anchor`` is the token that follows the committed prefix (default: the target's
        greedy next token, from the logits of the last :meth:`eval`). ``k`` bounds the tokens
        (default: DSpark's block size, one MTP step; at most 16)."""
        if anchor is not None and anchor < 0:
            raise ValueError("anchor must be a token id")
        if k is not None and k < 0:
            raise ValueError("k must be non-negative")
        tokens, logits, conf, base, hidden = self._native.propose(anchor, k)
        n = len(tokens)

        def rows(b: bytearray | None, width: int) -> npt.NDArray[np.float32] | None:
            return None if b is None else np.frombuffer(b, dtype="<f4").reshape(n, width)

        hid = None if hidden is None else np.frombuffer(hidden, dtype="<f4").reshape(n, -1)
        return Proposal(tokens, np.frombuffer(logits, dtype="<f4").reshape(n, self._vocab),
                        None if conf is None else np.asarray(conf, dtype=np.float32),
                        rows(base, self._vocab), hid)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise ValueError("this model file has no tokenizer: pass token ids")
            ids = self._tokenizer.encode(prompt, allow_special=True)
            bos = self._tokenizer.bos_id
            # A fresh context starts with BOS, as the model was trained.
            if self.position == 0 and bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            return ids
        return _token_ids(prompt)

    def stream(self, prompt: str | Sequence[int], *, max_tokens: int = 256, sampling: Sampling | None = None,
               stop: str | Sequence[str] = (), ignore_eos: bool = False,
               speculative: Speculative | None = None) -> Stream:
        """Evaluates ``prompt`` after what the session holds, then yields :class:`Chunk` s as
        tokens are sampled.

        ``prompt`` is text (encoded with special tokens allowed; BOS is added at the start
        of a fresh context) or token ids. ``sampling`` defaults to greedy decoding. The
        session owns the random stream: it is seeded from ``sampling.seed`` the first time
        that seed is used and continues, never reseeded, while later calls use the same
        seed; :meth:`snapshot` / :meth:`restore` save and rewind it. Generation stops at an
        end-of-sequence token, at any of the ``stop`` strings (matched across token
        boundaries and left out of the text), after ``max_tokens`` tokens, or when the
        context is full; ``ignore_eos`` generates through end-of-sequence tokens. The token
        that ends it is not evaluated, so the session holds the prompt and every generated
        token but the last. ``speculative`` drafts tokens and verifies them in batches; the
        output is the same (token for token at temperature 0, in distribution above). A stream
        that fails (a backend error) puts the session back as it was before that step and
        cannot go on; one whose session changed between chunks (an eval, verify, restore or
        reset) refuses to go on."""
        if not 1 <= max_tokens < 2**63:
            raise ValueError(f"max_tokens must be in [1, 2**63), got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop)
        s = Sampling.greedy() if sampling is None else sampling
        assert s.seed is not None
        native = self._native.start(self._prompt_ids(prompt), max_tokens, float(s.temperature), int(s.top_k),
                                    float(s.top_p), float(s.min_p), int(s.seed), stops, [] if ignore_eos else sorted(self._eos),
                                    None if speculative is None else speculative._native())
        return Stream(native)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 256, sampling: Sampling | None = None,
                 stop: str | Sequence[str] = (), ignore_eos: bool = False,
                 speculative: Speculative | None = None) -> Generation:
        """Like :meth:`stream`, run to the end: the text, tokens, finish reason, timings and
        speculation stats."""
        return self.stream(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop, ignore_eos=ignore_eos,
                           speculative=speculative).generation()

    def digest(self) -> int:
        """A digest of the whole decode state and random stream: equal digests mean the
        states are equal bit for bit (used to check that speculation leaves exactly the
        state plain decoding would)."""
        return self._native.digest()

    def __repr__(self) -> str:
        return f"Session(position={self.position}, context={self.context})"
