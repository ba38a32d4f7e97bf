"""The ``ds4`` command line."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any, Sequence

from . import __version__
from .errors import Ds4Error
from .gguf import GGUFFile


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _short(value: Any, limit: int) -> str:
    if isinstance(value, list):
        shown = ", ".join(_short(v, limit) for v in value[:limit])
        more = f", ... ({len(value)} items)" if len(value) > limit else ""
        return f"[{shown}{more}]"
    if isinstance(value, str):
        text = value if len(value) <= 80 else value[:77] + "..."
        return repr(text)
    return repr(value)


def cmd_info(args: argparse.Namespace) -> int:
    f = GGUFFile(args.file)
    out = sys.stdout
    print(f"{f.path}: GGUF v{f.version}, {_human(f.file_size)}, alignment {f.alignment}, "
          f"data at byte {f.data_offset}", file=out)
    types = f.metadata_types
    print(f"\nmetadata ({len(f.metadata)} keys)", file=out)
    width = max((len(k) for k in f.metadata), default=0)
    for key, value in f.metadata.items():
        print(f"  {key:<{width}}  {types[key]:<14} {_short(value, args.items)}", file=out)

    tensors = list(f.tensors.values())
    print(f"\ntensors ({len(tensors)})", file=out)
    if not args.no_tensors:
        nw = max((len(t.name) for t in tensors), default=4)
        print(f"  {'name':<{nw}}  {'type':<8} {'shape':<24} {'size':>12}", file=out)
        for t in tensors:
            shape = "x".join(str(d) for d in t.shape) or "scalar"
            print(f"  {t.name:<{nw}}  {t.type:<8} {shape:<24} {_human(t.nbytes):>12}", file=out)
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for t in tensors:
        row = by_type[t.type]
        row[0] += 1
        row[1] += t.n_elements
        row[2] += t.nbytes
    print("\nby type", file=out)
    for name, (count, elems, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][2]):
        bpw = 8 * nbytes / elems if elems else 0.0
        print(f"  {name:<8} {count:>6} tensors {elems:>16,d} weights {_human(nbytes):>12}  "
              f"{bpw:.3f} bits/weight", file=out)
    total_e = sum(r[1] for r in by_type.values())
    total_b = sum(r[2] for r in by_type.values())
    print(f"  {'total':<8} {len(tensors):>6} tensors {total_e:>16,d} weights {_human(total_b):>12}",
          file=out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert

    out = convert(args.hf_dir, args.out, dtype=args.dtype, progress=not args.quiet)
    print(out)
    return 0


def cmd_random(args: argparse.Namespace) -> int:
    from .testing import PRESETS, random_model

    random_model(args.out, PRESETS[args.preset.upper()], seed=args.seed, dtype=args.dtype,
                 progress=not args.quiet)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import json

    from .bench import bench

    result = bench(args.model, prompt=args.prompt, decode=args.decode, runs=args.runs)
    print(json.dumps(result.as_dict()) if args.json else result)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds4", description="DeepSeek V4 from GGUF files.")
    p.add_argument("--version", action="version", version=f"ds4 {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print a GGUF file's metadata, tensors and sizes")
    info.add_argument("file", help="path to a .gguf file")
    info.add_argument("--items", type=int, default=8, help="array items to show (default 8)")
    info.add_argument("--no-tensors", action="store_true", help="omit the per-tensor table")
    info.set_defaults(func=cmd_info)
    conv = sub.add_parser("convert", help="convert a Hugging Face DeepSeek V4 checkpoint to GGUF")
    conv.add_argument("hf_dir", help="checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    conv.add_argument("out", help="output .gguf path")
    conv.add_argument("--dtype", choices=["f32", "f16", "bf16", "q8_0"], default="f32",
                      help="output tensor types (default f32; see ds4.convert)")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.set_defaults(func=cmd_convert)
    rnd = sub.add_parser("random", help="write a random-weight model of a preset shape (tests, benchmarks)")
    rnd.add_argument("preset", type=str.upper, choices=["MICRO", "TINY", "MID", "FLASH"], help="model shape")
    rnd.add_argument("out", help="output .gguf path")
    rnd.add_argument("--dtype", choices=["f32", "f16", "bf16", "q8_0", "q2"], default="q8_0",
                     help="tensor types (default q8_0; q2 is ds4's Flash layout)")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    rnd.set_defaults(func=cmd_random)
    b = sub.add_parser("bench", help="measure prefill and decode speed of a model")
    b.add_argument("model", help="path to a deepseek4 .gguf file")
    b.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--decode", type=int, default=32, help="decoded tokens per run (default 32)")
    b.add_argument("--runs", type=int, default=3, help="timed runs; the median is reported (default 3)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (Ds4Error, OSError) as e:
        print(f"ds4: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
