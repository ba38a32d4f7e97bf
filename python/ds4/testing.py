"""Random ``deepseek4`` GGUF models of any shape, for tests and benchmarks (no torch).

>>> from ds4.testing import TINY, random_model
>>> random_model("tiny.gguf", TINY, seed=0, dtype="q8_0")

``config`` is a :class:`ModelConfig` (re-exported from :mod:`ds4.convert`) or a dict, either a
``config.json``-style dict or one of ``ModelConfig``'s field names; ``TINY.replace(...)`` makes a
variant. Presets follow docs/model.md §5.1:

========= ===== ====== ====== ===================== ====== =========== ============ =============
preset    vocab hidden layers heads x head_dim       q_lora groups x o  experts/top-k moe width
========= ===== ====== ====== ===================== ====== =========== ============ =============
MICRO     256   64     6 (+1) 2 x 128 (rope 64)      64     2 x 32      8 / 2        64
TINY      1024  256    6 (+1) 4 x 128 (rope 64)      128    2 x 64      16 / 6       256
MID       129280 1024  12 (+1) 16 x 512 (rope 64)    512    4 x 512     32 / 6       512
FLASH     129280 4096  43 (+1) 64 x 512 (rope 64)    1024   8 x 1024    256 / 6      2048
========= ===== ====== ====== ===================== ====== =========== ============ =============

All have ratios ``[0, 0, 4, 128, 4, 128, ...]``, 3 hash layers, one shared expert, hc 4/20/1e-6
and Flash's rope/YaRN settings. (+1) is the MTP block: ``num_nextn_predict_layers = 1`` (a 0 is
appended to ``compress_ratios``); its tensors (``mtp.0.*``) are written only with ``mtp=True``.

Weights are deterministic in ``seed`` and scaled like the golden fixtures so that logits have a
standard deviation near 1: matrices N(0, 1/fan_in), embeddings N(0, 1), norms 1 + 0.1 N(0, 1),
router bias 0.1 N(0, 1), compressor ape 0.5 N(0, 1), attention sinks 0, HC base 0 and HC scale
1, and hash tables with distinct expert ids per token. Each tensor has its own random stream
(seeded from ``seed`` and its name) and is generated and written in chunks, so any size, the
full FLASH shape included (about 81 GiB at "q2"), streams through a bounded amount of memory.

``dtype`` is one of the converter's ("f32", "f16", "bf16", "q8_0"; see :mod:`ds4.convert`) or
"q2": ds4's Flash q2 layout, IQ2_XXS routed gate/up, Q2_K routed down, Q8_0 attention, shared
experts, head and MTP projections, F16 embedding, router, HC, compressor and indexer, F32
vectors. No IQ2_XXS/Q2_K quantizer exists here, so their blocks are random bytes with finite,
moderate f16 scales (valid data that dequantizes to finite values of roughly the right size).
"q2" needs ``hidden_size`` and ``moe_intermediate_size`` to be multiples of 256.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import numpy.typing as npt

from ._progress import Progress
from .convert import (
    ALL_DTYPES,
    ARCH,
    Metadata,
    ModelConfig,
    TensorSpec,
    _as_config,
    _mtp_specs,
    _row_chunks,
    dspark_metadata,
    dspark_plan,
    encode,
    model_metadata,
    tensor_plan,
    tensor_type,
    write_model,
)
from .errors import UnsupportedModelError

__all__ = ["FLASH", "MICRO", "MID", "PRESETS", "TINY", "ModelConfig", "random_draft", "random_model",
           "synthetic_tokenizer"]


def _ratios(n: int) -> tuple[int, ...]:
    return tuple(0 if i < 2 else 4 if i % 2 == 0 else 128 for i in range(n))


MICRO = ModelConfig(
    vocab_size=256, hidden_size=64, num_hidden_layers=6, num_attention_heads=2, head_dim=128,
    qk_rope_head_dim=64, q_lora_rank=64, o_groups=2, o_lora_rank=32, sliding_window=8,
    compress_ratios=_ratios(6), num_hash_layers=3, index_n_heads=2, index_head_dim=128, index_topk=4,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
)
TINY = ModelConfig(
    vocab_size=1024, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, head_dim=128,
    qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, sliding_window=16,
    compress_ratios=_ratios(6), num_hash_layers=3, index_n_heads=4, index_head_dim=128, index_topk=8,
    n_routed_experts=16, num_experts_per_tok=6, moe_intermediate_size=256,
)
MID = ModelConfig(
    vocab_size=129280, hidden_size=1024, num_hidden_layers=12, num_attention_heads=16, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=512, sliding_window=128,
    compress_ratios=_ratios(12), num_hash_layers=3, index_n_heads=32, index_head_dim=128, index_topk=512,
    n_routed_experts=32, num_experts_per_tok=6, moe_intermediate_size=512,
)
FLASH = ModelConfig(
    vocab_size=129280, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, head_dim=512,
    qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, sliding_window=128,
    compress_ratios=_ratios(43), num_hash_layers=3, index_n_heads=64, index_head_dim=128, index_topk=512,
    n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
)
PRESETS: dict[str, ModelConfig] = {"MICRO": MICRO, "TINY": TINY, "MID": MID, "FLASH": FLASH}

# The DeepSeek special tokens of the golden toy tokenizer (ids 0..7).
_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
             "<think>", "</think>", "<｜fim▁hole｜>", "<｜▁pad▁｜>")


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character mapping, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def synthetic_tokenizer(vocab_size: int) -> Metadata:
    """A byte-level tokenizer without merges: the 8 DeepSeek special tokens (control), then the
    256 byte tokens (as many as fit), then ``[PAD{i}]`` (unused) up to ``vocab_size``."""
    tokens = list(_SPECIALS[:vocab_size])
    types = [3] * len(tokens)
    for t in _byte_tokens()[: max(0, vocab_size - len(tokens))]:
        tokens.append(t)
        types.append(1)
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]")
        types.append(5)
    return [
        ("tokenizer.ggml.model", "gpt2", "string"),
        ("tokenizer.ggml.pre", "gpt-2", "string"),
        ("tokenizer.ggml.tokens", tokens, "array[string]"),
        ("tokenizer.ggml.token_type", types, "array[i32]"),
        ("tokenizer.ggml.merges", [], "array[string]"),
        ("tokenizer.ggml.bos_token_id", 0, "u32"),
        ("tokenizer.ggml.eos_token_id", min(1, vocab_size - 1), "u32"),
        ("tokenizer.ggml.add_bos_token", True, "bool"),
    ]


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])


def _vector(spec: TensorSpec, rng: np.random.Generator) -> npt.NDArray[np.float32]:
    n = spec.ne[0]
    base = spec.name.split(".")[-2]  # "blk.3.hc_attn_base.weight" -> "hc_attn_base"
    if base in ("attn_sinks",) or base.endswith("_base"):
        return np.zeros(n, np.float32)
    if base.endswith("_scale"):
        return np.ones(n, np.float32)
    if base == "exp_probs_b":
        return (0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
    return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)


# (byte offset of d, bytes per block, [offsets of other f16 scales]) of the random-block types
_RANDOM_BLOCKS: dict[str, tuple[int, list[int]]] = {"IQ2_XXS": (66, [0]), "Q2_K": (84, [80, 82])}


def _random_blocks(rng: np.random.Generator, ggml_type: str, n_blocks: int, fan_in: int) -> npt.NDArray[np.uint8]:
    block_bytes, scale_offsets = _RANDOM_BLOCKS[ggml_type]
    data = np.frombuffer(bytearray(rng.bytes(n_blocks * block_bytes)), dtype=np.uint8).reshape(n_blocks, block_bytes)
    # d of roughly 1/(magnitude of the block's integer products * sqrt(fan_in)): finite, moderate
    unit = 1.0 / (50.0 if ggml_type == "IQ2_XXS" else 10.0) / np.sqrt(fan_in)
    d = (unit * rng.uniform(0.5, 1.5, size=n_blocks)).astype("<f2")
    data[:, scale_offsets[0]:scale_offsets[0] + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    if len(scale_offsets) > 1:  # Q2_K dmin: about 1.5 d centres the values
        dmin = (d.astype(np.float32) * 1.5).astype("<f2")
        data[:, scale_offsets[1]:scale_offsets[1] + 2] = dmin.view(np.uint8).reshape(n_blocks, 2)
    return data


def _random_chunks(spec: TensorSpec, ggml_type: str, seed: int, cfg: ModelConfig,
                   bar: Progress) -> Iterator[npt.NDArray[Any]]:
    rng = _rng(seed, spec.name)
    row_len = spec.ne[0]
    n_rows = spec.n_elements // row_len
    if spec.role == "vector":
        out = encode(_vector(spec, rng), ggml_type)
        bar.update(out.nbytes, spec.name)
        yield out
        return
    # a hash-table row draws one key per expert: chunk by that width
    chunk_width = cfg.n_routed_experts if spec.role == "tid2eid" else row_len
    for r0, r1 in _row_chunks(n_rows, chunk_width):
        rows = r1 - r0
        if spec.role == "tid2eid":  # the first k of a random permutation: k distinct expert ids
            keys = rng.random((rows, cfg.n_routed_experts), dtype=np.float32)
            x: npt.NDArray[Any] = np.argsort(keys, axis=1)[:, : row_len].astype(np.int32)
            out = encode(x, ggml_type)
        elif ggml_type in _RANDOM_BLOCKS:
            out = _random_blocks(rng, ggml_type, rows * row_len // 256, row_len)
        else:
            x = rng.standard_normal((rows, row_len), dtype=np.float32)
            if spec.role == "ape":
                x *= np.float32(0.5)
            elif spec.role != "embed":
                x *= np.float32(1.0 / np.sqrt(row_len))
            out = encode(x, ggml_type)
        bar.update(out.nbytes, spec.name)
        yield out


def random_model(path: str | os.PathLike[str], config: ModelConfig | Mapping[str, Any], seed: int = 0,
                 dtype: str = "f32", *, mtp: bool = False, tokenizer: Metadata | None = None,
                 progress: bool = False) -> Path:
    """Writes a random ``deepseek4`` GGUF of ``config`` to ``path`` and returns the path.

    The tensors are exactly the converter's for that config (:func:`ds4.convert.tensor_plan`,
    types by :func:`ds4.convert.tensor_type`), plus the MTP block(s) with ``mtp=True``. The
    tokenizer is :func:`synthetic_tokenizer` unless ``tokenizer`` (metadata, e.g. from
    :func:`ds4.convert.tokenizer_metadata`) is given. Same arguments, same bytes.
    """
    if dtype not in ALL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}")
    cfg = _as_config(config)
    if dtype == "q2":
        for key in ("hidden_size", "moe_intermediate_size"):
            if getattr(cfg, key) % 256:
                raise UnsupportedModelError(f"dtype 'q2' needs {key} to be a multiple of 256, "
                                            f"got {getattr(cfg, key)}")
    plan = tensor_plan(cfg, mtp_layers=cfg.num_nextn_predict_layers if mtp else 0)
    types = [tensor_type(s, dtype) for s in plan]
    metadata = model_metadata(cfg, dtype, name=f"random {ARCH} seed {seed}", plan=plan)
    metadata += synthetic_tokenizer(cfg.vocab_size) if tokenizer is None else list(tokenizer)
    return write_model(path, plan, types, metadata,
                       lambda spec, t, bar: _random_chunks(spec, t, seed, cfg, bar), progress,
                       desc="ds4 random_model")


def random_draft(path: str | os.PathLike[str], config: ModelConfig | Mapping[str, Any], method: str = "dspark",
                 seed: int = 0, dtype: str = "f32", *, block_size: int = 5, markov_rank: int = 16,
                 noise_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                 stages: int = 3, progress: bool = False) -> Path:
    """Writes a random drafter support file for a target of ``config`` (weights scaled as
    :func:`random_model`'s): ``method="mtp"`` (one ``mtp.0.*`` block) or ``"dspark"``
    (``stages`` window-only blocks, Markov head of rank ``markov_rank`` (0: none), confidence
    head, ``dspark.*`` metadata; ``target_layer_ids`` defaults to the last three layers and
    ``noise_token_id`` to the last token id). Load it with ``ds4.Model.load(target,
    draft=path)``."""
    if dtype not in ALL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}")
    cfg = _as_config(config)
    metadata: Metadata = [("general.type", "model", "string"), ("general.name", f"random {method} seed {seed}", "string")]
    if method == "mtp":
        plan = _mtp_specs(cfg, 0)
        arch = "deepseek4-mtp"
        metadata.append(("mtp.vocab_size", cfg.vocab_size, "u32"))
    elif method == "dspark":
        layers = list(range(max(0, cfg.num_hidden_layers - 3), cfg.num_hidden_layers)) \
            if target_layer_ids is None else list(target_layer_ids)
        plan = dspark_plan(cfg, stages, len(layers), markov_rank)
        arch = "deepseek4-dspark"
        noise = cfg.vocab_size - 1 if noise_token_id is None else noise_token_id
        metadata += dspark_metadata(block_size, markov_rank, noise, layers, stages, cfg.vocab_size)
    else:
        raise ValueError(f"method must be 'mtp' or 'dspark', got {method!r}")
    types = [tensor_type(s, dtype) for s in plan]
    return write_model(path, plan, types, metadata,
                       lambda spec, t, bar: _random_chunks(spec, t, seed, cfg, bar), progress,
                       desc="ds4 random_draft", arch=arch)
