"""The CUDA backend against the golden fixtures and the CPU reference. Skipped without a usable
GPU (CI); run on a GPU machine with ``pytest tests/test_cuda.py`` (see README, "GPU")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ds4
from ds4.testing import TINY, random_model
from conftest import GOLDEN, LLAMACPP_TINY_L
from test_drafters import check_sampling_is_exact, llamacpp_layout
from test_speculative import (Oracle, check_identical, check_python_speculative_loop, check_verify_then_keep,
                               prompts)

FIXTURES = ["tiny-a", "tiny-b", "tiny-l"]
gpu = pytest.mark.skipif(not ds4.cuda_available(), reason="no usable CUDA GPU")


def test_backend_selection_without_gpu(tmp_path: Path) -> None:
    if ds4.cuda_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ds4.BackendUnavailable):
        ds4.Model.load(LLAMACPP_TINY_L, backend="cuda")
    assert ds4.Model.load(LLAMACPP_TINY_L, backend="auto").backend == "cpu"
    with pytest.raises(ValueError, match="backend"):
        ds4.Model.load(LLAMACPP_TINY_L, backend="tpu")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cuda")
    out = {}
    for name in FIXTURES:
        out[name] = ds4.convert(GOLDEN / name, d / f"{name}.gguf", progress=False)
    out["mtp"] = ds4.convert_draft(GOLDEN / "drafters" / "tiny-l-mtp", d / "mtp.gguf", target=GOLDEN / "tiny-l",
                                   progress=False)
    out["dspark"] = ds4.convert_draft(GOLDEN / "drafters" / "tiny-l-dspark", d / "dspark.gguf",
                                      target=GOLDEN / "tiny-l", progress=False)
    return out


@gpu
@pytest.mark.parametrize("name", FIXTURES)
def test_golden_logits_and_greedy_on_cuda(files: dict[str, Path], name: str) -> None:
    gm = ds4.Model.load(files[name], backend="cuda")
    cm = ds4.Model.load(files[name])
    assert gm.backend == "cuda"
    g = dict(np.load(GOLDEN / name / "golden.npz"))
    for i in sorted(int(k.split("_")[1]) for k in g if k.startswith("prompt_")):
        prompt = g[f"prompt_{i}"]
        logits = gm.session(1024).eval(prompt)
        assert float(np.abs(logits - g[f"logits_{i}"]).max()) <= 1e-4
        assert float(np.abs(logits - cm.session(1024).eval(prompt)).max()) <= 1e-4
        s = gm.session(1024)
        last = s.eval(prompt, logits="last")[0]
        got = []
        for _ in range(len(g[f"greedy_{i}"])):
            got.append(int(np.argmax(last)))
            last = s.eval([got[-1]])[0]
        assert got == g[f"greedy_{i}"].tolist()


@gpu
@pytest.mark.parametrize("name", FIXTURES)
def test_rows_are_batch_invariant_on_cuda(files: dict[str, Path], name: str) -> None:
    # Two kinds of steps, each row-invariant: a prompt's (calls of more than 16 tokens, whose
    # products may run on the prefill kernels) and a decode's (1..=16 tokens: decode, verify).
    m = ds4.Model.load(files[name], backend="cuda")
    p = max(prompts(name), key=len)[:120]
    whole = m.session(1024).eval(p)
    rng = np.random.default_rng(len(p))
    for _ in range(3):
        # Prompts of 17 tokens or more, cut anywhere.
        s = m.session(1024)
        cuts = []
        for c in sorted(rng.integers(17, len(p) - 17, 3).tolist()):
            if c - ([0, *cuts][-1]) >= 17 and len(p) - c >= 17:
                cuts.append(c)
        parts = [s.eval(p[a:b]) for a, b in zip([0, *cuts], [*cuts, len(p)])]
        assert np.array_equal(whole.view(np.uint32), np.concatenate(parts).view(np.uint32))
    # Decode-sized calls, cut anywhere, are their rows' single decodes.
    s1, s2 = m.session(1024), m.session(1024)
    singles = [s1.eval([t]) for t in p[:40]]
    cuts = sorted(set(rng.integers(1, 40, 6).tolist()) | {16, 32})
    parts = [s2.eval(p[a:b]) for a, b in zip([0, *cuts], [*cuts, 40])]
    assert np.array_equal(np.concatenate(singles).view(np.uint32), np.concatenate(parts).view(np.uint32))
    assert s1.digest() == s2.digest()


@gpu
@pytest.mark.parametrize("dtype", ["q8_0", "q2"])
def test_quantized_models_match_cpu(tmp_path: Path, dtype: str) -> None:
    cfg = TINY.replace(num_hidden_layers=4, compress_ratios=(0, 0, 4, 128))
    path = random_model(tmp_path / "m.gguf", cfg, seed=5, dtype=dtype)
    prompt = np.random.default_rng(1).integers(8, cfg.vocab_size, 48).tolist()
    want = ds4.Model.load(path).session(256).eval(prompt)
    got = ds4.Model.load(path, backend="cuda").session(256).eval(prompt)
    # Quantized weights reduce in another order on the GPU: equal within f32 rounding on the
    # typical row (a routing flip may move a few rows more).
    row_err = np.abs(got - want).max(axis=1) / (np.abs(want).max(axis=1) + 1e-6)
    if dtype == "q2":
        # A prompt's steps run the F16 and Q8_0 products on the tensor cores (gemm.cu: x kept to
        # 22 bits, about 1e-6 from the host's sums where the decode's kernels are about 1e-7).
        # The routed experts' Q2_K products take 8-bit activations (quant/act8.rs), and those
        # differences put an activation on the other side of a rounding step in most rows of
        # this random model: on an H200 the median row error was 4.7e-3 (p90 8.3e-3) against
        # 5.1e-7 (p90 3.9e-3) on the decode's kernels, the argmax the same on every row, as
        # test_device_decode_matches_host_forward allows for the device against the host.
        assert float(np.mean(got.argmax(axis=1) == want.argmax(axis=1))) >= 0.95
        assert float(np.median(row_err)) < 2e-2
    else:
        assert float(np.median(row_err)) < 1e-3


@gpu
@pytest.mark.parametrize("method", ["oracle", "mtp", "dspark"])
def test_speculation_is_exact_on_cuda(files: dict[str, Path], method: str) -> None:
    draft = files.get(method)
    m = ds4.Model.load(files["tiny-l"], draft=draft, backend="cuda")
    for prompt in prompts("tiny-l")[:3]:
        if method == "oracle":
            truth = m.session(1024).generate(prompt, max_tokens=40, ignore_eos=True).tokens
            # Blocks of 6 and of 16, the most: a verify is at most one device step (16 rows),
            # so the drafts are cut to 15 there and every row stays a single decode's.
            for block in (6, 16):
                spec = ds4.Speculative(Oracle(prompt, truth, {2, 5}, m.vocab_size, block), max_draft=block,
                                       adaptive=False)
                check_identical(m, prompt, spec, max_tokens=40, ignore_eos=True)
        else:
            check_identical(m, prompt, ds4.Speculative(method, max_draft=4, adaptive=False), max_tokens=40,
                            ignore_eos=True)


@gpu
def test_a_verify_is_at_most_one_device_step(files: dict[str, Path]) -> None:
    # A device step takes 16 rows. A longer verify would run on the host forward pass, whose
    # sums are not the device's, so it is refused (nothing changes) rather than run with rows
    # that are not bitwise single decodes.
    m = ds4.Model.load(files["tiny-l"], backend="cuda")
    s = m.session(512)
    s.eval(prompts("tiny-l")[0], logits="none")
    assert s.forward_kind == "device" and s.max_verify == 16
    before = (s.position, s._native.digest())
    with pytest.raises(ValueError, match="1..=16"):
        s.verify(list(range(3, 20)))
    assert (s.position, s._native.digest()) == before
    v = s.verify(list(range(3, 19)), greedy=True)
    v.keep(16)
    assert s.position == before[0] + 16


@gpu
@pytest.mark.parametrize("name", ["tiny-l", "tiny-a"])
def test_verify_and_keep_on_cuda(files: dict[str, Path], name: str) -> None:
    # Session.verify on the device (a greedy verify's ids from the GPU's argmax): eval's rows
    # bit for bit, keep(n) the state of evaluating n tokens, and a Python speculative loop
    # over them the greedy output.
    m = ds4.Model.load(files[name], backend="cuda")
    check_verify_then_keep(m, name)
    if name == "tiny-l":
        check_python_speculative_loop(m)


@gpu
def test_drafters_match_reference_on_cuda(files: dict[str, Path]) -> None:
    g = np.load(GOLDEN / "drafters" / "tiny-l-dspark" / "golden.npz")
    m = ds4.Model.load(files["tiny-l"], draft=files["dspark"], backend="cuda")
    prompt = g["prompt_2"].tolist()
    for j, (p_, a) in enumerate(zip(g["dspark_anchor_pos_2"], g["dspark_anchor_tok_2"])):
        s = m.session(512)
        s.eval(prompt[: int(p_) + 1], logits="last")
        p = s.propose(anchor=int(a))
        assert p.tokens == g["dspark_draft_tokens_2"][j].tolist()
        assert np.abs(p.logits - g["dspark_logits_2"][j]).max() < 1e-4


def _chunked(s: ds4.Session, prompt: list[int], cuts: list[int]) -> np.ndarray:
    return np.concatenate([s.eval(prompt[a:b]) for a, b in zip([0, *cuts], [*cuts, len(prompt)])])


@gpu
def test_prompt_steps_of_1024_rows_are_row_invariant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A prompt's steps of up to 1024 rows (the default of DS4_CUDA_PREFILL_ROWS, read when a
    # session makes its decoder, at its first eval) give every row, and the next decode step,
    # the bits of steps of 512, 256 and 100 rows: the routing of 1024 rows in one block, experts
    # serving a hundred or more rows of a step (several tensor-core descriptors each), the step
    # parameters' tokens.
    cfg = TINY.replace(num_hidden_layers=4, compress_ratios=(0, 4, 128, 4))
    m = ds4.Model.load(random_model(tmp_path / "m.gguf", cfg, seed=5, dtype="q2"), backend="cuda")
    prompt = np.random.default_rng(4).integers(8, cfg.vocab_size, 1100).tolist()

    def rows_of(step_rows: str | None) -> np.ndarray:
        if step_rows is None:
            monkeypatch.delenv("DS4_CUDA_PREFILL_ROWS", raising=False)
        else:
            monkeypatch.setenv("DS4_CUDA_PREFILL_ROWS", step_rows)
        s = m.session(1200)
        out = np.concatenate([s.eval(prompt), s.eval([5])])
        monkeypatch.delenv("DS4_CUDA_PREFILL_ROWS", raising=False)
        return out

    wide = rows_of(None)
    assert wide.shape == (1101, cfg.vocab_size)
    for other in ["512", "256", "100"]:
        assert np.array_equal(wide.view(np.uint32), rows_of(other).view(np.uint32)), other


@gpu
@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q2"])
def test_device_decode_matches_host_forward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    # Sliding, CSA (ratio 4, indexer top-8 of up to 75 rows) and HCA layers; long chunks
    # (prefill), 16-row chunks, single tokens, across many window closes.
    cfg = TINY.replace(num_hidden_layers=4, compress_ratios=(0, 4, 128, 4))
    path = random_model(tmp_path / "m.gguf", cfg, seed=3, dtype=dtype)
    m = ds4.Model.load(path, backend="cuda")
    prompt = np.random.default_rng(2).integers(8, cfg.vocab_size, 300).tolist()
    cuts = [37, 53, *range(54, 70), 86, 100, 164, 165, 166, 200, 260, 261]
    s = m.session(512)
    assert s.forward_kind == "device"
    dev = _chunked(s, prompt, cuts)
    monkeypatch.setenv("DS4_DEVICE_DECODE", "0")
    h = m.session(512)
    assert h.forward_kind == "host"
    host = _chunked(h, prompt, cuts)
    monkeypatch.delenv("DS4_DEVICE_DECODE")
    row_err = np.abs(dev - host).max(axis=1) / (np.abs(host).max(axis=1) + 1e-6)
    tol = {"f32": 1e-4, "q8_0": 1e-3}.get(dtype, 2e-2)
    if dtype == "q2":
        # The routed experts' Q2_K down products take 8-bit activations quantized from the
        # gate and up products' outputs (quant/act8.rs), which the device and the host round
        # differently: now and then an activation lands on the other side of a rounding
        # boundary (a step of amax / 127 of its block), and a random model amplifies that. On
        # an H200 the median row error was 3.3e-3 (p90 6.2e-3) and the argmax agreed on 98%
        # of the rows; host products against the CPU backend differed as much. (With float
        # down inputs it was 4e-7.) A wrong kernel is off by far more.
        assert float(np.mean(dev.argmax(axis=1) == host.argmax(axis=1))) >= 0.95
    assert float(np.median(row_err)) < tol, (float(np.median(row_err)), float(row_err.max()))
    # Rows are batch invariant on the device: another chunking gives the same bits, where each
    # row is again in a prompt's call (more than 16 tokens) or again in a decode-sized one.
    again = _chunked(m.session(512), prompt, [37, 53, *range(54, 70), 86, 100, 130, 164, 165, 166, 200, 230, 260, 261])
    assert np.array_equal(dev.view(np.uint32), again.view(np.uint32))
    # Nor do the rows of a prompt's step (DS4_CUDA_PREFILL_ROWS, read when a session makes its
    # decoder; 512 by default: the 150-row call in one step, its products of more than 64 rows
    # in several descriptors) or of its routed products (DS4_CUDA_EXPERT_CHUNK, 4), the bands
    # of output rows of its tensor-core Q8_0 products (DS4_CUDA_BANDS), or the grid of its
    # routed tensor-core products (DS4_CUDA_GX_GRID=0: a block per table block, not the blocks
    # the GPU holds walking them) or their warp tile (DS4_CUDA_GX_TILE=2x2: 16 rows a
    # descriptor, not 32), over prompt calls of 150 and 134 rows.
    long_cuts = [150, 151, 166]
    steps = _chunked(m.session(512), prompt, long_cuts)
    for name, value in [("DS4_CUDA_PREFILL_ROWS", "16"), ("DS4_CUDA_PREFILL_ROWS", "64"),
                        ("DS4_CUDA_PREFILL_ROWS", "100"), ("DS4_CUDA_PREFILL_ROWS", "128"),
                        ("DS4_CUDA_EXPERT_CHUNK", "1"), ("DS4_CUDA_EXPERT_CHUNK", "16"),
                        ("DS4_CUDA_BANDS", "0"), ("DS4_CUDA_BANDS", "16"), ("DS4_CUDA_GX_GRID", "0"),
                        ("DS4_CUDA_GX_TILE", "2x2")]:
        monkeypatch.setenv(name, value)
        other = _chunked(m.session(512), prompt, long_cuts)
        monkeypatch.delenv(name)
        assert np.array_equal(steps.view(np.uint32), other.view(np.uint32)), (name, value)
    # The first call's rows in both chunkings (a prompt's 37 rows, the first 37 of 150): the same
    # bits. (Later rows see states that decode-sized calls made in `dev`.)
    assert np.array_equal(dev[:37].view(np.uint32), steps[:37].view(np.uint32))
    # A prompt's IQ2_XXS expert gate and up products (q2) run on the tensor cores
    # (gemm_experts.cu): the same integer sums per group of 32, added in another order than the
    # decode kernel's (DS4_CUDA_EXPERT_MMA=0 in prompts too).
    monkeypatch.setenv("DS4_CUDA_EXPERT_MMA", "0")
    dp4a = _chunked(m.session(512), prompt, cuts)
    monkeypatch.delenv("DS4_CUDA_EXPERT_MMA")
    assert np.array_equal(dev[:37].view(np.uint32), dp4a[:37].view(np.uint32)) == (dtype != "q2")
    rel = np.abs(dev - dp4a).max(axis=1) / (np.abs(dp4a).max(axis=1) + 1e-6)
    assert float(np.median(rel)) < tol
    # A restored state goes to the device again, its ring (the host's spare slots: a verify's
    # rows) laid onto the device's (a prompt step's rows): the same steps after it, the same bits.
    s1, s2 = m.session(512), m.session(512)
    s1.eval(prompt[:150])
    s2.eval(prompt[:150])
    snap = s2.snapshot()
    s2.eval(prompt[150:220])
    s2.restore(snap)
    for t in prompt[150:160]:
        assert np.array_equal(s1.eval([t]).view(np.uint32), s2.eval([t]).view(np.uint32))
    # The prefill kernels (gemm.cu: F16 and Q8_0 products; the attention on the tensor cores,
    # decode_attn.cu section 6) ran for the prompt's calls: without them (DS4_CUDA_GEMM=0, read
    # when a session makes its decoder: the decode's kernels for every step) the rows differ by
    # rounding.
    monkeypatch.setenv("DS4_CUDA_GEMM", "0")
    plain = _chunked(m.session(512), prompt, cuts)
    monkeypatch.delenv("DS4_CUDA_GEMM")
    assert not np.array_equal(dev[:37].view(np.uint32), plain[:37].view(np.uint32))
    rel = np.abs(dev - plain).max(axis=1) / (np.abs(plain).max(axis=1) + 1e-6)
    assert float(np.median(rel)) < tol
    # The Q8_0 products on the decode's tensor-core layout (q_b's class) run in a prompt's
    # steps on ds4_gemm_q8_0_mq; with DS4_CUDA_GEMM_MQ=0 on the decode's kernel for them: the
    # rows differ by rounding (an F32 model has no such products).
    monkeypatch.setenv("DS4_CUDA_GEMM_MQ", "0")
    mq = _chunked(m.session(512), prompt, cuts)
    monkeypatch.delenv("DS4_CUDA_GEMM_MQ")
    assert np.array_equal(dev[:37].view(np.uint32), mq[:37].view(np.uint32)) == (dtype == "f32")
    rel = np.abs(dev - mq).max(axis=1) / (np.abs(mq).max(axis=1) + 1e-6)
    assert float(np.median(rel)) < tol
    # Without the tensor-core attention alone (DS4_CUDA_ATTN_MMA=0), an F32 model's prompt rows
    # are the decode kernels' bits (it has no F16 or Q8_0 products); the others' still differ.
    # (With the hyper-connection sites in a mixing product and ds4_hc_pre each, as a prompt's
    # step runs them: on sm_90 a decode's run as one cluster launch, ds4_hc_site, unless
    # DS4_CUDA_HC_SITE=0, and so do a prompt's with DS4_CUDA_GEMM=0.)
    monkeypatch.setenv("DS4_CUDA_HC_SITE", "0")
    monkeypatch.setenv("DS4_CUDA_ATTN_MMA", "0")
    no_attn = _chunked(m.session(512), prompt, cuts)
    monkeypatch.delenv("DS4_CUDA_ATTN_MMA")
    monkeypatch.setenv("DS4_CUDA_GEMM", "0")
    plain_sites = _chunked(m.session(512), prompt, cuts)
    monkeypatch.delenv("DS4_CUDA_GEMM")
    monkeypatch.delenv("DS4_CUDA_HC_SITE")
    assert np.array_equal(no_attn[:37].view(np.uint32), plain_sites[:37].view(np.uint32)) == (dtype == "f32")
    rel = np.abs(dev - no_attn).max(axis=1) / (np.abs(no_attn).max(axis=1) + 1e-6)
    assert float(np.median(rel)) < tol
    # Without them, every chunking gives the same bits (the decode's kernels only).
    monkeypatch.setenv("DS4_CUDA_GEMM", "0")
    sixteen = _chunked(m.session(512), prompt, [16 * i for i in range(1, 19)])
    monkeypatch.delenv("DS4_CUDA_GEMM")
    assert np.array_equal(plain.view(np.uint32), sixteen.view(np.uint32))


@gpu
def test_device_state_follows_snapshots_and_verify(files: dict[str, Path]) -> None:
    m = ds4.Model.load(files["tiny-l"], backend="cuda")
    p = max(prompts("tiny-l"), key=len)
    a = m.session(1024)
    assert a.forward_kind == "device"
    a.eval(p[:50])
    snap = a.snapshot()
    first = [a.eval([t]) for t in p[50:70]]
    # Back to the snapshot (the device copy is stale: re-uploaded), then the same steps.
    a.restore(snap)
    second = [a.eval([t]) for t in p[50:70]]
    assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(first, second))
    b = m.session(1024)
    b.eval(p[:50])
    b.eval(p[50:66])
    b.eval(p[66:70])
    assert a.digest() == b.digest()


# A child process: loads argv[1] on CUDA, evaluates the prompt argv[2] (40 tokens at once,
# then one at a time, after dropping the model: the session holds the last reference) and
# saves the logits to argv[3].
_CHILD = """
import sys
import numpy as np
import ds4
m = ds4.Model.load(sys.argv[1], backend="cuda")
p = [int(t) for t in sys.argv[2].split(",")]
s = m.session(1024)
assert s.forward_kind == "device", s.forward_kind
out = [s.eval(p[:40])]
del m  # the session now holds the last reference to the model and its backend
out += [s.eval([t]) for t in p[40:]]
np.save(sys.argv[3], np.concatenate(out))
del s
print("ok")
"""


@gpu
def test_sinkhorn_side_branch_is_exact_and_tears_down(files: dict[str, Path], tmp_path: Path) -> None:
    # The side branch (the default, DS4_CUDA_FORK=1 here) runs the Sinkhorn iterations beside
    # the sublayer in the step's graph: the same bits as the fused kernel, and a session that
    # outlives its model must tear its side stream down cleanly (a child process each, so that a
    # crash fails this test, not the run).
    p = max(prompts("tiny-l"), key=len)[:60]
    off, on = (_child_logits(files["tiny-l"], p, {"DS4_CUDA_FORK": v}, tmp_path / f"fork{v}.npy") for v in "01")
    assert np.array_equal(off.view(np.uint32), on.view(np.uint32))


def _run_child(script: str, args: list[str], env: dict[str, str]) -> None:
    # A child process (the settings are read once a process), which must end printing "ok".
    r = subprocess.run([sys.executable, "-c", script, *args], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (env, r.returncode, r.stderr[-2000:])


def _child_logits(model: Path, prompt: list[int], env: dict[str, str], out: Path) -> np.ndarray:
    _run_child(_CHILD, [str(model), ",".join(map(str, prompt)), str(out)], env)
    logits: np.ndarray = np.load(out)
    return logits


@gpu
@pytest.mark.parametrize("switch", ["DS4_CUDA_PREFETCH", "DS4_CUDA_PREFETCH_BRANCH", "DS4_CUDA_SIDE_PROJ"])
def test_side_branch_work_changes_no_bits(switch: str, tmp_path: Path) -> None:
    # What the side branches run beside the main stream moves no bits: the L2 prefetch of each
    # layer's q_b is a hint (on a branch of its own or first on the side branch), and the
    # compressors' and indexer's projections (split products among them, with partial sums of
    # their own) are the same launches on another stream.
    # Every logit is the same bits with each and without, across a prefill chunk and single
    # steps (a child process each: the settings are read when a session's decoder is made).
    cfg = TINY.replace(num_hidden_layers=3, compress_ratios=(0, 4, 128))
    path = random_model(tmp_path / "m.gguf", cfg, seed=5, dtype="q2")
    p = np.random.default_rng(4).integers(8, cfg.vocab_size, 60).tolist()
    off, on = (_child_logits(path, p, {switch: v}, tmp_path / f"sw{v}.npy") for v in "01")
    assert np.array_equal(off.view(np.uint32), on.view(np.uint32))


@gpu
@pytest.mark.parametrize("dtype", ["q2", "f32"])
@pytest.mark.parametrize("switch", ["DS4_CUDA_ROUTE_TAIL", "DS4_CUDA_NORM_TAIL", "DS4_CUDA_WIDE"])
def test_opt_in_switches_change_no_bits(switch: str, dtype: str, tmp_path: Path) -> None:
    # The tails (decode/program.rs `tail_kernel`) run a one-row step's routing in the last block
    # of the router product's launch, or the q_a norm in the q_a product's, instead of a launch
    # after it: the same product blocks, and the same routing or norm in the same order. The
    # wide kernels (`wide_swiglu`) gather a prompt step's routed rows and take its SwiGLUs four
    # values a thread, each value's operations unchanged. So every logit is the same bits across
    # a prefill chunk and single steps, with the q2 layout's weights (F16 router, Q8_0 q_a,
    # 8-bit activations into the routed products) and F32 ones, through hash and learned routing
    # (the first layer hashes its tokens, the others learn).
    cfg = TINY.replace(num_hidden_layers=3, compress_ratios=(0, 4, 128), num_hash_layers=1)
    path = random_model(tmp_path / "m.gguf", cfg, seed=7, dtype=dtype)
    p = np.random.default_rng(6).integers(8, cfg.vocab_size, 60).tolist()
    off, on = (_child_logits(path, p, {switch: v}, tmp_path / f"t{v}.npy") for v in "01")
    assert np.array_equal(off.view(np.uint32), on.view(np.uint32))


@gpu
def test_fused_hyper_connection_sites_agree(tmp_path: Path) -> None:
    # A decode's and a verify's hyper-connection sites run as one cluster launch each on sm_90
    # (ds4_hc_site: the mixing product's sums in another order, the attention site's expansion
    # folded into the FFN site's launch); DS4_CUDA_HC_SITE=0 runs the mixing product, ds4_hc_pre
    # and ds4_hc_post. Across a prefill chunk and single steps of an F32 model the logits agree
    # to rounding, and so do the greedy tokens.
    cfg = TINY.replace(num_hidden_layers=3, compress_ratios=(0, 4, 128))
    path = random_model(tmp_path / "m.gguf", cfg, seed=6, dtype="f32")
    p = np.random.default_rng(5).integers(8, cfg.vocab_size, 60).tolist()
    off, on = (_child_logits(path, p, {"DS4_CUDA_HC_SITE": v}, tmp_path / f"hc{v}.npy") for v in "01")
    row_err = np.abs(on - off).max(axis=1) / (np.abs(off).max(axis=1) + 1e-6)
    assert float(row_err.max()) < 1e-4, float(row_err.max())
    assert np.array_equal(on.argmax(axis=1), off.argmax(axis=1))


# A prompt of 420 tokens with a drafter (argv: target, drafter, output file): every row's
# logits, the state's digest (the drafter's rings and MTP's pending streams in it), the device
# steps the prompt took (DS4_PROFILE), a proposal after it, a decode step and a proposal after
# that.
_PROMPT_CHILD = r"""
import sys
import numpy as np
import ds4
from ds4 import _ds4
target, draft, out = sys.argv[1:4]
m = ds4.Model.load(target, draft=draft, backend="cuda")
prompt = np.random.default_rng(7).integers(8, m.vocab_size, 420).tolist()
s = m.session(1024)
_ds4.profile(True)
logits = s.eval(prompt)
steps = {name: n for name, n, _ in _ds4.profile(True)}["device_step"]
digest = s.digest()
p = s.propose(k=3)
step = s.eval([int(logits[-1].argmax())])
q = s.propose(k=3)
np.savez(out, logits=logits, step=step, steps=steps, digest=np.array([digest, s.digest()], dtype=np.uint64),
         p=np.array(p.tokens), p_logits=p.logits, q=np.array(q.tokens), q_logits=q.logits)
print("ok")
"""


@gpu
@pytest.mark.parametrize("method", ["mtp", "dspark"])
@pytest.mark.parametrize("where", ["device", "host"])
def test_prompt_steps_with_a_drafter(files: dict[str, Path], tmp_path: Path, method: str, where: str) -> None:
    # With a drafter, a prompt's rows before its last ring slots (+ 1 for MTP's lag) go in full
    # prompt steps that leave the drafter out, the rest in steps that keep it. Every row's
    # logits, the whole state (the drafter's rings and pending streams too), the proposals and
    # a decode step after it are the bits of 16-row steps throughout (DS4_CUDA_PREFILL_ROWS=16,
    # how every prompt with a drafter ran before), in far fewer steps: 420 tokens with tiny-l's
    # window of 128 (145 ring slots) take one step of 274 (MTP) or 275 rows, then, with the
    # drafter's rows on the device (its upkeep, 160 rows a step), one of 146 or 145, or on the
    # host (DS4_CUDA_DRAFT=0), ten of at most 16; against 27.
    def run(env: dict[str, str]) -> dict[str, np.ndarray]:
        out = tmp_path / f"{len(env)}.npz"
        env = {"DS4_PROFILE": "1", "DS4_CUDA_DRAFT": "1" if where == "device" else "0", **env}
        _run_child(_PROMPT_CHILD, [str(files["tiny-l"]), str(files[method]), str(out)], env)
        return dict(np.load(out))

    full, small = run({}), run({"DS4_CUDA_PREFILL_ROWS": "16"})
    assert (int(full["steps"]), int(small["steps"])) == (2 if where == "device" else 11, 27)
    assert full["logits"].shape == (420, ds4.Model.load(files["tiny-l"]).vocab_size)
    for key in ["logits", "step", "digest", "p", "p_logits", "q", "q_logits"]:
        assert full[key].dtype == small[key].dtype and np.array_equal(full[key].view(np.uint8),
                                                                      small[key].view(np.uint8)), key
    assert len(full["p"]) == 3


# The start of the drafter children: argv is target, drafter, golden file, "device" or "host";
# calls() reads and clears the profile's call counts; check_path asserts which path proposed
# (the host path runs more than host_products products); eval_prompt evaluates a prompt, its
# last token in a step of its own, and asserts which path kept the drafter's window rows in
# that step (the host path's products, or none).
_DRAFT_CHILD = r"""
import sys
import numpy as np
import ds4
from ds4 import _ds4
target, draft, golden, where = sys.argv[1:5]
g = np.load(golden)
m = ds4.Model.load(target, draft=draft, backend="cuda")
def calls():
    return {name: n for name, n, _ in _ds4.profile(True)}
def check_path(c, host_products):
    if where == "device":
        assert c["device_draft"] == 1 and c["matmul"] == 0, c
    else:
        assert c["device_draft"] == 0 and c["matmul"] > host_products, c
def eval_prompt(s, prompt):
    s.eval(prompt[:-1])
    calls()
    s.eval(prompt[-1:], logits="last")
    c = calls()
    assert c["device_step"] == 1 and (c["matmul"] == 0) == (where == "device"), c
"""


def _run_draft_child(body: str, files: dict[str, Path], method: str, where: str) -> None:
    # A child process each: DS4_CUDA_DRAFT is read when a session's decoder is made,
    # DS4_PROFILE when the process first times.
    env = {"DS4_PROFILE": "1", "DS4_CUDA_DRAFT": "1" if where == "device" else "0"}
    golden = GOLDEN / "drafters" / f"tiny-l-{method}" / "golden.npz"
    _run_child(_DRAFT_CHILD + body, [str(files["tiny-l"]), str(files[method]), str(golden), where], env)


_MTP_CHILD = r"""
for i in range(3):
    s = m.session(512)
    eval_prompt(s, g[f"prompt_{i}"].tolist())
    p = s.propose(k=3)  # anchor: the target's greedy token
    check_path(calls(), 0)
    assert p.tokens == g[f"mtp_chain_tokens_{i}"].tolist(), (i, p.tokens)
    err = float(np.abs(p.logits - g[f"mtp_chain_logits_{i}"]).max())
    assert err < 1e-4, (i, err)
print("ok")
"""


@gpu
@pytest.mark.parametrize("where", ["device", "host"])
def test_mtp_chain_matches_reference_on_cuda(files: dict[str, Path], where: str) -> None:
    # The reference's depth-3 MTP chain: on the device decoder (no host product runs during
    # the proposal), and on the host with DS4_CUDA_DRAFT=0.
    _run_draft_child(_MTP_CHILD, files, "mtp", where)


_DSPARK_CHILD = r"""
prompt = g["prompt_2"].tolist()
for j, (p_, a) in enumerate(zip(g["dspark_anchor_pos_2"], g["dspark_anchor_tok_2"])):
    s = m.session(512)
    eval_prompt(s, prompt[: int(p_) + 1])
    p = s.propose(anchor=int(a))
    # On the device, greedy: the block, its head, and the Markov and confidence heads; the
    # host path runs more than the Markov and confidence products (two a token).
    check_path(calls(), 2 * len(p.tokens))
    assert p.tokens == g["dspark_draft_tokens_2"][j].tolist(), (j, p.tokens)
    for got, key in ((p.logits, "dspark_logits_2"), (p.base_logits, "dspark_base_logits_2"),
                     (p.confidence, "dspark_confidence_2")):
        err = float(np.abs(np.asarray(got) - g[key][j]).max())
        assert err < 1e-4, (j, key, err)
print("ok")
"""


@gpu
@pytest.mark.parametrize("where", ["device", "host"])
def test_dspark_matches_reference_on_cuda(files: dict[str, Path], where: str) -> None:
    # The reference's DSpark blocks: on the device decoder (the stages, each row seeing the
    # whole block, the head, then the Markov and confidence heads row by row), and on the host
    # path. (Sampled proposals take the host's Markov loop: test_dspark_sampling_is_exact_on_cuda.)
    _run_draft_child(_DSPARK_CHILD, files, "dspark", where)


@gpu
def test_mtp_layouts_and_pairing_on_cuda(files: dict[str, Path], tmp_path: Path) -> None:
    # llama.cpp's layout (one fused eh_proj; the MTP's own head, or the trunk's) and ds4's
    # pairing (the first step re-derives the last position): the device's proposals are the
    # CPU's, and speculation with them gives plain decoding's tokens.
    own = llamacpp_layout(files["tiny-l"], files["mtp"], tmp_path / "own.gguf", True)
    trunk = llamacpp_layout(files["tiny-l"], files["mtp"], tmp_path / "trunk.gguf", False)
    cases = [(own, {}), (trunk, {}), (files["tiny-l"], {"draft": files["mtp"], "mtp_pairing": "ds4"})]
    for path, kw in cases:
        gpu_m = ds4.Model.load(path, backend="cuda", **kw)  # type: ignore[arg-type]
        cpu_m = ds4.Model.load(path, backend="cpu", **kw)  # type: ignore[arg-type]
        for prompt in prompts("tiny-l")[:2]:
            a, b = gpu_m.session(512), cpu_m.session(512)
            a.eval(prompt, logits="last")
            b.eval(prompt, logits="last")
            pa, pb = a.propose(k=4), b.propose(k=4)
            assert pa.tokens == pb.tokens, (path.name, kw)
            assert np.abs(pa.logits - pb.logits).max() < 1e-4, (path.name, kw)
        check_identical(gpu_m, prompts("tiny-l")[2], ds4.Speculative("mtp", max_draft=3), max_tokens=24,
                        ignore_eos=True)


@gpu
def test_mtp_sampling_is_exact_on_cuda(files: dict[str, Path]) -> None:
    # The device's proposals at T > 0: tokens drawn on the host from the downloaded logits, the
    # target's distribution kept exactly.
    check_sampling_is_exact(ds4.Model.load(files["tiny-l"], draft=files["mtp"], backend="cuda"), "mtp")


@gpu
def test_dspark_sampling_is_exact_on_cuda(files: dict[str, Path]) -> None:
    check_sampling_is_exact(ds4.Model.load(files["tiny-l"], draft=files["dspark"], backend="cuda"), "dspark")
