//! Binding GGUF tensors to the model's weights by name, with shape and type checks.
//!
//! Large matrices stay in the memory map ([`Mat`] records where); small tensors (norms,
//! biases, hyper-connection scales, position biases, hash tables) are dequantized once at
//! load time. A missing, mis-shaped or mis-typed tensor is an [`Error::UnsupportedModel`]
//! that names it.

use crate::gguf::GgufFile;
use crate::model::config::{AttentionKind, LayerSpec, ModelConfig};
use crate::quant::GgmlType;
use crate::{Error, Result};

/// A matrix in the file: `n_out` rows of `n_in` elements, row-major, of type `ty`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mat {
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    /// Absolute byte offset in the file image.
    pub start: usize,
    pub row_bytes: usize,
}

impl Mat {
    /// The bytes of row `r`.
    #[inline]
    pub fn row<'a>(&self, raw: &'a [u8], r: usize) -> &'a [u8] {
        let s = self.start + r * self.row_bytes;
        &raw[s..s + self.row_bytes]
    }

    /// Bytes read to use every row once.
    pub fn nbytes(&self) -> usize {
        self.row_bytes * self.n_out
    }
}

/// A stack of `n_exp` matrices of the same shape (an expert tensor, expert index outermost).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stack {
    pub first: Mat,
    pub n_exp: usize,
}

impl Stack {
    /// Expert `e`'s matrix.
    pub fn get(&self, e: usize) -> Mat {
        Mat { start: self.first.start + e * self.first.nbytes(), ..self.first }
    }
}

/// Weights of one hyper-connection site (mixing of the residual streams).
#[derive(Clone, Debug)]
pub struct HyperWeights {
    /// `(2 + hc) * hc` rows (or `hc` for the head) over the flattened `hc * hidden` streams.
    pub proj: Mat,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

/// A compressor: projections of each token into `width` features (one or two series) and
/// the learned position bias, then the norm of emitted rows.
#[derive(Clone, Debug)]
pub struct CompressorWeights {
    pub kv: Mat,
    pub gate: Mat,
    /// `ratio` rows of `kv.n_out` position biases.
    pub ape: Vec<f32>,
    pub norm: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct IndexerWeights {
    pub q_b: Mat,
    pub proj: Mat,
    pub compressor: CompressorWeights,
}

#[derive(Clone, Debug)]
pub enum Router {
    /// Top-k of sqrt-softplus scores plus this selection bias.
    Learned { bias: Vec<f32> },
    /// Experts fixed per token id: `table[token * k .. + k]`.
    Hash { table: Vec<u32> },
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub hc_attn: HyperWeights,
    pub hc_ffn: HyperWeights,
    pub attn_norm: Vec<f32>,
    pub q_a: Mat,
    pub q_a_norm: Vec<f32>,
    pub q_b: Mat,
    pub kv: Mat,
    pub kv_norm: Vec<f32>,
    pub sinks: Vec<f32>,
    pub o_a: Mat,
    pub o_b: Mat,
    pub compressor: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
    pub ffn_norm: Vec<f32>,
    pub router_proj: Mat,
    pub router: Router,
    pub gate_exps: Stack,
    pub up_exps: Stack,
    pub down_exps: Stack,
    pub gate_sh: Mat,
    pub up_sh: Mat,
    pub down_sh: Mat,
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub embed: Mat,
    pub output: Mat,
    pub output_norm: Vec<f32>,
    pub hc_head: HyperWeights,
    pub layers: Vec<LayerWeights>,
}

pub(crate) struct Binder<'a> {
    pub(crate) file: &'a GgufFile,
}

impl Binder<'_> {
    pub(crate) fn info(&self, name: &str, dims: &[usize]) -> Result<&crate::gguf::TensorInfo> {
        let t = self.file.tensor(name).ok_or_else(|| Error::model(format!("missing tensor {name:?}")))?;
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        // Trailing 1-dims are the same shape (a [n] tensor may be written as [n, 1]).
        let mut got = t.dims.clone();
        while got.len() > want.len() && got.last() == Some(&1) {
            got.pop();
        }
        if got != want {
            return Err(Error::model(format!("tensor {name:?} has shape {:?}, expected {want:?}", t.dims)));
        }
        Ok(t)
    }

    pub(crate) fn mat(&self, name: &str, n_in: usize, n_out: usize) -> Result<Mat> {
        self.mat_of(name, &[n_in, n_out])
    }

    pub(crate) fn mat_of(&self, name: &str, dims: &[usize]) -> Result<Mat> {
        let t = self.info(name, dims)?;
        // A product of an empty matrix has nothing to compute and divides by its sizes.
        if dims.contains(&0) {
            return Err(Error::model(format!("tensor {name:?} has an empty dimension: {:?}", t.dims)));
        }
        if !t.ggml_type.is_supported() {
            return Err(Error::model(format!(
                "tensor {name:?} has type {}, which ds4 cannot compute with",
                t.ggml_type
            )));
        }
        Ok(Mat {
            ty: t.ggml_type,
            n_in: dims[0],
            n_out: dims[1],
            start: (self.file.data_offset() + t.offset) as usize,
            row_bytes: t.ggml_type.row_bytes(dims[0] as u64).expect("validated by the reader") as usize,
        })
    }

    pub(crate) fn stack(&self, name: &str, n_in: usize, n_out: usize, n_exp: usize) -> Result<Stack> {
        Ok(Stack { first: self.mat_of(name, &[n_in, n_out, n_exp])?, n_exp })
    }

    pub(crate) fn vec(&self, name: &str, dims: &[usize]) -> Result<Vec<f32>> {
        let t = self.info(name, dims)?;
        if !t.ggml_type.is_supported() {
            return Err(Error::model(format!(
                "tensor {name:?} has type {}, which ds4 cannot compute with",
                t.ggml_type
            )));
        }
        self.file.dequantize(name)
    }

    pub(crate) fn hyper(
        &self,
        prefix: &str,
        hidden: usize,
        hc: usize,
        n_mix: usize,
        n_scale: usize,
    ) -> Result<HyperWeights> {
        Ok(HyperWeights {
            proj: self.mat(&format!("{prefix}_fn.weight"), hc * hidden, n_mix)?,
            base: self.vec(&format!("{prefix}_base.weight"), &[n_mix])?,
            scale: self.vec(&format!("{prefix}_scale.weight"), &[n_scale])?,
        })
    }

    pub(crate) fn compressor(
        &self,
        prefix: &str,
        hidden: usize,
        width: usize,
        ratio: usize,
        norm_dim: usize,
    ) -> Result<CompressorWeights> {
        Ok(CompressorWeights {
            kv: self.mat(&format!("{prefix}_kv.weight"), hidden, width)?,
            gate: self.mat(&format!("{prefix}_gate.weight"), hidden, width)?,
            ape: self.vec(&format!("{prefix}_ape.weight"), &[width, ratio])?,
            norm: self.vec(&format!("{prefix}_norm.weight"), &[norm_dim])?,
        })
    }

    pub(crate) fn hash_table(&self, name: &str, k: usize, vocab: usize, n_exp: usize) -> Result<Vec<u32>> {
        let t = self.info(name, &[k, vocab])?;
        let bytes = self.file.bytes_of(t);
        let ids: Vec<i64> = match t.ggml_type {
            GgmlType::I32 => {
                bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect()
            }
            GgmlType::I64 => {
                bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect()
            }
            other => return Err(Error::model(format!("tensor {name:?} has type {other}, expected I32"))),
        };
        ids.into_iter()
            .map(|e| {
                u32::try_from(e)
                    .ok()
                    .filter(|&e| (e as usize) < n_exp)
                    .ok_or_else(|| Error::model(format!("tensor {name:?} names expert {e}, the layer has {n_exp}")))
            })
            .collect()
    }
}

impl Binder<'_> {
    /// The tensors of one block named `{prefix}.attn_q_a.weight`, ... (`blk.N` in the trunk,
    /// `mtp.K` for drafter blocks).
    pub(crate) fn layer(&self, p: &str, spec: &LayerSpec, cfg: &ModelConfig) -> Result<LayerWeights> {
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let n_mix = (2 + hc) * hc;
        let hd = cfg.head_dim;
        let (compressor, indexer) = match spec.kind {
            AttentionKind::Sliding => (None, None),
            AttentionKind::Hca => {
                (Some(self.compressor(&format!("{p}.attn_compressor"), d, hd, spec.ratio, hd)?), None)
            }
            AttentionKind::Csa => {
                let id = cfg.index_head_dim;
                (
                    Some(self.compressor(&format!("{p}.attn_compressor"), d, 2 * hd, spec.ratio, hd)?),
                    Some(IndexerWeights {
                        q_b: self.mat(
                            &format!("{p}.indexer.attn_q_b.weight"),
                            cfg.q_lora_rank,
                            cfg.index_heads * id,
                        )?,
                        proj: self.mat(&format!("{p}.indexer.proj.weight"), d, cfg.index_heads)?,
                        compressor: self.compressor(&format!("{p}.indexer_compressor"), d, 2 * id, spec.ratio, id)?,
                    }),
                )
            }
        };
        let e = cfg.n_experts;
        let router = if spec.hash_routed {
            Router::Hash {
                table: self.hash_table(&format!("{p}.ffn_gate_tid2eid.weight"), cfg.n_experts_used, cfg.vocab, e)?,
            }
        } else {
            Router::Learned { bias: self.vec(&format!("{p}.exp_probs_b.bias"), &[e])? }
        };
        let sh = cfg.expert_ff * cfg.n_shared_experts;
        Ok(LayerWeights {
            hc_attn: self.hyper(&format!("{p}.hc_attn"), d, hc, n_mix, 3)?,
            hc_ffn: self.hyper(&format!("{p}.hc_ffn"), d, hc, n_mix, 3)?,
            attn_norm: self.vec(&format!("{p}.attn_norm.weight"), &[d])?,
            q_a: self.mat(&format!("{p}.attn_q_a.weight"), d, cfg.q_lora_rank)?,
            q_a_norm: self.vec(&format!("{p}.attn_q_a_norm.weight"), &[cfg.q_lora_rank])?,
            q_b: self.mat(&format!("{p}.attn_q_b.weight"), cfg.q_lora_rank, cfg.n_heads * hd)?,
            kv: self.mat(&format!("{p}.attn_kv.weight"), d, hd)?,
            kv_norm: self.vec(&format!("{p}.attn_kv_a_norm.weight"), &[hd])?,
            sinks: self.vec(&format!("{p}.attn_sinks.weight"), &[cfg.n_heads])?,
            o_a: self.mat(
                &format!("{p}.attn_output_a.weight"),
                cfg.n_heads * hd / cfg.o_groups,
                cfg.o_groups * cfg.o_lora_rank,
            )?,
            o_b: self.mat(&format!("{p}.attn_output_b.weight"), cfg.o_groups * cfg.o_lora_rank, d)?,
            compressor,
            indexer,
            ffn_norm: self.vec(&format!("{p}.ffn_norm.weight"), &[d])?,
            router_proj: self.mat(&format!("{p}.ffn_gate_inp.weight"), d, e)?,
            router,
            gate_exps: self.stack(&format!("{p}.ffn_gate_exps.weight"), d, cfg.expert_ff, e)?,
            up_exps: self.stack(&format!("{p}.ffn_up_exps.weight"), d, cfg.expert_ff, e)?,
            down_exps: self.stack(&format!("{p}.ffn_down_exps.weight"), cfg.expert_ff, d, e)?,
            gate_sh: self.mat(&format!("{p}.ffn_gate_shexp.weight"), d, sh)?,
            up_sh: self.mat(&format!("{p}.ffn_up_shexp.weight"), d, sh)?,
            down_sh: self.mat(&format!("{p}.ffn_down_shexp.weight"), sh, d)?,
        })
    }
}

impl Weights {
    /// Binds every tensor the configuration calls for.
    pub fn bind(file: &GgufFile, cfg: &ModelConfig) -> Result<Self> {
        let b = Binder { file };
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let layers = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(i, spec)| b.layer(&format!("blk.{i}"), spec, cfg))
            .collect::<Result<_>>()?;
        Ok(Weights {
            embed: b.mat("token_embd.weight", d, cfg.vocab)?,
            output: b.mat("output.weight", d, cfg.vocab)?,
            output_norm: b.vec("output_norm.weight", &[d])?,
            hc_head: b.hyper("output_hc", d, hc, hc, 1)?,
            layers,
        })
    }
}
