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
use crate::model::{Logits, Model, Proposal};
use crate::sampling::Sampler;
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

    /// Most rows one call of a prompt's takes ([`DeviceDecoder::set_prefill`]), at least
    /// [`DeviceDecoder::max_rows`]: a prompt's chunks may be longer than a verify. With a
    /// drafter, a call of more than [`DeviceDecoder::draft_rows`] rows may leave the drafter's
    /// rings as they were (keeping only MTP's pending streams, `Model::draft_skip`): the
    /// session evaluates a prompt's last `DraftState::refill_rows` rows, at
    /// least, in calls that keep them, which write every slot of them again.
    fn prefill_rows(&self) -> usize {
        self.max_rows()
    }

    /// Most rows of a prompt's call that keeps the drafter's window rows once the drafter
    /// state has its pending streams (MTP), at least [`DeviceDecoder::max_rows`]; a call of at
    /// most `max_rows()` rows always keeps them.
    fn draft_rows(&self) -> usize {
        self.max_rows()
    }

    /// Marks the calls that follow, until `set_prefill(false)`, as the chunks of a prompt (a
    /// batch longer than [`DeviceDecoder::max_rows`]): a device may then run kernels made for
    /// throughput whose rows are not bitwise a decode's (the state and logits stay within the
    /// backend's tolerance of the host's). Decode steps and verifies are never marked, so a
    /// verify stays bitwise its rows' single decodes; a prompt is evaluated the same way in
    /// plain and speculative decoding. The default ignores it.
    fn set_prefill(&mut self, _on: bool) {}

    /// What the model's drafter proposes after `state` and `anchor` (`Model::propose`, with
    /// its arguments and contract), computed on the device, or `None` when this decoder has no
    /// device path for the model's drafter (the host computes it then). The logits may differ
    /// from the host's by rounding, so the tokens may too where two are close: a proposal
    /// only decides what a verify checks, never what it commits. With `want_logits` false and
    /// a greedy (or no) sampler, the proposal's `logits` may be left empty (and DSpark's
    /// `base_logits` and `hidden` unset).
    fn propose(
        &mut self,
        _model: &Model,
        _state: &State,
        _anchor: u32,
        _k: usize,
        _sampler: Option<&mut Sampler>,
        _want_logits: bool,
    ) -> Option<Result<Proposal>> {
        None
    }
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
        // The sampler's greedy token is `drafting::argmax` wherever it has one: one scan a row.
        if vocab > 0 {
            if let Ok(ids) = logits.chunks(vocab).map(crate::sampling::greedy).collect::<Result<Vec<u32>>>() {
                return Greedy::Ids(ids);
            }
        }
        Greedy::Logits(logits)
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
pub(crate) mod tests {
    use super::Greedy;
    use crate::model::drafting::argmax;
    use crate::quant::testutil::Rng;
    use crate::sampling::greedy;

    /// Rows of `len` values that the argmax must get right: ties (small integers, signed
    /// zeros, equal values everywhere), NaN at 0 and elsewhere, -inf and +inf anywhere, every
    /// value -inf or NaN, the largest value last, and plain random ones.
    pub(crate) fn hard_rows(len: usize, rng: &mut Rng) -> Vec<Vec<f32>> {
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let at = |rng: &mut Rng| (rng.next_u64() % len as u64) as usize;
        let ties = |rng: &mut Rng| -> Vec<f32> { (0..len).map(|_| (rng.next_u64() % 5) as f32 - 2.0).collect() };
        let mut rows = vec![
            rng.f32s(len),
            ties(rng),
            (0..len).map(|i| if i % 3 == 0 { 0.0 } else { -0.0 }).collect(),
            (0..len).map(|i| if i % 2 == 0 { -0.0 } else { f32::MIN_POSITIVE / 4.0 }).collect(),
            vec![1.5; len],
            vec![-inf; len],
            vec![nan; len],
            (0..len).map(|i| i as f32).collect(),
            (0..len).map(|i| if i == 0 { -inf } else { nan }).collect(),
        ];
        for _ in 0..4 {
            let mut r = ties(rng);
            r[0] = nan;
            rows.push(r);
            let mut r = ties(rng);
            let k = at(rng);
            r[k] = nan;
            r[at(rng)] = nan;
            rows.push(r);
            let mut r = rng.f32s(len);
            r[at(rng)] = inf;
            r[at(rng)] = inf;
            rows.push(r);
            let mut r = ties(rng);
            r[at(rng)] = -inf;
            r[0] = -inf;
            rows.push(r);
            let mut r = vec![-inf; len];
            r[at(rng)] = rng.f32();
            rows.push(r);
            let mut r = vec![-inf; len];
            r[at(rng)] = nan;
            rows.push(r);
            let mut r = vec![nan; len];
            r[at(rng)] = 1.0;
            rows.push(r);
            let mut r = ties(rng);
            r[at(rng)] = -inf;
            r[at(rng)] = nan;
            r[at(rng)] = 2.0;
            rows.push(r);
        }
        rows
    }

    /// What a thread of `ds4_argmax_rows` holds: the index (-1: none) and value of the first
    /// largest value above -inf it has seen.
    #[derive(Clone, Copy, Debug)]
    struct Best {
        idx: i64,
        v: f32,
    }

    const NONE: Best = Best { idx: -1, v: f32::NEG_INFINITY };

    /// A thread's scan of `idxs` (increasing): takes x[i] iff x[i] > v.
    fn scan(row: &[f32], idxs: impl Iterator<Item = usize>) -> Best {
        let mut b = NONE;
        for i in idxs {
            if row[i] > b.v {
                b = Best { idx: i as i64, v: row[i] };
            }
        }
        b
    }

    /// ds4_best_takes.
    fn takes(a: Best, b: Best) -> bool {
        b.idx >= 0 && (a.idx < 0 || b.v > a.v || (b.v == a.v && b.idx < a.idx))
    }

    fn combine(a: Best, b: Best) -> Best {
        if takes(a, b) {
            b
        } else {
            a
        }
    }

    /// The kernel's answer from the combined result: (the argmax, whether the row has no
    /// greedy token).
    fn finish(row: &[f32], b: Best) -> (u32, bool) {
        let bad = row.iter().any(|&v| v.is_nan() || v == f32::INFINITY) || b.idx < 0;
        (if row[0].is_nan() || b.idx < 0 { 0 } else { b.idx as u32 }, bad)
    }

    /// ds4_argmax_rows step by step for a block of `threads` threads (a multiple of 32): the
    /// float4 or scalar split, each warp's butterfly, then warp by warp in thread 0.
    fn kernel(row: &[f32], threads: usize) -> (u32, bool) {
        let n = row.len();
        let mut held: Vec<Best> = (0..threads)
            .map(|t| {
                if n.is_multiple_of(4) {
                    scan(row, (t..n / 4).step_by(threads).flat_map(|j| 4 * j..4 * j + 4))
                } else {
                    scan(row, (t..n).step_by(threads))
                }
            })
            .collect();
        for warp in held.chunks_mut(32) {
            for o in [16, 8, 4, 2, 1] {
                let before = warp.to_vec();
                for (lane, b) in warp.iter_mut().enumerate() {
                    *b = combine(before[lane], before[lane ^ o]);
                }
            }
        }
        let b = held.iter().step_by(32).skip(1).fold(held[0], |a, &w| combine(a, w));
        finish(row, b)
    }

    /// The values split between `parts` threads at random, combined in a random order.
    fn random_split(row: &[f32], parts: usize, rng: &mut Rng) -> (u32, bool) {
        let owner: Vec<usize> = (0..row.len()).map(|_| (rng.next_u64() % parts as u64) as usize).collect();
        let mut held: Vec<Best> = (0..parts).map(|p| scan(row, (0..row.len()).filter(|&i| owner[i] == p))).collect();
        while held.len() > 1 {
            let a = held.swap_remove((rng.next_u64() % held.len() as u64) as usize);
            let b = held.swap_remove((rng.next_u64() % held.len() as u64) as usize);
            held.push(if rng.next_u64().is_multiple_of(2) { combine(a, b) } else { combine(b, a) });
        }
        finish(row, held[0])
    }

    /// Contiguous ranges combined left to right by the rule without the index tie-break
    /// (`b.idx >= 0 && (a.idx < 0 || b.v > a.v)`), enough when a's indices are below b's.
    fn contiguous_split(row: &[f32], cuts: &[usize]) -> (u32, bool) {
        let mut bounds = vec![0];
        bounds.extend(cuts.iter().copied());
        bounds.push(row.len());
        let b = bounds.windows(2).map(|w| scan(row, w[0]..w[1])).fold(NONE, |a, b| {
            if b.idx >= 0 && (a.idx < 0 || b.v > a.v) {
                b
            } else {
                a
            }
        });
        finish(row, b)
    }

    #[track_caller]
    fn check(row: &[f32], got: (u32, bool), how: &str) {
        let want = argmax(row);
        assert_eq!(got.0, want, "{how}: argmax of {row:?}");
        assert_eq!(got.1, greedy(row).is_err(), "{how}: no greedy token for {row:?}");
        if !got.1 {
            assert_eq!(greedy(row).unwrap(), want, "{how}: the sampler's token for {row:?}");
        }
    }

    /// The reduction of `ds4_argmax_rows` (shaders/cuda/decode_step.cu), modelled here, is the
    /// host's sequential scan (`drafting::argmax`), NaNs and infinities included, and its flag
    /// is the greedy sampler's refusal: for the kernel's own split and block sizes, for any
    /// split of the values between threads combined in any order, and for contiguous splits
    /// combined left to right by the simpler rule.
    #[test]
    fn the_kernels_argmax_reduction_is_the_sequential_scan() {
        let mut rng = Rng(0x05ee_da11);
        for len in [1usize, 2, 3, 4, 5, 7, 8, 31, 32, 33, 64, 100, 128, 129, 257, 1000, 4096, 5003] {
            for row in hard_rows(len, &mut rng) {
                for threads in [32, 64, 256, 1024] {
                    check(&row, kernel(&row, threads), &format!("kernel, {threads} threads"));
                }
                for parts in [1, 2, 3, 7, 32] {
                    check(&row, random_split(&row, parts, &mut rng), &format!("{parts} random parts"));
                }
                let mut cuts: Vec<usize> = (0..3).map(|_| (rng.next_u64() % (len as u64 + 1)) as usize).collect();
                cuts.sort_unstable();
                check(&row, contiguous_split(&row, &cuts), &format!("contiguous at {cuts:?}"));
            }
        }
        // The tie-break is needed when the threads' indices interleave: without it, thread 1
        // (holding index 1) would win over thread 0 (holding index 4) of the same value.
        let row = [0.0, 2.0, 0.0, 0.0, 2.0];
        let (a, b) = (scan(&row, [0, 4].into_iter()), scan(&row, [1, 2, 3].into_iter()));
        assert_eq!(combine(a, b).idx, 1);
        assert_eq!(combine(b, a).idx, 1);
    }

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
