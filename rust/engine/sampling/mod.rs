//! Sampling: logits → a token, with the exact distribution available to speculative decoding.
//!
//! Speculative decoding at temperature > 0 is only exact if its rejection test uses the very
//! distribution the plain sampler draws from, so there is one definition,
//! [`distribution`], and the [`Sampler`] samples from what it returns:
//! `sampler.sample(logits)` is `sampler.sample_from(&sampler.distribution(logits)?)`, token
//! and random draws alike.
//!
//! # The distribution
//!
//! Parameters: [`SamplingParams`] (`temperature`, `top_k`, `top_p`, `min_p`, all `f32` except
//! `top_k`; arithmetic is f64 on the f32 values). With `l` the logits (-inf allowed: a masked
//! token; NaN, +inf, an empty vector or all -inf are errors):
//!
//! 0. **Greedy.** `temperature == 0`: the point mass on the argmax, the lowest id on ties.
//!    The filters below cannot change it (each keeps the argmax), so they are skipped.
//! 1. **Temperature, then softmax weights**: `e_i = exp((l_i - l_max) / T)`. Subtracting the
//!    maximum first keeps every weight in [0, 1] with `e_max = 1` exactly: no overflow for
//!    any `T > 0`. Tokens whose weight is 0 (masked, or underflowed) are dropped: the
//!    distribution lists only tokens of positive probability.
//! 2. **Top-k** (`top_k > 0`): keep the `k` heaviest tokens.
//! 3. **Top-p** (`top_p < 1`): over what top-k kept, renormalized, keep the smallest prefix
//!    of the tokens in order of decreasing probability whose cumulative probability is
//!    `>= top_p`. Precisely: with `Z` the sum of the kept weights in id order, keep the first
//!    `n` in order, where `n` is the smallest with `e_(1) + ... + e_(n) >= top_p * Z` (sums
//!    left to right; all of them if rounding keeps the sum below).
//! 4. **Min-p** (`min_p > 0`): drop tokens with `p_i < min_p * p_max`, i.e. `e_i < min_p`
//!    (a ratio to the maximum, so no renormalization before it changes it).
//! 5. **Renormalize**: `p_i = e_i / Z'` over the survivors, `Z'` summed in id order; a
//!    survivor whose `p_i` rounds to 0 (a weight among the smallest subnormals) is not listed.
//!
//! "Order" (steps 2 and 3) is by weight descending, then by id ascending: every tie is broken
//! towards the lower id, so the result is a deterministic function of the input. Each filter
//! keeps a prefix of that one order, so the result is always a prefix: never empty, always
//! holding the argmax.
//!
//! Why this order: temperature first, then top-k → top-p → min-p, is what vLLM and Hugging
//! Face `transformers` do. Scaling first means the filters act on the distribution that is
//! actually sampled, so `top_p = 0.9` means "90% of the mass you draw from" (the nucleus of
//! Holtzman et al.). Top-k before top-p, with top-p measured on the top-k renormalized
//! distribution, is the order of llama.cpp, vLLM and transformers alike; min-p last is
//! llama.cpp's (putting it before top-p would change the nucleus, since top-p would then
//! measure mass over the min-p survivors). llama.cpp's default chain differs in one respect:
//! it applies the temperature after the filters, so its top-p/min-p sets are those of T = 1;
//! at T = 1 the two agree.
//!
//! # Randomness
//!
//! [`Rng`] is xoshiro256** seeded once from [`SamplingParams::seed`] (see [`rng`]). It is
//! never reseeded: a sampler's stream continues across calls, and `Clone` (or
//! [`Sampler::state`] / [`Sampler::set_state`]) snapshots and restores it. At temperature > 0
//! every sample draws exactly one `next_f64` `u` and inverts the CDF over the ids in id
//! order: the first id whose cumulative probability exceeds `u * total` (`total` = the sum of
//! the probabilities, about 1). At temperature 0 nothing is drawn.

pub(crate) mod filters;
pub mod rng;

pub use filters::distribution;
pub use rng::Rng;

use crate::{Error, Result};

/// How to turn logits into a token. `Default` is plain sampling at temperature 1, seed 0.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature, finite and >= 0; 0 is greedy (argmax, lowest id on ties).
    pub temperature: f32,
    /// Keep the `top_k` most probable tokens; 0 disables the filter.
    pub top_k: usize,
    /// Nucleus: the smallest set of most probable tokens with mass >= `top_p`; in (0, 1], 1
    /// disables the filter.
    pub top_p: f32,
    /// Drop tokens less probable than `min_p` times the most probable; in [0, 1), 0 disables
    /// the filter.
    pub min_p: f32,
    /// Seed of the sampler's random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 1.0, top_k: 0, top_p: 1.0, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0 (the seed is irrelevant and set to 0).
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// Whether this is greedy decoding (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Rejects settings that define no distribution: `Error::InvalidArgument` naming the
    /// parameter, its valid range and the value given.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(Error::invalid(format!("temperature must be a finite number >= 0 (0 means greedy), got {t}")));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(Error::invalid(format!("top_p must be in (0, 1] (1 disables it), got {p}")));
        }
        let m = self.min_p;
        if !(0.0..1.0).contains(&m) {
            return Err(Error::invalid(format!("min_p must be in [0, 1) (0 disables it), got {m}")));
        }
        Ok(())
    }
}

/// A probability distribution over token ids, sparse: the ids of positive probability in
/// increasing order, and their probabilities (f64, summing to 1 up to rounding). Never empty.
#[derive(Clone, Debug, PartialEq)]
pub struct Distribution {
    ids: Vec<u32>,
    probs: Vec<f64>,
}

impl Distribution {
    /// Probability 1 on `id`.
    pub fn point_mass(id: u32) -> Self {
        Distribution { ids: vec![id], probs: vec![1.0] }
    }

    /// The distribution proportional to `weights` (e.g. a rejection-sampling residual):
    /// `ids` strictly increasing, weights finite and >= 0 with a positive sum. Zero weights
    /// are dropped; the rest are divided by their sum (taken in id order).
    pub fn from_weights(ids: Vec<u32>, weights: Vec<f64>) -> Result<Self> {
        if ids.len() != weights.len() {
            return Err(Error::invalid(format!("{} ids but {} weights", ids.len(), weights.len())));
        }
        if let Some(w) = ids.windows(2).find(|w| w[0] >= w[1]) {
            return Err(Error::invalid(format!("ids must be strictly increasing, got {} then {}", w[0], w[1])));
        }
        if let Some(w) = weights.iter().find(|w| !(w.is_finite() && **w >= 0.0)) {
            return Err(Error::invalid(format!("weights must be finite and >= 0, got {w}")));
        }
        let (ids, weights): (Vec<u32>, Vec<f64>) = ids.into_iter().zip(weights).filter(|&(_, w)| w > 0.0).unzip();
        let mut z = 0.0f64;
        for &w in &weights {
            z += w;
        }
        if z == 0.0 {
            return Err(Error::invalid("weights sum to 0: no distribution"));
        }
        // A weight among the smallest subnormals can round to probability 0: dropped too.
        let (ids, probs) = ids.into_iter().zip(weights).map(|(i, w)| (i, w / z)).filter(|&(_, p)| p > 0.0).unzip();
        Ok(Distribution { ids, probs })
    }

    /// Token ids of positive probability, increasing.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Their probabilities, in the same order.
    pub fn probs(&self) -> &[f64] {
        &self.probs
    }

    /// Number of tokens of positive probability (at least 1).
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Always false: a distribution has at least one token.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The probability of `id` (0 outside the support).
    pub fn prob(&self, id: u32) -> f64 {
        self.ids.binary_search(&id).map_or(0.0, |i| self.probs[i])
    }

    /// (id, probability) pairs in id order.
    pub fn iter(&self) -> impl Iterator<Item = (u32, f64)> + '_ {
        self.ids.iter().copied().zip(self.probs.iter().copied())
    }

    /// The most probable id, the lowest on ties.
    pub fn argmax(&self) -> u32 {
        let mut best = 0;
        for i in 1..self.probs.len() {
            if self.probs[i] > self.probs[best] {
                best = i;
            }
        }
        self.ids[best]
    }

    /// Inverse CDF: the first id (in id order) whose cumulative probability exceeds
    /// `u * total`, for `u` in [0, 1).
    fn invert(&self, u: f64) -> u32 {
        let mut total = 0.0f64;
        for &p in &self.probs {
            total += p;
        }
        let target = u * total;
        let mut acc = 0.0f64;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            acc += p;
            if target < acc {
                return id;
            }
        }
        // Only reachable when rounding makes u * total == total: the last interval.
        *self.ids.last().expect("a distribution is never empty")
    }
}

/// The greedy token of `logits` (temperature 0): the argmax, the lowest id on ties. An error
/// for logits that define no distribution (a NaN or +inf, or every logit -inf), as
/// [`distribution`] rejects them.
pub(crate) fn greedy(logits: &[f32]) -> Result<u32> {
    Ok(filters::argmax(logits)?.0 as u32)
}

/// Samples tokens with fixed [`SamplingParams`] and a persistent random stream.
/// `Clone` snapshots it (parameters and stream position).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
}

impl Sampler {
    /// Validates `params` and seeds the stream from `params.seed`, once.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Sampler { params, rng: Rng::seed_from_u64(params.seed) })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The random stream, for draws that must share it (speculative decoding's accept tests).
    pub fn rng_mut(&mut self) -> &mut Rng {
        &mut self.rng
    }

    /// The stream's state, for [`Sampler::set_state`].
    pub fn state(&self) -> [u64; 4] {
        self.rng.state()
    }

    /// Puts the stream back to a state from [`Sampler::state`].
    pub fn set_state(&mut self, state: [u64; 4]) -> Result<()> {
        self.rng = Rng::from_state(state)?;
        Ok(())
    }

    /// The distribution [`Sampler::sample`] draws from for these logits.
    pub fn distribution(&self, logits: &[f32]) -> Result<Distribution> {
        distribution(logits, &self.params)
    }

    /// One token from the filtered distribution of `logits`: the argmax without drawing at
    /// temperature 0, otherwise one draw.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if self.params.is_greedy() {
            return greedy(logits);
        }
        let d = self.distribution(logits)?;
        Ok(self.sample_from(&d))
    }

    /// One token from `dist` by inverse CDF over its ids in id order, with exactly one
    /// `next_f64`. At temperature 0 the sampler is deterministic: it returns `dist.argmax()`
    /// and draws nothing (for a greedy [`Sampler::distribution`], the point mass's id).
    pub fn sample_from(&mut self, dist: &Distribution) -> u32 {
        if self.params.is_greedy() {
            return dist.argmax();
        }
        dist.invert(self.rng.next_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p, seed }
    }

    fn message(p: SamplingParams) -> String {
        match p.validate() {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("{p:?}: expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn impossible_settings_are_rejected_with_clear_messages() {
        let base = SamplingParams::default();
        for t in [-1.0, f32::NAN, f32::INFINITY, -0.001] {
            let m = message(SamplingParams { temperature: t, ..base });
            assert!(m.starts_with("temperature must be a finite number >= 0"), "{m}");
        }
        for p in [0.0, -0.5, 1.5, f32::NAN] {
            let m = message(SamplingParams { top_p: p, ..base });
            assert!(m.starts_with("top_p must be in (0, 1]"), "{m}");
        }
        for m in [-0.1, 1.0, 2.0, f32::NAN] {
            let msg = message(SamplingParams { min_p: m, ..base });
            assert!(msg.starts_with("min_p must be in [0, 1)"), "{msg}");
        }
        assert_eq!(
            message(SamplingParams { temperature: -2.0, ..base }),
            "temperature must be a finite number >= 0 (0 means greedy), got -2"
        );
        assert!(Sampler::new(SamplingParams { top_p: 0.0, ..base }).is_err());
        assert!(distribution(&[0.0], &SamplingParams { min_p: 1.0, ..base }).is_err());
        for ok in [base, SamplingParams::greedy(), params(0.7, 40, 0.95, 0.05, 9), params(1e-6, 1, 1e-6, 0.999, 0)] {
            ok.validate().unwrap();
        }
    }

    #[test]
    fn greedy_takes_the_lowest_argmax_and_draws_nothing() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        let before = s.state();
        assert_eq!(s.sample(&[0.0, 7.0, 7.0, -1.0]).unwrap(), 1);
        assert_eq!(s.sample(&[f32::NEG_INFINITY, 2.0]).unwrap(), 1);
        let d = s.distribution(&[3.0, 1.0, 3.0]).unwrap();
        assert_eq!(d, Distribution::point_mass(0));
        assert_eq!(s.sample_from(&d), 0);
        assert_eq!(s.state(), before, "greedy never touches the stream");
    }

    #[test]
    fn same_seed_same_tokens_and_the_stream_is_not_reseeded() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let p = params(1.0, 0, 1.0, 0.0, 1234);
        let run = |n| {
            let mut s = Sampler::new(p).unwrap();
            (0..n).map(|_| s.sample(&logits).unwrap()).collect::<Vec<u32>>()
        };
        let a = run(200);
        assert_eq!(a, run(200));
        // Not reseeded per call: a fresh sampler per token would repeat the first token.
        assert!(a.iter().any(|&t| t != a[0]));
        let other: Vec<u32> = {
            let mut s = Sampler::new(SamplingParams { seed: 1235, ..p }).unwrap();
            (0..200).map(|_| s.sample(&logits).unwrap()).collect()
        };
        assert_ne!(a, other);
    }

    #[test]
    fn restoring_a_clone_or_state_reproduces_the_continuation() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.4).collect();
        let mut s = Sampler::new(params(0.8, 20, 0.9, 0.01, 5)).unwrap();
        for _ in 0..13 {
            s.sample(&logits).unwrap();
        }
        let snap = s.clone();
        let state = s.state();
        let cont: Vec<u32> = (0..100).map(|_| s.sample(&logits).unwrap()).collect();
        let mut c = snap;
        assert_eq!(cont, (0..100).map(|_| c.sample(&logits).unwrap()).collect::<Vec<_>>());
        s.set_state(state).unwrap();
        assert_eq!(cont, (0..100).map(|_| s.sample(&logits).unwrap()).collect::<Vec<_>>());
        assert!(s.set_state([0; 4]).is_err());
    }

    #[test]
    fn sample_is_sample_from_the_distribution_with_one_draw() {
        let logits: Vec<f32> = (0..64).map(|i| ((i * 13) % 17) as f32 * 0.25).collect();
        let p = params(0.9, 30, 0.95, 0.02, 77);
        let mut a = Sampler::new(p).unwrap();
        let mut b = Sampler::new(p).unwrap();
        let mut r = Rng::seed_from_u64(77);
        for _ in 0..500 {
            let d = b.distribution(&logits).unwrap();
            let t = a.sample(&logits).unwrap();
            assert_eq!(t, b.sample_from(&d));
            assert_eq!(t, d.invert(r.next_f64()), "exactly one next_f64 per sample");
            assert!(d.prob(t) > 0.0);
        }
        assert_eq!(a.state(), r.state());
    }

    #[test]
    fn sampling_frequencies_follow_the_distribution() {
        let logits = [1.0f32, 0.0, 2.0, -1.0, 1.5, f32::NEG_INFINITY];
        let mut s = Sampler::new(params(1.0, 0, 1.0, 0.0, 99)).unwrap();
        let d = s.distribution(&logits).unwrap();
        let n = 200_000;
        let mut counts = [0usize; 6];
        for _ in 0..n {
            counts[s.sample_from(&d) as usize] += 1;
        }
        assert_eq!(counts[5], 0);
        for (id, p) in d.iter() {
            let f = counts[id as usize] as f64 / n as f64;
            // 6 standard deviations at most.
            assert!((f - p).abs() < 6.0 * (p * (1.0 - p) / n as f64).sqrt(), "{id}: {f} vs {p}");
        }
    }

    #[test]
    fn inverse_cdf_intervals() {
        let d = Distribution::from_weights(vec![2, 5, 9], vec![1.0, 0.0, 3.0]).unwrap();
        assert_eq!(d.ids(), [2, 9]);
        assert_eq!(d.probs(), [0.25, 0.75]);
        assert_eq!(d.invert(0.0), 2);
        assert_eq!(d.invert(0.2499), 2);
        assert_eq!(d.invert(0.25), 9);
        assert_eq!(d.invert(1.0 - f64::EPSILON / 2.0), 9);
        assert_eq!(d.prob(5), 0.0);
        assert_eq!(d.argmax(), 9);
    }

    #[test]
    fn quotients_that_round_to_zero_are_not_listed() {
        // exp((1 - 38.25) / 0.05) is the smallest subnormal; over the sum 2 it rounds to 0.
        let p = params(0.05, 0, 1.0, 0.0, 0);
        let d = distribution(&[1.0, 38.25, 38.25], &p).unwrap();
        assert_eq!((d.ids(), d.probs()), (&[1u32, 2][..], &[0.5, 0.5][..]));
        let d = Distribution::from_weights(vec![0, 1, 2], vec![f64::from_bits(1), 1.0, 1.0]).unwrap();
        assert_eq!((d.ids(), d.probs()), (&[1u32, 2][..], &[0.5, 0.5][..]));
    }

    #[test]
    fn from_weights_rejects_what_is_not_a_distribution() {
        assert!(Distribution::from_weights(vec![1, 1], vec![1.0, 1.0]).is_err());
        assert!(Distribution::from_weights(vec![2, 1], vec![1.0, 1.0]).is_err());
        assert!(Distribution::from_weights(vec![1], vec![1.0, 1.0]).is_err());
        assert!(Distribution::from_weights(vec![1], vec![-1.0]).is_err());
        assert!(Distribution::from_weights(vec![1], vec![f64::NAN]).is_err());
        assert!(Distribution::from_weights(vec![1, 2], vec![0.0, 0.0]).is_err());
        assert!(Distribution::from_weights(vec![], vec![]).is_err());
    }
}
