"""The ``ds4`` command line."""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from typing import Any, Sequence

from . import __version__
from .errors import Ds4Error, UnsupportedModelError
from .gguf import GGUFFile
from .model import Generation, Model, Session
from .sampling import Sampling
from .speculative import MAX_DRAFT, Speculative
from .tokenizer import render_chat


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
    from .convert import convert, convert_draft

    if args.draft_of is not None:
        out = convert_draft(args.hf_dir, args.out, target=args.draft_of, dtype=args.dtype, progress=not args.quiet)
    else:
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

    spec = _speculative(args)
    result = bench(args.model, prompt=args.prompt, decode=args.decode, runs=args.runs, speculative=spec,
                   repetitive=args.repetitive, draft=args.draft, backend=args.backend)
    print(json.dumps(result.as_dict()) if args.json else result)
    return 0


def _sampling(args: argparse.Namespace) -> Sampling:
    return Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                    seed=args.seed)


def _load(path: str, draft: str | None = None, backend: str = "auto") -> Model:
    model = Model.load(path, draft=draft, backend=backend)  # type: ignore[arg-type]
    if model.tokenizer is None:
        raise UnsupportedModelError(f"{path} has no tokenizer metadata: generation needs one")
    return model


def _continue(session: Session, ids: list[int]) -> list[int]:
    """The part of ``ids`` the session still has to evaluate: reuses the session's tokens
    when they are a prefix of ``ids`` (minus the last one, which must be evaluated for its
    logits), else starts over."""
    held = session.tokens
    if len(held) < len(ids) and ids[: len(held)] == held:
        return ids[len(held):]
    session.reset()
    return ids


def _block(text: str) -> int:
    """--block: an int in Speculative's range, so that the message names the option."""
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= k <= MAX_DRAFT:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_DRAFT}, got {k}")
    return k


def _speculative(args: argparse.Namespace) -> Speculative | None:
    if args.spec is None:
        return None
    return Speculative(args.spec, max_draft=args.block, adaptive=not args.fixed_block)


def _run(session: Session, prompt: str | list[int], args: argparse.Namespace) -> Generation:
    stream = session.stream(prompt, max_tokens=args.max_tokens, sampling=_sampling(args), stop=args.stop,
                            speculative=_speculative(args))
    for chunk in stream:
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
    return stream.generation()


def _stats(g: Generation, spec: bool = False) -> str:
    line = (f"[{g.finish_reason}; prompt {g.prompt_tokens} tokens at {g.prefill_tokens_per_second:.1f} tok/s, "
            f"generated {len(g.tokens)} at {g.decode_tokens_per_second:.1f} tok/s]")
    if spec:
        st = g.stats
        line += (f"\n[speculative: {st.num_drafts} verify cycles, {st.num_draft_tokens} drafted, "
                 f"{st.num_accepted_tokens} accepted ({st.acceptance_rate:.1%}), "
                 f"{st.mean_accepted_length:.2f} tokens/cycle, {st.num_plain_steps} plain steps, "
                 f"accepted per position {st.accepted_per_pos}]")
    return line


def cmd_generate(args: argparse.Namespace) -> int:
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    model = _load(args.model, args.draft, args.backend)
    if args.chat:
        text = render_chat([{"role": "user", "content": text}], thinking=args.think)
    session = model.session(args.ctx)
    g = _run(session, text, args)
    sys.stdout.write("\n")
    if not args.quiet:
        print(_stats(g, args.stats), file=sys.stderr)
    return 0


CHAT_HELP = "commands: /reset (new conversation), /think (toggle thinking), /exit"


def cmd_chat(args: argparse.Namespace) -> int:
    model = _load(args.model, args.draft, args.backend)
    tok = model.tokenizer
    assert tok is not None
    session = model.session(args.ctx)
    messages: list[dict[str, str]] = []
    thinking = args.think
    print(f"ds4 chat ({'thinking' if thinking else 'no thinking'}); {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            messages.clear()
            session.reset()
            print("(new conversation)", file=sys.stderr)
            continue
        if cmd == "/think":
            thinking = not thinking
            print(f"(thinking {'on' if thinking else 'off'})", file=sys.stderr)
            continue
        if not cmd:
            continue
        messages.append({"role": "user", "content": line})
        ids = tok.encode(render_chat(messages, thinking=thinking), allow_special=True)
        g = _run(session, _continue(session, ids), args)
        print(file=sys.stdout)
        if not args.quiet:
            print(_stats(g, args.stats), file=sys.stderr)
        messages.append({"role": "assistant", "content": g.text})


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("model", help="path to a deepseek4 .gguf file (with tokenizer metadata)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * p_max (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: a fresh one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ctx", type=int, default=4096, help="context size in tokens (default 4096)")
    p.add_argument("--think", action="store_true", help="thinking mode in the chat template")
    p.add_argument("-q", "--quiet", action="store_true", help="no statistics on stderr")
    _add_speculation(p, backend="auto")
    p.add_argument("--stats", action="store_true", help="print speculation statistics on stderr")


def _add_speculation(p: argparse.ArgumentParser, backend: str) -> None:
    """The drafter, block and backend options of generate, chat and bench."""
    p.add_argument("--spec", choices=["ngram", "mtp", "dspark"], default=None,
                   help="speculative decoding with this drafter (mtp/dspark: the model's, see --draft)")
    p.add_argument("--draft", default=None, help="drafter support GGUF (MTP or DSpark) for --spec mtp|dspark")
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"], default=backend,
                   help=f"where the matrix products run (default {backend}; auto: CUDA if a GPU is usable)")
    p.add_argument("--block", type=_block, default=5,
                   help=f"most draft tokens verified per cycle, 1..{MAX_DRAFT} (default 5)")
    p.add_argument("--fixed-block", action="store_true", help="always verify what the drafter offers (no scheduler)")


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
    conv.add_argument("--draft-of", metavar="TARGET_HF_DIR", default=None,
                      help="hf_dir holds drafter weights (MTP or DSpark) of this target: write a support file")
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
    gen = sub.add_parser("generate", help="generate text from a prompt (argument or stdin), streaming")
    _add_sampling(gen, 256)
    gen.add_argument("prompt", nargs="?", help="the prompt (default: read stdin)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn of the chat template")
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive multi-turn chat (" + CHAT_HELP + ")")
    _add_sampling(chat, 1024)
    chat.set_defaults(func=cmd_chat)
    b = sub.add_parser("bench", help="measure prefill and decode speed of a model")
    b.add_argument("model", help="path to a deepseek4 .gguf file")
    b.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    b.add_argument("--decode", type=int, default=32, help="decoded tokens per run (default 32)")
    b.add_argument("--runs", type=int, default=3, help="timed runs; the median is reported (default 3)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    _add_speculation(b, backend="cpu")
    b.add_argument("--repetitive", action="store_true", help="a prompt repeating a 16-token motif")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (Ds4Error, OSError, ValueError) as e:
        print(f"ds4: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
