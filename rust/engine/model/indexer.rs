//! The lightning indexer of CSA layers: scores every visible compressed row for a query and
//! keeps the top-k.

use rayon::prelude::*;

use crate::backend::cpu::{dot_f32, PARALLEL_MIN_WORK};
use crate::state::RowStore;

/// `I_s = Σ_h g_h · ReLU(q_h · K_s) / sqrt(head_dim)` for the first `n_visible` rows, then
/// the indices of the `top_k` highest (all of them if `n_visible <= top_k`), in increasing
/// index order. Ties go to the lower index.
pub fn select(q: &[f32], weights: &[f32], keys: &RowStore, n_visible: usize, top_k: usize) -> Vec<usize> {
    if n_visible <= top_k {
        return (0..n_visible).collect();
    }
    let hd = keys.width();
    let scale = 1.0 / (hd as f32).sqrt();
    let score = |s: usize| {
        let k = keys.row(s);
        let mut acc = 0f32;
        for (h, qh) in q.chunks(hd).enumerate() {
            acc += (dot_f32(qh, k).max(0.0) * scale) * weights[h];
        }
        acc
    };
    let scores: Vec<f32> = if q.len() * n_visible >= PARALLEL_MIN_WORK {
        (0..n_visible).into_par_iter().map(score).collect()
    } else {
        (0..n_visible).map(score).collect()
    };
    let mut idx: Vec<usize> = (0..n_visible).collect();
    // Descending score, ascending index on ties: a total order, so the selected set is
    // unique; partitioning is O(n) even for the ~262K rows of a 1M context.
    idx.select_nth_unstable_by(top_k - 1, |&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(top_k);
    idx.sort_unstable();
    idx
}
