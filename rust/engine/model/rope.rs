//! Rotary position embedding: interleaved pairs on the last `dim` features of a vector.
//!
//! Frequencies and angles are computed in f32 the way the reference computes them
//! (`inv_freq` in f32, `angle = inv_freq * pos` as one f32 product), so positions far into
//! the context round the same way.

use crate::model::config::Yarn;

#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
}

fn pos_freqs(base: f32, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            f64::from(base).powf(f64::from(e)) as f32
        })
        .collect()
}

impl Rope {
    /// `ω_i = base^(−2i/dim)`.
    pub fn plain(base: f32, dim: usize) -> Self {
        Rope { inv_freq: pos_freqs(base, dim).into_iter().map(|p| 1.0 / p).collect() }
    }

    /// YaRN: frequencies below the correction range keep their value, those above are
    /// divided by `factor`, a linear ramp in between; no magnitude factor.
    pub fn yarn(base: f32, dim: usize, y: &Yarn) -> Self {
        let corr = |rot: f32| {
            (dim as f64 * (y.original_context as f64 / (f64::from(rot) * 2.0 * std::f64::consts::PI)).ln())
                / (2.0 * f64::from(base).ln())
        };
        let low = corr(y.beta_fast).floor().max(0.0);
        let high = corr(y.beta_slow).ceil().min(dim as f64 - 1.0);
        let (low, mut high) = (low as f32, high as f32);
        if low == high {
            high += 0.001;
        }
        let inv_freq = pos_freqs(base, dim)
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                let extrap = 1.0 / p;
                let interp = 1.0 / (y.factor * p);
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                interp * (1.0 - keep) + extrap * keep
            })
            .collect();
        Rope { inv_freq }
    }

    /// The inverse frequencies `ω_i`, one per rotated pair (the device kernels' table).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the device decoder's
    pub(crate) fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Number of rotated features.
    pub fn dim(&self) -> usize {
        2 * self.inv_freq.len()
    }

    /// Rotates the last `dim()` features of `x` by the angles of position `pos`
    /// (by their negation when `inverse`).
    pub fn apply(&self, x: &mut [f32], pos: usize, inverse: bool) {
        if !x.is_empty() {
            self.apply_heads(x, x.len(), pos, inverse);
        }
    }

    /// [`Rope::apply`] to each `width`-wide chunk of `x`; the angles depend on the position
    /// only, so they are computed once for all chunks.
    pub fn apply_heads(&self, x: &mut [f32], width: usize, pos: usize, inverse: bool) {
        let p = pos as f32;
        let cs: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|&f| {
                let angle = f64::from(f * p);
                let s = angle.sin() as f32;
                (angle.cos() as f32, if inverse { -s } else { s })
            })
            .collect();
        for h in x.chunks_mut(width) {
            let off = h.len() - self.dim();
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = (h[off + 2 * i], h[off + 2 * i + 1]);
                h[off + 2 * i] = a * c + (-b) * s;
                h[off + 2 * i + 1] = b * c + a * s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_yarn_bounds() {
        // model.md §2.4(d): i <= 15 keeps the frequency, i >= 25 is divided by 16.
        let y = Yarn { factor: 16.0, original_context: 65536, beta_fast: 32.0, beta_slow: 1.0 };
        let plain = Rope::plain(160000.0, 64);
        let r = Rope::yarn(160000.0, 64, &y);
        for i in 0..32 {
            let ratio = r.inv_freq[i] / plain.inv_freq[i];
            if i <= 15 {
                assert!((ratio - 1.0).abs() < 1e-6, "{i}: {ratio}");
            } else if i >= 25 {
                assert!((ratio - 1.0 / 16.0).abs() < 1e-6, "{i}: {ratio}");
            } else {
                assert!(ratio < 1.0 && ratio > 1.0 / 16.0);
            }
        }
        assert!((r.inv_freq[16] - 2.2656e-3).abs() < 1e-6);
    }

    #[test]
    fn inverse_undoes_rotation() {
        let r = Rope::plain(10000.0, 8);
        let orig: Vec<f32> = (0..12).map(|i| i as f32 * 0.37 - 2.0).collect();
        let mut x = orig.clone();
        r.apply(&mut x, 77, false);
        assert_ne!(x, orig);
        assert_eq!(&x[..4], &orig[..4]);
        r.apply(&mut x, 77, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
