"""Decode steps in a row under several settings of the engine's switches, interleaved (so
machine-to-machine and run-to-run drift cancel out of the comparison).

    python scripts/kernel_lab/ab_steps.py MODEL.gguf [--ctx 2100] [--steps 32] [--reps 3] \\
        [--verify 4,8] [--processes] \\
        base= nofork=DS4_CUDA_FORK=0 hostmax=DS4_CUDA_ARGMAX=0,DS4_CUDA_FORK=0

A setting is NAME=[VAR=VALUE[,VAR=VALUE...]] (a value may hold commas: the variables are
split only at a comma that starts another VAR=). For each repetition and setting, in turn: the
setting's variables are set (the others of all settings unset), a new session is made (its
device decoder reads the switches when it builds its step programs), a prompt of --ctx random
tokens is evaluated (timed), three steps warm up, each --verify row count is timed (median of
five evals of that many tokens, each from the prompt's snapshot), then --steps one-token steps
run one after another (positions advancing, as in generation). Prints each run's figures, then
per setting the median over its runs.

By default the model is loaded once, so only switches a decoder reads when it is made or builds
its programs compare (DS4_CUDA_FORK, DS4_CUDA_ARGMAX, and switches added for an experiment).
With --processes each run is a process of its own that loads the model, so the switches read
when the kernels are compiled or the weights uploaded compare too (DS4_CUDA_Q8,
DS4_CUDA_Q8_MMA_MAX_IN, DS4_CUDA_Q8_MMA_MIN_IN, DS4_CUDA_PDL, DS4_CUDA_INDEX, and
DS4_CUDA_DEFINES, which takes spaces: `q6=DS4_CUDA_DEFINES=MV_MIN_BLOCKS_Q8_0_1=6`); a Flash
load costs tens of seconds a run, and each run's line gives its load's seconds (`Model.load`:
the weights' upload, and the kernels' compile unless the PTX cache holds them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

import ds4


def measure(m: ds4.Model, args: argparse.Namespace) -> dict[str, float]:
    """One run: the prompt's seconds, each verify's median seconds, the steps' median and mean."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(8, m.vocab_size, args.ctx).tolist()
    s = m.session(args.ctx + args.steps + 16)
    t = time.perf_counter()
    s.eval(prompt, logits="last")
    out = {"prompt": time.perf_counter() - t}
    snap = s.snapshot()
    for i in range(3):
        s.eval([5 + i], logits="last")
    for k in args.verify:
        times = []
        for _ in range(5):
            s.restore(snap)
            toks = rng.integers(8, m.vocab_size, k).tolist()
            t = time.perf_counter()
            s.eval(toks, logits="all")
            times.append(time.perf_counter() - t)
        out[f"verify{k}"] = statistics.median(times)
    s.restore(snap)
    steps = []
    for i in range(args.steps):
        t = time.perf_counter()
        s.eval([8 + i], logits="last")
        steps.append(time.perf_counter() - t)
    out["step"] = statistics.median(steps)
    out["mean"] = statistics.fmean(steps)
    return out


def show(rep: int, name: str, r: dict[str, float]) -> None:
    vs = "".join(f", {k} {1e3 * v:.2f} ms" for k, v in r.items() if k.startswith("verify"))
    load = f", load {r['load']:.1f} s" if "load" in r else ""
    print(f"rep {rep} {name:12} step median {1e3 * r['step']:.3f} ms, mean {1e3 * r['mean']:.3f} ms{vs}, "
          f"prompt {r['prompt']:.2f} s{load}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("settings", nargs="+")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--ctx", type=int, default=2100)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--verify", type=lambda v: [int(k) for k in v.split(",") if k], default=[],
                    help="row counts of verifies to time, e.g. 4,8")
    ap.add_argument("--processes", action="store_true", help="a process of its own for each run")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.child:
        t = time.perf_counter()
        model = ds4.Model.load(args.model, backend=args.backend, draft=False)
        load = time.perf_counter() - t
        print(json.dumps({**measure(model, args), "load": load}))
        return
    settings: list[tuple[str, dict[str, str]]] = []
    for s in args.settings:
        name, _, rest = s.partition("=")
        # Variables are split at the commas that start another VAR=, so a value may hold
        # commas (an experiment's list: X=a,b,Y=1 sets X to "a,b").
        env = dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Za-z_][A-Za-z0-9_]*=)", rest) if kv)
        settings.append((name, env))
    every = {k for _, env in settings for k in env}
    m: ds4.Model | None = None if args.processes else ds4.Model.load(args.model, backend=args.backend, draft=False)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in settings}
    for rep in range(args.reps):
        for name, env in settings:
            for k in every:
                os.environ.pop(k, None)
            os.environ.update(env)
            if m is not None:
                r = measure(m, args)
            else:
                cmd = [sys.executable, os.path.abspath(__file__), args.model, "--child", "--backend", args.backend,
                       "--ctx", str(args.ctx), "--steps", str(args.steps),
                       "--verify", ",".join(map(str, args.verify)), "-"]  # ("-": no settings)
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    sys.exit(f"{name}: the run failed:\n{done.stderr[-2000:]}")
                r = json.loads(done.stdout.strip().splitlines()[-1])
            runs[name].append(r)
            show(rep, name, r)
    for name, _ in settings:
        rs = runs[name]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        vs = "".join(f", {k} {1e3 * v:.2f} ms" for k, v in med.items() if k.startswith("verify"))
        print(f"{name:12} {1e3 * med['step']:.3f} ms a step (median of {len(rs)} runs' medians: "
              + ", ".join(f"{1e3 * r['step']:.3f}" for r in rs) + f"){vs}, prompt {med['prompt']:.2f} s"
              + (f", load {med['load']:.1f} s" if "load" in med else ""))


if __name__ == "__main__":
    main()
