//! `Tokenizer`, `StreamDecoder` and `render_chat`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use ds4::tokenizer::{ChatMessage, Role, StreamDecoder, Tokenizer};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::IntoPy;

/// Texts longer than this (bytes) are encoded with the GIL released.
const DETACH_BYTES: usize = 4096;

/// `ids` as token ids of a vocabulary of `vocab`: a negative or too large id is the ValueError
/// the engine gives for an id past the vocabulary (not PyO3's OverflowError for a u32).
fn token_ids(ids: Vec<i64>, vocab: usize) -> PyResult<Vec<u32>> {
    ids.into_iter()
        .map(|id| match u32::try_from(id) {
            Ok(t) if (t as usize) < vocab => Ok(t),
            _ => Err(PyValueError::new_err(format!("token id {id} is not in the vocabulary of {vocab}"))),
        })
        .collect()
}

/// A byte-level BPE tokenizer (DeepSeek V4), read from GGUF metadata or a `tokenizer.json`.
#[pyclass(name = "Tokenizer", module = "ds4._ds4", frozen)]
pub struct PyTokenizer {
    pub(crate) inner: Arc<Tokenizer>,
}

#[pymethods]
impl PyTokenizer {
    /// The tokenizer in a GGUF file's `tokenizer.ggml.*` metadata.
    #[staticmethod]
    fn from_gguf(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| Tokenizer::from_gguf_path(&path)).into_py_result()?;
        Ok(PyTokenizer { inner: Arc::new(inner) })
    }

    /// A Hugging Face `tokenizer.json` (BOS/EOS from `tokenizer_config.json` beside it).
    #[staticmethod]
    fn from_json(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py.detach(|| Tokenizer::from_json_path(&path)).into_py_result()?;
        Ok(PyTokenizer { inner: Arc::new(inner) })
    }

    /// The token ids of `text`. Special tokens (BOS, EOS, ...) are recognised only with
    /// `allow_special`; DeepSeek's role and think tokens always are.
    #[pyo3(signature = (text, *, allow_special = false))]
    fn encode(&self, py: Python<'_>, text: &str, allow_special: bool) -> Vec<u32> {
        if text.len() > DETACH_BYTES {
            py.detach(|| self.inner.encode(text, allow_special))
        } else {
            self.inner.encode(text, allow_special)
        }
    }

    /// The pieces the pre-tokenizer cuts `text` into, before BPE (added tokens are not looked
    /// for).
    fn pre_tokenize<'a>(&self, text: &'a str) -> Vec<&'a str> {
        self.inner.pre_tokenize(text)
    }

    /// The text of `ids`; invalid UTF-8 becomes U+FFFD.
    fn decode(&self, ids: Vec<i64>) -> PyResult<String> {
        self.inner.decode(&token_ids(ids, self.inner.vocab_size())?).into_py_result()
    }

    /// A new incremental decoder.
    fn stream_decoder(&self) -> PyStreamDecoder {
        PyStreamDecoder {
            inner: Mutex::new(StreamDecoder::new(Arc::clone(&self.inner))),
            vocab: self.inner.vocab_size(),
        }
    }

    /// Number of token ids.
    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// The BOS token id, if known.
    #[getter]
    fn bos_id(&self) -> Option<u32> {
        self.inner.bos_id()
    }

    /// The EOS token id, if known.
    #[getter]
    fn eos_id(&self) -> Option<u32> {
        self.inner.eos_id()
    }

    /// The id of a token in its stored (byte-level) form ("Ġhello", "<｜User｜>"), or None.
    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The stored (byte-level) form of token `id`, or None.
    fn id_to_token(&self, id: i64) -> Option<&str> {
        u32::try_from(id).ok().and_then(|id| self.inner.id_to_token(id))
    }

    /// Whether `id` is a special token (matched only with `allow_special`).
    fn is_special(&self, id: u32) -> bool {
        self.inner.is_special(id)
    }

    /// The pre-tokenizer's `tokenizer.ggml.pre` name ("joyai-llm" or "gpt-2").
    #[getter]
    fn pre_tokenizer(&self) -> &'static str {
        self.inner.pre_tokenizer().gguf_name()
    }

    fn __repr__(&self) -> String {
        format!("Tokenizer(vocab_size={}, pre={:?})", self.inner.vocab_size(), self.inner.pre_tokenizer().gguf_name())
    }
}

/// Decodes tokens incrementally, emitting only complete characters.
#[pyclass(name = "StreamDecoder", module = "ds4._ds4", frozen)]
pub struct PyStreamDecoder {
    inner: Mutex<StreamDecoder>,
    vocab: usize,
}

impl PyStreamDecoder {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, StreamDecoder>> {
        self.inner.lock().map_err(|_| PyRuntimeError::new_err("stream decoder poisoned"))
    }
}

#[pymethods]
impl PyStreamDecoder {
    /// The text completed by `ids` (bytes of an unfinished character are held back).
    fn feed(&self, ids: Vec<i64>) -> PyResult<String> {
        let ids = token_ids(ids, self.vocab)?;
        self.lock()?.feed(&ids).into_py_result()
    }

    /// The held-back bytes as U+FFFD ("" when none); the decoder can be reused afterwards.
    fn flush(&self) -> PyResult<String> {
        Ok(self.lock()?.flush())
    }

    /// Bytes currently held back.
    #[getter]
    fn pending<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, self.lock()?.pending()))
    }
}

/// The DeepSeek V4 prompt of `messages`: (role, content, reasoning or None) triples.
#[pyfunction]
#[pyo3(signature = (messages, thinking = false, add_generation_prompt = true))]
fn render_chat(
    messages: Vec<(String, String, Option<String>)>,
    thinking: bool,
    add_generation_prompt: bool,
) -> PyResult<String> {
    let msgs = messages
        .into_iter()
        .map(|(role, content, reasoning_content)| {
            Ok(ChatMessage { role: role.parse::<Role>()?, content, reasoning_content })
        })
        .collect::<ds4::Result<Vec<_>>>()
        .into_py_result()?;
    Ok(ds4::tokenizer::render_chat(&msgs, thinking, add_generation_prompt))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_class::<PyStreamDecoder>()?;
    m.add_function(wrap_pyfunction!(render_chat, m)?)?;
    Ok(())
}
