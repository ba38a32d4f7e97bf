"""Fill the routed experts of a GGUF benchmark file with pseudo-random blocks, in place.

The synthetic full-size Flash file (gen_flash_q2_gguf.py) stores its weights as a sparse hole
of zeros, so that 81 GB fit on any disk. Zero expert blocks make the IQ2_XXS kernels read one
lattice entry for every group, which real weights never do: lookups spread over the shared
memory banks, and the kernels' time depends on it (shaders/cuda/iq2_xxs.cu). This writes
pseudo-random quant bytes, with small finite scales, into the routed expert tensors
(``blk.N.ffn_{gate,up,down}_exps.weight``) of the first layers that the disk has room for
(or of ``--layers``), so that timings see realistic lookups; the rest stay zero. Routing and
every other tensor are left as they are.

    python scripts/fill_experts.py FILE.gguf [--layers K] [--reserve-gib G]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

import numpy as np

import ds4

# Bytes of a block, and the offsets of its f16 scales, for the expert formats.
BLOCKS = {"IQ2_XXS": (66, (0,)), "Q2_K": (84, (80, 82)), "Q8_0": (34, (0,))}
EXPERTS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def pattern(kind: str, rng: np.random.Generator, blocks: int = 1 << 20) -> bytes:
    """`blocks` pseudo-random blocks of `kind` whose scales are all 1e-3."""
    size, scales = BLOCKS[kind]
    a = rng.integers(0, 256, size=(blocks, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(1e-3).tobytes(), dtype=np.uint8)
    for at in scales:
        a[:, at : at + 2] = d
    return a.tobytes()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=None, help="fill at most this many layers")
    ap.add_argument("--reserve-gib", type=float, default=6.0, help="disk to leave free")
    args = ap.parse_args()

    f = ds4.GGUFFile(args.path)
    n_layers = int(f.metadata["deepseek4.block_count"])
    layers: list[list[ds4.TensorInfo]] = []
    for il in range(n_layers):
        names = [f"blk.{il}.{n}" for n in EXPERTS]
        if not all(n in f.tensors for n in names):
            break
        layers.append([f.tensors[n] for n in names])
    if not layers:
        print(f"{args.path}: no routed expert tensors", file=sys.stderr)
        return 1
    for t in layers[0]:
        if t.type not in BLOCKS:
            print(f"{args.path}: {t.name} is {t.type}, not one of {', '.join(BLOCKS)}", file=sys.stderr)
            return 1
    per_layer = sum(t.nbytes for t in layers[0])
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(args.path))).free
    k = int(max(0, free - args.reserve_gib * 2**30) // per_layer)
    k = min(k, len(layers), args.layers if args.layers is not None else len(layers))
    print(f"filling the routed experts of {k} of {n_layers} layers ({per_layer / 2**30:.2f} GiB each)")
    if args.layers is not None and k < min(args.layers, len(layers)):
        # A sparse file takes disk as its holes are filled: say why fewer layers than asked.
        print(
            f"only {free / 2**30:.1f} GiB free, {args.reserve_gib:g} GiB kept in reserve (--reserve-gib)",
            file=sys.stderr,
        )

    rng = np.random.default_rng(19)
    pats = {kind: pattern(kind, rng) for kind in {t.type for t in layers[0]}}
    fd = os.open(args.path, os.O_WRONLY)
    try:
        for infos in layers[:k]:
            for t in infos:
                pat, done = pats[t.type], 0
                while done < t.nbytes:
                    m = min(len(pat), t.nbytes - done)
                    os.pwrite(fd, pat[:m], t.offset + done)
                    done += m
    finally:
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
