"""A small streaming GGUF v3 writer (pure Python + numpy).

The writer is used in three steps, so that a model is never held in memory twice:

1. :meth:`GGUFWriter.add` metadata (every GGUF value type, arrays nested to any depth) and
   :meth:`GGUFWriter.add_tensor_info` for every tensor (name, ``ne`` in GGUF order, ggml type);
2. :meth:`GGUFWriter.write_header` writes the header, the metadata and the tensor directory
   (each tensor's offset aligned to ``alignment``, 32 by default);
3. :meth:`GGUFWriter.write_tensor` is called once per tensor, in the declared order, with an
   iterable of chunks (numpy arrays or bytes) whose sizes add up to the tensor's byte size.

>>> w = GGUFWriter("x.gguf", arch="deepseek4")
>>> w.add("deepseek4.block_count", 43, "u32")
>>> w.add_tensor_info("output_norm.weight", [4096], "F32")
>>> w.write_header()
>>> w.write_tensor("output_norm.weight", [np.ones(4096, np.float32)])
>>> w.close()

Metadata value types are named as ``ds4.GGUFFile.metadata_types`` names them: ``u8 i8 u16 i16
u32 i32 u64 i64 f32 f64 bool string`` and ``array[T]`` (``T`` itself may be an array type).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable, Sequence

import numpy as np

__all__ = ["GGML_TYPES", "GGUFWriter", "tensor_nbytes"]

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
DEFAULT_ALIGNMENT = 32

# GGUF metadata value type ids, and the struct format of the scalar ones.
_VALUE_TYPES: dict[str, int] = {
    "u8": 0, "i8": 1, "u16": 2, "i16": 3, "u32": 4, "i32": 5, "f32": 6, "bool": 7,
    "string": 8, "array": 9, "u64": 10, "i64": 11, "f64": 12,
}
_SCALAR_FMT: dict[str, str] = {
    "u8": "<B", "i8": "<b", "u16": "<H", "i16": "<h", "u32": "<I", "i32": "<i", "f32": "<f",
    "bool": "<?", "u64": "<Q", "i64": "<q", "f64": "<d",
}
_NUMPY_DTYPE: dict[str, str] = {
    "u8": "<u1", "i8": "<i1", "u16": "<u2", "i16": "<i2", "u32": "<u4", "i32": "<i4", "f32": "<f4",
    "u64": "<u8", "i64": "<i8", "f64": "<f8",
}

# ggml type name -> (type id, elements per block, bytes per block)
GGML_TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4),
    "F16": (1, 1, 2),
    "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84),
    "Q4_K": (12, 256, 144),
    "IQ2_XXS": (16, 256, 66),
    "I8": (24, 1, 1),
    "I16": (25, 1, 2),
    "I32": (26, 1, 4),
    "I64": (27, 1, 8),
    "F64": (28, 1, 8),
    "BF16": (30, 1, 2),
    "MXFP4": (39, 32, 17),
}


def tensor_nbytes(ne: Sequence[int], ggml_type: str) -> int:
    """Bytes of a tensor of shape ``ne`` (GGUF order) and type ``ggml_type``.

    The row length ``ne[0]`` must be a multiple of the type's block size.
    """
    if ggml_type not in GGML_TYPES:
        raise ValueError(f"unknown ggml type {ggml_type!r}")
    _, be, bb = GGML_TYPES[ggml_type]
    if not ne:
        raise ValueError("a tensor needs at least one dimension")
    if ne[0] % be:
        raise ValueError(f"row length {ne[0]} is not a multiple of the {ggml_type} block size {be}")
    n = 1
    for d in ne:
        if d < 0:
            raise ValueError(f"negative dimension in {list(ne)}")
        n *= int(d)
    return n // be * bb


def _parse_type(vtype: str) -> tuple[str, str | None]:
    """'array[array[i32]]' -> ('array', 'array[i32]'); 'u32' -> ('u32', None)."""
    if vtype.startswith("array[") and vtype.endswith("]"):
        return "array", vtype[6:-1]
    if vtype not in _VALUE_TYPES or vtype == "array":
        raise ValueError(f"unknown GGUF value type {vtype!r}")
    return vtype, None


def _infer_type(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, np.integer)):
        return "i64" if int(value) < 0 else "u32" if int(value) < 2**32 else "u64"
    if isinstance(value, (float, np.floating)):
        return "f32"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) == 0:
            raise ValueError("the element type of an empty array cannot be inferred; pass vtype")
        return f"array[{_infer_type(value[0])}]"
    raise ValueError(f"cannot infer a GGUF type for {type(value).__name__}")


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _encode_value(value: Any, vtype: str) -> bytes:
    """The encoding of a value of type ``vtype`` without its leading type id."""
    kind, sub = _parse_type(vtype)
    if kind == "string":
        if not isinstance(value, str):
            raise TypeError(f"expected a str, got {type(value).__name__}")
        return _encode_string(value)
    if kind == "array":
        assert sub is not None
        sub_kind, _ = _parse_type(sub)
        items = list(value) if not isinstance(value, np.ndarray) else value
        head = struct.pack("<IQ", _VALUE_TYPES[sub_kind], len(items))
        if sub_kind in _NUMPY_DTYPE:
            arr = np.asarray(items)
            if sub_kind.startswith(("u", "i")) and arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise TypeError(f"array[{sub_kind}] needs integer items")
            return head + np.ascontiguousarray(arr, dtype=_NUMPY_DTYPE[sub_kind]).tobytes()
        if sub_kind == "bool":
            return head + bytes(1 if bool(v) else 0 for v in items)
        if sub_kind == "string":
            return head + b"".join(_encode_string(v) for v in items)
        # an array of arrays: each item is (element type, count, items) without a type id
        return head + b"".join(_encode_value(v, sub) for v in items)
    if kind == "bool":
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"expected a bool, got {type(value).__name__}")
        return struct.pack("<?", bool(value))
    if kind in ("f32", "f64"):
        return struct.pack(_SCALAR_FMT[kind], float(value))
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"expected an int for {kind}, got {type(value).__name__}")
    return struct.pack(_SCALAR_FMT[kind], int(value))


@dataclass
class _TensorEntry:
    name: str
    ne: tuple[int, ...]
    ggml_type: str
    nbytes: int
    offset: int = 0


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class GGUFWriter:
    """Writes one GGUF v3 file, streaming the tensor data (see the module docstring)."""

    def __init__(self, path: str | os.PathLike[str], arch: str | None = None,
                 alignment: int = DEFAULT_ALIGNMENT) -> None:
        if alignment <= 0 or alignment % 8:
            raise ValueError(f"alignment must be a positive multiple of 8, got {alignment}")
        self.path = os.fspath(path)
        self.alignment = alignment
        self._kv: dict[str, tuple[str, Any]] = {}
        self._tensors: list[_TensorEntry] = []
        self._names: set[str] = set()
        self._fout: BinaryIO | None = None
        self._next = 0  # index of the next tensor whose data is expected
        self._data_start = 0
        if arch is not None:
            self.add("general.architecture", arch, "string")
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", alignment, "u32")

    # -- metadata ------------------------------------------------------------------------
    def add(self, key: str, value: Any, vtype: str | None = None) -> None:
        """Adds metadata ``key`` with ``value`` of GGUF type ``vtype`` (inferred if None:
        bool, u32 for non-negative ints, f32, string, arrays of those)."""
        if self._fout is not None:
            raise RuntimeError("metadata must be added before write_header()")
        if key in self._kv:
            raise ValueError(f"duplicate metadata key {key!r}")
        vt = _infer_type(value) if vtype is None else vtype
        _encode_value(value, vt)  # validate now, not at write time
        self._kv[key] = (vt, value)

    @property
    def metadata(self) -> dict[str, tuple[str, Any]]:
        """The metadata added so far: key -> (type, value)."""
        return dict(self._kv)

    # -- tensors -------------------------------------------------------------------------
    def add_tensor_info(self, name: str, ne: Sequence[int], ggml_type: str) -> int:
        """Declares a tensor (``ne`` in GGUF order, row length first); returns its byte size."""
        if self._fout is not None:
            raise RuntimeError("tensors must be declared before write_header()")
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(ne) > 4:
            raise ValueError(f"tensor {name!r} has {len(ne)} dimensions, GGUF allows 4")
        nbytes = tensor_nbytes(ne, ggml_type)
        self._names.add(name)
        self._tensors.append(_TensorEntry(name, tuple(int(d) for d in ne), ggml_type, nbytes))
        return nbytes

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self._tensors]

    def write_header(self) -> None:
        """Writes header, metadata and tensor directory; then the data is written per tensor."""
        if self._fout is not None:
            raise RuntimeError("write_header() called twice")
        offset = 0
        for t in self._tensors:
            t.offset = offset
            offset += _pad(t.nbytes, self.alignment)
        parts = [GGUF_MAGIC, struct.pack("<IQQ", GGUF_VERSION, len(self._tensors), len(self._kv))]
        for key, (vt, value) in self._kv.items():
            kind, _ = _parse_type(vt)
            parts.append(_encode_string(key))
            parts.append(struct.pack("<I", _VALUE_TYPES[kind]))
            parts.append(_encode_value(value, vt))
        for t in self._tensors:
            parts.append(_encode_string(t.name))
            parts.append(struct.pack("<I", len(t.ne)))
            parts.append(struct.pack(f"<{len(t.ne)}Q", *t.ne))
            parts.append(struct.pack("<IQ", GGML_TYPES[t.ggml_type][0], t.offset))
        header = b"".join(parts)
        self._data_start = _pad(len(header), self.alignment)
        self._fout = open(self.path, "wb")
        self._fout.write(header)
        self._fout.write(b"\0" * (self._data_start - len(header)))
        if not self._tensors:
            self._fout.flush()

    def write_tensor(self, name: str, chunks: Iterable[np.ndarray[Any, Any] | bytes]) -> None:
        """Writes the data of tensor ``name`` (the next declared one) from ``chunks``."""
        if self._fout is None:
            raise RuntimeError("write_header() must come first")
        if self._next >= len(self._tensors):
            raise RuntimeError(f"tensor {name!r}: every declared tensor is already written")
        t = self._tensors[self._next]
        if t.name != name:
            raise RuntimeError(f"tensors must be written in declared order: expected {t.name!r}, got {name!r}")
        written = 0
        for chunk in chunks:
            if isinstance(chunk, np.ndarray):
                data = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1).data
            else:
                data = memoryview(chunk).cast("B")
            if written + len(data) > t.nbytes:
                raise ValueError(f"tensor {name!r}: more data than its {t.nbytes} bytes")
            self._fout.write(data)
            written += len(data)
        if written != t.nbytes:
            raise ValueError(f"tensor {name!r}: wrote {written} bytes, expected {t.nbytes}")
        self._fout.write(b"\0" * (_pad(t.nbytes, self.alignment) - t.nbytes))
        self._next += 1

    def close(self) -> None:
        """Closes the file; every declared tensor must have been written."""
        if self._fout is None:
            return
        f, self._fout = self._fout, None
        f.close()
        if self._next != len(self._tensors):
            missing = self._tensors[self._next].name
            raise RuntimeError(f"closed before tensor {missing!r} was written")

    def abort(self) -> None:
        """Closes the file without the completeness check (for error paths)."""
        if self._fout is not None:
            f, self._fout = self._fout, None
            f.close()

    def __enter__(self) -> GGUFWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
