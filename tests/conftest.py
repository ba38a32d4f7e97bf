"""Shared fixtures and helpers: GGUF files written with gguf-py's GGUFWriter (the oracle)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden"
LLAMACPP_TINY_L = GOLDEN / "tiny-l" / "llamacpp-f32.gguf"

# ggml type -> (byte offset, byte length) of every f16 scale in one block, so random blocks
# can be given finite scales.
F16_SCALES: dict[str, list[int]] = {
    "Q8_0": [0],
    "Q4_K": [0, 2],
    "Q2_K": [80, 82],
    "IQ2_XXS": [0],
}
QUANT_TYPES = ["Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4"]
FLOAT_TYPES = ["F32", "F16", "BF16"]
ALL_TYPES = FLOAT_TYPES + QUANT_TYPES


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def block_geometry(name: str) -> tuple[int, int]:
    """(elements, bytes) per block."""
    return gguf.GGML_QUANT_SIZES[qtype(name)]


def random_blocks(rng: np.random.Generator, name: str, n_blocks: int) -> np.ndarray:
    """Random valid blocks of a quantized type: random bytes with finite f16 scales."""
    _, bb = block_geometry(name)
    data = rng.integers(0, 256, size=(n_blocks, bb), dtype=np.uint8)
    for off in F16_SCALES.get(name, []):
        # Finite f16 of moderate size, either sign (exponent field never all ones).
        scale = rng.uniform(-4.0, 4.0, size=n_blocks).astype(np.float16)
        data[:, off : off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    if name == "MXFP4":
        # E8M0 scale 2^(e-128) near 1 so products stay well inside float32.
        data[:, 0] = rng.integers(118, 138, size=n_blocks)
    return data.reshape(-1)


def random_row(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    """Raw bytes (uint8) of a row of ``n`` elements of type ``name``."""
    if name == "F32":
        return rng.standard_normal(n).astype("<f4").view(np.uint8)
    if name == "F16":
        return rng.standard_normal(n).astype("<f2").view(np.uint8)
    if name == "BF16":
        bits = (rng.standard_normal(n).astype("<f4").view("<u4") >> 16).astype("<u2")
        return bits.view(np.uint8)
    be, _ = block_geometry(name)
    return random_blocks(rng, name, n // be)


def write_gguf(path: os.PathLike[str] | str, metadata: list[tuple[str, Any, gguf.GGUFValueType, Any]],
               tensors: list[tuple[str, np.ndarray, str | None]], alignment: int | None = None) -> None:
    """Writes a GGUF with gguf-py. ``tensors`` holds (name, array, raw ggml type or None);
    for a raw type the array is uint8 bytes shaped (rows, row_bytes)."""
    w = gguf.GGUFWriter(path, arch="test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, sub in metadata:
        w.add_key_value(key, value, vtype, sub_type=sub)
    for name, arr, raw in tensors:
        w.add_tensor(name, arr, raw_dtype=None if raw is None else qtype(raw))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def llamacpp_tiny_l() -> Path:
    assert LLAMACPP_TINY_L.exists(), "tests/golden/tiny-l/llamacpp-f32.gguf is missing"
    return LLAMACPP_TINY_L
