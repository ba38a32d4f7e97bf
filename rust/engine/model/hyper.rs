//! Manifold-constrained hyper-connections (mHC): the residual is `hc` streams; each
//! sublayer reads a weighted collapse of them ("pre") and writes back through a learned
//! expansion ("post") plus a doubly-stochastic mixing of the old streams ("comb",
//! projected with Sinkhorn).

use crate::backend::cpu::{rms_norm_plain, sigmoid};
use crate::backend::Ops;
use crate::model::config::ModelConfig;
use crate::model::weights::HyperWeights;
use crate::Result;

/// The mixing a hyper-connection site computed for one row, kept for its post step.
#[derive(Clone, Debug)]
pub struct Mix {
    pub post: Vec<f32>,
    /// `comb[i * hc + j]`: weight of input stream i in output stream j.
    pub comb: Vec<f32>,
}

/// The mixing logits for each row of `x` (`n` rows of `hc * d` streams): the projection of
/// the RMS-normalized flattened streams.
fn mix_logits(ops: Ops<'_>, w: &HyperWeights, x: &[f32], eps: f32) -> Result<Vec<f32>> {
    let width = w.proj.n_in;
    let mut flat = x.to_vec();
    for row in flat.chunks_mut(width) {
        rms_norm_plain(row, eps);
    }
    ops.matmul(&w.proj, &flat)
}

/// Collapses the streams of each row for the sublayer input (`y`, `n * d`) and returns the
/// per-row mixes for [`post`].
pub fn pre(ops: Ops<'_>, w: &HyperWeights, x: &[f32], cfg: &ModelConfig) -> Result<(Vec<f32>, Vec<Mix>)> {
    let (hc, d, hc_eps) = (cfg.hc_mult, cfg.hidden, cfg.hc_eps);
    let n = x.len() / (hc * d);
    let logits = mix_logits(ops, w, x, cfg.rms_eps)?;
    let n_mix = w.proj.n_out;
    let mut y = vec![0f32; n * d];
    let mut mixes = Vec::with_capacity(n);
    for r in 0..n {
        let m = &logits[r * n_mix..(r + 1) * n_mix];
        let (b, a) = (&w.base, &w.scale);
        let pre: Vec<f32> = (0..hc).map(|s| sigmoid(m[s] * a[0] + b[s]) + hc_eps).collect();
        let post: Vec<f32> = (0..hc).map(|s| 2.0 * sigmoid(m[hc + s] * a[1] + b[hc + s])).collect();
        let mut comb: Vec<f32> = (0..hc * hc).map(|k| m[2 * hc + k] * a[2] + b[2 * hc + k]).collect();
        for row in comb.chunks_mut(hc) {
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for v in row.iter_mut() {
                *v = (*v - mx).exp();
                sum += *v;
            }
            for v in row.iter_mut() {
                *v = *v / sum + hc_eps;
            }
        }
        sinkhorn(&mut comb, hc, hc_eps, cfg.sinkhorn_iters);
        let xs = &x[r * hc * d..(r + 1) * hc * d];
        let yr = &mut y[r * d..(r + 1) * d];
        for (i, v) in yr.iter_mut().enumerate() {
            let mut acc = 0f32;
            for s in 0..hc {
                acc += pre[s] * xs[s * d + i];
            }
            *v = acc;
        }
        mixes.push(Mix { post, comb });
    }
    Ok((y, mixes))
}

/// One column normalization, then `iters - 1` rounds of row then column normalization.
pub fn sinkhorn(c: &mut [f32], hc: usize, eps: f32, iters: usize) {
    let cols = |c: &mut [f32]| {
        for j in 0..hc {
            let s: f32 = (0..hc).map(|i| c[i * hc + j]).sum::<f32>() + eps;
            for i in 0..hc {
                c[i * hc + j] /= s;
            }
        }
    };
    cols(c);
    for _ in 1..iters {
        for row in c.chunks_mut(hc) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            for v in row.iter_mut() {
                *v /= s;
            }
        }
        cols(c);
    }
}

/// `X'_j = post_j * F + Σ_i comb[i][j] * X_i`, in place on `x`, for each row.
pub fn post(x: &mut [f32], f: &[f32], mixes: &[Mix], hc: usize, d: usize) {
    let mut old = vec![0f32; hc * d];
    let mut acc = vec![0f32; d];
    for (r, mix) in mixes.iter().enumerate() {
        let xs = &mut x[r * hc * d..(r + 1) * hc * d];
        old.copy_from_slice(xs);
        let fr = &f[r * d..(r + 1) * d];
        for j in 0..hc {
            // Each element sums i = 0, 1, ... in order (stream by stream, so it vectorizes).
            acc.fill(0.0);
            for i in 0..hc {
                let c = mix.comb[i * hc + j];
                for (a, &o) in acc.iter_mut().zip(&old[i * d..(i + 1) * d]) {
                    *a += c * o;
                }
            }
            let pj = mix.post[j];
            for ((y, &fk), &a) in xs[j * d..(j + 1) * d].iter_mut().zip(fr).zip(&acc) {
                *y = pj * fk + a;
            }
        }
    }
}

/// The output head's collapse: sigmoid weights, no Sinkhorn, no post step.
pub fn head(
    ops: Ops<'_>,
    w: &HyperWeights,
    x: &[f32],
    hc: usize,
    d: usize,
    rms_eps: f32,
    hc_eps: f32,
) -> Result<Vec<f32>> {
    let n = x.len() / (hc * d);
    let logits = mix_logits(ops, w, x, rms_eps)?;
    let mut y = vec![0f32; n * d];
    for r in 0..n {
        let pre: Vec<f32> = (0..hc).map(|s| sigmoid(logits[r * hc + s] * w.scale[0] + w.base[s]) + hc_eps).collect();
        let xs = &x[r * hc * d..(r + 1) * hc * d];
        for (i, v) in y[r * d..(r + 1) * d].iter_mut().enumerate() {
            let mut acc = 0f32;
            for s in 0..hc {
                acc += pre[s] * xs[s * d + i];
            }
            *v = acc;
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_is_doubly_stochastic_and_not_symmetric() {
        let mut c: Vec<f32> = (0..16).map(|k| ((k * k * 3 % 7) as f32 * 0.3).exp()).collect();
        sinkhorn(&mut c, 4, 1e-6, 20);
        for i in 0..4 {
            let row: f32 = c[i * 4..i * 4 + 4].iter().sum();
            let col: f32 = (0..4).map(|r| c[r * 4 + i]).sum();
            assert!((row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5, "{row} {col}");
        }
        let asym =
            (0..4).flat_map(|i| (0..4).map(move |j| (i, j))).any(|(i, j)| (c[i * 4 + j] - c[j * 4 + i]).abs() > 1e-3);
        assert!(asym);
    }
}
