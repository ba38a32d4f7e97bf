"""The HF -> GGUF converter, the streaming GGUF writer, the safetensors reader and random models.

The oracle is llama.cpp's own conversion of tiny-l (tests/golden/tiny-l/llamacpp-f32.gguf), read
with gguf-py, plus gguf-py's quantizers and an independent safetensors parser/writer below.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import ds4
from ds4 import UnsupportedModelError
from ds4._ggufwriter import GGUFWriter
from ds4._progress import Progress
from ds4._safetensors import Checkpoint, SafetensorsFile, decode_e4m3, decode_e8m0
from ds4.convert import ModelConfig, TensorSpec, dequant_fp4, dequant_fp8, tensor_plan, tensor_type
from ds4.testing import MICRO, TINY, random_model

GOLDEN = Path(__file__).parent / "golden"
LLAMACPP = GOLDEN / "tiny-l" / "llamacpp-f32.gguf"

# ---------------------------------------------------------------------------------------------
# An independent safetensors reader/writer
# ---------------------------------------------------------------------------------------------

_NP = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I8": "i1", "U8": "u1",
       "F8_E4M3": "u1", "F8_E8M0": "u1"}


def st_read(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (dtype, stored items) of a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + e], dtype=_NP[info["dtype"]]).reshape(info["shape"])
        out[name] = (info["dtype"], arr)
    return out


def st_write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    blobs, off = [], 0
    for name, (dtype, arr) in tensors.items():
        b = np.ascontiguousarray(arr, dtype=_NP[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def copy_fixture(name: str, dst: Path, tensors: dict[str, tuple[str, np.ndarray]] | None = None,
                 config: dict[str, Any] | None = None) -> Path:
    """A copy of a golden fixture directory, optionally with other tensors or config."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GOLDEN / name / f, dst / f)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is None:
        shutil.copy(GOLDEN / name / "model.safetensors", dst / "model.safetensors")
    else:
        st_write(dst / "model.safetensors", tensors)
    return dst


def f32_of(dtype: str, arr: np.ndarray) -> np.ndarray:
    assert dtype == "F16", dtype
    return arr.astype(np.float32)


def tensors_of(path: Path) -> dict[str, Any]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def ne(t: Any) -> list[int]:
    return [int(d) for d in t.shape]


def fields_of(path: Path) -> dict[str, Any]:
    return {k: f for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


# ---------------------------------------------------------------------------------------------
# tiny-l against llama.cpp
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_l_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ds4.convert(GOLDEN / "tiny-l", tmp_path_factory.mktemp("conv") / "tiny-l.gguf", progress=False)


def test_tiny_l_tensors_match_llamacpp(tiny_l_f32: Path) -> None:
    ours, ref = tensors_of(tiny_l_f32), tensors_of(LLAMACPP)
    assert sorted(ours) == sorted(ref)
    for name, r in ref.items():
        o = ours[name]
        assert o.tensor_type == r.tensor_type, name
        assert ne(o) == ne(r), name
        assert o.data.tobytes() == r.data.tobytes(), name


# general.* keys that legitimately differ: llama.cpp writes file_type 38 (MXFP4 MoE) for its
# all-F32 file, and embeds its own DeepSeek V4 chat template
_LLAMACPP_ONLY = {"general.file_type", "tokenizer.chat_template"}


def test_tiny_l_metadata_matches_llamacpp(tiny_l_f32: Path) -> None:
    ours, ref = fields_of(tiny_l_f32), fields_of(LLAMACPP)
    for key, r in ref.items():
        if key in _LLAMACPP_ONLY:
            continue
        assert key in ours, key
        o = ours[key]
        assert o.types == r.types, key
        assert o.contents() == r.contents(), key
    assert ours["general.file_type"].contents() == 0  # ALL_F32
    extra = {k: ours[k].contents() for k in ours if k not in ref}
    assert extra == {"deepseek4.vocab_size": 512, "deepseek4.expert_group_count": 0,
                     "deepseek4.expert_group_used_count": 0}
    f = ds4.GGUFFile(tiny_l_f32)
    types = f.metadata_types
    assert types["deepseek4.attention.compress_ratios"] == "array[i32]"
    assert types["deepseek4.swiglu_clamp_exp"] == "array[f32]"
    assert types["deepseek4.expert_weights_norm"] == "bool"
    assert f.metadata["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128, 0]
    assert f.metadata["general.size_label"] == "6x1.1M"
    assert len(f.tensors) == 116


# ---------------------------------------------------------------------------------------------
# tiny-a and tiny-b: transformers naming
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
def test_transformers_naming(name: str, tmp_path: Path) -> None:
    out = ds4.convert(GOLDEN / name, tmp_path / "m.gguf", progress=False)
    src = st_read(GOLDEN / name / "model.safetensors")
    cfg = json.loads((GOLDEN / name / "config.json").read_text())
    f = ds4.GGUFFile(out)
    t = tensors_of(out)

    def same(gguf_name: str, st_name: str) -> None:
        want = f32_of(*src[st_name])
        assert list(f.tensors[gguf_name].shape) == list(want.shape), gguf_name
        np.testing.assert_array_equal(f.read(gguf_name), want, err_msg=gguf_name)

    same("token_embd.weight", "model.embed_tokens.weight")
    same("output.weight", "head.weight")
    same("output_norm.weight", "model.norm.weight")
    same("output_hc_fn.weight", "model.hc_head.hc_fn")
    same("output_hc_scale.weight", "model.hc_head.hc_scale")
    same("blk.0.attn_kv_a_norm.weight", "model.layers.0.attn.norm.weight")
    same("blk.1.attn_q_b.weight", "model.layers.1.attn.wq_b.weight")
    same("blk.1.attn_compressor_ape.weight", "model.layers.1.attn.compressor.ape")
    same("blk.3.exp_probs_b.bias", "model.layers.3.ffn.gate.bias")
    same("blk.0.hc_ffn_fn.weight", "model.layers.0.hc_ffn_fn")
    n_exp = cfg["n_routed_experts"]
    for gname, w in (("ffn_gate_exps", "w1"), ("ffn_up_exps", "w3"), ("ffn_down_exps", "w2")):
        stacked = np.stack([f32_of(*src[f"model.layers.2.ffn.experts.{e}.{w}.weight"]) for e in range(n_exp)])
        np.testing.assert_array_equal(f.read(f"blk.2.{gname}.weight"), stacked)
    tid = f.read("blk.0.ffn_gate_tid2eid.weight")
    assert tid.dtype == np.int32 and t["blk.0.ffn_gate_tid2eid.weight"].tensor_type == gguf.GGMLQuantizationType.I32
    np.testing.assert_array_equal(tid, src["model.layers.0.ffn.gate.tid2eid"][1])

    # every tensor is accounted for: the GGUF holds as many values as the checkpoint
    n_src = sum(a.size for _, a in src.values())
    assert sum(int(np.prod(x.shape)) for x in t.values()) == n_src
    for x in t.values():
        assert x.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.I32)

    md = f.metadata
    if name == "tiny-a":  # SWA, HCA(16), CSA, HCA(16), CSA, SWA + MTP slot; hash layers 0, 1
        assert md["deepseek4.attention.compress_ratios"] == [0, 16, 4, 16, 4, 0, 0]
        assert md["deepseek4.hash_layer_count"] == 2
        assert list(f.tensors["blk.1.attn_compressor_ape.weight"].dims) == [64, 16]
        assert list(f.tensors["blk.2.attn_compressor_ape.weight"].dims) == [128, 4]
        assert "blk.1.indexer.proj.weight" not in f and "blk.2.indexer.proj.weight" in f
        assert md["deepseek4.attention.sliding_window"] == 8
    else:
        assert md["deepseek4.attention.compress_ratios"] == [128, 4, 128, 4, 0]
        assert md["deepseek4.hash_layer_count"] == 1
    assert md["deepseek4.rope.dimension_count"] == 16
    assert md["deepseek4.attention.indexer.key_length"] == 32
    assert md["deepseek4.rope.scaling.factor"] == 16.0
    assert md["deepseek4.attention.compress_rope_freq_base"] == 160000.0
    assert md["tokenizer.ggml.bos_token_id"] == 0 and md["tokenizer.ggml.eos_token_id"] == 1


# ---------------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------------

def expected_type(name: str, n_dims: int, dtype: str) -> str:
    """The documented policy, restated independently of ds4.convert.tensor_type."""
    if "tid2eid" in name:
        return "I32"
    if n_dims == 1 or dtype == "f32":
        return "F32"
    keep_f32 = "hc_" in name or name.endswith("_ape.weight")
    if dtype in ("f16", "bf16"):
        return "F32" if keep_f32 else dtype.upper()
    f16 = keep_f32 or "compressor" in name or "indexer" in name or "ffn_gate_inp" in name or "token_embd" in name
    return "F16" if f16 else "Q8_0"


@pytest.mark.parametrize("dtype", ["f16", "bf16", "q8_0"])
def test_dtypes(dtype: str, tiny_l_f32: Path, tmp_path: Path) -> None:
    out = ds4.convert(GOLDEN / "tiny-l", tmp_path / "m.gguf", dtype=dtype, progress=False)
    ref = tensors_of(LLAMACPP)
    got = tensors_of(out)
    assert sorted(got) == sorted(ref)
    seen = set()
    for name, r in ref.items():
        g = got[name]
        want_t = expected_type(name, len(r.shape), dtype)
        assert g.tensor_type.name == want_t, (name, g.tensor_type.name, want_t)
        seen.add(want_t)
        assert ne(g) == ne(r), name
        if want_t == "I32":
            assert g.data.tobytes() == r.data.tobytes()
            continue
        x = np.asarray(r.data, dtype=np.float32)
        qt = gguf.GGMLQuantizationType[want_t]
        want = x if want_t == "F32" else gguf.quants.quantize(x, qt)
        assert np.asarray(g.data).tobytes() == np.asarray(want).tobytes(), name
    assert {"F32", "I32"} < seen
    f = ds4.GGUFFile(out)
    assert f.metadata["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[dtype]
    np.testing.assert_allclose(f.read("blk.0.attn_q_a.weight"), ds4.GGUFFile(tiny_l_f32).read("blk.0.attn_q_a.weight"),
                               atol=0.02, rtol=0.02)


def test_type_fallbacks() -> None:
    assert tensor_type(TensorSpec("x.weight", (48, 64), "proj"), "q8_0") == "F16"
    assert tensor_type(TensorSpec("x.weight", (64, 64), "proj"), "q8_0") == "Q8_0"
    with pytest.raises(UnsupportedModelError, match="multiple of 256"):
        tensor_type(TensorSpec("x.weight", (64, 64, 4), "expert_down"), "q2")
    with pytest.raises(ValueError, match="unknown dtype"):
        tensor_type(TensorSpec("x.weight", (64, 64), "proj"), "q4")


# ---------------------------------------------------------------------------------------------
# FP8 / FP4 official checkpoints, MTP, shards
# ---------------------------------------------------------------------------------------------

def ref_e4m3(code: int) -> float:
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 7
    if e == 15 and m == 7:
        return float("nan")
    return s * (m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def ref_fp4(nibble: int) -> float:
    mag = [0, 0.5, 1, 1.5, 2, 3, 4, 6][nibble & 7]
    return -mag if nibble & 8 else mag


def test_fp8_codes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    got = decode_e4m3(codes)
    want = np.array([ref_e4m3(c) for c in range(256)], dtype=np.float32)
    np.testing.assert_array_equal(got, want)
    assert got[0x7E] == 448 and got[0x38] == 1.0 and got[0x01] == 2.0**-9 and got[0xB8] == -1.0
    e8 = decode_e8m0(codes)
    assert e8[127] == 1.0 and e8[128] == 2.0 and e8[0] == np.float32(2.0**-127) and np.isnan(e8[255])


def test_dequant_fp8_blocks() -> None:
    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, size=(300, 260), dtype=np.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    sc = rng.uniform(0.01, 4, size=(3, 3)).astype(np.float32)
    want = np.array([[ref_e4m3(int(w[i, j])) * sc[i // 128, j // 128] for j in range(260)] for i in range(300)],
                    dtype=np.float32)
    np.testing.assert_array_equal(dequant_fp8(w, sc), want)
    np.testing.assert_array_equal(dequant_fp8(w[130:200], sc, row0=130), want[130:200])


def test_fp8_fp4_checkpoint(tmp_path: Path) -> None:
    """tiny-l with an FP8 attention matrix and FP4 experts converts to their exact values."""
    rng = np.random.default_rng(1)
    tensors = st_read(GOLDEN / "tiny-l" / "model.safetensors")
    # FP8: wq_b [512, 64] -> scale [4, 1], one power of two per 128x128 block
    codes = rng.integers(0, 256, size=(512, 64), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38
    exps = rng.integers(120, 130, size=(4, 1), dtype=np.uint8)
    tensors["layers.1.attn.wq_b.weight"] = ("F8_E4M3", codes)
    tensors["layers.1.attn.wq_b.scale"] = ("F8_E8M0", exps)
    want_fp8 = np.vectorize(ref_e4m3)(codes) * 2.0 ** (exps.astype(np.float64)[np.arange(512) // 128] - 127)
    # FP4: layer 2 experts w1 [64, 128] -> I8 [64, 64] + E8M0 [64, 4]
    want_fp4 = []
    for e in range(6):
        packed = rng.integers(0, 256, size=(64, 64), dtype=np.uint8)
        sc = rng.integers(122, 132, size=(64, 4), dtype=np.uint8)
        tensors[f"layers.2.ffn.experts.{e}.w1.weight"] = ("I8", packed.view(np.int8))
        tensors[f"layers.2.ffn.experts.{e}.w1.scale"] = ("F8_E8M0", sc)
        vals = np.empty((64, 128))
        for i in range(64):
            for j in range(64):
                vals[i, 2 * j] = ref_fp4(packed[i, j] & 0xF)
                vals[i, 2 * j + 1] = ref_fp4(packed[i, j] >> 4)
        want_fp4.append(vals * 2.0 ** (np.repeat(sc.astype(np.float64), 32, axis=1) - 127))
        np.testing.assert_array_equal(dequant_fp4(packed, decode_e8m0(sc)), want_fp4[-1].astype(np.float32))
    d = copy_fixture("tiny-l", tmp_path / "fp", tensors)
    f = ds4.GGUFFile(ds4.convert(d, tmp_path / "fp.gguf", progress=False))
    np.testing.assert_array_equal(f.read("blk.1.attn_q_b.weight"), want_fp8.astype(np.float32))
    np.testing.assert_array_equal(f.read("blk.2.ffn_gate_exps.weight"), np.stack(want_fp4).astype(np.float32))

    # a scale of the wrong shape is refused, naming the tensor
    tensors["layers.1.attn.wq_b.scale"] = ("F8_E8M0", exps[:3])
    d = copy_fixture("tiny-l", tmp_path / "bad", tensors)
    with pytest.raises(UnsupportedModelError, match="layers.1.attn.wq_b.weight"):
        ds4.convert(d, tmp_path / "bad.gguf", progress=False)


def test_mtp_and_shards(tiny_l_f32: Path, tmp_path: Path) -> None:
    """MTP tensors (a second shard, with an index) become mtp.0.<gguf name>."""
    tensors = st_read(GOLDEN / "tiny-l" / "model.safetensors")
    rng = np.random.default_rng(2)
    mtp: dict[str, tuple[str, np.ndarray]] = {}
    for name, (dt, arr) in tensors.items():  # layer 3 without its compressor as the block
        if name.startswith("layers.3.") and "compressor" not in name and "indexer" not in name:
            mtp["mtp.0." + name[len("layers.3."):]] = (dt, arr)
    for n in ("e_proj.weight", "h_proj.weight"):
        mtp["mtp.0." + n] = ("F16", rng.standard_normal((128, 128)).astype(np.float16))
    for n in ("enorm.weight", "hnorm.weight", "norm.weight"):
        mtp["mtp.0." + n] = ("F16", rng.standard_normal(128).astype(np.float16))
    mtp["mtp.0.hc_head_fn"] = ("F16", rng.standard_normal((4, 512)).astype(np.float16))
    mtp["mtp.0.hc_head_base"] = ("F16", rng.standard_normal(4).astype(np.float16))
    mtp["mtp.0.hc_head_scale"] = ("F16", np.ones(1, np.float16))
    d = tmp_path / "mtp"
    copy_fixture("tiny-l", d, {k: v for k, v in tensors.items() if not k.startswith("layers.3.")})
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    st_write(d / "model-00002-of-00002.safetensors", {**{k: v for k, v in tensors.items() if k.startswith("layers.3.")},
                                                       **mtp})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors if not k.startswith("layers.3.")}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in tensors if k.startswith("layers.3.")})
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in mtp})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = ds4.convert(d, tmp_path / "mtp.gguf", progress=False)
    f, ref = ds4.GGUFFile(out), ds4.GGUFFile(tiny_l_f32)
    trunk = [n for n in f.tensors if not n.startswith("mtp.")]
    assert trunk == list(ref.tensors)
    for n in trunk:
        assert f.read_raw(n) == ref.read_raw(n), n
    assert f.metadata["deepseek4.block_count"] == 4
    names = {n for n in f.tensors if n.startswith("mtp.0.")}
    want = {"mtp.0." + n.split(".", 2)[2] for n in ref.tensors if n.startswith("blk.3.")
            and "compressor" not in n and "indexer" not in n}
    want |= {f"mtp.0.{n}.weight" for n in ("e_proj", "h_proj", "enorm", "hnorm", "norm", "hc_head_fn",
                                           "hc_head_base", "hc_head_scale")}
    assert names == want
    np.testing.assert_array_equal(f.read("mtp.0.attn_q_a.weight"), ref.read("blk.3.attn_q_a.weight"))
    np.testing.assert_array_equal(f.read("mtp.0.ffn_down_exps.weight"), ref.read("blk.3.ffn_down_exps.weight"))
    np.testing.assert_array_equal(f.read("mtp.0.hc_head_fn.weight"), mtp["mtp.0.hc_head_fn"][1].astype(np.float32))
    assert list(f.tensors["mtp.0.hc_head_fn.weight"].dims) == [512, 4]
    # the plan with one MTP layer names exactly these
    plan = tensor_plan(ModelConfig.from_dict(json.loads((d / "config.json").read_text())), mtp_layers=1)
    assert [s.name for s in plan] == list(f.tensors)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------

def test_missing_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ds4.convert(tmp_path / "nope", tmp_path / "x.gguf")
    d = copy_fixture("tiny-a", tmp_path / "a")
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ds4.convert(d, tmp_path / "x.gguf")
    d = copy_fixture("tiny-a", tmp_path / "b")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        ds4.convert(d, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


def test_missing_unknown_and_misshapen_tensors(tmp_path: Path) -> None:
    tensors = st_read(GOLDEN / "tiny-a" / "model.safetensors")
    gone = "model.layers.2.attn.indexer.wq_b.weight"
    d = copy_fixture("tiny-a", tmp_path / "a", {k: v for k, v in tensors.items() if k != gone})
    with pytest.raises(UnsupportedModelError, match=r"missing tensor 'layers\.2\.attn\.indexer\.wq_b\.weight'"):
        ds4.convert(d, tmp_path / "x.gguf", progress=False)
    assert not list(tmp_path.glob("x.gguf*"))

    d = copy_fixture("tiny-a", tmp_path / "b", {**tensors, "model.layers.0.attn.mystery": ("F16", np.zeros(3))})
    with pytest.raises(UnsupportedModelError, match="model.layers.0.attn.mystery"):
        ds4.convert(d, tmp_path / "x.gguf", progress=False)

    bad = dict(tensors)
    bad["model.layers.3.attn.wkv.weight"] = ("F16", np.zeros((64, 96)))
    d = copy_fixture("tiny-a", tmp_path / "c", bad)
    with pytest.raises(UnsupportedModelError, match=r"model\.layers\.3\.attn\.wkv\.weight.*\[64, 96\]"):
        ds4.convert(d, tmp_path / "x.gguf", progress=False)


@pytest.mark.parametrize("key", ["q_lora_rank", "hidden_size", "layer_types"])
def test_missing_config_key(key: str, tmp_path: Path) -> None:
    cfg = json.loads((GOLDEN / "tiny-a" / "config.json").read_text())
    del cfg[key]
    d = copy_fixture("tiny-a", tmp_path / "a", config=cfg)
    with pytest.raises(UnsupportedModelError, match="compress_ratios" if key == "layer_types" else key):
        ds4.convert(d, tmp_path / "x.gguf", progress=False)


def test_config_forms_agree() -> None:
    """tiny-l's config in official form and in transformers form parse to the same config."""
    cfg = json.loads((GOLDEN / "tiny-l" / "config.json").read_text())
    official = ModelConfig.from_dict(cfg)
    hf = ModelConfig.from_dict({k: v for k, v in cfg.items()
                                if k not in ("compress_ratios", "num_hash_layers", "rope_scaling", "qk_rope_head_dim")})
    assert official.compress_ratios == hf.compress_ratios == (0, 0, 4, 128)
    assert official.gguf_compress_ratios == [0, 0, 4, 128, 0]
    assert official.num_hash_layers == hf.num_hash_layers == 2
    assert official.qk_rope_head_dim == hf.qk_rope_head_dim == 64
    assert official.to_dict() == hf.to_dict()
    assert ModelConfig.from_dict(TINY.to_dict()) == TINY


# ---------------------------------------------------------------------------------------------
# random models
# ---------------------------------------------------------------------------------------------

def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", ["f32", "q8_0", "q2"])
def test_random_tiny(dtype: str, tmp_path: Path) -> None:
    path = random_model(tmp_path / "t.gguf", TINY, seed=0, dtype=dtype)
    f = ds4.GGUFFile(path)
    r = tensors_of(path)
    plan = tensor_plan(TINY)
    assert list(f.tensors) == [s.name for s in plan] == list(r)
    for s in plan:
        assert tuple(f.tensors[s.name].dims) == s.ne == tuple(ne(r[s.name])), s.name
        assert f.tensors[s.name].type == tensor_type(s, dtype), s.name
    md = f.metadata
    assert md["general.architecture"] == "deepseek4"
    assert md["deepseek4.attention.compress_ratios"] == [0, 0, 4, 128, 4, 128, 0]
    assert md["deepseek4.vocab_size"] == 1024 and len(md["tokenizer.ggml.tokens"]) == 1024
    if dtype == "q2":
        assert f.tensors["blk.3.ffn_gate_exps.weight"].type == "IQ2_XXS"
        assert f.tensors["blk.3.ffn_down_exps.weight"].type == "Q2_K"
        assert f.tensors["blk.3.attn_q_b.weight"].type == "Q8_0"
        assert f.tensors["blk.3.hc_attn_fn.weight"].type == "F16"
        for name in ("blk.3.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight"):
            x = gguf.quants.dequantize(r[name].data, r[name].tensor_type)
            assert np.isfinite(x).all() and 0.001 < x.std() < 1, (name, x.std())
    tid = f.read("blk.0.ffn_gate_tid2eid.weight")
    assert tid.shape == (1024, 6) and tid.min() >= 0 and tid.max() < 16
    assert all(len(set(row)) == 6 for row in tid.tolist())
    w = f.read("blk.2.attn_q_a.weight")
    assert np.isfinite(w).all() and abs(w.std() * np.sqrt(256) - 1) < 0.1
    assert (f.read("blk.2.attn_sinks.weight") == 0).all() and (f.read("blk.2.hc_ffn_scale.weight") == 1).all()


def test_random_deterministic(tmp_path: Path) -> None:
    a = random_model(tmp_path / "a.gguf", MICRO, seed=7, dtype="q8_0")
    b = random_model(tmp_path / "b.gguf", MICRO, seed=7, dtype="q8_0")
    c = random_model(tmp_path / "c.gguf", MICRO, seed=8, dtype="q8_0")
    assert sha(a) == sha(b) != sha(c)
    m = random_model(tmp_path / "m.gguf", MICRO, seed=7, dtype="f32", mtp=True)
    names = list(ds4.GGUFFile(m).tensors)
    assert names == [s.name for s in tensor_plan(MICRO, mtp_layers=1)]
    assert "mtp.0.e_proj.weight" in names and "mtp.0.exp_probs_b.bias" in names
    with pytest.raises(UnsupportedModelError, match="multiple of 256"):
        random_model(tmp_path / "q2.gguf", MICRO, dtype="q2")


def test_random_matches_converter_layout(tmp_path: Path) -> None:
    """random_model of tiny-l's config.json has llama.cpp's tensor table for tiny-l."""
    cfg = json.loads((GOLDEN / "tiny-l" / "config.json").read_text())
    out = random_model(tmp_path / "r.gguf", cfg, seed=3)
    got, ref = tensors_of(out), tensors_of(LLAMACPP)
    assert {n: (t.tensor_type, ne(t)) for n, t in got.items()} == {n: (t.tensor_type, ne(t)) for n, t in ref.items()}


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------

def test_convert_tokenizer(tmp_path: Path) -> None:
    out = ds4.convert_tokenizer(GOLDEN / "tiny-l" / "tokenizer.json", tmp_path / "tok.gguf")
    f = ds4.GGUFFile(out)
    ref = fields_of(LLAMACPP)
    assert len(f.tensors) == 0 and f.metadata["general.architecture"] == "deepseek4"
    assert f.metadata["tokenizer.ggml.tokens"] == ref["tokenizer.ggml.tokens"].contents()[:455]
    assert f.metadata["tokenizer.ggml.merges"] == ref["tokenizer.ggml.merges"].contents()
    assert f.metadata["tokenizer.ggml.token_type"] == ref["tokenizer.ggml.token_type"].contents()[:455]
    assert f.metadata["tokenizer.ggml.pre"] == "gpt-2"
    assert f.metadata["tokenizer.ggml.add_bos_token"] is True

    # the DeepSeek V3/V4 split sequence is "joyai-llm"; merges as pairs; user-defined added tokens
    tj = json.loads((GOLDEN / "tiny-l" / "tokenizer.json").read_text())
    splits = ["\\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+",
              "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
              " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"]
    tj["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        *({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": False} for r in splits),
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    tj["added_tokens"][2]["special"] = False
    tj["added_tokens"].append({"id": 460, "content": "<｜DSML｜>", "special": False})
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    f = ds4.GGUFFile(ds4.convert_tokenizer(tmp_path / "ds" / "tokenizer.json", tmp_path / "ds.gguf"))
    md = f.metadata
    assert md["tokenizer.ggml.pre"] == "joyai-llm"
    assert len(md["tokenizer.ggml.tokens"]) == 461 and md["tokenizer.ggml.tokens"][460] == "<｜DSML｜>"
    assert md["tokenizer.ggml.token_type"][2] == 4 and md["tokenizer.ggml.token_type"][460] == 4
    assert md["tokenizer.ggml.tokens"][455] == "[PAD455]" and md["tokenizer.ggml.token_type"][455] == 5
    tj["pre_tokenizer"] = {"type": "Whitespace"}
    (tmp_path / "ds" / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    with pytest.raises(UnsupportedModelError, match="pre_tokenizer"):
        ds4.convert_tokenizer(tmp_path / "ds" / "tokenizer.json", tmp_path / "x.gguf")


# ---------------------------------------------------------------------------------------------
# the writer, the reader, the progress bar
# ---------------------------------------------------------------------------------------------

def test_writer_value_types(tmp_path: Path) -> None:
    path = tmp_path / "w.gguf"
    w = GGUFWriter(path, arch="test", alignment=64)
    values = [("a.u8", 200, "u8"), ("a.i8", -5, "i8"), ("a.u16", 60000, "u16"), ("a.i16", -300, "i16"),
              ("a.u32", 4_000_000_000, "u32"), ("a.i32", -7, "i32"), ("a.u64", 2**40, "u64"),
              ("a.i64", -(2**40), "i64"), ("a.f32", 0.5, "f32"), ("a.f64", 0.1, "f64"), ("a.b", True, "bool"),
              ("a.s", "héllo", "string"), ("a.af", [1.5, -2.0], "array[f32]"), ("a.ab", [True, False], "array[bool]"),
              ("a.as", ["x", "yz"], "array[string]"), ("a.aai", [[1, 2], [3]], "array[array[i32]]"),
              ("a.empty", [], "array[u32]")]
    for k, v, t in values:
        w.add(k, v, t)
    w.add_tensor_info("t0", [3], "F32")
    w.add_tensor_info("t1", [32, 2], "Q8_0")
    with pytest.raises(ValueError):
        w.add_tensor_info("t2", [33], "Q8_0")
    w.write_header()
    with pytest.raises(RuntimeError, match="declared order"):
        w.write_tensor("t1", [])
    w.write_tensor("t0", [np.arange(3, dtype=np.float32)])
    q = gguf.quants.quantize(np.full((2, 32), 127.0, np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.write_tensor("t1", [q[:1], q[1:].tobytes()])
    w.close()
    f = ds4.GGUFFile(path)
    assert f.alignment == 64
    for k, v, t in values:
        assert f.metadata_types[k] == t, k
        assert f.metadata[k] == (pytest.approx(v) if t in ("f32", "f64") else v), k
    assert f.tensors["t1"].offset % 64 == 0
    np.testing.assert_array_equal(f.read("t0"), [0, 1, 2])
    np.testing.assert_array_equal(f.read("t1"), np.full((2, 32), 127.0))
    r = gguf.GGUFReader(path)
    A = gguf.GGUFValueType
    assert r.fields["a.aai"].types == [A.ARRAY, A.ARRAY, A.INT32]
    assert r.fields["a.as"].contents() == ["x", "yz"] and r.fields["a.u64"].contents() == 2**40


def test_safetensors_reader(tmp_path: Path) -> None:
    x = np.array([[1.5, -2.25], [3.0, 1e-3]], dtype=np.float32)
    bf = (x.view(np.uint32) >> 16).astype(np.uint16)
    st_write(tmp_path / "a.safetensors", {"f32": ("F32", x), "bf16": ("BF16", bf), "i64": ("I64", np.arange(4)),
                                          "u8": ("U8", np.arange(3, dtype=np.uint8))})
    st_write(tmp_path / "b.safetensors", {"f16": ("F16", x.astype(np.float16))})
    f = SafetensorsFile(tmp_path / "a.safetensors")
    np.testing.assert_array_equal(f.read("f32"), x)
    np.testing.assert_array_equal(f.read("bf16"), (bf.astype(np.uint32) << 16).view(np.float32))
    np.testing.assert_array_equal(f.read("f32", rows=(1, 2)), x[1:2])
    assert f.read("i64").dtype == np.int64 and f.read("u8").tolist() == [0, 1, 2]
    with Checkpoint(tmp_path) as c:
        assert sorted(c) == ["bf16", "f16", "f32", "i64", "u8"]
        np.testing.assert_array_equal(c.read("f16"), x.astype(np.float16).astype(np.float32))
    (tmp_path / "c.safetensors").write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(UnsupportedModelError):
        SafetensorsFile(tmp_path / "c.safetensors")


def test_progress_silent_without_tty(capsys: pytest.CaptureFixture[str]) -> None:
    with Progress(100, "x") as p:
        p.update(50, "t")
        p.update(50)
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

def test_cli_convert(tmp_path: Path) -> None:
    out = tmp_path / "a.gguf"
    r = subprocess.run([sys.executable, "-m", "ds4", "convert", str(GOLDEN / "tiny-a") + "/", str(out),
                        "--dtype", "q8_0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and r.stderr == ""
    r = subprocess.run([sys.executable, "-m", "ds4", "info", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Q8_0" in r.stdout and "'deepseek4'" in r.stdout
    r = subprocess.run([sys.executable, "-m", "ds4", "convert", str(tmp_path / "none"), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("ds4: error:")
