"""Builds ds4's CUDA kernel program as the engine does, for the kernel lab and register checks.

    python scripts/kernel_lab/build_ptx.py OUT.ptx [-D NAME=VALUE ...] [--file NAME=PATH ...]
                                           [--regs FILTER]

Concatenates shaders/cuda/ in the order of rust/engine/backend/cuda/context.rs `SOURCES`, with
the IQ2_XXS table emitted from rust/engine/quant/tables.rs after the shared header, compiles it
with NVRTC for compute_90 with the engine's default options (--fmad=false, C++17,
-D DS4_PDL_EARLY; --no-early drops the last) plus the -D options,
and writes OUT.ptx; `--file q8_0.cu=variant.cu` replaces one source file. With ptxas at hand
(PTXAS, or on PATH) it also writes OUT.cubin for sm_90 and prints each kernel's registers and
spills (those whose name contains FILTER, default ds4_mv_). NVRTC: the library at $NVRTC, or
libnvrtc.so.12 / .13 found by the loader.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def sources() -> list[str]:
    ctx = (ROOT / "rust/engine/backend/cuda/context.rs").read_text()
    block = ctx[ctx.index("pub(crate) const SOURCES"):]
    return re.findall(r'\("([\w.]+)", include_str!', block[: block.index("];")])


def grid_table() -> str:
    tables = (ROOT / "rust/engine/quant/tables.rs").read_text()
    body = tables[tables.index("IQ2XXS_GRID: [u64; 256] = [") :]
    values = re.findall(r"0x[0-9a-f]+", body[: body.index("];")])[:256]
    return "__device__ const unsigned long long iq2xxs_grid[256] = {" + ", ".join(v + "ull" for v in values) + "};\n"


def program(replace: dict[str, str]) -> str:
    out = []
    for i, name in enumerate(sources()):
        if i == 1:
            out.append(grid_table())
        out.append(Path(replace.get(name, ROOT / "shaders/cuda" / name)).read_text() + "\n")
    return "".join(out)


def nvrtc() -> ctypes.CDLL:
    for cand in [os.environ.get("NVRTC", ""), "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]:
        if cand:
            try:
                return ctypes.CDLL(cand)
            except OSError:
                pass
    sys.exit("NVRTC not found: set NVRTC to the path of libnvrtc.so")


def compile_ptx(src: str, defines: list[str]) -> bytes:
    lib = nvrtc()
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"ds4_kernels.cu", 0, None, None) != 0:
        sys.exit("nvrtcCreateProgram failed")
    opts = [b"--gpu-architecture=compute_90", b"--std=c++17", b"--fmad=false"] + [b"-D" + d.encode() for d in defines]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        sys.exit(log.value.decode())
    size = ctypes.c_size_t()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("-D", dest="defines", action="append", default=[])
    ap.add_argument("--file", action="append", default=[], help="NAME=PATH: use PATH for shaders/cuda/NAME")
    ap.add_argument("--regs", default="ds4_mv_")
    ap.add_argument("--no-early", action="store_true", help="without the engine's -D DS4_PDL_EARLY")
    args = ap.parse_args()
    defines = args.defines if args.no_early else ["DS4_PDL_EARLY", *args.defines]
    replace = dict(f.split("=", 1) for f in args.file)
    out = Path(args.out)
    out.write_bytes(compile_ptx(program(replace), defines))
    ptxas = os.environ.get("PTXAS") or shutil.which("ptxas")
    if not ptxas:
        return
    res = subprocess.run([ptxas, "-arch=sm_90", "-v", str(out), "-o", str(out.with_suffix(".cubin"))],
                         capture_output=True, text=True)
    kernel = None
    for line in res.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            kernel = m.group(1)
        elif kernel and args.regs in kernel and ("registers" in line or "spill" in line):
            print(kernel, line.split("info    :")[-1].strip())


if __name__ == "__main__":
    main()
