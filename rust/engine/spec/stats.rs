//! Speculation counters, named as vLLM and mistral.rs name them.

/// Counters of one generation.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Cycles that verified at least one draft token.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Draft tokens accepted.
    pub num_accepted_tokens: u64,
    /// `accepted_per_pos[i]`: cycles whose draft `i + 1` was accepted.
    pub accepted_per_pos: Vec<u64>,
    /// Cycles run without drafting (the scheduler chose plain decoding).
    pub num_plain_steps: u64,
}

impl SpecStats {
    /// Records one verify cycle that tested `drafted` tokens and accepted the first `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            self.num_plain_steps += 1;
            return;
        }
        self.num_drafts += 1;
        self.num_draft_tokens += drafted as u64;
        self.num_accepted_tokens += accepted as u64;
        if self.accepted_per_pos.len() < drafted {
            self.accepted_per_pos.resize(drafted, 0);
        }
        for c in &mut self.accepted_per_pos[..accepted] {
            *c += 1;
        }
    }

    /// Accepted over verified draft tokens.
    pub fn acceptance_rate(&self) -> f64 {
        if self.num_draft_tokens == 0 {
            0.0
        } else {
            self.num_accepted_tokens as f64 / self.num_draft_tokens as f64
        }
    }

    /// Tokens committed per verify cycle, counting the target's own token: `1 + accepted / drafts`.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.num_drafts == 0 {
            1.0
        } else {
            1.0 + self.num_accepted_tokens as f64 / self.num_drafts as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        let mut s = SpecStats::default();
        s.record(3, 2);
        s.record(2, 0);
        s.record(0, 0);
        assert_eq!((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_plain_steps), (2, 5, 2, 1));
        assert_eq!(s.accepted_per_pos, vec![1, 1, 0]);
        assert!((s.acceptance_rate() - 0.4).abs() < 1e-12);
        assert!((s.mean_accepted_length() - 2.0).abs() < 1e-12);
    }
}
