"""Speculative decoding: exactly the plain output, exactly the plain state.

Drafters are driven by hypothesis: an oracle that proposes the true greedy continuation with
errors injected at chosen positions, random drafters, drafters that propose EOS, and the
n-gram drafter; on the golden models."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4
from conftest import GOLDEN, LLAMACPP_TINY_L

EOS = 1


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ds4.Model]:
    d = tmp_path_factory.mktemp("spec")
    out = {"tiny-l": ds4.Model.load(LLAMACPP_TINY_L)}
    ds4.convert(GOLDEN / "tiny-a", d / "tiny-a.gguf", progress=False)
    out["tiny-a"] = ds4.Model.load(d / "tiny-a.gguf")
    return out


def prompts(name: str) -> list[list[int]]:
    g = np.load(GOLDEN / name / "golden.npz")
    return [g[k].tolist() for k in sorted(g.files) if k.startswith("prompt_")]


class Oracle:
    """Proposes the true continuation (from a reference run), wrong at chosen draft depths."""

    def __init__(self, prompt: list[int], truth: list[int], wrong_at: set[int], vocab: int, k: int) -> None:
        self.full = prompt + truth
        self.wrong_at = wrong_at
        self.vocab = vocab
        self.k = k
        self.calls = 0

    def __call__(self, history: list[int]) -> list[int]:
        self.calls += 1
        n = len(history)
        out = list(self.full[n : n + self.k])
        for i in range(len(out)):
            if (self.calls + i) % 7 in self.wrong_at:
                out[i] = (out[i] + 1 + i) % self.vocab
        return out


def plain(model: ds4.Model, prompt: list[int], **kw: object) -> tuple[ds4.Generation, ds4.Session]:
    s = model.session(1024)
    return s.generate(prompt, **kw), s  # type: ignore[arg-type]


def check_identical(model: ds4.Model, prompt: list[int], drafter: ds4.Speculative, **kw: object) -> ds4.Generation:
    want, ps = plain(model, prompt, **kw)
    s = model.session(1024)
    got = s.generate(prompt, speculative=drafter, **kw)  # type: ignore[arg-type]
    assert got.tokens == want.tokens
    assert got.text == want.text and got.finish_reason == want.finish_reason
    # The state is exactly the one plain decoding leaves: same position, tokens, rings,
    # compressor frontiers, emitted rows and random stream...
    assert s.position == ps.position and s.tokens == ps.tokens
    assert s.digest() == ps.digest()
    # ...so the next logits agree bit for bit.
    nxt = got.tokens[-1]
    assert np.array_equal(s.eval([nxt]).view(np.uint32), ps.eval([nxt]).view(np.uint32))
    return got


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(["tiny-l", "tiny-a"]), which=st.integers(0, 3), block=st.integers(1, 8),
       wrong_at=st.sets(st.integers(0, 6), max_size=4), max_tokens=st.integers(1, 40),
       use_stop=st.booleans(), adaptive=st.booleans())
def test_greedy_identity_oracle(models: dict[str, ds4.Model], name: str, which: int, block: int,
                                wrong_at: set[int], max_tokens: int, use_stop: bool, adaptive: bool) -> None:
    m = models[name]
    ps = prompts(name)
    prompt = ps[which % len(ps)]
    truth = m.session(1024).generate(prompt, max_tokens=60, ignore_eos=True).tokens
    kw: dict[str, object] = {"max_tokens": max_tokens}
    if use_stop:
        tok = m.tokenizer
        assert tok is not None
        text = tok.decode(truth[:30])
        if len(text) > 12:
            kw["stop"] = [text[8:11]]
    oracle = Oracle(prompt, truth, wrong_at, m.vocab_size, block)
    check_identical(m, prompt, ds4.Speculative(oracle, max_draft=block, adaptive=adaptive), **kw)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), block=st.integers(1, 8), eos_rate=st.floats(0, 1))
def test_greedy_identity_random_and_eos_drafters(models: dict[str, ds4.Model], seed: int, block: int,
                                                 eos_rate: float) -> None:
    m = models["tiny-l"]
    rng = np.random.default_rng(seed)

    def drafter(history: list[int]) -> list[int]:
        n = int(rng.integers(0, block + 1))
        return [EOS if rng.random() < eos_rate else int(rng.integers(0, m.vocab_size)) for _ in range(n)]

    check_identical(m, prompts("tiny-l")[1], ds4.Speculative(drafter, max_draft=block, adaptive=False), max_tokens=30)


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8])
def test_greedy_identity_ngram(models: dict[str, ds4.Model], block: int) -> None:
    m = models["tiny-l"]
    # A repetitive prompt, so the n-gram drafter has something to find.
    base = prompts("tiny-l")[0]
    prompt = base + base[1:] + base[1:] + base[1:]
    for adaptive in (False, True):
        g = check_identical(m, prompt, ds4.Speculative("ngram", max_draft=block, adaptive=adaptive),
                            max_tokens=48, ignore_eos=True)
        assert g.stats.num_drafts + g.stats.num_plain_steps > 0


def test_worst_argmax_gap_is_zero(models: dict[str, ds4.Model]) -> None:
    # Teacher-force the speculative output through plain one-token decode: every committed
    # token must be exactly the argmax of the logits before it.
    m = models["tiny-l"]
    prompt = prompts("tiny-l")[2]
    truth = m.session(1024).generate(prompt, max_tokens=40, ignore_eos=True).tokens
    spec = ds4.Speculative(Oracle(prompt, truth, {1, 4}, m.vocab_size, 6), max_draft=6, adaptive=False)
    out = m.session(1024).generate(prompt, max_tokens=40, ignore_eos=True, speculative=spec)
    s = m.session(1024)
    logits = s.eval(prompt)[-1]
    worst = 0.0
    for t in out.tokens:
        worst = max(worst, float(logits.max() - logits[t]))
        logits = s.eval([t])[0]
    assert worst == 0.0
    assert out.stats.num_accepted_tokens > 0 and out.stats.num_draft_tokens > out.stats.num_accepted_tokens


def check_verify_then_keep(m: ds4.Model, name: str) -> None:
    """Session.verify is Session.eval of the same tokens, bit for bit (logits, and with greedy
    each row's argmax); keep(n) leaves the session bit for bit as if only the first n had been
    evaluated: the same digest, and the same logits for what follows. (The reference
    evaluates the prompt and the kept tokens in separate calls, as the verify's session did:
    on CUDA a call of more than 16 tokens is a prompt's, whose rows are not a decode's bits.)"""
    prompt = prompts(name)[0]
    draft = [int(t) for t in np.random.default_rng(7).integers(2, m.vocab_size, 5)]
    s = m.session(512)
    s.eval(prompt, logits="none")
    snap = s.snapshot()
    plain = s.eval(draft)
    s.restore(snap)
    v = s.verify(draft)
    assert v.rows == 5 and v.ids is None and v.logits is not None
    assert np.array_equal(v.logits.view(np.uint32), plain.view(np.uint32))
    s.restore(snap)
    g = s.verify(draft, greedy=True)
    assert g.logits is None and g.ids == [int(i) for i in plain.argmax(axis=1)]
    nxt = [3]
    for n in range(len(draft) + 1):
        s.restore(snap)
        s.verify(draft, greedy=n % 2 == 1).keep(n)
        ref = m.session(512)
        ref.eval(prompt, logits="none")
        if n:
            ref.eval(draft[:n], logits="none")
        assert s.position == ref.position == len(prompt) + n
        assert s._native.digest() == ref._native.digest()
        assert np.array_equal(s.eval(nxt).view(np.uint32), ref.eval(nxt).view(np.uint32))


def check_python_speculative_loop(m: ds4.Model) -> None:
    """The README's loop over Session.verify and keep, with drafts right and wrong at random
    depths: exactly the plain greedy tokens, and the plain session's state."""
    prompt = prompts("tiny-l")[1]
    truth = m.session(1024).generate(prompt, max_tokens=30, ignore_eos=True).tokens
    rng = np.random.default_rng(5)
    s = m.session(1024)
    anchor = int(s.eval(prompt, logits="last")[-1].argmax())
    out = [anchor]
    while len(out) < len(truth):
        at = len(out)
        draft = [truth[at + i] if at + i < len(truth) and rng.random() < 0.75 else int(rng.integers(2, m.vocab_size))
                 for i in range(int(rng.integers(1, 6)))]
        v = s.verify([anchor, *draft], greedy=True)
        assert v.ids is not None
        n = next((i for i, t in enumerate(draft) if t != v.ids[i]), len(draft))
        v.keep(n + 1)
        anchor = v.ids[n]
        out += [*draft[:n], anchor]
    assert out[:len(truth)] == truth
    plain = m.session(1024)
    plain.eval(prompt, logits="none")
    for i in range(0, len(out) - 1, 8):  # decode-sized calls, as the loop's
        plain.eval(out[i:min(i + 8, len(out) - 1)], logits="none")
    assert s._native.digest() == plain._native.digest()


@pytest.mark.parametrize("name", ["tiny-l", "tiny-a"])
def test_verify_then_keep_is_eval_of_the_kept_prefix(models: dict[str, ds4.Model], name: str) -> None:
    check_verify_then_keep(models[name], name)


def test_a_python_speculative_loop_is_greedy_decoding(models: dict[str, ds4.Model]) -> None:
    check_python_speculative_loop(models["tiny-l"])


def test_verify_errors_change_nothing(models: dict[str, ds4.Model]) -> None:
    m = models["tiny-l"]
    s = m.session(512)
    s.eval(prompts("tiny-l")[0], logits="none")
    before = (s.position, s._native.digest())
    assert s.max_verify == 17  # on the host: a draft of 16 after its anchor
    for bad in ([], list(range(2, 20)), [m.vocab_size]):
        with pytest.raises(ValueError):
            s.verify(bad)
        assert (s.position, s._native.digest()) == before
    v = s.verify([5, 6, 7])
    with pytest.raises(ValueError, match="0..=3"):
        v.keep(4)
    with pytest.raises(ValueError):
        v.keep(-1)
    v.keep(1)  # still possible after the refused ones
    with pytest.raises(ValueError, match="already kept"):
        v.keep(0)
    assert s.position == before[0] + 1
    # Once the session changes, a verification can no longer cut it: after an eval, and after
    # a restore to a state of the same length (whose rows the verify never wrote).
    v = s.verify([8, 9])
    s.eval([10])
    at = (s.position, s._native.digest())
    with pytest.raises(ValueError, match="changed"):
        v.keep(0)
    assert (s.position, s._native.digest()) == at
    snap = s.snapshot()
    v = s.verify([11, 12])
    s.restore(snap)
    s.eval([13, 14])
    at = (s.position, s._native.digest())
    with pytest.raises(ValueError, match="changed"):
        v.keep(0)
    assert (s.position, s._native.digest()) == at


def test_stats(models: dict[str, ds4.Model]) -> None:
    m = models["tiny-l"]
    prompt = prompts("tiny-l")[1]
    truth = m.session(1024).generate(prompt, max_tokens=30, ignore_eos=True).tokens
    perfect = m.session(1024).generate(prompt, max_tokens=30, ignore_eos=True,
                                       speculative=ds4.Speculative(Oracle(prompt, truth, set(), m.vocab_size, 4),
                                                                   max_draft=4, adaptive=False))
    st_ = perfect.stats
    assert st_.acceptance_rate == 1.0 and st_.mean_accepted_length == 5.0
    assert st_.num_drafts * 5 >= 29 and st_.accepted_per_pos[:4] == [st_.num_drafts] * 4
    reject = m.session(1024).generate(prompt, max_tokens=30, ignore_eos=True,
                                      speculative=ds4.Speculative(lambda h: [(t + 1) % 512 for t in truth[:3]],
                                                                  max_draft=3, adaptive=False))
    assert reject.tokens == truth and reject.stats.num_accepted_tokens <= 3
    none = m.session(1024).generate(prompt, max_tokens=5)
    assert none.stats == ds4.SpecStats()


def chi2_sf(stat: float, dof: int) -> float:
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def chi2_pvalue(counts: dict[int, int], ids: np.ndarray, probs: np.ndarray) -> float:
    n = sum(counts.values())
    assert set(counts) <= set(ids.tolist())
    exp = probs * n
    obs = np.array([counts.get(int(i), 0) for i in ids], dtype=float)
    big = exp >= 5
    o = np.append(obs[big], obs[~big].sum())
    e = np.append(exp[big], exp[~big].sum())
    keep = e > 0
    dof = int(keep.sum()) - 1
    assert dof >= 1
    return chi2_sf(float((((o - e) ** 2)[keep] / e[keep]).sum()), dof)


@pytest.mark.parametrize("acceptance", ["low", "high"])
def test_temperature_sampling_is_exact(models: dict[str, ds4.Model], acceptance: str) -> None:
    # The first and second generated tokens follow the target distribution, whatever the
    # drafter proposes (top-k limited so the test has power).
    m = models["tiny-l"]
    prompt = prompts("tiny-l")[0]
    params = dict(temperature=1.0, top_k=6)
    s = m.session(64)
    s.eval(prompt[:-1])
    snap = s.snapshot()
    p1_logits = m.session(64).eval(prompt)[-1]
    ids1, p1 = ds4.Sampling(**params, seed=0).sampler().distribution(p1_logits)  # type: ignore[arg-type]
    top = int(ids1[np.argmax(p1)])
    p2_logits = m.session(64).eval(prompt + [top])[-1]
    ids2, p2 = ds4.Sampling(**params, seed=0).sampler().distribution(p2_logits)  # type: ignore[arg-type]
    best2 = int(ids2[np.argmax(p2)])

    def drafter(history: list[int]) -> Sequence[int]:
        if acceptance == "high":  # the likeliest tokens: accepted often
            return [top, best2] if len(history) == len(prompt) else [best2]
        return [int(ids1[np.argmin(p1)]), 3]  # unlikely tokens: mostly rejected

    first: dict[int, int] = {}
    second: dict[int, int] = {}
    n = 2500
    spec = ds4.Speculative(drafter, max_draft=2, adaptive=False)
    for seed in range(n):
        s.restore(snap)
        g = s.generate(prompt[-1:], max_tokens=2, ignore_eos=True, speculative=spec,
                       sampling=ds4.Sampling(**params, seed=seed))  # type: ignore[arg-type]
        first[g.tokens[0]] = first.get(g.tokens[0], 0) + 1
        if g.tokens[0] == top:
            second[g.tokens[1]] = second.get(g.tokens[1], 0) + 1
    assert chi2_pvalue(first, ids1, p1) > 1e-6
    assert sum(second.values()) > 200 and chi2_pvalue(second, ids2, p2) > 1e-6


def test_seed_reproducible_with_speculation(models: dict[str, ds4.Model]) -> None:
    m = models["tiny-l"]
    prompt = prompts("tiny-l")[1]
    spec = ds4.Speculative("ngram", max_draft=4)
    warm = ds4.Sampling(temperature=0.9, seed=11)
    a = m.session(512).generate(prompt, max_tokens=30, sampling=warm, speculative=spec)
    b = m.session(512).generate(prompt, max_tokens=30, sampling=warm, speculative=spec)
    assert a.tokens == b.tokens


def test_drafter_failure_is_atomic(models: dict[str, ds4.Model]) -> None:
    m = models["tiny-l"]
    prompt = prompts("tiny-l")[1]
    truth = m.session(1024).generate(prompt, max_tokens=40, ignore_eos=True).tokens
    oracle = Oracle(prompt, truth, {2}, m.vocab_size, 3)
    calls = {"n": 0}

    class Boom(RuntimeError):
        pass

    def drafter(history: list[int]) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 4:
            raise Boom("drafter failed")
        return oracle(history)

    s = m.session(1024)
    stream = s.stream(prompt, max_tokens=40, ignore_eos=True, speculative=ds4.Speculative(drafter, max_draft=3,
                                                                                          adaptive=False))
    seen: list[int] = []
    with pytest.raises(Boom, match="drafter failed"):
        for chunk in stream:
            seen.extend(chunk.tokens)
    # The session is exactly as before the failed cycle: the tokens returned so far, each
    # evaluated, as plain decoding would have left them.
    ref = m.session(1024)
    ref.generate(prompt + seen, max_tokens=1)  # evaluates them; its greedy sampler draws nothing
    assert s.tokens == prompt + seen and s.digest() == ref.digest()
    with pytest.raises(ValueError, match="failed earlier"):
        next(stream)
    bad = ds4.Speculative(lambda h: [-5], max_draft=2, adaptive=False)
    with pytest.raises(ValueError, match="not a token id"):
        m.session(1024).generate(prompt, max_tokens=5, speculative=bad)
    with pytest.raises(ValueError):
        ds4.Speculative("eagle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_draft"):
        ds4.Speculative("ngram", max_draft=0)


def test_cli_spec(models: dict[str, ds4.Model]) -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ds4", *args], capture_output=True, text=True, timeout=120)

    plain_out = run("generate", str(LLAMACPP_TINY_L), "the the the the the", "--max-tokens", "12", "-q")
    spec_out = run("generate", str(LLAMACPP_TINY_L), "the the the the the", "--max-tokens", "12", "--spec", "ngram",
                   "--block", "3", "--fixed-block", "--stats")
    assert spec_out.returncode == 0, spec_out.stderr
    assert spec_out.stdout == plain_out.stdout
    assert "[speculative:" in spec_out.stderr and "accepted per position" in spec_out.stderr
    b = run("bench", str(LLAMACPP_TINY_L), "--prompt", "32", "--decode", "4", "--runs", "1", "--spec", "ngram",
            "--repetitive")
    assert b.returncode == 0, b.stderr
    assert "generate: speculative" in b.stdout and "plain" in b.stdout
    assert "backend cpu, host forward pass" in b.stdout
