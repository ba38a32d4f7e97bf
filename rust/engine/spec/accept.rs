//! Which drafts the target accepts, and the token that follows.
//!
//! `rows[i]` are the target's logits after row `i` of the verify batch (row 0 is the
//! pending token, row `i` draft `i`), so **row `i − 1` verifies draft `i`** and row `l`
//! gives the bonus token. Every target distribution `p` is the session sampler's own
//! filtered distribution of that row ([`Sampler::distribution`]): the one plain decoding
//! samples from.
//!
//! - Temperature 0: draft `i` is accepted iff it is the argmax of its row (ties to the lowest
//!   id); the token after the accepted prefix is the argmax of the next row. The output is
//!   therefore the plain greedy output, token for token.
//! - Temperature > 0, point-mass drafts (`q` = one-hot): accept with probability `p(d)`; on
//!   rejection sample from `p` with `d` removed, renormalized.
//! - Temperature > 0, sampled drafts with their `q`: accept with probability
//!   `min(1, p(d)/q(d))`; on rejection sample from `(p − q)+`, renormalized (from `p` if
//!   that has no mass).
//! - Every acceptance test and every residual draw takes fresh uniforms from the session's
//!   persistent stream, in order; after a full acceptance the bonus is a plain sample of
//!   the last row. With these rules the emitted tokens are distributed exactly as plain
//!   sampling from the target (Leviathan et al. 2023; Chen et al. 2023).

use rayon::prelude::*;

use crate::sampling::{distribution, Distribution, Sampler};
use crate::spec::Draft;
use crate::{Error, Result};

/// The outcome of verifying a draft block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Drafts accepted (a prefix of the block).
    pub accepted: usize,
    /// The token after the accepted prefix: the correction sampled from the rejecting row,
    /// or the bonus from the last row. It is not evaluated yet.
    pub next: u32,
}

/// Tests `draft` against `rows` (`draft.tokens.len() + 1` rows of `vocab` logits).
pub fn verify(sampler: &mut Sampler, rows: &[f32], vocab: usize, draft: &Draft) -> Result<Verdict> {
    let l = draft.tokens.len();
    if rows.len() != (l + 1) * vocab {
        return Err(Error::invalid(format!("verify: {l} drafts need {} rows of logits", l + 1)));
    }
    if let Some(q) = &draft.dists {
        if q.len() != l {
            return Err(Error::invalid("verify: one draft distribution per draft token"));
        }
    }
    let row = |i: usize| &rows[i * vocab..(i + 1) * vocab];
    let greedy = sampler.params().is_greedy();
    // Above temperature 0 the rows' distributions as many at a time as rayon has threads,
    // from the first row the loop needs (each is a function of its row alone, and an error
    // counts only when the loop reaches its row, as if made there): with a thread a row, a
    // block costs about one row's time instead of the sum, and a block rejected early makes
    // at most a thread's worth of rows it does not read.
    let params = *sampler.params();
    let wave = if greedy { 1 } else { rayon::current_num_threads().max(1) };
    let mut dists: Vec<Option<Result<Distribution>>> = (0..=l).map(|_| None).collect();
    let mut dist_of = |i: usize| -> Result<Distribution> {
        if dists[i].is_none() {
            let end = (i + wave).min(l + 1);
            let made: Vec<Result<Distribution>> =
                (i..end).into_par_iter().map(|j| distribution(row(j), &params)).collect();
            for (slot, d) in dists[i..end].iter_mut().zip(made) {
                *slot = Some(d);
            }
        }
        dists[i].take().unwrap_or_else(|| distribution(row(i), &params))
    };
    for (i, &d) in draft.tokens.iter().enumerate() {
        let p = dist_of(i)?;
        if greedy {
            let best = p.argmax();
            if d != best {
                return Ok(Verdict { accepted: i, next: best });
            }
            continue;
        }
        let u = sampler.rng_mut().next_f64();
        let residual = match &draft.dists {
            None => {
                if u < p.prob(d) {
                    continue;
                }
                without(&p, d)?
            }
            Some(qs) => {
                let q = &qs[i];
                let (pd, qd) = (p.prob(d), q.prob(d));
                if qd > 0.0 && u < (pd / qd).min(1.0) {
                    continue;
                }
                positive_difference(&p, q)?.unwrap_or(p)
            }
        };
        let next = sampler.sample_from(&residual);
        return Ok(Verdict { accepted: i, next });
    }
    let p = dist_of(l)?;
    let next = sampler.sample_from(&p);
    Ok(Verdict { accepted: l, next })
}

/// [`verify`] at temperature 0 from each row's greedy token, `ids[i]` for row `i` (e.g. from
/// [`crate::Session::verify_argmax`]), instead of its logits: the same verdict, since a greedy
/// row's distribution is the point mass on its argmax. Draws nothing.
pub fn verify_greedy(ids: &[u32], draft: &Draft) -> Result<Verdict> {
    let l = draft.tokens.len();
    if ids.len() != l + 1 {
        return Err(Error::invalid(format!("verify: {l} drafts need {} rows of logits", l + 1)));
    }
    if let Some(q) = &draft.dists {
        if q.len() != l {
            return Err(Error::invalid("verify: one draft distribution per draft token"));
        }
    }
    for (i, &d) in draft.tokens.iter().enumerate() {
        if d != ids[i] {
            return Ok(Verdict { accepted: i, next: ids[i] });
        }
    }
    Ok(Verdict { accepted: l, next: ids[l] })
}

/// `p` with `d` removed, renormalized (`p(d) < 1` whenever this is reached: a uniform in
/// [0, 1) is always below 1).
fn without(p: &Distribution, d: u32) -> Result<Distribution> {
    let (ids, probs): (Vec<u32>, Vec<f64>) = p.iter().filter(|&(id, _)| id != d).unzip();
    Distribution::from_weights(ids, probs)
}

/// `max(p − q, 0)` renormalized, or `None` if it has no mass (p == q).
fn positive_difference(p: &Distribution, q: &Distribution) -> Result<Option<Distribution>> {
    let (ids, w): (Vec<u32>, Vec<f64>) =
        p.iter().map(|(id, pp)| (id, (pp - q.prob(id)).max(0.0))).filter(|&(_, w)| w > 0.0).unzip();
    if ids.is_empty() {
        return Ok(None);
    }
    Distribution::from_weights(ids, w).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn sampler(t: f32, seed: u64) -> Sampler {
        Sampler::new(SamplingParams { temperature: t, seed, ..SamplingParams::default() }).unwrap()
    }

    /// Rows whose argmax is `best[i]`.
    fn rows(best: &[u32], vocab: usize) -> Vec<f32> {
        best.iter()
            .flat_map(|&b| (0..vocab).map(move |v| if v as u32 == b { 2.0 } else { (v % 3) as f32 * 0.1 }))
            .collect()
    }

    #[test]
    fn greedy_row_alignment() {
        // Row i-1 verifies draft i: drafts equal to the argmax of the previous row pass.
        let r = rows(&[3, 5, 7, 1], 8);
        let mut s = sampler(0.0, 0);
        assert_eq!(verify(&mut s, &r, 8, &Draft::point(vec![3, 5, 7])).unwrap(), Verdict { accepted: 3, next: 1 });
        assert_eq!(verify(&mut s, &r, 8, &Draft::point(vec![3, 5, 6])).unwrap(), Verdict { accepted: 2, next: 7 });
        assert_eq!(verify(&mut s, &r, 8, &Draft::point(vec![5, 5, 7])).unwrap(), Verdict { accepted: 0, next: 3 });
        // An off-by-one (draft i against row i) would accept this block.
        assert_eq!(verify(&mut s, &r, 8, &Draft::point(vec![5, 7, 1])).unwrap().accepted, 0);
        assert_eq!(verify(&mut s, &r[..8], 8, &Draft::point(vec![])).unwrap(), Verdict { accepted: 0, next: 3 });
        assert!(verify(&mut s, &r, 8, &Draft::point(vec![3])).is_err());
    }

    /// The verdict from the rows' greedy tokens is the verdict from their logits, for blocks
    /// rejected at every depth or accepted whole; the checks are the same.
    #[test]
    fn greedy_ids_give_the_verdict_of_the_logits() {
        let best = [3, 5, 7, 1, 0];
        let r = rows(&best, 8);
        let mut s = sampler(0.0, 0);
        for l in 0..best.len() {
            for wrong in 0..=l {
                let mut d = best[..l].to_vec();
                if wrong < l {
                    d[wrong] = (d[wrong] + 1 + wrong as u32) % 8;
                }
                let draft = Draft::point(d);
                let want = verify(&mut s, &r[..(l + 1) * 8], 8, &draft).unwrap();
                assert_eq!(verify_greedy(&best[..=l], &draft).unwrap(), want, "{l} drafts, wrong at {wrong}");
            }
        }
        assert!(verify_greedy(&best[..2], &Draft::point(vec![3, 5])).is_err());
        let q = Distribution::point_mass(3);
        let draft = Draft { tokens: vec![3, 5], dists: Some(vec![q]), survival: None };
        assert!(verify_greedy(&best[..3], &draft).is_err());
    }

    /// Sampled drafts with their q: min(1, p/q) acceptance and the (p - q)+ residual give
    /// the target's marginal for the first token and, given it, for the second.
    #[test]
    fn sampled_draft_marginals() {
        let vocab = 5;
        let l0: Vec<f32> = vec![0.3, 1.0, -0.5, 0.8, 0.0];
        let l1: Vec<f32> = vec![1.2, -1.0, 0.4, 0.1, 0.9];
        let l2: Vec<f32> = vec![0.0; 5];
        let rows: Vec<f32> = [l0.clone(), l1.clone(), l2].concat();
        let q_logits: Vec<f32> = vec![0.9, 0.2, 0.6, -0.3, 0.1];
        let mut s = sampler(1.0, 7);
        let p0 = s.distribution(&l0).unwrap();
        let p1 = s.distribution(&l1).unwrap();
        let q = s.distribution(&q_logits).unwrap();
        let mut drafting = sampler(1.0, 99);
        let n = 60000;
        let mut first = [0usize; 5];
        let mut second = [0usize; 5];
        let mut n_second = 0;
        for _ in 0..n {
            // Both drafts sampled from q, as exactness requires.
            let d1 = drafting.sample_from(&q);
            let d2 = drafting.sample_from(&q);
            let draft = Draft { tokens: vec![d1, d2], dists: Some(vec![q.clone(), q.clone()]), survival: None };
            let v = verify(&mut s, &rows, vocab, &draft).unwrap();
            let emitted: Vec<u32> = draft.tokens[..v.accepted].iter().copied().chain([v.next]).collect();
            first[emitted[0] as usize] += 1;
            // The second token's law given the first is only p1 when the first was d1 from
            // row 0 (rows are fixed here, not conditioned): count it when d1 was accepted.
            if v.accepted >= 1 {
                n_second += 1;
                second[emitted[1] as usize] += 1;
            }
        }
        for id in 0..5u32 {
            let f = first[id as usize] as f64 / n as f64;
            assert!((f - p0.prob(id)).abs() < 0.01, "first {id}: {f} vs {}", p0.prob(id));
            let f2 = second[id as usize] as f64 / n_second as f64;
            assert!((f2 - p1.prob(id)).abs() < 0.015, "second {id}: {f2} vs {}", p1.prob(id));
        }
    }

    /// Above temperature 0 the rows' distributions are made all at once, but a row's bad
    /// logits fail the verify only when its draft is reached, and the draws are those of a
    /// verify that makes each row's distribution when it gets there.
    #[test]
    fn sampled_rows_fail_only_when_reached_and_draw_the_same() {
        let vocab = 4;
        let good: Vec<f32> = vec![0.0, 3.0, 0.5, -1.0];
        let bad: Vec<f32> = vec![0.0, f32::NAN, 0.5, -1.0];
        let r = [good.clone(), bad.clone(), good.clone()].concat();
        // Draft 0 (id 0, p about 0.05) is rejected at some seeds: row 1 is never reached.
        let (mut rejected, mut failed) = (0, 0);
        for seed in 0..200 {
            let mut s = sampler(1.0, seed);
            match verify(&mut s, &r, vocab, &Draft::point(vec![0, 1])) {
                Ok(v) => {
                    assert_eq!(v.accepted, 0);
                    rejected += 1;
                }
                Err(_) => failed += 1,
            }
        }
        assert!(rejected > 150 && failed > 0, "{rejected} rejected, {failed} failed");
        // The same verdicts and streams as rows verified one at a time.
        let one_at_a_time = |s: &mut Sampler, rows: &[f32], draft: &Draft| -> Verdict {
            for (i, &d) in draft.tokens.iter().enumerate() {
                let p = s.distribution(&rows[i * vocab..(i + 1) * vocab]).unwrap();
                if s.rng_mut().next_f64() >= p.prob(d) {
                    let next = s.sample_from(&without(&p, d).unwrap());
                    return Verdict { accepted: i, next };
                }
            }
            let l = draft.tokens.len();
            let p = s.distribution(&rows[l * vocab..]).unwrap();
            Verdict { accepted: l, next: s.sample_from(&p) }
        };
        let r = [good.clone(), good.clone(), good].concat();
        for seed in 0..50 {
            let (mut a, mut b) = (sampler(0.8, seed), sampler(0.8, seed));
            for draft in [vec![1, 1], vec![2, 0], vec![1, 3]] {
                let draft = Draft::point(draft);
                assert_eq!(verify(&mut a, &r, vocab, &draft).unwrap(), one_at_a_time(&mut b, &r, &draft));
            }
            assert_eq!(a.rng_mut().next_u64(), b.rng_mut().next_u64());
        }
    }

    /// Exact distribution of the first emitted token by enumeration-free Monte Carlo is
    /// tested from Python; here: the point-mass rule's marginal over many seeds.
    #[test]
    fn point_mass_marginal() {
        let vocab = 4;
        let logits: Vec<f32> = vec![0.0, 1.0, 0.5, -1.0];
        let mut r = logits.clone();
        r.extend(&logits);
        let p = sampler(1.0, 0).distribution(&logits).unwrap();
        let n = 40000;
        let mut counts = [0usize; 4];
        let mut s = sampler(1.0, 42);
        for _ in 0..n {
            let v = verify(&mut s, &r, vocab, &Draft::point(vec![2])).unwrap();
            let first = if v.accepted == 1 { 2 } else { v.next };
            counts[first as usize] += 1;
        }
        for id in 0..4u32 {
            let f = counts[id as usize] as f64 / n as f64;
            assert!((f - p.prob(id)).abs() < 0.01, "{id}: {f} vs {}", p.prob(id));
        }
    }
}
