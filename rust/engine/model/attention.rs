//! Attention with sinks over one shared K=V head: the raw sliding window plus the
//! compressed rows a layer may see.

use rayon::prelude::*;

use crate::backend::cpu::{dot_f32, weighted_sum, PARALLEL_MIN_WORK};

/// One query row: `q` holds `n_heads` heads of `head_dim`; `keys` are the visible rows (each
/// both key and value). Writes `n_heads * head_dim` outputs:
/// `o_h = Σ_j e^{ℓ_j−M} k_j / (e^{s_h−M} + Σ_j e^{ℓ_j−M})`, `ℓ_j = q_h·k_j / sqrt(head_dim)`.
pub fn attend(q: &[f32], keys: &[&[f32]], sinks: &[f32], head_dim: usize, out: &mut [f32]) {
    let one_head = |h: usize, qh: &[f32], oh: &mut [f32]| {
        let scale = 1.0 / (head_dim as f32).sqrt();
        let mut logits = vec![0f32; keys.len()];
        let mut m = sinks[h];
        for (l, k) in logits.iter_mut().zip(keys) {
            *l = dot_f32(qh, k) * scale;
            m = m.max(*l);
        }
        let mut denom = (sinks[h] - m).exp();
        for l in logits.iter_mut() {
            *l = (*l - m).exp();
            denom += *l;
        }
        for l in logits.iter_mut() {
            *l /= denom;
        }
        weighted_sum(oh, &logits, keys);
    };
    // Heads are independent; each is computed the same way on whichever thread runs it.
    if q.len() * keys.len() >= PARALLEL_MIN_WORK {
        q.par_chunks(head_dim)
            .zip(out.par_chunks_mut(head_dim))
            .enumerate()
            .for_each(|(h, (qh, oh))| one_head(h, qh, oh));
    } else {
        q.chunks(head_dim).zip(out.chunks_mut(head_dim)).enumerate().for_each(|(h, (qh, oh))| one_head(h, qh, oh));
    }
}

/// Positions of the raw rows visible to the query at `pos`: the current token and the
/// `window - 1` before it.
pub fn raw_range(pos: usize, window: usize) -> std::ops::RangeInclusive<usize> {
    (pos + 1).saturating_sub(window)..=pos
}

/// Compressed rows visible to the query at `pos` for a layer of this ratio: row `w` is
/// visible iff `w < (pos + 1) / ratio`, so a window that closes at `pos` is already visible.
pub fn visible_compressed(pos: usize, ratio: usize) -> usize {
    (pos + 1) / ratio
}
