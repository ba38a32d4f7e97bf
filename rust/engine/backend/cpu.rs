//! CPU kernels of the forward pass.
//!
//! Row invariance: every output element of [`matmul`] is exactly one call of the fused
//! [`quant::dot`] of a weight row with one input row, so its value does not depend on how
//! many rows share the batch or how the work is split across threads. Every other kernel
//! here works on one row at a time. This is what lets a speculative verify pass commit its
//! rows as if they had been decoded one by one.

use rayon::prelude::*;

use crate::model::weights::Mat;
use crate::quant;
use crate::Result;

/// Below this many multiply-adds a matmul runs on the calling thread.
const PARALLEL_MIN_WORK: usize = 1 << 18;

/// `y[r, o] = W[o] · x[r]` for the `n = x.len() / w.n_in` rows of `x`.
pub fn matmul(raw: &[u8], w: &Mat, x: &[f32], y: &mut [f32]) -> Result<()> {
    let n = x.len() / w.n_in;
    debug_assert_eq!(x.len(), n * w.n_in);
    debug_assert_eq!(y.len(), n * w.n_out);
    let one_row = |o: usize, out: &mut [f32]| -> Result<()> {
        let row = w.row(raw, o);
        for (r, v) in out.iter_mut().enumerate() {
            *v = quant::dot(w.ty, row, &x[r * w.n_in..(r + 1) * w.n_in])?;
        }
        Ok(())
    };
    if n == 1 {
        // y is already in output-row order.
        if w.n_out * w.n_in < PARALLEL_MIN_WORK {
            return y.iter_mut().enumerate().try_for_each(|(o, v)| one_row(o, std::slice::from_mut(v)));
        }
        return y.par_chunks_mut(64).enumerate().try_for_each(|(c, out)| {
            out.iter_mut().enumerate().try_for_each(|(i, v)| one_row(c * 64 + i, std::slice::from_mut(v)))
        });
    }
    // Weight-row-major scratch (each weight row is read once for all batch rows), then
    // transposed into y.
    let mut t = vec![0f32; n * w.n_out];
    if n * w.n_out * w.n_in < PARALLEL_MIN_WORK {
        t.chunks_mut(n).enumerate().try_for_each(|(o, out)| one_row(o, out))?;
    } else {
        t.par_chunks_mut(n).enumerate().try_for_each(|(o, out)| one_row(o, out))?;
    }
    for o in 0..w.n_out {
        for r in 0..n {
            y[r * w.n_out + o] = t[o * n + r];
        }
    }
    Ok(())
}

/// Convenience: a new `n x w.n_out` output.
pub fn matmul_new(raw: &[u8], w: &Mat, x: &[f32]) -> Result<Vec<f32>> {
    let mut y = vec![0f32; x.len() / w.n_in * w.n_out];
    matmul(raw, w, x, &mut y)?;
    Ok(y)
}

/// `1 / sqrt(mean(x²) + eps)`, the mean accumulated in f64.
#[inline]
pub fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
    let mean = (ss / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// In place: `x <- w * (x * rms_scale(x))` (the weight applied after the scaling, as the
/// reference does).
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let s = rms_scale(x, eps);
    for (v, &g) in x.iter_mut().zip(w) {
        *v = g * (*v * s);
    }
}

/// In place, without a weight.
pub fn rms_norm_plain(x: &mut [f32], eps: f32) {
    let s = rms_scale(x, eps);
    for v in x.iter_mut() {
        *v *= s;
    }
}

/// Applies [`rms_norm`] to each `w.len()`-wide row of `x`.
pub fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_mut(w.len()) {
        rms_norm(row, w, eps);
    }
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, linear above 20 as torch's softplus is.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Dot product of two f32 slices in a fixed order (used for attention scores).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes, then a fixed pairwise sum: deterministic and vectorizable.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a * x`.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (v, &u) in y.iter_mut().zip(x) {
        *v += a * u;
    }
}
