//! `Model`, `Session` and `Snapshot`.

use std::sync::{Arc, Mutex, MutexGuard};

use ds4::backend::Greedy;
use ds4::generate::{GenerateOptions, Generation, Speculation};
use ds4::model::AttentionKind;
use ds4::sampling::SamplingParams;
use ds4::spec::ngram::NgramDrafter;
use ds4::spec::schedule::{Policy, Scheduler};
use ds4::spec::{Draft, Drafter, ModelDrafter};
use ds4::state::BatchLog;
use ds4::tokenizer::Tokenizer;
use ds4::{Logits, Model, Session, Snapshot};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict};

use crate::IntoPy;

/// A loaded DeepSeek V4 model (native part of `ds4.Model`).
#[pyclass(name = "Model", module = "ds4._ds4", frozen)]
pub struct PyModel {
    inner: Arc<Model>,
    /// The tokenizer in the same file's metadata, if it has one.
    tokenizer: Option<Arc<Tokenizer>>,
}

#[pymethods]
impl PyModel {
    /// Loads `path`; `draft` is a drafter support file (MTP or DSpark) to use instead of any
    /// MTP block in the file itself; `mtp_pairing` is "deepseek" (h_t with x_{t+1}) or "ds4"
    /// (h_t with x_t); `use_draft = false` loads no drafter at all.
    #[new]
    #[pyo3(signature = (path, draft = None, mtp_pairing = "deepseek", use_draft = true, backend = "cpu", progress = None))]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        draft: Option<std::path::PathBuf>,
        mtp_pairing: &str,
        use_draft: bool,
        backend: &str,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let pairing = match mtp_pairing {
            "deepseek" => ds4::model::MtpPairing::Next,
            "ds4" => ds4::model::MtpPairing::Same,
            other => {
                return Err(PyValueError::new_err(format!("mtp_pairing must be 'deepseek' or 'ds4', got {other:?}")))
            }
        };
        let (m, tok) = py
            .detach(|| -> ds4::Result<_> {
                let mut m = match &draft {
                    Some(d) => Model::load_with_draft(&path, d)?,
                    None => Model::load(&path)?,
                };
                m.set_mtp_pairing(pairing);
                if !use_draft {
                    m.draft = None;
                }
                // The progress callback (bytes done, bytes total) runs with the GIL; its errors
                // are ignored: a broken progress bar must not fail a load.
                let mut report = |done: u64, total: u64| {
                    if let Some(cb) = &progress {
                        Python::attach(|py| {
                            let _ = cb.call1(py, (done, total));
                        });
                    }
                };
                m.select_backend(backend, &mut report)?;
                let tok = match m.file().get("tokenizer.ggml.model") {
                    Some(_) => Some(Arc::new(Tokenizer::from_gguf(m.file())?)),
                    None => None,
                };
                Ok((m, tok))
            })
            .into_py_result()?;
        Ok(PyModel { inner: Arc::new(m), tokenizer: tok })
    }

    /// The backend computing the matrix products ("cpu" or "cuda").
    #[getter]
    fn backend(&self) -> &'static str {
        self.inner.backend().name()
    }

    /// The drafter's method ("mtp" or "dspark"), or None.
    #[getter]
    fn draft_method(&self) -> Option<&'static str> {
        self.inner.draft.as_ref().map(|d| d.method())
    }

    /// The drafter's settings as a dict, or None.
    fn draft_config<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(dm) = &self.inner.draft else { return Ok(None) };
        let d = PyDict::new(py);
        d.set_item("method", dm.method())?;
        match &dm.kind {
            ds4::model::draft::DraftKind::Mtp(w) => {
                d.set_item(
                    "layout",
                    if matches!(w.input, ds4::model::draft::MtpInput::Fused { .. }) { "llama.cpp" } else { "ds4" },
                )?;
                d.set_item("pairing", if dm.pairing == ds4::model::MtpPairing::Next { "deepseek" } else { "ds4" })?;
            }
            ds4::model::draft::DraftKind::DSpark(w) => {
                d.set_item("block_size", w.block_size)?;
                d.set_item("markov_rank", w.markov_rank)?;
                d.set_item("noise_token_id", w.noise_token)?;
                d.set_item("target_layer_ids", w.target_layers.clone())?;
                d.set_item("stages", w.stages.len())?;
            }
        }
        Ok(Some(d))
    }

    /// The tokenizer stored in the model file, or None if it has none.
    fn tokenizer(&self) -> Option<crate::tokenizer::PyTokenizer> {
        self.tokenizer.as_ref().map(|t| crate::tokenizer::PyTokenizer { inner: Arc::clone(t) })
    }

    /// The configuration read from the file's metadata, as a dict.
    fn config<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner.config;
        let d = PyDict::new(py);
        d.set_item("vocab_size", c.vocab)?;
        d.set_item("hidden_size", c.hidden)?;
        d.set_item("num_layers", c.n_layers())?;
        d.set_item("num_heads", c.n_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("rope_dim", c.rope_dim)?;
        d.set_item("q_lora_rank", c.q_lora_rank)?;
        d.set_item("o_groups", c.o_groups)?;
        d.set_item("o_lora_rank", c.o_lora_rank)?;
        d.set_item("sliding_window", c.window)?;
        d.set_item("index_heads", c.index_heads)?;
        d.set_item("index_head_dim", c.index_head_dim)?;
        d.set_item("index_topk", c.index_topk)?;
        d.set_item("num_experts", c.n_experts)?;
        d.set_item("num_experts_per_token", c.n_experts_used)?;
        d.set_item("expert_ff", c.expert_ff)?;
        d.set_item("hc_mult", c.hc_mult)?;
        d.set_item("context_length", c.context_length)?;
        d.set_item("bos_id", c.bos)?;
        d.set_item("eos_id", c.eos)?;
        let kinds: Vec<&str> = c
            .layers
            .iter()
            .map(|l| match l.kind {
                AttentionKind::Sliding => "sliding",
                AttentionKind::Csa => "csa",
                AttentionKind::Hca => "hca",
            })
            .collect();
        d.set_item("layer_kinds", kinds)?;
        d.set_item("compress_ratios", c.layers.iter().map(|l| l.ratio).collect::<Vec<_>>())?;
        d.set_item("hash_layers", c.layers.iter().filter(|l| l.hash_routed).count())?;
        Ok(d)
    }

    /// Weight bytes read to decode one token.
    fn decode_weight_bytes(&self) -> u64 {
        self.inner.decode_weight_bytes()
    }

    /// A new session holding at most `ctx` tokens; `kv` is the attention state's storage
    /// precision: "f32", "f16" or "fp8".
    #[pyo3(signature = (ctx, kv = "f32"))]
    fn session(&self, ctx: usize, kv: &str) -> PyResult<PySession> {
        let precision = ds4::state::KvPrecision::from_name(kv)
            .ok_or_else(|| PyValueError::new_err(format!("kv must be 'f32', 'f16' or 'fp8', got {kv:?}")))?;
        let s = Session::new(Arc::clone(&self.inner), ctx, precision).into_py_result()?;
        Ok(PySession { inner: Mutex::new(s), tokenizer: self.tokenizer.clone() })
    }
}

/// Speculation settings from Python: (method, callable or None, max_draft, adaptive,
/// min_ngram, max_ngram).
type SpecArgs = (String, Option<Py<PyAny>>, usize, bool, usize, usize);

/// A saved session state.
#[pyclass(name = "Snapshot", module = "ds4._ds4", frozen)]
pub struct PySnapshot {
    inner: Snapshot,
}

#[pymethods]
impl PySnapshot {
    /// Tokens processed when the snapshot was taken.
    #[getter]
    fn position(&self) -> usize {
        self.inner.position()
    }
}

/// A decoding session (native part of `ds4.Session`).
#[pyclass(name = "Session", module = "ds4._ds4", frozen)]
pub struct PySession {
    // A Mutex rather than PyO3's borrow flag: eval releases the GIL, and a second thread
    // calling into the same session must wait, not fail.
    inner: Mutex<Session>,
    tokenizer: Option<Arc<Tokenizer>>,
}

impl PySession {
    /// The session, locked where a ds4 error is wanted (inside `py.detach`): a lock poisoned by
    /// a panic is an error, not a second panic.
    fn lock(&self) -> ds4::Result<MutexGuard<'_, Session>> {
        self.inner.lock().map_err(|_| ds4::Error::InvalidArgument("the session was poisoned".into()))
    }

    fn with<T>(&self, f: impl FnOnce(&mut Session) -> PyResult<T>) -> PyResult<T> {
        let mut s = self.inner.lock().map_err(|_| PyRuntimeError::new_err("the session was poisoned by a panic"))?;
        f(&mut s)
    }
}

#[pymethods]
impl PySession {
    /// Evaluates `tokens` and returns float32 logits (a bytearray) of the rows asked for:
    /// `which` is "all", "last" or "none".
    #[pyo3(signature = (tokens, which = "all"))]
    fn eval<'py>(&self, py: Python<'py>, tokens: Vec<u32>, which: &str) -> PyResult<Bound<'py, PyByteArray>> {
        let which = match which {
            "all" => Logits::All,
            "last" => Logits::Last,
            "none" => Logits::None,
            _ => return Err(PyValueError::new_err(format!("logits must be 'all', 'last' or 'none', got {which:?}"))),
        };
        let out = py.detach(|| {
            let mut s = self.lock()?;
            s.eval(&tokens, which)
        });
        crate::quant::f32_bytearray(py, &out.into_py_result()?)
    }

    /// Tokens processed so far.
    #[getter]
    fn position(&self) -> PyResult<usize> {
        self.with(|s| Ok(s.position()))
    }

    /// Where the forward pass runs: "device" (the whole pass on the GPU, state mirrored
    /// there) or "host" (on the CPU, products on the model's backend).
    #[getter]
    fn forward_kind(&self) -> PyResult<&'static str> {
        self.with(|s| s.forward_kind().into_py_result())
    }

    /// The most tokens one verify takes (16 on the GPU: one device step, every row bitwise a
    /// single decode's; 17 on the host).
    #[getter]
    fn max_verify(&self) -> PyResult<usize> {
        self.with(|s| s.max_verify().into_py_result())
    }

    /// The context size.
    #[getter]
    fn context(&self) -> PyResult<usize> {
        self.with(|s| Ok(s.context()))
    }

    /// The token ids processed so far.
    #[getter]
    fn tokens(&self) -> PyResult<Vec<u32>> {
        self.with(|s| Ok(s.tokens().to_vec()))
    }

    /// A digest of the whole decode state and the random stream (equal digests: equal
    /// states, bit for bit).
    fn digest(&self) -> PyResult<u64> {
        self.with(|s| Ok(s.digest()))
    }

    /// Bytes held by the decode state.
    fn state_bytes(&self) -> PyResult<usize> {
        self.with(|s| Ok(s.state_bytes()))
    }

    fn snapshot(&self) -> PyResult<PySnapshot> {
        self.with(|s| Ok(PySnapshot { inner: s.snapshot() }))
    }

    fn restore(&self, snapshot: &PySnapshot) -> PyResult<()> {
        self.with(|s| s.restore(&snapshot.inner).into_py_result())
    }

    fn reset(&self) -> PyResult<()> {
        self.with(|s| {
            s.reset();
            Ok(())
        })
    }

    /// Evaluates `tokens` as a speculative verify (see `ds4.Session.verify`): the verify, then
    /// every row's logits (a bytearray), or with `greedy` every row's greedy token id (None,
    /// and the logits, when some row has none).
    #[pyo3(signature = (tokens, greedy = false))]
    #[allow(clippy::type_complexity)]
    fn verify<'py>(
        slf: &Bound<'py, Self>,
        py: Python<'py>,
        tokens: Vec<u32>,
        greedy: bool,
    ) -> PyResult<(PyVerification, Option<Bound<'py, PyByteArray>>, Option<Vec<u32>>)> {
        let session = slf.get();
        let out = py.detach(|| {
            let mut s = session.lock()?;
            let (rows, log) = if greedy {
                s.verify_argmax(&tokens)?
            } else {
                let (logits, log) = s.verify(&tokens)?;
                (Greedy::Logits(logits), log)
            };
            Ok((rows, log, s.changes()))
        });
        let (rows, log, changes) = out.into_py_result()?;
        let v =
            PyVerification { session: slf.clone().unbind(), log: Mutex::new(Some(log)), changes, rows: tokens.len() };
        Ok(match rows {
            Greedy::Ids(ids) => (v, None, Some(ids)),
            Greedy::Logits(logits) => (v, Some(crate::quant::f32_bytearray(py, &logits)?), None),
        })
    }

    /// What the model's drafter proposes from the committed state (nothing changes):
    /// (tokens, logits, confidence, base_logits, hidden), the float arrays as bytearrays.
    #[pyo3(signature = (anchor = None, k = None))]
    #[allow(clippy::type_complexity)]
    fn propose<'py>(
        &self,
        py: Python<'py>,
        anchor: Option<u32>,
        k: Option<usize>,
    ) -> PyResult<(
        Vec<u32>,
        Bound<'py, PyByteArray>,
        Option<Vec<f32>>,
        Option<Bound<'py, PyByteArray>>,
        Option<Bound<'py, PyByteArray>>,
    )> {
        let p = py.detach(|| {
            let mut s = self.lock()?;
            s.propose(anchor, k)
        });
        let p = p.into_py_result()?;
        let opt = |v: &Option<Vec<f32>>| v.as_ref().map(|v| crate::quant::f32_bytearray(py, v)).transpose();
        Ok((
            p.tokens,
            crate::quant::f32_bytearray(py, &p.logits)?,
            p.confidence.clone(),
            opt(&p.base_logits)?,
            opt(&p.hidden)?,
        ))
    }

    /// Evaluates `prompt` and returns a stream of generated chunks (see `ds4.Session.stream`).
    /// `spec` is None or (method, callable or None, max_draft, adaptive, min_ngram, max_ngram)
    /// with method "ngram" or "callable".
    #[pyo3(signature = (prompt, max_tokens, temperature, top_k, top_p, min_p, seed, stop, stop_tokens, spec = None))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        slf: &Bound<'_, Self>,
        py: Python<'_>,
        prompt: Vec<u32>,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Vec<String>,
        stop_tokens: Vec<u32>,
        spec: Option<SpecArgs>,
    ) -> PyResult<PyStream> {
        let this = slf.get();
        let tokenizer = this
            .tokenizer
            .clone()
            .ok_or_else(|| PyValueError::new_err("this model file has no tokenizer: generation needs one"))?;
        let opts = GenerateOptions {
            max_tokens,
            sampling: SamplingParams { temperature, top_k, top_p, min_p, seed },
            stop,
            stop_tokens,
        };
        let mut error_slot = None;
        // Model drafters are bound to the session below, under its lock.
        let mut model_method: Option<(String, usize)> = None;
        let speculation = match spec {
            None => None,
            Some((method, callable, max_draft, adaptive, min_ngram, max_ngram)) => {
                let drafter: Box<dyn Drafter> = match (method.as_str(), callable) {
                    ("ngram", _) => Box::new(NgramDrafter::new(min_ngram, max_ngram).into_py_result()?),
                    ("callable", Some(f)) => {
                        let d = PyDrafter { f, error: Arc::new(Mutex::new(None)) };
                        error_slot = Some(Arc::clone(&d.error));
                        Box::new(d)
                    }
                    (m @ ("mtp" | "dspark"), _) => {
                        model_method = Some((m.to_string(), max_draft));
                        Box::new(NgramDrafter::new(1, 1).into_py_result()?)
                    }
                    (m, _) => return Err(PyValueError::new_err(format!("unknown speculative method {m:?}"))),
                };
                let policy = if adaptive { Policy::Adaptive { max: max_draft } } else { Policy::Fixed(max_draft) };
                Some(Speculation { drafter, scheduler: Scheduler::new(policy).into_py_result()? })
            }
        };
        let gen = py.detach(|| {
            let mut s = this.lock()?;
            let mut speculation = speculation;
            if let (Some((m, max)), Some(sp)) = (&model_method, speculation.as_mut()) {
                sp.drafter = Box::new(ModelDrafter::new(&s, m, *max)?);
            }
            Generation::start(&mut s, tokenizer, &prompt, opts, speculation)
        });
        let gen = gen.into_py_result()?;
        Ok(PyStream { session: slf.clone().unbind(), gen: Mutex::new(gen), drafter_error: error_slot })
    }
}

/// The rows of a verify, which `keep` cuts to a prefix (native part of `ds4.Verification`).
#[pyclass(name = "Verification", module = "ds4._ds4", frozen)]
pub struct PyVerification {
    session: Py<PySession>,
    /// What the verify's rows overwrote; taken by the first `keep`.
    log: Mutex<Option<BatchLog>>,
    /// The session's change count right after the verify: a cut applies only while the
    /// session is still there (`Session::changes`).
    changes: u64,
    rows: usize,
}

#[pymethods]
impl PyVerification {
    /// The verified tokens.
    #[getter]
    fn rows(&self) -> usize {
        self.rows
    }

    /// Keeps the first `n` rows: the session is then bit for bit as if only those tokens had
    /// been evaluated. Once per verify, and only while the session has not changed since.
    fn keep(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        if n > self.rows {
            return Err(PyValueError::new_err(format!("keep takes 0..={} rows, not {n}", self.rows)));
        }
        let log = self
            .log
            .lock()
            .map_err(|_| PyRuntimeError::new_err("the verification was poisoned by a panic"))?
            .take()
            .ok_or_else(|| PyValueError::new_err("this verification was already kept"))?;
        let session = self.session.get();
        let changes = self.changes;
        py.detach(|| {
            let mut s = session.lock()?;
            if s.changes() != changes {
                return Err(ds4::Error::InvalidArgument(
                    "the session changed since this verification (evaluated, verified, restored or reset): \
                     its rows can no longer be cut"
                        .into(),
                ));
            }
            s.keep(log, n)
        })
        .into_py_result()
    }
}

/// A generation in progress: iterate for `(text, tokens)` chunks.
#[pyclass(name = "Stream", module = "ds4._ds4", frozen)]
pub struct PyStream {
    session: Py<PySession>,
    gen: Mutex<Generation>,
    /// Where a Python drafter leaves the exception it raised, to re-raise it as is.
    drafter_error: Option<Arc<Mutex<Option<PyErr>>>>,
}

/// A drafter implemented by a Python callable `f(history: list[int]) -> list[int]`.
struct PyDrafter {
    f: Py<PyAny>,
    error: Arc<Mutex<Option<PyErr>>>,
}

impl Drafter for PyDrafter {
    fn name(&self) -> &str {
        "python"
    }

    fn propose(&mut self, history: &[u32], max: usize) -> ds4::Result<Draft> {
        let out = Python::attach(|py| -> PyResult<Vec<i64>> { self.f.bind(py).call1((history.to_vec(),))?.extract() });
        match out {
            Ok(ids) => {
                let mut tokens = Vec::with_capacity(ids.len().min(max));
                for id in ids.into_iter().take(max) {
                    let t = u32::try_from(id).map_err(|_| {
                        ds4::Error::InvalidArgument(format!(
                            "the drafter proposed token id {id}, which is not a token id"
                        ))
                    })?;
                    tokens.push(t);
                }
                Ok(Draft::point(tokens))
            }
            Err(e) => {
                if let Ok(mut slot) = self.error.lock() {
                    *slot = Some(e);
                }
                Err(ds4::Error::InvalidArgument("the Python drafter raised an exception".into()))
            }
        }
    }
}

#[pymethods]
impl PyStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// The next chunk, computed with the GIL released; Ctrl+C is honoured between tokens.
    fn __next__(&self, py: Python<'_>) -> PyResult<Option<(String, Vec<u32>)>> {
        py.check_signals()?;
        let session = self.session.get();
        let out = py.detach(|| {
            let mut g = self.gen.lock().map_err(|_| ds4::Error::InvalidArgument("the stream was poisoned".into()))?;
            let mut s = session.lock()?;
            g.step(&mut s)
        });
        if out.is_err() {
            // A Python drafter's own exception is re-raised as it was.
            if let Some(e) = self.drafter_error.as_ref().and_then(|slot| slot.lock().ok().and_then(|mut s| s.take())) {
                return Err(e);
            }
        }
        Ok(out.into_py_result()?.map(|c| (c.text, c.tokens)))
    }

    /// "eos", "stop" or "length" once finished, else None.
    #[getter]
    fn finish_reason(&self) -> PyResult<Option<&'static str>> {
        let g = self.gen.lock().map_err(|_| PyRuntimeError::new_err("the stream was poisoned"))?;
        Ok(g.finish_reason().map(|f| f.as_str()))
    }

    /// Speculation counters: (num_drafts, num_draft_tokens, num_accepted_tokens,
    /// accepted_per_pos, num_plain_steps).
    #[getter]
    fn stats(&self) -> PyResult<(u64, u64, u64, Vec<u64>, u64)> {
        let g = self.gen.lock().map_err(|_| PyRuntimeError::new_err("the stream was poisoned"))?;
        let s = &g.stats;
        Ok((s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_pos.clone(), s.num_plain_steps))
    }

    /// (prompt tokens, prefill seconds, generated tokens, decode seconds).
    #[getter]
    fn timings(&self) -> PyResult<(usize, f64, usize, f64)> {
        let g = self.gen.lock().map_err(|_| PyRuntimeError::new_err("the stream was poisoned"))?;
        Ok((g.prompt_tokens, g.prefill_seconds, g.tokens().len(), g.decode_seconds))
    }
}

/// Whether a CUDA GPU and driver are usable by this build (False when built without CUDA).
#[pyfunction]
fn cuda_available() -> bool {
    #[cfg(feature = "cuda")]
    {
        ds4::backend::cuda::cuda_available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The name of the first CUDA device, or None.
#[pyfunction]
fn cuda_device_name() -> Option<String> {
    #[cfg(feature = "cuda")]
    {
        ds4::backend::cuda::device_name()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Per-phase totals of the forward pass when `DS4_PROFILE` is set: [(phase, calls, seconds)].
/// `reset=True` clears them after reading.
#[pyfunction]
#[pyo3(signature = (reset = false))]
fn profile(reset: bool) -> Vec<(&'static str, u64, f64)> {
    let r = ds4::profile::report();
    if reset {
        ds4::profile::reset();
    }
    r
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(profile, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_name, m)?)?;
    m.add_class::<PyModel>()?;
    m.add_class::<PySession>()?;
    m.add_class::<PyVerification>()?;
    m.add_class::<PySnapshot>()?;
    m.add_class::<PyStream>()?;
    Ok(())
}
