//! The forward pass: embedding, the layers, the output head.
//!
//! A batch of `n` tokens is evaluated as `n` consecutive decode steps. Everything that does
//! not touch the decode state (projections, norms, hyper-connections, MoE) runs batched;
//! the state updates and attention run row by row in position order, each row seeing
//! exactly the state a single-token decode would see. Every per-row value is computed by
//! the same code with the same reduction order whatever `n` is, so a row's logits and state
//! updates are bitwise independent of the batch it came in.

use crate::backend::cpu::rms_norm_rows;
use crate::backend::Ops;
use crate::model::attention::{attend, raw_range, visible_compressed};
use crate::model::block::{finish_kv, finish_queries};
use crate::model::config::AttentionKind;
use crate::model::draft::DraftKind;
use crate::model::weights::{LayerWeights, Mat};
use crate::model::{hyper, indexer, moe, Model};
use crate::state::{BatchLog, CompressorState, State};
use crate::Result;

/// Which rows of a batch need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

impl Model {
    /// Token `token`'s embedding row, dequantized into `out`.
    pub(crate) fn embed_row(&self, token: u32, out: &mut [f32]) -> Result<()> {
        let e = &self.weights.embed;
        crate::quant::dequantize(e.ty, e.row(self.file.raw(), token as usize), out)
    }

    /// Runs `tokens` through the model from `state`, advancing it, and returns the logits of
    /// the rows `which` asks for (`rows * vocab` floats). Callers check the context and the
    /// token ids first; this never fails half-way on valid input.
    pub(crate) fn forward(
        &self,
        state: &mut State,
        tokens: &[u32],
        which: Logits,
        mut log: Option<&mut BatchLog>,
    ) -> Result<Vec<f32>> {
        let _t = crate::profile::scope(crate::profile::Phase::Forward);
        let cfg = &self.config;
        let ops = self.ops();
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let n = tokens.len();
        let pos0 = state.pos;
        // Changed on the host: no device copy of the state is current any more.
        state.sync = 0;

        // Embedding, copied into every stream.
        let mut x = vec![0f32; n * hc * d];
        let mut e = vec![0f32; d];
        for (r, &t) in tokens.iter().enumerate() {
            self.embed_row(t, &mut e)?;
            for s in 0..hc {
                x[(r * hc + s) * d..(r * hc + s + 1) * d].copy_from_slice(&e);
            }
        }

        // DSpark reads the outputs of some target layers, HC streams averaged.
        let capture: &[usize] = match self.draft.as_ref().map(|dm| &dm.kind) {
            Some(DraftKind::DSpark(w)) if state.draft.is_some() => &w.target_layers,
            _ => &[],
        };
        let mut captured = vec![0f32; n * capture.len() * d];

        for (li, (lw, spec)) in self.weights.layers.iter().zip(&cfg.layers).enumerate() {
            // ---- attention sublayer
            let (mut h, mixes) = hyper::pre(ops, &lw.hc_attn, &x, cfg)?;
            rms_norm_rows(&mut h, &lw.attn_norm, cfg.rms_eps);
            let attn = self.attention(li, state, pos0, &h, log.as_deref_mut())?;
            hyper::post(&mut x, &attn, &mixes, hc, d);

            // ---- MoE sublayer
            let (mut h, mixes) = hyper::pre(ops, &lw.hc_ffn, &x, cfg)?;
            rms_norm_rows(&mut h, &lw.ffn_norm, cfg.rms_eps);
            let f = moe::forward(ops, cfg, spec, lw, &h, tokens)?;
            hyper::post(&mut x, &f, &mixes, hc, d);

            if let Some(j) = capture.iter().position(|&c| c == li) {
                let k = capture.len();
                for r in 0..n {
                    mean_of_streams(
                        &x[r * hc * d..(r + 1) * hc * d],
                        &mut captured[(r * k + j) * d..(r * k + j + 1) * d],
                    );
                }
            }
        }
        self.draft_advance(state, &x, &captured, tokens, pos0, log)?;
        state.pos += n;
        state.tokens.extend_from_slice(tokens);

        let rows = match which {
            Logits::All => 0..n,
            Logits::Last => n.saturating_sub(1)..n,
            Logits::None => return Ok(Vec::new()),
        };
        let xs = &x[rows.start * hc * d..rows.end * hc * d];
        let mut y = hyper::head(ops, &self.weights.hc_head, xs, hc, d, cfg.rms_eps, cfg.hc_eps)?;
        rms_norm_rows(&mut y, &self.weights.output_norm, cfg.rms_eps);
        ops.matmul(&self.weights.output, &y)
    }

    /// The attention sublayer of layer `li` for the rows of `h` (already normalized), at
    /// positions `pos0..`: updates the layer's state and returns `n * hidden` outputs.
    fn attention(
        &self,
        li: usize,
        state: &mut State,
        pos0: usize,
        h: &[f32],
        mut log: Option<&mut BatchLog>,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let ops = self.ops();
        let lw = &self.weights.layers[li];
        let spec = &cfg.layers[li];
        let rope = &self.ropes[li];
        let (nh, hd) = (cfg.n_heads, cfg.head_dim);
        let n = h.len() / cfg.hidden;

        // Every projection of h, then every projection of c_q, each in one parallel region.
        let mut specs: Vec<(&Mat, &[f32])> = vec![(&lw.q_a, h), (&lw.kv, h)];
        if let Some(cw) = &lw.compressor {
            specs.extend([(&cw.kv, h), (&cw.gate, h)]);
        }
        if let Some(iw) = &lw.indexer {
            specs.extend([(&iw.proj, h), (&iw.compressor.kv, h), (&iw.compressor.gate, h)]);
        }
        let mut outs = ops.matmul_many(&specs)?.into_iter();
        let mut next = || outs.next().expect("one output per product");
        let (mut cq, mut kv) = (next(), next());
        let comp = lw.compressor.as_ref().map(|_| (next(), next()));
        let idx_h = lw.indexer.as_ref().map(|_| (next(), next(), next()));
        rms_norm_rows(&mut cq, &lw.q_a_norm, cfg.rms_eps);
        let mut specs: Vec<(&Mat, &[f32])> = vec![(&lw.q_b, &cq)];
        if let Some(iw) = &lw.indexer {
            specs.push((&iw.q_b, &cq));
        }
        let mut outs = ops.matmul_many(&specs)?.into_iter();
        let mut q = outs.next().expect("q");
        let iq = outs.next();

        let positions: Vec<usize> = (pos0..pos0 + n).collect();
        finish_queries(&mut q, cfg, rope, &positions);
        let precision = state.precision;
        finish_kv(&mut kv, cfg, lw, rope, precision, &positions);
        let idx = match (iq, idx_h) {
            (Some(mut iq), Some((mut g, ckv, cg))) => {
                let id = cfg.index_head_dim;
                for (r, qr) in iq.chunks_mut(cfg.index_heads * id).enumerate() {
                    rope.apply_heads(qr, id, pos0 + r, false);
                    precision.round_index(qr, id);
                }
                let gs = 1.0 / (cfg.index_heads as f32).sqrt();
                g.iter_mut().for_each(|v| *v *= gs);
                Some((iq, g, ckv, cg))
            }
            _ => None,
        };

        // Row by row: update the state with this token, then attend.
        let attention_time = crate::profile::scope(crate::profile::Phase::Attention);
        let ls = &mut state.layers_mut()[li];
        let mut o = vec![0f32; n * nh * hd];
        for r in 0..n {
            let pos = pos0 + r;
            if let Some(log) = log.as_deref_mut() {
                log.before_row(li, pos, ls);
            }
            ls.push_raw(pos, &kv[r * hd..(r + 1) * hd]);
            if let (Some((ckv, cg)), Some(cw), Some(cs)) = (&comp, &lw.compressor, ls.compressor.as_mut()) {
                compress_step(cs, pos, ckv, cg, &cw.ape, &cw.norm, r, cfg.rms_eps, rope, |row| {
                    precision.round_kv(row, cfg.rope_dim)
                });
            }
            if let (Some((_, _, ckv, cg)), Some(iw), Some(is)) = (&idx, &lw.indexer, ls.indexer.as_mut()) {
                let id = cfg.index_head_dim;
                compress_step(is, pos, ckv, cg, &iw.compressor.ape, &iw.compressor.norm, r, cfg.rms_eps, rope, |row| {
                    precision.round_index(row, id)
                });
            }

            let mut keys: Vec<&[f32]> = raw_range(pos, ls.window).map(|p| ls.raw(p)).collect();
            if let Some(cs) = &ls.compressor {
                let n_vis = visible_compressed(pos, spec.ratio).min(cs.rows.len());
                match (spec.kind, &idx, &ls.indexer) {
                    (AttentionKind::Csa, Some((iq, g, _, _)), Some(is)) => {
                        let id = cfg.index_head_dim;
                        let ih = cfg.index_heads;
                        let sel = indexer::select(
                            &iq[r * ih * id..(r + 1) * ih * id],
                            &g[r * ih..(r + 1) * ih],
                            &is.rows,
                            n_vis.min(is.rows.len()),
                            cfg.index_topk,
                        );
                        keys.extend(sel.into_iter().map(|w| cs.rows.row(w)));
                    }
                    _ => keys.extend((0..n_vis).map(|w| cs.rows.row(w))),
                }
            }
            let orow = &mut o[r * nh * hd..(r + 1) * nh * hd];
            attend(&q[r * nh * hd..(r + 1) * nh * hd], &keys, &lw.sinks, hd, orow);
            rope.apply_heads(orow, hd, pos, true);
        }
        drop(attention_time);

        output_projection(ops, cfg, lw, &o)
    }
}

/// DSpark's capture of one row: the mean of its streams (`streams` holds them one after the
/// other, each `out.len()` wide), added to `out` (zeroed) in stream order.
pub(crate) fn mean_of_streams(streams: &[f32], out: &mut [f32]) {
    let hc = streams.len() / out.len();
    for stream in streams.chunks(out.len()) {
        for (o, v) in out.iter_mut().zip(stream) {
            *o += v;
        }
    }
    out.iter_mut().for_each(|o| *o /= hc as f32);
}

/// The grouped low-rank output projection of attention outputs `o` (`n` rows of
/// `n_heads * head_dim`): group g's heads through rows `g*R..` of `o_a`, then `o_b`.
pub(crate) fn output_projection(
    ops: Ops<'_>,
    cfg: &crate::ModelConfig,
    lw: &LayerWeights,
    o: &[f32],
) -> Result<Vec<f32>> {
    let (nh, hd) = (cfg.n_heads, cfg.head_dim);
    let n = o.len() / (nh * hd);
    let (groups, rank) = (cfg.o_groups, cfg.o_lora_rank);
    let gin = nh * hd / groups;
    let mats: Vec<Mat> =
        (0..groups).map(|g| Mat { n_out: rank, start: lw.o_a.start + g * rank * lw.o_a.row_bytes, ..lw.o_a }).collect();
    let xs: Vec<Vec<f32>> = (0..groups)
        .map(|g| (0..n).flat_map(|r| o[r * nh * hd + g * gin..r * nh * hd + (g + 1) * gin].iter().copied()).collect())
        .collect();
    let specs: Vec<(&Mat, &[f32])> = mats.iter().zip(&xs).map(|(m, x)| (m, x.as_slice())).collect();
    let ys = ops.matmul_many(&specs)?;
    let mut u = vec![0f32; n * groups * rank];
    for (g, yg) in ys.iter().enumerate() {
        for r in 0..n {
            u[r * groups * rank + g * rank..r * groups * rank + (g + 1) * rank]
                .copy_from_slice(&yg[r * rank..(r + 1) * rank]);
        }
    }
    ops.matmul(&lw.o_b, &u)
}

/// Feeds row `r` of a compressor's projections to its state; an emitted row is normalized,
/// rotated at its window's first position, rounded to the storage precision and appended.
#[allow(clippy::too_many_arguments)]
pub(crate) fn compress_step(
    cs: &mut CompressorState,
    pos: usize,
    kv: &[f32],
    gate: &[f32],
    ape: &[f32],
    norm: &[f32],
    r: usize,
    eps: f32,
    rope: &crate::model::rope::Rope,
    round: impl Fn(&mut [f32]),
) {
    let pw = cs.proj_width();
    let slot = pos % cs.ratio;
    let score: Vec<f32> =
        gate[r * pw..(r + 1) * pw].iter().zip(&ape[slot * pw..(slot + 1) * pw]).map(|(g, a)| g + a).collect();
    let mut row = vec![0f32; cs.width];
    if cs.push(pos, &kv[r * pw..(r + 1) * pw], &score, &mut row) {
        crate::backend::cpu::rms_norm(&mut row, norm, eps);
        rope.apply(&mut row, pos + 1 - cs.ratio, false);
        round(&mut row);
        cs.rows.push(&row);
    }
}
