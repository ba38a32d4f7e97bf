"""Per-kernel GPU time of decode steps on CUDA, measured by Nsight Compute (ncu).

    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --print-units base \\
        python scripts/kernel_lab/ncu_step.py MODEL.gguf [STEPS] > /tmp/ncu.csv
    python scripts/kernel_lab/ncu_step.py --sum /tmp/ncu.csv [STEPS]

The first form loads the model, runs a 64-token prompt and a few warm-up steps (the step
programs are built and captured then), prints the mean wall time of 20 one-token steps, and
turns the profiler on (cuProfilerStart) around STEPS more (default 1), so that ncu measures
only those kernels. ncu runs each kernel alone, so the sum of the durations can differ from
the step's wall time: it has no launch gaps, and no overlap of a kernel's start with the
previous one's end. The second form sums the report per kernel name.
"""

from __future__ import annotations

import collections
import csv
import ctypes
import sys
import time


def profile(model: str, steps: int) -> None:
    import numpy as np

    import ds4

    m = ds4.Model.load(model, backend="cuda", draft=False)
    s = m.session(4096)
    s.eval(np.random.default_rng(0).integers(8, m.vocab_size, 64).tolist(), logits="last")
    for i in range(5):
        s.eval([5 + i], logits="last")
    t = time.perf_counter()
    for i in range(20):
        s.eval([9 + i], logits="last")
    print(f"step {(time.perf_counter() - t) / 20 * 1e3:.3f} ms (wall, mean of 20)", file=sys.stderr)
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for i in range(steps):
        s.eval([40 + i], logits="last")
    cuda.cuProfilerStop()


def summarize(report: str, steps: int) -> None:
    rows = list(csv.reader(open(report)))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    name, metric, value = cols.index("Kernel Name"), cols.index("Metric Name"), cols.index("Metric Value")
    per = collections.defaultdict(lambda: [0, 0.0])
    for r in rows[head + 1 :]:
        if len(r) > value and r[metric] == "gpu__time_duration.sum":
            k = per[r[name].split("(")[0]]
            k[0] += 1
            k[1] += float(r[value].replace(",", ""))  # nanoseconds
    launches = sum(v[0] for v in per.values())
    total = sum(v[1] for v in per.values())
    print(f"{launches / steps:.0f} launches and {total / steps / 1e6:.3f} ms of kernels per step")
    for k, (count, ns) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"  {k:32} {ns / steps / 1e3:8.1f} us/step {count / steps:6.1f} launches {ns / count / 1e3:7.2f} us each")


if __name__ == "__main__":
    if sys.argv[1] == "--sum":
        summarize(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    else:
        profile(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
