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

use std::sync::Arc;

use crate::model::weights::Mat;
use crate::model::{Logits, Model};
use crate::state::{BatchLog, KvPrecision, State};
use crate::Result;

/// The whole forward pass of decode-sized batches on a device, with the session's attention
/// state mirrored in device memory (a session holds one). The host [`State`] stays the
/// reference copy: every step also brings back what it wrote to the state, so snapshots,
/// digests, undo logs and drafters work on the host as before; the mirror is re-uploaded
/// whenever the host state changed by other means (its `sync` tag tells).
pub trait DeviceDecoder: Send {
    /// The host forward pass (`Model::forward`) for `1..=max_rows()` tokens, with its
    /// contract: advances `state`, logs every overwritten value in `log`, returns the
    /// requested rows' logits.
    fn forward(
        &mut self,
        model: &Model,
        state: &mut State,
        tokens: &[u32],
        which: Logits,
        log: Option<&mut BatchLog>,
    ) -> Result<Vec<f32>>;

    /// [`DeviceDecoder::forward`] for the greedy token of each requested row rather than its
    /// logits: what greedy decoding and a temperature-0 verify read of them. A device
    /// computes the argmax where the logits are and brings back one id per row instead of
    /// `vocab` floats (129280 for Flash: 517 KB of download and a host scan per row avoided).
    /// The state, the log and the errors are those of `forward`. The default takes the rows
    /// from `forward` ([`Greedy::from_logits`]).
    fn forward_argmax(
        &mut self,
        model: &Model,
        state: &mut State,
        tokens: &[u32],
        which: Logits,
        log: Option<&mut BatchLog>,
    ) -> Result<Greedy> {
        let logits = self.forward(model, state, tokens, which, log)?;
        Ok(Greedy::from_logits(logits, model.config.vocab))
    }

    /// Follows [`State::keep_prefix`] of the last batch on the device: `tag` is the state's
    /// sync tag before the cut. Leaves the mirror stale (re-uploaded later) when it cannot.
    fn kept(&mut self, state: &mut State, tag: u64, keep: usize) -> Result<()>;

    /// Brings the device copy up to date with `state` now (after a restore), rather than at
    /// the next step.
    fn sync(&mut self, state: &mut State) -> Result<()>;

    /// Most rows one call takes.
    fn max_rows(&self) -> usize;
}

/// The greedy tokens of a pass's requested rows ([`DeviceDecoder::forward_argmax`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Greedy {
    /// Each row's argmax (`model::drafting::argmax`: the lowest index of the largest value),
    /// every row holding a greedy token for the sampler (no NaN or +inf, some value above
    /// -inf): the token the greedy sampler takes from the row.
    Ids(Vec<u32>),
    /// The rows' logits, `rows * vocab` floats, when some row has no greedy token: the
    /// sampler then fails on them exactly as it does on logits.
    Logits(Vec<f32>),
}

impl Greedy {
    /// The greedy tokens of `logits` (rows of `vocab` floats), or the logits themselves when
    /// some row has none.
    pub fn from_logits(logits: Vec<f32>, vocab: usize) -> Self {
        if vocab > 0 && logits.chunks(vocab).all(|row| crate::sampling::greedy(row).is_ok()) {
            Greedy::Ids(logits.chunks(vocab).map(crate::model::drafting::argmax).collect())
        } else {
            Greedy::Logits(logits)
        }
    }

    /// The argmax of the last row (`model::drafting::argmax`, the drafters' anchor), if there
    /// is a row.
    pub fn last_argmax(&self, vocab: usize) -> Option<u32> {
        match self {
            Greedy::Ids(ids) => ids.last().copied(),
            Greedy::Logits(l) if vocab > 0 && l.len() >= vocab => {
                Some(crate::model::drafting::argmax(&l[l.len() - vocab..]))
            }
            Greedy::Logits(_) => None,
        }
    }
}

/// Matrix products over weights that live in a GGUF file image.
pub trait Backend: Send + Sync {
    /// A short name ("cpu", "cuda").
    fn name(&self) -> &'static str;

    /// For each `(w, x)`: `y[r, o] = w[o] · x[r]` for the `x.len() / w.n_in` rows of `x`,
    /// as a new `rows * w.n_out` vector. `raw` is the image of the file `w` points into.
    fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>>;

    /// A device decoder for sessions of `ctx` tokens of `model` stored at `precision`, when
    /// this backend has one and can run this model: `None` otherwise (the session then runs
    /// the forward pass on the host, with this backend's products).
    fn decoder(
        self: Arc<Self>,
        model: &Model,
        ctx: usize,
        precision: KvPrecision,
    ) -> Option<Result<Box<dyn DeviceDecoder>>> {
        let _ = (model, ctx, precision);
        None
    }

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

#[cfg(test)]
mod tests {
    use super::Greedy;

    #[test]
    fn greedy_from_logits_is_the_argmax_or_the_logits() {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let rows = [0.0, 3.0, 3.0, 1.0, /* */ -inf, -1.0, -2.0, -1.0];
        let g = Greedy::from_logits(rows.to_vec(), 4);
        assert_eq!(g, Greedy::Ids(vec![1, 1]));
        assert_eq!(g.last_argmax(4), Some(1));
        // A row with no greedy token anywhere: every row's logits come back.
        for bad in [[0.0, nan, 1.0, 0.0], [0.0, inf, 1.0, 0.0], [-inf; 4]] {
            let logits = [rows.to_vec(), bad.to_vec()].concat();
            match Greedy::from_logits(logits.clone(), 4) {
                Greedy::Logits(l) => assert_eq!(
                    l.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    logits.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                ),
                other => panic!("{other:?}"),
            }
        }
        // The anchor of rows without a greedy token is still drafting's argmax of the last.
        assert_eq!(Greedy::Logits(vec![nan, 5.0, 1.0]).last_argmax(3), Some(0));
        assert_eq!(Greedy::Logits(vec![1.0, nan, 5.0]).last_argmax(3), Some(2));
        assert_eq!(Greedy::Logits(vec![]).last_argmax(3), None);
        assert_eq!(Greedy::Ids(vec![]).last_argmax(3), None);
    }
}
