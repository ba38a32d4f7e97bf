"""Speculative decoding throughput against plain decoding on a model (CPU).

    python benches/spec_bench.py MODEL.gguf [--tokens 64] [--runs 3]

Scenarios: an all-reject drafter (the scheduler's guard must keep >= 0.9x plain), the n-gram
drafter on a repetitive prompt (it should win), and an oracle drafter that proposes the true
greedy continuation with each token wrong with probability 1 - a, for a = 0.3, 0.6, 0.9.
Prints decode tokens/s (median of runs), speedup over plain, and the speculation stats.
All runs are greedy, so every speculative run must reproduce the plain tokens (checked).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence

import numpy as np

import ds4


def run(model: ds4.Model, prompt: list[int], n: int, spec: ds4.Speculative | None) -> ds4.Generation:
    return model.session(len(prompt) + n + 32).generate(prompt, max_tokens=n, ignore_eos=True, speculative=spec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--block", type=int, default=5)
    args = ap.parse_args()
    m = ds4.Model.load(args.model)
    vocab = m.vocab_size
    rng = np.random.default_rng(0)
    random_prompt = [int(t) for t in rng.integers(2, vocab, 48)]
    motif = [int(t) for t in rng.integers(2, vocab, 12)]
    repetitive = motif * 4

    def oracle(prompt: list[int], truth: list[int], a: float, seed: int) -> Callable[[list[int]], Sequence[int]]:
        full = prompt + truth
        r = np.random.default_rng(seed)

        def propose(history: list[int]) -> list[int]:
            out = list(full[len(history): len(history) + args.block])
            return [t if r.random() < a else (t + 1) % vocab for t in out]

        return propose

    def measure(prompt: list[int], make: Callable[[], ds4.Speculative | None]) -> tuple[float, ds4.Generation]:
        rates, last = [], None
        for _ in range(args.runs):
            g = run(m, prompt, args.tokens, make())
            rates.append(g.decode_tokens_per_second)
            last = g
        assert last is not None
        return statistics.median(rates), last

    for label, prompt in [("random prompt", random_prompt), ("repetitive prompt", repetitive)]:
        base, ref = measure(prompt, lambda: None)
        print(f"\n{label}: plain {base:.1f} tok/s")
        truth = ref.tokens
        scenarios: list[tuple[str, Callable[[], ds4.Speculative | None]]] = [
            ("all-reject, adaptive", lambda: ds4.Speculative(lambda h: [(t + 1) % vocab for t in truth[:3]],
                                                             max_draft=args.block)),
            ("all-reject, fixed", lambda: ds4.Speculative(lambda h: [(t + 1) % vocab for t in truth[:3]],
                                                          max_draft=args.block, adaptive=False)),
            ("ngram, adaptive", lambda: ds4.Speculative("ngram", max_draft=args.block)),
            ("ngram, fixed", lambda: ds4.Speculative("ngram", max_draft=args.block, adaptive=False)),
        ]
        for a in (0.3, 0.6, 0.9):
            scenarios.append((f"oracle a={a}, adaptive",
                              lambda a=a: ds4.Speculative(oracle(prompt, truth, a, 1), max_draft=args.block)))
            scenarios.append((f"oracle a={a}, fixed",
                              lambda a=a: ds4.Speculative(oracle(prompt, truth, a, 1), max_draft=args.block,
                                                          adaptive=False)))
        for name, make in scenarios:
            rate, g = measure(prompt, make)
            assert g.tokens == truth, f"{name}: speculative output differs from plain"
            st = g.stats
            print(f"  {name:24s} {rate:8.1f} tok/s  x{rate / base:5.2f}  accept {st.acceptance_rate:5.1%}  "
                  f"{st.mean_accepted_length:4.2f} tok/cycle  cycles {st.num_drafts:3d}  plain steps "
                  f"{st.num_plain_steps:3d}")


if __name__ == "__main__":
    main()
