//! `Sampler`: the engine's sampler over float32 logits passed as little-endian bytes.
//! `ds4.sampling` wraps it with numpy conveniences and the `ds4.Sampling` parameters.

use std::sync::Mutex;

use ds4::sampling::{Sampler, SamplingParams};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::IntoPy;

fn logits_f32(bytes: &[u8]) -> PyResult<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!("logits: {} bytes is not a whole number of float32", bytes.len())));
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// A token sampler with fixed parameters and a persistent random stream.
#[pyclass(name = "Sampler", module = "ds4._ds4", frozen)]
pub struct PySampler {
    // A Mutex rather than PyO3's borrow flag: sampling releases the GIL, and a second thread
    // using the same sampler must wait, not fail.
    inner: Mutex<Sampler>,
}

impl PySampler {
    fn with<T>(&self, f: impl FnOnce(&mut Sampler) -> PyResult<T>) -> PyResult<T> {
        let mut s = self.inner.lock().map_err(|_| PyRuntimeError::new_err("the sampler was poisoned by a panic"))?;
        f(&mut s)
    }
}

#[pymethods]
impl PySampler {
    #[new]
    fn new(temperature: f32, top_k: i64, top_p: f32, min_p: f32, seed: u64) -> PyResult<Self> {
        let top_k = usize::try_from(top_k)
            .map_err(|_| PyValueError::new_err(format!("top_k must be >= 0 (0 disables it), got {top_k}")))?;
        let params = SamplingParams { temperature, top_k, top_p, min_p, seed };
        let s = Sampler::new(params).into_py_result()?;
        Ok(PySampler { inner: Mutex::new(s) })
    }

    /// One token id sampled from float32 `logits` (little-endian bytes).
    fn sample(&self, py: Python<'_>, logits: &[u8]) -> PyResult<u32> {
        py.detach(|| {
            let logits = logits_f32(logits)?;
            self.with(|s| s.sample(&logits).into_py_result())
        })
    }

    /// The distribution ``sample`` draws from: (ids, probabilities), ids increasing, only
    /// tokens of positive probability.
    fn distribution(&self, py: Python<'_>, logits: &[u8]) -> PyResult<(Vec<u32>, Vec<f64>)> {
        let d = py.detach(|| {
            let logits = logits_f32(logits)?;
            self.with(|s| s.distribution(&logits).into_py_result())
        })?;
        Ok((d.ids().to_vec(), d.probs().to_vec()))
    }

    /// The random stream's state (four 64-bit words), for ``restore``.
    fn snapshot(&self) -> PyResult<(u64, u64, u64, u64)> {
        self.with(|s| {
            let [a, b, c, d] = s.state();
            Ok((a, b, c, d))
        })
    }

    /// Puts the random stream back to a state from ``snapshot``.
    fn restore(&self, state: (u64, u64, u64, u64)) -> PyResult<()> {
        self.with(|s| s.set_state([state.0, state.1, state.2, state.3]).into_py_result())
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySampler>()?;
    Ok(())
}
