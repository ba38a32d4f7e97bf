//! Scheduling: how many of the offered drafts to verify in each cycle (0 = plain decoding).
//!
//! [`Policy::Fixed`]`(k)` verifies `min(k, available)` drafts every cycle.
//!
//! [`Policy::Adaptive`]`{ max }` picks `l` in `0..=min(max, available)` each cycle to maximize
//! expected tokens per unit of time, from two online estimates:
//!
//! - **Cost.** `c(n) = T(n) / T(1)`: `T(n)` is a moving average of the seconds the engine
//!   reports for evaluating `n` rows (1 row = a plain decode, `l + 1` = a verify of `l`
//!   drafts). Sizes never measured are estimated: before any verify is timed, `c(n) = n`
//!   (batching assumed to buy nothing; under this prior no block can look profitable, so
//!   nothing is staked on a guess and the first verify timing comes from a probe, below);
//!   between measured sizes, linear interpolation; above the largest measured size `k`,
//!   extrapolation at the mean slope `(c(k) − 1) / (k − 1)`, which over-estimates the usual
//!   concave curve (each extra row costs less than the previous one) and is replaced by a
//!   measurement the first time that size runs.
//! - **Acceptance.** Conditional acceptance per position, `a_j = P(draft j accepted |
//!   drafts 1..j−1 accepted)`, from counts decayed by `GAMMA` per cycle (the last ~10
//!   cycles weigh most). A cycle that verified `l` drafts and accepted `k` has tested
//!   positions `1..=min(k + 1, l)`: the first `k` passed, position `k + 1` failed, deeper ones
//!   were not tested and count for nothing (censored, not rejected). Each `a_j` is shrunk towards the
//!   pooled rate of all positions (`SHRINK` pseudo-tests); the pooled rate is the maximum-
//!   likelihood rate of a geometric model and starts from a prior of 0.5 with the weight of
//!   one test, which decays like the data. Per-position counts let acceptance that falls
//!   with depth (as DSpark's does) be modelled as such where there is data; the pooled rate
//!   fills in positions rarely reached.
//!
//! With survival `s_j = a_1 ⋯ a_j`, a cycle of `l` drafts yields `E(l) = 1 + s_1 + … + s_l`
//! tokens (the target's own token plus the accepted prefix) in time `c(l + 1)`. The policy
//! takes the `l` maximizing `E(l) / c(l + 1)` (the smallest on ties) and verifies only if that
//! beats plain decoding (`E(0) / c(1) = 1`) by `MARGIN` (5%); otherwise it decodes plainly.
//! On repetitive text (`a_j` near 1) `E(l) ≈ l + 1` grows faster than `c(l + 1)` whenever a
//! verify row costs less than a decode, so it takes the full block.
//!
//! **Guard.** Two rules keep speculation from costing more than a bounded amount:
//!
//! 1. *Probes.* While the model says "plain" it sees no outcomes, so it probes: after
//!    `interval` plain cycles it verifies a single draft. A rejected probe doubles the
//!    interval (1, 2, 4, … up to `MAX_PROBE_INTERVAL` = 64); an accepted probe, or any
//!    cycle the model itself chose to speculate, resets it to 1, so returning acceptance (a
//!    copy span starting) is picked up within a few tokens.
//! 2. *Account.* `A`, in plain-decode times from the cost table: a verify cycle adds its gain
//!    over decoding the same tokens plainly, `(1 + accepted) − c(l + 1)`; a plain cycle adds
//!    `CREDIT` = 1/64; `A` is capped at `ACCOUNT_CAP` = 4. The model may speculate only while
//!    `A > −ACCOUNT_FLOOR` (−4); a probe needs `A ≥ 0`.
//!
//! What this guarantees, in modeled time (the cost table's time, not wall-clock):
//! - **Every regime:** a cycle starts only with `A > −4` and loses at most
//!   `L = c(max + 1) − 1`, so `A ≥ −4 − L` always; summing the account, the verify cycles
//!   cost at most `P / 64 + 4 + L` more than plain decoding of the tokens they produced (`P`
//!   plain cycles). Over `N` tokens the time is at most `N · (1 + 1/64) + 4 + L` plain-decode
//!   times: throughput ≥ `1 / (1 + 1/64 + (4 + L) / N)` of plain (≥ 0.98× once
//!   `N ≥ 250 · (4 + L)`), however wrong the acceptance estimates are (the bound is in the
//!   cost table's time, so it assumes the table is accurate).
//! - **Every draft rejected:** the `a_j` fall geometrically towards 0, so within a few
//!   cycles no block beats plain by 5% and the policy decodes plainly, probing after 1, 2,
//!   4, …, 64 plain cycles and from then on once every 64 plain tokens. A rejected probe
//!   emits one token in time `c(2)`, i.e. costs `c(2) − 1`, so the steady state runs at
//!   `65 / (64 + c(2))` of plain: ≥ 0.984× for `c(2) ≤ 2`. If `c(2) > 2` the account spaces
//!   probes further (one per `64 · (c(2) − 1)` plain cycles), keeping the loss ≤ 1/64.
//! - **Speculation that pays:** untouched; the account only binds after a losing streak.
//!
//! The adaptive policy needs [`Scheduler::record_cost`]: without timings every `c(n) = n`
//! and only probes ever verify. The state depends only on the sequence of calls and their
//! arguments: given the same timings and outcomes the decisions are the same (real timings
//! vary from run to run, so real block sizes do; with exact verification the output does
//! not). Costs are measured while the context grows; a ratio whose two averages were taken
//! at different depths lags a little, which the averaging (weight `COST_EMA` per sample, each
//! sample clamped to [½×, 2×] the average to shrug off a stray stall) keeps small.

use super::MAX_DRAFT;
use crate::{Error, Result};

/// How the block size is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Verify `min(k, available)` drafts every cycle.
    Fixed(usize),
    /// Choose `0..=max` each cycle from the measured cost and recent acceptance.
    Adaptive { max: usize },
}

/// Conditional-acceptance decay per recorded cycle.
const GAMMA: f64 = 0.9;
/// Pseudo-tests pulling each position's rate towards the pooled rate.
const SHRINK: f64 = 2.0;
/// Prior acceptance rate and its weight in tests (decays like the data).
const PRIOR_ALPHA: f64 = 0.5;
const PRIOR_WEIGHT: f64 = 1.0;
/// A block must beat plain decoding by this fraction.
const MARGIN: f64 = 0.05;
/// Longest wait between probes, in plain cycles.
const MAX_PROBE_INTERVAL: u32 = 64;
/// Account credit per plain cycle, its cap, and the floor below which the model may not speculate.
const CREDIT: f64 = 1.0 / 64.0;
const ACCOUNT_CAP: f64 = 4.0;
const ACCOUNT_FLOOR: f64 = 4.0;
/// Weight of a new timing in its row count's moving average.
const COST_EMA: f64 = 0.25;
/// Row counts the cost table holds (1 to a verify of `MAX_DRAFT` drafts).
const MAX_ROWS: usize = MAX_DRAFT + 1;

/// Chooses the number of drafts to verify per cycle (see the module documentation).
#[derive(Clone, Debug)]
pub struct Scheduler {
    policy: Policy,
    costs: CostTable,
    acceptance: Acceptance,
    /// Modeled gain of speculation over plain decoding, in plain-decode times.
    account: f64,
    /// Plain cycles between probes, and plain cycles since the last probe.
    probe_interval: u32,
    plain_since_probe: u32,
    /// The last [`Scheduler::block`] was a probe whose outcome is not recorded yet.
    probing: bool,
}

impl Scheduler {
    /// A scheduler for `policy`; the block size (`k` or `max`) must be in `1..=MAX_DRAFT`.
    pub fn new(policy: Policy) -> Result<Self> {
        let (Policy::Fixed(n) | Policy::Adaptive { max: n }) = policy;
        if n == 0 || n > MAX_DRAFT {
            return Err(Error::invalid(format!("the draft block must be in 1..={MAX_DRAFT}, got {n}")));
        }
        Ok(Scheduler {
            policy,
            costs: CostTable::default(),
            acceptance: Acceptance::new(),
            account: 0.0,
            probe_interval: 1,
            plain_since_probe: 0,
            probing: false,
        })
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// How many drafts to verify this cycle, at most `available` (what the drafter offered or
    /// the budget allows); 0 means a plain decode step. Call once per cycle.
    pub fn block(&mut self, available: usize) -> usize {
        self.block_with(available, None)
    }

    /// [`Scheduler::block`] with the drafter's predicted conditional acceptance of each
    /// offered position (DSpark's confidence): the adaptive policy then weighs blocks by the
    /// prediction for this very proposal instead of its measured per-position rates. The
    /// guard (probes, account) is unchanged, so a miscalibrated prediction costs no more
    /// than the bound above.
    pub fn block_with(&mut self, available: usize, predicted: Option<&[f64]>) -> usize {
        match self.policy {
            Policy::Fixed(k) => k.min(available),
            Policy::Adaptive { max } => self.adaptive(max.min(available), predicted),
        }
    }

    /// Whether [`Scheduler::block`] could verify anything with up to `available` drafts (a
    /// block that pays by the measured rates, or a probe that is due), without changing
    /// anything. The generation asks this before drafting, so a drafter whose proposals
    /// cost time (MTP, DSpark) is not run for a cycle that will decode plainly.
    pub fn would_speculate(&self, available: usize) -> bool {
        match self.policy {
            Policy::Fixed(k) => k.min(available) > 0,
            Policy::Adaptive { max } => {
                let limit = max.min(available);
                if limit == 0 {
                    return false;
                }
                let (l, gain) = self.best(limit, None);
                (l > 0 && gain >= 1.0 + MARGIN && self.account > -ACCOUNT_FLOOR)
                    || (self.plain_since_probe >= self.probe_interval && self.account >= 0.0)
            }
        }
    }

    fn adaptive(&mut self, limit: usize, predicted: Option<&[f64]>) -> usize {
        self.probing = false;
        if limit > 0 {
            let (l, gain) = self.best(limit, predicted);
            if l > 0 && gain >= 1.0 + MARGIN && self.account > -ACCOUNT_FLOOR {
                self.probe_interval = 1;
                self.plain_since_probe = 0;
                return l;
            }
            if self.plain_since_probe >= self.probe_interval && self.account >= 0.0 {
                self.plain_since_probe = 0;
                self.probing = true;
                return 1;
            }
        }
        self.plain_since_probe = self.plain_since_probe.saturating_add(1);
        self.account = (self.account + CREDIT).min(ACCOUNT_CAP);
        0
    }

    /// The block in `0..=limit` with the most expected tokens per unit of time, and that rate
    /// relative to plain decoding.
    fn best(&self, limit: usize, predicted: Option<&[f64]>) -> (usize, f64) {
        let mut best = (0, 1.0);
        let (mut tokens, mut survival) = (1.0, 1.0);
        for l in 1..=limit.min(MAX_DRAFT) {
            let a = predicted.and_then(|p| p.get(l - 1)).copied().filter(|a| a.is_finite());
            survival *= a.map_or_else(|| self.acceptance.conditional(l - 1), |a| a.clamp(0.0, 1.0));
            tokens += survival;
            let rate = tokens / self.costs.ratio(l + 1);
            if rate > best.1 {
                best = (l, rate);
            }
        }
        best
    }

    /// The engine evaluated `rows` rows (1: plain decode; `l + 1`: verify of `l` drafts) in
    /// `seconds` (for a verify, the drafter's proposal time included: it is part of what
    /// speculating costs). Non-positive or non-finite timings are ignored.
    pub fn record_cost(&mut self, rows: usize, seconds: f64) {
        self.costs.record(rows, seconds);
    }

    /// A verify cycle tested up to `drafted` drafts and accepted the first `accepted`.
    pub fn record_outcome(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        let accepted = accepted.min(drafted);
        self.acceptance.record(drafted, accepted);
        let gain = (1 + accepted) as f64 - self.costs.ratio(drafted + 1);
        self.account = (self.account + gain).min(ACCOUNT_CAP);
        if std::mem::take(&mut self.probing) {
            self.probe_interval = match accepted {
                0 => (self.probe_interval * 2).min(MAX_PROBE_INTERVAL),
                _ => 1,
            };
        }
    }

    /// Estimated cost of evaluating `rows` rows, in plain-decode times.
    pub fn cost_ratio(&self, rows: usize) -> f64 {
        self.costs.ratio(rows)
    }

    /// Estimated tokens a cycle verifying `l` drafts yields (the target's token included).
    pub fn expected_tokens(&self, l: usize) -> f64 {
        let (mut tokens, mut survival) = (1.0, 1.0);
        for j in 0..l.min(MAX_DRAFT) {
            survival *= self.acceptance.conditional(j);
            tokens += survival;
        }
        tokens
    }
}

/// Moving averages of the time to evaluate `n` rows, `n` in `1..=MAX_ROWS`.
#[derive(Clone, Debug, Default)]
struct CostTable {
    secs: [Option<f64>; MAX_ROWS + 1],
}

impl CostTable {
    fn record(&mut self, rows: usize, seconds: f64) {
        if rows == 0 || rows > MAX_ROWS || !(seconds.is_finite() && seconds > 0.0) {
            return;
        }
        let slot = &mut self.secs[rows];
        *slot = Some(match *slot {
            None => seconds,
            Some(avg) => avg + COST_EMA * (seconds.clamp(0.5 * avg, 2.0 * avg) - avg),
        });
    }

    /// `T(rows) / T(1)`, estimated where not measured (see the module documentation).
    fn ratio(&self, rows: usize) -> f64 {
        let Some(t1) = self.secs[1] else {
            return rows as f64;
        };
        let at = |n: usize| self.secs[n].map(|t| t / t1);
        if rows <= 1 {
            return 1.0;
        }
        if rows <= MAX_ROWS {
            if let Some(c) = at(rows) {
                return c;
            }
        }
        let top = rows.min(MAX_ROWS + 1);
        let lo = (1..top).rev().find(|&n| self.secs[n].is_some()).unwrap_or(1);
        let hi = (top..=MAX_ROWS).find(|&n| self.secs[n].is_some());
        let c_lo = at(lo).unwrap_or(1.0);
        match hi {
            Some(hi) => {
                let c_hi = at(hi).unwrap_or(1.0);
                c_lo + (c_hi - c_lo) * (rows - lo) as f64 / (hi - lo) as f64
            }
            None if lo == 1 => rows as f64,
            None => {
                let slope = ((c_lo - 1.0) / (lo - 1) as f64).max(0.0);
                c_lo + slope * (rows - lo) as f64
            }
        }
    }
}

/// Decayed counts of tested and accepted drafts, per position and pooled.
#[derive(Clone, Debug)]
struct Acceptance {
    tested: [f64; MAX_DRAFT],
    accepted: [f64; MAX_DRAFT],
    pool_tested: f64,
    pool_accepted: f64,
}

impl Acceptance {
    fn new() -> Self {
        Acceptance {
            tested: [0.0; MAX_DRAFT],
            accepted: [0.0; MAX_DRAFT],
            pool_tested: PRIOR_WEIGHT,
            pool_accepted: PRIOR_WEIGHT * PRIOR_ALPHA,
        }
    }

    fn record(&mut self, drafted: usize, accepted: usize) {
        for j in 0..MAX_DRAFT {
            self.tested[j] *= GAMMA;
            self.accepted[j] *= GAMMA;
        }
        self.pool_tested *= GAMMA;
        self.pool_accepted *= GAMMA;
        let tested = (accepted + 1).min(drafted).min(MAX_DRAFT);
        for j in 0..tested {
            self.tested[j] += 1.0;
            if j < accepted {
                self.accepted[j] += 1.0;
            }
        }
        self.pool_tested += tested as f64;
        self.pool_accepted += accepted.min(tested) as f64;
    }

    /// `P(draft j + 1 accepted | drafts 1..=j accepted)`.
    fn conditional(&self, j: usize) -> f64 {
        let pooled = self.pool_accepted / self.pool_tested;
        (self.accepted[j] + SHRINK * pooled) / (self.tested[j] + SHRINK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct XorShift(u64);

    impl XorShift {
        fn uniform(&mut self) -> f64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// Results of a simulated run; time in units of the 1-row cost.
    #[derive(Debug, PartialEq)]
    struct Run {
        tokens: f64,
        time: f64,
        blocks: Vec<usize>,
    }

    impl Run {
        /// Throughput relative to plain decoding.
        fn speedup(&self) -> f64 {
            self.tokens / self.time
        }

        fn share(&self, from: usize, pred: impl Fn(usize) -> bool) -> f64 {
            let tail = &self.blocks[from..];
            tail.iter().filter(|&&l| pred(l)).count() as f64 / tail.len() as f64
        }
    }

    /// Runs `cycles` cycles: `accept(cycle, j)` is the probability that draft `j` (0-based)
    /// is accepted given the earlier ones were, `cost(n)` the seconds `n` rows take.
    fn simulate(
        s: &mut Scheduler,
        cycles: usize,
        accept: impl Fn(usize, usize) -> f64,
        cost: impl Fn(usize) -> f64,
        seed: u64,
    ) -> Run {
        let mut rng = XorShift(seed);
        let mut run = Run { tokens: 0.0, time: 0.0, blocks: Vec::with_capacity(cycles) };
        for i in 0..cycles {
            let l = s.block(MAX_DRAFT);
            assert!(l <= MAX_DRAFT);
            let t = cost(l + 1);
            s.record_cost(l + 1, t);
            let mut k = 0;
            while k < l && rng.uniform() < accept(i, k) {
                k += 1;
            }
            if l > 0 {
                s.record_outcome(l, k);
            }
            run.tokens += (k + 1) as f64;
            run.time += t / cost(1);
            run.blocks.push(l);
        }
        run
    }

    /// The best any fixed block does: `max_l E(l) / c(l + 1)` with the true rates.
    fn oracle(max: usize, accept: impl Fn(usize) -> f64, cost: impl Fn(usize) -> f64) -> (usize, f64) {
        let mut best = (0, 1.0);
        let (mut e, mut s) = (1.0, 1.0);
        for l in 1..=max {
            s *= accept(l - 1);
            e += s;
            let r = e / (cost(l + 1) / cost(1));
            if r > best.1 {
                best = (l, r);
            }
        }
        best
    }

    fn adaptive(max: usize) -> Scheduler {
        Scheduler::new(Policy::Adaptive { max }).unwrap()
    }

    #[test]
    fn validation() {
        for p in [
            Policy::Fixed(0),
            Policy::Fixed(MAX_DRAFT + 1),
            Policy::Adaptive { max: 0 },
            Policy::Adaptive { max: MAX_DRAFT + 1 },
        ] {
            assert!(matches!(Scheduler::new(p), Err(Error::InvalidArgument(_))), "{p:?}");
        }
        for p in [
            Policy::Fixed(1),
            Policy::Fixed(MAX_DRAFT),
            Policy::Adaptive { max: 1 },
            Policy::Adaptive { max: MAX_DRAFT },
        ] {
            assert_eq!(Scheduler::new(p).unwrap().policy(), p);
        }
    }

    #[test]
    fn fixed_policy_takes_what_is_offered_up_to_k() {
        let mut s = Scheduler::new(Policy::Fixed(5)).unwrap();
        for available in 0..=MAX_DRAFT {
            assert_eq!(s.block(available), available.min(5));
            s.record_cost(available.min(5) + 1, 3.0);
            s.record_outcome(available.min(5), 0);
        }
        let run = simulate(&mut s, 200, |_, _| 0.0, |n| n as f64, 1);
        assert!(run.blocks.iter().all(|&l| l == 5));
    }

    #[test]
    fn block_never_exceeds_what_is_available() {
        let mut s = adaptive(MAX_DRAFT);
        let mut rng = XorShift(7);
        for i in 0..3000 {
            let available = (rng.uniform() * 20.0) as usize;
            let l = s.block(available);
            assert!(l <= available.min(MAX_DRAFT));
            s.record_cost(l + 1, 1.0 + 0.05 * l as f64);
            if l > 0 {
                s.record_outcome(l, if i % 500 < 300 { l } else { 0 });
            }
        }
    }

    #[test]
    fn cost_model_priors_interpolation_and_extrapolation() {
        let mut s = adaptive(8);
        // Nothing measured, or only plain decodes: linear.
        assert_eq!(s.cost_ratio(5), 5.0);
        s.record_cost(1, 0.02);
        assert_eq!((s.cost_ratio(1), s.cost_ratio(5)), (1.0, 5.0));
        // One verify size measured: its mean slope beyond it, a line from 1 below it.
        s.record_cost(3, 0.03);
        assert!((s.cost_ratio(3) - 1.5).abs() < 1e-12);
        assert!((s.cost_ratio(2) - 1.25).abs() < 1e-12);
        assert!((s.cost_ratio(7) - 2.5).abs() < 1e-12);
        // A concave curve: extrapolation from the largest size overestimates, as intended.
        s.record_cost(9, 0.05);
        assert!((s.cost_ratio(6) - 2.0).abs() < 1e-12);
        assert!((s.cost_ratio(17) - (2.5 + 8.0 * 1.5 / 8.0)).abs() < 1e-12);
        // Moving averages; junk ignored; a stall is clamped to twice the average.
        s.record_cost(1, f64::NAN);
        s.record_cost(1, -1.0);
        s.record_cost(0, 1.0);
        s.record_cost(MAX_DRAFT + 2, 1.0);
        assert_eq!(s.cost_ratio(1), 1.0);
        s.record_cost(3, 10.0);
        assert!((s.cost_ratio(3) - (0.03 + 0.25 * 0.03) / 0.02).abs() < 1e-12);
    }

    #[test]
    fn all_rejected_converges_to_plain_with_rare_probes() {
        // c(n) = 1 + s (n - 1): c(2) from 1.02 (nearly free verify rows) to 2.0 (none free).
        for slope in [0.02, 0.1, 0.3, 0.6, 1.0] {
            let cost = |n: usize| 0.01 * (1.0 + slope * (n - 1) as f64);
            let mut s = adaptive(MAX_DRAFT);
            let n = 20_000;
            let run = simulate(&mut s, n, |_, _| 0.0, cost, 42);
            assert!(run.speedup() >= 0.98, "slope {slope}: {:.4}", run.speedup());
            // Converged: plain, but for single-draft probes at most every 64 plain tokens.
            assert!(run.share(1000, |l| l == 0) >= 0.98, "slope {slope}");
            assert!(run.blocks[1000..].iter().all(|&l| l <= 1), "slope {slope}");
            let probes: Vec<usize> = (n / 2..n).filter(|&i| run.blocks[i] == 1).collect();
            assert!(probes.windows(2).all(|w| w[1] - w[0] > MAX_PROBE_INTERVAL as usize), "slope {slope}");
            let tail = &run.blocks[n / 2..];
            let time: f64 = tail.iter().map(|&l| cost(l + 1) / cost(1)).sum();
            let steady = tail.len() as f64 / time;
            assert!(steady >= 65.0 / (64.0 + cost(2) / cost(1)) - 1e-3, "slope {slope}: {steady}");
            assert!(steady >= 0.984, "slope {slope}: {steady}");
        }
        // Only rejections from the first cycle: never more than a single draft.
        let mut s = adaptive(MAX_DRAFT);
        let run = simulate(&mut s, 500, |_, _| 0.0, |n| 1.0 + 0.1 * n as f64, 3);
        assert!(run.blocks.iter().all(|&l| l <= 1), "{:?}", &run.blocks[..50]);
    }

    #[test]
    fn repetitive_text_takes_the_full_block() {
        let cost = |n: usize| 1.0 + 0.1 * n as f64;
        for (max, alpha, share) in [(8, 0.95, 0.9), (5, 0.95, 0.95), (16, 0.99, 0.9), (16, 1.0, 0.99)] {
            let mut s = adaptive(max);
            let run = simulate(&mut s, 3000, |_, _| alpha, cost, 5);
            assert!(run.share(500, |l| l == max) >= share, "max {max} alpha {alpha}: {}", run.share(500, |l| l == max));
            let (_, best) = oracle(max, |_| alpha, cost);
            assert!(run.speedup() >= 0.95 * best, "max {max} alpha {alpha}: {} vs {best}", run.speedup());
        }
        // Where 12..16 are all within 1% of each other, it stays in that flat top.
        let mut s = adaptive(16);
        let run = simulate(&mut s, 3000, |_, _| 0.95, cost, 6);
        assert!(run.share(500, |l| l >= 10) >= 0.9);
        assert!(run.speedup() >= 0.93 * oracle(16, |_| 0.95, cost).1);
    }

    #[test]
    fn low_acceptance_without_batching_benefit_is_plain() {
        // CPU-like: a row costs a decode. Nothing can win; probes stay within the guard.
        // At 30% acceptance it decodes plainly; at higher rates accepted probes come more
        // often (they break even: 2 tokens for c(2) = 2) but never a longer block.
        for (alpha, plain) in [(0.3, 0.95), (0.7, 0.8), (0.9, 0.8)] {
            let mut s = adaptive(MAX_DRAFT);
            let run = simulate(&mut s, 20_000, |_, _| alpha, |n| n as f64, 11);
            assert!(run.share(1000, |l| l == 0) >= plain, "alpha {alpha}: {}", run.share(1000, |l| l == 0));
            assert!(run.blocks.iter().all(|&l| l <= 1), "alpha {alpha}");
            assert!(run.speedup() >= 0.98, "alpha {alpha}: {}", run.speedup());
        }
        // Half-price rows but 30% acceptance: not worth it either (E(1) / c(2) = 1.3 / 1.5).
        // Accepted probes gain here and reset the probe interval, so probes are more
        // frequent; the account holds their net loss to its budget.
        let mut s = adaptive(MAX_DRAFT);
        let run = simulate(&mut s, 20_000, |_, _| 0.3, |n| 1.0 + 0.5 * (n - 1) as f64, 12);
        assert!(run.share(1000, |l| l == 0) >= 0.9, "{}", run.share(1000, |l| l == 0));
        assert!(run.blocks[1000..].iter().all(|&l| l <= 1));
        assert!(run.speedup() >= 0.98, "{}", run.speedup());
    }

    #[test]
    fn moderate_regimes_pick_the_middle() {
        // (acceptance by position, cost) cases whose best fixed block is strictly inside.
        let geometric = |a: f64| move |_: usize| a;
        let dspark = |j: usize| [0.9, 0.75, 0.6, 0.45, 0.3, 0.2, 0.1][j.min(6)];
        type Rates = Box<dyn Fn(usize) -> f64>;
        let cases: Vec<(Rates, f64)> = vec![
            (Box::new(geometric(0.6)), 0.25),
            (Box::new(geometric(0.8)), 0.2),
            (Box::new(geometric(0.7)), 0.1),
            (Box::new(dspark), 0.15),
            (Box::new(dspark), 0.4),
        ];
        for (i, (accept, slope)) in cases.iter().enumerate() {
            let cost = |n: usize| 1.0 + slope * (n - 1) as f64;
            let (l_best, best) = oracle(MAX_DRAFT, accept, cost);
            assert!(l_best > 0 && l_best < MAX_DRAFT, "case {i}: oracle {l_best}");
            let mut s = adaptive(MAX_DRAFT);
            let run = simulate(&mut s, 6000, |_, j| accept(j), cost, 100 + i as u64);
            let near = run.share(1000, |l| l + 2 >= l_best && l <= l_best + 2);
            let mean = run.blocks[1000..].iter().sum::<usize>() as f64 / 5000.0;
            assert!(near >= 0.7, "case {i}: best {l_best}, {near} near it, mean {mean}");
            assert!(run.speedup() >= 0.93 * best, "case {i}: {} vs {best} (l = {l_best})", run.speedup());
        }
    }

    #[test]
    fn recovers_when_acceptance_returns() {
        let cost = |n: usize| 1.0 + 0.1 * n as f64;
        let mut s = adaptive(8);
        let switch = 3000;
        let run = simulate(&mut s, switch + 400, |i, _| if i < switch { 0.0 } else { 0.97 }, cost, 9);
        assert!(run.blocks[switch - 500..switch].iter().all(|&l| l <= 1));
        // The next probe (≤ 64 tokens away) starts it; a few cycles more reach the full block.
        let first = (switch..run.blocks.len()).find(|&i| run.blocks[i] == 8).expect("recovered");
        assert!(first - switch <= 64 + 20, "took {} cycles", first - switch);
        assert!(run.share(switch + 200, |l| l == 8) >= 0.9);
        // And back: acceptance gone again, it returns to plain.
        let mut s2 = adaptive(8);
        let run = simulate(&mut s2, 2000, |i, _| if i < 1000 { 0.97 } else { 0.0 }, cost, 10);
        assert!(run.share(1100, |l| l == 0) >= 0.97);
    }

    #[test]
    fn account_bounds_the_loss_when_the_model_is_wrong() {
        // Acceptance that flips every 3 cycles between certain and impossible fools a
        // moving average; the modeled loss stays within the guard.
        for slope in [0.1, 0.5, 1.0] {
            let mut s = adaptive(MAX_DRAFT);
            let run = simulate(
                &mut s,
                20_000,
                |i, _| if i % 6 < 3 { 1.0 } else { 0.0 },
                |n| 1.0 + slope * (n - 1) as f64,
                13,
            );
            assert!(run.speedup() >= 0.98, "slope {slope}: {}", run.speedup());
        }
    }

    #[test]
    fn noisy_timings_still_work() {
        let rng = std::cell::RefCell::new(XorShift(77));
        let noisy = |n: usize| (1.0 + 0.1 * n as f64) * (0.9 + 0.2 * rng.borrow_mut().uniform());
        let mut s = adaptive(8);
        let run = simulate(&mut s, 3000, |_, _| 0.95, noisy, 14);
        assert!(run.share(500, |l| l >= 7) >= 0.9);
        let mut s = adaptive(8);
        let run = simulate(&mut s, 5000, |_, _| 0.0, noisy, 15);
        assert!(run.share(1000, |l| l == 0) >= 0.98);
    }

    #[test]
    fn deterministic() {
        let cost = |n: usize| 1.0 + 0.3 * n as f64;
        let accept = |i: usize, _: usize| 0.2 + 0.7 * ((i / 300) % 2) as f64;
        let a = simulate(&mut adaptive(MAX_DRAFT), 3000, accept, cost, 21);
        let b = simulate(&mut adaptive(MAX_DRAFT), 3000, accept, cost, 21);
        assert_eq!(a, b);
        assert!(a.blocks.iter().any(|&l| l > 1) && a.blocks.contains(&0));
    }

    #[test]
    fn predicted_survival_replaces_the_measured_rates() {
        // Costs known: a verify row costs 0.3 of a decode.
        let mut s = Scheduler::new(Policy::Adaptive { max: 5 }).unwrap();
        for n in 1..=6 {
            s.record_cost(n, 1.0 + 0.3 * (n - 1) as f64);
        }
        // The drafter is sure of the first three tokens and not of the rest: a block of 3.
        assert_eq!(s.block_with(5, Some(&[0.99, 0.99, 0.99, 0.05, 0.05])), 3);
        // The drafter predicts no survival: plain decoding (the probe budget aside, the
        // prediction alone never pays for a verify).
        let mut t = s.clone();
        t.probe_interval = MAX_PROBE_INTERVAL;
        assert_eq!(t.block_with(5, Some(&[0.01; 5])), 0);
        // Non-finite predictions fall back to the measured rates; the result is in range.
        assert!(s.block_with(5, Some(&[f64::NAN; 5])) <= 5);
        // Fixed policies ignore predictions.
        let mut f = Scheduler::new(Policy::Fixed(4)).unwrap();
        assert_eq!(f.block_with(5, Some(&[0.0; 5])), 4);
    }

    #[test]
    fn would_speculate_agrees_with_block() {
        // Through cost learning, acceptance runs, rejection streaks and probes: asking first
        // never changes what block() decides.
        let mut s = Scheduler::new(Policy::Adaptive { max: 6 }).unwrap();
        let mut rng = XorShift(7);
        for i in 0..3000 {
            let available = 1 + i % 7;
            let asked = s.would_speculate(available);
            let l = s.block(available);
            assert_eq!(asked, l > 0, "cycle {i}");
            s.record_cost(l + 1, 1.0 + 0.4 * l as f64);
            let rate = if (i / 300) % 2 == 0 { 0.9 } else { 0.05 };
            let mut k = 0;
            while k < l && rng.uniform() < rate {
                k += 1;
            }
            s.record_outcome(l, k);
        }
        assert!(!Scheduler::new(Policy::Fixed(3)).unwrap().would_speculate(0));
    }
}
