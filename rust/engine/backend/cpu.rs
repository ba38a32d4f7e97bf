//! CPU kernels of the forward pass.
//!
//! Row invariance: every output element of [`matmul`] is exactly one call of the fused
//! [`RowDot::dot`] of a weight row with one input row, so its value does not depend on how
//! many rows share the batch or how the work is split across threads. Every other kernel
//! here works on one row at a time. This is what lets a speculative verify pass commit its
//! rows as if they had been decoded one by one.
//!
//! Products with IQ2_XXS or Q2_K weights take their input as 8-bit activations (see
//! [`crate::quant::act8`]): each input row is quantized once, by itself, before the dots.

use rayon::prelude::*;

use crate::model::weights::Mat;
use crate::quant::{act8, RowDot};
use crate::Result;

/// Below this many multiply-adds a product runs on the calling thread.
pub const PARALLEL_MIN_WORK: usize = 1 << 16;
/// Weight bytes per parallel task: enough to amortize scheduling, small enough to balance.
const TASK_BYTES: usize = 1 << 15;

/// One matrix product of a batch: `y[r, o] = w[o] · x[r]` for the `x.len() / w.n_in` rows.
pub struct Job<'a> {
    pub w: &'a Mat,
    pub x: &'a [f32],
    pub y: &'a mut [f32],
}

/// `y[r, o] = W[o] · x[r]` for the `n = x.len() / w.n_in` rows of `x`.
pub fn matmul(raw: &[u8], w: &Mat, x: &[f32], y: &mut [f32]) -> Result<()> {
    matmul_many(raw, &mut [Job { w, x, y }])
}

/// Runs independent products in one parallel region: a decode step has dozens of small
/// products, and waking the worker threads once per product would cost more than the
/// products themselves. The output rows of all jobs are cut into tasks of about
/// `TASK_BYTES` of weights; each weight row is read once for all batch rows.
pub fn matmul_many(raw: &[u8], jobs: &mut [Job<'_>]) -> Result<()> {
    let mut work = 0usize;
    let mut specs = Vec::with_capacity(jobs.len());
    for j in jobs.iter() {
        let n = j.x.len() / j.w.n_in;
        if j.x.len() != n * j.w.n_in || j.y.len() != n * j.w.n_out {
            return Err(crate::Error::invalid("matmul: input or output of the wrong size"));
        }
        work += n * j.w.n_out * j.w.n_in;
        specs.push((j.w, j.x, n, RowDot::best(j.w.ty, j.w.n_in)?));
    }
    // The 8-bit activations of the products that take them (empty for the others).
    let quantized: Vec<Vec<u8>> = specs
        .iter()
        .map(|&(w, x, _, dot)| if dot.takes_act8() { act8::quantize_rows(x, w.n_in) } else { Ok(Vec::new()) })
        .collect::<Result<_>>()?;
    // Weight-row-major results: for a single row that is y itself, else a scratch buffer
    // transposed into y afterwards.
    let mut scratch: Vec<Vec<f32>> =
        specs.iter().map(|&(w, _, n, _)| if n == 1 { Vec::new() } else { vec![0f32; n * w.n_out] }).collect();
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (i, (job, buf)) in jobs.iter_mut().zip(scratch.iter_mut()).enumerate() {
        let (w, _, n, _) = specs[i];
        let out: &mut [f32] = if n == 1 { &mut *job.y } else { buf };
        let rows = (TASK_BYTES / w.row_bytes.max(1) / n).max(1);
        for (c, chunk) in out.chunks_mut(rows * n).enumerate() {
            tasks.push((i, c * rows, chunk));
        }
    }
    let run = |(i, first, out): &mut (usize, usize, &mut [f32])| {
        let (w, x, n, dot) = &specs[*i];
        let qx = &quantized[*i];
        let qn = act8::bytes(w.n_in);
        for (k, o) in out.chunks_mut(*n).enumerate() {
            let row = w.row(raw, *first + k);
            for (r, v) in o.iter_mut().enumerate() {
                *v = if dot.takes_act8() {
                    dot.dot_act8(row, &qx[r * qn..(r + 1) * qn])
                } else {
                    dot.dot(row, &x[r * w.n_in..(r + 1) * w.n_in])
                };
            }
        }
    };
    if work < PARALLEL_MIN_WORK {
        tasks.iter_mut().for_each(run);
    } else {
        tasks.par_iter_mut().for_each(run);
    }
    drop(tasks);
    for (job, (buf, &(w, _, n, _))) in jobs.iter_mut().zip(scratch.iter().zip(&specs)) {
        if n > 1 {
            for o in 0..w.n_out {
                for r in 0..n {
                    job.y[r * w.n_out + o] = buf[o * n + r];
                }
            }
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

/// Several products at once into new outputs (see [`matmul_many`]).
pub fn matmul_many_new(raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
    let mut outs: Vec<Vec<f32>> = specs.iter().map(|(w, x)| vec![0f32; x.len() / w.n_in * w.n_out]).collect();
    let mut jobs: Vec<Job<'_>> = specs.iter().zip(outs.iter_mut()).map(|(&(w, x), y)| Job { w, x, y }).collect();
    matmul_many(raw, &mut jobs)?;
    drop(jobs);
    Ok(outs)
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

/// Dot product of two f32 slices in a fixed order (attention and indexer scores). The AVX2
/// kernel (chosen once per process by CPU features) and the portable one round differently,
/// but a process always uses the same one, so every row of a batch is computed alike.
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::simd::available() {
        // SAFETY: AVX2 and FMA are present (checked just above).
        return unsafe { x86::dot_f32(a, b) };
    }
    dot_f32_portable(a, b)
}

fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Two 8-lane FMA accumulators over 16 elements per step, then a fixed lane sum.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
            i += 16;
        }
        if i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
        let v = _mm256_add_ps(acc0, acc1);
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let h = _mm_add_ps(q, _mm_movehl_ps(q, q));
        let mut s = _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
        while i < n {
            s += a[i] * b[i];
            i += 1;
        }
        s
    }

    /// See [`super::weighted_sum`]: 32 outputs (4 registers) at a time over all rows, then
    /// the tail with [`axpy`]'s per-element operations.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum(out: &mut [f32], w: &[f32], rows: &[&[f32]]) {
        let n = out.len();
        let po = out.as_mut_ptr();
        let mut i = 0;
        while i + 32 <= n {
            let mut a0 = _mm256_setzero_ps();
            let mut a1 = _mm256_setzero_ps();
            let mut a2 = _mm256_setzero_ps();
            let mut a3 = _mm256_setzero_ps();
            for (&wj, r) in w.iter().zip(rows) {
                debug_assert!(r.len() >= n);
                let (vw, pr) = (_mm256_set1_ps(wj), r.as_ptr().add(i));
                a0 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(pr), a0);
                a1 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(pr.add(8)), a1);
                a2 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(pr.add(16)), a2);
                a3 = _mm256_fmadd_ps(vw, _mm256_loadu_ps(pr.add(24)), a3);
            }
            _mm256_storeu_ps(po.add(i), a0);
            _mm256_storeu_ps(po.add(i + 8), a1);
            _mm256_storeu_ps(po.add(i + 16), a2);
            _mm256_storeu_ps(po.add(i + 24), a3);
            i += 32;
        }
        if i < n {
            for (&wj, r) in w.iter().zip(rows) {
                axpy(&mut out[i..], wj, &r[i..n]);
            }
        }
    }

    /// `y += a * x`, eight lanes at a time.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let (py, px) = (y.as_mut_ptr(), x.as_ptr());
        let va = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(py.add(i), _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i))));
            i += 8;
        }
        while i < n {
            y[i] += a * x[i];
            i += 1;
        }
    }
}

/// `out = Σ_j w[j] · rows[j]`, accumulated over `j` in order for every element (the value
/// side of attention). The AVX2 kernel keeps a 32-wide slice of `out` in registers across
/// all rows instead of streaming `out` through memory once per row; per element it performs
/// the same fused multiply-adds in the same order as repeated [`axpy`], so the two agree bit
/// for bit.
pub fn weighted_sum(out: &mut [f32], w: &[f32], rows: &[&[f32]]) {
    out.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if crate::quant::simd::available() {
        // SAFETY: AVX2 and FMA are present (checked just above).
        return unsafe { x86::weighted_sum(out, w, rows) };
    }
    for (&wj, r) in w.iter().zip(rows) {
        axpy(out, wj, r);
    }
}

/// `y += a * x`.
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::quant::simd::available() {
        // SAFETY: AVX2 and FMA are present (checked just above).
        return unsafe { x86::axpy(y, a, x) };
    }
    for (v, &u) in y.iter_mut().zip(x) {
        *v += a * u;
    }
}
