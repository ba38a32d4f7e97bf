//! The one error type of the engine. The Python bindings map each variant to an exception
//! class (`ds4.GGUFError`, `FileNotFoundError`, ...); nothing here knows about Python.

use std::path::PathBuf;

use crate::gguf::GgufError;

/// Every fallible engine operation returns this.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be opened or mapped.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The GGUF file is malformed (or uses a feature this reader rejects).
    #[error("{0}")]
    Gguf(#[from] GgufError),
    /// A well-formed tensor whose type the engine cannot compute with.
    #[error("tensor type {type_name} is not supported for {op}")]
    UnsupportedType { type_name: &'static str, op: &'static str },
    /// A well-formed GGUF file that is not a model ds4 can run: wrong architecture, missing or
    /// inconsistent metadata, a missing tensor, a tensor of the wrong shape or type.
    #[error("{0}")]
    UnsupportedModel(String),
    /// More tokens than the session's context holds.
    #[error("context overflow: {needed} tokens do not fit in a context of {capacity}")]
    ContextOverflow { needed: usize, capacity: usize },
    /// A drafter (MTP or DSpark weights) that does not fit the target model: the message
    /// names what differs.
    #[error("{0}")]
    DraftMismatch(String),
    /// The requested compute backend cannot run here (no GPU, no driver, not built in).
    #[error("{0}")]
    BackendUnavailable(String),
    /// A compute backend failed while running (a driver or kernel error).
    #[error("{0}")]
    Backend(String),
    /// A caller passed arguments that cannot be honoured (wrong lengths, bad names, ...).
    #[error("{0}")]
    InvalidArgument(String),
}

/// `Result` with the engine's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Error::InvalidArgument(msg.into())
    }

    pub(crate) fn mismatch(msg: impl Into<String>) -> Self {
        Error::DraftMismatch(msg.into())
    }

    pub(crate) fn model(msg: impl Into<String>) -> Self {
        Error::UnsupportedModel(msg.into())
    }
}
