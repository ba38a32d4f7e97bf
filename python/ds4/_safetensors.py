"""A minimal safetensors reader (pure Python + numpy, memory-mapped).

A safetensors file is an 8-byte little-endian header length, a JSON header
(``name -> {"dtype", "shape", "data_offsets": [begin, end]}`` plus an optional
``__metadata__``), then the data. Tensors are read lazily from an ``np.memmap``; whole
tensors or row ranges are decoded to numpy:

======== ============================================================
dtype    decoded as
======== ============================================================
F32      float32
F16      float32 (exact)
BF16     float32 (exact: the 16 bits shifted into the high half)
F64      float64
I64/I32  int64 / int32 (I16, I8, U8, U16, U32, U64 and BOOL likewise)
F8_E4M3  float32, exactly (E4M3 "fn": bias 7, max 448, 0x7f/0xff are NaN)
F8_E8M0  float32 2^(e-127) (a power-of-two scale; 0xff is NaN)
======== ============================================================

:class:`Checkpoint` opens a directory: the shards named by ``model.safetensors.index.json``, or
else every ``*.safetensors`` file in it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import numpy.typing as npt

from .errors import UnsupportedModelError

__all__ = ["Checkpoint", "SafetensorsFile", "TensorMeta", "decode_e4m3", "decode_e8m0"]

# dtype -> (numpy dtype of the stored items, bytes per item)
_STORAGE: dict[str, str] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
    "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
    "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "u1",
    "F8_E4M3": "u1", "F8_E8M0": "u1",
}

_MAX_HEADER = 100 * 1024 * 1024


def _e4m3_table() -> npt.NDArray[np.float32]:
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exp = (codes >> 3) & 0xF
    man = codes & 0x7
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    subnormal = (man / 8.0) * np.exp2(-6.0)
    val = sign * np.where(exp == 0, subnormal, normal)
    val[(codes & 0x7F) == 0x7F] = np.nan
    return np.asarray(val, dtype=np.float32)


def _e8m0_table() -> npt.NDArray[np.float32]:
    e = np.arange(256, dtype=np.float64)
    val = np.exp2(e - 127.0)
    val[255] = np.nan
    return val.astype(np.float32)  # 2^-127 is an exact float32 subnormal


_E4M3 = _e4m3_table()
_E8M0 = _e8m0_table()


def decode_e4m3(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """FP8 E4M3 (fn) codes -> float32, exactly."""
    return _E4M3[np.asarray(codes, dtype=np.uint8)]


def decode_e8m0(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """UE8M0 scale codes -> float32 2^(e-127)."""
    return _E8M0[np.asarray(codes, dtype=np.uint8)]


def _bf16_to_f32(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.float32]:
    return (bits.astype("<u4") << 16).view("<f4")


@dataclass(frozen=True)
class TensorMeta:
    """One tensor of a safetensors file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset in the data section
    end: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class SafetensorsFile:
    """One memory-mapped safetensors file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size  # FileNotFoundError for a missing file
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise UnsupportedModelError(f"{self.path}: not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise UnsupportedModelError(f"{self.path}: bad safetensors header length {n}")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise UnsupportedModelError(f"{self.path}: bad safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise UnsupportedModelError(f"{self.path}: bad safetensors header")
        self.data_offset = 8 + n
        data_size = size - self.data_offset
        self.metadata: dict[str, Any] = dict(header.pop("__metadata__", None) or {})
        self.tensors: dict[str, TensorMeta] = {}
        for name, info in header.items():
            try:
                dtype = str(info["dtype"])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise UnsupportedModelError(f"{self.path}: bad header entry for {name!r}") from None
            if dtype not in _STORAGE:
                raise UnsupportedModelError(f"{self.path}: tensor {name!r} has unsupported dtype {dtype}")
            meta = TensorMeta(name, dtype, shape, begin, end)
            item = np.dtype(_STORAGE[dtype]).itemsize
            if not (0 <= begin <= end <= data_size) or end - begin != meta.n_elements * item:
                raise UnsupportedModelError(f"{self.path}: tensor {name!r} has bad data offsets")
            self.tensors[name] = meta
        self._mm: np.memmap[Any, np.dtype[np.uint8]] | None = None

    def _map(self) -> np.memmap[Any, np.dtype[np.uint8]]:
        if self._mm is None:  # only called for a non-empty tensor, so the data is not empty
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self.data_offset)
        return self._mm

    def close(self) -> None:
        """Drops this object's map; it is unmapped once no array read from it is alive."""
        self._mm = None

    def raw(self, name: str) -> npt.NDArray[Any]:
        """The stored items of ``name`` as a read-only numpy view (shape as in the header).

        BF16 comes as uint16 bits, F8 types as uint8 codes, BOOL as uint8.
        """
        meta = self.tensors[name]
        if meta.begin == meta.end:
            return np.zeros(meta.shape, dtype=_STORAGE[meta.dtype])
        buf = self._map()[meta.begin:meta.end]
        return buf.view(_STORAGE[meta.dtype]).reshape(meta.shape)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> npt.NDArray[Any]:
        """Tensor ``name`` decoded (floats to float32, F64 to float64, integers kept), optionally
        only rows ``[start, stop)`` of its first axis. Always a new array."""
        meta = self.tensors[name]
        arr = self.raw(name)
        if rows is not None:
            arr = arr[rows[0]:rows[1]]
        return decode(arr, meta.dtype)


def decode(arr: npt.NDArray[Any], dtype: str) -> npt.NDArray[Any]:
    """Decodes stored items of safetensors ``dtype`` (see the module table) into a new array."""
    if dtype == "F32":
        return np.array(arr, dtype=np.float32)
    if dtype == "F16":
        return arr.astype(np.float32)
    if dtype == "BF16":
        return _bf16_to_f32(arr)
    if dtype == "F8_E4M3":
        return decode_e4m3(arr)
    if dtype == "F8_E8M0":
        return decode_e8m0(arr)
    if dtype == "BOOL":
        return arr.astype(np.bool_)
    return np.array(arr, dtype=np.dtype(_STORAGE[dtype]).newbyteorder("="))


class Checkpoint:
    """The safetensors files of one checkpoint directory, as one name -> tensor mapping."""

    INDEX = "model.safetensors.index.json"

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"no such checkpoint directory: {self.directory}")
        index = self.directory / self.INDEX
        if index.exists():
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UnsupportedModelError(f"{index}: no weight_map")
            shard_names = sorted(set(str(v) for v in weight_map.values()))
            paths = [self.directory / s for s in shard_names]
            for p in paths:
                if not p.exists():
                    raise FileNotFoundError(f"{index} names a missing shard: {p}")
        else:
            paths = sorted(self.directory.glob("*.safetensors"))
            if not paths:
                raise FileNotFoundError(f"no *.safetensors files in {self.directory}")
        self.files = [SafetensorsFile(p) for p in paths]
        self._where: dict[str, SafetensorsFile] = {}
        for sf in self.files:
            for name in sf.tensors:
                if name in self._where:
                    raise UnsupportedModelError(
                        f"tensor {name!r} is in both {self._where[name].path.name} and {sf.path.name}")
                self._where[name] = sf

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def meta(self, name: str) -> TensorMeta:
        return self._where[name].tensors[name]

    def raw(self, name: str) -> npt.NDArray[Any]:
        return self._where[name].raw(name)

    def read(self, name: str, rows: tuple[int, int] | None = None) -> npt.NDArray[Any]:
        return self._where[name].read(name, rows)

    def close(self) -> None:
        for f in self.files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
