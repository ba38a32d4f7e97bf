//! Compute backends. The CPU backend is the reference every other backend is tested against.
//!
//! A backend computes the matrix products of the forward pass: they read every weight byte
//! of a decode step, so they are where a GPU pays. The contract every backend keeps is
//! **row invariance**: each output row of a product is computed with the same reduction
//! order whatever the number of rows in the batch, so a row's value never depends on what
//! else was in it. Speculative verify relies on that to commit its rows without replay.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use crate::model::weights::Mat;
use crate::Result;

/// Matrix products over weights that live in a GGUF file image.
pub trait Backend: Send + Sync {
    /// A short name ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// For each `(w, x)`: `y[r, o] = w[o] · x[r]` for the `x.len() / w.n_in` rows of `x`,
    /// as a new `rows * w.n_out` vector. `raw` is the image of the file `w` points into.
    fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>>;

    /// One product (see [`Backend::matmul_many`]).
    fn matmul(&self, raw: &[u8], w: &Mat, x: &[f32]) -> Result<Vec<f32>> {
        Ok(self.matmul_many(raw, &[(w, x)])?.pop().expect("one output per product"))
    }
}

/// The reference backend: the fused CPU dot kernels of [`cpu`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Cpu;

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
        cpu::matmul_many_new(raw, specs)
    }
}

/// The weights of one file image and the backend that multiplies by them: what every
/// block of the forward pass needs to compute a product.
#[derive(Clone, Copy)]
pub struct Ops<'a> {
    pub raw: &'a [u8],
    pub backend: &'a dyn Backend,
}

impl Ops<'_> {
    pub fn matmul(&self, w: &Mat, x: &[f32]) -> Result<Vec<f32>> {
        let _t = crate::profile::scope(crate::profile::Phase::Matmul);
        self.backend.matmul(self.raw, w, x)
    }

    pub fn matmul_many(&self, specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
        let _t = crate::profile::scope(crate::profile::Phase::Matmul);
        self.backend.matmul_many(self.raw, specs)
    }
}
