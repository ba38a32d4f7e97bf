#!/usr/bin/env python3
"""Write a small seed corpus of valid GGUF files for the `gguf_parse` fuzz target.

Usage (from the repo root or anywhere):
    python3 fuzz/make_seeds.py [OUT_DIR]      # default: fuzz/corpus/gguf_parse

Needs the `gguf` and `numpy` Python packages. Every seed is well under 64 KiB, so the
fuzzer's -max_len=65536 keeps them whole. Types the `gguf` package cannot quantize
(K-quants, IQ2_XXS, MXFP4, ...) are written as deterministic pseudo-random bytes of the
right size with `raw_dtype`, which is all the parser and the dequantizers need.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

HERE = Path(__file__).resolve().parent
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "corpus" / "gguf_parse"
MAX_SEED = 64 * 1024
rng = np.random.default_rng(0x6775_6666)


def write(name: str, build, **kw) -> None:
    path = OUT / f"{name}.gguf"
    w = gguf.GGUFWriter(str(path), arch=kw.pop("arch", "ds4"), **kw)
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    size = path.stat().st_size
    assert size <= MAX_SEED, f"{path} is {size} bytes (> {MAX_SEED})"
    print(f"{path.name:32s} {size:6d} bytes")


def raw_quant(w: gguf.GGUFWriter, name: str, qtype: Q, shape: tuple[int, ...]) -> None:
    """A tensor of `qtype` with logical `shape` (numpy order, last dim innermost) and random
    block bytes. F16 scales inside the blocks are kept finite by masking exponent bits."""
    elems_per_block, bytes_per_block = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    assert cols % elems_per_block == 0
    nbytes = rows * (cols // elems_per_block) * bytes_per_block
    data = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    data = data & 0xBF  # clears bit 6 of every byte: no F16 with exponent 0x1F (inf/nan)
    w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=qtype)


def all_metadata(w: gguf.GGUFWriter) -> None:
    w.add_name("seed-all-metadata")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4_000_000_000)
    w.add_int32("test.i32", -2_000_000_000)
    w.add_uint64("test.u64", 2**63 + 5)
    w.add_int64("test.i64", -(2**62))
    w.add_float32("test.f32", 3.25)
    w.add_float64("test.f64", -1e300)
    w.add_bool("test.bool_t", True)
    w.add_bool("test.bool_f", False)
    w.add_string("test.str", "héllo, wörld \u2603")
    w.add_string("test.str_empty", "")
    w.add_array("test.arr_i32", [1, -2, 3, -4])
    w.add_array("test.arr_f32", [0.5, 1.5, -2.5])
    w.add_array("test.arr_bool", [True, False, True])
    w.add_array("test.arr_str", ["a", "bc", "", "déf"])
    w.add_key_value("test.arr_u8", [0, 1, 255], V.ARRAY, V.UINT8)
    w.add_key_value("test.arr_u64", [0, 2**64 - 1], V.ARRAY, V.UINT64)
    w.add_key_value("test.arr_f64", [0.1, -0.2], V.ARRAY, V.FLOAT64)
    w.add_array("test.arr_nested", [[1, 2], [3]])  # the writer refuses empty arrays
    w.add_array("test.arr_nested_str", [["x", "yz"], ["w"]])
    # A small tokenizer-like block, as real model files carry.
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "b", "ab"])
    w.add_token_types([3, 3, 1, 1, 1])
    w.add_token_scores([0.0, 0.0, -1.0, -2.0, -0.5])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_tensor("tiny", np.arange(4, dtype=np.float32))


def plain_tensors(w: gguf.GGUFWriter) -> None:
    w.add_uint32("ds4.block_count", 1)
    w.add_tensor("t.f32_1d", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("t.f32_2d", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("t.f32_3d", rng.standard_normal((2, 2, 3)).astype(np.float32))
    w.add_tensor("t.f16", rng.standard_normal((2, 8)).astype(np.float16))
    w.add_tensor("t.f64", rng.standard_normal(3).astype(np.float64))
    w.add_tensor("t.i8", np.arange(-4, 4, dtype=np.int8))
    w.add_tensor("t.i16", np.arange(-3, 3, dtype=np.int16))
    w.add_tensor("t.i32", np.arange(5, dtype=np.int32))
    w.add_tensor("t.i64", np.arange(2, dtype=np.int64))
    w.add_tensor("t.scalar", np.array([42.0], dtype=np.float32))


def quant_tensors(w: gguf.GGUFWriter) -> None:
    x = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q.q8_0", gguf.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("q.bf16", gguf.quantize(x, Q.BF16), raw_dtype=Q.BF16)
    w.add_tensor("q.q4_0", gguf.quantize(x, Q.Q4_0), raw_dtype=Q.Q4_0)
    raw_quant(w, "q.q4_k", Q.Q4_K, (2, 256))
    raw_quant(w, "q.q2_k", Q.Q2_K, (1, 256))
    raw_quant(w, "q.iq2_xxs", Q.IQ2_XXS, (1, 256))
    raw_quant(w, "q.mxfp4", Q.MXFP4, (2, 32))
    raw_quant(w, "q.q6_k", Q.Q6_K, (1, 256))  # a type the engine cannot dequantize


def aligned(w: gguf.GGUFWriter) -> None:
    w.add_custom_alignment(64)
    w.add_tensor("a.f32", np.arange(3, dtype=np.float32))
    w.add_tensor("a.f16", np.arange(5, dtype=np.float16))
    x = rng.standard_normal(32).astype(np.float32)
    w.add_tensor("a.q8_0", gguf.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)


def empty(w: gguf.GGUFWriter) -> None:
    pass


def kv_only(w: gguf.GGUFWriter) -> None:
    w.add_string("general.description", "metadata only, no tensors")
    w.add_uint32("general.quantization_version", 2)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    write("empty", empty, arch="x")  # only general.architecture
    write("kv_only", kv_only)
    write("all_metadata", all_metadata)
    write("plain_tensors", plain_tensors)
    write("quant_tensors", quant_tensors)
    write("aligned64", aligned)
    write("big_endian", plain_tensors, endianess=gguf.GGUFEndian.BIG)  # most readers reject
    # GGUF v2 has the same little-endian layout as v3; only the version field differs.
    v3 = (OUT / "quant_tensors.gguf").read_bytes()
    assert v3[:8] == b"GGUF\x03\x00\x00\x00"
    (OUT / "quant_tensors_v2.gguf").write_bytes(v3[:4] + (2).to_bytes(4, "little") + v3[8:])
    print(f"{'quant_tensors_v2.gguf':32s} {len(v3):6d} bytes")


if __name__ == "__main__":
    main()
