//! Logits → the filtered, renormalized sampling distribution, in the order documented on
//! [the module](super). Everything is computed in f64, in a fixed order of operations, so
//! the result is a pure function of the logits and the parameters (no reassociation: every
//! sum runs in its documented order; only the element-wise weights of long vectors are
//! computed on several threads, which changes no value) and a straightforward
//! reimplementation reproduces it.

use std::cmp::Ordering;

use rayon::prelude::*;

use super::{Distribution, SamplingParams};
use crate::{Error, Result};

/// Lanes of [`first_max`]'s running maxima (a multiple of every SIMD width it may compile to).
const SCAN_LANES: usize = 16;

/// What a sequential scan from index 0 that moves only to a strictly larger value ends on:
/// the first index of the largest value, where a NaN never wins (except at index 0, where the
/// scan starts and which then stays), and 0 for an empty row. Returns the index and its value.
///
/// Computed as the largest value in [`SCAN_LANES`] running maxima, then the first index that
/// holds it: both loops compile to vector compares (the plain scan's next step depends on its
/// last one, so it runs one element at a time). A Flash row of 129280 logits took 11.5 us
/// against 71 for the scan on one core of the build machine, without AVX.
pub(crate) fn first_max(row: &[f32]) -> (usize, f32) {
    match row.first() {
        None => return (0, f32::NAN),
        Some(&v) if v.is_nan() => return (0, v),
        _ => {}
    }
    let mut lanes = [f32::NEG_INFINITY; SCAN_LANES];
    let chunks = row.chunks_exact(SCAN_LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(tail) {
        if v > max {
            max = v;
        }
    }
    // The first chunk holding it (an OR over the whole chunk: no early exit to serialize),
    // then its place there. `max` is one of the row's values, so some chunk holds it.
    for (k, c) in row.chunks(SCAN_LANES).enumerate() {
        if c.iter().fold(false, |any, &v| any | (v == max)) {
            let j = c.iter().position(|&v| v == max).unwrap_or(0);
            return (k * SCAN_LANES + j, row[k * SCAN_LANES + j]);
        }
    }
    (0, row[0])
}

/// The greedy token: the index of the largest logit, the lowest index on ties. Rejects what
/// has no distribution: an empty vector, a NaN or +inf logit, or no finite logit at all
/// (-inf entries are allowed: they are masked tokens). Returns the index and the maximum.
pub(crate) fn argmax(logits: &[f32]) -> Result<(usize, f32)> {
    if logits.is_empty() {
        return Err(Error::invalid("cannot sample from an empty logits vector"));
    }
    if logits.len() > u32::MAX as usize {
        return Err(Error::invalid(format!("{} logits is more than 2^32 - 1 token ids", logits.len())));
    }
    // An OR over the row (vector compares), then the first offender for the message.
    let bad = |l: f32| l.is_nan() | (l == f32::INFINITY);
    if logits.iter().fold(false, |any, &l| any | bad(l)) {
        if let Some((i, l)) = logits.iter().enumerate().find(|(_, l)| bad(**l)) {
            return Err(Error::invalid(format!("logit {i} is {l}: logits must be finite or -inf")));
        }
    }
    let (best, max) = first_max(logits);
    if max == f32::NEG_INFINITY {
        return Err(Error::invalid("every logit is -inf: no token can be sampled"));
    }
    Ok((best, max))
}

/// Sum in the order given, left to right (spelled out: the order is part of the contract).
fn sum_in_order(e: &[f64], ids: &[u32]) -> f64 {
    let mut z = 0.0f64;
    for &i in ids {
        z += e[i as usize];
    }
    z
}

/// The filters' total order: weight descending, then id ascending.
fn by_weight_desc(e: &[f64]) -> impl Fn(&u32, &u32) -> Ordering + '_ {
    move |&a, &b| e[b as usize].total_cmp(&e[a as usize]).then(a.cmp(&b))
}

/// Top-p: reorders `cand` so that its first `n` entries are, in order, the `n` heaviest, and
/// returns the smallest `n` whose running sum (left to right in that order) is `>= threshold`,
/// or None when the whole of `cand` stays below it. Sorts lazily, a growing chunk at a
/// time, since the nucleus is usually a tiny part of a 129k vocabulary; the result is the
/// same as a full sort's because the order is total.
fn nucleus(cand: &mut [u32], e: &[f64], threshold: f64) -> Option<usize> {
    let cmp = by_weight_desc(e);
    let n = cand.len();
    let (mut done, mut chunk, mut acc) = (0usize, 64usize, 0.0f64);
    while done < n {
        let end = (done + chunk).min(n);
        let rest = &mut cand[done..];
        if end < n {
            rest.select_nth_unstable_by(end - done - 1, &cmp);
        }
        rest[..end - done].sort_unstable_by(&cmp);
        for j in done..end {
            acc += e[cand[j] as usize];
            if acc >= threshold {
                return Some(j + 1);
            }
        }
        done = end;
        chunk = chunk.saturating_mul(4);
    }
    None
}

/// Weights past which [`filter_long`] finds the top-k and top-p survivors from the binades of
/// the weights (below it the whole candidate list is cheap to order).
const LONG: usize = 4096;

/// Weights per piece of the parallel passes over a long vector.
const PIECE: usize = 8192;

/// Per binade of the positive weights (the f64 exponent field: weights are in (0, 1], so
/// binades 0, the subnormals, ..= 1023, which holds 1.0), how many there are and their sum
/// (summed piece by piece, so not in id order: it only chooses a bound, with a margin).
struct Binades {
    count: Vec<usize>,
    mass: Vec<f64>,
}

impl Binades {
    const N: usize = 1024;

    fn of(e: &[f64]) -> Self {
        let pieces: Vec<Binades> = e
            .par_chunks(PIECE)
            .map(|piece| {
                let mut h = Binades { count: vec![0; Self::N], mass: vec![0.0; Self::N] };
                for &w in piece.iter().filter(|&&w| w > 0.0) {
                    let b = ((w.to_bits() >> 52) as usize).min(Self::N - 1);
                    h.count[b] += 1;
                    h.mass[b] += w;
                }
                h
            })
            .collect();
        let mut all = Binades { count: vec![0; Self::N], mass: vec![0.0; Self::N] };
        for h in pieces {
            for b in 0..Self::N {
                all.count[b] += h.count[b];
                all.mass[b] += h.mass[b];
            }
        }
        all
    }

    /// The ids (in id order) of the positive weights at or above the lower bound of the
    /// highest binade at which `enough(count, weight)` holds of the weights at or above it;
    /// None if it holds nowhere. Every weight at or above a bound is in it, so it is a prefix
    /// of the filters' order.
    fn prefix(&self, e: &[f64], enough: impl Fn(usize, f64) -> bool) -> Option<Vec<u32>> {
        let (mut c, mut m) = (0usize, 0f64);
        for b in (0..Self::N).rev() {
            if self.count[b] == 0 {
                continue;
            }
            c += self.count[b];
            m += self.mass[b];
            if enough(c, m) {
                // The binade's least value (0 for the subnormals, which then all count).
                let lo = f64::from_bits((b as u64) << 52);
                return Some(ids_where(e, |w| w >= lo && w > 0.0));
            }
        }
        None
    }

    fn total(&self) -> usize {
        self.count.iter().sum()
    }
}

/// The ids, in id order, of the weights for which `keep` holds (pieces on rayon's threads).
fn ids_where(e: &[f64], keep: impl Fn(f64) -> bool + Sync) -> Vec<u32> {
    e.par_chunks(PIECE)
        .enumerate()
        .flat_map_iter(|(p, piece)| {
            let keep = &keep;
            piece.iter().enumerate().filter(move |(_, &w)| keep(w)).map(move |(j, _)| (p * PIECE + j) as u32)
        })
        .collect()
}

/// Steps 2 and 3 (top-k, then top-p over what it kept) on a long vector of weights, the
/// survivors in id order, without ordering every candidate: the binades give the lightest
/// prefix of the filters' order that holds the k heaviest, or whose weight reaches the
/// nucleus' threshold, and only that prefix is ordered. The k heaviest of a prefix with k
/// members, or the nucleus found inside a prefix, are those of all the candidates, because
/// the order is total; so the survivors are the same as [`distribution`]'s plain path's.
/// None when neither filter is on, or the nucleus' running sum does not reach the threshold
/// inside the prefix (rounding): the caller then filters the whole candidate list.
fn filter_long(e: &[f64], k: usize, top_p: f32) -> Option<Vec<u32>> {
    let h = Binades::of(e);
    let mut cand = if k > 0 && k < h.total() {
        let mut c = h.prefix(e, |c, _| c >= k).filter(|c| c.len() >= k)?;
        keep_top_k(&mut c, e, k);
        c
    } else if top_p < 1.0 {
        // Over every candidate: their sum in id order is the sum of all the weights in id
        // order (a zero weight adds nothing).
        let threshold = f64::from(top_p) * e.iter().fold(0.0f64, |z, &w| z + w);
        let mut c = h.prefix(e, |_, m| m >= threshold * (1.0 + 1e-9))?;
        let n = nucleus(&mut c, e, threshold)?;
        c.truncate(n);
        c.sort_unstable();
        return Some(c);
    } else {
        return None;
    };
    if top_p < 1.0 {
        keep_nucleus(&mut cand, e, top_p);
    }
    Some(cand)
}

/// Step 2 on candidates in id order: keeps the `k` heaviest (all of them when there are no
/// more than `k`), in id order.
fn keep_top_k(cand: &mut Vec<u32>, e: &[f64], k: usize) {
    if k > 0 && k < cand.len() {
        cand.select_nth_unstable_by(k - 1, by_weight_desc(e));
        cand.truncate(k);
        cand.sort_unstable();
    }
}

/// Step 3 on candidates in id order: keeps the nucleus of `top_p` of their weight (all of
/// them if rounding keeps the running sum below it), in id order.
fn keep_nucleus(cand: &mut Vec<u32>, e: &[f64], top_p: f32) {
    let threshold = f64::from(top_p) * sum_in_order(e, cand);
    let n = nucleus(cand, e, threshold).unwrap_or(cand.len());
    cand.truncate(n);
    cand.sort_unstable();
}

/// Logits past which [`weights`] computes in parallel.
const PAR_MIN: usize = 16384;

/// `e_i = exp((l_i - max) / t)` for every logit. Each weight is the same operations on its
/// own logit, so computing them on several threads (long vectors: the exponentials are most
/// of a 129k-token distribution's time) changes no value.
fn weights(logits: &[f32], max: f64, t: f64) -> Vec<f64> {
    let w = |l: f32| ((f64::from(l) - max) / t).exp();
    if logits.len() < PAR_MIN {
        return logits.iter().map(|&l| w(l)).collect();
    }
    let mut e = vec![0f64; logits.len()];
    e.par_chunks_mut(PAR_MIN / 2).zip(logits.par_chunks(PAR_MIN / 2)).for_each(|(o, l)| {
        for (o, &l) in o.iter_mut().zip(l) {
            *o = w(l);
        }
    });
    e
}

/// The distribution the sampler draws from: see the module documentation for the exact
/// definition. Greedy parameters (temperature 0) give the point mass on `argmax`.
pub fn distribution(logits: &[f32], params: &SamplingParams) -> Result<Distribution> {
    params.validate()?;
    let (best, max) = argmax(logits)?;
    if params.temperature == 0.0 {
        return Ok(Distribution::point_mass(best as u32));
    }
    // 1. Weights relative to the maximum: e_i = exp((l_i - l_max) / T), so e_max = 1 exactly,
    //    nothing overflows, and -inf logits get weight 0.
    let e = weights(logits, f64::from(max), f64::from(params.temperature));
    let (k, top_p) = (params.top_k, params.top_p);
    let long = if e.len() <= LONG {
        None
    } else if k > 0 || top_p < 1.0 {
        filter_long(&e, k, top_p)
    } else if params.min_p > 0.0 {
        // Min-p alone keeps the weights >= min_p: listed at once, not cut from every candidate.
        Some(ids_where(&e, |w| w >= f64::from(params.min_p)))
    } else {
        None
    };
    let mut cand = match long {
        Some(c) => c,
        None => {
            // Candidates in id order; zero-weight tokens (masked or underflowed) are never
            // candidates.
            let mut cand = if e.len() > LONG {
                ids_where(&e, |w| w > 0.0)
            } else {
                (0..e.len() as u32).filter(|&i| e[i as usize] > 0.0).collect()
            };

            // 2. Top-k.
            keep_top_k(&mut cand, &e, k);
            // 3. Top-p over what top-k kept, renormalized.
            if top_p < 1.0 {
                keep_nucleus(&mut cand, &e, top_p);
            }
            cand
        }
    };

    // 4. Min-p: p_i >= min_p * p_max  <=>  e_i >= min_p (e_max = 1, and the ratio does not
    //    depend on any renormalization).
    if params.min_p > 0.0 {
        let m = f64::from(params.min_p);
        cand.retain(|&i| e[i as usize] >= m);
    }

    // 5. Renormalize (the sum in id order; the quotients, one per token, on rayon's threads
    //    when there are many).
    let z = sum_in_order(&e, &cand);
    let mut probs: Vec<f64> = if cand.len() > LONG {
        cand.par_iter().map(|&i| e[i as usize] / z).collect()
    } else {
        cand.iter().map(|&i| e[i as usize] / z).collect()
    };
    // A weight among the smallest subnormals can still round to probability 0 in its quotient
    // (z >= 1: the heaviest token always survives). Such a token is never drawn (`invert`
    // moves past an interval of length 0), and the distribution lists only tokens of positive
    // probability.
    if probs.contains(&0.0) {
        (cand, probs) = cand.iter().zip(&probs).filter(|&(_, &p)| p > 0.0).map(|(&i, &p)| (i, p)).unzip();
    }
    Ok(Distribution { ids: cand, probs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
        SamplingParams { temperature, top_k, top_p, min_p, seed: 0 }
    }

    fn ids(logits: &[f32], p: SamplingParams) -> Vec<u32> {
        distribution(logits, &p).unwrap().ids().to_vec()
    }

    fn assert_normalized(d: &Distribution) {
        let total: f64 = d.probs().iter().sum();
        assert!((total - 1.0).abs() < 1e-12, "total {total}");
        assert!(d.probs().iter().all(|&p| p > 0.0 && p <= 1.0));
        assert!(d.ids().windows(2).all(|w| w[0] < w[1]), "ids sorted and unique");
    }

    /// The distribution as first written: every weight in one loop, the k heaviest and the
    /// nucleus searched in all the candidates.
    fn plain_distribution(logits: &[f32], p: &SamplingParams) -> Distribution {
        let (best, max) = argmax(logits).unwrap();
        if p.temperature == 0.0 {
            return Distribution::point_mass(best as u32);
        }
        let (max, t) = (f64::from(max), f64::from(p.temperature));
        let e: Vec<f64> = logits.iter().map(|&l| ((f64::from(l) - max) / t).exp()).collect();
        let mut cand: Vec<u32> = (0..logits.len() as u32).filter(|&i| e[i as usize] > 0.0).collect();
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_weight_desc(&e));
            cand.truncate(p.top_k);
            cand.sort_unstable();
        }
        if p.top_p < 1.0 {
            let threshold = f64::from(p.top_p) * sum_in_order(&e, &cand);
            cand.sort_unstable_by(by_weight_desc(&e));
            let mut acc = 0.0;
            let n = cand.iter().position(|&i| {
                acc += e[i as usize];
                acc >= threshold
            });
            cand.truncate(n.map_or(cand.len(), |n| n + 1));
            cand.sort_unstable();
        }
        if p.min_p > 0.0 {
            cand.retain(|&i| e[i as usize] >= f64::from(p.min_p));
        }
        let z = sum_in_order(&e, &cand);
        let probs = cand.iter().map(|&i| e[i as usize] / z).collect();
        Distribution { ids: cand, probs }
    }

    #[test]
    fn large_vocabularies_give_the_plain_definition_bit_for_bit() {
        // 129280 logits (DeepSeek V4's vocabulary): the parallel weights and the filters'
        // narrowed searches, against the definition computed the plain way.
        let mut rng = crate::quant::testutil::Rng(0x2545_f491_4f6c_dd1d);
        let n = 129_280;
        let spread = |rng: &mut crate::quant::testutil::Rng, scale: f32| -> Vec<f32> {
            (0..n).map(|_| scale * (rng.f32() + rng.f32() + rng.f32())).collect()
        };
        let mut rows = vec![spread(&mut rng, 1.0), spread(&mut rng, 4.0), spread(&mut rng, 30.0)];
        // Ties everywhere, masked tokens, one dominant token.
        rows.push((0..n).map(|i| (i % 7) as f32).collect());
        rows.push((0..n).map(|i| if i % 3 == 0 { f32::NEG_INFINITY } else { (i % 101) as f32 * 0.1 }).collect());
        rows.push((0..n).map(|i| if i == 77_777 { 40.0 } else { (i % 13) as f32 * 0.01 }).collect());
        for row in &rows {
            for (t, k, top_p, min_p) in [
                (1.0, 0, 1.0, 0.0),
                (0.8, 0, 0.95, 0.0),
                (0.6, 0, 0.5, 0.0),
                (1.3, 0, 0.999, 0.0),
                (0.8, 40, 1.0, 0.0),
                (1.0, 5000, 1.0, 0.0),
                (0.7, 20, 0.9, 0.0),
                (1.0, 0, 1.0, 0.05),
                (0.9, 0, 0.95, 0.02),
            ] {
                let p = params(t, k, top_p, min_p);
                let (got, want) = (distribution(row, &p).unwrap(), plain_distribution(row, &p));
                assert_eq!(got.ids, want.ids, "{p:?}");
                let bits = |d: &Distribution| d.probs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{p:?}");
            }
        }
    }

    /// The scan [`first_max`] must end where: from index 0, move to a strictly larger value.
    fn scan(row: &[f32]) -> usize {
        let mut best = 0;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] {
                best = i;
            }
        }
        best
    }

    #[test]
    fn first_max_is_the_sequential_scan() {
        let mut rng = crate::quant::testutil::Rng(0x9e37_79b9_7f4a_7c15);
        let mut lens: Vec<usize> = (1..=3 * SCAN_LANES + 1).collect();
        lens.extend([255, 256, 257, 4096, 129_280]);
        for len in lens {
            let mut rows = crate::backend::tests::hard_rows(len, &mut rng);
            // Signed zeros tied at the top, NaN first, the largest value once in every chunk.
            rows.push((0..len).map(|i| if i % 3 == 0 { 0.0 } else { -0.0 }).collect());
            rows.push((0..len).map(|i| if i == 0 { f32::NAN } else { i as f32 }).collect());
            rows.push((0..len).map(|i| (i % SCAN_LANES) as f32).collect());
            for row in rows {
                let (i, v) = first_max(&row);
                assert_eq!(i, scan(&row), "len {len}: {row:?}");
                assert_eq!(v.to_bits(), row[i].to_bits());
            }
        }
        assert_eq!(first_max(&[]).0, 0);
    }

    #[test]
    fn argmax_ties_go_to_the_lowest_id() {
        assert_eq!(argmax(&[1.0, 3.0, 2.0, 3.0]).unwrap(), (1, 3.0));
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0, -5.0]).unwrap(), (1, -5.0));
        assert_eq!(argmax(&[0.0]).unwrap(), (0, 0.0));
    }

    #[test]
    fn logits_without_a_distribution_are_rejected() {
        for bad in [&[][..], &[1.0, f32::NAN], &[f32::INFINITY, 0.0], &[f32::NEG_INFINITY; 3]] {
            let err = distribution(bad, &SamplingParams::default()).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        }
        let msg = distribution(&[0.0, f32::NAN], &SamplingParams::default()).unwrap_err().to_string();
        assert!(msg.contains("logit 1 is NaN"), "{msg}");
    }

    #[test]
    fn greedy_is_a_point_mass_on_the_lowest_argmax() {
        let d = distribution(&[0.5, 2.0, -1.0, 2.0], &SamplingParams::greedy()).unwrap();
        assert_eq!(d.ids(), [1]);
        assert_eq!(d.probs(), [1.0]);
    }

    #[test]
    fn plain_softmax_matches_the_formula() {
        let logits = [1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
        let d = distribution(&logits, &params(1.0, 0, 1.0, 0.0)).unwrap();
        assert_eq!(d.ids(), [0, 1, 2], "-inf is never a candidate");
        let z: f64 = (1..=3).map(|x| (x as f64).exp()).sum();
        for (&id, &p) in d.ids().iter().zip(d.probs()) {
            let want = ((id + 1) as f64).exp() / z;
            assert!((p - want).abs() < 1e-15, "{id}: {p} vs {want}");
        }
        assert_normalized(&d);
        // Temperature 2 flattens: p ∝ exp(l / 2).
        let d = distribution(&logits, &params(2.0, 0, 1.0, 0.0)).unwrap();
        let z: f64 = (1..=3).map(|x| (x as f64 / 2.0).exp()).sum();
        assert!((d.prob(2) - 1.5f64.exp() / z).abs() < 1e-15);
    }

    #[test]
    fn top_k_keeps_the_k_heaviest_ties_to_lower_ids() {
        let logits = [1.0f32, 5.0, 3.0, 5.0, 3.0, 0.0];
        assert_eq!(ids(&logits, params(1.0, 1, 1.0, 0.0)), [1]);
        assert_eq!(ids(&logits, params(1.0, 2, 1.0, 0.0)), [1, 3]);
        assert_eq!(ids(&logits, params(1.0, 3, 1.0, 0.0)), [1, 2, 3], "tie between 2 and 4 goes to 2");
        assert_eq!(ids(&logits, params(1.0, 4, 1.0, 0.0)), [1, 2, 3, 4]);
        assert_eq!(ids(&logits, params(1.0, 6, 1.0, 0.0)), [0, 1, 2, 3, 4, 5]);
        assert_eq!(ids(&logits, params(1.0, 100, 1.0, 0.0)), [0, 1, 2, 3, 4, 5]);
        let d = distribution(&logits, &params(1.0, 3, 1.0, 0.0)).unwrap();
        assert_normalized(&d);
        let (a, b) = (5f64.exp(), 3f64.exp());
        assert!((d.prob(2) - b / (2.0 * a + b)).abs() < 1e-15);
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // Probabilities about 0.5, 0.25, 0.125, 0.125 (the f32 logits round them slightly, so
        // no threshold below sits on a boundary).
        let logits = [0.125f32.ln(), 0.5f32.ln(), 0.125f32.ln(), 0.25f32.ln()];
        let p = |top_p| ids(&logits, params(1.0, 0, top_p, 0.0));
        assert_eq!(p(0.3), [1]);
        assert_eq!(p(0.6), [1, 3]);
        assert_eq!(p(0.8), [0, 1, 3], "the tie at 0.125 goes to the lower id");
        assert_eq!(p(0.95), [0, 1, 2, 3]);
        assert_eq!(p(1.0), [0, 1, 2, 3]);
        let d = distribution(&logits, &params(1.0, 0, 0.8, 0.0)).unwrap();
        assert_normalized(&d);
        assert!((d.prob(1) - 0.5 / 0.875).abs() < 1e-6);
        assert_eq!(d.prob(2), 0.0);
        // Exact boundaries (equal logits: every probability is exactly 1/4): cumulative >= p.
        let flat = [0.0f32; 4];
        assert_eq!(ids(&flat, params(1.0, 0, 0.25, 0.0)), [0]);
        assert_eq!(ids(&flat, params(1.0, 0, 0.5, 0.0)), [0, 1]);
        assert_eq!(ids(&flat, params(1.0, 0, 0.75, 0.0)), [0, 1, 2]);
    }

    #[test]
    fn top_p_applies_to_the_top_k_renormalized_distribution() {
        // After top-2 the kept probabilities are 2/3 and 1/3: top_p 0.6 keeps one token,
        // whereas over the full distribution 0.5 < 0.6 would need two.
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.125f32.ln()];
        assert_eq!(ids(&logits, params(1.0, 2, 0.6, 0.0)), [0]);
        assert_eq!(ids(&logits, params(1.0, 0, 0.6, 0.0)), [0, 1]);
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        let logits = [0.5f32.ln(), 0.25f32.ln(), 0.125f32.ln(), 0.0625f32.ln(), 0.0625f32.ln()];
        let m = |min_p| ids(&logits, params(1.0, 0, 1.0, min_p));
        assert_eq!(m(0.6), [0]);
        assert_eq!(m(0.51), [0]);
        assert_eq!(m(0.49), [0, 1]);
        assert_eq!(m(0.2), [0, 1, 2]);
        assert_eq!(m(0.1), [0, 1, 2, 3, 4]);
        // min-p commutes with top-k (a ratio to the max is unchanged by renormalization).
        assert_eq!(ids(&logits, params(1.0, 2, 1.0, 0.2)), [0, 1]);
        assert_eq!(ids(&logits, params(1.0, 0, 0.7, 0.2)), [0, 1]);
    }

    #[test]
    fn temperature_changes_the_filtered_sets() {
        // Logits 0 and -1: at T=1 the ratio is e^-1 ≈ 0.37, at T=4 it is e^-0.25 ≈ 0.78.
        let logits = [0.0f32, -1.0];
        assert_eq!(ids(&logits, params(1.0, 0, 1.0, 0.5)), [0]);
        assert_eq!(ids(&logits, params(4.0, 0, 1.0, 0.5)), [0, 1]);
        assert_eq!(ids(&logits, params(1.0, 0, 0.7, 0.0)), [0]);
        assert_eq!(ids(&logits, params(4.0, 0, 0.7, 0.0)), [0, 1]);
    }

    #[test]
    fn extreme_temperatures_and_logits_stay_finite() {
        let logits = [3.0e38f32, -3.0e38, 0.0, 1.0];
        let d = distribution(&logits, &params(1e-30, 0, 1.0, 0.0)).unwrap();
        assert_eq!(d.ids(), [0]);
        let d = distribution(&logits, &params(1e38, 0, 1.0, 0.0)).unwrap();
        assert_normalized(&d);
        assert_eq!(d.len(), 4);
        // Weights that underflow to 0 drop out of the support.
        let d = distribution(&[0.0, -1000.0, -1.0], &params(1.0, 0, 1.0, 0.0)).unwrap();
        assert_eq!(d.ids(), [0, 2]);
    }

    #[test]
    fn nucleus_is_the_same_as_a_full_sort_on_a_large_vocabulary() {
        // A vocabulary large enough to go through several lazy chunks, with many ties.
        let n = 5000u32;
        let logits: Vec<f32> = (0..n).map(|i| ((i * 7919) % 613) as f32 / 50.0).collect();
        for top_p in [0.01f32, 0.3, 0.9, 0.999, 0.999_999] {
            let got = ids(&logits, params(1.3, 0, top_p, 0.0));
            // Reference: full sort, then the running sum.
            let t = 1.3f32 as f64;
            let max = logits.iter().cloned().fold(f32::MIN, f32::max) as f64;
            let e: Vec<f64> = logits.iter().map(|&l| ((l as f64 - max) / t).exp()).collect();
            let mut order: Vec<u32> = (0..n).collect();
            order.sort_by(by_weight_desc(&e));
            let all: Vec<u32> = (0..n).collect();
            let threshold = top_p as f64 * sum_in_order(&e, &all);
            let mut acc = 0.0;
            let mut keep = n as usize;
            for (j, &i) in order.iter().enumerate() {
                acc += e[i as usize];
                if acc >= threshold {
                    keep = j + 1;
                    break;
                }
            }
            let mut want = order[..keep].to_vec();
            want.sort_unstable();
            assert_eq!(got, want, "top_p {top_p}");
        }
    }

    #[test]
    fn distributions_sum_to_one() {
        let mut rng = super::super::Rng::seed_from_u64(3);
        for round in 0..200 {
            let n = 1 + (rng.next_u64() % 300) as usize;
            let logits: Vec<f32> = (0..n).map(|_| (rng.next_f64() * 20.0 - 10.0) as f32).collect();
            let p = params(
                [0.1f32, 0.7, 1.0, 2.5][round % 4],
                [0usize, 1, 5, 50][(round / 4) % 4],
                [1.0f32, 0.95, 0.5, 0.1][(round / 16) % 4],
                [0.0f32, 0.05, 0.3][(round / 64) % 3],
            );
            let d = distribution(&logits, &p).unwrap();
            assert_normalized(&d);
            let best = argmax(&logits).unwrap().0 as u32;
            assert!(d.ids().contains(&best), "the argmax survives every filter");
            if p.top_k > 0 {
                assert!(d.len() <= p.top_k);
            }
        }
    }
}
