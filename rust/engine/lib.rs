//! ds4: a DeepSeek V4 (Flash) inference engine that reads GGUF files.
//!
//! This crate is the engine core. It has no Python in it: the PyO3 bindings live in
//! `rust/python` and depend on this crate, so `cargo test` and `cargo bench` never link
//! libpython.
//!
//! Dependencies point one way: `gguf` (file format) uses `quant::types` (type ids and block
//! sizes); `quant` knows nothing of files; everything returns [`Error`].

// Numeric kernels index several parallel arrays by the same loop variable; iterator chains
// would hide the arithmetic.
#![allow(clippy::needless_range_loop)]

pub mod backend;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod model;
pub mod profile;
pub mod quant;
pub mod sampling;
pub mod session;
pub mod spec;
pub mod state;
pub mod tokenizer;

pub use error::{Error, Result};
pub use model::{Logits, Model, ModelConfig};
pub use session::{Session, Snapshot};
