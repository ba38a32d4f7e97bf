//! Speculative decoding: drafters propose tokens, one batched target pass verifies them,
//! and the accepted prefix is committed.
//!
//! The pieces, each in its own file:
//! - [`drafter`]: the [`Drafter`] trait, [`Draft`], and [`ModelDrafter`], which proposes with
//!   the model's own MTP or DSpark drafter (weights in `model::draft`, computation in
//!   `model::drafting`, state in the session next to the target's so commits and restores
//!   cover it);
//! - [`ngram`]: prompt-lookup drafting from the history, no weights;
//! - [`accept`]: which drafts the target accepts and what token follows (greedy, or exact
//!   rejection sampling at temperature > 0);
//! - [`schedule`]: how many tokens to draft, from a measured cost model and recent acceptance;
//! - [`stats`]: counters reported on every generation.
//!
//! The cycle (the "folded" shape: the pending token is row 0 of the verify batch), as run by
//! [`crate::generate::Generation`]:
//! 1. `a` is the pending token: sampled from the target's last logits, not yet evaluated.
//! 2. The drafter proposes `d1..dl` to follow `history + [a]`.
//! 3. The session evaluates `[a, d1..dl]` as one batch. Row `i` holds the logits after
//!    `d_i` (row 0 after `a`): **row i−1 verifies draft i**, row `l` gives the bonus.
//! 4. Drafts are tested in order and the first rejection stops the cycle; the token that
//!    follows (the correction from the rejecting row, or the bonus) is sampled from that row
//!    and becomes the next pending token. It has no state row yet: it is evaluated as row 0
//!    of the next cycle, never committed from a row computed for another token.
//! 5. The session keeps the state after rows `0..=k` (`k` accepted drafts) and drops the
//!    rest. Rows are batch-invariant, so this state is bit for bit the state of decoding
//!    `a, d1..dk` one at a time: nothing is replayed.

pub mod accept;
pub mod drafter;
pub mod ngram;
pub mod schedule;
pub mod stats;

pub use drafter::{Draft, Drafter, ModelDrafter};
pub use stats::SpecStats;

/// Most tokens one cycle may draft. The session's raw window rings keep this many extra
/// slots so that rejected rows never overwrite a row a committed position still needs.
pub const MAX_DRAFT: usize = 16;
