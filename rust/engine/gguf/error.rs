//! What can be wrong with a GGUF file. Each variant names the offending piece (a byte offset,
//! a key, a tensor name) so the message tells the user where to look.

/// A malformed or unsupported GGUF file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file: it starts with \"{}\", expected \"GGUF\"", found.escape_ascii())]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("GGUF file is truncated: {what} at byte {offset} needs {needed} bytes, only {available} remain")]
    Truncated { what: String, offset: u64, needed: u64, available: u64 },
    #[error("GGUF {what} overflows: {detail}")]
    Overflow { what: String, detail: String },
    #[error("metadata key {key:?}: unknown value type id {type_id}")]
    UnknownValueType { key: String, type_id: u32 },
    #[error("metadata key {key:?}: arrays nested deeper than {max_depth} levels")]
    TooDeep { key: String, max_depth: usize },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("metadata key {key:?} at byte {offset}: boolean byte is {value}, expected 0 or 1")]
    InvalidBool { key: String, offset: u64, value: u8 },
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("general.alignment must be a non-zero power of two of type u32, got {0}")]
    BadAlignment(String),
    #[error("tensor {name:?}: unknown tensor type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?}: {n_dims} dimensions (at most {max} are allowed)")]
    TooManyDims { name: String, n_dims: u32, max: usize },
    #[error("tensor {name:?}: bad shape {dims:?}: {reason}")]
    BadShape { name: String, dims: Vec<u64>, reason: String },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { name: String, offset: u64, alignment: u64 },
    #[error(
        "tensor {name:?}: data [{start}, {end}) lies outside the data section of {data_len} bytes (file truncated?)"
    )]
    OutOfBounds { name: String, start: u64, end: u64, data_len: u64 },
    #[error("no tensor named {0:?}")]
    MissingTensor(String),
}
