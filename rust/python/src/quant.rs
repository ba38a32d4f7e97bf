//! Quantized-format functions on raw buffers (`bytes` in, `bytes`/`bytearray` out).
//! `ds4.quant` wraps them with numpy conveniences.

use ds4::quant::{self, GgmlType, Kernel};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes};

use crate::IntoPy;

fn ggml_type(name: &str) -> PyResult<GgmlType> {
    GgmlType::from_name(name).ok_or_else(|| PyValueError::new_err(format!("unknown GGML type {name:?}")))
}

fn kernel(name: &str) -> PyResult<Kernel> {
    match name {
        "auto" => Ok(Kernel::best()),
        "scalar" => Ok(Kernel::Scalar),
        "simd" if Kernel::simd_available() => Ok(Kernel::Simd),
        "simd" => Err(PyValueError::new_err("no SIMD kernel on this CPU")),
        _ => Err(PyValueError::new_err(format!("kernel must be 'auto', 'scalar' or 'simd', got {name:?}"))),
    }
}

fn f32s(bytes: &[u8], what: &str) -> PyResult<Vec<f32>> {
    if !bytes.len().is_multiple_of(4) {
        return Err(PyValueError::new_err(format!("{what}: {} bytes is not a whole number of float32", bytes.len())));
    }
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn u16s(bytes: &[u8], what: &str) -> PyResult<Vec<u16>> {
    if !bytes.len().is_multiple_of(2) {
        return Err(PyValueError::new_err(format!(
            "{what}: {} bytes is not a whole number of 16-bit values",
            bytes.len()
        )));
    }
    Ok(bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

/// Allocates a bytearray of `n` float32 values and fills it with `f` with the GIL released.
pub(crate) fn fill_f32_bytearray<'py>(
    py: Python<'py>,
    n: u64,
    f: impl FnOnce(&mut [f32]) -> ds4::Result<()> + Send,
) -> PyResult<Bound<'py, PyByteArray>> {
    let n = usize::try_from(n).map_err(|_| PyValueError::new_err("too many elements"))?;
    let mut out = vec![0f32; n];
    py.detach(|| f(&mut out)).into_py_result()?;
    f32_bytearray(py, &out)
}

/// The values as a new bytearray of little-endian float32: on a little-endian machine one copy
/// of their bytes. (`PyByteArray::new_with` zeroes the new buffer before a loop fills it:
/// `dequantize` of 4.1 MB of F32, the size of a verify's 8 rows of Flash logits, took 0.32 ms
/// that way against 0.25 this way.)
pub(crate) fn f32_bytearray<'py>(py: Python<'py>, values: &[f32]) -> PyResult<Bound<'py, PyByteArray>> {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the bytes of `values` (`size_of_val` of them, initialised, no padding in
        // f32), read as u8 while `values` is borrowed.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) };
        Ok(PyByteArray::new(py, bytes))
    }
    #[cfg(not(target_endian = "little"))]
    PyByteArray::new_with(py, values.len() * 4, |buf| {
        for (dst, v) in buf.chunks_exact_mut(4).zip(values) {
            dst.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    })
}

/// Dequantizes whole blocks of `type` to float32 (a bytearray of little-endian floats).
#[pyfunction]
fn dequantize<'py>(py: Python<'py>, r#type: &str, data: &[u8]) -> PyResult<Bound<'py, PyByteArray>> {
    let ty = ggml_type(r#type)?;
    let (bb, be) = (ty.block_bytes(), ty.block_elems());
    if !data.len().is_multiple_of(bb) {
        return Err(PyValueError::new_err(format!(
            "{} bytes is not a whole number of {ty} blocks ({bb} bytes)",
            data.len()
        )));
    }
    let n = (data.len() / bb * be) as u64;
    fill_f32_bytearray(py, n, |dst| quant::dequantize(ty, data, dst))
}

/// Fused dot product of one quantized row with a float32 vector `x` (little-endian bytes).
#[pyfunction]
#[pyo3(signature = (r#type, row, x, kernel = "auto"))]
fn dot(py: Python<'_>, r#type: &str, row: &[u8], x: &[u8], kernel: &str) -> PyResult<f32> {
    let ty = ggml_type(r#type)?;
    let k = self::kernel(kernel)?;
    let x = f32s(x, "x")?;
    py.detach(|| quant::dot_with(ty, row, &x, k)).into_py_result()
}

/// Whether a SIMD kernel exists on this CPU (AVX2+FMA on x86-64).
#[pyfunction]
fn simd_available() -> bool {
    Kernel::simd_available()
}

/// Quantizes float32 values (a multiple of 32) to Q8_0 blocks, exactly as gguf-py does.
#[pyfunction]
fn quantize_q8_0<'py>(py: Python<'py>, x: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    let x = f32s(x, "x")?;
    if x.len() % 32 != 0 {
        return Err(PyValueError::new_err(format!("Q8_0 needs a multiple of 32 values, got {}", x.len())));
    }
    let mut out = vec![0u8; x.len() / 32 * 34];
    quant::quantize_q8_0(&x, &mut out).into_py_result()?;
    Ok(PyBytes::new(py, &out))
}

fn to_half<'py>(
    py: Python<'py>,
    x: &[u8],
    f: fn(&[f32], &mut [u16]) -> ds4::Result<()>,
) -> PyResult<Bound<'py, PyBytes>> {
    let x = f32s(x, "x")?;
    let mut out = vec![0u16; x.len()];
    f(&x, &mut out).into_py_result()?;
    let bytes: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
    Ok(PyBytes::new(py, &bytes))
}

fn from_half<'py>(
    py: Python<'py>,
    x: &[u8],
    f: fn(&[u16], &mut [f32]) -> ds4::Result<()>,
) -> PyResult<Bound<'py, PyByteArray>> {
    let x = u16s(x, "x")?;
    fill_f32_bytearray(py, x.len() as u64, |dst| f(&x, dst))
}

/// float32 -> float16 bits (round to nearest even).
#[pyfunction]
fn f32_to_f16<'py>(py: Python<'py>, x: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    to_half(py, x, quant::f32_to_f16)
}

/// float16 bits -> float32.
#[pyfunction]
fn f16_to_f32<'py>(py: Python<'py>, x: &[u8]) -> PyResult<Bound<'py, PyByteArray>> {
    from_half(py, x, quant::f16_to_f32)
}

/// float32 -> bfloat16 bits (round to nearest even, as gguf-py).
#[pyfunction]
fn f32_to_bf16<'py>(py: Python<'py>, x: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
    to_half(py, x, quant::f32_to_bf16)
}

/// bfloat16 bits -> float32.
#[pyfunction]
fn bf16_to_f32<'py>(py: Python<'py>, x: &[u8]) -> PyResult<Bound<'py, PyByteArray>> {
    from_half(py, x, quant::bf16_to_f32)
}

/// (name, id, elements per block, bytes per block, supported) for every GGML type.
#[pyfunction]
fn ggml_types() -> Vec<(&'static str, u32, usize, usize, bool)> {
    GgmlType::all().map(|t| (t.name(), t.id(), t.block_elems(), t.block_bytes(), t.is_supported())).collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(dot, m)?)?;
    m.add_function(wrap_pyfunction!(simd_available, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_q8_0, m)?)?;
    m.add_function(wrap_pyfunction!(f32_to_f16, m)?)?;
    m.add_function(wrap_pyfunction!(f16_to_f32, m)?)?;
    m.add_function(wrap_pyfunction!(f32_to_bf16, m)?)?;
    m.add_function(wrap_pyfunction!(bf16_to_f32, m)?)?;
    m.add_function(wrap_pyfunction!(ggml_types, m)?)?;
    Ok(())
}
