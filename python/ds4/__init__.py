"""ds4: DeepSeek V4 (Flash) from GGUF files, with exact speculative decoding.

The engine is written in Rust (``ds4._ds4``); this package is its Python surface.
"""

from __future__ import annotations

from . import gguf, quant
from ._ds4 import __version__, cuda_available, cuda_device_name
from .errors import (
    BackendError,
    BackendUnavailable,
    ContextOverflowError,
    DraftMismatchError,
    Ds4Error,
    GGUFError,
    UnsupportedModelError,
)
from .gguf import GGUFFile, TensorInfo
from .convert import convert, convert_draft, convert_tokenizer
from .model import Chunk, Generation, Model, Proposal, Session, Snapshot, Stream, Verification
from .speculative import SpecStats, Speculative
from .sampling import Sampling
from .tokenizer import StreamDecoder, Tokenizer, render_chat
from ._cuda_libs import export_pip_nvrtc_dirs

# NVRTC from pip, for the CUDA backend (read when a CUDA backend first starts).
export_pip_nvrtc_dirs()

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "Chunk",
    "ContextOverflowError",
    "DraftMismatchError",
    "Ds4Error",
    "GGUFError",
    "GGUFFile",
    "Generation",
    "Model",
    "Proposal",
    "Sampling",
    "Session",
    "Snapshot",
    "SpecStats",
    "Speculative",
    "Stream",
    "StreamDecoder",
    "TensorInfo",
    "Tokenizer",
    "UnsupportedModelError",
    "Verification",
    "__version__",
    "convert",
    "convert_draft",
    "convert_tokenizer",
    "cuda_available",
    "cuda_device_name",
    "gguf",
    "quant",
    "render_chat",
]
