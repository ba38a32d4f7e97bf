//! Decode state: everything that carries from one token to the next.
//!
//! A [`State`] is cheap to snapshot: compressed and indexer rows live in append-only,
//! reference-counted chunks that snapshots share (copy-on-write for the one chunk still
//! being filled), and the bounded parts (raw window rings, compressor frontiers) are copied.
//! Restoring a snapshot makes the state bit-identical to what it was when the snapshot was
//! taken.

mod draft;
mod layer;
mod precision;
mod rows;

pub(crate) use draft::DraftLog;
pub use draft::DraftState;
pub(crate) use layer::CompressorUndo;
pub use layer::{CompressorState, LayerState};
pub use precision::{hadamard, KvPrecision};
pub use rows::RowStore;

use std::sync::Arc;

use crate::model::config::{AttentionKind, ModelConfig};

/// Writes to the layers' state that a device step computed and the host copy has not taken
/// yet ([`State::defer`]).
pub(crate) trait PendingWrites: Send + Sync + std::fmt::Debug {
    /// Makes the writes, in the order the step made them.
    fn apply(&self, layers: &mut [LayerState]);
    /// The rows that made them: (position of the first, rows).
    fn rows(&self) -> (usize, usize);
    /// The writes of the first `keep` rows only, `1 <= keep < rows`.
    fn prefix(&self, keep: usize) -> Arc<dyn PendingWrites>;
}

/// The decode state of one session.
#[derive(Clone, Debug)]
pub struct State {
    /// Number of tokens processed (the position of the next token).
    pub pos: usize,
    /// The token ids processed so far.
    pub tokens: Vec<u32>,
    /// Read and written through [`State::layers`] and [`State::layers_mut`], which first make
    /// the writes still pending.
    layers: Vec<LayerState>,
    /// The last device step's writes to `layers`, not made yet. A device decoder leaves them
    /// here so that the host copies them while the GPU runs the next step (on an H200 about
    /// 0.25 ms of a 9 ms Flash step); every access to `layers` makes them first, and a clone
    /// shares them, so no reader can see the layers without them.
    pending: Option<Arc<dyn PendingWrites>>,
    /// How stored rows are rounded.
    pub precision: KvPrecision,
    /// The model drafter's rows, when the model has a drafter.
    pub draft: Option<DraftState>,
    /// Which device copy of this state is current: the tag a device decoder gave it when it
    /// last wrote it (it keeps the same tag), 0 when the state changed on the host since. A
    /// snapshot carries the tag, so restoring an older one never matches a newer device copy.
    pub(crate) sync: u64,
}

impl State {
    pub fn new(cfg: &ModelConfig, precision: KvPrecision) -> Self {
        let layers = cfg
            .layers
            .iter()
            .map(|l| {
                let hd = cfg.head_dim;
                let (comp, index) = match l.kind {
                    AttentionKind::Sliding => (None, None),
                    AttentionKind::Hca => (Some(CompressorState::new(hd, l.ratio, false)), None),
                    AttentionKind::Csa => (
                        Some(CompressorState::new(hd, l.ratio, true)),
                        Some(CompressorState::new(cfg.index_head_dim, l.ratio, true)),
                    ),
                };
                LayerState::new(cfg.window, hd, comp, index)
            })
            .collect();
        State { pos: 0, tokens: Vec::new(), layers, pending: None, precision, draft: None, sync: 0 }
    }

    /// The layers' state, after the writes still pending.
    pub fn layers(&mut self) -> &[LayerState] {
        self.flush();
        &self.layers
    }

    /// The layers' state to write, after the writes still pending.
    pub fn layers_mut(&mut self) -> &mut [LayerState] {
        self.flush();
        &mut self.layers
    }

    /// Number of layers.
    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// Leaves `writes` to be made at the next access to the layers. The caller has already
    /// advanced `pos` and `tokens` past the rows that made them.
    #[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
    pub(crate) fn defer(&mut self, writes: Arc<dyn PendingWrites>) {
        self.flush();
        self.pending = Some(writes);
    }

    /// Makes the writes still pending, if any.
    pub(crate) fn flush(&mut self) {
        if let Some(w) = self.pending.take() {
            w.apply(&mut self.layers);
        }
    }

    /// Bytes held by the state (shared chunks counted once per state; not the writes still
    /// pending, at most one step's rows).
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(LayerState::nbytes).sum::<usize>()
            + self.tokens.len() * 4
            + self.draft.as_ref().map_or(0, DraftState::nbytes)
    }
}

/// What one batch evaluation overwrote, kept so that the state can be cut back to the state
/// after any prefix of the batch (speculative commit, [`State::keep_prefix`]) or to the state
/// before it (an error half-way, `State::rollback`). For each layer and row: the ring slot
/// the row overwrote and what its compressors' pushes overwrote.
#[derive(Debug)]
pub struct BatchLog {
    pub(crate) pos0: usize,
    pub(crate) n: usize,
    pub(crate) layers: Vec<LayerLog>,
    pub(crate) draft: Option<DraftLog>,
    /// Whether the batch's writes to the layers were left pending in the state
    /// ([`State::defer`]) rather than made and logged: a cut then keeps the pending writes of
    /// the kept rows only, and there is nothing of the layers to undo.
    pub(crate) layers_pending: bool,
}

#[derive(Debug, Default)]
pub(crate) struct LayerLog {
    pub(crate) ring_before: Vec<f32>,
    pub(crate) undo: Vec<(Option<CompressorUndo>, Option<CompressorUndo>)>,
}

impl BatchLog {
    pub(crate) fn new(pos0: usize, n: usize, n_layers: usize) -> Self {
        BatchLog {
            pos0,
            n,
            layers: (0..n_layers).map(|_| LayerLog::default()).collect(),
            draft: None,
            layers_pending: false,
        }
    }

    /// Records, before row `pos` of layer `layer` writes anything, what it will overwrite.
    pub(crate) fn before_row(&mut self, layer: usize, pos: usize, ls: &LayerState) {
        let l = &mut self.layers[layer];
        l.ring_before.extend_from_slice(ls.raw(pos));
        l.undo.push((
            ls.compressor.as_ref().map(|c| CompressorUndo::capture(c, pos)),
            ls.indexer.as_ref().map(|c| CompressorUndo::capture(c, pos)),
        ));
    }
}

impl State {
    /// Cuts the state back to right after the first `keep` rows of the batch that `log`
    /// recorded (which must be the last batch evaluated): bit for bit the state of having
    /// evaluated only those rows.
    pub fn keep_prefix(&mut self, log: BatchLog, keep: usize) -> crate::Result<()> {
        if self.pos != log.pos0 + log.n || keep > log.n || log.layers.len() != self.layers.len() {
            return Err(crate::Error::invalid("keep_prefix: the log is not of the last batch"));
        }
        if log.layers_pending && self.pending.as_ref().map(|p| p.rows()) != Some((log.pos0, log.n)) {
            // (Cannot happen through a session: only a later batch makes them, and it moves the
            // position.)
            return Err(crate::Error::invalid("keep_prefix: the batch's writes were already made"));
        }
        if keep == log.n {
            return Ok(());
        }
        self.undo(log, keep);
        Ok(())
    }

    /// Puts the state back as it was before the batch `log` recorded, after that batch failed
    /// at any point (the rows and layers it had not reached are untouched).
    pub(crate) fn rollback(&mut self, log: BatchLog) {
        self.undo(log, 0);
    }

    /// Undoes every logged row from `keep` on, newest first (a slot written twice ends up
    /// with what it held before the first write), and sets the position to `pos0 + keep`.
    fn undo(&mut self, log: BatchLog, keep: usize) {
        if log.layers_pending {
            // The batch's own writes (checked by `keep_prefix`; a failed batch leaves none):
            // only the kept rows' are made.
            match self.pending.take() {
                Some(p) if p.rows() == (log.pos0, log.n) => self.pending = (keep > 0).then(|| p.prefix(keep)),
                other => self.pending = other,
            }
        } else {
            self.flush();
        }
        self.sync = 0;
        if let (Some(ds), Some(dl)) = (self.draft.as_mut(), log.draft) {
            let cut = log.pos0 + keep;
            let mut rings = ds.rings_mut();
            for (ring, pos, before) in dl.written.iter().rev() {
                if pos + dl.lag >= cut {
                    rings[*ring].raw_slot_mut(*pos).copy_from_slice(before);
                }
            }
            if let DraftState::Mtp { pending, .. } = ds {
                // hs[0] is the pending state before the batch, hs[r + 1] row r's.
                *pending = dl.hs[keep].clone();
            }
        }
        for (ls, ll) in self.layers.iter_mut().zip(log.layers) {
            let hd = ls.head_dim;
            for (r, (comp, index)) in ll.undo.into_iter().enumerate().skip(keep).rev() {
                ls.raw_slot_mut(log.pos0 + r).copy_from_slice(&ll.ring_before[r * hd..(r + 1) * hd]);
                if let (Some(u), Some(c)) = (comp, ls.compressor.as_mut()) {
                    u.restore(c);
                }
                if let (Some(u), Some(c)) = (index, ls.indexer.as_mut()) {
                    u.restore(c);
                }
            }
        }
        self.pos = log.pos0 + keep;
        self.tokens.truncate(self.pos);
    }

    /// A digest of every value of the state (position, tokens, raw rings, frontiers, emitted
    /// rows), for tests that compare states bit for bit.
    pub fn digest(&self) -> u64 {
        if self.pending.is_some() {
            let mut made = self.clone();
            made.flush();
            return made.digest();
        }
        // FNV-1a over the bit patterns.
        let mut h: u64 = 0xcbf29ce484222325;
        let mut eat = |x: u64| {
            for b in x.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x100000001b3);
            }
        };
        eat(self.pos as u64);
        self.tokens.iter().for_each(|&t| eat(u64::from(t)));
        for l in &self.layers {
            l.ring.iter().for_each(|v| eat(u64::from(v.to_bits())));
            for c in [&l.compressor, &l.indexer].into_iter().flatten() {
                for v in [&c.cur_kv, &c.cur_score, &c.prev_kv, &c.prev_score] {
                    v.iter().for_each(|x| eat(u64::from(x.to_bits())));
                }
                eat(c.rows.len() as u64);
                c.rows.iter_values().for_each(|x| eat(u64::from(x.to_bits())));
            }
        }
        if let Some(ds) = &self.draft {
            for ring in ds.rings() {
                ring.ring.iter().for_each(|v| eat(u64::from(v.to_bits())));
            }
            if let DraftState::Mtp { pending, .. } = ds {
                eat(pending.len() as u64);
                pending.iter().for_each(|v| eat(u64::from(v.to_bits())));
            }
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pending writes of raw rows from `pos0`, the same row to every layer.
    #[derive(Debug)]
    struct RawRows {
        pos0: usize,
        rows: Vec<Vec<f32>>,
    }

    impl PendingWrites for RawRows {
        fn apply(&self, layers: &mut [LayerState]) {
            for l in layers {
                for (r, row) in self.rows.iter().enumerate() {
                    l.push_raw(self.pos0 + r, row);
                }
            }
        }

        fn rows(&self) -> (usize, usize) {
            (self.pos0, self.rows.len())
        }

        fn prefix(&self, keep: usize) -> Arc<dyn PendingWrites> {
            Arc::new(RawRows { pos0: self.pos0, rows: self.rows[..keep].to_vec() })
        }
    }

    /// A state with 3 rows pending, as a device step leaves it, and its log.
    fn pending_state() -> (State, BatchLog, Vec<Vec<f32>>) {
        let model = crate::session::tests::tiny_l();
        let mut s = State::new(&model.config, KvPrecision::F32);
        let hd = model.config.head_dim;
        let rows: Vec<Vec<f32>> = (0..3).map(|r| (0..hd).map(|i| (r * hd + i) as f32 + 0.5).collect()).collect();
        let mut log = BatchLog::new(0, 3, s.n_layers());
        s.defer(Arc::new(RawRows { pos0: 0, rows: rows.clone() }));
        log.layers_pending = true;
        s.pos = 3;
        s.tokens = vec![7, 8, 9];
        (s, log, rows)
    }

    /// Pending writes are seen by every reader: the layers, a digest, a clone; a cut makes
    /// only the kept rows' writes; a log whose writes were already made is refused.
    #[test]
    fn pending_writes_are_made_before_any_read() {
        let (mut s, log, rows) = pending_state();
        let (mut made, _, _) = pending_state();
        made.flush();
        assert!(made.pending.is_none());
        assert_eq!(s.digest(), made.digest());
        assert!(s.pending.is_some(), "a digest reads a copy");
        let mut c = s.clone();
        assert_eq!(c.layers()[0].raw(2), &rows[2][..]);
        assert_eq!(c.digest(), made.digest());

        // A cut to one row: rows 1 and 2 are never written.
        s.keep_prefix(log, 1).unwrap();
        assert_eq!((s.pos, s.tokens.clone()), (1, vec![7]));
        let fresh = State::new(&crate::session::tests::tiny_l().config, KvPrecision::F32);
        for (l, f) in s.layers().iter().zip(&fresh.layers) {
            assert_eq!(l.raw(0), &rows[0][..]);
            assert_eq!((l.raw(1), l.raw(2)), (f.raw(1), f.raw(2)));
        }

        // The batch's writes already made (a reader flushed them): the cut cannot be made.
        let (mut s, log, _) = pending_state();
        let before = s.digest();
        s.flush();
        assert!(matches!(s.keep_prefix(log, 1), Err(crate::Error::InvalidArgument(_))));
        assert_eq!(s.digest(), before);
    }
}
