//! `GGUFFile` and `TensorInfo`.

use std::sync::Arc;

use ds4::gguf::{GgufFile, TensorInfo, Value};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyList};

use crate::IntoPy;

/// One entry of a GGUF file's tensor directory.
#[pyclass(name = "TensorInfo", module = "ds4._ds4", frozen, get_all)]
pub struct PyTensorInfo {
    /// Tensor name.
    name: String,
    /// Shape in row-major (numpy) order, as returned by `GGUFFile.read`.
    shape: Vec<u64>,
    /// Dimensions in GGUF order (`ne`): the row length first.
    dims: Vec<u64>,
    /// GGML type name ("F32", "Q8_0", "IQ2_XXS", ...).
    r#type: String,
    /// GGML type id.
    type_id: u32,
    /// Absolute byte offset of the tensor data in the file.
    offset: u64,
    /// Size of the tensor data in bytes.
    nbytes: u64,
    /// Number of elements.
    n_elements: u64,
}

#[pymethods]
impl PyTensorInfo {
    fn __repr__(&self) -> String {
        format!(
            "TensorInfo(name={:?}, shape={:?}, type={:?}, offset={}, nbytes={})",
            self.name, self.shape, self.r#type, self.offset, self.nbytes
        )
    }
}

impl PyTensorInfo {
    fn new(file: &GgufFile, t: &TensorInfo) -> Self {
        PyTensorInfo {
            name: t.name.clone(),
            shape: t.shape(),
            dims: t.dims.clone(),
            r#type: t.ggml_type.name().to_string(),
            type_id: t.ggml_type.id(),
            offset: file.data_offset() + t.offset,
            nbytes: t.nbytes,
            n_elements: t.n_elements,
        }
    }
}

/// A memory-mapped, validated GGUF file (native part of `ds4.gguf.GGUFFile`).
#[pyclass(name = "GGUFFile", module = "ds4._ds4", frozen)]
pub struct PyGgufFile {
    inner: Arc<GgufFile>,
    path: String,
}

#[pymethods]
impl PyGgufFile {
    #[new]
    fn new(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let display = path.display().to_string();
        let inner = py.detach(|| GgufFile::open(&path)).into_py_result()?;
        Ok(PyGgufFile { inner: Arc::new(inner), path: display })
    }

    /// The path the file was opened from.
    #[getter]
    fn path(&self) -> &str {
        &self.path
    }

    /// GGUF version (2 or 3).
    #[getter]
    fn version(&self) -> u32 {
        self.inner.version()
    }

    /// Alignment of tensor data in bytes.
    #[getter]
    fn alignment(&self) -> u64 {
        self.inner.alignment()
    }

    /// Absolute offset of the data section.
    #[getter]
    fn data_offset(&self) -> u64 {
        self.inner.data_offset()
    }

    /// File size in bytes.
    #[getter]
    fn file_size(&self) -> u64 {
        self.inner.file_size()
    }

    /// All metadata as a new dict, in file order.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.metadata() {
            d.set_item(k, value_to_py(py, v)?)?;
        }
        Ok(d)
    }

    /// GGUF value type of each metadata key: "u32", "string", "array[f32]", ...
    fn metadata_types<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.inner.metadata() {
            d.set_item(k, type_name(v))?;
        }
        Ok(d)
    }

    /// The tensor directory, in file order.
    fn tensors(&self) -> Vec<PyTensorInfo> {
        self.inner.tensors().iter().map(|t| PyTensorInfo::new(&self.inner, t)).collect()
    }

    /// The raw bytes of tensor `name`.
    fn read_raw<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let data = self.inner.tensor_data(name).into_py_result()?;
        Ok(PyBytes::new(py, data))
    }

    /// Tensor `name` dequantized to little-endian float32 values, in a new bytearray.
    fn dequantize<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyByteArray>> {
        let info = self
            .inner
            .tensor(name)
            .cloned()
            .ok_or_else(|| crate::errors::to_pyerr(ds4::gguf::GgufError::MissingTensor(name.to_string()).into()))?;
        let file = Arc::clone(&self.inner);
        crate::quant::fill_f32_bytearray(py, info.n_elements, move |dst| file.dequantize_into(&info, dst))
    }
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Array(ty, items) => match (ty, items.first()) {
            (ds4::gguf::ValueType::Array, Some(inner)) => format!("array[{}]", type_name(inner)),
            _ => format!("array[{}]", ty.name()),
        },
        other => other.value_type().name().to_string(),
    }
}

fn value_to_py<'py>(py: Python<'py>, v: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        Value::U8(x) => x.into_pyobject(py)?.into_any(),
        Value::I8(x) => x.into_pyobject(py)?.into_any(),
        Value::U16(x) => x.into_pyobject(py)?.into_any(),
        Value::I16(x) => x.into_pyobject(py)?.into_any(),
        Value::U32(x) => x.into_pyobject(py)?.into_any(),
        Value::I32(x) => x.into_pyobject(py)?.into_any(),
        Value::U64(x) => x.into_pyobject(py)?.into_any(),
        Value::I64(x) => x.into_pyobject(py)?.into_any(),
        Value::F32(x) => f64::from(*x).into_pyobject(py)?.into_any(),
        Value::F64(x) => x.into_pyobject(py)?.into_any(),
        Value::Bool(x) => x.into_pyobject(py)?.to_owned().into_any(),
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(_, items) => {
            let list = PyList::empty(py);
            for i in items {
                list.append(value_to_py(py, i)?)?;
            }
            list.into_any()
        }
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyGgufFile>()?;
    m.add_class::<PyTensorInfo>()?;
    Ok(())
}
