//! Prompt-lookup drafting: guess that the text is about to repeat itself.
//!
//! The drafter takes the last `n` tokens of the history, finds where the same `n` tokens
//! most recently appeared before, and proposes the tokens that came after that occurrence.
//! It tries the longest context first (`n = max_ngram`) and gives up at `min_ngram`: a
//! longer match pins down which earlier passage is being repeated, and among occurrences of
//! the same n-gram the most recent one is the likeliest to continue the same way. No match
//! of at least `min_ngram` tokens means no proposal. Proposals are point masses and cost
//! nothing to compute: they only pay when the target agrees, and the verifier plus the
//! scheduler take care of the rest.
//!
//! The continuation is copied LZ77-style: when the match lies within `max` tokens of the
//! end, the copy runs past the end of the history into the tokens it has just proposed, so a
//! loop of period `p` is extended for `max` tokens instead of stopping after `p`.
//!
//! Defaults: `min_ngram = 2`, `max_ngram = 4`. A 1-gram match ("what followed the last
//! `the`") is a coin toss on prose, and since the scheduler estimates one acceptance rate for
//! everything the drafter offers, such guesses would also talk it out of verifying the good
//! matches. Four tokens are the context ds4's prompt lookup (#396) matches on; longer
//! n-grams rarely change which occurrence is chosen but cost one index entry per token each.
//!
//! Index: a hash map from (n, n-gram) to the end of its latest occurrence among the
//! committed tokens, at most `max_ngram - min_ngram + 1` entries per committed token (16
//! bytes of payload each, a repeated n-gram overwrites its entry), updated in
//! O(`max_ngram`) per token by [`Drafter::observe`] and rebuilt from scratch by
//! [`Drafter::rewind`]. Keys are 64-bit hashes of the n-gram (and its length); a hit is
//! always checked against the history before it is used, so a collision can cost a match
//! but never yields a wrong one, and a stale index (the engine forgot to rewind) can only
//! cost matches. [`Drafter::propose`] receives the committed history plus the pending
//! token(s); n-grams ending among those pending tokens are not indexed and are scanned
//! directly (with one pending token there is nothing to scan: the only unindexed n-gram
//! ending there is the query itself). Everything is deterministic: the hash is fixed and
//! the map is only probed, never iterated.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

use super::drafter::{Draft, Drafter};
use crate::{Error, Result};

/// The longest n-gram [`NgramDrafter`] accepts (per-token indexing work grows with it).
pub const MAX_NGRAM: usize = 64;

/// Prompt-lookup drafter (see the module documentation).
#[derive(Clone, Debug)]
pub struct NgramDrafter {
    min_ngram: usize,
    max_ngram: usize,
    /// (n, n-gram) hash → end (exclusive) of its latest occurrence among indexed tokens.
    index: HashMap<u64, usize, BuildHasherDefault<KeyHasher>>,
    /// The last `max_ngram` indexed tokens (n-grams that straddle two `observe` calls).
    tail: VecDeque<u32>,
    /// How many committed tokens are indexed.
    len: usize,
}

impl NgramDrafter {
    /// Matches of `min_ngram..=max_ngram` tokens; `1 <= min_ngram <= max_ngram <= MAX_NGRAM`.
    pub fn new(min_ngram: usize, max_ngram: usize) -> Result<Self> {
        if min_ngram == 0 || min_ngram > max_ngram || max_ngram > MAX_NGRAM {
            return Err(Error::invalid(format!(
                "n-gram sizes must satisfy 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got {min_ngram} and {max_ngram}"
            )));
        }
        Ok(NgramDrafter {
            min_ngram,
            max_ngram,
            index: HashMap::default(),
            tail: VecDeque::with_capacity(max_ngram + 1),
            len: 0,
        })
    }

    pub fn min_ngram(&self) -> usize {
        self.min_ngram
    }

    pub fn max_ngram(&self) -> usize {
        self.max_ngram
    }

    /// Indexes one committed token.
    fn push(&mut self, token: u32) {
        self.tail.push_back(token);
        if self.tail.len() > self.max_ngram {
            self.tail.pop_front();
        }
        self.len += 1;
        let end = self.len;
        let mut h = SEED;
        for (k, &t) in self.tail.iter().rev().enumerate() {
            let n = k + 1;
            h = step(h, t, n);
            if n >= self.min_ngram {
                self.index.insert(h, end);
            }
        }
    }

    /// End of the latest occurrence of `history[len - n..]` that ends before `len`, if any.
    fn find(&self, history: &[u32], n: usize, key: u64) -> Option<usize> {
        let len = history.len();
        let suffix = &history[len - n..];
        // Ends after the indexed prefix (pending tokens): more recent than anything indexed.
        let lo = (self.len + 1).max(n);
        if let Some(e) = (lo..len).rev().find(|&e| &history[e - n..e] == suffix) {
            return Some(e);
        }
        let &e = self.index.get(&key)?;
        (e >= n && e < len && &history[e - n..e] == suffix).then_some(e)
    }
}

impl Default for NgramDrafter {
    /// 2- to 4-grams (see the module documentation for why).
    fn default() -> Self {
        NgramDrafter::new(2, 4).expect("valid default n-gram sizes")
    }
}

impl Drafter for NgramDrafter {
    fn name(&self) -> &str {
        "ngram"
    }

    fn propose(&mut self, history: &[u32], max: usize) -> Result<Draft> {
        let len = history.len();
        // An earlier occurrence of an n-gram ends at `n` or later, before `len`.
        if max == 0 || len <= self.min_ngram {
            return Ok(Draft::default());
        }
        let top = self.max_ngram.min(len - 1);
        let mut keys = [0u64; MAX_NGRAM + 1];
        let mut h = SEED;
        for n in 1..=top {
            h = step(h, history[len - n], n);
            keys[n] = h;
        }
        for n in (self.min_ngram..=top).rev() {
            if let Some(e) = self.find(history, n, keys[n]) {
                let mut tokens = Vec::with_capacity(max);
                for i in 0..max {
                    // Past the end of the history the copy reads its own output (e < len).
                    let src = e + i;
                    let t = if src < len { history[src] } else { tokens[src - len] };
                    tokens.push(t);
                }
                return Ok(Draft::point(tokens));
            }
        }
        Ok(Draft::default())
    }

    fn observe(&mut self, committed: &[u32]) {
        for &t in committed {
            self.push(t);
        }
    }

    fn rewind(&mut self, history: &[u32]) {
        self.index.clear();
        self.tail.clear();
        self.len = 0;
        self.observe(history);
    }
}

const SEED: u64 = 0x243F_6A88_85A3_08D3;

/// Extends the hash of an n-gram read backwards from its end by its `n`-th token from the
/// end; the position is mixed in, so the hash of a k-gram also encodes k.
#[inline]
fn step(h: u64, token: u32, n: usize) -> u64 {
    splitmix64(h ^ ((n as u64) << 32 | token as u64))
}

#[inline]
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The keys are already well-mixed hashes: use them as they are.
#[derive(Clone, Copy, Debug, Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = splitmix64(self.0 ^ b as u64);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The definition, by brute force: longest n first, then the latest end, LZ77 copy.
    fn reference(history: &[u32], max: usize, min_n: usize, max_n: usize) -> Vec<u32> {
        let len = history.len();
        for n in (min_n..=max_n).rev() {
            if n >= len {
                continue;
            }
            let suffix = &history[len - n..];
            if let Some(e) = (n..len).rev().find(|&e| &history[e - n..e] == suffix) {
                let mut ext = history.to_vec();
                for i in 0..max {
                    ext.push(ext[e + i]);
                }
                return ext[len..].to_vec();
            }
        }
        Vec::new()
    }

    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// A drafter that has seen `committed`, asked about `committed + pending`.
    fn ask(d: &mut NgramDrafter, committed: &[u32], pending: &[u32], max: usize) -> Vec<u32> {
        d.rewind(committed);
        let mut h = committed.to_vec();
        h.extend_from_slice(pending);
        d.propose(&h, max).unwrap().tokens
    }

    #[test]
    fn validation_and_defaults() {
        assert!(matches!(NgramDrafter::new(0, 3), Err(Error::InvalidArgument(_))));
        assert!(matches!(NgramDrafter::new(3, 2), Err(Error::InvalidArgument(_))));
        assert!(matches!(NgramDrafter::new(1, MAX_NGRAM + 1), Err(Error::InvalidArgument(_))));
        assert!(NgramDrafter::new(1, 1).is_ok());
        assert!(NgramDrafter::new(MAX_NGRAM, MAX_NGRAM).is_ok());
        let d = NgramDrafter::default();
        assert_eq!((d.min_ngram(), d.max_ngram(), d.name()), (2, 4, "ngram"));
    }

    #[test]
    fn repetitive_text_gets_long_correct_proposals() {
        let period: Vec<u32> = vec![11, 12, 13, 14, 15, 16, 17];
        let text: Vec<u32> = period.iter().cycle().copied().take(7 * 5 + 3).collect();
        let mut d = NgramDrafter::default();
        let (committed, pending) = text.split_at(text.len() - 1);
        let got = ask(&mut d, committed, pending, 16);
        let want: Vec<u32> = period.iter().cycle().copied().skip(text.len()).take(16).collect();
        assert_eq!(got, want);
        // A single token repeated: the LZ77 copy fills the whole block.
        let mut d = NgramDrafter::new(1, 3).unwrap();
        assert_eq!(ask(&mut d, &[9, 5, 5], &[5], 10), vec![5; 10]);
        // Period 2, found one token before the end.
        let mut d = NgramDrafter::default();
        assert_eq!(ask(&mut d, &[1, 2, 1], &[2], 5), vec![1, 2, 1, 2, 1]);
    }

    #[test]
    fn no_match_no_proposal() {
        let mut d = NgramDrafter::default();
        let text: Vec<u32> = (0..100).collect();
        assert!(ask(&mut d, &text[..99], &text[99..], 8).is_empty());
        // Too short to hold an earlier occurrence of a 2-gram.
        assert!(ask(&mut d, &[4], &[4], 8).is_empty());
        assert!(ask(&mut d, &[], &[4], 8).is_empty());
        // A repeated 1-gram is below the default minimum.
        assert!(ask(&mut d, &[1, 7, 2, 3], &[7], 8).is_empty());
        // max = 0.
        assert!(ask(&mut d, &[1, 2, 3, 1], &[2], 0).is_empty());
    }

    #[test]
    fn prefers_the_longest_match_then_the_latest_occurrence() {
        let mut d = NgramDrafter::new(1, 3).unwrap();
        // "1 2 3" occurred once (→ 50 51); "3" alone occurred later (→ 60).
        let committed = [1, 2, 3, 50, 51, 9, 3, 60, 61, 1, 2];
        assert_eq!(ask(&mut d, &committed, &[3], 2), vec![50, 51]);
        // "2 3" twice: the later one wins.
        let committed = [7, 2, 3, 70, 8, 2, 3, 80, 9, 2];
        assert_eq!(ask(&mut d, &committed, &[3], 2), vec![80, 9]);
        // With 1-grams off, a 1-gram-only match gives nothing.
        let mut d = NgramDrafter::new(2, 3).unwrap();
        assert!(ask(&mut d, &[5, 3, 60, 4], &[3], 2).is_empty());
    }

    #[test]
    fn the_pending_token_completes_a_match() {
        // The index holds the committed tokens only; the n-gram ending at the pending token
        // is the query, and the occurrence ending one token before it is indexed.
        let mut d = NgramDrafter::new(2, 3).unwrap();
        assert_eq!(ask(&mut d, &[5, 6, 7, 8, 5, 6], &[7], 3), vec![8, 5, 6]);
        // Several pending tokens: an occurrence among them is the latest.
        let mut d = NgramDrafter::new(2, 2).unwrap();
        assert_eq!(ask(&mut d, &[1, 2, 10, 3], &[1, 2, 20, 1, 2], 1), vec![20]);
    }

    #[test]
    fn proposals_never_exceed_max() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        let text: Vec<u32> = (0..400).map(|_| rng.below(3) as u32).collect();
        let mut d = NgramDrafter::new(1, 4).unwrap();
        d.rewind(&text[..399]);
        for max in 0..=40 {
            let got = d.propose(&text, max).unwrap();
            assert_eq!(got.tokens.len(), max, "a 3-letter text always matches");
            assert!(got.dists.is_none());
        }
    }

    #[test]
    fn matches_the_brute_force_definition() {
        let mut rng = XorShift(0x1234_5678_9ABC_DEF1);
        for trial in 0..40 {
            let alphabet = 2 + trial % 6;
            let (min_n, max_n) = [(1, 1), (1, 3), (2, 4), (3, 5), (2, 2)][trial as usize % 5];
            let text: Vec<u32> = (0..300).map(|_| rng.below(alphabet) as u32).collect();
            let mut d = NgramDrafter::new(min_n, max_n).unwrap();
            for cut in (1..text.len()).step_by(7) {
                let pending = 1 + rng.below(3) as usize;
                let end = (cut + pending).min(text.len());
                let max = rng.below(MAX_NGRAM as u64) as usize;
                let got = ask(&mut d, &text[..cut], &text[cut..end], max);
                assert_eq!(got, reference(&text[..end], max, min_n, max_n), "trial {trial} cut {cut}");
            }
        }
    }

    #[test]
    fn observe_and_rewind_agree() {
        let mut rng = XorShift(0xDEAD_BEEF_CAFE_F00D);
        for trial in 0..20 {
            let alphabet = 2 + trial % 5;
            let text: Vec<u32> = (0..500).map(|_| rng.below(alphabet) as u32).collect();
            let mut inc = NgramDrafter::default();
            let mut fresh = NgramDrafter::default();
            inc.rewind(&[]);
            let mut at = 0;
            while at < text.len() {
                // Commit a chunk, as a cycle would (pending token plus accepted drafts).
                let n = (1 + rng.below(6) as usize).min(text.len() - at);
                inc.observe(&text[at..at + n]);
                at += n;
                fresh.rewind(&text[..at]);
                if at < text.len() {
                    let history = &text[..at + 1];
                    let max = rng.below(17) as usize;
                    let a = inc.propose(history, max).unwrap();
                    let b = fresh.propose(history, max).unwrap();
                    assert_eq!(a, b, "trial {trial} at {at}");
                    assert_eq!(a.tokens, reference(history, max, 2, 4));
                }
            }
        }
    }

    #[test]
    fn rewinding_to_a_shorter_history_forgets_the_rest() {
        let mut d = NgramDrafter::default();
        d.rewind(&[1, 2, 3, 4, 1, 2, 9]);
        assert_eq!(d.propose(&[1, 2, 3, 4, 1, 2, 9, 1, 2], 2).unwrap().tokens, vec![9, 1]);
        d.rewind(&[1, 2, 3, 4]);
        assert_eq!(d.propose(&[1, 2, 3, 4, 1, 2], 2).unwrap().tokens, vec![3, 4]);
        // Not rewound after a truncation: a stale index may miss, but never proposes a
        // continuation that is not in the history it is given.
        let mut d = NgramDrafter::default();
        d.rewind(&[1, 2, 3, 4, 1, 2, 9, 7, 7]);
        let got = d.propose(&[1, 2, 3, 4, 1, 2], 2).unwrap().tokens;
        assert!(got.is_empty() || got == vec![3, 4]);
    }
}
