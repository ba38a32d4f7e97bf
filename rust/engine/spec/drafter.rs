//! The drafter interface.

use crate::sampling::Distribution;
use crate::session::Session;
use crate::Result;

/// Tokens proposed to follow a history, with the distributions they were drawn from.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// For each token, the draft distribution `q` it was **sampled** from; `None` means
    /// point masses (deterministic proposals such as argmax or lookup). Exact rejection
    /// sampling needs the true `q` of each sampled token.
    pub dists: Option<Vec<Distribution>>,
    /// The drafter's own prediction, per token, of the probability that the target accepts
    /// it given that the previous ones were accepted (DSpark's confidence head). The adaptive
    /// scheduler uses it in place of its measured per-position rates.
    pub survival: Option<Vec<f64>>,
}

impl Draft {
    /// A deterministic proposal.
    pub fn point(tokens: Vec<u32>) -> Self {
        Draft { tokens, dists: None, survival: None }
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

    /// Like [`Drafter::propose`], with the session (at the committed prefix) and the pending
    /// token `anchor` that follows it: model drafters read their state from the session.
    /// `history` is the session's tokens followed by `anchor`.
    fn propose_in(&mut self, _session: &mut Session, history: &[u32], _anchor: u32, max: usize) -> Result<Draft> {
        self.propose(history, max)
    }

    /// The tokens committed by the last cycle, in order (the history grew by them).
    fn observe(&mut self, _committed: &[u32]) {}

    /// Resynchronizes with `history` (after a restore or a failed cycle).
    fn rewind(&mut self, _history: &[u32]) {}

    /// Whether each token of a proposal costs a step of its own (MTP: one block and one
    /// output head a token) and the proposal carries no survival estimates: a cycle then
    /// chooses its block first and asks for that many tokens, rather than drafting the most
    /// and verifying a few of them.
    fn drafts_one_at_a_time(&self) -> bool {
        false
    }
}

/// The model's own drafter (MTP or DSpark), whose state lives in the session.
#[derive(Clone, Debug)]
pub struct ModelDrafter {
    method: &'static str,
    /// Most tokens per proposal (each MTP token costs one block and one output head).
    max: usize,
}

impl ModelDrafter {
    /// A drafter for `session`'s model, which must have a drafter of `method` ("mtp" or
    /// "dspark"), proposing at most `max` tokens per cycle.
    pub fn new(session: &Session, method: &str, max: usize) -> Result<Self> {
        match session.draft_method() {
            Some(m) if m == method => Ok(ModelDrafter { method: m, max }),
            Some(m) => Err(crate::Error::invalid(format!("the model's drafter is {m}, not {method}"))),
            None => Err(crate::Error::invalid(format!(
                "speculative method {method:?} needs a model loaded with its drafter (draft=...)"
            ))),
        }
    }
}

impl Drafter for ModelDrafter {
    fn name(&self) -> &str {
        self.method
    }

    fn propose(&mut self, _history: &[u32], _max: usize) -> Result<Draft> {
        Err(crate::Error::invalid("a model drafter proposes from a session"))
    }

    fn drafts_one_at_a_time(&self) -> bool {
        self.method == "mtp"
    }

    fn propose_in(&mut self, session: &mut Session, _history: &[u32], anchor: u32, max: usize) -> Result<Draft> {
        let p = session.propose_for_verify(anchor, max.min(self.max))?;
        let survival = p.confidence.map(|c| c.iter().map(|&z| 1.0 / (1.0 + (-f64::from(z)).exp())).collect());
        Ok(Draft { tokens: p.tokens, dists: p.dists, survival })
    }
}
