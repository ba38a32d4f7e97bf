//! The DeepSeek V4 model: configuration, weights bound from a GGUF file, and the CPU
//! forward pass (one file per block kind).

pub mod attention;
pub(crate) mod block;
pub mod config;
pub mod draft;
pub(crate) mod drafting;
pub mod forward;
pub mod hyper;
pub mod indexer;
pub mod moe;
pub mod rope;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

pub use config::{AttentionKind, LayerSpec, ModelConfig};
pub use draft::{DraftModel, MtpPairing};
pub use drafting::Proposal;
pub use forward::Logits;

use crate::backend::{Backend, Cpu, Ops};
use crate::gguf::GgufFile;
use crate::Result;
use rope::Rope;
use weights::Weights;

/// A loaded model: the memory-mapped file, its configuration and bound weights.
pub struct Model {
    pub(crate) file: Arc<GgufFile>,
    pub config: ModelConfig,
    pub weights: Weights,
    /// Each layer's rotary table: plain on sliding layers, YaRN on compressed ones.
    pub(crate) ropes: Vec<Rope>,
    /// What computes the matrix products.
    pub(crate) backend: Arc<dyn Backend>,
    /// The drafter (MTP or DSpark), from the model's own file or a support file.
    pub draft: Option<DraftModel>,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model").field("config", &self.config).finish_non_exhaustive()
    }
}

impl Model {
    /// Opens, validates and binds a `deepseek4` GGUF file.
    /// An MTP block stored in the same file is loaded as the model's drafter.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::from_gguf(Arc::new(GgufFile::open(path)?))
    }

    /// Loads a model and takes its drafter from the support file `draft` (MTP or DSpark).
    pub fn load_with_draft(path: impl AsRef<Path>, draft: impl AsRef<Path>) -> Result<Self> {
        let mut m = Self::load(path)?;
        m.attach_draft(Arc::new(GgufFile::open(draft)?))?;
        Ok(m)
    }

    /// Uses the drafter of the support file `support` (replacing any in-file MTP).
    pub fn attach_draft(&mut self, support: Arc<GgufFile>) -> Result<()> {
        self.draft = Some(DraftModel::from_support(support, &self.config)?);
        Ok(())
    }

    /// Chooses the MTP input pairing (DeepSeek's by default).
    pub fn set_mtp_pairing(&mut self, pairing: MtpPairing) {
        if let Some(dm) = self.draft.as_mut() {
            dm.pairing = pairing;
        }
    }

    pub fn from_gguf(file: Arc<GgufFile>) -> Result<Self> {
        let config = ModelConfig::from_gguf(&file)?;
        let weights = Weights::bind(&file, &config)?;
        let plain = Rope::plain(config.rope_base, config.rope_dim);
        let compressed = match &config.yarn {
            Some(y) => Rope::yarn(config.compress_rope_base, config.rope_dim, y),
            None => Rope::plain(config.compress_rope_base, config.rope_dim),
        };
        let ropes = config
            .layers
            .iter()
            .map(|l| if l.kind == AttentionKind::Sliding { plain.clone() } else { compressed.clone() })
            .collect();
        let draft = DraftModel::find_in(&file, &config)?;
        Ok(Model { file, config, weights, ropes, backend: Arc::new(Cpu), draft })
    }

    /// Computes the products with `backend` from now on (the CPU is the default).
    pub fn set_backend(&mut self, backend: Arc<dyn Backend>) {
        self.backend = backend;
    }

    /// Switches the products to the backend named `name`: "cpu"; "cuda" (the first GPU: the
    /// weights of the model file, and of a separate drafter file, are copied to its memory
    /// once, `progress(bytes_done, bytes_total)` reporting each file's copy); or "auto" (CUDA
    /// when a GPU is usable and holds the weights, else the CPU). A build without the `cuda` feature, or a machine
    /// without a GPU or driver, makes "cuda" an [`crate::Error::BackendUnavailable`].
    pub fn select_backend(&mut self, name: &str, progress: &mut dyn FnMut(u64, u64)) -> Result<()> {
        match name {
            "cpu" => {
                self.backend = Arc::new(Cpu);
                Ok(())
            }
            "cuda" | "auto" => match self.cuda_backend(progress) {
                Ok(b) => {
                    self.backend = b;
                    Ok(())
                }
                // "auto" settles for the CPU whatever kept the GPU from being set up (no
                // device or driver, or not enough GPU memory for the weights).
                Err(crate::Error::BackendUnavailable(_) | crate::Error::Backend(_)) if name == "auto" => {
                    self.backend = Arc::new(Cpu);
                    Ok(())
                }
                Err(e) => Err(e),
            },
            other => {
                Err(crate::Error::InvalidArgument(format!("backend must be 'cpu', 'cuda' or 'auto', got {other:?}")))
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_backend(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<Arc<dyn Backend>> {
        let b = crate::backend::cuda::CudaBackend::new(0)?;
        b.upload(&self.file, &mut *progress)?;
        if let Some(d) = &self.draft {
            if !Arc::ptr_eq(&d.file, &self.file) {
                b.upload(&d.file, &mut *progress)?;
            }
        }
        Ok(Arc::new(b))
    }

    #[cfg(not(feature = "cuda"))]
    fn cuda_backend(&self, _progress: &mut dyn FnMut(u64, u64)) -> Result<Arc<dyn Backend>> {
        Err(crate::Error::BackendUnavailable("this build of ds4 has no CUDA backend (feature `cuda`)".into()))
    }

    /// The backend computing the products.
    pub fn backend(&self) -> &dyn Backend {
        &*self.backend
    }

    /// The trunk's weights and backend.
    pub(crate) fn ops(&self) -> Ops<'_> {
        Ops { raw: self.file.raw(), backend: &*self.backend }
    }

    /// The GGUF file the model was loaded from.
    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// Bytes of weights read to decode one token: every non-expert matrix, the experts
    /// actually used (`n_experts_used` of each layer), one embedding row and the head.
    pub fn decode_weight_bytes(&self) -> u64 {
        let w = &self.weights;
        let k = self.config.n_experts_used;
        let mut total = w.output.nbytes() + w.embed.row_bytes + w.hc_head.proj.nbytes();
        for l in &w.layers {
            let mats = [
                &l.hc_attn.proj,
                &l.hc_ffn.proj,
                &l.q_a,
                &l.q_b,
                &l.kv,
                &l.o_a,
                &l.o_b,
                &l.router_proj,
                &l.gate_sh,
                &l.up_sh,
                &l.down_sh,
            ];
            total += mats.iter().map(|m| m.nbytes()).sum::<usize>();
            if let Some(c) = &l.compressor {
                total += c.kv.nbytes() + c.gate.nbytes();
            }
            if let Some(i) = &l.indexer {
                total += i.q_b.nbytes() + i.proj.nbytes() + i.compressor.kv.nbytes() + i.compressor.gate.nbytes();
            }
            total += k * (l.gate_exps.first.nbytes() + l.up_exps.first.nbytes() + l.down_exps.first.nbytes());
        }
        total as u64
    }
}
