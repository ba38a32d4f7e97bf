"""Decode steps in a row under several settings of the engine's switches, interleaved in one
process (so machine-to-machine and run-to-run drift cancel out of the comparison).

    python scripts/kernel_lab/ab_steps.py MODEL.gguf [--ctx 2100] [--steps 32] [--reps 3] \\
        base= nofork=DS4_CUDA_FORK=0 hostmax=DS4_CUDA_ARGMAX=0,DS4_CUDA_FORK=0

A setting is NAME=[VAR=VALUE[,VAR=VALUE...]]. For each repetition and setting, in turn: the
setting's variables are set (the others of all settings unset), a new session is made (its
device decoder reads the switches when it builds its step programs), a prompt of --ctx random
tokens is evaluated, three steps warm up, then --steps one-token steps run one after another
(positions advancing, as in generation). Prints each run's median and mean step time, then
per setting the median over its runs. The model is loaded once, so only switches a decoder
reads when it is made or builds its programs compare this way (DS4_CUDA_FORK, DS4_CUDA_ARGMAX,
and switches added for an experiment); those read when the kernels are compiled
(DS4_CUDA_PDL, DS4_CUDA_INDEX, DS4_CUDA_Q8) hold for the whole process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import ds4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("settings", nargs="+")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--ctx", type=int, default=2100)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    settings: list[tuple[str, dict[str, str]]] = []
    for s in args.settings:
        name, _, rest = s.partition("=")
        env = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
        settings.append((name, env))
    every = {k for _, env in settings for k in env}
    m = ds4.Model.load(args.model, backend=args.backend, draft=False)
    prompt = np.random.default_rng(0).integers(8, m.vocab_size, args.ctx).tolist()
    runs: dict[str, list[float]] = {name: [] for name, _ in settings}
    for rep in range(args.reps):
        for name, env in settings:
            for k in every:
                os.environ.pop(k, None)
            os.environ.update(env)
            s = m.session(args.ctx + args.steps + 8)
            s.eval(prompt, logits="last")
            for i in range(3):
                s.eval([5 + i], logits="last")
            times = []
            for i in range(args.steps):
                t = time.perf_counter()
                s.eval([8 + i], logits="last")
                times.append(time.perf_counter() - t)
            del s
            med = statistics.median(times)
            runs[name].append(med)
            print(f"rep {rep} {name:12} median {1e3 * med:.3f} ms, mean {1e3 * statistics.fmean(times):.3f} ms")
    for name, _ in settings:
        r = runs[name]
        print(f"{name:12} {1e3 * statistics.median(r):.3f} ms a step (median of {len(r)} runs' medians: "
              + ", ".join(f"{1e3 * x:.3f}" for x in r) + ")")


if __name__ == "__main__":
    main()
