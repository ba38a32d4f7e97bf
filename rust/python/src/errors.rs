//! Maps engine errors onto the Python exception hierarchy defined in `ds4/errors.py`.
//!
//! The classes are defined in Python because they use multiple inheritance (for example
//! `GGUFError` is both a `ds4.Ds4Error` and a `ValueError`), which `create_exception!`
//! cannot express. They are looked up once and cached.

use ds4::Error;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

fn class<'py>(py: Python<'py>, cell: &'static PyOnceLock<Py<PyType>>, name: &str) -> PyResult<Bound<'py, PyType>> {
    cell.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        Ok(py.import("ds4.errors")?.getattr(name)?.cast_into::<PyType>()?.unbind())
    })
    .map(|t| t.bind(py).clone())
}

fn raise(py: Python<'_>, cell: &'static PyOnceLock<Py<PyType>>, name: &str, msg: String) -> PyErr {
    match class(py, cell, name) {
        Ok(cls) => PyErr::from_type(cls, msg),
        Err(e) => e,
    }
}

static GGUF_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static UNSUPPORTED_MODEL: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static CONTEXT_OVERFLOW: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DRAFT_MISMATCH: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BACKEND_UNAVAILABLE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static BACKEND_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Converts an engine error into the matching Python exception.
pub(crate) fn to_pyerr(e: Error) -> PyErr {
    Python::attach(|py| match e {
        Error::Io { path, source } => {
            // Python's own OSError text: the description without Rust's " (os error N)".
            let errno = source.raw_os_error().unwrap_or(0);
            let text = source.to_string();
            let text = text.strip_suffix(&format!(" (os error {errno})")).unwrap_or(&text).to_string();
            let args = (errno, text, path.display().to_string());
            match source.kind() {
                std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(args),
                std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(args),
                _ => PyOSError::new_err(args),
            }
        }
        Error::Gguf(g) => raise(py, &GGUF_ERROR, "GGUFError", g.to_string()),
        e @ Error::UnsupportedType { .. } => raise(py, &UNSUPPORTED_MODEL, "UnsupportedModelError", e.to_string()),
        Error::UnsupportedModel(msg) => raise(py, &UNSUPPORTED_MODEL, "UnsupportedModelError", msg),
        e @ Error::ContextOverflow { .. } => raise(py, &CONTEXT_OVERFLOW, "ContextOverflowError", e.to_string()),
        Error::DraftMismatch(msg) => raise(py, &DRAFT_MISMATCH, "DraftMismatchError", msg),
        Error::BackendUnavailable(msg) => raise(py, &BACKEND_UNAVAILABLE, "BackendUnavailable", msg),
        Error::Backend(msg) => raise(py, &BACKEND_ERROR, "BackendError", msg),
        Error::InvalidArgument(msg) => PyValueError::new_err(msg),
    })
}

/// `result.into_py_result()?` in binding code.
pub(crate) trait IntoPy<T> {
    fn into_py_result(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for ds4::Result<T> {
    fn into_py_result(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}
