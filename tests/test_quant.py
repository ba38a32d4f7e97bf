"""Quantized formats against gguf-py's numpy implementation (the oracle)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import ds4
from conftest import ALL_TYPES, F16_SCALES, QUANT_TYPES, block_geometry, qtype, random_row

KERNELS = ["scalar", "simd"] if ds4.quant.simd_available() else ["scalar"]


def test_supported_types() -> None:
    assert set(ds4.quant.SUPPORTED_TYPES) == set(ALL_TYPES)
    geometry = {t.name: (t.block_elems, t.block_bytes) for t in ds4.quant.ggml_types()}
    for name, size in gguf.GGML_QUANT_SIZES.items():
        assert geometry[name.name] == size, name.name


@st.composite
def blocks(draw: st.DrawFn, name: str) -> np.ndarray:
    """Random valid blocks: arbitrary bytes, with finite f16 scales."""
    _, bb = block_geometry(name)
    n = draw(st.integers(1, 6))
    data = bytearray(draw(st.binary(min_size=n * bb, max_size=n * bb)))
    for b in range(n):
        for off in F16_SCALES.get(name, []):
            scale = draw(st.floats(width=16, allow_nan=False, allow_infinity=False))
            data[b * bb + off : b * bb + off + 2] = np.float16(scale).tobytes()
        if name == "MXFP4":
            # Any E8M0 scale whose largest product (12 * 2^(e-128)) is a finite float32.
            data[b * bb] = draw(st.integers(0, 250))
    return np.frombuffer(bytes(data), dtype=np.uint8)


@pytest.mark.parametrize("name", QUANT_TYPES)
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_dequantize_bit_identical(name: str, data: st.DataObject) -> None:
    raw = data.draw(blocks(name))
    got = ds4.quant.dequantize(raw, name)
    want = gguf.quants.dequantize(raw, qtype(name)).reshape(-1)
    assert got.dtype == np.float32 and want.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name,width", [("F16", 16), ("BF16", 16), ("F32", 32)])
@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_float_dequantize_bit_identical(name: str, width: int, data: st.DataObject) -> None:
    bits = data.draw(hnp.arrays(np.uint16 if width == 16 else np.uint32, st.integers(1, 64)))
    # NaN payloads are not something the oracle promises to keep; only finite and inf values.
    vals = gguf.quants.dequantize(bits.view(np.uint8), qtype(name)).reshape(-1)
    keep = ~np.isnan(vals)
    bits, vals = bits[keep], vals[keep]
    got = ds4.quant.dequantize(bits.view(np.uint8), name)
    assert np.array_equal(got.view(np.uint32), vals.view(np.uint32))


@pytest.mark.parametrize("name", ALL_TYPES)
@pytest.mark.parametrize("kernel", KERNELS)
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_blocks=st.integers(1, 24))
def test_dot_matches_numpy(name: str, kernel: str, seed: int, n_blocks: int) -> None:
    rng = np.random.default_rng(seed)
    be, _ = block_geometry(name)
    n = n_blocks * (be if be > 1 else 37)
    row = random_row(rng, name, n)
    x = rng.standard_normal(n).astype(np.float32)
    w = ds4.quant.dequantize(row, name).astype(np.float64)
    want = float(np.dot(w, x.astype(np.float64)))
    scale = float(np.sum(np.abs(w * x))) + 1e-30
    got = ds4.quant.dot(row, x, name, kernel=kernel)  # type: ignore[arg-type]
    assert abs(got - want) <= 1e-5 * scale, (got, want, scale)


@pytest.mark.parametrize("name", ALL_TYPES)
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_simd_agrees_with_scalar(name: str, seed: int) -> None:
    if not ds4.quant.simd_available():
        pytest.skip("no SIMD kernels on this CPU")
    rng = np.random.default_rng(seed)
    be, _ = block_geometry(name)
    n = 4096 if be > 1 else 4099
    row = random_row(rng, name, n)
    x = rng.standard_normal(n).astype(np.float32)
    w = ds4.quant.dequantize(row, name).astype(np.float64)
    scale = float(np.sum(np.abs(w * x)))
    a = ds4.quant.dot(row, x, name, kernel="scalar")
    b = ds4.quant.dot(row, x, name, kernel="simd")
    assert abs(a - b) <= 1e-5 * scale
    # Deterministic: the same call gives the same bits.
    assert ds4.quant.dot(row, x, name, kernel="simd") == b


# Q8_0 stores d = max|x| / 127 as f16, so inputs stay below 127 * 65504.
finite_f32 = hnp.arrays(np.float32, st.integers(1, 8).map(lambda k: 32 * k),
                        elements=st.floats(-(2.0**22), 2.0**22, width=32, allow_subnormal=True))


@settings(max_examples=200, deadline=None)
@given(x=finite_f32)
def test_quantize_q8_0_bit_identical(x: np.ndarray) -> None:
    # When 1/d overflows (max|x| below ~127 * 2^-128) both ggml and gguf-py cast inf to int8,
    # which C and numpy leave undefined: such blocks have no oracle.
    amax = np.abs(x.reshape(-1, 32)).max(axis=1)
    assume(bool(np.all((amax == 0) | (amax >= 2.0**-120))))
    got = ds4.quant.quantize_q8_0(x)
    with np.errstate(over="ignore", invalid="ignore"):
        want = gguf.quants.quantize(x.reshape(-1, 32), qtype("Q8_0")).reshape(-1)
    assert got.tobytes() == want.tobytes()


@settings(max_examples=200, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 64), elements=st.floats(width=32, allow_nan=False)))
def test_f16_and_bf16_conversion(x: np.ndarray) -> None:
    with np.errstate(over="ignore"):  # beyond the f16 range both give inf
        want_f16 = x.astype(np.float16).view(np.uint16)
    assert np.array_equal(ds4.quant.f32_to_f16(x), want_f16)
    want_bf16 = gguf.quants.quantize(x, qtype("BF16")).view(np.uint16).reshape(-1)
    assert np.array_equal(ds4.quant.f32_to_bf16(x), want_bf16)
    back = ds4.quant.bf16_to_f32(want_bf16)
    assert np.array_equal(back, gguf.quants.dequantize(want_bf16.view(np.uint8), qtype("BF16")).reshape(-1))


def test_errors() -> None:
    with pytest.raises(ValueError, match="whole number of Q8_0 blocks"):
        ds4.quant.dequantize(b"\0" * 33, "Q8_0")
    with pytest.raises(ValueError, match="unknown GGML type"):
        ds4.quant.dequantize(b"\0" * 34, "Q9_9")
    with pytest.raises(ds4.UnsupportedModelError, match="Q6_K"):
        ds4.quant.dequantize(b"\0" * 210, "Q6_K")
    with pytest.raises(ValueError):
        ds4.quant.dot(b"\0" * 34, np.zeros(31, np.float32), "Q8_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        ds4.quant.quantize_q8_0(np.zeros(31, np.float32))
    with pytest.raises(ValueError, match="kernel"):
        ds4.quant.dot(b"\0" * 34, np.zeros(32, np.float32), "Q8_0", kernel="gpu")  # type: ignore[arg-type]
