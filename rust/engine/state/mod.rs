//! Decode state: everything that carries from one token to the next.
//!
//! A [`State`] is cheap to snapshot: compressed and indexer rows live in append-only,
//! reference-counted chunks that snapshots share (copy-on-write for the one chunk still
//! being filled), and the bounded parts (raw window rings, compressor frontiers) are copied.
//! Restoring a snapshot makes the state bit-identical to what it was when the snapshot was
//! taken.

mod layer;
mod precision;
mod rows;

pub use layer::{CompressorState, LayerState};
pub use precision::{hadamard, KvPrecision};
pub use rows::RowStore;

use crate::model::config::{AttentionKind, ModelConfig};

/// The decode state of one session.
#[derive(Clone, Debug)]
pub struct State {
    /// Number of tokens processed (the position of the next token).
    pub pos: usize,
    /// The token ids processed so far.
    pub tokens: Vec<u32>,
    pub layers: Vec<LayerState>,
    /// How stored rows are rounded.
    pub precision: KvPrecision,
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
        State { pos: 0, tokens: Vec::new(), layers, precision }
    }

    /// Bytes held by the state (shared chunks counted once per state).
    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(LayerState::nbytes).sum::<usize>() + self.tokens.len() * 4
    }
}
