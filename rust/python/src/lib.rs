//! `ds4._ds4`: the PyO3 module. Thin wrappers only: argument conversion, error mapping and
//! releasing the GIL around long work. Logic lives in the `ds4` engine crate.

use pyo3::prelude::*;

mod errors;
mod gguf;
mod model;
mod quant;
mod sampling;
mod tokenizer;

pub(crate) use errors::IntoPy;

#[pymodule(gil_used = false)]
fn _ds4(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    gguf::register(m)?;
    quant::register(m)?;
    model::register(m)?;
    sampling::register(m)?;
    tokenizer::register(m)?;
    Ok(())
}
