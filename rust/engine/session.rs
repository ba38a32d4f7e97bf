//! A session: one sequence being decoded, with its state.

use std::sync::{Arc, Weak};

use crate::backend::{DeviceDecoder, Greedy};
use crate::model::draft::DraftKind;
use crate::model::{DraftModel, Logits, Model, ModelConfig, Proposal};
use crate::sampling::{Sampler, SamplingParams};
use crate::state::{BatchLog, KvPrecision, State};
use crate::{Error, Result};

/// A saved session state; [`Session::restore`] brings the session back to it bit for bit.
#[derive(Clone, Debug)]
pub struct Snapshot {
    state: State,
    sampler: Option<Sampler>,
    last_greedy: Option<u32>,
    /// The model of the session it was taken on, and its config: a state's shapes are its
    /// model's. Weak, so that a snapshot does not keep the model (its GPU memory) alive; it
    /// keeps the allocation, so no other model can take its address.
    model: Weak<Model>,
    config: ModelConfig,
}

impl Snapshot {
    /// The position (tokens processed) at which it was taken.
    pub fn position(&self) -> usize {
        self.state.pos
    }
}

/// The calls of a prompt of `len` rows on a device decoder: calls of up to `big` rows, except
/// that with a drafter (`refill` > 0, [`crate::state::DraftState::refill_rows`]) the last
/// `refill` rows, at least, go in calls of at most `keep` rows
/// ([`DeviceDecoder::draft_rows`]), the first of them at most `small`
/// ([`DeviceDecoder::max_rows`]) when no call comes before them (MTP's first call, without
/// pending streams, keeps the drafter's rows only that small). A longer call may skip the
/// drafter's rings, and every slot of them is written again by those last rows, so the state
/// is bit for bit that of calls of `small` rows throughout (each row's results do not depend
/// on the rows that share its call); only the prompt's time changes (Flash: steps of 16 rows
/// run at about a fifth of the rate of steps of 1024).
fn prompt_chunks(len: usize, big: usize, small: usize, keep: usize, refill: usize) -> Vec<usize> {
    let (big, small) = (big.max(1), small.max(1));
    let keep = keep.clamp(small, big.max(small));
    let head = if refill > 0 && big > small { len.saturating_sub(refill) } else { len };
    let mut sizes: Vec<usize> = std::iter::repeat_n(big, head / big).collect();
    if refill > 0 && head % big > small {
        sizes.push(head % big);
    }
    let mut rest = len - sizes.iter().sum::<usize>();
    if refill > 0 && sizes.is_empty() && rest > 0 {
        sizes.push(rest.min(small));
        rest -= rest.min(small);
    }
    let step = if refill > 0 { keep } else { big };
    while rest > 0 {
        sizes.push(rest.min(step));
        rest -= rest.min(step);
    }
    sizes
}

/// A decoding session over a shared model.
pub struct Session {
    model: Arc<Model>,
    ctx: usize,
    state: State,
    /// The session's sampler and its random stream. It is created from the first sampling
    /// parameters used and keeps its stream across calls: a later call with the same seed
    /// continues the stream (it is never reseeded per call); a call naming another seed
    /// starts that seed's stream.
    sampler: Option<Sampler>,
    /// The greedy token after the last evaluated position, when the last call computed its
    /// logits and the model has a drafter (the default anchor of [`Session::propose`]).
    last_greedy: Option<u32>,
    /// The backend's device decoder, when it has one for this model (made at the first
    /// evaluation): the whole forward pass on the device, the state mirrored there.
    decoder: Option<Box<dyn DeviceDecoder>>,
    decoder_tried: bool,
    /// How many times the state changed (evaluations, verifies, cuts, restores, resets): see
    /// [`Session::changes`].
    changes: u64,
}

impl Session {
    /// A fresh session holding at most `ctx` tokens, with attention state stored at
    /// `precision`.
    pub fn new(model: Arc<Model>, ctx: usize, precision: KvPrecision) -> Result<Self> {
        if ctx == 0 {
            return Err(Error::invalid("the context size must be at least 1"));
        }
        if ctx > model.config.context_length {
            return Err(Error::invalid(format!(
                "a context of {ctx} exceeds the model's maximum of {}",
                model.config.context_length
            )));
        }
        let id = model.config.index_head_dim;
        if precision == KvPrecision::Fp8 && id != 0 && (!id.is_power_of_two() || !id.is_multiple_of(32)) {
            return Err(Error::invalid(format!(
                "fp8 state needs an indexer head dim that is a power of two and a multiple of 32, not {id}"
            )));
        }
        let mut state = State::new(&model.config, precision);
        state.draft = model.draft.as_ref().map(|dm| dm.new_state(&model));
        Ok(Session {
            model,
            ctx,
            state,
            sampler: None,
            last_greedy: None,
            decoder: None,
            decoder_tried: false,
            changes: 0,
        })
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens processed so far.
    pub fn position(&self) -> usize {
        self.state.pos
    }

    /// The context size.
    pub fn context(&self) -> usize {
        self.ctx
    }

    /// The token ids processed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.state.tokens
    }

    /// Checks that `tokens` can be evaluated without changing anything.
    pub fn check(&self, tokens: &[u32]) -> Result<()> {
        let vocab = self.model.config.vocab;
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::invalid(format!("token id {t} is outside the vocabulary of {vocab}")));
        }
        let needed = self.state.pos + tokens.len();
        if needed > self.ctx {
            return Err(Error::ContextOverflow { needed, capacity: self.ctx });
        }
        Ok(())
    }

    /// Evaluates `tokens` (advancing the session) and returns the logits of the requested
    /// rows, `rows * vocab` floats. On error nothing changes.
    pub fn eval(&mut self, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.check(tokens)?;
        if tokens.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self.evaluate(tokens, which, logits_pass, |mut earlier, rows| {
            earlier.extend(rows);
            earlier
        })?;
        let v = self.model.config.vocab;
        // Only a drafter's proposal reads it (the default anchor).
        self.last_greedy = (which != Logits::None && self.model.draft.is_some())
            .then(|| crate::model::drafting::argmax(&logits[logits.len() - v..]));
        Ok(logits)
    }

    /// [`Session::eval`] for the greedy token after the last of `tokens` rather than its
    /// logits (greedy decoding: see [`DeviceDecoder::forward_argmax`]): one id, or that row's
    /// logits when it has no greedy token. On error nothing changes.
    pub fn eval_argmax(&mut self, tokens: &[u32]) -> Result<Greedy> {
        self.check(tokens)?;
        if tokens.is_empty() {
            return Ok(Greedy::Ids(Vec::new()));
        }
        // Only the last chunk of a long batch has a requested row, so `earlier` is empty.
        let greedy = self.evaluate(tokens, Logits::Last, greedy_pass, |_, rows| rows)?;
        let anchor = greedy.last_argmax(self.model.config.vocab);
        self.last_greedy = anchor.filter(|_| self.model.draft.is_some());
        Ok(greedy)
    }

    /// How many times the state has changed so far. A caller holding a verify's log can tell
    /// whether it is still the last batch (the count the verify left) before it cuts with
    /// [`Session::keep`]: the log's position check alone would pass after a restore to a state
    /// of the same length, and the cut would then undo rows the log never wrote.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Evaluates `tokens` on the device decoder or the host, changing nothing on error: `pass`
    /// runs one pass, `join` puts the logits of earlier chunks of a long batch before the
    /// last chunk's rows. `tokens` is checked and not empty.
    fn evaluate<T>(
        &mut self,
        tokens: &[u32],
        which: Logits,
        pass: Pass<T>,
        join: impl FnOnce(Vec<f32>, T) -> T,
    ) -> Result<T> {
        self.ensure_decoder()?;
        self.changes += 1;
        let device_rows = self.decoder.as_ref().map_or(0, |d| d.max_rows());
        if tokens.len() <= device_rows || (device_rows == 0 && tokens.len() <= crate::spec::MAX_DRAFT + 1) {
            // Decode-sized batches run in place with a log of what each row overwrites (a few
            // KB a layer), undone if the pass fails half-way.
            return Ok(self.run_logged(tokens, which, pass)?.0);
        }
        // Longer batches work on a copy (it shares the compressed rows, so it costs the
        // bounded state only, small next to the batch), so that a failure changes nothing; on
        // the device, in chunks of the most rows it takes.
        // (Pending device writes made first, once: the copy would share them, and both states
        // would make them.)
        self.state.flush();
        let mut next = self.state.clone();
        let out = match self.decoder.as_deref_mut() {
            Some(dec) => {
                // With a drafter, the prompt's last rows in calls that keep the drafter's rings
                // (`DeviceDecoder::draft_rows`); the rows before them in a prompt's full steps,
                // which may skip it.
                let refill = next.draft.as_ref().filter(|_| self.model.draft.is_some()).map_or(0, |d| d.refill_rows());
                let big = dec.prefill_rows().max(device_rows);
                let sizes = prompt_chunks(tokens.len(), big, device_rows, dec.draft_rows(), refill);
                let mut chunks: Vec<&[u32]> = Vec::with_capacity(sizes.len());
                let mut rest = tokens;
                for &k in &sizes {
                    let (c, r) = rest.split_at(k);
                    chunks.push(c);
                    rest = r;
                }
                let (last, earlier) = chunks.split_last().ok_or_else(|| Error::invalid("no tokens to evaluate"))?;
                // Every chunk of a long batch, the last too, is a prompt's step for the device.
                dec.set_prefill(true);
                let run = || -> Result<T> {
                    let mut logits = Vec::new();
                    for chunk in earlier {
                        let w = if which == Logits::All { Logits::All } else { Logits::None };
                        logits.extend(dec.forward(&self.model, &mut next, chunk, w, None)?);
                    }
                    Ok(join(logits, pass(Some(&mut *dec), &self.model, &mut next, last, which, None)?))
                };
                let out = run();
                dec.set_prefill(false);
                out?
            }
            None => pass(None, &self.model, &mut next, tokens, which, None)?,
        };
        self.state = next;
        Ok(out)
    }

    /// Evaluates `tokens` like [`Session::eval`] with every row's logits, keeping what is
    /// needed to cut the state back to any prefix of them with [`Session::keep`].
    pub fn verify(&mut self, tokens: &[u32]) -> Result<(Vec<f32>, BatchLog)> {
        self.verify_with(tokens, logits_pass)
    }

    /// [`Session::verify`] for the greedy token of every row rather than its logits (a
    /// temperature-0 verify: see [`DeviceDecoder::forward_argmax`]): one id per row, or every
    /// row's logits when some row has no greedy token.
    pub fn verify_argmax(&mut self, tokens: &[u32]) -> Result<(Greedy, BatchLog)> {
        self.verify_with(tokens, greedy_pass)
    }

    fn verify_with<T>(&mut self, tokens: &[u32], pass: Pass<T>) -> Result<(T, BatchLog)> {
        self.check(tokens)?;
        let most = self.max_verify()?;
        if tokens.is_empty() || tokens.len() > most {
            let why = if self.decoder.is_some() {
                "the rows of one device step, so that every row is bitwise a single decode's"
            } else {
                "the rings keep that many spare slots"
            };
            return Err(Error::invalid(format!("verify takes 1..={most} tokens ({why}), not {}", tokens.len())));
        }
        self.changes += 1;
        let out = self.run_logged(tokens, Logits::All, pass)?;
        self.last_greedy = None;
        Ok(out)
    }

    /// The most tokens one [`Session::verify`] takes: with a device decoder, the rows of one of
    /// its steps (at most [`crate::spec::MAX_DRAFT`] + 1), else `MAX_DRAFT` + 1. A longer batch
    /// would run on the host forward pass, whose sums are not the device's, so a verify's rows
    /// would no longer be bitwise the single decodes that plain decoding runs; generation
    /// drafts at most one token fewer.
    pub fn max_verify(&mut self) -> Result<usize> {
        self.ensure_decoder()?;
        let most = crate::spec::MAX_DRAFT + 1;
        Ok(self.decoder.as_ref().map_or(most, |d| d.max_rows().min(most)))
    }

    /// Runs `tokens` in place, on the device decoder when it takes that many rows, else on the
    /// host, logging what each row overwrites; a failure half-way is undone from the log.
    fn run_logged<T>(&mut self, tokens: &[u32], which: Logits, pass: Pass<T>) -> Result<(T, BatchLog)> {
        let mut log = BatchLog::new(self.state.pos, tokens.len(), self.state.n_layers());
        let dec: Option<&mut dyn DeviceDecoder> = match self.decoder.as_mut() {
            Some(d) if tokens.len() <= d.max_rows() => Some(&mut **d),
            _ => None,
        };
        match pass(dec, &self.model, &mut self.state, tokens, which, Some(&mut log)) {
            Ok(rows) => Ok((rows, log)),
            Err(e) => {
                self.state.rollback(log);
                Err(e)
            }
        }
    }

    /// Keeps the first `keep` rows of the batch just verified: afterwards the session is bit
    /// for bit as if only those tokens had been evaluated.
    pub fn keep(&mut self, log: BatchLog, keep: usize) -> Result<()> {
        self.changes += 1;
        let tag = self.state.sync;
        self.state.keep_prefix(log, keep)?;
        match self.decoder.as_mut() {
            Some(dec) => dec.kept(&mut self.state, tag, keep),
            None => Ok(()),
        }
    }

    /// Makes the backend's device decoder at the first evaluation, if the backend has one
    /// for this model. A decoder that cannot be made (device memory) leaves the session on
    /// the host forward pass; an invalid setting of the decoder's (a `DS4_CUDA_*` variable
    /// with a value it does not take) is the caller's error, returned by every call until it is
    /// fixed, rather than a silent move to the host.
    fn ensure_decoder(&mut self) -> Result<()> {
        if self.decoder_tried {
            return Ok(());
        }
        let backend = std::sync::Arc::clone(&self.model.backend);
        match backend.decoder(&self.model, self.ctx, self.state.precision) {
            Some(Ok(d)) => self.decoder = Some(d),
            Some(Err(e @ Error::InvalidArgument(_))) => return Err(e),
            Some(Err(_)) | None => {}
        }
        self.decoder_tried = true;
        Ok(())
    }

    /// Which forward pass the session runs: "device" (the whole pass on the GPU) or "host".
    /// Errors as the first evaluation would, for an invalid setting of the device decoder.
    pub fn forward_kind(&mut self) -> Result<&'static str> {
        self.ensure_decoder()?;
        Ok(if self.decoder.is_some() { "device" } else { "host" })
    }

    /// A digest of the whole decode state and the sampler's stream position (tests).
    pub fn digest(&self) -> u64 {
        let rng = self.sampler.as_ref().map_or([0; 4], Sampler::state);
        rng.iter().fold(self.state.digest(), |h, &x| (h ^ x).wrapping_mul(0x100000001b3))
    }

    /// Sets the sampling parameters for the next [`Session::sample`] calls (see the field
    /// doc of the session's sampler for when the random stream is kept).
    pub fn use_sampling(&mut self, params: &SamplingParams) -> Result<()> {
        let mut next = Sampler::new(*params)?;
        if let Some(old) = &self.sampler {
            if old.params().seed == params.seed {
                next.set_state(old.state())?;
            }
        }
        self.sampler = Some(next);
        Ok(())
    }

    /// Samples one token from `logits` with the session's sampler (greedy if none was set).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        self.sampler_mut()?.sample(logits)
    }

    /// The session's sampler (greedy if none was set).
    pub fn sampler_mut(&mut self) -> Result<&mut Sampler> {
        if self.sampler.is_none() {
            self.sampler = Some(Sampler::new(SamplingParams::greedy())?);
        }
        Ok(self.sampler.as_mut().expect("set just above"))
    }

    /// Saves the decode state and the sampler's random stream.
    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            state: self.state.clone(),
            sampler: self.sampler.clone(),
            last_greedy: self.last_greedy,
            model: Arc::downgrade(&self.model),
            config: self.model.config.clone(),
        }
    }

    /// Returns to a snapshot taken on a session of the same model (the same loaded model, or
    /// one of the same config without a drafter), of the same state precision, whose position
    /// fits this session's context. Anything else is refused and changes nothing: its state's
    /// shapes would not be this model's.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        // (A state has drafter state exactly when its model has a drafter.)
        let same_model = Weak::ptr_eq(&snap.model, &Arc::downgrade(&self.model))
            || (snap.config == self.model.config && snap.state.draft.is_none() && self.model.draft.is_none());
        if !same_model || snap.state.draft.is_some() != self.state.draft.is_some() {
            return Err(Error::invalid("the snapshot was taken on a session of another model"));
        }
        if snap.state.precision != self.state.precision || snap.state.pos > self.ctx {
            return Err(Error::invalid(format!(
                "the snapshot ({:?} state at position {}) does not fit this session ({:?} state, context {})",
                snap.state.precision, snap.state.pos, self.state.precision, self.ctx
            )));
        }
        self.changes += 1;
        self.state = snap.state.clone();
        self.sampler = snap.sampler.clone();
        self.last_greedy = snap.last_greedy;
        if let Some(dec) = self.decoder.as_mut() {
            // The device copy follows now; if it cannot, the next step uploads it.
            dec.sync(&mut self.state).ok();
        }
        Ok(())
    }

    /// Back to the empty context (the sampler's stream is kept).
    pub fn reset(&mut self) {
        let mut state = State::new(&self.model.config, self.state.precision);
        state.draft = self.model.draft.as_ref().map(|dm| dm.new_state(&self.model));
        self.state = state;
        self.last_greedy = None;
        self.changes += 1;
    }

    /// What the model's drafter proposes to follow the committed tokens and `anchor` (by
    /// default the target's greedy next token, from the last evaluated logits), at most `k`
    /// tokens (by default the drafter's block: DSpark's block size, one MTP step), each the
    /// argmax of the drafter's logits. Changes nothing.
    pub fn propose(&mut self, anchor: Option<u32>, k: Option<usize>) -> Result<Proposal> {
        let (anchor, k) = self.proposal_args(anchor, k)?;
        self.propose_on(anchor, k, false, true)
    }

    /// [`Session::propose`] for speculation: with a non-greedy sampler the tokens are drawn
    /// from the drafter's distributions (filtered like the target's) with the session's random
    /// stream, and those distributions come back for exact rejection sampling.
    pub(crate) fn propose_for_verify(&mut self, anchor: u32, k: usize) -> Result<Proposal> {
        let (anchor, k) = self.proposal_args(Some(anchor), Some(k))?;
        // A verify reads the tokens (and, sampling, the distributions), not the logits.
        self.propose_on(anchor, k, true, false)
    }

    /// The proposal on the device decoder when it has a path for the drafter, else on the host;
    /// with the session's sampler when `sample`.
    fn propose_on(&mut self, anchor: u32, k: usize, sample: bool, want_logits: bool) -> Result<Proposal> {
        self.model.check_anchor(anchor)?;
        if self.state.pos > 0 && k > 0 {
            self.ensure_decoder()?;
        }
        if let Some(dec) = self.decoder.as_mut() {
            let sampler = if sample { self.sampler.as_mut() } else { None };
            if let Some(out) = dec.propose(&self.model, &self.state, anchor, k, sampler, want_logits) {
                return out;
            }
        }
        let sampler = if sample { self.sampler.as_mut() } else { None };
        self.model.propose(&self.state, anchor, k, sampler)
    }

    fn proposal_args(&self, anchor: Option<u32>, k: Option<usize>) -> Result<(u32, usize)> {
        let dm = self
            .model
            .draft
            .as_ref()
            .ok_or_else(|| Error::invalid("this model has no drafter (load one with draft=...)"))?;
        let anchor = match anchor {
            Some(a) => a,
            None => match self.last_greedy {
                Some(t) => t,
                None => {
                    return Err(Error::invalid(
                        "the session has no logits of its last position to take the anchor from: pass anchor",
                    ))
                }
            },
        };
        let k = k.unwrap_or(match &dm.kind {
            DraftKind::DSpark(w) => w.block_size,
            DraftKind::Mtp(_) => 1,
        });
        if k > crate::spec::MAX_DRAFT {
            return Err(Error::invalid(format!("k = {k} exceeds the most a cycle drafts, {}", crate::spec::MAX_DRAFT)));
        }
        Ok((anchor, k))
    }

    /// The method of the model's drafter ("mtp", "dspark"), if it has one.
    pub fn draft_method(&self) -> Option<&'static str> {
        self.model.draft.as_ref().map(DraftModel::method)
    }

    /// The storage precision of the attention state.
    pub fn precision(&self) -> KvPrecision {
        self.state.precision
    }

    /// Bytes held by the decode state.
    pub fn state_bytes(&self) -> usize {
        self.state.nbytes()
    }
}

/// One forward pass of a batch: on the device decoder when given one, else on the host.
type Pass<T> =
    fn(Option<&mut dyn DeviceDecoder>, &Model, &mut State, &[u32], Logits, Option<&mut BatchLog>) -> Result<T>;

/// A [`Pass`] for the requested rows' logits.
fn logits_pass(
    dec: Option<&mut dyn DeviceDecoder>,
    model: &Model,
    state: &mut State,
    tokens: &[u32],
    which: Logits,
    log: Option<&mut BatchLog>,
) -> Result<Vec<f32>> {
    match dec {
        Some(dec) => dec.forward(model, state, tokens, which, log),
        None => model.forward(state, tokens, which, log),
    }
}

/// A [`Pass`] for the requested rows' greedy tokens.
fn greedy_pass(
    dec: Option<&mut dyn DeviceDecoder>,
    model: &Model,
    state: &mut State,
    tokens: &[u32],
    which: Logits,
    log: Option<&mut BatchLog>,
) -> Result<Greedy> {
    match dec {
        Some(dec) => dec.forward_argmax(model, state, tokens, which, log),
        None => Ok(Greedy::from_logits(model.forward(state, tokens, which, log)?, model.config.vocab)),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::backend::{Backend, Cpu};
    use crate::model::weights::Mat;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The CPU backend, failing the call whose number (counting from 0) is `fail_at`.
    struct Failing {
        calls: AtomicUsize,
        fail_at: AtomicUsize,
    }

    impl Backend for Failing {
        fn name(&self) -> &'static str {
            "failing"
        }

        fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
            if self.calls.fetch_add(1, Ordering::Relaxed) == self.fail_at.load(Ordering::Relaxed) {
                return Err(Error::Backend("injected failure".into()));
            }
            Cpu.matmul_many(raw, specs)
        }
    }

    /// What a [`HostDecoder`] saw, shared with the test.
    #[derive(Default)]
    pub(crate) struct Seen {
        pub(crate) forwards: AtomicUsize,
        pub(crate) fail_at: AtomicUsize,
        /// The forward call whose logits get a NaN (at index 7 of the first row).
        pub(crate) poison_at: AtomicUsize,
        /// Calls of `forward_argmax`, and of those the ones for every row (verifies).
        pub(crate) argmaxes: AtomicUsize,
        pub(crate) argmax_all: AtomicUsize,
        pub(crate) kept: AtomicUsize,
        pub(crate) syncs: AtomicUsize,
        /// Calls that left their writes pending.
        pub(crate) deferred: AtomicUsize,
        /// Whether the calls now are marked a prompt's ([`DeviceDecoder::set_prefill`]), and
        /// the rows of the calls that were.
        pub(crate) prefill: std::sync::atomic::AtomicBool,
        pub(crate) prefill_rows: AtomicUsize,
    }

    impl Seen {
        /// Nothing failing or poisoned.
        pub(crate) fn new() -> Arc<Self> {
            Arc::new(Seen {
                fail_at: AtomicUsize::new(usize::MAX),
                poison_at: AtomicUsize::new(usize::MAX),
                ..Seen::default()
            })
        }
    }

    /// A stand-in device decoder: the host forward pass behind the [`DeviceDecoder`] calls,
    /// taking at most 4 rows a call (6 in a prompt's calls), failing the forward call numbered
    /// `fail_at`, with a NaN in the logits of the one numbered `poison_at`; like the CUDA
    /// decoder, it leaves its writes pending in the state.
    struct HostDecoder(Arc<Seen>);

    /// Pending writes of rows from `pos0`: the layers as each row left them.
    #[derive(Debug)]
    struct Layers {
        pos0: usize,
        after: Vec<Vec<crate::state::LayerState>>,
    }

    impl crate::state::PendingWrites for Layers {
        fn apply(&self, layers: &mut [crate::state::LayerState]) {
            if let Some(last) = self.after.last() {
                layers.clone_from_slice(last);
            }
        }

        fn rows(&self) -> (usize, usize) {
            (self.pos0, self.after.len())
        }

        fn prefix(&self, keep: usize) -> Arc<dyn crate::state::PendingWrites> {
            Arc::new(Layers { pos0: self.pos0, after: self.after[..keep].to_vec() })
        }
    }

    impl DeviceDecoder for HostDecoder {
        fn forward(
            &mut self,
            model: &Model,
            state: &mut State,
            tokens: &[u32],
            which: Logits,
            log: Option<&mut BatchLog>,
        ) -> Result<Vec<f32>> {
            let prefill = self.0.prefill.load(Ordering::Relaxed);
            assert!(tokens.len() <= if prefill { 6 } else { 4 });
            if prefill {
                self.0.prefill_rows.fetch_add(tokens.len(), Ordering::Relaxed);
            }
            let call = self.0.forwards.fetch_add(1, Ordering::Relaxed);
            if call == self.0.fail_at.load(Ordering::Relaxed) {
                return Err(Error::Backend("injected failure".into()));
            }
            // As the CUDA decoder (without a drafter), the layers' writes are left pending:
            // here the layers as each row left them, row by row on a copy.
            let mut logits = if state.draft.is_none() {
                let mut next = state.clone();
                let mut after = Vec::new();
                let mut logits = Vec::new();
                for (r, &t) in tokens.iter().enumerate() {
                    let w = match which {
                        Logits::All => Logits::All,
                        Logits::Last if r + 1 == tokens.len() => Logits::Last,
                        _ => Logits::None,
                    };
                    logits.extend(model.forward(&mut next, &[t], w, None)?);
                    after.push(next.layers_mut().to_vec());
                }
                (state.pos, state.tokens) = (next.pos, std::mem::take(&mut next.tokens));
                state.defer(Arc::new(Layers { pos0: state.pos - tokens.len(), after }));
                if let Some(log) = log {
                    log.layers_pending = true;
                }
                self.0.deferred.fetch_add(1, Ordering::Relaxed);
                logits
            } else {
                model.forward(state, tokens, which, log)?
            };
            if call == self.0.poison_at.load(Ordering::Relaxed) && logits.len() > 7 {
                logits[7] = f32::NAN;
            }
            Ok(logits)
        }

        fn forward_argmax(
            &mut self,
            model: &Model,
            state: &mut State,
            tokens: &[u32],
            which: Logits,
            log: Option<&mut BatchLog>,
        ) -> Result<Greedy> {
            self.0.argmaxes.fetch_add(1, Ordering::Relaxed);
            if which == Logits::All {
                self.0.argmax_all.fetch_add(1, Ordering::Relaxed);
            }
            // The trait's default.
            Ok(Greedy::from_logits(self.forward(model, state, tokens, which, log)?, model.config.vocab))
        }

        fn kept(&mut self, _state: &mut State, _tag: u64, _keep: usize) -> Result<()> {
            self.0.kept.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }

        fn sync(&mut self, _state: &mut State) -> Result<()> {
            self.0.syncs.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }

        fn max_rows(&self) -> usize {
            4
        }

        fn prefill_rows(&self) -> usize {
            6
        }

        fn set_prefill(&mut self, on: bool) {
            self.0.prefill.store(on, Ordering::Relaxed);
        }
    }

    /// The CPU backend offering a [`HostDecoder`].
    pub(crate) struct WithDecoder(pub(crate) Arc<Seen>);

    impl Backend for WithDecoder {
        fn name(&self) -> &'static str {
            "with-decoder"
        }

        fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
            Cpu.matmul_many(raw, specs)
        }

        fn decoder(
            self: Arc<Self>,
            _model: &Model,
            _ctx: usize,
            _precision: KvPrecision,
        ) -> Option<Result<Box<dyn DeviceDecoder>>> {
            Some(Ok(Box::new(HostDecoder(Arc::clone(&self.0)))))
        }
    }

    /// The session's device path (chunks of the decoder's size, failures, cuts, restores)
    /// gives what the host path gives, bit for bit, and tells the decoder about cuts and
    /// restores, and which calls are a prompt's: every chunk of a batch longer than it takes,
    /// never a call it takes whole (a decode step, a verify), the mark cleared after a failure.
    #[test]
    fn the_device_decoder_path_matches_the_host_path() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-l");
        let plain = Arc::new(Model::load(dir.join("llamacpp-f32.gguf")).unwrap());
        let mut m = Model::load(dir.join("llamacpp-f32.gguf")).unwrap();
        let seen = Seen::new();
        m.set_backend(Arc::new(WithDecoder(Arc::clone(&seen))));
        let m = Arc::new(m);
        let mut h = Session::new(plain, 512, KvPrecision::F32).unwrap();
        let mut d = Session::new(m, 512, KvPrecision::F32).unwrap();
        assert_eq!((h.forward_kind().unwrap(), d.forward_kind().unwrap()), ("host", "device"));
        let prompt: Vec<u32> = (0..131).map(|i| (i * 37 % 500 + 3) as u32).collect();
        let (a, b) = (h.eval(&prompt[..127], Logits::All).unwrap(), d.eval(&prompt[..127], Logits::All).unwrap());
        assert_eq!(a, b);
        // A prompt's chunks of the stand-in's 6 prefill rows (its decode calls take 4).
        assert_eq!(seen.forwards.load(Ordering::Relaxed), 22);
        let marked = || (seen.prefill.load(Ordering::Relaxed), seen.prefill_rows.load(Ordering::Relaxed));
        assert_eq!(marked(), (false, 127));
        assert_eq!(h.eval(&prompt[127..], Logits::Last).unwrap(), d.eval(&prompt[127..], Logits::Last).unwrap());
        assert_eq!(marked(), (false, 127));
        // Every call so far left its writes pending: the next read made them.
        assert_eq!(seen.deferred.load(Ordering::Relaxed), 23);
        assert_eq!(h.digest(), d.digest());

        // A failure in any chunk of a long batch changes nothing.
        let digest = d.digest();
        for k in 0..3 {
            // 14 tokens are chunks of 6, 6 and 2: the k-th one fails.
            seen.fail_at.store(seen.forwards.load(Ordering::Relaxed) + k, Ordering::Relaxed);
            assert!(matches!(d.eval(&[5; 14], Logits::Last), Err(Error::Backend(_))));
            assert_eq!(d.digest(), digest, "failing at chunk {k}");
            assert!(!marked().0);
        }
        seen.fail_at.store(usize::MAX, Ordering::Relaxed);
        let prompt_rows = marked().1;

        // Verify and cut: the decoder hears of the cut; the state is the host's.
        let (rows, log) = d.verify(&[7, 8, 9]).unwrap();
        let (hrows, hlog) = h.verify(&[7, 8, 9]).unwrap();
        assert_eq!(rows, hrows);
        d.keep(log, 1).unwrap();
        h.keep(hlog, 1).unwrap();
        assert_eq!(seen.kept.load(Ordering::Relaxed), 1);
        assert_eq!(d.digest(), h.digest());
        assert_eq!(marked(), (false, prompt_rows));
        let snap = d.snapshot();
        d.eval(&[9], Logits::Last).unwrap();
        d.restore(&snap).unwrap();
        assert_eq!(seen.syncs.load(Ordering::Relaxed), 1);
        assert_eq!(d.eval(&[9], Logits::All).unwrap(), h.eval(&[9], Logits::All).unwrap());
        assert_eq!(d.digest(), h.digest());
    }

    /// A prompt's calls: the decoder's prompt size throughout without a drafter; with one, the
    /// last `refill` rows or more in calls of at most `keep` rows, which keep the drafter (the
    /// first of the prompt at most `small`), after full calls, which may skip it.
    #[test]
    fn prompt_calls_leave_the_drafters_last_rows_to_calls_that_keep_them() {
        assert_eq!(prompt_chunks(2500, 1024, 16, 16, 0), vec![1024, 1024, 452]);
        assert_eq!(prompt_chunks(1024, 1024, 16, 160, 0), vec![1024]);
        assert_eq!(prompt_chunks(20, 1024, 16, 16, 0), vec![20]);
        // Flash with MTP: a window of 128, 17 spare slots, and the lag of MTP's rows; the
        // drafter's rows on the device (160 rows a call) or on the host (16).
        assert_eq!(prompt_chunks(2500, 1024, 16, 160, 146), vec![1024, 1024, 306, 146]);
        assert_eq!(prompt_chunks(2500, 1024, 16, 16, 146), [vec![1024, 1024, 306], vec![16; 9], vec![2]].concat());
        // The head's remainder: a call of its own when more than `small` rows, else with the
        // last rows, whose first call is then the prompt's first.
        assert_eq!(prompt_chunks(146 + 17, 1024, 16, 160, 146), vec![17, 146]);
        assert_eq!(prompt_chunks(146 + 16, 1024, 16, 160, 146), vec![16, 146]);
        assert_eq!(prompt_chunks(100, 1024, 16, 160, 146), vec![16, 84]);
        assert_eq!(prompt_chunks(100, 1024, 16, 16, 146), [vec![16; 6], vec![4]].concat());
        // Prompt steps no larger than a verify's (DS4_CUDA_PREFILL_ROWS=16): all of them small.
        assert_eq!(prompt_chunks(40, 16, 16, 16, 146), vec![16, 16, 8]);
        for len in 1..700 {
            for (big, small, keep, refill) in [
                (64, 16, 16, 0),
                (64, 16, 16, 146),
                (64, 16, 48, 146),
                (100, 16, 32, 30),
                (16, 16, 16, 146),
                (1024, 4, 9, 9),
            ] {
                let c = prompt_chunks(len, big, small, keep, refill);
                let case = format!("{len} {big} {small} {keep} {refill}: {c:?}");
                assert_eq!(c.iter().sum::<usize>(), len, "{case}");
                assert!(c.iter().all(|&k| k > 0 && k <= big.max(small)), "{case}");
                if refill == 0 {
                    assert!(c[..c.len() - 1].iter().all(|&k| k == big), "{case}");
                    continue;
                }
                // Every call holding one of the last `refill` rows keeps the drafter: at most
                // `keep` rows, and at most `small` when it is the prompt's first call.
                let mut at = 0;
                for &k in &c {
                    if at + k > len.saturating_sub(refill) {
                        assert!(k <= keep.max(small) && (at > 0 || k <= small), "{case}");
                    }
                    at += k;
                }
            }
        }
    }

    /// The CPU backend whose device decoder cannot be made: with an invalid setting
    /// (`Error::InvalidArgument`) or for want of device memory (`Error::Backend`).
    struct NoDecoder(fn() -> Error);

    impl Backend for NoDecoder {
        fn name(&self) -> &'static str {
            "no-decoder"
        }

        fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
            Cpu.matmul_many(raw, specs)
        }

        fn decoder(
            self: Arc<Self>,
            _model: &Model,
            _ctx: usize,
            _precision: KvPrecision,
        ) -> Option<Result<Box<dyn DeviceDecoder>>> {
            Some(Err((self.0)()))
        }
    }

    /// A device decoder refused for an invalid setting is an error of every call that would
    /// make it (the state untouched), never a silent move to the host forward pass; one that
    /// cannot be made for want of memory leaves the session on the host.
    #[test]
    fn an_invalid_decoder_setting_is_an_error_not_the_host_path() {
        let mut m = tiny_l();
        m.set_backend(Arc::new(NoDecoder(|| Error::invalid("DS4_CUDA_PREFILL_ROWS takes 16..=1024, not \"2048\""))));
        let mut s = Session::new(Arc::new(m), 512, KvPrecision::F32).unwrap();
        let digest = s.digest();
        for _ in 0..2 {
            let e = s.eval(&[5, 6], Logits::All).unwrap_err();
            assert!(matches!(&e, Error::InvalidArgument(m) if m.contains("DS4_CUDA_PREFILL_ROWS")), "{e}");
            assert!(matches!(s.verify(&[5]), Err(Error::InvalidArgument(_))));
            assert!(matches!(s.forward_kind(), Err(Error::InvalidArgument(_))));
            assert!(matches!(s.max_verify(), Err(Error::InvalidArgument(_))));
            assert_eq!((s.digest(), s.position()), (digest, 0));
        }
        let mut m = tiny_l();
        m.set_backend(Arc::new(NoDecoder(|| Error::Backend("out of device memory".into()))));
        let mut s = Session::new(Arc::new(m), 512, KvPrecision::F32).unwrap();
        assert_eq!(s.forward_kind().unwrap(), "host");
        assert_eq!(s.max_verify().unwrap(), crate::spec::MAX_DRAFT + 1);
        let mut r = Session::new(Arc::new(tiny_l()), 512, KvPrecision::F32).unwrap();
        assert_eq!(s.eval(&[5, 6], Logits::All).unwrap(), r.eval(&[5, 6], Logits::All).unwrap());
    }

    /// A snapshot restores only into a session of its model (the same loaded model, or one of
    /// equal config and no drafter) and state precision: anything else is refused and changes
    /// nothing, where it once went through and panicked at the next eval (a state of other
    /// shapes).
    #[test]
    fn a_snapshot_restores_only_into_its_model_and_precision() {
        let model = Arc::new(tiny_l());
        let mut a = Session::new(Arc::clone(&model), 512, KvPrecision::F32).unwrap();
        a.eval(&[5, 6, 7], Logits::Last).unwrap();
        let snap = a.snapshot();
        // Another load of the same file: the same config, restored.
        let mut b = Session::new(Arc::new(tiny_l()), 512, KvPrecision::F32).unwrap();
        b.restore(&snap).unwrap();
        assert_eq!(b.digest(), a.digest());
        // Another config, another precision, a shorter context: refused.
        let mut other = tiny_l();
        other.config.rms_eps *= 2.0;
        let refused = |s: &mut Session| {
            let digest = s.digest();
            assert!(matches!(s.restore(&snap), Err(Error::InvalidArgument(_))));
            assert_eq!(s.digest(), digest);
        };
        refused(&mut Session::new(Arc::new(other), 512, KvPrecision::F32).unwrap());
        refused(&mut Session::new(Arc::clone(&model), 512, KvPrecision::F16).unwrap());
        refused(&mut Session::new(Arc::clone(&model), 2, KvPrecision::F32).unwrap());
    }

    /// The tiny-l golden model (llama.cpp's f32 file).
    pub(crate) fn tiny_l() -> Model {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-l");
        Model::load(dir.join("llamacpp-f32.gguf")).unwrap()
    }

    /// tiny-l with a [`HostDecoder`] reporting to `seen`.
    pub(crate) fn tiny_l_with_decoder(seen: &Arc<Seen>) -> Arc<Model> {
        let mut m = tiny_l();
        m.set_backend(Arc::new(WithDecoder(Arc::clone(seen))));
        Arc::new(m)
    }

    /// Drafting's argmax of each row.
    fn argmaxes(logits: &[f32], vocab: usize) -> Vec<u32> {
        logits.chunks(vocab).map(crate::model::drafting::argmax).collect()
    }

    /// `eval_argmax` and `verify_argmax`, on the host and through a device decoder (long
    /// batches in chunks, verifies of more rows than it takes on the host), give the argmax of
    /// the logits `eval` and `verify` give and leave the same state; a failure changes nothing.
    #[test]
    fn argmax_evaluation_is_the_argmax_of_the_logits() {
        let plain = Arc::new(tiny_l());
        let vocab = plain.config.vocab;
        let seen = Seen::new();
        let mut r = Session::new(Arc::clone(&plain), 512, KvPrecision::F32).unwrap();
        let mut h = Session::new(plain, 512, KvPrecision::F32).unwrap();
        let mut d = Session::new(tiny_l_with_decoder(&seen), 512, KvPrecision::F32).unwrap();
        assert_eq!(d.forward_kind().unwrap(), "device");
        let prompt: Vec<u32> = (0..127).map(|i| (i * 37 % 500 + 3) as u32).collect();
        let want = Greedy::Ids(argmaxes(&r.eval(&prompt, Logits::Last).unwrap(), vocab));
        assert_eq!(h.eval_argmax(&prompt).unwrap(), want);
        assert_eq!(d.eval_argmax(&prompt).unwrap(), want);
        // 127 tokens in chunks of 4: only the last asks for the argmax.
        assert_eq!(seen.argmaxes.load(Ordering::Relaxed), 1);
        assert_eq!((h.digest(), d.digest()), (r.digest(), r.digest()));
        let mut t = 11;
        for _ in 0..6 {
            let want = argmaxes(&r.eval(&[t], Logits::Last).unwrap(), vocab);
            assert_eq!(h.eval_argmax(&[t]).unwrap(), Greedy::Ids(want.clone()));
            assert_eq!(d.eval_argmax(&[t]).unwrap(), Greedy::Ids(want.clone()));
            t = want[0];
        }
        assert_eq!(seen.argmaxes.load(Ordering::Relaxed), 7);

        // Verifies of 3 rows and of 4 (the most the decoder takes; 17 on the host), each cut
        // back. A longer verify is refused on the decoder: on the host forward pass its rows
        // would not be the decoder's single decodes.
        assert_eq!((d.max_verify().unwrap(), h.max_verify().unwrap()), (4, 17));
        let digest = d.digest();
        let err = d.verify_argmax(&[20, 21, 22, 23, 24]).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("1..=4"), "{err}");
        assert_eq!(d.digest(), digest);
        for (batch, keep) in [(vec![7, 8, 9], 2), (vec![20, 21, 22, 23], 3), ((0..17).map(|i| 20 + i).collect(), 5)] {
            if batch.len() > 4 {
                // The host sessions alone.
                let (rows, rlog) = r.verify(&batch).unwrap();
                let (hg, hlog) = h.verify_argmax(&batch).unwrap();
                assert_eq!(hg, Greedy::Ids(argmaxes(&rows, vocab)));
                r.keep(rlog, keep).unwrap();
                h.keep(hlog, keep).unwrap();
                // The decoder's session the same tokens in verifies it takes, then cut alike.
                let (_, dlog) = d.verify_argmax(&batch[..4]).unwrap();
                d.keep(dlog, 4).unwrap();
                let (_, dlog) = d.verify_argmax(&batch[4..keep]).unwrap();
                d.keep(dlog, keep - 4).unwrap();
                assert_eq!((h.digest(), d.digest()), (r.digest(), r.digest()));
                continue;
            }
            let (rows, rlog) = r.verify(&batch).unwrap();
            let want = Greedy::Ids(argmaxes(&rows, vocab));
            let (hg, hlog) = h.verify_argmax(&batch).unwrap();
            let (dg, dlog) = d.verify_argmax(&batch).unwrap();
            assert_eq!((&hg, &dg), (&want, &want));
            r.keep(rlog, keep).unwrap();
            h.keep(hlog, keep).unwrap();
            d.keep(dlog, keep).unwrap();
            assert_eq!((h.digest(), d.digest()), (r.digest(), r.digest()));
        }
        // Every verify the decoder's session ran (3 and 4 rows, then 4 and 1) was the decoder's.
        assert_eq!(seen.argmax_all.load(Ordering::Relaxed), 4);

        // A failure anywhere (a step, a verify, any chunk of a long batch) changes nothing.
        let digest = d.digest();
        // (14 tokens: the prompt chunks 6, 6 and 2.)
        for (k, tokens) in [(0, vec![5]), (0, vec![5, 6, 7]), (0, vec![5; 14]), (1, vec![5; 14]), (2, vec![5; 14])] {
            seen.fail_at.store(seen.forwards.load(Ordering::Relaxed) + k, Ordering::Relaxed);
            if tokens.len() == 3 {
                assert!(matches!(d.verify_argmax(&tokens), Err(Error::Backend(_))));
            } else {
                assert!(matches!(d.eval_argmax(&tokens), Err(Error::Backend(_))));
            }
            assert_eq!(d.digest(), digest, "{tokens:?} failing at chunk {k}");
        }
        seen.fail_at.store(usize::MAX, Ordering::Relaxed);
        assert_eq!(d.eval_argmax(&[5]).unwrap(), Greedy::Ids(argmaxes(&r.eval(&[5], Logits::Last).unwrap(), vocab)));

        // A row without a greedy token (a NaN): its logits come back, as `eval` gives them.
        seen.poison_at.store(seen.forwards.load(Ordering::Relaxed), Ordering::Relaxed);
        let mut want = r.eval(&[6], Logits::Last).unwrap();
        want[7] = f32::NAN;
        match d.eval_argmax(&[6]).unwrap() {
            Greedy::Logits(l) => assert_eq!(bits(&l), bits(&want)),
            other => panic!("{other:?}"),
        }
        assert_eq!(d.digest(), r.digest());
        // Checks and empty batches as `eval`.
        assert!(matches!(d.eval_argmax(&[vocab as u32]), Err(Error::InvalidArgument(_))));
        assert_eq!(d.eval_argmax(&[]).unwrap(), Greedy::Ids(Vec::new()));
        assert!(d.verify_argmax(&[]).is_err() && d.verify_argmax(&[1; 18]).is_err());
        assert_eq!(d.digest(), r.digest());
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn a_pass_failing_anywhere_leaves_the_session_as_it_was() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/tiny-l");
        let mut m = Model::load(dir.join("llamacpp-f32.gguf")).unwrap();
        let fb = Arc::new(Failing { calls: AtomicUsize::new(0), fail_at: AtomicUsize::new(usize::MAX) });
        m.set_backend(fb.clone());
        let mut s = Session::new(Arc::new(m), 512, KvPrecision::F32).unwrap();
        // 127 tokens: the next one closes a window of the ratio-4 and ratio-128 compressors.
        let prompt: Vec<u32> = (0..127).map(|i| (i * 37 % 500 + 3) as u32).collect();
        s.eval(&prompt, Logits::Last).unwrap();
        let (snap, digest) = (s.snapshot(), s.digest());
        let calls = || fb.calls.load(Ordering::Relaxed);
        let c0 = calls();
        let want = s.eval(&[7, 8], Logits::All).unwrap();
        let per_step = calls() - c0;
        assert!(per_step > 10);
        s.restore(&snap).unwrap();
        for k in 0..per_step {
            fb.fail_at.store(calls() + k, Ordering::Relaxed);
            assert!(matches!(s.eval(&[7], Logits::Last), Err(Error::Backend(_))));
            assert_eq!(s.digest(), digest, "decode failing at its call {k}");
            fb.fail_at.store(calls() + k, Ordering::Relaxed);
            assert!(matches!(s.verify(&[7, 8, 9, 10, 11]), Err(Error::Backend(_))));
            assert_eq!(s.digest(), digest, "verify failing at its call {k}");
            // The session goes on exactly like one that never failed.
            fb.fail_at.store(usize::MAX, Ordering::Relaxed);
            assert_eq!(s.eval(&[7, 8], Logits::All).unwrap(), want);
            s.restore(&snap).unwrap();
        }
    }
}
