//! Per-layer decode state: the raw window ring, the compressors' frontiers and the rows they
//! have emitted.

use super::rows::RowStore;

/// The streaming state of one compressor (main or indexer) of one layer.
///
/// Each token's projection holds `series * width` features (`series` is 2 for CSA, whose
/// first half `Ca` belongs to the next window and second half `Cb` to the token's own
/// window; 1 for HCA). `cur_*` hold the projections of the window being filled, slot
/// `pos % ratio`, with the position bias already added to the scores; `prev_*` hold the
/// `Ca` halves of the last complete window (scores −∞ before the first window closes).
#[derive(Clone, Debug)]
pub struct CompressorState {
    pub width: usize,
    pub ratio: usize,
    pub overlap: bool,
    pub cur_kv: Vec<f32>,
    pub cur_score: Vec<f32>,
    pub prev_kv: Vec<f32>,
    pub prev_score: Vec<f32>,
    /// Emitted rows (after norm and rope).
    pub rows: RowStore,
}

impl CompressorState {
    pub fn new(width: usize, ratio: usize, overlap: bool) -> Self {
        let series = if overlap { 2 } else { 1 };
        let prev = if overlap { ratio * width } else { 0 };
        CompressorState {
            width,
            ratio,
            overlap,
            cur_kv: vec![0.0; ratio * series * width],
            cur_score: vec![f32::NEG_INFINITY; ratio * series * width],
            prev_kv: vec![0.0; prev],
            prev_score: vec![f32::NEG_INFINITY; prev],
            rows: RowStore::new(width),
        }
    }

    /// Features per token projection.
    pub fn proj_width(&self) -> usize {
        self.cur_kv.len() / self.ratio
    }

    /// Stores the projection of the token at `pos` (`score` already includes the position
    /// bias). If this token closes a window, pools it into `out` and returns true.
    pub fn push(&mut self, pos: usize, kv: &[f32], score: &[f32], out: &mut [f32]) -> bool {
        if !self.store(pos, kv, score) {
            return false;
        }
        let (w, r, pw) = (self.width, self.ratio, self.proj_width());
        // Candidates per feature, in the reference's order: the previous window's Ca slots
        // (overlap only), then this window's slots (its Cb half when overlapping).
        let own = if self.overlap { w } else { 0 };
        let mut logits = Vec::with_capacity(2 * r);
        for f in 0..w {
            logits.clear();
            if self.overlap {
                logits.extend((0..r).map(|j| self.prev_score[j * w + f]));
            }
            logits.extend((0..r).map(|j| self.cur_score[j * pw + own + f]));
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut denom = 0f32;
            for l in logits.iter_mut() {
                *l = (*l - m).exp();
                denom += *l;
            }
            let mut acc = 0f32;
            let mut k = 0;
            if self.overlap {
                for j in 0..r {
                    acc += self.prev_kv[j * w + f] * (logits[k] / denom);
                    k += 1;
                }
            }
            for j in 0..r {
                acc += self.cur_kv[j * pw + own + f] * (logits[k] / denom);
                k += 1;
            }
            out[f] = acc;
        }
        self.shift();
        true
    }

    /// Writes slot `pos % ratio`; returns whether the token closes a window.
    fn store(&mut self, pos: usize, kv: &[f32], score: &[f32]) -> bool {
        let pw = self.proj_width();
        let slot = pos % self.ratio;
        self.cur_kv[slot * pw..(slot + 1) * pw].copy_from_slice(kv);
        self.cur_score[slot * pw..(slot + 1) * pw].copy_from_slice(score);
        (pos + 1).is_multiple_of(self.ratio)
    }

    /// After a window closed: its `Ca` halves become the previous window's (overlap only).
    fn shift(&mut self) {
        if self.overlap {
            let (w, pw) = (self.width, self.proj_width());
            for j in 0..self.ratio {
                self.prev_kv[j * w..(j + 1) * w].copy_from_slice(&self.cur_kv[j * pw..j * pw + w]);
                self.prev_score[j * w..(j + 1) * w].copy_from_slice(&self.cur_score[j * pw..j * pw + w]);
            }
        }
    }

    /// [`CompressorState::push`] with the pooling done elsewhere (on a device): stores the
    /// projection of `pos` and, when it closes a window, appends `row` (the emitted row,
    /// already normalized, rotated and rounded) and shifts the window.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the device decoder's
    pub(crate) fn push_computed(&mut self, pos: usize, kv: &[f32], score: &[f32], row: &[f32]) {
        if self.store(pos, kv, score) {
            self.rows.push(row);
            self.shift();
        }
    }

    pub fn nbytes(&self) -> usize {
        4 * (self.cur_kv.len() + self.cur_score.len() + self.prev_kv.len() + self.prev_score.len()) + self.rows.nbytes()
    }
}

/// What [`CompressorState::push`] at one position (and the row it may emit) overwrites: the
/// position's slot, the previous window's halves if the window closes, the emitted-row
/// count. Taken before the push; [`CompressorUndo::restore`] puts it back. A few KB, where a
/// whole frontier of a ratio-128 layer is 512 KB.
#[derive(Debug)]
pub(crate) struct CompressorUndo {
    slot: usize,
    kv: Vec<f32>,
    score: Vec<f32>,
    prev: Option<(Vec<f32>, Vec<f32>)>,
    rows: usize,
}

impl CompressorUndo {
    pub(crate) fn capture(cs: &CompressorState, pos: usize) -> Self {
        let pw = cs.proj_width();
        let slot = pos % cs.ratio;
        let closes = (pos + 1).is_multiple_of(cs.ratio);
        CompressorUndo {
            slot,
            kv: cs.cur_kv[slot * pw..(slot + 1) * pw].to_vec(),
            score: cs.cur_score[slot * pw..(slot + 1) * pw].to_vec(),
            prev: (closes && cs.overlap).then(|| (cs.prev_kv.clone(), cs.prev_score.clone())),
            rows: cs.rows.len(),
        }
    }

    pub(crate) fn restore(self, cs: &mut CompressorState) {
        let pw = cs.proj_width();
        cs.cur_kv[self.slot * pw..(self.slot + 1) * pw].copy_from_slice(&self.kv);
        cs.cur_score[self.slot * pw..(self.slot + 1) * pw].copy_from_slice(&self.score);
        if let Some((kv, score)) = self.prev {
            cs.prev_kv = kv;
            cs.prev_score = score;
        }
        cs.rows.truncate(self.rows);
    }
}

/// The state of one layer.
#[derive(Clone, Debug)]
pub struct LayerState {
    /// Raw window ring: `slots` rows of `head_dim`, slot `pos % slots`. It has
    /// [`crate::spec::MAX_DRAFT`] + 1 slots more than the window, so the rows of a rejected
    /// speculative block never overwrite a row that a committed position still attends to.
    pub ring: Vec<f32>,
    pub window: usize,
    pub slots: usize,
    pub head_dim: usize,
    pub compressor: Option<CompressorState>,
    pub indexer: Option<CompressorState>,
}

impl LayerState {
    pub fn new(
        window: usize,
        head_dim: usize,
        compressor: Option<CompressorState>,
        indexer: Option<CompressorState>,
    ) -> Self {
        let slots = window + crate::spec::MAX_DRAFT + 1;
        LayerState { ring: vec![0.0; slots * head_dim], window, slots, head_dim, compressor, indexer }
    }

    pub fn push_raw(&mut self, pos: usize, kv: &[f32]) {
        let s = (pos % self.slots) * self.head_dim;
        self.ring[s..s + self.head_dim].copy_from_slice(kv);
    }

    /// The raw row of position `pos` (which must be within the window of the newest one).
    #[inline]
    pub fn raw(&self, pos: usize) -> &[f32] {
        let s = (pos % self.slots) * self.head_dim;
        &self.ring[s..s + self.head_dim]
    }

    /// The ring slot that position `pos` writes.
    pub fn raw_slot_mut(&mut self, pos: usize) -> &mut [f32] {
        let s = (pos % self.slots) * self.head_dim;
        &mut self.ring[s..s + self.head_dim]
    }

    pub fn nbytes(&self) -> usize {
        self.ring.len() * 4
            + self.compressor.as_ref().map_or(0, CompressorState::nbytes)
            + self.indexer.as_ref().map_or(0, CompressorState::nbytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replaying pushes with the emitted rows computed elsewhere (a device) leaves the same
    /// state as pushing with the host's pooling, bit for bit, including batches of many
    /// windows (the device decoder's journal relies on it).
    #[test]
    fn push_computed_replays_push() {
        for (width, ratio, overlap) in [(8, 4, true), (8, 4, false), (4, 2, true), (6, 3, false)] {
            let mut a = CompressorState::new(width, ratio, overlap);
            let mut b = CompressorState::new(width, ratio, overlap);
            let pw = a.proj_width();
            let mut out = vec![0f32; width];
            for pos in 0..41 {
                let kv: Vec<f32> = (0..pw).map(|i| ((pos * 31 + i * 7) % 13) as f32 * 0.25 - 1.0).collect();
                let score: Vec<f32> = (0..pw).map(|i| ((pos * 17 + i * 5) % 11) as f32 * 0.5 - 2.0).collect();
                let emitted = a.push(pos, &kv, &score, &mut out);
                if emitted {
                    a.rows.push(&out);
                }
                b.push_computed(pos, &kv, &score, if emitted { &out } else { &[] });
                assert_eq!(a.cur_kv, b.cur_kv);
                assert_eq!(a.cur_score, b.cur_score);
                assert_eq!(a.prev_kv, b.prev_kv);
                assert_eq!(a.prev_score, b.prev_score);
                assert_eq!(a.rows.len(), b.rows.len());
                assert!(a.rows.iter_values().zip(b.rows.iter_values()).all(|(x, y)| x.to_bits() == y.to_bits()));
            }
            assert_eq!(a.rows.len(), 41 / ratio);
        }
    }
}
