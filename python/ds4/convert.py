"""Hugging Face DeepSeek V4 checkpoint -> ``deepseek4`` GGUF (pure Python + numpy).

>>> ds4.convert("DeepSeek-V4-Flash/", "flash-q8.gguf", dtype="q8_0")

or ``ds4 convert HF_DIR OUT.gguf --dtype q8_0``. The result has llama.cpp's metadata keys and
tensor names (``general.architecture = "deepseek4"``), plus ``deepseek4.vocab_size`` and
``deepseek4.expert_group_count``/``expert_group_used_count`` = 0 that ds4 reads.

**Input.** A directory with ``config.json`` and safetensors weights (the shards named by
``model.safetensors.index.json``, or every ``*.safetensors``), and optionally ``tokenizer.json``
and ``tokenizer_config.json``. Both namings are read: the official one (``embed.weight``,
``layers.N.attn.kv_norm.weight``, ``hc_head_fn``, ``norm.weight``, ``head.weight``, ...) and the
one transformers writes on save (``model.`` prefix, ``model.embed_tokens.weight``,
``model.hc_head.hc_fn``, ``attn.norm.weight`` for the kv norm, ``model.norm.weight``). Official
FP8 weights (``X.weight`` F8_E4M3 + ``X.scale`` F8_E8M0 per 128x128 block) and FP4 routed experts
(I8 ``[out, in/2]``, low nibble = even element, + one F8_E8M0 scale per 32) are dequantized
exactly to float32 first. ``mtp.K.*`` tensors, when present, are written as
``mtp.K.<gguf per-layer name>`` (ds4's naming) plus ``mtp.K.{e_proj,h_proj,enorm,hnorm,norm,
hc_head_fn,hc_head_base,hc_head_scale}.weight``; ``block_count`` stays the trunk's.
``config.json`` may be transformers' form (``layer_types`` + ``compress_rates``,
``rope_parameters``, ``mlp_layer_types``) or the official one (``compress_ratios`` with an optional
trailing 0 per MTP layer, ``num_hash_layers``, ``rope_scaling``).

**Output types** per tensor role (:func:`tensor_type`; "q2" is only offered by
:func:`ds4.testing.random_model`):

============== ===================================================== ==== ==== ==== ==== =======
role           tensors                                               f32  f16  bf16 q8_0 q2
============== ===================================================== ==== ==== ==== ==== =======
vector         every 1-D tensor: norms, ``attn_sinks``,              F32  F32  F32  F32  F32
               ``exp_probs_b``, hc base/scale
tid2eid        ``ffn_gate_tid2eid`` (hash routing table)             I32  I32  I32  I32  I32
hc_fn          ``hc_{attn,ffn}_fn``, ``output_hc_fn``,               F32  F32  F32  F16  F16
               ``mtp.K.hc_head_fn``
ape            ``attn_compressor_ape``, ``indexer_compressor_ape``   F32  F32  F32  F16  F16
embed          ``token_embd``                                        F32  F16  BF16 F16  F16
router         ``ffn_gate_inp``                                      F32  F16  BF16 F16  F16
compressor     ``attn_compressor_{kv,gate}``, ``indexer.attn_q_b``,  F32  F16  BF16 F16  F16
               ``indexer.proj``, ``indexer_compressor_{kv,gate}``
proj           ``attn_{q_a,q_b,kv,output_a,output_b}``,              F32  F16  BF16 Q8_0 Q8_0
               ``ffn_*_shexp``, ``output``, ``mtp.K.{e,h}_proj``
expert_gate_up ``ffn_gate_exps``, ``ffn_up_exps``                    F32  F16  BF16 Q8_0 IQ2_XXS
expert_down    ``ffn_down_exps``                                     F32  F16  BF16 Q8_0 Q2_K
============== ===================================================== ==== ==== ==== ==== =======

At f16/bf16 the HC fns and the compressor ape stay F32: they are F32 in the official checkpoint
and small. A Q8_0 cell falls back to F16 for a tensor whose row length is not a multiple of 32. The
q8_0 column is ds4's own choice (its shipped files keep the router, HC, compressor and
indexer tensors at F16), with Q8_0 experts since no K-quant quantizer is available here;
Q8_0 data is bit-identical to gguf-py (``ds4.quant.quantize_q8_0``).

**Streaming.** Tensors are read from memory-mapped safetensors and converted in chunks of rows,
one tensor at a time; routed experts are written expert by expert into the stacked
``[in, out, n_expert]`` tensor, so memory stays at a few chunks whatever the model size.

**Errors.** A missing directory, ``config.json`` or weights file is ``FileNotFoundError``; a
missing config key, a missing or unknown tensor, or a shape mismatch is
:class:`ds4.UnsupportedModelError` naming the key or tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ._ggufwriter import GGUFWriter
from ._progress import Progress
from ._safetensors import Checkpoint, decode, decode_e4m3
from .errors import UnsupportedModelError

__all__ = [
    "DTYPES",
    "ModelConfig",
    "TensorSpec",
    "convert",
    "convert_draft",
    "convert_tokenizer",
    "dspark_metadata",
    "dspark_plan",
    "model_metadata",
    "size_label",
    "tensor_plan",
    "tensor_type",
    "tokenizer_metadata",
]

ARCH = "deepseek4"
DTYPES = ("f32", "f16", "bf16", "q8_0")
#: every output dtype, including the random-only "q2"
ALL_DTYPES = DTYPES + ("q2",)

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"

Metadata = list[tuple[str, Any, str]]


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelConfig:
    """The shape and hyperparameters of a DeepSeek V4 model.

    Field names follow the Hugging Face config keys. ``compress_ratios`` has one entry per trunk
    layer (0 = sliding window only, 4 = CSA, 128 = HCA in Flash); the GGUF array also gets one 0
    per MTP layer (``num_nextn_predict_layers``). ``layer_types`` is optional: without it, a
    layer with ratio 4 is CSA (has an indexer) and any other non-zero ratio is HCA. Defaults
    are Flash's values. Use :meth:`from_dict` for a ``config.json``-style dict.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]
    num_hash_layers: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 1
    num_key_value_heads: int = 1
    num_nextn_predict_layers: int = 1
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    swiglu_limit: float = 10.0
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    scoring_func: str = "sqrtsoftplus"
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling_type: str | None = "yarn"
    rope_scaling_factor: float = 16.0
    rope_original_max_position_embeddings: int = 65536
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for f in dataclasses.fields(self):
            if f.type == "int":
                v = getattr(self, f.name)
                if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                    raise UnsupportedModelError(f"config {f.name!r} must be a non-negative integer, got {v!r}")
        L = self.num_hidden_layers

        def bad(msg: str) -> UnsupportedModelError:
            return UnsupportedModelError(f"unsupported config: {msg}")

        if L < 1 or self.hidden_size < 1 or self.vocab_size < 1:
            raise bad("num_hidden_layers, hidden_size and vocab_size must be positive")
        if len(self.compress_ratios) != L:
            raise bad(f"compress_ratios has {len(self.compress_ratios)} entries for {L} layers")
        if self.layer_types is not None:
            if len(self.layer_types) != L:
                raise bad(f"layer_types has {len(self.layer_types)} entries for {L} layers")
            for i, (t, r) in enumerate(zip(self.layer_types, self.compress_ratios)):
                if t not in (SLIDING, CSA, HCA):
                    raise bad(f"layer {i} has unknown layer type {t!r}")
                if (t == SLIDING) != (r == 0):
                    raise bad(f"layer {i} is {t} with compress ratio {r}")
        if any(r < 0 for r in self.compress_ratios):
            raise bad("negative compress ratio")
        if self.num_attention_heads < 1 or self.o_groups < 1 or self.num_attention_heads % self.o_groups:
            raise bad(f"{self.num_attention_heads} heads do not split into {self.o_groups} output groups")
        if not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise bad(f"qk_rope_head_dim {self.qk_rope_head_dim} vs head_dim {self.head_dim}")
        if self.num_hash_layers > L:
            raise bad(f"num_hash_layers {self.num_hash_layers} > {L} layers")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise bad(f"num_experts_per_tok {self.num_experts_per_tok} of {self.n_routed_experts} experts")
        if self.num_key_value_heads != 1:
            raise bad(f"num_key_value_heads must be 1, got {self.num_key_value_heads}")
        if self.hc_mult < 1:
            raise bad("hc_mult must be positive")
        if self.scoring_func not in _GATING_FUNC:
            raise bad(f"unknown scoring_func {self.scoring_func!r}")

    # -- derived ------------------------------------------------------------------------------
    def layer_type(self, i: int) -> str:
        """``sliding_attention``, ``compressed_sparse_attention`` or ``heavily_compressed_attention``."""
        if self.layer_types is not None:
            return self.layer_types[i]
        r = self.compress_ratios[i]
        return SLIDING if r == 0 else CSA if r == 4 else HCA

    @property
    def hc_mix(self) -> int:
        """Rows of an HC site's fn matrix: pre (n), post (n), comb (n*n)."""
        return 2 * self.hc_mult + self.hc_mult * self.hc_mult

    @property
    def gguf_compress_ratios(self) -> list[int]:
        """The metadata array: the trunk ratios, then 0 per MTP layer."""
        return list(self.compress_ratios) + [0] * self.num_nextn_predict_layers

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Parses a ``config.json`` dict (transformers' or the official form) or a dict of this
        class's field names."""
        return _parse_config(d)


_GATING_FUNC = {"softmax": 1, "sigmoid": 2, "softmax_weight": 3, "sqrtsoftplus": 4}
_FIELD_NAMES = {f.name for f in dataclasses.fields(ModelConfig)}


def _parse_config(d: Mapping[str, Any]) -> ModelConfig:
    if not isinstance(d, Mapping):
        raise TypeError(f"config must be a dict or a ModelConfig, got {type(d).__name__}")

    def req(key: str) -> Any:
        if key not in d or d[key] is None:
            raise UnsupportedModelError(f"config.json has no {key!r}")
        return d[key]

    def opt(key: str, default: Any) -> Any:
        v = d.get(key)
        return default if v is None else v

    L = int(req("num_hidden_layers"))
    n_mtp = int(opt("num_nextn_predict_layers", 0))
    head_dim = int(req("head_dim"))

    # per-layer compression and layer types
    layer_types: tuple[str, ...] | None = None
    if isinstance(d.get("layer_types"), (list, tuple)):
        layer_types = tuple(str(t) for t in d["layer_types"])
        if len(layer_types) > L:
            layer_types = layer_types[:L]
    if d.get("compress_ratios") is not None:
        ratios_all = [int(r) for r in d["compress_ratios"]]
        if len(ratios_all) < L:
            raise UnsupportedModelError(f"config.json 'compress_ratios' has {len(ratios_all)} entries "
                                        f"for {L} layers")
        ratios = tuple(ratios_all[:L])
        if any(r != 0 for r in ratios_all[L:]):
            raise UnsupportedModelError("config.json 'compress_ratios': MTP layers must have ratio 0")
    elif layer_types is not None:
        rates = d.get("compress_rates") or {}
        ratio_list = []
        for i, t in enumerate(layer_types):
            if t == SLIDING:
                ratio_list.append(0)
            elif t in (CSA, HCA):
                if t not in rates:
                    raise UnsupportedModelError(f"config.json has no 'compress_rates'[{t!r}] (layer {i})")
                ratio_list.append(int(rates[t]))
            else:
                raise UnsupportedModelError(f"config.json layer {i} has unknown layer type {t!r}")
        ratios = tuple(ratio_list)
    else:
        raise UnsupportedModelError("config.json has no 'compress_ratios' (nor 'layer_types')")

    if d.get("num_hash_layers") is not None:
        n_hash = int(d["num_hash_layers"])
    elif isinstance(d.get("mlp_layer_types"), (list, tuple)):
        kinds = list(d["mlp_layer_types"])[:L]
        n_hash = 0
        while n_hash < len(kinds) and kinds[n_hash] == "hash_moe":
            n_hash += 1
        if "hash_moe" in kinds[n_hash:]:
            raise UnsupportedModelError("config.json 'mlp_layer_types': hash layers must come first")
    else:
        raise UnsupportedModelError("config.json has no 'num_hash_layers' (nor 'mlp_layer_types')")

    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * float(d["partial_rotary_factor"])))
    else:
        raise UnsupportedModelError("config.json has no 'qk_rope_head_dim' (nor 'partial_rotary_factor')")

    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), Mapping) else {}
    assert isinstance(rp, Mapping)
    main = rp.get("main") if isinstance(rp.get("main"), Mapping) else {}
    comp = rp.get("compress") if isinstance(rp.get("compress"), Mapping) else {}
    assert isinstance(main, Mapping) and isinstance(comp, Mapping)
    rope_theta = float(opt("rope_theta", main.get("rope_theta", 10000.0)))
    compress_theta = float(opt("compress_rope_theta", comp.get("rope_theta", 160000.0)))
    scaling = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), Mapping) else comp
    assert isinstance(scaling, Mapping)
    stype = scaling.get("type", scaling.get("rope_type"))
    if stype in (None, "default", "none"):
        scaling_type: str | None = None
        scaling = {}
    else:
        scaling_type = str(stype)
        if scaling_type != "yarn":
            raise UnsupportedModelError(f"config.json: unsupported rope scaling type {scaling_type!r}")

    def sc(key: str, default: Any) -> Any:
        v = scaling.get(key)
        return default if v is None else v

    kw: dict[str, Any] = dict(
        vocab_size=int(req("vocab_size")),
        hidden_size=int(req("hidden_size")),
        num_hidden_layers=L,
        num_attention_heads=int(req("num_attention_heads")),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=int(req("q_lora_rank")),
        o_groups=int(req("o_groups")),
        o_lora_rank=int(req("o_lora_rank")),
        sliding_window=int(req("sliding_window")),
        compress_ratios=ratios,
        num_hash_layers=n_hash,
        n_routed_experts=int(req("n_routed_experts")),
        num_experts_per_tok=int(req("num_experts_per_tok")),
        moe_intermediate_size=int(req("moe_intermediate_size")),
        n_shared_experts=int(opt("n_shared_experts", 1)),
        num_key_value_heads=int(opt("num_key_value_heads", 1)),
        num_nextn_predict_layers=n_mtp,
        hc_mult=int(req("hc_mult")),
        hc_sinkhorn_iters=int(opt("hc_sinkhorn_iters", 20)),
        hc_eps=float(opt("hc_eps", 1e-6)),
        swiglu_limit=float(opt("swiglu_limit", 10.0)),
        routed_scaling_factor=float(opt("routed_scaling_factor", 1.5)),
        norm_topk_prob=bool(opt("norm_topk_prob", True)),
        scoring_func=str(opt("scoring_func", "sqrtsoftplus")),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        rope_scaling_type=scaling_type,
        rope_scaling_factor=float(sc("factor", 16.0)),
        rope_original_max_position_embeddings=int(sc("original_max_position_embeddings", 65536)),
        rope_beta_fast=float(sc("beta_fast", 32.0)),
        rope_beta_slow=float(sc("beta_slow", 1.0)),
        rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(opt("max_position_embeddings", 1048576)),
        bos_token_id=int(opt("bos_token_id", 0)),
        eos_token_id=int(opt("eos_token_id", 1)),
        layer_types=layer_types,
    )
    has_csa = any(t == CSA for t in layer_types) if layer_types is not None else 4 in ratios
    if has_csa:  # the indexer's shape is needed only where there is an indexer
        kw["index_n_heads"] = int(req("index_n_heads"))
        kw["index_head_dim"] = int(req("index_head_dim"))
        kw["index_topk"] = int(req("index_topk"))
    else:
        kw["index_n_heads"] = int(opt("index_n_heads", 0))
        kw["index_head_dim"] = int(opt("index_head_dim", 0))
        kw["index_topk"] = int(opt("index_topk", 0))
    # a dict of this class's own field names may carry the flat rope fields directly
    for key in ("rope_scaling_type", "rope_scaling_factor", "rope_original_max_position_embeddings",
                "rope_beta_fast", "rope_beta_slow"):
        if key in d:
            kw[key] = d[key]
    return ModelConfig(**kw)


def _as_config(config: ModelConfig | Mapping[str, Any]) -> ModelConfig:
    return config if isinstance(config, ModelConfig) else _parse_config(config)


# ---------------------------------------------------------------------------------------------
# Tensor plan: names, shapes (GGUF ne order), roles and the official source names
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    """One output tensor: GGUF name, ``ne`` (row length first), role (selects its type, see the
    module table) and the official (canonical) source tensor names; a stacked expert tensor has
    one source per expert."""

    name: str
    ne: tuple[int, ...]
    role: str
    sources: tuple[str, ...] = field(default=())

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


ROLES = ("vector", "tid2eid", "hc_fn", "ape", "embed", "router", "compressor", "proj",
         "expert_gate_up", "expert_down")


def _layer_specs(cfg: ModelConfig, gp: str, sp: str, ratio: int, kind: str, hashed: bool) -> list[TensorSpec]:
    """The tensors of one block; ``gp``/``sp`` are the GGUF/source name prefixes."""
    D, H, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    Rq, G, Ro = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    E, I, n_sh = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.n_shared_experts
    hcD, mix = cfg.hc_mult * D, cfg.hc_mix
    S: list[TensorSpec] = []

    def t(name: str, ne: Sequence[int], role: str, *src: str) -> None:
        S.append(TensorSpec(gp + name, tuple(ne), role, tuple(sp + s for s in src)))

    t("hc_attn_fn.weight", [hcD, mix], "hc_fn", "hc_attn_fn")
    t("hc_attn_base.weight", [mix], "vector", "hc_attn_base")
    t("hc_attn_scale.weight", [3], "vector", "hc_attn_scale")
    t("attn_norm.weight", [D], "vector", "attn_norm.weight")
    t("attn_q_a.weight", [D, Rq], "proj", "attn.wq_a.weight")
    t("attn_q_a_norm.weight", [Rq], "vector", "attn.q_norm.weight")
    t("attn_q_b.weight", [Rq, H * dh], "proj", "attn.wq_b.weight")
    t("attn_kv.weight", [D, dh], "proj", "attn.wkv.weight")
    t("attn_kv_a_norm.weight", [dh], "vector", "attn.kv_norm.weight")
    t("attn_sinks.weight", [H], "vector", "attn.attn_sink")
    t("attn_output_a.weight", [dh * (H // G), G * Ro], "proj", "attn.wo_a.weight")
    t("attn_output_b.weight", [G * Ro, D], "proj", "attn.wo_b.weight")
    if ratio != 0:
        cw = (2 if kind == CSA else 1) * dh
        t("attn_compressor_ape.weight", [cw, ratio], "ape", "attn.compressor.ape")
        t("attn_compressor_kv.weight", [D, cw], "compressor", "attn.compressor.wkv.weight")
        t("attn_compressor_gate.weight", [D, cw], "compressor", "attn.compressor.wgate.weight")
        t("attn_compressor_norm.weight", [dh], "vector", "attn.compressor.norm.weight")
    if ratio != 0 and kind == CSA:
        HI, dI = cfg.index_n_heads, cfg.index_head_dim
        t("indexer.attn_q_b.weight", [Rq, HI * dI], "compressor", "attn.indexer.wq_b.weight")
        t("indexer.proj.weight", [D, HI], "compressor", "attn.indexer.weights_proj.weight")
        t("indexer_compressor_ape.weight", [2 * dI, ratio], "ape", "attn.indexer.compressor.ape")
        t("indexer_compressor_kv.weight", [D, 2 * dI], "compressor", "attn.indexer.compressor.wkv.weight")
        t("indexer_compressor_gate.weight", [D, 2 * dI], "compressor", "attn.indexer.compressor.wgate.weight")
        t("indexer_compressor_norm.weight", [dI], "vector", "attn.indexer.compressor.norm.weight")
    t("hc_ffn_fn.weight", [hcD, mix], "hc_fn", "hc_ffn_fn")
    t("hc_ffn_base.weight", [mix], "vector", "hc_ffn_base")
    t("hc_ffn_scale.weight", [3], "vector", "hc_ffn_scale")
    t("ffn_norm.weight", [D], "vector", "ffn_norm.weight")
    t("ffn_gate_inp.weight", [D, E], "router", "ffn.gate.weight")
    if hashed:
        t("ffn_gate_tid2eid.weight", [cfg.num_experts_per_tok, cfg.vocab_size], "tid2eid", "ffn.gate.tid2eid")
    else:
        t("exp_probs_b.bias", [E], "vector", "ffn.gate.bias")
    experts = range(E)
    t("ffn_gate_exps.weight", [D, I, E], "expert_gate_up", *(f"ffn.experts.{e}.w1.weight" for e in experts))
    t("ffn_up_exps.weight", [D, I, E], "expert_gate_up", *(f"ffn.experts.{e}.w3.weight" for e in experts))
    t("ffn_down_exps.weight", [I, D, E], "expert_down", *(f"ffn.experts.{e}.w2.weight" for e in experts))
    t("ffn_gate_shexp.weight", [D, I * n_sh], "proj", "ffn.shared_experts.w1.weight")
    t("ffn_up_shexp.weight", [D, I * n_sh], "proj", "ffn.shared_experts.w3.weight")
    t("ffn_down_shexp.weight", [I * n_sh, D], "proj", "ffn.shared_experts.w2.weight")
    return S


def _mtp_specs(cfg: ModelConfig, k: int) -> list[TensorSpec]:
    """The tensors of MTP block ``k`` (``mtp.K.*``)."""
    D, n_hc = cfg.hidden_size, cfg.hc_mult
    gp = sp = f"mtp.{k}."
    plan = [
        TensorSpec(gp + "e_proj.weight", (D, D), "proj", (sp + "e_proj.weight",)),
        TensorSpec(gp + "h_proj.weight", (D, D), "proj", (sp + "h_proj.weight",)),
        TensorSpec(gp + "enorm.weight", (D,), "vector", (sp + "enorm.weight",)),
        TensorSpec(gp + "hnorm.weight", (D,), "vector", (sp + "hnorm.weight",)),
    ]
    plan += _layer_specs(cfg, gp, sp, 0, SLIDING, False)
    plan += _head_specs(cfg, gp, sp)
    return plan


def _head_specs(cfg: ModelConfig, gp: str, sp: str) -> list[TensorSpec]:
    """A drafter's own HC head and final norm."""
    D, n_hc = cfg.hidden_size, cfg.hc_mult
    return [
        TensorSpec(gp + "hc_head_fn.weight", (n_hc * D, n_hc), "hc_fn", (sp + "hc_head_fn",)),
        TensorSpec(gp + "hc_head_base.weight", (n_hc,), "vector", (sp + "hc_head_base",)),
        TensorSpec(gp + "hc_head_scale.weight", (1,), "vector", (sp + "hc_head_scale",)),
        TensorSpec(gp + "norm.weight", (D,), "vector", (sp + "norm.weight",)),
    ]


def dspark_plan(config: ModelConfig | Mapping[str, Any], n_stages: int, n_target_layers: int,
                markov_rank: int, confidence: bool = True) -> list[TensorSpec]:
    """The tensors of a DSpark support file (ds4's layout): ``n_stages`` window-only blocks
    ``mtp.S.*``, ``main_proj``/``main_norm`` on stage 0, and on the last stage the HC head,
    final norm, Markov head (rank ``markov_rank``, none if 0) and confidence head."""
    cfg = _as_config(config)
    D, V = cfg.hidden_size, cfg.vocab_size
    plan = [
        TensorSpec("mtp.0.main_proj.weight", (n_target_layers * D, D), "proj", ("mtp.0.main_proj.weight",)),
        TensorSpec("mtp.0.main_norm.weight", (D,), "vector", ("mtp.0.main_norm.weight",)),
    ]
    for s in range(n_stages):
        plan += _layer_specs(cfg, f"mtp.{s}.", f"mtp.{s}.", 0, SLIDING, False)
    last = f"mtp.{n_stages - 1}."
    plan += _head_specs(cfg, last, last)
    if markov_rank:
        # W1 is an embedding table (vocab rows of rank r), W2 a linear map r -> vocab.
        for w, role in (("markov_w1", "embed"), ("markov_w2", "router")):
            name = f"{last}markov_head.{w}.weight"
            plan.append(TensorSpec(name, (markov_rank, V), role, (name,)))
    if confidence:
        name = f"{last}confidence_head.proj.weight"
        plan.append(TensorSpec(name, (D + markov_rank, 1), "router", (name,)))
    return plan


def tensor_plan(config: ModelConfig | Mapping[str, Any], mtp_layers: int = 0) -> list[TensorSpec]:
    """Every tensor a ``deepseek4`` GGUF of ``config`` holds, in file order: ``token_embd``, the
    blocks ``blk.N.*``, the output head, then ``mtp_layers`` MTP blocks ``mtp.K.*``."""
    cfg = _as_config(config)
    D, V, n_hc = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    plan = [TensorSpec("token_embd.weight", (D, V), "embed", ("embed.weight",))]
    for i in range(cfg.num_hidden_layers):
        plan += _layer_specs(cfg, f"blk.{i}.", f"layers.{i}.", cfg.compress_ratios[i], cfg.layer_type(i),
                             i < cfg.num_hash_layers)
    plan += [
        TensorSpec("output_hc_fn.weight", (n_hc * D, n_hc), "hc_fn", ("hc_head_fn",)),
        TensorSpec("output_hc_base.weight", (n_hc,), "vector", ("hc_head_base",)),
        TensorSpec("output_hc_scale.weight", (1,), "vector", ("hc_head_scale",)),
        TensorSpec("output_norm.weight", (D,), "vector", ("norm.weight",)),
        TensorSpec("output.weight", (D, V), "proj", ("head.weight",)),
    ]
    for k in range(mtp_layers):
        plan += _mtp_specs(cfg, k)
    return plan


# ---------------------------------------------------------------------------------------------
# dtype policy
# ---------------------------------------------------------------------------------------------

_POLICY: dict[str, dict[str, str]] = {
    "f32": {r: "F32" for r in ROLES} | {"tid2eid": "I32"},
    "f16": {r: "F16" for r in ROLES} | {"vector": "F32", "tid2eid": "I32", "hc_fn": "F32", "ape": "F32"},
    "bf16": {r: "BF16" for r in ROLES} | {"vector": "F32", "tid2eid": "I32", "hc_fn": "F32", "ape": "F32"},
    "q8_0": {"vector": "F32", "tid2eid": "I32", "hc_fn": "F16", "ape": "F16", "embed": "F16",
             "router": "F16", "compressor": "F16", "proj": "Q8_0", "expert_gate_up": "Q8_0",
             "expert_down": "Q8_0"},
    "q2": {"vector": "F32", "tid2eid": "I32", "hc_fn": "F16", "ape": "F16", "embed": "F16",
           "router": "F16", "compressor": "F16", "proj": "Q8_0", "expert_gate_up": "IQ2_XXS",
           "expert_down": "Q2_K"},
}

#: general.file_type (llama.cpp's LlamaFileType) per dtype
FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q2": 19}


def tensor_type(spec: TensorSpec, dtype: str) -> str:
    """The ggml type of ``spec`` in a file of ``dtype`` (see the module table)."""
    if dtype not in _POLICY:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(ALL_DTYPES)}")
    t = _POLICY[dtype][spec.role]
    if len(spec.ne) == 1 and t not in ("I32", "F32"):
        t = "F32"
    if t == "Q8_0" and spec.ne[0] % 32:
        t = "F16"
    if t in ("IQ2_XXS", "Q2_K") and spec.ne[0] % 256:
        raise UnsupportedModelError(f"{spec.name}: row length {spec.ne[0]} is not a multiple of 256, "
                                    f"needed for {t}")
    return t


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------

def _rounded_count(n: float) -> str:
    """A parameter count as llama.cpp's size labels write it: "1.1M", "13B", "284B"."""
    for limit, scale, suffix in ((1e12, 1e-12, "T"), (1e9, 1e-9, "B"), (1e6, 1e-6, "M")):
        if n > limit:
            break
    else:
        scale, suffix = 1e-3, "K"
    x = n * scale
    digits = max(2 - len(str(round(x)).lstrip("0")), 0)
    return f"{x:.{digits}f}{suffix}"


def size_label(plan: Sequence[TensorSpec]) -> str:
    """``general.size_label`` as llama.cpp computes it: "{experts}x{shared + one expert}"."""
    shared = expert = 0
    n_experts = 0
    for spec in plan:
        if "_exps." in spec.name and len(spec.ne) == 3:
            expert += spec.n_elements // spec.ne[2]
            n_experts = spec.ne[2]
        else:
            shared += spec.n_elements
    if n_experts:
        return f"{n_experts}x{_rounded_count(shared + expert)}"
    return _rounded_count(shared)


def model_metadata(config: ModelConfig | Mapping[str, Any], dtype: str = "f32",
                   name: str | None = None, plan: Sequence[TensorSpec] | None = None) -> Metadata:
    """The ``general.*`` and ``deepseek4.*`` metadata as (key, value, GGUF type), in the order
    llama.cpp's converter writes them, plus ``vocab_size`` and the expert group counts.
    ``plan`` (default: the trunk's) gives ``general.size_label``."""
    cfg = _as_config(config)
    A = ARCH + "."
    L = cfg.num_hidden_layers
    m: Metadata = [("general.type", "model", "string")]
    if name:
        m.append(("general.name", name, "string"))
    m.append(("general.size_label", size_label(tensor_plan(cfg) if plan is None else plan), "string"))
    m += [
        (A + "block_count", L, "u32"),
        (A + "context_length", cfg.max_position_embeddings, "u32"),
        (A + "embedding_length", cfg.hidden_size, "u32"),
        (A + "attention.head_count", cfg.num_attention_heads, "u32"),
        (A + "attention.head_count_kv", cfg.num_key_value_heads, "u32"),
    ]
    if cfg.rope_scaling_type is not None:
        m += [
            (A + "rope.scaling.type", cfg.rope_scaling_type, "string"),
            (A + "rope.scaling.factor", cfg.rope_scaling_factor, "f32"),
            (A + "rope.scaling.original_context_length", cfg.rope_original_max_position_embeddings, "u32"),
            (A + "rope.scaling.yarn_beta_fast", cfg.rope_beta_fast, "f32"),
            (A + "rope.scaling.yarn_beta_slow", cfg.rope_beta_slow, "f32"),
        ]
    m += [
        (A + "rope.freq_base", cfg.rope_theta, "f32"),
        (A + "attention.layer_norm_rms_epsilon", cfg.rms_norm_eps, "f32"),
        (A + "expert_count", cfg.n_routed_experts, "u32"),
        (A + "expert_used_count", cfg.num_experts_per_tok, "u32"),
        (A + "expert_gating_func", _GATING_FUNC[cfg.scoring_func], "u32"),
        (A + "attention.key_length", cfg.head_dim, "u32"),
        (A + "attention.value_length", cfg.head_dim, "u32"),
        ("general.file_type", FILE_TYPE[dtype], "u32"),
        (A + "rope.dimension_count", cfg.qk_rope_head_dim, "u32"),
        (A + "attention.q_lora_rank", cfg.q_lora_rank, "u32"),
        (A + "attention.sliding_window", cfg.sliding_window, "u32"),
        (A + "expert_feed_forward_length", cfg.moe_intermediate_size, "u32"),
        (A + "expert_shared_count", cfg.n_shared_experts, "u32"),
        (A + "expert_weights_scale", cfg.routed_scaling_factor, "f32"),
        (A + "expert_weights_norm", cfg.norm_topk_prob, "bool"),
        (A + "swiglu_clamp_exp", [cfg.swiglu_limit] * L, "array[f32]"),
        (A + "swiglu_clamp_shexp", [cfg.swiglu_limit] * L, "array[f32]"),
        (A + "attention.indexer.head_count", cfg.index_n_heads, "u32"),
        (A + "attention.indexer.key_length", cfg.index_head_dim, "u32"),
        (A + "attention.indexer.top_k", cfg.index_topk, "u32"),
        (A + "attention.output_group_count", cfg.o_groups, "u32"),
        (A + "attention.output_lora_rank", cfg.o_lora_rank, "u32"),
        (A + "attention.compress_ratios", cfg.gguf_compress_ratios, "array[i32]"),
        (A + "attention.compress_rope_freq_base", cfg.compress_rope_theta, "f32"),
        (A + "hyper_connection.count", cfg.hc_mult, "u32"),
        (A + "hyper_connection.sinkhorn_iterations", cfg.hc_sinkhorn_iters, "u32"),
        (A + "hyper_connection.epsilon", cfg.hc_eps, "f32"),
        (A + "hash_layer_count", cfg.num_hash_layers, "u32"),
        (A + "embedding_length_out", cfg.hidden_size * cfg.hc_mult, "u32"),
        ("general.quantization_version", 2, "u32"),
        (A + "vocab_size", cfg.vocab_size, "u32"),
        (A + "expert_group_count", 0, "u32"),
        (A + "expert_group_used_count", 0, "u32"),
    ]
    return m


# -- tokenizer ----------------------------------------------------------------------------------

# The DeepSeek V3/V4 pre-tokenizer: three ordered Split regexes then a regex-free ByteLevel.
_DEEPSEEK_SPLITS = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def _pre_tokenizer_name(pt: Any) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a tokenizer.json ``pre_tokenizer``."""
    if isinstance(pt, Mapping):
        if pt.get("type") == "ByteLevel" and pt.get("use_regex", True):
            return "gpt-2"
        if pt.get("type") == "Sequence":
            parts = list(pt.get("pretokenizers") or [])
            splits = [p for p in parts if isinstance(p, Mapping) and p.get("type") == "Split"]
            rest = [p for p in parts if not (isinstance(p, Mapping) and p.get("type") == "Split")]
            regexes = tuple(str((p.get("pattern") or {}).get("Regex", "")) for p in splits)
            if (regexes == _DEEPSEEK_SPLITS and len(rest) == 1 and rest[0].get("type") == "ByteLevel"
                    and not rest[0].get("use_regex", True)):
                return "joyai-llm"
            if not splits and len(rest) == 1:
                return _pre_tokenizer_name(rest[0])
    raise UnsupportedModelError(f"unsupported tokenizer pre_tokenizer: {json.dumps(pt)[:200]}")


def _token_content(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def tokenizer_metadata(tokenizer_json: str | os.PathLike[str], vocab_size: int | None = None,
                       tokenizer_config: Mapping[str, Any] | None = None,
                       bos_token_id: int | None = None, eos_token_id: int | None = None) -> Metadata:
    """``tokenizer.ggml.*`` metadata from a byte-level BPE ``tokenizer.json``.

    Tokens are in id order, padded with ``[PAD{i}]`` (type 5, unused) up to ``vocab_size``;
    types are 1 (normal), 3 (control: special added tokens), 4 (user-defined: other added
    tokens). BOS/EOS/PAD ids come from ``tokenizer_config`` (``bos_token`` ...), else from the
    given ids; ``add_bos_token``/``add_eos_token``/``chat_template`` are copied when present.
    """
    path = Path(tokenizer_json)
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    model = tj.get("model") or {}
    if model.get("type") not in ("BPE", None) or not isinstance(model.get("vocab"), Mapping):
        raise UnsupportedModelError(f"{path}: only byte-level BPE tokenizers are supported")
    vocab: Mapping[str, int] = model["vocab"]
    added: list[Mapping[str, Any]] = list(tj.get("added_tokens") or [])
    max_id = max([int(i) for i in vocab.values()] + [int(a["id"]) for a in added], default=-1)
    n = max_id + 1 if vocab_size is None else int(vocab_size)
    if max_id >= n:
        raise UnsupportedModelError(f"{path}: token id {max_id} does not fit the vocabulary of {n}")
    tokens: list[str | None] = [None] * n
    types = [TOKEN_NORMAL] * n
    for s, i in vocab.items():
        tokens[int(i)] = s
    for a in added:
        i = int(a["id"])
        tokens[i] = str(a["content"])
        types[i] = TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    for i, tok in enumerate(tokens):
        if tok is None:
            tokens[i] = f"[PAD{i}]"
            types[i] = TOKEN_UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    ids = {s: i for i, s in enumerate(tokens) if types[i] != TOKEN_UNUSED}
    tc = tokenizer_config or {}

    def special_id(key: str, fallback: int | None) -> int | None:
        content = _token_content(tc.get(key))
        if content is not None and content in ids:
            return ids[content]
        return fallback

    md: Metadata = [
        ("tokenizer.ggml.model", "gpt2", "string"),
        ("tokenizer.ggml.pre", _pre_tokenizer_name(tj.get("pre_tokenizer")), "string"),
        ("tokenizer.ggml.tokens", tokens, "array[string]"),
        ("tokenizer.ggml.token_type", types, "array[i32]"),
        ("tokenizer.ggml.merges", merges, "array[string]"),
    ]
    for key, gkey, fb in (("bos_token", "bos_token_id", bos_token_id), ("eos_token", "eos_token_id", eos_token_id),
                          ("pad_token", "padding_token_id", None)):
        tid = special_id(key, fb)
        if tid is not None:
            md.append((f"tokenizer.ggml.{gkey}", tid, "u32"))
    for key in ("add_bos_token", "add_eos_token"):
        if isinstance(tc.get(key), bool):
            md.append((f"tokenizer.ggml.{key}", tc[key], "bool"))
    if isinstance(tc.get("chat_template"), str):
        md.append(("tokenizer.chat_template", tc["chat_template"], "string"))
    return md


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict):
        raise UnsupportedModelError(f"{path}: not a JSON object")
    return d


def convert_tokenizer(tokenizer_json: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
                      vocab_size: int | None = None) -> Path:
    """Writes a tokenizer-only GGUF (architecture ``deepseek4``, no tensors) from ``tokenizer.json``
    (``tokenizer_config.json`` beside it is used for the special tokens when present)."""
    src = Path(tokenizer_json)
    if not src.is_file():
        raise FileNotFoundError(f"no such tokenizer file: {src}")
    tc_path = src.parent / "tokenizer_config.json"
    tc = _read_json(tc_path) if tc_path.is_file() else {}
    md = tokenizer_metadata(src, vocab_size, tc)
    n_vocab = len(next(v for k, v, _ in md if k == "tokenizer.ggml.tokens"))
    out = Path(out_path)
    w = GGUFWriter(out, arch=ARCH)
    w.add("general.type", "vocab", "string")
    w.add(ARCH + ".vocab_size", n_vocab, "u32")
    for key, value, vt in md:
        w.add(key, value, vt)
    w.write_header()
    w.close()
    return out


# ---------------------------------------------------------------------------------------------
# Reading the checkpoint: canonical names, FP8/FP4 dequantization
# ---------------------------------------------------------------------------------------------

_KV_NORM = re.compile(r"((?:layers|mtp)\.\d+\.attn)\.norm\.weight")
_HC_HEAD = re.compile(r"hc_head\.hc_(fn|base|scale)")
# tensors a checkpoint may carry that the GGUF does not need (the MTP block shares the trunk's)
_IGNORED = re.compile(r"mtp\.\d+\.(embed|emb|head)(\..*)?|.*\.rotary_emb\.inv_freq")


def canonical_name(name: str) -> str:
    """A checkpoint tensor name in the official naming (``model.`` prefix and transformers'
    renames undone)."""
    n = name[6:] if name.startswith("model.") else name
    if n == "embed_tokens.weight":
        return "embed.weight"
    if n == "lm_head.weight":
        return "head.weight"
    m = _HC_HEAD.fullmatch(n)
    if m:
        return f"hc_head_{m.group(1)}"
    m = _KV_NORM.fullmatch(n)
    if m:
        return f"{m.group(1)}.kv_norm.weight"
    return n


_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                 dtype=np.float32)
FP8_BLOCK = 128
FP4_BLOCK = 32


def dequant_fp8(w: npt.NDArray[np.uint8], scale: npt.NDArray[np.float32], row0: int = 0) -> npt.NDArray[np.float32]:
    """FP8 E4M3 codes ``w`` (rows ``row0..`` of a matrix) times their 128x128 block scales (the
    full scale matrix, decoded)."""
    vals = decode_e4m3(w)
    rows = (np.arange(row0, row0 + w.shape[0]) // FP8_BLOCK)
    cols = np.arange(w.shape[1]) // FP8_BLOCK
    return np.asarray(vals * scale[rows][:, cols], dtype=np.float32)


def dequant_fp4(packed: npt.NDArray[Any], scale: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """FP4 E2M1 pairs (``[rows, in/2]`` bytes, low nibble = even element) times one scale per 32
    inputs (``[rows, in/32]``, decoded)."""
    b = np.asarray(packed).view(np.uint8)
    out = np.empty((b.shape[0], b.shape[1] * 2), dtype=np.float32)
    out[:, 0::2] = _E2M1[b & 0xF]
    out[:, 1::2] = _E2M1[b >> 4]
    return out * np.repeat(scale, FP4_BLOCK, axis=1)


class _Source:
    """The checkpoint seen through canonical names, with logical shapes and row reads."""

    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.names: dict[str, str] = {}  # canonical -> stored name
        for stored in ckpt:
            canon = canonical_name(stored)
            if canon in self.names:
                raise UnsupportedModelError(f"tensors {self.names[canon]!r} and {stored!r} are the same tensor")
            self.names[canon] = stored
        self.used: set[str] = set()

    def __contains__(self, canon: str) -> bool:
        return canon in self.names

    def _scale_name(self, canon: str) -> str | None:
        if not canon.endswith(".weight"):
            return None
        base = canon[: -len(".weight")]
        for s in (base + ".scale", base + ".weight_scale_inv"):
            if s in self.names:
                return s
        return None

    def kind(self, canon: str) -> str:
        """'plain', 'fp8' or 'fp4'."""
        meta = self.ckpt.meta(self.names[canon])
        scale = self._scale_name(canon)
        if meta.dtype == "F8_E4M3":
            if scale is None:
                raise UnsupportedModelError(f"FP8 tensor {self.names[canon]!r} has no scale tensor")
            return "fp8"
        if meta.dtype in ("I8", "U8") and scale is not None:
            return "fp4"
        if scale is not None:
            raise UnsupportedModelError(f"tensor {self.names[canon]!r} ({meta.dtype}) has an unexpected scale")
        return "plain"

    def shape(self, canon: str) -> tuple[int, ...]:
        """The logical (dequantized) shape in PyTorch order."""
        meta = self.ckpt.meta(self.names[canon])
        kind = self.kind(canon)
        if kind == "plain":
            return meta.shape
        scale = self.ckpt.meta(self.names[str(self._scale_name(canon))])
        if len(meta.shape) != 2 or len(scale.shape) != 2:
            raise UnsupportedModelError(f"quantized tensor {self.names[canon]!r} is not a matrix")
        out, n = meta.shape
        if kind == "fp8":
            want = (-(-out // FP8_BLOCK), -(-n // FP8_BLOCK))
            if scale.shape != want:
                raise UnsupportedModelError(f"scale of {self.names[canon]!r} has shape {list(scale.shape)}, "
                                            f"expected {list(want)} (128x128 blocks)")
            return meta.shape
        if scale.shape != (out, 2 * n // FP4_BLOCK) or (2 * n) % FP4_BLOCK:
            raise UnsupportedModelError(f"scale of FP4 tensor {self.names[canon]!r} has shape "
                                        f"{list(scale.shape)}, expected {[out, 2 * n // FP4_BLOCK]}")
        return (out, 2 * n)

    def mark_used(self, canon: str) -> None:
        self.used.add(canon)
        s = self._scale_name(canon)
        if s is not None:
            self.used.add(s)

    def read(self, canon: str, rows: tuple[int, int] | None = None) -> npt.NDArray[Any]:
        """Rows ``[start, stop)`` (all if None) of the tensor, decoded/dequantized."""
        stored = self.names[canon]
        kind = self.kind(canon)
        if kind == "plain":
            return self.ckpt.read(stored, rows)
        raw = self.ckpt.raw(stored)
        scale_name = self.names[str(self._scale_name(canon))]
        r0, r1 = rows if rows is not None else (0, raw.shape[0])
        if kind == "fp8":
            scale = decode(self.ckpt.raw(scale_name), self.ckpt.meta(scale_name).dtype).astype(np.float32)
            return dequant_fp8(np.asarray(raw[r0:r1]), scale, r0)
        scale = decode(self.ckpt.raw(scale_name)[r0:r1], self.ckpt.meta(scale_name).dtype).astype(np.float32)
        return dequant_fp4(np.asarray(raw[r0:r1]), scale)


# ---------------------------------------------------------------------------------------------
# Encoding chunks
# ---------------------------------------------------------------------------------------------

CHUNK_ELEMENTS = 1 << 22  # values converted at once (16 MiB of float32)


def f32_to_bf16_bits(x: npt.NDArray[np.float32]) -> npt.NDArray[np.uint16]:
    """float32 -> bfloat16 bits, round to nearest even, NaN kept quiet (as gguf-py)."""
    n = np.ascontiguousarray(x, dtype="<f4").view("<u4").astype(np.uint64)
    nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = np.where(nan, (n & 0xFFFF0000) | (64 << 16), n)
    n = np.where(nan, n, n + (0x7FFF + ((n >> 16) & 1)))
    return (n >> 16).astype("<u2")


def encode(x: npt.NDArray[Any], ggml_type: str) -> npt.NDArray[Any]:
    """Values (any float array, rows of a tensor) -> the bytes of ``ggml_type`` as an array."""
    if ggml_type == "F32":
        return np.ascontiguousarray(x, dtype="<f4")
    if ggml_type == "F16":
        return np.ascontiguousarray(x, dtype="<f2")
    if ggml_type == "BF16":
        return f32_to_bf16_bits(np.asarray(x, dtype=np.float32))
    if ggml_type == "Q8_0":
        from .quant import quantize_q8_0

        return quantize_q8_0(np.ascontiguousarray(x, dtype="<f4"))
    if ggml_type == "I32":
        return np.ascontiguousarray(x, dtype="<i4")
    raise ValueError(f"cannot encode values as {ggml_type}")


def _row_chunks(n_rows: int, row_len: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_ELEMENTS // max(row_len, 1))
    for r in range(0, n_rows, step):
        yield r, min(n_rows, r + step)


# ---------------------------------------------------------------------------------------------
# The converter
# ---------------------------------------------------------------------------------------------

def _model_name(hf_dir: Path) -> str:
    parts = [p for p in re.split(r"[-_\s]+", hf_dir.resolve().name) if p]
    return " ".join(p[:1].upper() + p[1:] for p in parts)


def _check_sources(plan: list[TensorSpec], src: _Source, cfg: ModelConfig) -> None:
    for spec in plan:
        want = tuple(reversed(spec.ne[:2])) if len(spec.ne) == 3 else tuple(reversed(spec.ne))
        for canon in spec.sources:
            if canon not in src:
                raise UnsupportedModelError(f"missing tensor {canon!r} (for {spec.name})")
            shape = src.shape(canon)
            if spec.role == "tid2eid":
                dtype = src.ckpt.meta(src.names[canon]).dtype
                if dtype not in ("I64", "I32", "I16", "I8", "U8", "U16", "U32"):
                    raise UnsupportedModelError(f"tensor {src.names[canon]!r} must be an integer table, is {dtype}")
            if shape != want:
                raise UnsupportedModelError(
                    f"tensor {src.names[canon]!r} has shape {list(shape)}, expected {list(want)} for {spec.name}")
            src.mark_used(canon)
    unknown = [src.names[c] for c in src.names if c not in src.used and not _IGNORED.fullmatch(c)]
    if unknown:
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UnsupportedModelError(f"unknown tensor {unknown[0]!r}" +
                                    (f" (also {', '.join(repr(u) for u in unknown[1:3])}{more})"
                                     if len(unknown) > 1 else ""))


def _tensor_chunks(spec: TensorSpec, ggml_type: str, src: _Source, cfg: ModelConfig,
                   progress: Progress) -> Iterator[npt.NDArray[Any]]:
    row_len = spec.ne[0]
    for canon in spec.sources:  # one source, or one per expert
        n_rows = int(np.prod(src.shape(canon)[:-1])) if len(src.shape(canon)) > 1 else 1
        for r0, r1 in _row_chunks(n_rows, row_len):
            x = src.read(canon, (r0, r1)) if len(src.shape(canon)) > 1 else src.read(canon)
            if spec.role == "tid2eid":
                if x.size and (x.min() < 0 or x.max() >= cfg.n_routed_experts):
                    raise UnsupportedModelError(f"{src.names[canon]!r} holds expert ids outside "
                                                f"[0, {cfg.n_routed_experts})")
            out = encode(x, ggml_type)
            progress.update(out.nbytes, spec.name)
            yield out


def convert(hf_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], *, dtype: str = "f32",
            progress: bool = True) -> Path:
    """Converts the Hugging Face DeepSeek V4 checkpoint in ``hf_dir`` to a GGUF at ``out_path``.

    ``dtype`` is "f32", "f16", "bf16" or "q8_0" (see the module docstring for what each does
    to each tensor). A progress bar goes to stderr when ``progress`` and stderr is a terminal.
    Returns the output path. The file is written to ``out_path + ".part"`` and renamed at the
    end, so a failed conversion leaves nothing behind.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    root = Path(hf_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"no such checkpoint directory: {root}")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {root}")
    cfg = _parse_config(_read_json(cfg_path))

    with Checkpoint(root) as ckpt:
        src = _Source(ckpt)
        mtp_ids = sorted({int(c.split(".")[1]) for c in src.names
                          if re.match(r"mtp\.\d+\.", c) and not _IGNORED.fullmatch(c)})
        if mtp_ids != list(range(len(mtp_ids))):
            raise UnsupportedModelError(f"MTP layers must be numbered from 0, found {mtp_ids}")
        plan = tensor_plan(cfg, mtp_layers=len(mtp_ids))
        _check_sources(plan, src, cfg)
        types = [tensor_type(s, dtype) for s in plan]

        metadata = model_metadata(cfg, dtype, name=_model_name(root), plan=plan)
        tok_path = root / "tokenizer.json"
        if tok_path.is_file():
            tc_path = root / "tokenizer_config.json"
            tc = _read_json(tc_path) if tc_path.is_file() else {}
            metadata += tokenizer_metadata(tok_path, cfg.vocab_size, tc, cfg.bos_token_id, cfg.eos_token_id)

        return write_model(out_path, plan, types, metadata,
                           lambda spec, t, bar: _tensor_chunks(spec, t, src, cfg, bar), progress,
                           desc="ds4 convert")


def _draft_setting(d: Mapping[str, Any], key: str) -> Any:
    for k in (key, "dspark_" + key):
        if k in d:
            return d[k]
    raise UnsupportedModelError(f"the drafter's config.json lacks {key!r} (or 'dspark_{key}')")


def dspark_metadata(block_size: int, markov_rank: int, noise_token_id: int, target_layer_ids: Sequence[int],
                    stages: int, vocab_size: int) -> Metadata:
    """The ``dspark.*`` keys of a DSpark support file (as ds4 writes them)."""
    return [
        ("dspark.block_size", block_size, "u32"),
        ("dspark.markov_rank", markov_rank, "u32"),
        ("dspark.noise_token_id", noise_token_id, "u32"),
        ("dspark.target_layer_ids", list(target_layer_ids), "array[u32]"),
        ("dspark.stage_count", stages, "u32"),
        ("dspark.vocab_size", vocab_size, "u32"),
    ]


def convert_draft(draft_dir: str | os.PathLike[str], out_path: str | os.PathLike[str], *,
                  target: str | os.PathLike[str], dtype: str = "f32", progress: bool = True) -> Path:
    """Converts drafter weights (a directory of safetensors holding only ``mtp.*`` tensors, and
    a ``config.json``) to a ds4 support GGUF for ``ds4.Model.load(..., draft=out_path)``.

    ``target`` is the target's Hugging Face directory (its ``config.json`` gives the shapes).
    The kind is told from the tensors: ``mtp.0.main_proj`` makes a DSpark file (architecture
    ``deepseek4-dspark``, ``dspark.*`` metadata from the drafter's config: ``block_size``,
    ``markov_rank``, ``noise_token_id``, ``target_layer_ids``, also spelled ``dspark_*``),
    ``mtp.0.e_proj`` an MTP file (``deepseek4-mtp``). Tensors are named as in ds4's support
    files (``mtp.S.<gguf per-layer name>``)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
    root, troot = Path(draft_dir), Path(target)
    for d in (root, troot):
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {d}")
    cfg = _parse_config(_read_json(troot / "config.json"))
    dcfg = _read_json(root / "config.json")
    with Checkpoint(root) as ckpt:
        src = _Source(ckpt)
        metadata: Metadata = [("general.type", "model", "string"), ("general.name", _model_name(root), "string")]
        if "mtp.0.main_proj.weight" in src:
            arch = "deepseek4-dspark"
            n_stages = 0
            while f"mtp.{n_stages}.attn_norm.weight" in src:
                n_stages += 1
            layers = [int(x) for x in _draft_setting(dcfg, "target_layer_ids")]
            rank = int(_draft_setting(dcfg, "markov_rank"))
            plan = dspark_plan(cfg, n_stages, len(layers), rank,
                               confidence=f"mtp.{n_stages - 1}.confidence_head.proj.weight" in src)
            metadata += dspark_metadata(int(_draft_setting(dcfg, "block_size")), rank,
                                        int(_draft_setting(dcfg, "noise_token_id")), layers, n_stages,
                                        cfg.vocab_size)
        elif "mtp.0.e_proj.weight" in src:
            arch = "deepseek4-mtp"
            plan = _mtp_specs(cfg, 0)
            metadata += [("mtp.vocab_size", cfg.vocab_size, "u32")]
        else:
            raise UnsupportedModelError(f"{root} holds neither MTP (mtp.0.e_proj) nor DSpark (mtp.0.main_proj) weights")
        _check_sources(plan, src, cfg)
        types = [tensor_type(s, dtype) for s in plan]
        return write_model(out_path, plan, types, metadata,
                           lambda spec, t, bar: _tensor_chunks(spec, t, src, cfg, bar), progress,
                           desc="ds4 convert", arch=arch)


def write_model(out_path: str | os.PathLike[str], plan: Sequence[TensorSpec], types: Sequence[str],
                metadata: Metadata,
                chunks: Callable[[TensorSpec, str, Progress], Iterable[npt.NDArray[Any] | bytes]],
                progress: bool = True, desc: str = "ds4", arch: str = ARCH) -> Path:
    """Writes a ``deepseek4`` GGUF of ``plan`` (with ``types``) and ``metadata``, taking each
    tensor's data from ``chunks(spec, type, progress_bar)``, one tensor at a time. The file is
    written as ``out_path + ".part"`` and renamed when complete."""
    out = Path(out_path)
    part = out.with_name(out.name + ".part")
    w = GGUFWriter(part, arch=arch)
    try:
        for key, value, vt in metadata:
            w.add(key, value, vt)
        total = sum(w.add_tensor_info(s.name, s.ne, t) for s, t in zip(plan, types))
        w.write_header()
        with Progress(total, f"{desc} {out.name}", enabled=progress) as bar:
            for spec, t in zip(plan, types):
                w.write_tensor(spec.name, chunks(spec, t, bar))
        w.close()
        os.replace(part, out)
    except BaseException:
        w.abort()
        part.unlink(missing_ok=True)
        raise
    return out
