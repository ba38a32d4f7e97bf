//! The mixture-of-experts sublayer: sqrt-softplus router (hash-routed on the first layers),
//! clamped SwiGLU experts and a shared expert.

use crate::backend::cpu::{silu, softplus};
use crate::backend::Ops;
use crate::model::config::{LayerSpec, ModelConfig};
use crate::model::weights::{LayerWeights, Mat, Router};
use crate::Result;

/// The experts chosen for one row and their weights.
pub fn route(cfg: &ModelConfig, w: &LayerWeights, logits: &[f32], token: u32) -> (Vec<usize>, Vec<f32>) {
    let k = cfg.n_experts_used;
    let scores: Vec<f32> = logits.iter().map(|&z| softplus(z).sqrt()).collect();
    let mut chosen: Vec<usize> = match &w.router {
        Router::Hash { table } => {
            table[token as usize * k..(token as usize + 1) * k].iter().map(|&e| e as usize).collect()
        }
        Router::Learned { bias } => {
            let biased: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
            let mut idx: Vec<usize> = (0..scores.len()).collect();
            idx.sort_by(|&a, &b| biased[b].total_cmp(&biased[a]).then(a.cmp(&b)));
            idx.truncate(k);
            idx
        }
    };
    // A fixed order (by expert id) for the sum over experts.
    chosen.sort_unstable();
    let mut weights: Vec<f32> = chosen.iter().map(|&e| scores[e]).collect();
    if cfg.expert_weights_norm {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        for v in weights.iter_mut() {
            *v /= sum;
        }
    }
    for v in weights.iter_mut() {
        *v *= cfg.expert_weights_scale;
    }
    (chosen, weights)
}

/// `silu(min(g, c)) * clamp(u, ±c)`.
fn swiglu(g: &[f32], u: &[f32], clamp: f32) -> Vec<f32> {
    g.iter().zip(u).map(|(&g, &u)| silu(g.min(clamp)) * u.clamp(-clamp, clamp)).collect()
}

/// The MoE output for the rows of `h` (`n * hidden`), `tokens` being each row's input token.
pub fn forward(
    ops: Ops<'_>,
    cfg: &ModelConfig,
    spec: &LayerSpec,
    w: &LayerWeights,
    h: &[f32],
    tokens: &[u32],
) -> Result<Vec<f32>> {
    let d = cfg.hidden;
    let n = tokens.len();
    let logits = ops.matmul(&w.router_proj, h)?;
    let routes: Vec<(Vec<usize>, Vec<f32>)> =
        (0..n).map(|r| route(cfg, w, &logits[r * cfg.n_experts..(r + 1) * cfg.n_experts], tokens[r])).collect();

    // Group the rows by expert so each expert's weights are read once per batch; every
    // row's result is still its own dot products, whatever the grouping. All gate/up
    // products (and then all down products) of the layer run in one parallel region.
    let mut used: Vec<(usize, Vec<usize>, Vec<f32>)> = Vec::new();
    for e in 0..cfg.n_experts {
        let rows: Vec<usize> = (0..n).filter(|&r| routes[r].0.contains(&e)).collect();
        if !rows.is_empty() {
            let x = rows.iter().flat_map(|&r| h[r * d..(r + 1) * d].iter().copied()).collect();
            used.push((e, rows, x));
        }
    }
    let gates: Vec<Mat> = used.iter().map(|(e, _, _)| w.gate_exps.get(*e)).collect();
    let ups: Vec<Mat> = used.iter().map(|(e, _, _)| w.up_exps.get(*e)).collect();
    let downs: Vec<Mat> = used.iter().map(|(e, _, _)| w.down_exps.get(*e)).collect();
    let mut specs: Vec<(&Mat, &[f32])> = vec![(&w.gate_sh, h), (&w.up_sh, h)];
    for (i, (_, _, x)) in used.iter().enumerate() {
        specs.extend([(&gates[i], x.as_slice()), (&ups[i], x.as_slice())]);
    }
    let gu = ops.matmul_many(&specs)?;
    let acts: Vec<Vec<f32>> = gu
        .chunks(2)
        .enumerate()
        .map(|(i, p)| swiglu(&p[0], &p[1], if i == 0 { spec.clamp_shared } else { spec.clamp_routed }))
        .collect();
    let mut specs: Vec<(&Mat, &[f32])> = vec![(&w.down_sh, acts[0].as_slice())];
    for (i, m) in downs.iter().enumerate() {
        specs.push((m, acts[i + 1].as_slice()));
    }
    let downs_out = ops.matmul_many(&specs)?;
    let shared = &downs_out[0];
    let mut per_row: Vec<Vec<(usize, &[f32])>> = vec![Vec::new(); n];
    for (i, (e, rows, _)) in used.iter().enumerate() {
        for (k, &r) in rows.iter().enumerate() {
            per_row[r].push((*e, &downs_out[i + 1][k * d..(k + 1) * d]));
        }
    }
    let mut out = vec![0f32; n * d];
    for r in 0..n {
        let (experts, weights) = &routes[r];
        let o = &mut out[r * d..(r + 1) * d];
        // Experts in increasing id (per_row was filled in that order), then the shared one.
        for (e, y) in &per_row[r] {
            // (A hash table may name an expert twice: its weights add up.)
            let wk: f32 = experts.iter().zip(weights).filter(|(x, _)| *x == e).map(|(_, w)| w).sum();
            for (v, &u) in o.iter_mut().zip(y.iter()) {
                *v += u * wk;
            }
        }
        for (v, &u) in o.iter_mut().zip(&shared[r * d..(r + 1) * d]) {
            *v += u;
        }
    }
    Ok(out)
}
