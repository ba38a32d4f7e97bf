"""Quantized formats: dequantize, fused dot products, Q8_0 / F16 / BF16 conversion.

These run the engine's own kernels on numpy buffers, mainly for tests and inspection.
Types are named as ggml names them: "F32", "F16", "BF16", "Q8_0", "Q4_K", "Q2_K",
"IQ2_XXS", "MXFP4".
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from . import _ds4

__all__ = [
    "GGMLType",
    "SUPPORTED_TYPES",
    "bf16_to_f32",
    "dequantize",
    "dot",
    "f16_to_f32",
    "f32_to_bf16",
    "f32_to_f16",
    "ggml_types",
    "quantize_q8_0",
    "simd_available",
]

Kernel = Literal["auto", "scalar", "simd"]


class GGMLType(NamedTuple):
    """A GGML tensor type and its block geometry."""

    name: str
    id: int
    block_elems: int
    block_bytes: int
    supported: bool


def ggml_types() -> list[GGMLType]:
    """Every type ggml defines, with whether ds4 can dequantize it."""
    return [GGMLType(*t) for t in _ds4.ggml_types()]


SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in ggml_types() if t.supported)


def _bytes(a: npt.ArrayLike | bytes, dtype: str) -> bytes:
    if isinstance(a, (bytes, bytearray, memoryview)):
        return bytes(a)
    return np.ascontiguousarray(a, dtype=dtype).tobytes()


def dequantize(data: npt.ArrayLike | bytes, qtype: str) -> npt.NDArray[np.float32]:
    """Dequantizes whole blocks of ``qtype`` (raw bytes or a uint8 array) to float32."""
    return np.frombuffer(_ds4.dequantize(qtype, _bytes(data, "u1")), dtype="<f4")


def dot(row: npt.ArrayLike | bytes, x: npt.ArrayLike, qtype: str, kernel: Kernel = "auto") -> float:
    """Fused dot product of one quantized row with the float32 vector ``x``."""
    return _ds4.dot(qtype, _bytes(row, "u1"), _bytes(x, "<f4"), kernel)


def simd_available() -> bool:
    """Whether this CPU has the SIMD kernels (AVX2 + FMA on x86-64)."""
    return _ds4.simd_available()


def quantize_q8_0(x: npt.ArrayLike) -> npt.NDArray[np.uint8]:
    """Quantizes float32 values (a multiple of 32) to Q8_0 blocks, bit-identical to gguf-py."""
    return np.frombuffer(_ds4.quantize_q8_0(_bytes(x, "<f4")), dtype=np.uint8)


def f32_to_f16(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """float32 -> float16 bit patterns, rounding to nearest even."""
    return np.frombuffer(_ds4.f32_to_f16(_bytes(x, "<f4")), dtype="<u2")


def f16_to_f32(bits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """float16 bit patterns -> float32."""
    return np.frombuffer(_ds4.f16_to_f32(_bytes(bits, "<u2")), dtype="<f4")


def f32_to_bf16(x: npt.ArrayLike) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bit patterns, rounding to nearest even (as gguf-py)."""
    return np.frombuffer(_ds4.f32_to_bf16(_bytes(x, "<f4")), dtype="<u2")


def bf16_to_f32(bits: npt.ArrayLike) -> npt.NDArray[np.float32]:
    """bfloat16 bit patterns -> float32."""
    return np.frombuffer(_ds4.bf16_to_f32(_bytes(bits, "<u2")), dtype="<f4")
