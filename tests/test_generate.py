"""Generation: the sampling loop, stop conditions, seeds and the CLI, on the golden tiny-l
model (llama.cpp's GGUF, which carries the fixtures' toy tokenizer)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import ds4
from conftest import GOLDEN, LLAMACPP_TINY_L


@pytest.fixture(scope="module")
def model() -> ds4.Model:
    return ds4.Model.load(LLAMACPP_TINY_L)


def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN / "tiny-l" / "golden.npz"))


def test_greedy_generation_reproduces_golden(model: ds4.Model) -> None:
    g = golden()
    for i in range(3):
        want = g[f"greedy_{i}"].tolist()
        out = model.session(1024).generate(g[f"prompt_{i}"].tolist(), max_tokens=len(want), ignore_eos=True)
        assert out.tokens == want
        stopped = model.session(1024).generate(g[f"prompt_{i}"].tolist(), max_tokens=len(want))
        if 1 in want:  # the toy model samples EOS (id 1) on the way
            assert stopped.finish_reason == "eos" and stopped.tokens == want[: want.index(1) + 1]
        assert out.finish_reason == "length"
        assert out.prompt_tokens == len(g[f"prompt_{i}"])
        tok = model.tokenizer
        assert tok is not None and out.text == tok.decode(want)
    assert any(1 in g[f"greedy_{i}"].tolist() for i in range(3))


def test_stream_chunks_add_up(model: ds4.Model) -> None:
    s = model.session(256)
    stream = s.stream("The quick brown fox", max_tokens=30)
    chunks = list(stream)
    g = stream.generation()
    assert [t for c in chunks for t in c.tokens] == g.tokens and len(g.tokens) == 30
    assert "".join(c.text for c in chunks) == g.text
    # The finishing token is returned but not evaluated.
    assert s.position == g.prompt_tokens + 29 and s.tokens[-1] == g.tokens[-2]


def test_prompt_text_gets_bos_once(model: ds4.Model) -> None:
    s = model.session(256)
    s.generate("hello", max_tokens=1)
    assert s.tokens[0] == 0 and s.tokens.count(0) == 1
    s.generate(" more", max_tokens=1)  # not a fresh context: no second BOS
    assert s.tokens.count(0) == 1


def test_stop_strings_across_token_boundaries(model: ds4.Model) -> None:
    tok = model.tokenizer
    assert tok is not None
    prompt = golden()["prompt_1"].tolist()
    free = model.session(1024).generate(prompt, max_tokens=40)
    pieces = [tok.decode([t]) for t in free.tokens]
    # A stop string made of the end of token 10 and the start of token 11.
    a, b = pieces[10], pieces[11]
    assert a and b and "\ufffd" not in a + b
    stop = a[-1:] + b[:1]
    where = free.text.find(stop)
    out = model.session(1024).generate(prompt, max_tokens=40, stop=["zzzz-never", stop])
    assert out.finish_reason == "stop"
    assert out.text == free.text[:where]
    assert out.tokens == free.tokens[: len(out.tokens)]
    # The stream never released text past the stop string.
    s = model.session(1024).stream(prompt, max_tokens=40, stop=stop)
    assert "".join(c.text for c in s) == free.text[:where]


def test_seeds_snapshots_and_the_session_stream(model: ds4.Model) -> None:
    prompt = golden()["prompt_0"].tolist()
    warm = ds4.Sampling(temperature=1.2, top_k=50, seed=7)
    a = model.session(256).generate(prompt, max_tokens=24, sampling=warm).tokens
    b = model.session(256).generate(prompt, max_tokens=24, sampling=warm).tokens
    c = model.session(256).generate(prompt, max_tokens=24, sampling=ds4.Sampling(temperature=1.2, top_k=50, seed=8)).tokens
    assert a == b and a != c
    # Snapshot/restore rewinds both the state and the random stream.
    s = model.session(256)
    s.eval(prompt)
    snap = s.snapshot()
    x = s.generate([5], max_tokens=16, sampling=warm).tokens
    s.restore(snap)
    assert s.generate([5], max_tokens=16, sampling=warm).tokens == x
    # The stream is not reseeded per call: a second call with the same seed continues it.
    s.restore(snap)
    first = s.generate([5], max_tokens=8, sampling=warm).tokens
    s.restore(snap)
    s2 = model.session(256)
    s2.eval(prompt)
    s2.generate([5], max_tokens=8, sampling=warm)  # consumes the stream
    s2.restore(snap)  # a snapshot from another session: state and stream come back
    assert s2.generate([5], max_tokens=8, sampling=warm).tokens == first


def chi2_sf(stat: float, dof: int) -> float:
    """Survival function of the chi-square distribution (Wilson-Hilferty approximation)."""
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("params", [
    dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.3, top_p=0.8), dict(min_p=0.2),
])
def test_first_token_distribution(model: ds4.Model, params: dict[str, float]) -> None:
    # Sample the first generated token from many fresh seeds and compare the frequencies
    # with the distribution the sampler defines for the model's logits.
    prompt = golden()["prompt_0"].tolist()
    logits = model.session(64).eval(prompt)[-1]
    ids, probs = ds4.Sampling(**params, seed=0).sampler().distribution(logits)  # type: ignore[arg-type]
    n = 3000
    s = model.session(64)
    s.eval(prompt[:-1])
    snap = s.snapshot()
    counts: dict[int, int] = {}
    for seed in range(n):
        s.restore(snap)
        t = s.generate(prompt[-1:], max_tokens=1, sampling=ds4.Sampling(**params, seed=seed)).tokens[0]  # type: ignore[arg-type]
        counts[t] = counts.get(t, 0) + 1
    assert set(counts) <= set(ids.tolist())
    expected = probs * n
    # Pool tokens with small expected counts into one bin.
    big = expected >= 5
    observed = np.array([counts.get(int(i), 0) for i in ids])
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert dof >= 1 and chi2_sf(stat, dof) > 1e-6, (stat, dof)


def test_eos_ends_generation(model: ds4.Model, tmp_path: Path) -> None:
    # Make the first greedy token of a prompt the EOS id of a copy of the model.
    prompt = golden()["prompt_1"].tolist()
    first = model.session(256).generate(prompt, max_tokens=1).tokens[0]
    r = gguf.GGUFReader(LLAMACPP_TINY_L)
    path = tmp_path / "eos.gguf"
    w = gguf.GGUFWriter(path, arch="deepseek4")
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = first if key == "tokenizer.ggml.eos_token_id" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = ds4.Model.load(path).session(256).generate(prompt, max_tokens=10)
    assert out.finish_reason == "eos" and out.tokens == [first] and out.text == ""


def test_context_limit_and_errors(model: ds4.Model) -> None:
    s = model.session(12)
    out = s.generate(list(range(1, 9)), max_tokens=100)
    assert out.finish_reason == "length" and len(out.tokens) == 5 and s.position == 12
    with pytest.raises(ds4.ContextOverflowError):
        model.session(4).generate(list(range(1, 9)))
    for ctx in (0, -5):
        with pytest.raises(ValueError, match=f"the context size must be at least 1, got {ctx}"):
            model.session(ctx)
    s = model.session(64)
    for bad in [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=1.0), dict(top_k=-1)]:
        with pytest.raises(ValueError):
            s.generate("x", sampling=ds4.Sampling(**bad))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_tokens"):
        s.generate("x", max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        s.generate([])
    with pytest.raises(ValueError, match="stop strings"):
        s.generate("x", stop=[""])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.generate([100000])
    assert s.position == 0


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ds4", *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_cli_generate_and_chat(model: ds4.Model) -> None:
    tok = model.tokenizer
    assert tok is not None
    want = model.session(256).generate("Hello there", max_tokens=8).text
    r = run("generate", str(LLAMACPP_TINY_L), "Hello there", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n" and "[length; prompt" in r.stderr
    r = run("generate", str(LLAMACPP_TINY_L), "--max-tokens", "8", "-q", stdin="Hello there")
    assert r.returncode == 0 and r.stdout == want + "\n" and r.stderr == ""
    chat = ds4.render_chat([{"role": "user", "content": "Hi"}])
    want_chat = model.session(256).generate(chat, max_tokens=5).text
    r = run("generate", str(LLAMACPP_TINY_L), "Hi", "--chat", "--max-tokens", "5", "-q")
    assert r.stdout == want_chat + "\n"
    r = run("chat", str(LLAMACPP_TINY_L), "--max-tokens", "4", "-q", stdin="Hi\n/think\nAgain\n/reset\nHi\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "(thinking on)" in r.stderr and "(new conversation)" in r.stderr
    assert r.stdout.count("> ") >= 3 and want_chat[:2] in r.stdout
    r = run("generate", str(LLAMACPP_TINY_L), "x", "--temperature", "-1")
    assert r.returncode == 1 and "temperature" in r.stderr
