"""The model drafters (MTP and DSpark) against the PyTorch reference oracles in
tests/golden/drafters (see its README), in every layout; then the exactness properties of
speculation with them, their state across snapshots, and the pairing checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ds4
from ds4._ggufwriter import GGUFWriter
from ds4.convert import _as_config
from ds4.testing import TINY, random_draft, random_model
from conftest import GOLDEN
from test_speculative import check_identical, chi2_pvalue, prompts

DRAFTERS = GOLDEN / "drafters"
TOL = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("drafters")
    out = {"target": d / "tiny-l.gguf", "mtp": d / "mtp.gguf", "dspark": d / "dspark.gguf"}
    ds4.convert(GOLDEN / "tiny-l", out["target"], progress=False)
    ds4.convert_draft(DRAFTERS / "tiny-l-mtp", out["mtp"], target=GOLDEN / "tiny-l", progress=False)
    ds4.convert_draft(DRAFTERS / "tiny-l-dspark", out["dspark"], target=GOLDEN / "tiny-l", progress=False)
    return out


@pytest.fixture(scope="module")
def mtp(files: dict[str, Path]) -> ds4.Model:
    return ds4.Model.load(files["target"], draft=files["mtp"])


@pytest.fixture(scope="module")
def dspark(files: dict[str, Path]) -> ds4.Model:
    return ds4.Model.load(files["target"], draft=files["dspark"])


def mtp_rows(model: ds4.Model, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Each prompt row's MTP logits (row t: the trunk state of t with token t+1), and the
    golden ones."""
    g = np.load(DRAFTERS / "tiny-l-mtp" / "golden.npz")
    prompt, pair = g[f"prompt_{i}"], g[f"mtp_input_tokens_{i}"]
    s = model.session(512)
    rows = []
    for t in range(len(prompt)):
        s.eval([int(prompt[t])], logits="last")
        p = s.propose(anchor=int(pair[t]), k=1)
        rows.append(p.logits[0])
    return np.array(rows), g[f"mtp_logits_{i}"]


def check_tokens(got: np.ndarray, want_logits: np.ndarray, err: float) -> None:
    """Argmax equal wherever the golden top-1 margin exceeds twice the logit error."""
    top2 = np.sort(want_logits, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > 2 * max(err, 1e-6)
    assert np.array_equal(np.asarray(got)[clear], want_logits.argmax(-1)[clear])


@pytest.mark.parametrize("i", [0, 1, 2])
def test_mtp_matches_reference(mtp: ds4.Model, i: int) -> None:
    got, want = mtp_rows(mtp, i)
    err = float(np.abs(got - want).max())
    assert err < TOL
    check_tokens(got.argmax(-1), want, err)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_mtp_chain_matches_reference(mtp: ds4.Model, i: int) -> None:
    g = np.load(DRAFTERS / "tiny-l-mtp" / "golden.npz")
    s = mtp.session(512)
    s.eval(g[f"prompt_{i}"].tolist(), logits="last")
    p = s.propose(k=3)  # anchor: the target's greedy token
    assert p.tokens == g[f"mtp_chain_tokens_{i}"].tolist()
    assert np.abs(p.logits - g[f"mtp_chain_logits_{i}"]).max() < TOL
    assert p.confidence is None


@pytest.mark.parametrize("i", [0, 1, 2])
def test_dspark_matches_reference(dspark: ds4.Model, i: int) -> None:
    g = np.load(DRAFTERS / "tiny-l-dspark" / "golden.npz")
    prompt = g[f"prompt_{i}"].tolist()
    for j, (p_, a) in enumerate(zip(g[f"dspark_anchor_pos_{i}"], g[f"dspark_anchor_tok_{i}"])):
        s = dspark.session(512)
        s.eval(prompt[: int(p_) + 1], logits="last")
        p = s.propose(anchor=int(a))
        assert p.tokens == g[f"dspark_draft_tokens_{i}"][j].tolist()
        assert np.abs(p.logits - g[f"dspark_logits_{i}"][j]).max() < TOL
        assert p.base_logits is not None and np.abs(p.base_logits - g[f"dspark_base_logits_{i}"][j]).max() < TOL
        assert p.confidence is not None and np.abs(p.confidence - g[f"dspark_confidence_{i}"][j]).max() < TOL
        assert p.hidden is not None and np.abs(p.hidden - g[f"dspark_hidden_{i}"][j]).max() < TOL
    # The default anchor is the target's greedy token.
    s = dspark.session(512)
    last = s.eval(prompt, logits="last")[0]
    assert s.propose().tokens == s.propose(anchor=int(last.argmax())).tokens


def test_mtp_in_model_file(tmp_path: Path) -> None:
    # A checkpoint carrying mtp.* converts to one file whose MTP block is found by itself.
    ck = tmp_path / "ck"
    ck.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        os.symlink(GOLDEN / "tiny-l" / f, ck / f)
    os.symlink(DRAFTERS / "tiny-l-mtp" / "model.safetensors", ck / "mtp.safetensors")
    ds4.convert(ck, tmp_path / "with-mtp.gguf", progress=False)
    m = ds4.Model.load(tmp_path / "with-mtp.gguf")
    assert m.draft_config == {"method": "mtp", "layout": "ds4", "pairing": "deepseek"}
    got, want = mtp_rows(m, 1)
    assert np.abs(got - want).max() < TOL


def llamacpp_layout(target: Path, mtp_file: Path, out: Path, own_head: bool) -> Path:
    """The target and MTP block in llama.cpp's layout: ``blk.4.*`` after the trunk,
    ``nextn.eh_proj`` = [e_proj | h_proj] along the input axis, block_count 5 with
    nextn_predict_layers 1; with ``own_head`` also the MTP's HC head and norm."""
    t, m = ds4.GGUFFile(target), ds4.GGUFFile(mtp_file)
    n = int(t.metadata["deepseek4.block_count"])
    w = GGUFWriter(out)
    types = t.metadata_types
    for k, v in t.metadata.items():
        if k == "deepseek4.block_count":
            v = n + 1
        w.add(k, v, types[k])
    w.add("deepseek4.nextn_predict_layers", 1, "u32")
    tensors: dict[str, np.ndarray] = {name: t.read(name) for name in t.tensors}
    for name in m.tensors:
        short = name[len("mtp.0."):]
        if short in ("e_proj.weight", "h_proj.weight"):
            continue
        if short in ("enorm.weight", "hnorm.weight"):
            tensors[f"blk.{n}.nextn.{short}"] = m.read(name)
        elif short.startswith("hc_head_"):
            if own_head:
                tensors[f"blk.{n}.nextn.{short}"] = m.read(name)
        elif short == "norm.weight":
            if own_head:
                tensors[f"blk.{n}.nextn.shared_head_norm.weight"] = m.read(name)
        else:
            tensors[f"blk.{n}.{short}"] = m.read(name)
    tensors[f"blk.{n}.nextn.eh_proj.weight"] = np.concatenate(
        [m.read("mtp.0.e_proj.weight"), m.read("mtp.0.h_proj.weight")], axis=1)
    for name, a in tensors.items():
        w.add_tensor_info(name, list(reversed(a.shape)), "I32" if a.dtype == np.int32 else "F32")
    w.write_header()
    for name, a in tensors.items():
        w.write_tensor(name, [np.ascontiguousarray(a, dtype="<i4" if a.dtype == np.int32 else "<f4")])
    w.close()
    return out


def test_mtp_llamacpp_layout(files: dict[str, Path], tmp_path: Path) -> None:
    own = ds4.Model.load(llamacpp_layout(files["target"], files["mtp"], tmp_path / "own.gguf", True))
    assert own.config["num_layers"] == 4 and own.draft_config["layout"] == "llama.cpp"  # type: ignore[index]
    got, want = mtp_rows(own, 2)
    assert np.abs(got - want).max() < TOL
    # Without the MTP's own head (as llama.cpp writes them) the trunk's head is used.
    trunk = ds4.Model.load(llamacpp_layout(files["target"], files["mtp"], tmp_path / "trunk.gguf", False))
    got2, _ = mtp_rows(trunk, 2)
    assert np.abs(got2 - want).max() > 1e-2
    check_identical(trunk, prompts("tiny-l")[2], ds4.Speculative("mtp", max_draft=3), max_tokens=24,
                    ignore_eos=True)


def test_mtp_pairing_option(files: dict[str, Path]) -> None:
    ds4_pairing = ds4.Model.load(files["target"], draft=files["mtp"], mtp_pairing="ds4")
    assert ds4_pairing.draft_config["pairing"] == "ds4"  # type: ignore[index]
    prompt = prompts("tiny-l")[1]
    s = ds4_pairing.session(512)
    s.eval(prompt, logits="last")
    p = s.propose(k=2)
    assert len(p.tokens) == 2
    got, want = mtp_rows(ds4_pairing, 1)
    assert np.abs(got - want).max() > 1e-2  # the pairing the reference was not run with
    check_identical(ds4_pairing, prompt, ds4.Speculative("mtp", max_draft=2), max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("method", ["mtp", "dspark"])
@pytest.mark.parametrize("block", [1, 2, 3, 5])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_identity(files: dict[str, Path], mtp: ds4.Model, dspark: ds4.Model, method: str, block: int,
                         adaptive: bool) -> None:
    m = mtp if method == "mtp" else dspark
    for prompt in prompts("tiny-l")[:3]:
        g = check_identical(m, prompt, ds4.Speculative(method, max_draft=block, adaptive=adaptive),
                            max_tokens=40, ignore_eos=True)
        if not adaptive:
            assert g.stats.num_drafts > 0


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_worst_argmax_gap_is_zero(mtp: ds4.Model, dspark: ds4.Model, method: str) -> None:
    m = mtp if method == "mtp" else dspark
    prompt = prompts("tiny-l")[2]
    out = m.session(1024).generate(prompt, max_tokens=48, ignore_eos=True,
                                   speculative=ds4.Speculative(method, max_draft=4, adaptive=False))
    s = m.session(1024)
    logits = s.eval(prompt)[-1]
    worst = 0.0
    for t in out.tokens:
        worst = max(worst, float(logits.max() - logits[t]))
        logits = s.eval([t])[0]
    assert worst == 0.0


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_temperature_sampling_is_exact(mtp: ds4.Model, dspark: ds4.Model, method: str) -> None:
    check_sampling_is_exact(mtp if method == "mtp" else dspark, method)


def check_sampling_is_exact(m: ds4.Model, method: str) -> None:
    """At T > 0 the drafter samples its tokens from its own filtered distribution q; the
    target accepts with min(1, p/q) and resamples rejections from (p - q)+. The second
    generated token (the first one a draft can supply) must follow the target's p exactly."""
    prompt = prompts("tiny-l")[0]
    params = dict(temperature=1.0, top_k=6)
    s = m.session(64)
    s.eval(prompt[:-1])
    snap = s.snapshot()
    ids1, p1 = ds4.Sampling(**params, seed=0).sampler().distribution(  # type: ignore[arg-type]
        m.session(64).eval(prompt)[-1])
    top = int(ids1[np.argmax(p1)])
    ids2, p2 = ds4.Sampling(**params, seed=0).sampler().distribution(  # type: ignore[arg-type]
        m.session(64).eval(prompt + [top])[-1])
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    spec = ds4.Speculative(method, max_draft=3, adaptive=False)
    drafted = 0
    for seed in range(1500):
        s.restore(snap)
        g = s.generate(prompt[-1:], max_tokens=3, ignore_eos=True, speculative=spec,
                       sampling=ds4.Sampling(**params, seed=seed))  # type: ignore[arg-type]
        first[g.tokens[0]] = first.get(g.tokens[0], 0) + 1
        if g.tokens[0] == top:
            second[g.tokens[1]] = second.get(g.tokens[1], 0) + 1
        drafted += g.stats.num_draft_tokens
    assert drafted > 0
    assert chi2_pvalue(first, ids1, p1) > 1e-6
    assert sum(second.values()) > 150 and chi2_pvalue(second, ids2, p2) > 1e-6


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_drafter_state_snapshot_restore(mtp: ds4.Model, dspark: ds4.Model, method: str) -> None:
    m = mtp if method == "mtp" else dspark
    prompt = prompts("tiny-l")[1]
    s = m.session(512)
    s.eval(prompt[:100], logits="last")
    before, digest = s.propose(k=3), s.digest()
    assert s.digest() == digest  # proposing changes nothing
    snap = s.snapshot()
    s.eval(prompt[100:140], logits="last")
    assert s.digest() != digest
    s.restore(snap)
    after = s.propose(k=3)
    assert s.digest() == digest and after.tokens == before.tokens
    assert np.array_equal(after.logits.view(np.uint32), before.logits.view(np.uint32))
    # A fresh session fed the same tokens in other chunks has the same drafter state.
    t = m.session(512)
    for a, b in ((0, 7), (7, 64), (64, 100)):
        t.eval(prompt[a:b], logits="last")
    assert t.digest() == digest
    s.reset()
    assert s.position == 0 and s.propose(anchor=3).tokens == []


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_random_drafters(tmp_path: Path, method: str) -> None:
    cfg = TINY.replace(num_hidden_layers=4, compress_ratios=(0, 0, 4, 128))
    target = random_model(tmp_path / "t.gguf", cfg, seed=3, dtype="q8_0", mtp=(method == "mtp"))
    if method == "mtp":
        m = ds4.Model.load(target)  # the MTP block in the file itself
    else:
        m = ds4.Model.load(target, draft=random_draft(tmp_path / "d.gguf", cfg, "dspark", seed=4, dtype="q8_0",
                                                      block_size=4, markov_rank=32))
    assert m.draft_method == method
    rng = np.random.default_rng(0)
    for _ in range(2):
        prompt = rng.integers(8, cfg.vocab_size, size=30).tolist()
        check_identical(m, prompt, ds4.Speculative(method, max_draft=4, adaptive=False), max_tokens=20,
                        ignore_eos=True)


def test_mismatched_drafters_raise(files: dict[str, Path], tmp_path: Path) -> None:
    tiny_l = _as_config(json.loads((GOLDEN / "tiny-l" / "config.json").read_text()))  # the target's shapes

    def load(**kw: object) -> None:
        path = random_draft(tmp_path / "bad.gguf", kw.pop("cfg", tiny_l), "dspark", **kw)  # type: ignore[arg-type]
        ds4.Model.load(files["target"], draft=path)

    with pytest.raises(ds4.DraftMismatchError, match="target layer id 9"):
        load(target_layer_ids=[1, 2, 9])
    with pytest.raises(ds4.DraftMismatchError, match="strictly increasing"):
        load(target_layer_ids=[2, 1, 3])
    with pytest.raises(ds4.DraftMismatchError, match="noise token id 512"):
        load(noise_token_id=512)
    with pytest.raises(ds4.DraftMismatchError, match="block size 17"):
        load(block_size=17)
    with pytest.raises(ds4.DraftMismatchError, match="hidden size: the drafter has 256, the target 128"):
        load(cfg=tiny_l.replace(hidden_size=256))
    with pytest.raises(ds4.DraftMismatchError, match="vocabulary"):
        load(cfg=tiny_l.replace(vocab_size=1024), noise_token_id=5)
    mtp = random_draft(tmp_path / "mtp.gguf", tiny_l.replace(hidden_size=64), "mtp")
    with pytest.raises(ds4.DraftMismatchError, match="hidden size"):
        ds4.Model.load(files["target"], draft=mtp)
    with pytest.raises(ds4.DraftMismatchError, match="neither MTP"):
        ds4.Model.load(files["target"], draft=files["target"])
    assert issubclass(ds4.DraftMismatchError, ValueError)
    # Asking for a drafter the model does not have.
    plain = ds4.Model.load(files["target"])
    assert plain.draft_method is None
    s = plain.session(64)
    s.eval([0, 5, 9])
    with pytest.raises(ValueError, match="no drafter"):
        s.propose()
    with pytest.raises(ValueError, match="needs a model loaded with its drafter"):
        s.generate([0, 5], max_tokens=3, speculative=ds4.Speculative("mtp"))
    m = ds4.Model.load(files["target"], draft=files["mtp"])
    with pytest.raises(ValueError, match="is mtp, not dspark"):
        m.session(64).generate([0, 5], max_tokens=3, speculative=ds4.Speculative("dspark"))
    s = m.session(64)
    with pytest.raises(ValueError, match="pass anchor"):
        s.propose()
    s.eval([0, 5])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        s.propose(anchor=512)
    with pytest.raises(ValueError, match="exceeds"):
        s.propose(anchor=3, k=17)


def test_cli_spec_model_drafters(files: dict[str, Path]) -> None:
    def run(*extra: str) -> str:
        r = subprocess.run([sys.executable, "-m", "ds4", "generate", str(files["target"]), "Once upon a time",
                            "--max-tokens", "24", "-q", *extra], capture_output=True, text=True, check=True)
        return r.stdout

    plain = run()
    assert run("--spec", "mtp", "--draft", str(files["mtp"])) == plain
    assert run("--spec", "dspark", "--draft", str(files["dspark"]), "--block", "3", "--fixed-block") == plain
