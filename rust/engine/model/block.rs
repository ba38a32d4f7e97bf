//! One window-only V4 block for the drafters: the trunk's attention (low-rank q, shared K=V
//! head with sinks, partial rope, grouped output) and MoE, over a few new rows that see a
//! given set of context rows plus **all** the new rows (non-causal among themselves: DSpark's
//! block attends within itself; MTP calls it one row at a time).

use crate::backend::cpu::{rms_norm_plain, rms_norm_rows};
use crate::backend::Ops;
use crate::model::attention::attend;
use crate::model::config::{LayerSpec, ModelConfig};
use crate::model::forward::output_projection;
use crate::model::rope::Rope;
use crate::model::weights::LayerWeights;
use crate::model::{hyper, moe};
use crate::state::KvPrecision;
use crate::Result;

/// Query rows after `q_b`, in place: each head RMS-normalized, then rotated at its row's
/// position (the trunk and the drafter blocks alike).
pub(crate) fn finish_queries(q: &mut [f32], cfg: &ModelConfig, rope: &Rope, positions: &[usize]) {
    for (qr, &p) in q.chunks_mut(cfg.n_heads * cfg.head_dim).zip(positions) {
        for head in qr.chunks_mut(cfg.head_dim) {
            rms_norm_plain(head, cfg.rms_eps);
        }
        rope.apply_heads(qr, cfg.head_dim, p, false);
    }
}

/// K=V rows after the `kv` projection, in place: `kv_norm`, rotation at the row's position,
/// rounding to the storage precision.
pub(crate) fn finish_kv(
    kv: &mut [f32],
    cfg: &ModelConfig,
    lw: &LayerWeights,
    rope: &Rope,
    precision: KvPrecision,
    positions: &[usize],
) {
    rms_norm_rows(kv, &lw.kv_norm, cfg.rms_eps);
    for (k, &p) in kv.chunks_mut(cfg.head_dim).zip(positions) {
        rope.apply(k, p, false);
        precision.round_kv(k, cfg.rope_dim);
    }
}

/// The K=V row a block stores for input `y` (already attention-normed) at each position.
pub(crate) fn kv_rows(
    ops: Ops<'_>,
    cfg: &ModelConfig,
    lw: &LayerWeights,
    rope: &Rope,
    precision: KvPrecision,
    y: &[f32],
    positions: &[usize],
) -> Result<Vec<f32>> {
    let mut kv = ops.matmul(&lw.kv, y)?;
    finish_kv(&mut kv, cfg, lw, rope, precision, positions);
    Ok(kv)
}

/// Runs the block on `x` (`m` rows of `hc * hidden` streams) at `positions`, each row
/// attending to `context` (rotated K=V rows at earlier positions) and to the `m` new rows.
/// Returns the new streams and the new rows' K=V rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn window_block(
    ops: Ops<'_>,
    cfg: &ModelConfig,
    spec: &LayerSpec,
    lw: &LayerWeights,
    rope: &Rope,
    precision: KvPrecision,
    x: &[f32],
    positions: &[usize],
    context: &[&[f32]],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (d, hc, nh, hd) = (cfg.hidden, cfg.hc_mult, cfg.n_heads, cfg.head_dim);
    let m = positions.len();
    let mut x = x.to_vec();

    let (mut h, mixes) = hyper::pre(ops, &lw.hc_attn, &x, cfg)?;
    rms_norm_rows(&mut h, &lw.attn_norm, cfg.rms_eps);
    let mut cq = ops.matmul(&lw.q_a, &h)?;
    rms_norm_rows(&mut cq, &lw.q_a_norm, cfg.rms_eps);
    let mut q = ops.matmul(&lw.q_b, &cq)?;
    finish_queries(&mut q, cfg, rope, positions);
    let kv = kv_rows(ops, cfg, lw, rope, precision, &h, positions)?;
    let mut keys: Vec<&[f32]> = context.to_vec();
    keys.extend(kv.chunks(hd));
    let mut o = vec![0f32; m * nh * hd];
    for (r, orow) in o.chunks_mut(nh * hd).enumerate() {
        attend(&q[r * nh * hd..(r + 1) * nh * hd], &keys, &lw.sinks, hd, orow);
        rope.apply_heads(orow, hd, positions[r], true);
    }
    let attn = output_projection(ops, cfg, lw, &o)?;
    hyper::post(&mut x, &attn, &mixes, hc, d);

    let (mut h, mixes) = hyper::pre(ops, &lw.hc_ffn, &x, cfg)?;
    rms_norm_rows(&mut h, &lw.ffn_norm, cfg.rms_eps);
    // Drafter blocks route with their learned router: the token ids are not used.
    let f = moe::forward(ops, cfg, spec, lw, &h, &vec![0; m])?;
    hyper::post(&mut x, &f, &mixes, hc, d);
    Ok((x, kv))
}
