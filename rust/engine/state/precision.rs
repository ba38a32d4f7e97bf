//! Precision of the stored attention state (raw window rows, compressed rows, indexer rows).
//!
//! `F32` keeps what the forward pass computes (what the golden tests use). `F16` rounds
//! every stored row through half precision. `Fp8` reproduces the official model's storage
//! simulation: the non-rotary part of raw and compressed KV rows goes through FP8 E4M3 in
//! blocks of 64 with a power-of-two scale, the rotary tail through BF16, and indexer keys and
//! queries through a Walsh-Hadamard rotation then FP4 E2M1 in blocks of 32 (model.md §2.4 e, g).
//! The values stay in f32 slots; what changes is which values they can hold.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvPrecision {
    #[default]
    F32,
    F16,
    Fp8,
}

impl KvPrecision {
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "f32" => Some(KvPrecision::F32),
            "f16" => Some(KvPrecision::F16),
            "fp8" => Some(KvPrecision::Fp8),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvPrecision::F32 => "f32",
            KvPrecision::F16 => "f16",
            KvPrecision::Fp8 => "fp8",
        }
    }

    /// Rounds a KV row (raw or compressed) whose last `rope_dim` features are rotary.
    pub fn round_kv(self, row: &mut [f32], rope_dim: usize) {
        match self {
            KvPrecision::F32 => {}
            KvPrecision::F16 => round_f16(row),
            KvPrecision::Fp8 => {
                let nope = row.len() - rope_dim;
                for block in row[..nope].chunks_mut(64) {
                    round_e4m3_block(block);
                }
                for v in &mut row[nope..] {
                    *v = bf16::from_f32(*v).to_f32();
                }
            }
        }
    }

    /// Rounds an indexer key row, or each head of an indexer query (`head_dim` wide).
    pub fn round_index(self, x: &mut [f32], head_dim: usize) {
        match self {
            KvPrecision::F32 => {}
            KvPrecision::F16 => round_f16(x),
            KvPrecision::Fp8 => {
                for head in x.chunks_mut(head_dim) {
                    hadamard(head);
                    for block in head.chunks_mut(32) {
                        round_e2m1_block(block);
                    }
                }
            }
        }
    }
}

fn round_f16(x: &mut [f32]) {
    for v in x {
        *v = f16::from_f32(*v).to_f32();
    }
}

/// The power-of-two scale `2^ceil(log2(amax / max))`.
fn pow2_scale(amax: f32, max: f32) -> f32 {
    (amax / max).log2().ceil().exp2()
}

/// Rounds to the nearest multiple of `2^exp_lo` … with `mant` mantissa bits: the value grid
/// of a small float format with minimum normal exponent `min_exp`, ties to even.
fn round_small_float(x: f32, mant: i32, min_exp: i32, max: f32) -> f32 {
    if x == 0.0 || !x.is_finite() {
        return if x.is_nan() { x } else { x.clamp(-max, max) };
    }
    let a = f64::from(x.abs().min(max));
    let e = (a.log2().floor() as i32).max(min_exp);
    let quantum = (f64::from(e - mant)).exp2();
    let q = ((a / quantum).round_ties_even() * quantum).min(f64::from(max));
    (q as f32).copysign(x)
}

fn round_e4m3_block(block: &mut [f32]) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-4);
    let s = pow2_scale(amax, 448.0);
    for v in block {
        *v = round_small_float(*v / s, 3, -6, 448.0) * s;
    }
}

fn round_e2m1_block(block: &mut [f32]) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs())).max(6.0 * (-126f32).exp2());
    let s = pow2_scale(amax, 6.0);
    for v in block {
        *v = round_small_float(*v / s, 1, 0, 6.0) * s;
    }
}

/// In-place Walsh-Hadamard transform (Sylvester order), scaled by `1/sqrt(n)`.
/// `x.len()` must be a power of two.
pub fn hadamard(x: &mut [f32]) {
    let n = x.len();
    debug_assert!(n.is_power_of_two());
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (x[j], x[j + h]);
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
        h *= 2;
    }
    let s = 1.0 / (n as f32).sqrt();
    for v in x {
        *v *= s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_grid() {
        // Normal values keep 3 mantissa bits; ties go to even; the maximum is 448.
        assert_eq!(round_small_float(1.0625, 3, -6, 448.0), 1.0);
        assert_eq!(round_small_float(1.1875, 3, -6, 448.0), 1.25);
        assert_eq!(round_small_float(500.0, 3, -6, 448.0), 448.0);
        assert_eq!(round_small_float(-3.3, 3, -6, 448.0), -3.25);
        // Subnormal step 2^-9.
        assert_eq!(round_small_float(0.0029, 3, -6, 448.0), 0.001953125 * 1.0);
    }

    #[test]
    fn e2m1_grid() {
        let grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
        for i in 0..=600 {
            let x = i as f32 / 100.0;
            let r = round_small_float(x, 1, 0, 6.0);
            assert!(grid.contains(&r), "{x} -> {r}");
            let best = grid.iter().map(|g| (g - x).abs()).fold(f32::INFINITY, f32::min);
            assert!(((r - x).abs() - best).abs() < 1e-6);
        }
    }

    #[test]
    fn hadamard_is_orthonormal() {
        let mut x: Vec<f32> = (0..128).map(|i| (i as f32 * 0.7).sin()).collect();
        let orig = x.clone();
        hadamard(&mut x);
        hadamard(&mut x);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
