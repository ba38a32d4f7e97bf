"""Per-kernel GPU time of decode steps on CUDA, measured by Nsight Compute (ncu).

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --print-units base \\
        python scripts/kernel_lab/ncu_step.py MODEL.gguf [STEPS] [--prompt N] [--rows R] > /tmp/ncu.csv
    python scripts/kernel_lab/ncu_step.py --sum /tmp/ncu.csv [STEPS]

The first form loads the model, runs a prompt of N random tokens (default 64; Flash's
indexer selects rows only once a ratio-4 layer sees more than 512, from position 2051, so
``--prompt 2100`` traces steps with the selection) and a few warm-up steps (the step
programs are built and captured then), prints the mean wall time of 20 one-token steps, and
turns the profiler on (cuProfilerStart) around STEPS more (default 1), so that ncu measures
only those kernels; with ``--rows R`` each of those steps is a batch of R random tokens (a
verify's step up to 16 rows, a prompt's beyond; one more such step first builds its program).
ncu runs each kernel alone, so the sum of the durations can differ from the step's wall time:
it has no launch gaps, and no overlap of a kernel's start with the previous one's end. The
second form sums the report per kernel name.

The kernels' times as they ran (graph nodes, the side branch and programmatic launches
overlapping), with the idle time between them, come from a CUPTI trace of the same steps by
kernel_trace.cpp (its build line is in it), or from Nsight Systems' `cuda_gpu_trace` report
(`nsys profile --capture-range=cudaProfilerApi --cuda-graph-trace=node`, then `nsys stats
--report cuda_gpu_trace --format csv`):

    CUDA_INJECTION64_PATH=/tmp/kernel_trace.so DS4_TRACE_OUT=/tmp/trace.csv \\
        python scripts/kernel_lab/ncu_step.py MODEL.gguf [STEPS] --cupti /tmp/kernel_trace.so
    python scripts/kernel_lab/ncu_step.py --trace /tmp/trace.csv [STEPS]

The third form lists one traced step's kernels in the order they ran (STEP from 0; with
--layer L only layer L's), each with its start, end, duration, the idle time before it and
the time it added to the step: the critical path of a layer, kernel by kernel. The trace is
a small CSV (a Flash step is about 1300 kernels), worth bringing back from the GPU machine.

    python scripts/kernel_lab/ncu_step.py --timeline /tmp/trace.csv [STEP] [--layer L]

The fourth sums one step's layers by kind (CSA, HCA, window): per stage of a Flash layer
(q_b, the attention, o_b, the routing, the routed products, ...), the median time it added to
the layer, from the previous stage's end to its own.

    python scripts/kernel_lab/ncu_step.py --stages /tmp/trace.csv [STEP]
"""

from __future__ import annotations

import collections
import csv
import ctypes
import re
import signal
import statistics
import sys
import time


def profile(model: str, steps: int, cupti: str | None = None, prompt: int = 64, rows: int = 1) -> None:
    import numpy as np

    import ds4

    m = ds4.Model.load(model, backend="cuda", draft=False)
    s = m.session(max(4096, prompt + 256))
    s.eval(np.random.default_rng(0).integers(8, m.vocab_size, prompt).tolist(), logits="last")
    for i in range(5):
        s.eval([5 + i], logits="last")
    t = time.perf_counter()
    for i in range(20):
        s.eval([9 + i], logits="last")
    print(f"step {(time.perf_counter() - t) / 20 * 1e3:.3f} ms (wall, mean of 20)", file=sys.stderr)
    # The measured steps: one token each, or with rows > 1 a batch of that many random tokens
    # (a verify's step up to the decoder's most rows, 16, a prompt's step beyond), whose rows
    # route to different experts as a verify's do.
    rng = np.random.default_rng(1)
    batches = [[40 + i] if rows == 1 else rng.integers(8, m.vocab_size, rows).tolist() for i in range(steps)]
    if rows > 1:
        s.eval(batches[0], logits="last")  # the program of a step of that many rows, built and captured
    if cupti:
        # Traced by kernel_trace.cpp, loaded as the process's CUDA injection library.
        lib = ctypes.CDLL(cupti)
        lib.ds4_trace_on()
        for b in batches:
            s.eval(b, logits="last")
        lib.ds4_trace_off()
        return
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for b in batches:
        s.eval(b, logits="last")
    cuda.cuProfilerStop()


def summarize(report: str, steps: int) -> None:
    rows = list(csv.reader(open(report)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    name, metric, value = cols.index("Kernel Name"), cols.index("Metric Name"), cols.index("Metric Value")
    per: collections.defaultdict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for r in rows[head + 1 :]:
        if len(r) > value and r[metric] == "gpu__time_duration.sum":
            v = per[r[name].split("(")[0]]
            v[0] += 1
            v[1] += float(r[value].replace(",", ""))  # nanoseconds
    launches = sum(v[0] for v in per.values())
    total = sum(v[1] for v in per.values())
    print(f"{launches / steps:.0f} launches and {total / steps / 1e6:.3f} ms of kernels per step")
    for k, (count, ns) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:32} {ns / steps / 1e3:8.1f} us/step {count / steps:6.1f} launches {ns / count / 1e3:7.2f} us each")


def read_trace(trace: str) -> list[tuple[int, int, str]]:
    """The ds4 kernels of a trace CSV (kernel_trace.cpp's or nsys's cuda_gpu_trace) as (start
    ns, duration ns, name), in start order."""
    rows = list(csv.reader(open(trace)))
    head = next(i for i, r in enumerate(rows) if any(c.startswith("Start") for c in r))
    cols = rows[head]

    def col(prefix: str) -> int:
        return next(i for i, c in enumerate(cols) if c.startswith(prefix))

    start, dur, name = col("Start"), col("Duration"), col("Name")
    return sorted(
        (int(r[start]), int(r[dur]), r[name].split("(")[0])
        for r in rows[head + 1 :]
        if len(r) > name and r[name].startswith("ds4_")
    )


def step_kernels(kernels: list[tuple[int, int, str]], step: int) -> list[tuple[int, int, str]] | None:
    """The kernels of traced step `step` (steps end with ds4_pack), or None past the trace."""
    ends = [i for i, k in enumerate(kernels) if k[2] == "ds4_pack"]
    if len(ends) <= step:
        print(f"the trace holds {len(ends)} whole steps")
        return None
    first = ends[step - 1] + 1 if step > 0 else 0
    return kernels[first : ends[step] + 1]


def layer_spans(ks: list[tuple[int, int, str]]) -> list[tuple[int, int]]:
    """Each layer of a step's kernels as [lo, hi) indices: layer L from the 2L-th ds4_hc_pre or
    ds4_hc_site (its attention site's; the mixing product before a ds4_hc_pre and a side-branch
    prefetch are counted in the layer before) to the next layer's start, the last to the step's
    end."""
    starts = [i for i, k in enumerate(ks) if k[2] in ("ds4_hc_pre", "ds4_hc_site")][::2]
    return list(zip(starts, starts[1:] + [len(ks)]))


def timeline(trace: str, step: int = 0, layer: int | None = None) -> None:
    """The kernels of one traced step in start order: start and end relative to the step's
    first kernel, duration, the idle time before it (no kernel running) and how far it moved
    the end of the busy time, as summarize_trace counts them. With `layer`, only that layer's
    kernels (layer_spans)."""
    ks = step_kernels(read_trace(trace), step)
    if ks is None:
        return
    t0 = ks[0][0]
    spans = layer_spans(ks)
    lo, hi = 0, len(ks)
    if layer is not None:
        if layer >= len(spans):
            print(f"the step has {len(spans)} layers")
            return
        lo, hi = spans[layer]
    print(f"{'#':>5} {'kernel':28} {'start us':>9} {'end us':>9} {'dur us':>8} {'idle us':>8} {'adds us':>8}")
    busy = t0
    for i, (s0, d, name) in enumerate(ks):
        idle = max(0, s0 - busy)
        adds = max(0, s0 + d - max(busy, s0))
        busy = max(busy, s0 + d)
        if lo <= i < hi:
            print(f"{i:5} {name:28} {(s0 - t0) / 1e3:9.2f} {(s0 + d - t0) / 1e3:9.2f} {d / 1e3:8.2f} "
                  f"{idle / 1e3:8.2f} {adds / 1e3:8.2f}")


# The stages of a Flash decode layer (one row) in program.rs's order: (label, the kernel stems
# that end it, whether a run of them ends it together). A stage ends at the first such kernel
# after the previous stage's end (with the flag, the last of a run of them); the compressors'
# and indexer's F16 products only when they come before ds4_finish_rows.
# o_a runs on the tensor-core Q8_0 kernel like q_b and o_b (Q8_MMA_MIN_ROWS in context.rs),
# or on the float-x one (DS4_CUDA_Q8=fma), and o_b follows it at once: each is one launch.
# With the hyper-connection sites as single launches (DS4_CUDA_HC_SITE, the default) there is
# no hc_post, and the FFN site's mixing is in the router's stage.
STAGES = [
    ("hc_pre, q_a and kv, q_a norm", ("ds4_rms_weight",), True),
    ("q_b", ("ds4_mv_q8_0_mq",), False),
    ("compressor and indexer products", ("ds4_mv_f16",), True),
    ("finish_rows", ("ds4_finish_rows",), True),
    ("compressors", ("ds4_compress",), True),
    ("indexer scores and top-k", ("ds4_index_topk",), True),
    ("attention", ("ds4_attention",), True),
    ("o_a", ("ds4_mv_q8_0_mq", "ds4_mv_q8_0"), False),
    ("o_b", ("ds4_mv_q8_0_mq",), False),
    ("hc_post", ("ds4_hc_post",), True),
    ("FFN mixing, hc_pre, router, route", ("ds4_route",), True),
    ("gather", ("ds4_gather",), True),
    ("routed gate and up", ("ds4_mv_iq2_xxs",), True),
    ("swiglu, routed down", ("ds4_mv_q2_k",), True),
    ("combine", ("ds4_moe_combine",), True),
]


def stages(trace: str, step: int = 0) -> None:
    """A decode step's layers by kind (CSA: with an indexer; HCA: a compressor without one;
    window: neither), and per kind the median microseconds each stage of STAGES added to the
    layer: from the end of the stage before (or the layer's start) to the end of the stage's
    last kernel, where the critical path runs, then the time to the next layer's start. A
    stage a layer lacks adds 0. Stage ends follow the kernel order of a Flash layer in
    program.rs (product kernels by their stem, without the rows: a verify's step too); a model
    with other product formats needs other names here."""
    ks = step_kernels(read_trace(trace), step)
    if ks is None:
        return
    per: dict[str, list[list[float]]] = {}
    for lo, hi in layer_spans(ks):
        layer = ks[lo:hi]
        # Product kernels by stem, whatever their rows (a verify's step runs ds4_mv_q8_0_8).
        names = [re.sub(r"_\d+$", "", k[2]) if k[2].startswith("ds4_mv_") else k[2] for k in layer]
        busy = layer[0][0]
        adds = []
        pos = -1
        for _, kernels, run in STAGES:
            # The first of these kernels after the previous stage's, or with `run` the last of
            # a run of them (two compressors in a CSA layer); a stage missing here adds nothing.
            hits = [i for i in range(pos + 1, len(layer)) if names[i] in kernels]
            if not hits or ("ds4_mv_f16" in kernels and "ds4_finish_rows" in names[pos + 1 : hits[0]]):
                adds.append(0.0)
                continue
            i = hits[0]
            while run and i + 1 < len(layer) and names[i + 1] in kernels:
                i += 1
            end = layer[i][0] + layer[i][1]
            adds.append(max(0, end - busy) / 1e3)
            busy = max(busy, end)
            pos = i
        nxt = ks[hi][0] if hi < len(ks) else busy
        adds.append(max(0, nxt - busy) / 1e3)
        kind = "CSA" if "ds4_index_topk" in names else "HCA" if "ds4_compress" in names else "window"
        per.setdefault(kind, []).append(adds)
    labels = [s[0] for s in STAGES] + ["to the next layer"]
    kinds = list(per)
    print(f"  {'us added, median':36}" + "".join(f"{f'{k} ({len(per[k])})':>14}" for k in kinds))
    for j, label in enumerate(labels):
        print(f"  {label:36}" + "".join(f"{statistics.median(a[j] for a in per[k]):14.1f}" for k in kinds))
    print(f"  {'layer':36}" + "".join(f"{statistics.median(sum(a) for a in per[k]):14.1f}" for k in kinds))


def summarize_trace(trace: str, steps: int) -> None:
    kernels = read_trace(trace)
    if not kernels:
        print("no ds4 kernels in the trace")
        return
    # Per kernel: launches, ns running (from its start, which with programmatic launch can be
    # before the previous kernel's end), ns by which it moved the end of the busy time (the
    # step's wall time is the sum of these and of the idle time; of two kernels running side
    # by side, the one that ends later is charged the overlap's end), ns of idle before it.
    # The gaps from ds4_pack (the journal's packing, each step's last kernel) to the next step's
    # first main-stream kernel are the host's part of the step, between two steps' graphs; they
    # are counted apart, not as idle before that kernel. A step's program may start with a
    # side-branch ds4_prefetch, which the graph launches at once, so the host's gap can fall
    # after it.
    per: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    busy_end = kernels[0][0]
    host = True  # before a step's first main-stream kernel (the trace starts with a step)
    idle = between = 0
    for s0, d, k in kernels:
        gap = max(0, s0 - busy_end)  # the GPU ran no kernel for this long before this one
        v = per[k]
        if host:
            between += gap
            host = k == "ds4_prefetch"
        else:
            idle += gap
            v[3] += gap
        v[0] += 1
        v[1] += d
        v[2] += max(0, s0 + d - max(busy_end, s0))
        if s0 + d > busy_end:
            busy_end = s0 + d
        if k == "ds4_pack":
            host = True
    span = busy_end - kernels[0][0]
    print(f"{len(kernels) / steps:.0f} launches per step; {span / steps / 1e6:.3f} ms from the first kernel's "
          f"start to the last one's end, of which {idle / steps / 1e6:.3f} ms with no kernel running inside the "
          f"steps and {between / steps / 1e6:.3f} ms between them (the host's part, longer under the tracer)")
    print(f"  {'kernel':32} {'us/step':>8} {'launches':>8} {'us each':>8} {'adds, us':>9} {'idle before':>11}")
    for k, (count, ns, ext, gap) in sorted(per.items(), key=lambda kv: -kv[1][2]):
        print(f"  {k:32} {ns / steps / 1e3:8.1f} {count / steps:8.1f} {ns / count / 1e3:8.2f} {ext / steps / 1e3:9.1f} "
              f"{gap / steps / 1e3:11.1f}")


if __name__ == "__main__":
    # Quiet when piped into `head`.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if sys.argv[1] == "--sum":
        summarize(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    elif sys.argv[1] == "--trace":
        summarize_trace(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    elif sys.argv[1] == "--stages":
        stages(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
    elif sys.argv[1] == "--timeline":
        args = sys.argv[2:]
        layer = None
        if "--layer" in args:
            layer = int(args.pop(args.index("--layer") + 1))
            args.remove("--layer")
        timeline(args[0], int(args[1]) if len(args) > 1 else 0, layer)
    else:
        args = sys.argv[1:]
        out = None
        prompt = 64
        if "--prompt" in args:
            prompt = int(args.pop(args.index("--prompt") + 1))
            args.remove("--prompt")
        rows = 1
        if "--rows" in args:
            rows = int(args.pop(args.index("--rows") + 1))
            args.remove("--rows")
        if "--cupti" in args:
            out = args.pop(args.index("--cupti") + 1)
            args.remove("--cupti")
        profile(args[0], int(args[1]) if len(args) > 1 else 1, out, prompt, rows)
