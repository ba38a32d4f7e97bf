"""Decode, verify and prefill costs of a model on a backend.

    python benches/verify_bench.py MODEL.gguf [--backend cuda] [--ctx 2048] [--prefill 2048,8192]

After a prompt of --ctx tokens (random ids), measures with the median of --runs:

* one decode step (``eval`` of 1 token), and 4 * --runs (at most 48) of them in a row (positions
  advancing, as in generation). For Flash at --ctx 2048 the two differ in kind: the indexer
  keeps 512 compressed rows and a ratio-4 layer then sees exactly 512, so the one step skips
  the indexer's selection, which every step from position 2051 on runs;
* a verify of k rows for k = 2..8 (``eval`` of k tokens: the same computation, every row's
  logits brought back), as a ratio to the decode step, beside the byte model of a verify
  (docs/performance.md 5d): the weights of one decode once, with the routed experts for the
  expected union of k rows' choices, n(1 - (1 - used/n)^k) of n experts under independent
  uniform routing; then greedy verifies of 2, 4 and 8 rows (``Session.verify(greedy=True)``:
  one token id a row, as a temperature-0 speculative step) as a ratio to a greedy step of one;
* prefill tokens/s for each --prefill length (from an empty session; with --draft, the
  drafter's window rows kept too, as a speculative session's prompt); with --ab NAME, for a
  session made with the switch NAME=1 and one with NAME=0 (a setting the device decoder reads
  when a session makes it, such as DS4_CUDA_GEMM), or with --ab NAME=V1,V2,.. one a value
  (DS4_CUDA_PREFILL_ROWS=16,256,512), their runs interleaved; --ab given more than once, a
  session for each combination of the settings' values. --prefill-only
  skips the prompt of --ctx tokens, the decode steps and the verifies.

Every timed call but the steps in a row is preceded by a restore of the same snapshot,
outside the timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import ds4


def timed(f, runs: int, setup) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(runs + 1):
        setup()
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return statistics.median(out[1:])


def routed_bytes(path: str) -> tuple[float, int, int]:
    """The routed expert bytes one token reads (its `used` experts in every layer), the
    experts per layer n, and used; (0, 0, 0) for a model without routed experts."""
    f = ds4.GGUFFile(path)
    md = f.metadata
    n, used = int(md.get("deepseek4.expert_count", 0)), int(md.get("deepseek4.expert_used_count", 0))
    if n == 0 or used == 0:
        return 0.0, 0, 0
    routed = sum(t.nbytes for name, t in f.tensors.items() if name.startswith("blk.") and name.endswith("_exps.weight"))
    return routed * used / n, n, used


def verify_byte_model(decode_bytes: int, routed: tuple[float, int, int], k: int) -> float:
    """Bytes a verify of k rows reads over those of one decode, by the 5d model: every weight
    once, the routed experts for the expected union of the rows' choices (`routed` from
    :func:`routed_bytes`). 1 for a model without routed experts."""
    per_token, n, used = routed
    if n == 0:
        return 1.0
    union = n * (1.0 - (1.0 - used / n) ** k)
    return (decode_bytes - per_token + per_token * union / used) / decode_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--prefill", default="2048")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--profile", action="store_true", help="split the decode step by phase (DS4_PROFILE)")
    ap.add_argument("--host", action="store_true",
                    help="run the forward pass on the host even on CUDA (products on the GPU only)")
    ap.add_argument("--prefill-only", action="store_true", help="only the prefill timings")
    ap.add_argument("--draft", metavar="FILE", help="load this drafter with the model (a prompt then also "
                    "keeps the drafter's window rows)")
    ap.add_argument("--ab", metavar="NAME[=V,...]", action="append", default=[],
                    help="prefill with the setting NAME=1 and NAME=0, or each V given (read when a session "
                    "makes its decoder); more than once: each combination")
    args = ap.parse_args()
    # Each figure as soon as it is measured, also into a pipe (a run cut short keeps them).
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.host:
        os.environ["DS4_DEVICE_DECODE"] = "0"
    if args.profile:
        os.environ["DS4_PROFILE"] = "1"  # read at the first forward pass
    m = ds4.Model.load(args.model, backend=args.backend, draft=args.draft or False)
    rng = np.random.default_rng(0)
    if not args.prefill_only:
        steps(args, m, rng)
    prefill(args, m, rng)


def steps(args: argparse.Namespace, m: ds4.Model, rng: np.random.Generator) -> None:
    """The prompt of --ctx tokens, then decode steps and verifies after it."""
    vocab = m.vocab_size
    prompt = rng.integers(8, vocab, args.ctx).tolist()
    s = m.session(args.ctx + 64)
    t0 = time.perf_counter()
    s.eval(prompt, logits="last")
    print(f"{args.model} on {m.backend} ({s.forward_kind} forward): {args.ctx}-token prompt in "
          f"{time.perf_counter() - t0:.2f} s; "
          f"{m.decode_weight_bytes() / 1e6:.1f} MB of weights per decoded token")
    snap = s.snapshot()
    # One step first, so that the profile's means leave out the one-off build of the step's
    # program and graph.
    s.eval([5], logits="last")
    s.restore(snap)
    ds4._ds4.profile(reset=True)
    base = timed(lambda: s.eval([5], logits="last"), args.runs, lambda: s.restore(snap))
    print(f"  decode step {1e3 * base:.2f} ms = {1 / base:.1f} tok/s "
          f"({m.decode_weight_bytes() / base / 1e9:.1f} GB/s of weights)")
    prof = {name: (calls, secs) for name, calls, secs in ds4._ds4.profile(reset=True)}
    # The same steps one after another, positions advancing (what generation sees: the
    # compressors close windows as they go, and no restore comes between two steps).
    s.restore(snap)
    steady = []
    for i in range(min(4 * args.runs, 48)):
        t = time.perf_counter()
        s.eval([8 + i], logits="last")
        steady.append(time.perf_counter() - t)
    s.restore(snap)
    print(f"  {len(steady)} decode steps in a row: median {1e3 * statistics.median(steady):.2f} ms, "
          f"mean {1e3 * statistics.fmean(steady):.2f} ms = {len(steady) / sum(steady):.1f} tok/s")
    if args.profile and prof.get("forward", (0, 0))[0]:
        steps = max(prof["forward"][0], 1)
        fwd = prof["forward"][1] / steps
        mm, att = prof["matmul"][1] / steps, prof["attention"][1] / steps
        print(f"  per step: forward {1e3 * fwd:.2f} ms = products {1e3 * mm:.2f} ms "
              f"({prof['matmul'][0] / steps:.0f} calls) + attention loop {1e3 * att:.2f} ms "
              f"+ the rest {1e3 * (fwd - mm - att):.2f} ms")
    if args.profile and prof.get("device_step", (0, 0))[0]:
        steps = max(prof["device_step"][0], 1)
        step, wait, jr = (prof[k][1] / steps for k in ("device_step", "device_wait", "journal"))
        print(f"  per step: device decoder {1e3 * step:.2f} ms = waiting for the GPU {1e3 * wait:.2f} ms "
              f"+ journal replay {1e3 * jr:.2f} ms + the rest (embedding, uploads, launches) "
              f"{1e3 * (step - wait - jr):.2f} ms; outside it (Python, session) {1e3 * (base - step):.2f} ms")
    routed = routed_bytes(args.model)
    for k in range(2, 9):
        toks = rng.integers(8, vocab, k).tolist()
        t = timed(lambda: s.eval(toks, logits="all"), args.runs, lambda: s.restore(snap))
        model = verify_byte_model(m.decode_weight_bytes(), routed, k)
        print(f"  verify {k} rows {1e3 * t:8.2f} ms  = {t / base:5.2f} decodes (byte model {model:.2f})")
    # A temperature-0 verify as speculative decoding runs it: each row's greedy token, not its
    # logits, against a greedy step of one row (the same call with one token).
    one = timed(lambda: s.verify([5], greedy=True), args.runs, lambda: s.restore(snap))
    print(f"  greedy step {1e3 * one:.2f} ms (Session.verify of one token, greedy)")
    for k in (2, 4, 8):
        toks = rng.integers(8, vocab, k).tolist()
        t = timed(lambda: s.verify(toks, greedy=True), args.runs, lambda: s.restore(snap))
        model = verify_byte_model(m.decode_weight_bytes(), routed, k)
        print(f"  greedy verify {k} rows {1e3 * t:8.2f} ms  = {t / one:5.2f} greedy steps (byte model {model:.2f})")


def prefill(args: argparse.Namespace, m: ds4.Model, rng: np.random.Generator) -> None:
    """Prompts of each --prefill length from an empty session (per --ab setting, interleaved)."""
    # Each mode: the settings of one session, as (name, value) pairs.
    modes: list[list[tuple[str, str]]] = [[]]
    for ab in args.ab:
        name, _, values = ab.partition("=")
        modes = [m + [(name, v)] for m in modes for v in (values.split(",") if values else ["1", "0"])]
    runs = max(1, args.runs // 3)
    for n in (int(x) for x in args.prefill.split(",") if x):
        p = rng.integers(8, m.vocab_size, n).tolist()
        sessions: list[tuple[str, ds4.Session, ds4.Snapshot, list[float]]] = []
        for mode in modes:
            before = {name: os.environ.get(name) for name, _ in mode}
            os.environ.update(dict(mode))
            sess = m.session(n + 8)
            empty = sess.snapshot()
            sess.eval(p[:1], logits="none")  # the decoder is made now, with these settings
            sess.restore(empty)
            for name, old in before.items():
                if old is None:
                    del os.environ[name]
                else:
                    os.environ[name] = old
            label = " ".join(f"{name}={v}" for name, v in mode)
            sessions.append((label, sess, empty, []))
        # Each run restores its empty session, then times the prompt (the first round warms up).
        for r in range(runs + 1):
            for v, sess, empty, times in sessions:
                sess.restore(empty)
                t = time.perf_counter()
                sess.eval(p, logits="last")
                if r:
                    times.append(time.perf_counter() - t)
        for v, _, _, times in sessions:
            t = statistics.median(times)
            label = f" ({v})" if v else ""
            print(f"  prefill {n} tokens{label} {t:.2f} s = {n / t:.0f} tok/s")


if __name__ == "__main__":
    main()
