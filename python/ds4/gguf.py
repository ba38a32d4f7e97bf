"""Reading GGUF files.

>>> f = ds4.gguf.GGUFFile("model.gguf")
>>> f.metadata["general.architecture"]
'deepseek4'
>>> f.tensors["token_embd.weight"].shape
(129280, 4096)
>>> f.read("output_norm.weight")        # numpy float32 array, dequantized
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _ds4
from ._ds4 import TensorInfo

__all__ = ["GGUFFile", "TensorInfo"]

_INT_DTYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


class GGUFFile:
    """A GGUF file, memory-mapped and validated when opened.

    Opening checks the whole header: magic, version (2 or 3), every metadata value, the tensor
    directory, alignment and that every tensor lies inside the file. A malformed file raises
    :class:`ds4.GGUFError`; a missing one ``FileNotFoundError``. Tensor data is read lazily.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._native = _ds4.GGUFFile(os.fspath(path))
        self._metadata: dict[str, Any] | None = None
        self._tensors: dict[str, TensorInfo] | None = None

    @property
    def path(self) -> str:
        """The path the file was opened from."""
        return self._native.path

    @property
    def version(self) -> int:
        """GGUF format version (2 or 3)."""
        return self._native.version

    @property
    def alignment(self) -> int:
        """Alignment of tensor data in bytes (``general.alignment``, default 32)."""
        return self._native.alignment

    @property
    def data_offset(self) -> int:
        """Absolute byte offset of the data section."""
        return self._native.data_offset

    @property
    def file_size(self) -> int:
        """Size of the file in bytes."""
        return self._native.file_size

    @property
    def metadata(self) -> dict[str, Any]:
        """Metadata as a dict in file order: ints, floats, bools, strs and (nested) lists."""
        if self._metadata is None:
            self._metadata = self._native.metadata()
        return self._metadata

    @property
    def metadata_types(self) -> dict[str, str]:
        """The GGUF value type of each metadata key ("u32", "string", "array[f32]", ...)."""
        return self._native.metadata_types()

    @property
    def tensors(self) -> dict[str, TensorInfo]:
        """The tensor directory: name -> :class:`TensorInfo`, in file order."""
        if self._tensors is None:
            self._tensors = {t.name: t for t in self._native.tensors()}
        return self._tensors

    def read(self, name: str) -> npt.NDArray[Any]:
        """Tensor ``name`` as a new numpy array in row-major shape (``TensorInfo.shape``).

        Float and quantized types are dequantized to float32 (F64 stays float64); integer
        tables (I8..I64) keep their integer dtype. Raises ``KeyError`` for an unknown name and
        :class:`ds4.UnsupportedModelError` for a type ds4 cannot dequantize.
        """
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        if info.type in _INT_DTYPES:
            dtype = np.dtype(_INT_DTYPES[info.type]).newbyteorder("<")
            arr = np.frombuffer(bytearray(self._native.read_raw(name)), dtype=dtype)
        elif info.type == "F64":
            arr = np.frombuffer(bytearray(self._native.read_raw(name)), dtype="<f8")
        else:
            arr = np.frombuffer(self._native.dequantize(name), dtype="<f4")
        return arr.reshape(info.shape)

    def read_raw(self, name: str) -> bytes:
        """The raw bytes of tensor ``name`` as stored in the file."""
        if name not in self.tensors:
            raise KeyError(f"no tensor named {name!r} in {self.path}")
        return self._native.read_raw(name)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        arch = self.metadata.get("general.architecture", "?")
        return (
            f"GGUFFile({self.path!r}, version={self.version}, architecture={arch!r}, "
            f"tensors={len(self.tensors)}, metadata={len(self.metadata)})"
        )
