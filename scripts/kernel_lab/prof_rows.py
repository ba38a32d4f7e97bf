"""Per-kernel tables of steps of given row counts after a prompt (``DS4_DECODE_PROFILE=1``).

    DS4_DECODE_PROFILE=1 python scripts/kernel_lab/prof_rows.py MODEL.gguf 1,8 [--ctx 2100]

Loads MODEL on CUDA, evaluates a prompt of --ctx random tokens, then runs 32 steps of each row
count (random tokens, each step from the prompt's snapshot, as a verify of that many rows
would): the decoder prints the table of a row count on stderr every 32 of its steps (launches
and microseconds a step per kernel, each launch timed alone with events, so the sum is above
an untimed step's wall time).
"""

from __future__ import annotations

import argparse

import numpy as np

import ds4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("rows", type=lambda v: [int(r) for r in v.split(",") if r])
    ap.add_argument("--ctx", type=int, default=2100)
    args = ap.parse_args()
    m = ds4.Model.load(args.model, backend="cuda", draft=False)
    rng = np.random.default_rng(0)
    s = m.session(args.ctx + 64)
    s.eval(rng.integers(8, m.vocab_size, args.ctx).tolist(), logits="last")
    snap = s.snapshot()
    for n in args.rows:
        for _ in range(32):
            s.eval(rng.integers(8, m.vocab_size, n).tolist(), logits="last")
            s.restore(snap)


if __name__ == "__main__":
    main()
