"""Cost of the model drafters relative to one target decode (CPU, or the model's backend).

    python benches/draft_bench.py PRESET [--dtype q8_0] [--dir /tmp] [--runs 9]

Writes (once, into --dir) a random target of the preset's shape with an MTP block in the file
and a random DSpark support file (3 stages, block 5, Markov rank 256 or 16 for tiny shapes),
then measures, after a 256-token prompt, the lower quartile of --runs timings:

* one target decode step (``session.eval([t])``) without a drafter, and with each drafter
  attached (the difference is the per-token upkeep of the drafter's window rows);
* ``session.propose`` for MTP at depth 1..3 and DSpark at block 2..5 (one full proposal:
  MTP runs one block and one output head per token; DSpark runs its stages over the whole
  block at once whatever k is, then the Markov/confidence heads for k rows).
* one speculative cycle with MTP at depth 1..3 and DSpark at 2, 3, 5 (a greedy generation with a
  fixed draft length: upkeep, proposal without logits, verify of k + 1 rows, commit), its
  milliseconds per verify cycle; on random weights nearly every draft is rejected, so a cycle
  commits one token.

Prints milliseconds and the ratio to the plain decode step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import ds4
from ds4.testing import PRESETS, random_draft, random_model


def median_ms(f: Callable[[], object], runs: int, setup: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(runs + 2):  # two warm-up calls
        setup()
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    # The lower quartile: on a shared machine the median catches other processes' bursts.
    return 1e3 * statistics.quantiles(times[2:], n=4)[0]


def decode_ms(model: ds4.Model, prompt: list[int], runs: int) -> float:
    s = model.session(len(prompt) + 8)
    s.eval(prompt, logits="last")
    snap = s.snapshot()
    return median_ms(lambda: s.eval([5], logits="last"), runs, lambda: s.restore(snap))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("preset", type=str.upper, choices=list(PRESETS))
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    d = Path(args.dir)
    target = d / f"bench-{args.preset.lower()}-{args.dtype}-mtp.gguf"
    dspark = d / f"bench-{args.preset.lower()}-{args.dtype}-dspark.gguf"
    if not target.exists():
        random_model(target, cfg, seed=1, dtype=args.dtype, mtp=True, progress=True)
    if not dspark.exists():
        rank = 16 if cfg.hidden_size < 512 else 256
        random_draft(dspark, cfg, "dspark", seed=2, dtype=args.dtype, markov_rank=rank, progress=True)

    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(8, cfg.vocab_size, args.prompt)]
    b = args.backend
    mtp_model = ds4.Model.load(target, backend=b)  # its MTP block is in the file
    dspark_model = ds4.Model.load(target, draft=dspark, backend=b)
    base = decode_ms(ds4.Model.load(target, draft=False, backend=b), prompt, args.runs)
    print(f"{args.preset} {args.dtype} on {mtp_model.backend}: decode step {base:.2f} ms without a drafter, "
          f"{decode_ms(mtp_model, prompt, args.runs):.2f} with MTP upkeep, "
          f"{decode_ms(dspark_model, prompt, args.runs):.2f} with DSpark upkeep")

    def propose_cost(model: ds4.Model, k: int) -> float:
        s = model.session(len(prompt) + 32)
        s.eval(prompt, logits="last")
        return median_ms(lambda: s.propose(anchor=5, k=k), args.runs)

    print("  drafter           ms     / decode")
    for k in (1, 2, 3):
        ms = propose_cost(mtp_model, k)
        print(f"  MTP depth {k}     {ms:8.2f}   {ms / base:6.3f}")
    for k in (2, 3, 4, 5):
        ms = propose_cost(dspark_model, k)
        print(f"  DSpark block {k}  {ms:8.2f}   {ms / base:6.3f}")

    def cycle_cost(model: ds4.Model, method: str, k: int, tokens: int = 24) -> float:
        s = model.session(len(prompt) + tokens + 32)
        s.eval(prompt, logits="last")
        snap = s.snapshot()
        spec = ds4.Speculative(method, max_draft=k, adaptive=False)
        cycles = []

        def gen() -> None:
            g = s.generate([5], max_tokens=tokens, ignore_eos=True, speculative=spec)
            cycles.append(g.stats.num_drafts + g.stats.num_plain_steps)

        ms = median_ms(gen, max(3, args.runs // 3), lambda: s.restore(snap))
        return ms / statistics.median(cycles)

    for k in (1, 2, 3):
        ms = cycle_cost(mtp_model, "mtp", k)
        print(f"  MTP cycle k={k}  {ms:8.2f}   {ms / base:6.3f}")
    for k in (2, 3, 5):
        ms = cycle_cost(dspark_model, "dspark", k)
        print(f"  DSpark cycle k={k} {ms:7.2f}   {ms / base:6.3f}")


if __name__ == "__main__":
    main()
