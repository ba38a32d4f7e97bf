//! The drafter interface.

use crate::sampling::Distribution;
use crate::Result;

/// Tokens proposed to follow a history, with the distributions they were drawn from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// For each token, the draft distribution `q` it was **sampled** from; `None` means
    /// point masses (deterministic proposals such as argmax or lookup). Exact rejection
    /// sampling needs the true `q` of each sampled token.
    pub dists: Option<Vec<Distribution>>,
}

impl Draft {
    /// A deterministic proposal.
    pub fn point(tokens: Vec<u32>) -> Self {
        Draft { tokens, dists: None }
    }
}

/// Something that proposes continuations.
///
/// The engine calls [`Drafter::propose`] with the full committed history followed by the
/// pending token, then [`Drafter::observe`] with what the cycle committed. After a failed
/// cycle or a session restore it calls [`Drafter::rewind`] with the history as it now is;
/// a drafter whose state is a function of the history rebuilds it from there.
pub trait Drafter: Send {
    /// A short name for stats and errors ("ngram", "python", ...).
    fn name(&self) -> &str;

    /// Up to `max` tokens to follow `history` (fewer or none is fine).
    fn propose(&mut self, history: &[u32], max: usize) -> Result<Draft>;

    /// The tokens committed by the last cycle, in order (the history grew by them).
    fn observe(&mut self, _committed: &[u32]) {}

    /// Resynchronizes with `history` (after a restore or a failed cycle).
    fn rewind(&mut self, _history: &[u32]) {}
}
