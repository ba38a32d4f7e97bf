//! 8-bit activations: how a product with IQ2_XXS or Q2_K weights takes its input rows.
//!
//! Every backend multiplies IQ2_XXS and Q2_K weights by `x` quantized to int8 blocks of 32,
//! not by float `x`. Their weights are small integers times a float scale per group (IQ2_XXS:
//! lattice coordinates 8, 25 or 43, signed, per 32; Q2_K: 0..3 times a scale minus a min, per
//! 16), so with int8 `x` a group's dot is an exact integer sum and a few float operations. With
//! float `x` a GPU spends several instructions a weight converting bytes (and its L1 serving
//! 16-byte pieces of `x` scattered over many lines), and the routed experts' products of a
//! decode step were bound by that instead of by memory (H200: twelve IQ2_XXS 2048 x 4096
//! products took 47 -> 35 µs at one batch row, 74 -> 39 µs at two, 131 -> 54 µs at four; six
//! Q2_K 4096 x 2048 ones 23.2 -> 16.2, 31.3 -> 20.0, 48.3 -> 27.3, 82.0 -> 42.3 µs at one, two,
//! four and eight). ggml makes the same trade (`q8_K` blocks on the CPU, `q8_1` on CUDA).
//!
//! The price is accuracy: on random q2 models (CPU, ds4's Flash layout) the two together moved
//! the logits by a median 1.3e-2 to 1.7e-2 of a row's largest logit and the mean KL divergence
//! to the float-input model to 0.8e-3 to 1.5e-3; random models route unstably, so a trained one
//! should move less. And a product's input now changes in steps: two backends whose float
//! inputs differ by rounding (the gate and up products before a down product) can round an
//! activation to neighbouring integers.
//!
//! A row of `n` elements (`n` a multiple of 32) quantizes to [`bytes`]`(n)` bytes: the `n`
//! values `q` as i8, then the `n / 32` block scales `d` as little-endian f32. Per block:
//! `amax = max |x|` (NaN if any element is NaN), `d = amax / 127`, `q = round(x * (1 / d))`
//! with ties away from zero (all 0 when `d` is 0). That is Q8_0's rule
//! ([`super::quantize_q8_0`]) with the scale kept in f32; `x ≈ q * d` within `d / 2`. Every
//! backend quantizes with these float operations in this order, so equal rows give equal
//! bytes (a block holding a NaN gets some NaN scale, whose bits may differ), and a row's bytes
//! never depend on the other rows of its batch.
//!
//! The dot of an IQ2_XXS row with such a row is, per group `g` of 32 with scale `db` (see
//! `quant/iq2_xxs.rs`) and the block's `d`: `s_g = sum(sign * grid * q)` in i32 (exact),
//! then `(db * d) * s_g` in f32 (two roundings); a Q2_K row's is, per sub-block of 16, the
//! exact sums of `q_w * q` and of `q`, then `d * (dl * sum - ml * sum)` (`quant/q2_k.rs`). The
//! terms are summed over the row in f64 on the CPU and in f32 lanes on a GPU.

use super::GgmlType;
use crate::{Error, Result};

/// Elements per block (one scale).
pub const BLOCK: usize = 32;

/// Whether a product with weights of `ty` takes its input rows as 8-bit activations.
pub fn takes_act8(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::IQ2_XXS | GgmlType::Q2_K)
}

/// The quantized size of a row of `n` elements (`n` a multiple of [`BLOCK`]).
pub const fn bytes(n: usize) -> usize {
    n + n / BLOCK * 4
}

/// Quantizes one row `x` into `out` ([`bytes`]`(x.len())` bytes), as the module describes.
pub fn quantize_row(x: &[f32], out: &mut [u8]) -> Result<()> {
    if !x.len().is_multiple_of(BLOCK) || out.len() != bytes(x.len()) {
        return Err(Error::invalid(format!(
            "quantize_act8: a row of {} elements (a multiple of {BLOCK}) quantizes to {} bytes, got {}",
            x.len(),
            bytes(x.len()),
            out.len()
        )));
    }
    let (qs, ds) = out.split_at_mut(x.len());
    for ((xs, q), d_out) in x.chunks_exact(BLOCK).zip(qs.chunks_exact_mut(BLOCK)).zip(ds.chunks_exact_mut(4)) {
        // A NaN element gives the block a NaN scale, which makes its products NaN.
        let d = super::q8_0::quantize_block(xs, q);
        d_out.copy_from_slice(&d.to_le_bytes());
    }
    Ok(())
}

/// Quantizes the rows of `x` (each `n` long) into a new buffer of `rows * bytes(n)` bytes.
pub fn quantize_rows(x: &[f32], n: usize) -> Result<Vec<u8>> {
    if n == 0 || !x.len().is_multiple_of(n) {
        return Err(Error::invalid("quantize_act8: input of the wrong size"));
    }
    let mut out = vec![0u8; x.len() / n * bytes(n)];
    for (row, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(bytes(n))) {
        quantize_row(row, o)?;
    }
    Ok(out)
}

/// Block `b`'s scale in a quantized row of `n` elements.
#[inline(always)]
pub(crate) fn scale(qx: &[u8], n: usize, b: usize) -> f32 {
    let s = n + 4 * b;
    f32::from_le_bytes([qx[s], qx[s + 1], qx[s + 2], qx[s + 3]])
}

/// The values a quantized row stands for, `q * d` (for tests and oracles).
pub fn dequantize_row(qx: &[u8], n: usize) -> Vec<f32> {
    (0..n).map(|i| qx[i] as i8 as f32 * scale(qx, n, i / BLOCK)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_block() {
        let x: Vec<f32> = (0..32).map(|k| (k as f32 - 16.0) / 4.0).collect();
        let mut q = vec![0u8; bytes(32)];
        quantize_row(&x, &mut q).unwrap();
        // amax = 4: d = 4/127 (in f32), q = round(x * (1/d)).
        assert_eq!(scale(&q, 32, 0), 4.0f32 / 127.0);
        assert_eq!(q[0] as i8, -127);
        assert_eq!(q[16] as i8, 0);
        assert_eq!(q[31] as i8, 119); // 3.75 * 31.75 = 119.06
                                      // The same q as Q8_0's quantizer (which differs only in storing d as f16).
        let mut q8 = vec![0u8; 34];
        super::super::quantize_q8_0(&x, &mut q8).unwrap();
        assert_eq!(&q[..32], &q8[2..]);
    }

    #[test]
    fn round_trip_within_half_a_step() {
        let mut s = 0x1234_5678u32;
        let mut x = vec![0f32; 256];
        for v in x.iter_mut() {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            *v = (s >> 8) as f32 / (1 << 24) as f32 * 6.0 - 3.0;
        }
        x[40..72].fill(0.0); // an all-zero block: d = 0, q = 0
        let q = quantize_rows(&x, 256).unwrap();
        let back = dequantize_row(&q, 256);
        for (b, (xs, ys)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
            let d = scale(&q, 256, b);
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(d, amax / 127.0);
            for (a, y) in xs.iter().zip(ys) {
                assert!((a - y).abs() <= d * 0.5001, "{a} {y} {d}");
            }
        }
        assert!(back[40..72].iter().all(|&v| v == 0.0));
    }

    #[test]
    fn bad_lengths_are_errors() {
        assert!(quantize_row(&[0.0; 31], &mut [0u8; 35]).is_err());
        assert!(quantize_row(&[0.0; 32], &mut [0u8; 32]).is_err());
        assert!(quantize_rows(&[0.0; 64], 0).is_err());
        assert!(quantize_rows(&[0.0; 64], 48).is_err());
    }
}
