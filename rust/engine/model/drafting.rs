//! Running the model drafters: keeping their window rows up to date as the target commits
//! tokens ([`Model::draft_advance`], called by the forward pass) and proposing tokens from the
//! committed state ([`Model::propose`], which changes nothing).

use crate::backend::cpu::rms_norm;
use crate::backend::Ops;
use crate::model::attention::raw_range;
use crate::model::block::{kv_rows, window_block};
use crate::model::draft::{DSparkWeights, DraftKind, DraftModel, MtpInput, MtpPairing, MtpWeights};
use crate::model::{hyper, Model};
use crate::sampling::{Distribution, Sampler};
use crate::state::{BatchLog, DraftLog, DraftState, LayerState, State};
use crate::{Error, Result};

/// What a model drafter proposes after the committed prefix and an anchor token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Proposal {
    /// Proposed tokens, the first one to follow the anchor.
    pub tokens: Vec<u32>,
    /// One row of `vocab` logits per token, the one it was chosen from (after the Markov
    /// bias for DSpark).
    pub logits: Vec<f32>,
    /// DSpark: the confidence logit of each token (sigmoid = predicted acceptance).
    pub confidence: Option<Vec<f32>>,
    /// DSpark: the logits before the Markov bias.
    pub base_logits: Option<Vec<f32>>,
    /// DSpark: the unnormalized hidden row of each token (the HC head's output).
    pub hidden: Option<Vec<f32>>,
    /// When the tokens were sampled (temperature > 0), the distribution each was drawn from.
    pub dists: Option<Vec<Distribution>>,
}

/// How a drafter picks each token from its logits: the argmax, or a draw from the filtered
/// distribution of a (non-greedy) sampler, whose `q` is kept for exact rejection sampling.
pub(crate) struct Chooser<'a> {
    sampler: Option<&'a mut Sampler>,
    dists: Vec<Distribution>,
}

impl<'a> Chooser<'a> {
    pub(crate) fn new(sampler: Option<&'a mut Sampler>) -> Self {
        Chooser { sampler: sampler.filter(|s| !s.params().is_greedy()), dists: Vec::new() }
    }

    /// Whether each token is the argmax (no sampler, or a greedy one).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn is_greedy(&self) -> bool {
        self.sampler.is_none()
    }

    pub(crate) fn choose(&mut self, logits: &[f32]) -> Result<u32> {
        match self.sampler.as_deref_mut() {
            None => Ok(argmax(logits)),
            Some(s) => {
                let q = s.distribution(logits)?;
                let t = s.sample_from(&q);
                self.dists.push(q);
                Ok(t)
            }
        }
    }

    pub(crate) fn finish(self, out: &mut Proposal) {
        if self.sampler.is_some() {
            out.dists = Some(self.dists);
        }
    }
}

/// The index of the largest value, the lowest index among equals: where a sequential scan
/// that moves only to a strictly larger value ends (a NaN never wins, except at index 0).
pub(crate) fn argmax(row: &[f32]) -> u32 {
    crate::sampling::filters::first_max(row).0 as u32
}

impl DraftModel {
    fn ops<'a>(&'a self, model: &'a Model) -> Ops<'a> {
        Ops { raw: self.file.raw(), backend: &*model.backend }
    }

    /// A fresh drafter state for a session of `model`.
    pub(crate) fn new_state(&self, model: &Model) -> DraftState {
        let cfg = &model.config;
        let ring = || LayerState::new(cfg.window, cfg.head_dim, None, None);
        match &self.kind {
            DraftKind::Mtp(_) => DraftState::Mtp { ring: Box::new(ring()), pending: Vec::new() },
            DraftKind::DSpark(w) => DraftState::DSpark { rings: w.stages.iter().map(|_| ring()).collect() },
        }
    }
}

impl Model {
    /// The MTP block's input streams for each `(h, token)` pair: per stream
    /// `e_proj · enorm(E[τ]) + h_proj · hnorm(H_s)`.
    fn mtp_inputs(&self, dm: &DraftModel, w: &MtpWeights, pairs: &[(&[f32], u32)]) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let (d, hc, eps) = (cfg.hidden, cfg.hc_mult, cfg.rms_eps);
        let m = pairs.len();
        let dops = dm.ops(self);
        let mut e = vec![0f32; m * d];
        let mut hn = vec![0f32; m * hc * d];
        for (r, &(h, t)) in pairs.iter().enumerate() {
            let er = &mut e[r * d..(r + 1) * d];
            self.embed_row(t, er)?;
            rms_norm(er, &w.enorm, eps);
            for s in 0..hc {
                let hs = &mut hn[(r * hc + s) * d..(r * hc + s + 1) * d];
                hs.copy_from_slice(&h[s * d..(s + 1) * d]);
                rms_norm(hs, &w.hnorm, eps);
            }
        }
        let mut x = vec![0f32; m * hc * d];
        match &w.input {
            MtpInput::Split { e_proj, h_proj } => {
                let outs = dops.matmul_many(&[(e_proj, &e), (h_proj, &hn)])?;
                for r in 0..m {
                    for s in 0..hc {
                        let k = (r * hc + s) * d;
                        for i in 0..d {
                            x[k + i] = outs[0][r * d + i] + outs[1][k + i];
                        }
                    }
                }
            }
            MtpInput::Fused { eh_proj } => {
                let mut cat = vec![0f32; m * hc * 2 * d];
                for r in 0..m {
                    for s in 0..hc {
                        let k = (r * hc + s) * 2 * d;
                        cat[k..k + d].copy_from_slice(&e[r * d..(r + 1) * d]);
                        cat[k + d..k + 2 * d].copy_from_slice(&hn[(r * hc + s) * d..(r * hc + s + 1) * d]);
                    }
                }
                x = dops.matmul(eh_proj, &cat)?;
            }
        }
        Ok(x)
    }

    /// The positions of the drafter rows a step of `n` rows at `pos0..` adds: MTP's rows lag
    /// the trunk's by one in DeepSeek's pairing (the first pairs the pending streams, if any,
    /// with the step's first token), DSpark's do not. Empty without a drafter state.
    pub(crate) fn draft_positions(&self, state: &State, pos0: usize, n: usize) -> Vec<usize> {
        let (Some(dm), Some(ds)) = (&self.draft, state.draft.as_ref()) else { return Vec::new() };
        match (dm.pairing, ds) {
            (MtpPairing::Next, DraftState::Mtp { pending, .. }) => {
                let first = if pending.is_empty() { pos0 } else { pos0 - 1 };
                (first..pos0 + n - 1).collect()
            }
            _ => (pos0..pos0 + n).collect(),
        }
    }

    /// Brings the drafter rows up to date after the trunk evaluated `tokens` at `pos0..`:
    /// `x` holds each row's final HC streams, `captured` (DSpark) each row's averaged
    /// target-layer outputs. Every row written is logged for [`State::keep_prefix`].
    pub(crate) fn draft_advance(
        &self,
        state: &mut State,
        x: &[f32],
        captured: &[f32],
        tokens: &[u32],
        pos0: usize,
        log: Option<&mut BatchLog>,
    ) -> Result<()> {
        let rows = self.draft_rows(state, x, captured, tokens, pos0)?;
        self.draft_store(state, tokens.len(), x, &rows, pos0, log)
    }

    /// What a step of the trunk that leaves the drafter out (a prompt's rows before its last
    /// [`DraftState::refill_rows`], `crate::session`'s `prompt_chunks`) does to the drafter
    /// state: MTP keeps the step's last streams `last` (one row of HC streams) as the pending
    /// ones, as [`Model::draft_store`] would; the rings keep what they had, every slot of them
    /// written again by the prompt's last rows. Fails, changing nothing, on streams of the
    /// wrong shape.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn draft_skip(&self, state: &mut State, last: &[f32]) -> Result<()> {
        let cfg = &self.config;
        if let (Some(_), Some(DraftState::Mtp { pending, .. })) = (&self.draft, state.draft.as_mut()) {
            if last.len() != cfg.hc_mult * cfg.hidden {
                return Err(Error::invalid("draft_skip: the streams are not one row's (internal)"));
            }
            pending.clear();
            pending.extend_from_slice(last);
        }
        Ok(())
    }

    /// The K=V rows a step adds to each drafter ring (`rows[ring]`, one row of `head_dim` per
    /// position of [`Model::draft_positions`]), computed on the host with the backend's
    /// products. Changes nothing.
    fn draft_rows(
        &self,
        state: &State,
        x: &[f32],
        captured: &[f32],
        tokens: &[u32],
        pos0: usize,
    ) -> Result<Vec<Vec<f32>>> {
        let (Some(dm), Some(ds)) = (&self.draft, state.draft.as_ref()) else { return Ok(Vec::new()) };
        let cfg = &self.config;
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let n = tokens.len();
        let precision = state.precision;
        let dops = dm.ops(self);
        let positions = self.draft_positions(state, pos0, n);
        match (&dm.kind, ds) {
            (DraftKind::Mtp(w), DraftState::Mtp { pending, .. }) => {
                let rows: Vec<&[f32]> = x.chunks(hc * d).collect();
                let mut pairs: Vec<(&[f32], u32)> = Vec::new();
                match dm.pairing {
                    MtpPairing::Next => {
                        if !pending.is_empty() {
                            pairs.push((pending.as_slice(), tokens[0]));
                        }
                        pairs.extend((0..n - 1).map(|r| (rows[r], tokens[r + 1])));
                    }
                    MtpPairing::Same => pairs.extend(rows.iter().copied().zip(tokens.iter().copied())),
                }
                if pairs.is_empty() {
                    return Ok(vec![Vec::new()]);
                }
                let xin = self.mtp_inputs(dm, w, &pairs)?;
                let (mut y, _) = hyper::pre(dops, &w.block.hc_attn, &xin, cfg)?;
                crate::backend::cpu::rms_norm_rows(&mut y, &w.block.attn_norm, cfg.rms_eps);
                Ok(vec![kv_rows(dops, cfg, &w.block, &dm.rope, precision, &y, &positions)?])
            }
            (DraftKind::DSpark(w), DraftState::DSpark { .. }) => {
                let mut main_x = dops.matmul(&w.main_proj, captured)?;
                crate::backend::cpu::rms_norm_rows(&mut main_x, &w.main_norm, cfg.rms_eps);
                w.stages
                    .iter()
                    .map(|stage| kv_rows(dops, cfg, stage, &dm.rope, precision, &main_x, &positions))
                    .collect()
            }
            _ => Err(Error::invalid("the session's drafter state does not match the model's drafter")),
        }
    }

    /// Writes the drafter rows of a step of `n` rows of the trunk at `pos0..` (`rows[ring]` at
    /// [`Model::draft_positions`], from [`Model::draft_rows`] or the device) into the session's
    /// rings and, for MTP, keeps the step's last streams of `x` (its rows of HC streams; DSpark
    /// does not read it) as the pending ones. Logs what it overwrote when `log` is given. Fails,
    /// changing nothing, on rows of the wrong shape.
    pub(crate) fn draft_store(
        &self,
        state: &mut State,
        n: usize,
        x: &[f32],
        rows: &[Vec<f32>],
        pos0: usize,
        log: Option<&mut BatchLog>,
    ) -> Result<()> {
        let Some(dm) = &self.draft else { return Ok(()) };
        let cfg = &self.config;
        let (d, hc, hd) = (cfg.hidden, cfg.hc_mult, cfg.head_dim);
        let is_mtp = match (&dm.kind, &state.draft) {
            (_, None) => return Ok(()),
            (DraftKind::Mtp(_), Some(DraftState::Mtp { .. })) => true,
            (DraftKind::DSpark(_), Some(DraftState::DSpark { .. })) => false,
            _ => return Err(Error::invalid("the session's drafter state does not match the model's drafter")),
        };
        if n == 0 || (is_mtp && x.len() != n * hc * d) {
            return Err(Error::invalid("draft_store: the streams are not the step's rows (internal)"));
        }
        let positions = self.draft_positions(state, pos0, n);
        let Some(ds) = state.draft.as_mut() else { return Ok(()) };
        let rings = ds.rings_mut();
        if rows.len() != rings.len() || rows.iter().any(|r| r.len() != positions.len() * hd) {
            return Err(Error::invalid("draft_store: drafter rows of the wrong shape (internal)"));
        }
        let mut dlog = DraftLog::default();
        for (s, (ring, kv)) in rings.into_iter().zip(rows).enumerate() {
            for (row, &p) in kv.chunks(hd).zip(&positions) {
                if log.is_some() {
                    dlog.written.push((s, p, ring.raw(p).to_vec()));
                }
                ring.push_raw(p, row);
            }
        }
        if let DraftState::Mtp { pending, .. } = ds {
            if dm.pairing == MtpPairing::Next {
                dlog.lag = 1;
            }
            if log.is_some() {
                dlog.hs.push(std::mem::take(pending));
                dlog.hs.extend(x.chunks(hc * d).map(<[f32]>::to_vec));
            }
            *pending = x[(n - 1) * hc * d..].to_vec();
        }
        if let Some(log) = log {
            log.draft = Some(dlog);
        }
        Ok(())
    }

    /// What the model's drafter proposes after the committed state `state` and `anchor` (the
    /// token that follows it), at most `k` tokens: argmax tokens, or with a non-greedy
    /// `sampler`, tokens drawn from its filtered distribution of the drafter's logits (drawing
    /// from the sampler's stream; the distributions are returned). Changes nothing else.
    pub fn propose(&self, state: &State, anchor: u32, k: usize, sampler: Option<&mut Sampler>) -> Result<Proposal> {
        let dm =
            self.draft.as_ref().ok_or_else(|| Error::invalid("this model has no drafter (load one with draft=...)"))?;
        self.check_anchor(anchor)?;
        if state.pos == 0 || k == 0 {
            return Ok(Proposal::default());
        }
        match (&dm.kind, state.draft.as_ref()) {
            (DraftKind::Mtp(w), Some(DraftState::Mtp { ring, pending })) => {
                self.propose_mtp(dm, w, ring, pending, state, anchor, k, Chooser::new(sampler))
            }
            (DraftKind::DSpark(w), Some(DraftState::DSpark { rings })) => {
                self.propose_dspark(dm, w, rings, state, anchor, k, Chooser::new(sampler))
            }
            _ => Err(Error::invalid("the session was created without the model's drafter state")),
        }
    }

    /// An error unless `anchor` is a token of the vocabulary.
    pub(crate) fn check_anchor(&self, anchor: u32) -> Result<()> {
        if anchor as usize >= self.config.vocab {
            return Err(Error::invalid(format!("anchor {anchor} is outside the vocabulary of {}", self.config.vocab)));
        }
        Ok(())
    }

    /// The logits of the drafter head for HC streams `x`: its HC head, its norm, the
    /// target's output matrix. Also returns the unnormalized head output.
    fn draft_head(
        &self,
        dm: &DraftModel,
        head: &crate::model::weights::HyperWeights,
        norm: &[f32],
        from_target: bool,
        x: &[f32],
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let cfg = &self.config;
        let hops = if from_target { self.ops() } else { dm.ops(self) };
        let h = hyper::head(hops, head, x, cfg.hc_mult, cfg.hidden, cfg.rms_eps, cfg.hc_eps)?;
        let mut y = h.clone();
        crate::backend::cpu::rms_norm_rows(&mut y, norm, cfg.rms_eps);
        Ok((self.ops().matmul(&self.weights.output, &y)?, h))
    }

    #[allow(clippy::too_many_arguments)]
    fn propose_mtp(
        &self,
        dm: &DraftModel,
        w: &MtpWeights,
        ring: &LayerState,
        pending: &[f32],
        state: &State,
        anchor: u32,
        k: usize,
        mut chooser: Chooser<'_>,
    ) -> Result<Proposal> {
        let cfg = &self.config;
        let p = state.pos - 1;
        let dops = dm.ops(self);
        // Rows in the ring: positions < p for DeepSeek's pairing (row p waits for the anchor),
        // <= p for ds4's.
        let ring_end = match dm.pairing {
            MtpPairing::Next => p,
            MtpPairing::Same => p + 1,
        };
        let mut out = Proposal::default();
        let mut transient: Vec<(usize, Vec<f32>)> = Vec::new();
        // Step inputs: the trunk state with the anchor (DeepSeek) or with the last token,
        // whose output is then chained with the anchor (ds4).
        let (mut h, mut tok, mut pos) = match dm.pairing {
            MtpPairing::Next => (pending.to_vec(), anchor, p),
            MtpPairing::Same => (pending.to_vec(), state.tokens[p], p),
        };
        let mut first = true;
        while out.tokens.len() < k {
            let xin = self.mtp_inputs(dm, w, &[(&h, tok)])?;
            let mut ctx: Vec<&[f32]> = Vec::new();
            for q in raw_range(pos, cfg.window) {
                if q == pos {
                    break;
                }
                if q < ring_end {
                    ctx.push(ring.raw(q));
                } else if let Some((_, row)) = transient.iter().find(|(tp, _)| *tp == q) {
                    ctx.push(row);
                }
            }
            let (xo, kv) = window_block(dops, cfg, &dm.spec, &w.block, &dm.rope, state.precision, &xin, &[pos], &ctx)?;
            transient.push((pos, kv));
            let chained_anchor = dm.pairing == MtpPairing::Same && first;
            first = false;
            h = xo;
            pos += 1;
            if chained_anchor {
                // ds4's pairing: the first step re-derives the last position's output; the
                // anchor is then fed to it like a draft.
                tok = anchor;
                continue;
            }
            let (logits, _) = self.draft_head(dm, &w.hc_head, &w.norm, w.head_from_target, &h)?;
            tok = chooser.choose(&logits)?;
            out.tokens.push(tok);
            out.logits.extend_from_slice(&logits);
        }
        chooser.finish(&mut out);
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn propose_dspark(
        &self,
        dm: &DraftModel,
        w: &DSparkWeights,
        rings: &[LayerState],
        state: &State,
        anchor: u32,
        k: usize,
        chooser: Chooser<'_>,
    ) -> Result<Proposal> {
        let cfg = &self.config;
        let (d, hc) = (cfg.hidden, cfg.hc_mult);
        let b = w.block_size;
        let p = state.pos - 1;
        let dops = dm.ops(self);
        let positions: Vec<usize> = (p + 1..p + 1 + b).collect();
        let mut x = vec![0f32; b * hc * d];
        let mut e = vec![0f32; d];
        for r in 0..b {
            self.embed_row(if r == 0 { anchor } else { w.noise_token }, &mut e)?;
            for s in 0..hc {
                x[(r * hc + s) * d..(r * hc + s + 1) * d].copy_from_slice(&e);
            }
        }
        for (stage, ring) in w.stages.iter().zip(rings) {
            let ctx: Vec<&[f32]> = raw_range(p, cfg.window).map(|q| ring.raw(q)).collect();
            x = window_block(dops, cfg, &dm.spec, stage, &dm.rope, state.precision, &x, &positions, &ctx)?.0;
        }
        let (base, h) = self.draft_head(dm, &w.hc_head, &w.norm, false, &x)?;
        self.dspark_choose(dm, w, &base, &h, anchor, k, chooser)
    }

    /// DSpark's proposal from its block's head: `base` the logits of each block row before the
    /// Markov bias, `h` its unnormalized hidden row. Row by row: the Markov bias of the previous
    /// token, the confidence, the chosen token (the host's or a device's block before it).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dspark_choose(
        &self,
        dm: &DraftModel,
        w: &DSparkWeights,
        base: &[f32],
        h: &[f32],
        anchor: u32,
        k: usize,
        mut chooser: Chooser<'_>,
    ) -> Result<Proposal> {
        let cfg = &self.config;
        let (d, b) = (cfg.hidden, w.block_size);
        let dops = dm.ops(self);
        let v = cfg.vocab;
        let k = k.min(b);
        let mut out = Proposal {
            base_logits: Some(base[..k * v].to_vec()),
            hidden: Some(h[..k * d].to_vec()),
            ..Default::default()
        };
        let mut conf = Vec::new();
        let mut prev = anchor;
        let mut emb = vec![0f32; w.markov_rank];
        for r in 0..k {
            let mut row = base[r * v..(r + 1) * v].to_vec();
            if let (Some(w1), Some(w2)) = (&w.markov_w1, &w.markov_w2) {
                crate::quant::dequantize(w1.ty, w1.row(dm.file.raw(), prev as usize), &mut emb)?;
                let bias = dops.matmul(w2, &emb)?;
                for (l, b) in row.iter_mut().zip(&bias) {
                    *l += b;
                }
            }
            if let Some(cw) = &w.confidence {
                let mut inp = h[r * d..(r + 1) * d].to_vec();
                inp.extend_from_slice(&emb);
                conf.push(dops.matmul(cw, &inp)?[0]);
            }
            prev = chooser.choose(&row)?;
            out.tokens.push(prev);
            out.logits.extend_from_slice(&row);
        }
        if w.confidence.is_some() {
            out.confidence = Some(conf);
        }
        chooser.finish(&mut out);
        Ok(out)
    }
}
