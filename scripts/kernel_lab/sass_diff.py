"""Compares the sm_90 machine code (SASS) of ds4's CUDA kernels between two versions of the shaders.

    python scripts/kernel_lab/sass_diff.py [REV_A [REV_B]] [--kernel FILTER] [-D NAME=VALUE ...]

REV_A defaults to HEAD and REV_B to the working tree; either may be any git revision. Each side's
kernel program is built as build_ptx.py builds it (NVRTC, the engine's options), then ptxas
makes the sm_90 cubin and cuobjdump prints its SASS. Every kernel whose name contains FILTER
gets one line:

- `same`: the same instructions in the same order.
- `same up to registers`: the same instructions, with other register numbers and in another
  order (a refactor that moved code, or one that the register allocator saw differently).
- `differs`: the instruction counts of both sides and the opcodes whose counts changed most.

The exit status is 1 when some kernel differs, so that a refactor meant to leave the machine
code alone can be checked without a GPU. Needs NVRTC (NVRTC or the loader's libnvrtc), ptxas
(PTXAS or PATH) and cuobjdump with nvdisasm (CUOBJDUMP or PATH; cuobjdump finds nvdisasm
beside itself or on PATH). The pip wheels nvidia-cuda-nvcc-cu12, nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm hold them.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_ptx  # noqa: E402

# The repository (build_ptx.ROOT is pointed at each side's files in turn).
REPO = build_ptx.ROOT

# What build_ptx.program reads of a checkout.
PATHS = ["shaders/cuda", "rust/engine/backend/cuda/context.rs", "rust/engine/quant/tables.rs"]


def tool(env: str, name: str) -> str:
    path = os.environ.get(env) or shutil.which(name)
    if not path:
        sys.exit(f"{name} not found: set {env} or put it on PATH")
    return path


def checkout(rev: str | None, into: Path) -> Path:
    """The files build_ptx needs, of `rev` (None: the working tree)."""
    if rev is None:
        return REPO
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, *PATHS], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def sass(root: Path, defines: list[str], work: Path) -> dict[str, list[str]]:
    """Each kernel's instructions, in order, of the program at `root`."""
    return {name: [ins for _, ins in code] for name, code in listing(sass_text(root, defines, work)).items()}


def sass_text(root: Path, defines: list[str], work: Path) -> str:
    """`cuobjdump -sass` of the sm_90 cubin of the program at `root`."""
    build_ptx.ROOT = root
    ptx = work / "k.ptx"
    ptx.write_bytes(build_ptx.compile_ptx(build_ptx.program({}), ["DS4_PDL_EARLY", *defines]))
    cubin = work / "k.cubin"
    subprocess.run([tool("PTXAS", "ptxas"), "-arch=sm_90", str(ptx), "-o", str(cubin)], check=True)
    cuobjdump = tool("CUOBJDUMP", "cuobjdump")
    env = dict(os.environ, PATH=str(Path(cuobjdump).parent) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True, env=env).stdout


def listing(text: str) -> dict[str, list[tuple[int, str]]]:
    """Each kernel's instructions with their addresses, from `cuobjdump -sass` output."""
    kernels: dict[str, list[tuple[int, str]]] = {}
    current: list[tuple[int, str]] | None = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = kernels.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2).strip()))
    return kernels


def normalized(ins: str) -> str:
    """An instruction without its register numbers and branch targets."""
    ins = re.sub(r"\bU?R\d+\b", "R", ins)
    ins = re.sub(r"\bU?P\d\b", "P", ins)
    return re.sub(r"0x[0-9a-f]+\s*$", "TARGET", ins) if "BRA" in ins else ins


def opcode(ins: str) -> str:
    words = ins.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("revs", nargs="*", help="REV_A [REV_B]: git revisions (default HEAD and the working tree)")
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    args = ap.parse_args()
    if len(args.revs) > 2:
        ap.error("at most two revisions")
    rev_a = args.revs[0] if args.revs else "HEAD"
    rev_b = args.revs[1] if len(args.revs) == 2 else None
    with tempfile.TemporaryDirectory() as tmp:
        sides = []
        for i, rev in enumerate([rev_a, rev_b]):
            work = Path(tmp) / str(i)
            work.mkdir()
            sides.append(sass(checkout(rev, work / "src"), args.defines, work))
    a, b = sides
    differ = 0
    for name in sorted(set(a) | set(b)):
        if args.kernel not in name:
            continue
        if name not in a or name not in b:
            print(f"{name}: only in {'the second' if name not in a else 'the first'}")
            differ += 1
        elif a[name] == b[name]:
            print(f"{name}: same ({len(a[name])} instructions)")
        elif sorted(map(normalized, a[name])) == sorted(map(normalized, b[name])):
            print(f"{name}: same up to registers ({len(a[name])} instructions)")
        else:
            ca = collections.Counter(map(opcode, a[name]))
            cb = collections.Counter(map(opcode, b[name]))
            delta = sorted(((cb[k] - ca[k], k) for k in set(ca) | set(cb) if cb[k] != ca[k]), key=lambda d: -abs(d[0]))
            moved = ", ".join(f"{k} {d:+d}" for d, k in delta[:8])
            print(f"{name}: differs, {len(a[name])} -> {len(b[name])} instructions ({moved})")
            differ += 1
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
