//! The two trained drafters of DeepSeek V4 and how their weights are found and checked.
//!
//! * **MTP** ("nextn"): one V4 block fed `(trunk HC state h_t, token x_{t+1})`, drafting
//!   autoregressively. Stored in the main file as ds4 does (`mtp.0.*` with separate
//!   `e_proj`/`h_proj`) or as llama.cpp does (`blk.{trunk}.*` plus `blk.{trunk}.nextn.*` with a
//!   fused `eh_proj` = `[e_proj | h_proj]` along the input axis), or in a support file.
//! * **DSpark**: a stack of window-only V4 blocks run over `[anchor, noise x (B-1)]` at once,
//!   conditioned on target hidden states of a few layers through `main_proj`, with a Markov
//!   head (bias from the previous token) and a confidence head. Support file layout: ds4's
//!   (`dspark.*` metadata, `mtp.{s}.*` tensors).
//!
//! Both share the target's token embedding and output matrix. A support file that does not
//! fit its target is a [`Error::DraftMismatch`] naming what differs.

use std::sync::Arc;

use crate::gguf::{GgufFile, Value};
use crate::model::config::{AttentionKind, LayerSpec, ModelConfig};
use crate::model::rope::Rope;
use crate::model::weights::{Binder, HyperWeights, LayerWeights, Mat};
use crate::{Error, Result};

/// How an MTP block combines the token embedding and the trunk state.
#[derive(Clone, Debug)]
pub enum MtpInput {
    /// ds4 / the official checkpoint: `e_proj · enorm(E[τ]) + h_proj · hnorm(H_s)`.
    Split { e_proj: Mat, h_proj: Mat },
    /// llama.cpp: one `[2d -> d]` matrix applied to `[enorm(E[τ]); hnorm(H_s)]`.
    Fused { eh_proj: Mat },
}

/// Which trunk state an MTP row is paired with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MtpPairing {
    /// DeepSeek's convention (the default): `(h_t, x_{t+1})` at position `t` drafts `x_{t+2}`.
    Next,
    /// Upstream ds4's: `(h_t, x_t)` at position `t`, a guess of `x_{t+1}`.
    Same,
}

#[derive(Clone, Debug)]
pub struct MtpWeights {
    pub input: MtpInput,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    pub block: LayerWeights,
    /// The MTP's own HC head and final norm (the trunk's in llama.cpp files that lack them).
    pub hc_head: HyperWeights,
    pub norm: Vec<f32>,
    /// Whether `hc_head`/`norm` point into the target file (llama.cpp layout fallback).
    pub head_from_target: bool,
}

#[derive(Clone, Debug)]
pub struct DSparkWeights {
    pub block_size: usize,
    pub markov_rank: usize,
    pub noise_token: u32,
    /// Target layers whose outputs (HC streams averaged) feed `main_proj`, in order.
    pub target_layers: Vec<usize>,
    pub main_proj: Mat,
    pub main_norm: Vec<f32>,
    pub stages: Vec<LayerWeights>,
    pub hc_head: HyperWeights,
    pub norm: Vec<f32>,
    /// `vocab` rows of `markov_rank`: the previous token's embedding.
    pub markov_w1: Option<Mat>,
    /// `rank -> vocab`: the bias added to a row's logits.
    pub markov_w2: Option<Mat>,
    /// `[h; W1[prev]] -> 1`, no bias.
    pub confidence: Option<Mat>,
}

#[derive(Clone, Debug)]
pub enum DraftKind {
    Mtp(Box<MtpWeights>),
    DSpark(Box<DSparkWeights>),
}

/// A drafter bound to its target: its weights, the file they live in, the block shape.
#[derive(Clone)]
pub struct DraftModel {
    /// The file holding the drafter's own tensors (the target's file for in-file MTP).
    pub(crate) file: Arc<GgufFile>,
    pub kind: DraftKind,
    /// The drafter blocks' structure: window-only attention, learned routing.
    pub spec: LayerSpec,
    /// Plain rotary table of the drafter blocks.
    pub(crate) rope: Rope,
    pub pairing: MtpPairing,
}

impl std::fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DraftModel").field("method", &self.method()).finish_non_exhaustive()
    }
}

impl DraftModel {
    /// "mtp" or "dspark".
    pub fn method(&self) -> &'static str {
        match self.kind {
            DraftKind::Mtp(_) => "mtp",
            DraftKind::DSpark(_) => "dspark",
        }
    }

    /// The MTP block stored in the target's own file, if there is one.
    pub fn find_in(target: &Arc<GgufFile>, cfg: &ModelConfig) -> Result<Option<Self>> {
        if target.tensor("mtp.0.e_proj.weight").is_some() {
            return Self::mtp_ds4(target, cfg).map(Some);
        }
        let n = cfg.n_layers();
        if cfg.nextn_layers > 0 && target.tensor(&format!("blk.{n}.nextn.eh_proj.weight")).is_some() {
            return Self::mtp_llamacpp(target, cfg).map(Some);
        }
        Ok(None)
    }

    /// A drafter from a support file (MTP or DSpark, told apart by their tensors).
    pub fn from_support(support: Arc<GgufFile>, cfg: &ModelConfig) -> Result<Self> {
        match support.architecture() {
            Some("deepseek4" | "deepseek4-mtp" | "deepseek4-dspark") | None => {}
            Some(other) => {
                return Err(Error::mismatch(format!(
                    "the draft file has architecture {other:?}, not a DeepSeek V4 drafter"
                )))
            }
        }
        if let Some(v) = ["deepseek4.vocab_size", "dspark.vocab_size", "mtp.vocab_size"]
            .iter()
            .find_map(|k| support.get(k).and_then(Value::as_u64))
        {
            if v as usize != cfg.vocab {
                return Err(Error::mismatch(format!(
                    "vocabulary: the drafter has {v} tokens, the target {}",
                    cfg.vocab
                )));
            }
        }
        if support.tensor("mtp.0.main_proj.weight").is_some() {
            Self::dspark(&support, cfg)
        } else if support.tensor("mtp.0.e_proj.weight").is_some() {
            Self::mtp_ds4(&support, cfg)
        } else {
            Err(Error::mismatch("the draft file has neither MTP (mtp.0.e_proj) nor DSpark (mtp.0.main_proj) tensors"))
        }
    }

    fn block_spec(cfg: &ModelConfig) -> LayerSpec {
        let last = cfg.layers.last().expect("a model has layers");
        LayerSpec {
            kind: AttentionKind::Sliding,
            ratio: 0,
            hash_routed: false,
            clamp_routed: last.clamp_routed,
            clamp_shared: last.clamp_shared,
        }
    }

    fn new(file: &Arc<GgufFile>, kind: DraftKind, cfg: &ModelConfig) -> Self {
        DraftModel {
            file: Arc::clone(file),
            kind,
            spec: Self::block_spec(cfg),
            rope: Rope::plain(cfg.rope_base, cfg.rope_dim),
            pairing: MtpPairing::Next,
        }
    }

    /// Checks the hidden size first so that a drafter of another model gets a clear message
    /// rather than the first mis-shaped tensor.
    fn check_hidden(b: &Binder<'_>, name: &str, cfg: &ModelConfig) -> Result<()> {
        let t = b.file.tensor(name).ok_or_else(|| Error::mismatch(format!("the draft file lacks {name:?}")))?;
        let d = t.dims.first().copied().unwrap_or(0) as usize;
        if d != cfg.hidden {
            return Err(Error::mismatch(format!("hidden size: the drafter has {d}, the target {}", cfg.hidden)));
        }
        Ok(())
    }

    fn mtp_ds4(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Result<Self> {
        let b = Binder { file };
        Self::check_hidden(&b, "mtp.0.attn_norm.weight", cfg)?;
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let w = (|| -> Result<MtpWeights> {
            Ok(MtpWeights {
                input: MtpInput::Split {
                    e_proj: b.mat("mtp.0.e_proj.weight", d, d)?,
                    h_proj: b.mat("mtp.0.h_proj.weight", d, d)?,
                },
                enorm: b.vec("mtp.0.enorm.weight", &[d])?,
                hnorm: b.vec("mtp.0.hnorm.weight", &[d])?,
                block: b.layer("mtp.0", &Self::block_spec(cfg), cfg)?,
                hc_head: b.hyper("mtp.0.hc_head", d, hc, hc, 1)?,
                norm: b.vec("mtp.0.norm.weight", &[d])?,
                head_from_target: false,
            })
        })()
        .map_err(as_mismatch)?;
        Ok(Self::new(file, DraftKind::Mtp(Box::new(w)), cfg))
    }

    fn mtp_llamacpp(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Result<Self> {
        let b = Binder { file };
        let n = cfg.n_layers();
        let p = format!("blk.{n}");
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        // llama.cpp's files carry no MTP HC head; its graph uses the trunk's head and the
        // optional `nextn.shared_head_norm`. Use the MTP's own where present.
        let own_head = file.tensor(&format!("{p}.nextn.hc_head_fn.weight")).is_some();
        let hc_head = if own_head {
            b.hyper(&format!("{p}.nextn.hc_head"), d, hc, hc, 1)?
        } else {
            b.hyper("output_hc", d, hc, hc, 1)?
        };
        let norm = if file.tensor(&format!("{p}.nextn.shared_head_norm.weight")).is_some() {
            b.vec(&format!("{p}.nextn.shared_head_norm.weight"), &[d])?
        } else {
            b.vec("output_norm.weight", &[d])?
        };
        let w = MtpWeights {
            input: MtpInput::Fused { eh_proj: b.mat(&format!("{p}.nextn.eh_proj.weight"), 2 * d, d)? },
            enorm: b.vec(&format!("{p}.nextn.enorm.weight"), &[d])?,
            hnorm: b.vec(&format!("{p}.nextn.hnorm.weight"), &[d])?,
            block: b.layer(&p, &Self::block_spec(cfg), cfg)?,
            hc_head,
            norm,
            head_from_target: !own_head,
        };
        Ok(Self::new(file, DraftKind::Mtp(Box::new(w)), cfg))
    }

    fn dspark(file: &Arc<GgufFile>, cfg: &ModelConfig) -> Result<Self> {
        let b = Binder { file };
        Self::check_hidden(&b, "mtp.0.main_norm.weight", cfg)?;
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let meta = |key: &str| -> Option<&Value> {
            [format!("dspark.{key}"), format!("deepseek4.dspark.{key}"), format!("deepseek4.dspark_{key}")]
                .iter()
                .find_map(|k| file.get(k))
        };
        let count = |key: &str| -> Result<usize> {
            meta(key)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| Error::mismatch(format!("the DSpark file lacks the integer dspark.{key}")))
        };
        let block_size = count("block_size")?;
        if block_size == 0 || block_size > crate::spec::MAX_DRAFT {
            return Err(Error::mismatch(format!("block size {block_size} is outside 1..={}", crate::spec::MAX_DRAFT)));
        }
        let noise = count("noise_token_id")?;
        if noise >= cfg.vocab {
            return Err(Error::mismatch(format!(
                "noise token id {noise} is outside the target vocabulary of {}",
                cfg.vocab
            )));
        }
        let layers: Vec<usize> = meta("target_layer_ids")
            .and_then(Value::as_array)
            .ok_or_else(|| Error::mismatch("the DSpark file lacks the array dspark.target_layer_ids"))?
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| Error::mismatch("dspark.target_layer_ids holds a non-integer"))
            })
            .collect::<Result<_>>()?;
        if layers.is_empty() || layers.windows(2).any(|w| w[0] >= w[1]) {
            return Err(Error::mismatch(format!("target layer ids {layers:?} must be strictly increasing")));
        }
        if let Some(&bad) = layers.iter().find(|&&l| l >= cfg.n_layers()) {
            return Err(Error::mismatch(format!(
                "target layer id {bad} is outside the target's {} layers",
                cfg.n_layers()
            )));
        }
        let mut n_stages = 0;
        while file.tensor(&format!("mtp.{n_stages}.attn_norm.weight")).is_some() {
            n_stages += 1;
        }
        if n_stages == 0 {
            return Err(Error::mismatch("the DSpark file has no stages (mtp.0.attn_norm.weight is missing)"));
        }
        if let Some(v) = meta("stage_count").or_else(|| meta("n_layers")).and_then(Value::as_u64) {
            if v as usize != n_stages {
                return Err(Error::mismatch(format!("dspark.stage_count is {v}, the file has {n_stages} stages")));
            }
        }
        let last = format!("mtp.{}", n_stages - 1);
        let main = file.tensor("mtp.0.main_proj.weight").expect("checked by the caller");
        if main.dims.first().copied() != Some((layers.len() * d) as u64) {
            return Err(Error::mismatch(format!(
                "main_proj takes {:?} inputs, {} target layers of {d} need {}",
                main.dims.first(),
                layers.len(),
                layers.len() * d
            )));
        }
        let w1 = file.tensor(&format!("{last}.markov_head.markov_w1.weight"));
        let markov_rank = match w1 {
            Some(t) => {
                let (r, v) =
                    (t.dims.first().copied().unwrap_or(0) as usize, t.dims.get(1).copied().unwrap_or(0) as usize);
                if v != cfg.vocab {
                    return Err(Error::mismatch(format!(
                        "vocabulary: the Markov head has {v} tokens, the target {}",
                        cfg.vocab
                    )));
                }
                r
            }
            None => 0,
        };
        if let Some(r) = meta("markov_rank").and_then(Value::as_u64) {
            if r as usize != markov_rank {
                return Err(Error::mismatch(format!(
                    "dspark.markov_rank is {r}, the Markov head has rank {markov_rank}"
                )));
            }
        }
        let spec = Self::block_spec(cfg);
        let w = (|| -> Result<DSparkWeights> {
            let stages = (0..n_stages).map(|s| b.layer(&format!("mtp.{s}"), &spec, cfg)).collect::<Result<_>>()?;
            let (markov_w1, markov_w2) = if markov_rank > 0 {
                (
                    Some(b.mat(&format!("{last}.markov_head.markov_w1.weight"), markov_rank, cfg.vocab)?),
                    Some(b.mat(&format!("{last}.markov_head.markov_w2.weight"), markov_rank, cfg.vocab)?),
                )
            } else {
                (None, None)
            };
            let conf_name = format!("{last}.confidence_head.proj.weight");
            let confidence =
                if file.tensor(&conf_name).is_some() { Some(b.mat(&conf_name, d + markov_rank, 1)?) } else { None };
            Ok(DSparkWeights {
                block_size,
                markov_rank,
                noise_token: noise as u32,
                target_layers: layers.clone(),
                main_proj: b.mat("mtp.0.main_proj.weight", layers.len() * d, d)?,
                main_norm: b.vec("mtp.0.main_norm.weight", &[d])?,
                stages,
                hc_head: b.hyper(&format!("{last}.hc_head"), d, hc, hc, 1)?,
                norm: b.vec(&format!("{last}.norm.weight"), &[d])?,
                markov_w1,
                markov_w2,
                confidence,
            })
        })()
        .map_err(as_mismatch)?;
        Ok(Self::new(file, DraftKind::DSpark(Box::new(w)), cfg))
    }
}

/// A drafter tensor of the wrong shape or type is a mismatch with the target, not a broken
/// target.
fn as_mismatch(e: Error) -> Error {
    match e {
        Error::UnsupportedModel(m) => Error::DraftMismatch(format!("drafter: {m}")),
        other => other,
    }
}
