//! The sampler's random number generator: xoshiro256** (Blackman and Vigna, 2018), seeded
//! through SplitMix64.
//!
//! Why this one: it is small (four `u64`s of state, a dozen lines), fast, passes BigCrush and
//! PractRand, has a published reference implementation (<https://prng.di.unimi.it/>) that the
//! tests here check against, and its state is plain data, so a session can snapshot and
//! restore it by copying. It is not cryptographic, and need not be: it picks tokens. Writing it
//! here rather than taking the `rand` family keeps the engine's dependencies small and pins
//! the exact stream forever (a crate upgrade can never change which tokens a seed produces).
//!
//! A `u64` seed is expanded into the 256-bit state with SplitMix64, as the authors recommend;
//! the state is then only ever advanced, never reseeded, except by an explicit
//! [`Rng::seed_from_u64`] or [`Rng::from_state`].

use crate::{Error, Result};

/// xoshiro256**: a seedable, clonable 64-bit generator. `Clone` is the snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rng {
    s: [u64; 4],
}

/// One step of SplitMix64 (Steele, Lea and Flood, 2014), the seed expander.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose state is the first four SplitMix64 outputs from `seed` (never all
    /// zero: SplitMix64's output function is a bijection of its counter).
    pub fn seed_from_u64(seed: u64) -> Rng {
        let mut sm = seed;
        let s = [splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm), splitmix64(&mut sm)];
        Rng { s }
    }

    /// A generator with exactly this state (as returned by [`Rng::state`]). The all-zero state
    /// is a fixed point of xoshiro and is rejected.
    pub fn from_state(s: [u64; 4]) -> Result<Rng> {
        if s == [0; 4] {
            return Err(Error::invalid("the all-zero state is not a valid xoshiro256** state"));
        }
        Ok(Rng { s })
    }

    /// The full state, for saving; [`Rng::from_state`] restores it.
    pub fn state(&self) -> [u64; 4] {
        self.s
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// A uniform double in [0, 1) with 53 random bits: `(next_u64() >> 11) * 2^-53`. Every
    /// value is a multiple of 2^-53, so 1.0 is never returned.
    #[inline]
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xoshiro_matches_the_reference_stream() {
        // From the reference C code with s = {1, 2, 3, 4}.
        let mut r = Rng::from_state([1, 2, 3, 4]).unwrap();
        let got: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(got, [11520, 0, 1509978240, 1215971899390074240]);
    }

    #[test]
    fn splitmix_matches_the_reference_stream() {
        // SplitMix64 from state 0: the widely published first outputs.
        let mut sm = 0u64;
        assert_eq!(splitmix64(&mut sm), 0xe220_a839_7b1d_cdaf);
        assert_eq!(splitmix64(&mut sm), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(Rng::seed_from_u64(0).state()[..2], [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4]);
    }

    #[test]
    fn same_seed_same_stream_and_different_seeds_differ() {
        let mut a = Rng::seed_from_u64(42);
        let mut b = Rng::seed_from_u64(42);
        let mut c = Rng::seed_from_u64(43);
        let sa: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
        let sb: Vec<u64> = (0..100).map(|_| b.next_u64()).collect();
        let sc: Vec<u64> = (0..100).map(|_| c.next_u64()).collect();
        assert_eq!(sa, sb);
        assert_ne!(sa, sc);
    }

    #[test]
    fn clone_and_state_restore_the_continuation() {
        let mut r = Rng::seed_from_u64(7);
        for _ in 0..10 {
            r.next_u64();
        }
        let snap = r.clone();
        let saved = r.state();
        let cont: Vec<u64> = (0..50).map(|_| r.next_u64()).collect();
        let mut from_clone = snap;
        let mut from_state = Rng::from_state(saved).unwrap();
        assert_eq!(cont, (0..50).map(|_| from_clone.next_u64()).collect::<Vec<_>>());
        assert_eq!(cont, (0..50).map(|_| from_state.next_u64()).collect::<Vec<_>>());
    }

    #[test]
    fn zero_state_is_rejected() {
        assert!(matches!(Rng::from_state([0; 4]), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn next_f64_is_in_unit_interval_with_53_bits() {
        let mut r = Rng::seed_from_u64(1);
        let mut sum = 0.0;
        let n = 100_000;
        for _ in 0..n {
            let u = r.next_f64();
            assert!((0.0..1.0).contains(&u));
            assert_eq!(u * (1u64 << 53) as f64, (u * (1u64 << 53) as f64).trunc());
            sum += u;
        }
        let mean = sum / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        // The extremes of the mapping.
        assert_eq!((u64::MAX >> 11) as f64 * (1.0 / (1u64 << 53) as f64), 1.0 - f64::EPSILON / 2.0);
    }
}
