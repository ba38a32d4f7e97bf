"""The loops of ds4's CUDA kernels in their sm_90 machine code (SASS), with what each issues a pass.

    python scripts/kernel_lab/sass_loops.py [--kernel FILTER] [--min N] [-D NAME=VALUE ...] [REV]

Builds the kernel program of REV (default: the working tree) as sass_diff.py does (NVRTC with the
engine's options, ptxas for sm_90, cuobjdump), finds every loop of each kernel whose name
contains FILTER (a backward branch and its target; nested loops show up once each, the outer
ones counting their inner ones' bodies once) and prints one line per loop of at least N
instructions (default 40): its first address, its instructions, how many of them are guarded by
a predicate (`@P0 ...`), the tensor-core instructions (HMMA, IMMA), the memory ones (global,
generic, shared) and the shuffles.

Why: a warp issues a predicated-off instruction as it issues any other, so a run-time test
inside a loop whose branches are both short (the compiler if-converts them) costs every pass the
issue slots of the branch not taken. That is how the one-row tensor-core Q8_0 kernel's loops
were found to issue the 2-byte loads of unaligned tiles on aligned ones (73 of 229 instructions
a chunk; q8_0.cu MQ_FAST_VEC). A loop with many predicated instructions is worth a look; not
all are waste (a row test of a batch kernel is real work of the rows present).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sass_diff  # noqa: E402

BRANCH = re.compile(r"\bBRA\b[^;]*?(0x[0-9a-f]+)\s*$")


def loops(code: list[tuple[int, str]]) -> list[tuple[int, list[str]]]:
    """Each backward branch's loop: its first address and its instructions, in address order."""
    found = []
    for addr, ins in code:
        m = BRANCH.search(ins)
        if m and int(m.group(1), 16) <= addr:
            start = int(m.group(1), 16)
            found.append((start, [i for a, i in code if start <= a <= addr]))
    return sorted(found, key=lambda f: f[0])


def counts(body: list[str]) -> dict[str, int]:
    """What a pass of a loop issues: its instructions, the predicated ones, mma, memory, shuffles."""
    ops = [sass_diff.opcode(i) for i in body]
    return {
        "instructions": len(body),
        "predicated": sum(1 for i in body if re.match(r"@!?U?P[0-6]\b", i)),
        "mma": sum(1 for o in ops if o in ("HMMA", "IMMA")),
        "memory": sum(1 for o in ops if o.startswith(("LDG", "LDS", "STG", "STS")) or o in ("LD", "ST")),
        "shuffles": sum(1 for o in ops if o == "SHFL"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rev", nargs="?", help="a git revision (default: the working tree)")
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    ap.add_argument("--min", type=int, default=40, help="the fewest instructions of a loop listed")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = sass_diff.checkout(args.rev, Path(tmp) / "src") if args.rev else sass_diff.REPO
        code = sass_diff.listing(sass_diff.sass_text(root, args.defines, Path(tmp)))
    for name in sorted(code):
        if args.kernel not in name:
            continue
        for start, body in loops(code[name]):
            c = counts(body)
            if c["instructions"] < args.min:
                continue
            print(
                f"{name} {start:#06x}: {c['instructions']} instructions, {c['predicated']} predicated, "
                f"{c['mma']} mma, {c['memory']} memory, {c['shuffles']} shuffles"
            )


if __name__ == "__main__":
    main()
