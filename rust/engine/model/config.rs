//! The model configuration, read from GGUF metadata alone (`deepseek4.*` keys).

use crate::gguf::{GgufFile, Value};
use crate::{Error, Result};

/// What the attention of one layer looks at besides its raw sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Sliding window only (compress ratio 0).
    Sliding,
    /// Compressed sparse attention: overlapping windows of `2 * ratio` tokens with stride
    /// `ratio`, a lightning indexer picking the top-k compressed rows.
    Csa,
    /// Heavily compressed attention: disjoint windows of `ratio` tokens, every row visible.
    Hca,
}

/// Per-layer structure.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    pub kind: AttentionKind,
    /// Tokens per compressed row (0 for sliding layers).
    pub ratio: usize,
    /// Experts chosen by the token-id table (`ffn_gate_tid2eid`) instead of the router.
    pub hash_routed: bool,
    /// Clamp of the routed experts' SwiGLU.
    pub clamp_routed: f32,
    /// Clamp of the shared expert's SwiGLU.
    pub clamp_shared: f32,
}

/// YaRN frequency interpolation of compressed layers (no magnitude correction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_context: u64,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// Most rows of a layer's sliding window a config may ask for ([`ModelConfig::window`]).
pub const MAX_WINDOW: usize = 1 << 16;

/// Most Sinkhorn iterations a config may ask for ([`ModelConfig::sinkhorn_iters`]).
pub const MAX_SINKHORN_ITERS: usize = 1000;

/// Everything the forward pass needs to know about a DeepSeek V4 model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub head_dim: usize,
    /// Rotary dims at the tail of each head (and of compressed and indexer rows).
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub window: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub compress_rope_base: f32,
    pub yarn: Option<Yarn>,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    pub n_experts: usize,
    pub n_experts_used: usize,
    pub expert_ff: usize,
    pub n_shared_experts: usize,
    pub expert_weights_scale: f32,
    pub expert_weights_norm: bool,
    pub hc_mult: usize,
    pub sinkhorn_iters: usize,
    pub hc_eps: f32,
    pub context_length: usize,
    /// MTP blocks stored after the trunk as `blk.N.*` (llama.cpp's layout; 0 otherwise).
    pub nextn_layers: usize,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub layers: Vec<LayerSpec>,
}

const ARCH: &str = "deepseek4";

struct Meta<'a>(&'a GgufFile);

impl Meta<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(&format!("{ARCH}.{key}"))
    }
    fn req(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| Error::model(format!("GGUF metadata lacks {ARCH}.{key}")))
    }
    fn usize(&self, key: &str) -> Result<usize> {
        let v = self.req(key)?;
        v.as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| Error::model(format!("{ARCH}.{key} must be a non-negative integer, got {v:?}")))
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        if self.get(key).is_some() {
            self.usize(key)
        } else {
            Ok(default)
        }
    }
    fn f32(&self, key: &str) -> Result<f32> {
        let v = self.req(key)?;
        v.as_f64().map(|x| x as f32).ok_or_else(|| Error::model(format!("{ARCH}.{key} must be a float, got {v:?}")))
    }
    fn f32_or(&self, key: &str, default: f32) -> Result<f32> {
        if self.get(key).is_some() {
            self.f32(key)
        } else {
            Ok(default)
        }
    }
    /// A per-layer float: an array of at least `n` entries, or one scalar for all layers.
    fn per_layer_f32(&self, key: &str, n: usize) -> Result<Option<Vec<f32>>> {
        let Some(v) = self.get(key) else { return Ok(None) };
        if let Some(x) = v.as_f64() {
            return Ok(Some(vec![x as f32; n]));
        }
        let items = v.as_array().ok_or_else(|| Error::model(format!("{ARCH}.{key} must be a float array")))?;
        if items.len() < n {
            return Err(Error::model(format!("{ARCH}.{key} has {} entries, the model has {n} layers", items.len())));
        }
        items
            .iter()
            .take(n)
            .map(|x| {
                x.as_f64().map(|f| f as f32).ok_or_else(|| Error::model(format!("{ARCH}.{key} holds a non-float")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

impl ModelConfig {
    /// Reads the configuration of a `deepseek4` GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        match file.architecture() {
            Some(ARCH) => {}
            Some(other) => {
                return Err(Error::model(format!("architecture {other:?} is not supported (expected {ARCH:?})")))
            }
            None => return Err(Error::model("GGUF metadata lacks general.architecture")),
        }
        let m = Meta(file);
        // llama.cpp counts its in-file MTP blocks (`blk.{trunk}.*`, after the trunk) in
        // block_count; the trunk is the rest.
        let blocks = m.usize("block_count")?;
        let nextn_layers = m.usize_or("nextn_predict_layers", 0)?;
        if nextn_layers >= blocks {
            return Err(Error::model(format!("{nextn_layers} MTP blocks of {blocks} leave no trunk layers")));
        }
        let n_layers = blocks - nextn_layers;
        let hidden = m.usize("embedding_length")?;
        let n_heads = m.usize("attention.head_count")?;
        let head_dim = m.usize("attention.key_length")?;
        let value_len = m.usize_or("attention.value_length", head_dim)?;
        if value_len != head_dim {
            return Err(Error::model("key_length and value_length differ: V4 shares K and V"));
        }
        if m.usize_or("attention.head_count_kv", 1)? != 1 {
            return Err(Error::model("V4 has exactly one shared KV head"));
        }
        let rope_dim = m.usize("rope.dimension_count")?;
        let index_head_dim = m.usize_or("attention.indexer.key_length", 0)?;
        // The vocabulary size: the explicit key, else the embedding table's row count.
        let vocab = match m.get("vocab_size") {
            Some(_) => m.usize("vocab_size")?,
            None => file
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| {
                    Error::model("cannot tell the vocabulary size: no vocab_size key and no token_embd.weight")
                })?,
        };

        let ratios_v = m.req("attention.compress_ratios")?;
        let ratios = ratios_v
            .as_array()
            .ok_or_else(|| Error::model(format!("{ARCH}.attention.compress_ratios must be an array")))?;
        if ratios.len() < n_layers {
            return Err(Error::model(format!(
                "{ARCH}.attention.compress_ratios has {} entries for {n_layers} layers",
                ratios.len()
            )));
        }
        let hash_layers = m.usize_or("hash_layer_count", 0)?;
        let clamp = m.per_layer_f32("swiglu_clamp_exp", n_layers)?.unwrap_or_else(|| vec![f32::INFINITY; n_layers]);
        let clamp_sh = m.per_layer_f32("swiglu_clamp_shexp", n_layers)?.unwrap_or_else(|| clamp.clone());
        let mut layers = Vec::with_capacity(n_layers);
        for (i, r) in ratios.iter().take(n_layers).enumerate() {
            let ratio = r
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(|| Error::model(format!("compress ratio of layer {i} is not a non-negative integer")))?;
            // CSA's overlapping two-series windows exist only at ratio 4 in V4; every other
            // non-zero ratio is a heavily compressed (disjoint-window) layer.
            let kind = match ratio {
                0 => AttentionKind::Sliding,
                4 => AttentionKind::Csa,
                _ => AttentionKind::Hca,
            };
            layers.push(LayerSpec {
                kind,
                ratio,
                hash_routed: i < hash_layers,
                clamp_routed: clamp[i],
                clamp_shared: clamp_sh[i],
            });
        }

        let yarn = match file.get(&format!("{ARCH}.rope.scaling.type")).and_then(Value::as_str) {
            Some("none") => None,
            _ if m.get("rope.scaling.factor").is_none() => None,
            _ => Some(Yarn {
                factor: m.f32("rope.scaling.factor")?,
                original_context: m.usize("rope.scaling.original_context_length")? as u64,
                beta_fast: m.f32_or("rope.scaling.yarn_beta_fast", 32.0)?,
                beta_slow: m.f32_or("rope.scaling.yarn_beta_slow", 1.0)?,
            }),
        };
        let gating = m.usize_or("expert_gating_func", 4)?;
        if gating != 4 {
            return Err(Error::model(format!(
                "expert_gating_func {gating} is not supported (V4 uses 4, sqrt-softplus)"
            )));
        }
        if m.usize_or("expert_group_count", 0)? > 1 {
            return Err(Error::model("grouped expert routing is not part of V4"));
        }
        let token_id = |key: &str| file.get(key).and_then(Value::as_u64).and_then(|v| u32::try_from(v).ok());

        let cfg = ModelConfig {
            vocab,
            hidden,
            n_heads,
            head_dim,
            rope_dim,
            q_lora_rank: m.usize("attention.q_lora_rank")?,
            o_groups: m.usize("attention.output_group_count")?,
            o_lora_rank: m.usize("attention.output_lora_rank")?,
            window: m.usize("attention.sliding_window")?,
            rms_eps: m.f32_or("attention.layer_norm_rms_epsilon", 1e-6)?,
            rope_base: m.f32_or("rope.freq_base", 10000.0)?,
            compress_rope_base: m.f32_or("attention.compress_rope_freq_base", 160000.0)?,
            yarn,
            index_heads: m.usize_or("attention.indexer.head_count", 0)?,
            index_head_dim,
            index_topk: m.usize_or("attention.indexer.top_k", 0)?,
            n_experts: m.usize("expert_count")?,
            n_experts_used: m.usize("expert_used_count")?,
            expert_ff: m.usize("expert_feed_forward_length")?,
            n_shared_experts: m.usize_or("expert_shared_count", 1)?,
            expert_weights_scale: m.f32_or("expert_weights_scale", 1.0)?,
            expert_weights_norm: m.get("expert_weights_norm").and_then(Value::as_bool).unwrap_or(true),
            hc_mult: m.usize("hyper_connection.count")?,
            sinkhorn_iters: m.usize("hyper_connection.sinkhorn_iterations")?,
            hc_eps: m.f32_or("hyper_connection.epsilon", 1e-6)?,
            context_length: m.usize_or("context_length", 1 << 20)?,
            nextn_layers,
            bos: token_id("tokenizer.ggml.bos_token_id"),
            eos: token_id("tokenizer.ggml.eos_token_id"),
            layers,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(Error::model(msg));
        if self.hidden == 0 || self.n_heads == 0 || self.head_dim == 0 || self.vocab == 0 {
            return bad("hidden size, heads, head dim and vocabulary must be non-zero".into());
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return bad(format!("rope dim {} must be even and at most the head dim {}", self.rope_dim, self.head_dim));
        }
        if self.o_groups == 0 || !self.n_heads.is_multiple_of(self.o_groups) {
            return bad(format!("{} heads do not split into {} output groups", self.n_heads, self.o_groups));
        }
        // A session holds `window` rows a layer (DeepSeek V4: 128) and runs `sinkhorn_iters`
        // iterations at each hyper-connection site (20): the bounds keep a file's values from
        // asking for terabytes at the first session or an endless step.
        if self.window == 0 || self.window > MAX_WINDOW {
            return bad(format!("the sliding window must be in 1..={MAX_WINDOW}, not {}", self.window));
        }
        if self.hc_mult == 0 || self.sinkhorn_iters == 0 || self.sinkhorn_iters > MAX_SINKHORN_ITERS {
            return bad(format!(
                "hyper-connection count ({}) must be non-zero and Sinkhorn iterations ({}) in 1..={MAX_SINKHORN_ITERS}",
                self.hc_mult, self.sinkhorn_iters
            ));
        }
        if self.q_lora_rank == 0 || self.o_lora_rank == 0 || self.expert_ff == 0 {
            return bad("the query and output ranks and the expert width must be non-zero".into());
        }
        if self.n_experts_used == 0 || self.n_experts_used > self.n_experts {
            return bad(format!("{} experts used of {}", self.n_experts_used, self.n_experts));
        }
        if self.layers.iter().any(|l| l.kind == AttentionKind::Csa) {
            if self.index_heads == 0 || self.index_head_dim == 0 || self.index_topk == 0 {
                return bad("CSA layers need the indexer head count, key length and top-k".into());
            }
            if self.rope_dim > self.index_head_dim {
                return bad("the rope dim exceeds the indexer key length".into());
            }
        }
        Ok(())
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
}
