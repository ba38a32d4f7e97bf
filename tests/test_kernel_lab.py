"""scripts/kernel_lab/ncu_step.py's trace readers on a made-up CUPTI trace (kernel_trace.cpp's
CSV): the per-kernel sums and one step's timeline, against times worked out by hand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "kernel_lab" / "ncu_step.py"

# Two steps of two layers each (ns). Step 0: hc_pre 0-10, a product 13-30, a side-branch
# prefetch 14-40 beside it, hc_pre 40-50, route 50-55 (layer 0); hc_pre 60-70, hc_pre 70-80
# (layer 1); pack 80-82. Step 1 starts after a host gap at 1000.
TRACE = """Start (ns),Duration (ns),Name
0,10000,ds4_hc_pre
13000,17000,ds4_mv_f16_1(const MvDesc*)
14000,26000,ds4_prefetch
40000,10000,ds4_hc_pre
50000,5000,ds4_route
60000,10000,ds4_hc_pre
70000,10000,ds4_hc_pre
80000,2000,ds4_pack
1000000,10000,ds4_hc_pre
1010000,2000,ds4_pack
"""


def run(tmp_path: Path, *args: str) -> list[str]:
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE)
    out = subprocess.run([sys.executable, str(SCRIPT), *args[:1], str(trace), *args[1:]],
                         capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def test_timeline_of_a_step_and_of_a_layer(tmp_path: Path) -> None:
    rows = [line.split() for line in run(tmp_path, "--timeline")[1:]]
    # Index, name, start, end, duration, idle before, time added to the busy span (us).
    assert [r[1] for r in rows] == ["ds4_hc_pre", "ds4_mv_f16_1", "ds4_prefetch", "ds4_hc_pre", "ds4_route",
                                    "ds4_hc_pre", "ds4_hc_pre", "ds4_pack"]
    got = {r[1] + r[0]: [float(v) for v in r[2:]] for r in rows}
    assert got["ds4_mv_f16_11"] == [13.0, 30.0, 17.0, 3.0, 17.0]
    # The prefetch runs beside the product: no idle, and only its last 10 us extend the step.
    assert got["ds4_prefetch2"] == [14.0, 40.0, 26.0, 0.0, 10.0]
    assert got["ds4_hc_pre5"] == [60.0, 70.0, 10.0, 5.0, 10.0]
    # Layer 1: from the step's third hc_pre to the end.
    layer = [line.split()[1] for line in run(tmp_path, "--timeline", "0", "--layer", "1")[1:]]
    assert layer == ["ds4_hc_pre", "ds4_hc_pre", "ds4_pack"]
    # The second step, and one past the trace.
    assert [line.split()[1] for line in run(tmp_path, "--timeline", "1")[1:]] == ["ds4_hc_pre", "ds4_pack"]
    assert run(tmp_path, "--timeline", "2") == ["the trace holds 2 whole steps"]


def test_trace_summary_counts_the_host_gap_apart(tmp_path: Path) -> None:
    lines = run(tmp_path, "--trace", "2")
    # The trace spans 0-1012 us, of which 3 + 5 us idle inside step 0 and 918 between the steps
    # (the host's), per step.
    assert lines[0].startswith("5 launches per step; 0.506 ms from the first kernel's start")
    assert "0.004 ms with no kernel running inside the steps and 0.459 ms between them" in lines[0]
    pre = next(line.split() for line in lines if line.split()[0] == "ds4_hc_pre")
    # hc_pre: 5 launches of 10 us over 2 steps.
    assert pre[1:4] == ["25.0", "2.5", "10.00"]


def test_ncu_report_sums_per_kernel(tmp_path: Path) -> None:
    # Nsight Compute's CSV (--csv --print-units base): a preamble line, then one row per kernel
    # and metric.
    report = tmp_path / "ncu.csv"
    report.write_text('==PROF== Connected\n"ID","Kernel Name","Metric Name","Metric Value"\n'
                      '"0","ds4_route(float const*)","gpu__time_duration.sum","12,000"\n'
                      '"1","ds4_route(float const*)","gpu__time_duration.sum","8,000"\n'
                      '"1","ds4_route(float const*)","sm__cycles_elapsed.avg","9"\n'
                      '"2","ds4_pack","gpu__time_duration.sum","2,000"\n')
    out = subprocess.run([sys.executable, str(SCRIPT), "--sum", str(report), "2"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "2 launches and 0.011 ms of kernels per step"
    assert out[1].split() == ["ds4_route", "10.0", "us/step", "1.0", "launches", "10.00", "us", "each"]
    assert out[2].split()[:2] == ["ds4_pack", "1.0"]


# A made-up `cuobjdump -sass` listing: one kernel with an outer loop (0x0010-0x0070) around an
# inner one (0x0020-0x0050), and a forward branch that is no loop.
SASS = """
        Function : ds4_lab
        .headerflags    @"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   MOV R1, c[0x0][0x28] ;                      /* 0x00000a0000017a02 */
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;                /* 0x0000000404027981 */
        /*0020*/               @P0 LD.E.U16 R3, desc[UR4][R6.64] ;            /* 0x0000000406030980 */
        /*0030*/                   HMMA.16816.F32 R8, R12, R14, R8 ;            /* 0x0000000e0c08723c */
        /*0040*/              @!P1 SHFL.BFLY PT, R5, R4, 0x1, 0x1f ;          /* 0x0c201f0004057f89 */
        /*0050*/               @P2 BRA 0x20 ;                                  /* 0xfffffffc00008947 */
        /*0060*/               @P3 BRA 0x80 ;                                  /* 0x0000000000008947 */
        /*0070*/               @P4 BRA 0x10 ;                                  /* 0xfffffff800008947 */
        /*0080*/                   EXIT ;                                      /* 0x000000000000794d */
"""


def test_sass_loops_finds_each_backward_branch_and_counts_its_body() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    import sass_diff
    import sass_loops

    code = sass_diff.listing(SASS)
    assert list(code) == ["ds4_lab"] and len(code["ds4_lab"]) == 9
    found = sass_loops.loops(code["ds4_lab"])
    assert [(start, len(body)) for start, body in found] == [(0x10, 7), (0x20, 4)]
    outer = sass_loops.counts(found[0][1])
    assert outer == {"instructions": 7, "predicated": 5, "mma": 1, "memory": 2, "shuffles": 1}
    inner = sass_loops.counts(found[1][1])
    assert inner == {"instructions": 4, "predicated": 3, "mma": 1, "memory": 1, "shuffles": 1}
