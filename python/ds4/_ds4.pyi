"""Native part of ds4 (Rust, PyO3). Hand-written stub, checked by ``mypy.stubtest``."""

import os
from collections.abc import Callable, Sequence
from typing import Any, final

__all__ = [
    "__version__",
    "GGUFFile",
    "Model",
    "Sampler",
    "Session",
    "Snapshot",
    "Stream",
    "StreamDecoder",
    "TensorInfo",
    "Tokenizer",
    "Verification",
    "bf16_to_f32",
    "cuda_available",
    "cuda_device_name",
    "dequantize",
    "profile",
    "dot",
    "f16_to_f32",
    "f32_to_bf16",
    "f32_to_f16",
    "ggml_types",
    "quantize_q8_0",
    "render_chat",
    "simd_available",
]

__version__: str

@final
class TensorInfo:
    """One entry of a GGUF file's tensor directory."""

    @property
    def name(self) -> str:
        """Tensor name."""
    @property
    def shape(self) -> list[int]:
        """Shape in row-major (numpy) order, as ``GGUFFile.read`` returns it."""
    @property
    def dims(self) -> list[int]:
        """Dimensions in GGUF order (``ne``): the row length first."""
    @property
    def type(self) -> str:
        """GGML type name ("F32", "Q8_0", "IQ2_XXS", ...)."""
    @property
    def type_id(self) -> int:
        """GGML type id."""
    @property
    def offset(self) -> int:
        """Absolute byte offset of the tensor data in the file."""
    @property
    def nbytes(self) -> int:
        """Size of the tensor data in bytes."""
    @property
    def n_elements(self) -> int:
        """Number of elements."""

@final
class GGUFFile:
    """A memory-mapped, validated GGUF file (native part of ``ds4.gguf.GGUFFile``)."""

    def __new__(cls, path: str) -> GGUFFile: ...
    @property
    def path(self) -> str:
        """The path the file was opened from."""
    @property
    def version(self) -> int:
        """GGUF version (2 or 3)."""
    @property
    def alignment(self) -> int:
        """Alignment of tensor data in bytes."""
    @property
    def data_offset(self) -> int:
        """Absolute offset of the data section."""
    @property
    def file_size(self) -> int:
        """File size in bytes."""
    def metadata(self) -> dict[str, Any]:
        """All metadata as a new dict, in file order."""
    def metadata_types(self) -> dict[str, str]:
        """GGUF value type of each metadata key: "u32", "string", "array[f32]", ..."""
    def tensors(self) -> list[TensorInfo]:
        """The tensor directory, in file order."""
    def read_raw(self, name: str) -> bytes:
        """The raw bytes of tensor ``name``."""
    def dequantize(self, name: str) -> bytearray:
        """Tensor ``name`` dequantized to little-endian float32 values, in a new bytearray."""

def dequantize(type: str, data: bytes) -> bytearray:
    """Dequantizes whole blocks of ``type`` to float32 (a bytearray of little-endian floats)."""

def dot(type: str, row: bytes, x: bytes, kernel: str = "auto") -> float:
    """Fused dot product of one quantized row with a float32 vector ``x`` (little-endian bytes)."""

def simd_available() -> bool:
    """Whether a SIMD kernel exists on this CPU (AVX2+FMA on x86-64)."""

def quantize_q8_0(x: bytes) -> bytes:
    """Quantizes float32 values (a multiple of 32) to Q8_0 blocks, exactly as gguf-py does."""

def f32_to_f16(x: bytes) -> bytes:
    """float32 -> float16 bits (round to nearest even)."""

def f16_to_f32(x: bytes) -> bytearray:
    """float16 bits -> float32."""

def f32_to_bf16(x: bytes) -> bytes:
    """float32 -> bfloat16 bits (round to nearest even, as gguf-py)."""

def bf16_to_f32(x: bytes) -> bytearray:
    """bfloat16 bits -> float32."""

def ggml_types() -> list[tuple[str, int, int, int, bool]]:
    """(name, id, elements per block, bytes per block, supported) for every GGML type."""

def cuda_available() -> bool:
    """Whether a CUDA GPU and driver are usable by this build (False when built without CUDA)."""

def profile(reset: bool = False) -> list[tuple[str, int, float]]:
    """Per-phase totals of the forward pass when ``DS4_PROFILE`` is set: (phase, calls, seconds)."""

def cuda_device_name() -> str | None:
    """The name of the first CUDA device, or None."""

@final
class Model:
    """A loaded DeepSeek V4 model (native part of ``ds4.Model``)."""

    def __new__(cls, path: str, draft: str | None = None, mtp_pairing: str = "deepseek",
                use_draft: bool = True, backend: str = "cpu",
                progress: Callable[[int, int], None] | None = None) -> Model: ...
    @property
    def backend(self) -> str:
        """The backend computing the matrix products ("cpu" or "cuda")."""
    @property
    def draft_method(self) -> str | None:
        """The drafter's method ("mtp" or "dspark"), or None."""
    def draft_config(self) -> dict[str, Any] | None:
        """The drafter's settings as a dict, or None."""
    def config(self) -> dict[str, Any]:
        """The configuration read from the file's metadata, as a dict."""
    def decode_weight_bytes(self) -> int:
        """Weight bytes read to decode one token."""
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer stored in the model file, or None if it has none."""
    def session(self, ctx: int, kv: str = "f32") -> Session:
        """A new session holding at most ``ctx`` tokens; ``kv`` is the attention state's
        storage precision: "f32", "f16" or "fp8"."""

@final
class Snapshot:
    """A saved session state."""

    @property
    def position(self) -> int:
        """Tokens processed when the snapshot was taken."""

@final
class Verification:
    """The rows of a verify, which ``keep`` cuts to a prefix (native part of
    ``ds4.Verification``)."""

    @property
    def rows(self) -> int:
        """The verified tokens."""
    def keep(self, n: int) -> None:
        """Keeps the first ``n`` rows: the session is then bit for bit as if only those tokens
        had been evaluated. Once per verify, and only while the session has not changed since."""

@final
class Session:
    """A decoding session (native part of ``ds4.Session``)."""

    def eval(self, tokens: list[int], which: str = "all") -> bytearray:
        """Evaluates ``tokens`` and returns float32 logits (a bytearray) of the rows asked for:
        ``which`` is "all", "last" or "none"."""
    def verify(self, tokens: list[int], greedy: bool = False
               ) -> tuple[Verification, bytearray | None, list[int] | None]:
        """Evaluates ``tokens`` as a speculative verify (see ``ds4.Session.verify``): the verify,
        then every row's logits (a bytearray), or with ``greedy`` every row's greedy token id
        (None, and the logits, when some row has none)."""
    @property
    def position(self) -> int:
        """Tokens processed so far."""
    @property
    def forward_kind(self) -> str:
        """Where the forward pass runs: "device" (the whole pass on the GPU, state mirrored
        there) or "host" (on the CPU, products on the model's backend)."""
    @property
    def max_verify(self) -> int:
        """The most tokens one verify takes (16 on the GPU: one device step, every row bitwise a
        single decode's; 17 on the host)."""
    @property
    def context(self) -> int:
        """The context size."""
    @property
    def tokens(self) -> list[int]:
        """The token ids processed so far."""
    def state_bytes(self) -> int:
        """Bytes held by the decode state."""
    def snapshot(self) -> Snapshot: ...
    def restore(self, snapshot: Snapshot) -> None: ...
    def reset(self) -> None: ...
    def propose(self, anchor: int | None = None, k: int | None = None
                ) -> tuple[list[int], bytearray, list[float] | None, bytearray | None, bytearray | None]:
        """What the model's drafter proposes from the committed state (nothing changes):
        (tokens, logits, confidence, base_logits, hidden), the float arrays as bytearrays."""
    def start(self, prompt: list[int], max_tokens: int, temperature: float, top_k: int, top_p: float,
              min_p: float, seed: int, stop: list[str], stop_tokens: list[int],
              spec: tuple[str, Callable[[list[int]], Sequence[int]] | None, int, bool, int, int] | None = None
              ) -> Stream:
        """Evaluates ``prompt`` and returns a stream of generated chunks (see ``ds4.Session.stream``).
        ``spec`` is None or (method, callable or None, max_draft, adaptive, min_ngram, max_ngram)
        with method "ngram", "callable", "mtp" or "dspark"."""
    def digest(self) -> int:
        """A digest of the whole decode state and the random stream (equal digests: equal
        states, bit for bit)."""

@final
class Stream:
    """A generation in progress: iterate for ``(text, tokens)`` chunks."""

    def __iter__(self) -> Stream: ...
    def __next__(self) -> tuple[str, list[int]]:
        """The next chunk, computed with the GIL released; Ctrl+C is honoured between tokens."""
    @property
    def finish_reason(self) -> str | None:
        """"eos", "stop" or "length" once finished, else None."""
    @property
    def stats(self) -> tuple[int, int, int, list[int], int]:
        """Speculation counters: (num_drafts, num_draft_tokens, num_accepted_tokens,
        accepted_per_pos, num_plain_steps)."""
    @property
    def timings(self) -> tuple[int, float, int, float]:
        """(prompt tokens, prefill seconds, generated tokens, decode seconds)."""

@final
class StreamDecoder:
    """Decodes tokens incrementally, emitting only complete characters."""

    def feed(self, ids: Sequence[int]) -> str:
        """The text completed by ``ids`` (bytes of an unfinished character are held back)."""
    def flush(self) -> str:
        """The held-back bytes as U+FFFD ("" when none); the decoder can be reused afterwards."""
    @property
    def pending(self) -> bytes:
        """Bytes currently held back."""

@final
class Tokenizer:
    """A byte-level BPE tokenizer (DeepSeek V4), read from GGUF metadata or a ``tokenizer.json``."""

    @staticmethod
    def from_gguf(path: str | os.PathLike[str]) -> Tokenizer:
        """The tokenizer in a GGUF file's ``tokenizer.ggml.*`` metadata."""
    @staticmethod
    def from_json(path: str | os.PathLike[str]) -> Tokenizer:
        """A Hugging Face ``tokenizer.json`` (BOS/EOS from ``tokenizer_config.json`` beside it)."""
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """The token ids of ``text``. Special tokens (BOS, EOS, ...) are recognised only with
        ``allow_special``; DeepSeek's role and think tokens always are."""
    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer cuts ``text`` into, before BPE (added tokens are not looked
        for)."""
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``; invalid UTF-8 becomes U+FFFD."""
    def stream_decoder(self) -> StreamDecoder:
        """A new incremental decoder."""
    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
    @property
    def bos_id(self) -> int | None:
        """The BOS token id, if known."""
    @property
    def eos_id(self) -> int | None:
        """The EOS token id, if known."""
    def token_to_id(self, token: str) -> int | None:
        """The id of a token in its stored (byte-level) form ("Ġhello", "<｜User｜>"), or None."""
    def id_to_token(self, id: int) -> str | None:
        """The stored (byte-level) form of token ``id``, or None."""
    def is_special(self, id: int) -> bool:
        """Whether ``id`` is a special token (matched only with ``allow_special``)."""
    @property
    def pre_tokenizer(self) -> str:
        """The pre-tokenizer's ``tokenizer.ggml.pre`` name ("joyai-llm" or "gpt-2")."""

def render_chat(messages: list[tuple[str, str, str | None]], thinking: bool = False,
                add_generation_prompt: bool = True) -> str:
    """The DeepSeek V4 prompt of ``messages``: (role, content, reasoning or None) triples."""

@final
class Sampler:
    """A token sampler with fixed parameters and a persistent random stream (native part of
    ``ds4.sampling.Sampler``)."""

    def __new__(cls, temperature: float, top_k: int, top_p: float, min_p: float, seed: int) -> Sampler: ...
    def sample(self, logits: bytes) -> int:
        """One token id sampled from float32 `logits` (little-endian bytes)."""
    def distribution(self, logits: bytes) -> tuple[list[int], list[float]]:
        """The distribution ``sample`` draws from: (ids, probabilities), ids increasing, only
        tokens of positive probability."""
    def snapshot(self) -> tuple[int, int, int, int]:
        """The random stream's state (four 64-bit words), for ``restore``."""
    def restore(self, state: tuple[int, int, int, int]) -> None:
        """Puts the random stream back to a state from ``snapshot``."""
