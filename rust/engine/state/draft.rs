//! The drafter's part of a session's state: its window rings of committed, target-derived
//! rows. It lives in the session's [`super::State`] so that snapshots, restores and the
//! speculative commit ([`super::State::keep_prefix`]) treat it exactly like the target's.

use super::layer::LayerState;

/// What a model drafter carries from one token to the next.
#[derive(Clone, Debug)]
pub enum DraftState {
    /// MTP: the block's K=V ring and the trunk's final HC state of the last evaluated
    /// position, which waits for the next token to form its pair.
    ///
    /// MTP rows lag the trunk by one position: row `t` pairs `h_t` with `x_{t+1}`, so after
    /// the trunk has evaluated positions `0..pos` the ring holds rows `0..pos-1` and
    /// `pending` is `h_{pos-1}` (empty before the first token).
    Mtp { ring: Box<LayerState>, pending: Vec<f32> },
    /// DSpark: one ring per stage of `kv_norm_s(wkv_s(main_x_p))` rows, one per committed
    /// position `p`.
    DSpark { rings: Vec<LayerState> },
}

impl DraftState {
    pub fn nbytes(&self) -> usize {
        match self {
            DraftState::Mtp { ring, pending } => ring.nbytes() + pending.len() * 4,
            DraftState::DSpark { rings } => rings.iter().map(LayerState::nbytes).sum(),
        }
    }

    pub(crate) fn rings(&self) -> Vec<&LayerState> {
        match self {
            DraftState::Mtp { ring, .. } => vec![&**ring],
            DraftState::DSpark { rings } => rings.iter().collect(),
        }
    }

    /// Trunk rows after which every slot of every ring holds a row written after them: the
    /// rings' slots, one more for MTP's lag (its rows pair `h_t` with the next token). A
    /// prompt's rows before its last `refill_rows` can skip the drafter (a device call of more
    /// rows than [`crate::backend::DeviceDecoder::draft_rows`]) and leave the same state.
    pub(crate) fn refill_rows(&self) -> usize {
        let slots = self.rings().iter().map(|r| r.slots).max().unwrap_or(0);
        match self {
            DraftState::Mtp { .. } => slots + 1,
            DraftState::DSpark { .. } => slots,
        }
    }

    pub(crate) fn rings_mut(&mut self) -> Vec<&mut LayerState> {
        match self {
            DraftState::Mtp { ring, .. } => vec![&mut **ring],
            DraftState::DSpark { rings } => rings.iter_mut().collect(),
        }
    }
}

/// What a batch did to the drafter state, to cut it back to a prefix of the batch.
#[derive(Debug, Default)]
pub(crate) struct DraftLog {
    /// `(ring, position, slot contents it overwrote)` for every row written, in order.
    pub(crate) written: Vec<(usize, usize, Vec<f32>)>,
    /// How far the drafter's rows lag the trunk's (1 for MTP, 0 for DSpark): the row at
    /// position `p` belongs to the trunk row `p + lag`.
    pub(crate) lag: usize,
    /// MTP: `pending` before the batch, then `h` of each row of the batch.
    pub(crate) hs: Vec<Vec<f32>>,
}
