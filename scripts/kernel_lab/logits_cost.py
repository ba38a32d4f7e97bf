"""Wall time of evals of k rows after a 2100-token prompt by the logits they return ("all",
"last", "none"): what the host's logits handling adds to a verify. Medians of 7, each from the
prompt's snapshot (restore outside the timing), after one more that warms up.

    python scripts/kernel_lab/logits_cost.py MODEL.gguf
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

import ds4

m = ds4.Model.load(sys.argv[1], backend="cuda", draft=False)
rng = np.random.default_rng(0)
s = m.session(2200)
s.eval(rng.integers(8, m.vocab_size, 2100).tolist(), logits="last")
snap = s.snapshot()
s.eval([5], logits="last")
for k in (1, 2, 4, 8):
    toks = rng.integers(8, m.vocab_size, k).tolist()
    out = []
    for which in ("all", "last", "none"):
        ts = []
        for _ in range(8):
            s.restore(snap)
            t = time.perf_counter()
            s.eval(toks, logits=which)
            ts.append(time.perf_counter() - t)
        out.append(f"{which} {1e3 * statistics.median(ts[1:]):.2f}")
    print(f"k={k}: " + ", ".join(out) + " ms", flush=True)
