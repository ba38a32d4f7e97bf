//! GGUF files: a strict, zero-copy reader.
//!
//! [`GgufFile::open`] memory-maps a file, validates the whole header (metadata and tensor
//! directory) up front, and then hands out tensor bytes as slices of the map. Every count,
//! length and offset read from the file is checked before it is used, with checked
//! arithmetic, so a malformed file gives a [`GgufError`] and never a panic, an out-of-bounds
//! read or a huge allocation.

mod error;
mod reader;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
pub use value::{Value, ValueType};
pub use writer::GgufWriter;
