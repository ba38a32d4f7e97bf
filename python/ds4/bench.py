"""``ds4 bench``: prefill and decode speed of a model on this machine.

Prefill is timed as one evaluation of a ``prompt``-token prompt. Decode is timed token by
token after a prefill, feeding back the argmax; each figure is the median over ``runs``
runs (after one warm-up run). Decode bandwidth counts the weight bytes one token reads (every
non-expert matrix, the active experts, the head; ``Model.decode_weight_bytes``).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .model import Model
from .speculative import SpecStats, Speculative

__all__ = ["BenchResult", "bench"]


@dataclass(frozen=True)
class BenchResult:
    model: str
    prompt_tokens: int
    decode_tokens: int
    runs: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_weight_bytes: int
    decode_gb_s: float
    threads: int
    #: Where the matrix products ran ("cpu" or "cuda").
    backend: str = "cpu"
    #: Where the rest of the forward pass ran: "device" (the whole pass on the GPU) or "host".
    forward: str = "host"
    #: With ``speculative``: decode tokens/s of greedy generation with speculation, and its stats.
    spec_tok_s: float | None = None
    spec_stats: SpecStats | None = None
    #: With ``speculative``: plain greedy generation timed like the speculative one.
    plain_generate_tok_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"{self.model}\n"
            f"  prefill  {self.prompt_tokens:5d} tokens  {self.prefill_tok_s:10.1f} tok/s\n"
            f"  decode   {self.decode_tokens:5d} tokens  {self.decode_tok_s:10.2f} tok/s  "
            f"{self.decode_weight_bytes / 1e6:,.1f} MB of weights/token  {self.decode_gb_s:6.2f} GB/s\n"
            f"  (median of {self.runs} runs, {self.threads} threads, backend {self.backend}, "
            f"{self.forward} forward pass)"
        ) + ("" if self.spec_stats is None or self.spec_tok_s is None else (
            f"\n  generate: speculative {self.spec_tok_s:.2f} tok/s, plain {self.plain_generate_tok_s or 0:.2f} tok/s "
            f"(x{self.spec_tok_s / (self.plain_generate_tok_s or self.decode_tok_s):.2f}); "
            f"acceptance {self.spec_stats.acceptance_rate:.1%}, {self.spec_stats.mean_accepted_length:.2f} tokens/cycle, "
            f"{self.spec_stats.num_drafts} cycles, {self.spec_stats.num_plain_steps} plain steps"))


def bench(path: str | os.PathLike[str], *, prompt: int = 128, decode: int = 32, runs: int = 3,
          seed: int = 0, speculative: Speculative | None = None, repetitive: bool = False,
          draft: str | os.PathLike[str] | None = None, backend: str = "cpu") -> BenchResult:
    """Measures prefill and decode tokens/s of the model at ``path``; with ``speculative``,
    also greedy decode with speculation (same prompt and length). ``repetitive`` uses a
    prompt that repeats a 16-token motif (where n-gram drafting has something to find).
    ``draft`` is a drafter support file (for ``Speculative("mtp" | "dspark")``); ``backend``
    as in :meth:`ds4.Model.load`."""
    if prompt < 1 or decode < 1 or runs < 1:
        raise ValueError("prompt, decode and runs must be at least 1")
    model = Model.load(path, draft=draft, backend=backend)  # type: ignore[arg-type]
    vocab = model.vocab_size
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, vocab, size=prompt)]
    if repetitive:
        motif = tokens[:16]
        tokens = (motif * (prompt // 16 + 1))[:prompt]
    ctx = prompt + decode + 1

    prefill: list[float] = []
    decode_times: list[float] = []
    forward = "host"
    for run in range(runs + 1):  # run 0 warms caches and page-ins, and is not counted
        s = model.session(ctx)
        forward = s.forward_kind
        t0 = time.perf_counter()
        logits = s.eval(tokens, logits="last")
        t1 = time.perf_counter()
        tok = int(np.argmax(logits[0]))
        per_token = []
        for _ in range(decode):
            a = time.perf_counter()
            tok = int(np.argmax(s.eval([tok])[0]))
            per_token.append(time.perf_counter() - a)
        if run:
            prefill.append(t1 - t0)
            decode_times.append(statistics.median(per_token))
    spec_rate = spec_stats = plain_rate = None
    if speculative is not None:
        # Speculative and plain generation timed the same way (runs interleaved, so drifts of a
        # shared machine hit both alike); the speedup compares these two.
        rates, plain_rates = [], []
        for run in range(runs + 1):
            g = model.session(ctx).generate(tokens, max_tokens=decode, ignore_eos=True, speculative=speculative)
            p = model.session(ctx).generate(tokens, max_tokens=decode, ignore_eos=True)
            if g.tokens != p.tokens:
                raise AssertionError("speculative greedy output differs from plain decoding")
            if run:
                rates.append(g.decode_tokens_per_second)
                plain_rates.append(p.decode_tokens_per_second)
                spec_stats = g.stats
        spec_rate = statistics.median(rates)
        plain_rate = statistics.median(plain_rates)
    pre_s = statistics.median(prefill)
    dec_s = statistics.median(decode_times)
    nbytes = model.decode_weight_bytes()
    return BenchResult(
        model=os.fspath(path), prompt_tokens=prompt, decode_tokens=decode, runs=runs,
        prefill_tok_s=prompt / pre_s, decode_tok_s=1.0 / dec_s, decode_weight_bytes=nbytes,
        decode_gb_s=nbytes / dec_s / 1e9, threads=os.cpu_count() or 1, backend=model.backend, forward=forward,
        spec_tok_s=spec_rate,
        spec_stats=spec_stats, plain_generate_tok_s=plain_rate,
    )
