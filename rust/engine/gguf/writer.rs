//! A streaming GGUF writer: the header first (metadata and tensor directory, offsets
//! computed from the declared shapes), then each tensor's bytes in declaration order. A
//! converter can therefore write a model tensor by tensor without holding it in memory.

use std::io::Write;

use super::reader::{DEFAULT_ALIGNMENT, MAX_DIMS};
use super::value::Value;
use crate::quant::GgmlType;
use crate::{Error, Result};

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    offset: u64,
    nbytes: u64,
}

/// Builds a GGUF v3 file. Declare metadata and tensors, call [`GgufWriter::write_header`],
/// then [`GgufWriter::write_tensor_data`] once per tensor in the order they were declared.
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
    data_size: u64,
    next_tensor: usize,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
            data_size: 0,
            next_tensor: 0,
        }
    }

    /// Adds a metadata entry. `general.alignment` (a u32 power of two) also sets the
    /// alignment used for tensor offsets; it must come before any tensor.
    pub fn add(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        let key = key.into();
        if self.metadata.iter().any(|(k, _)| *k == key) {
            return Err(Error::invalid(format!("duplicate metadata key {key:?}")));
        }
        if key == "general.alignment" {
            match value {
                Value::U32(a) if a != 0 && a.is_power_of_two() && self.tensors.is_empty() => self.alignment = a.into(),
                _ => return Err(Error::invalid("general.alignment must be a u32 power of two, set before any tensor")),
            }
        }
        check_value(&value)?;
        self.metadata.push((key, value));
        Ok(())
    }

    /// Declares a tensor with `dims` in GGUF (`ne`) order.
    pub fn add_tensor(&mut self, name: impl Into<String>, dims: &[u64], ggml_type: GgmlType) -> Result<()> {
        let name = name.into();
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(Error::invalid(format!("duplicate tensor name {name:?}")));
        }
        if dims.len() > MAX_DIMS {
            return Err(Error::invalid(format!("tensor {name:?}: more than {MAX_DIMS} dimensions")));
        }
        let n: u64 =
            dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or_else(|| Error::invalid("shape overflows"))?;
        let row = dims.first().copied().unwrap_or(1);
        let row_bytes = ggml_type.row_bytes(row).ok_or_else(|| {
            Error::invalid(format!("tensor {name:?}: row of {row} is not a whole number of {ggml_type} blocks"))
        })?;
        let nbytes = n.checked_div(row).map_or(0, |rows| row_bytes * rows);
        let offset = self.data_size;
        self.data_size = (offset + nbytes).div_ceil(self.alignment) * self.alignment;
        self.tensors.push(PendingTensor { name, dims: dims.to_vec(), ggml_type, offset, nbytes });
        Ok(())
    }

    /// Writes magic, counts, metadata and the tensor directory, padded to the alignment.
    pub fn write_header(&mut self, w: &mut impl Write) -> std::io::Result<()> {
        let mut buf = Vec::new();
        buf.extend_from_slice(b"GGUF");
        buf.extend_from_slice(&3u32.to_le_bytes());
        buf.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        buf.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut buf, k);
            buf.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            put_value(&mut buf, v);
        }
        for t in &self.tensors {
            put_str(&mut buf, &t.name);
            buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&t.ggml_type.id().to_le_bytes());
            buf.extend_from_slice(&t.offset.to_le_bytes());
        }
        let padded = (buf.len() as u64).div_ceil(self.alignment) * self.alignment;
        buf.resize(padded as usize, 0);
        w.write_all(&buf)
    }

    /// Writes the next tensor's bytes (and the padding after them).
    pub fn write_tensor_data(&mut self, w: &mut impl Write, data: &[u8]) -> Result<()> {
        let t = self
            .tensors
            .get(self.next_tensor)
            .ok_or_else(|| Error::invalid("all declared tensors were already written"))?;
        if data.len() as u64 != t.nbytes {
            return Err(Error::invalid(format!("tensor {:?} needs {} bytes, got {}", t.name, t.nbytes, data.len())));
        }
        let end = self.tensors.get(self.next_tensor + 1).map_or(self.data_size, |n| n.offset);
        let pad = (end - t.offset - t.nbytes) as usize;
        let io = |source| Error::Io { path: "<gguf writer>".into(), source };
        w.write_all(data).map_err(io)?;
        w.write_all(&vec![0u8; pad]).map_err(io)?;
        self.next_tensor += 1;
        Ok(())
    }
}

fn check_value(v: &Value) -> Result<()> {
    if let Value::Array(ty, items) = v {
        if let Some(bad) = items.iter().find(|i| i.value_type() != *ty) {
            return Err(Error::invalid(format!("array of {} holds a {}", ty.name(), bad.value_type().name())));
        }
        items.iter().try_for_each(check_value)?;
    }
    Ok(())
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.push(*x),
        Value::I8(x) => buf.push(*x as u8),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(u8::from(*x)),
        Value::String(s) => put_str(buf, s),
        Value::Array(ty, items) => {
            buf.extend_from_slice(&(*ty as u32).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for i in items {
                put_value(buf, i);
            }
        }
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufError, GgufFile, ValueType};

    fn build(meta: Vec<(&str, Value)>, tensors: &[(&str, &[u64], GgmlType, Vec<u8>)]) -> Vec<u8> {
        let mut w = GgufWriter::new();
        for (k, v) in meta {
            w.add(k, v).unwrap();
        }
        for (n, d, t, _) in tensors {
            w.add_tensor(*n, d, *t).unwrap();
        }
        let mut out = Vec::new();
        w.write_header(&mut out).unwrap();
        for (_, _, _, data) in tensors {
            w.write_tensor_data(&mut out, data).unwrap();
        }
        out
    }

    fn sample() -> Vec<u8> {
        let f32s: Vec<u8> = (0..6).flat_map(|i| (i as f32).to_le_bytes()).collect();
        build(
            vec![
                ("general.architecture", Value::String("deepseek4".into())),
                ("general.alignment", Value::U32(64)),
                ("a.u8", Value::U8(7)),
                ("a.i64", Value::I64(-5)),
                ("a.f64", Value::F64(0.25)),
                ("a.bool", Value::Bool(true)),
                (
                    "a.nested",
                    Value::Array(
                        ValueType::Array,
                        vec![
                            Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-2)]),
                            Value::Array(ValueType::String, vec![Value::String("x".into())]),
                        ],
                    ),
                ),
            ],
            &[
                ("t.f32", &[3, 2], GgmlType::F32, f32s),
                ("t.i32", &[2], GgmlType::I32, vec![1, 0, 0, 0, 2, 0, 0, 0]),
                ("t.q8", &[32], GgmlType::Q8_0, vec![0u8; 34]),
            ],
        )
    }

    #[test]
    fn round_trip() {
        let f = GgufFile::from_bytes(sample()).unwrap();
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), 64);
        assert_eq!(f.data_offset() % 64, 0);
        assert_eq!(f.architecture(), Some("deepseek4"));
        assert_eq!(f.get("a.i64"), Some(&Value::I64(-5)));
        assert_eq!(f.get("a.nested").unwrap().as_array().unwrap()[0].as_array().unwrap()[1], Value::I32(-2));
        let t = f.tensor("t.f32").unwrap();
        assert_eq!((t.dims.clone(), t.shape(), t.nbytes, t.n_elements), (vec![3, 2], vec![2, 3], 24, 6));
        assert_eq!(f.dequantize("t.f32").unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(f.tensor("t.i32").unwrap().offset % 64, 0);
        assert_eq!(f.tensor_data("t.i32").unwrap(), &[1, 0, 0, 0, 2, 0, 0, 0]);
        assert!(matches!(f.tensor_data("nope"), Err(Error::Gguf(GgufError::MissingTensor(_)))));
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        let last_end = f.tensors().iter().map(|t| f.data_offset() + t.offset + t.nbytes).max().unwrap();
        for cut in 0..last_end as usize {
            let r = GgufFile::from_bytes(bytes[..cut].to_vec());
            assert!(matches!(r, Err(Error::Gguf(_))), "cut at {cut} was accepted");
        }
    }

    #[test]
    fn every_byte_flip_is_handled() {
        // No panic for any single-byte corruption of the header; errors are GGUF errors.
        let bytes = sample();
        let f = GgufFile::from_bytes(bytes.clone()).unwrap();
        for i in 0..f.data_offset() as usize {
            for v in [0x00u8, 0xff, 0x80, 0x01] {
                let mut b = bytes.clone();
                b[i] ^= v;
                if let Err(e) = GgufFile::from_bytes(b) {
                    assert!(matches!(e, Error::Gguf(_)), "{e}");
                }
            }
        }
    }

    #[test]
    fn specific_errors() {
        let mut b = sample();
        b[0] = b'X';
        assert!(matches!(GgufFile::from_bytes(b).unwrap_err(), Error::Gguf(GgufError::BadMagic { .. })));
        // The message shows the first bytes as text, escaped where they are not printable.
        let mut b = sample();
        b[..4].copy_from_slice(b"\x7fEL\xff");
        let e = GgufFile::from_bytes(b).unwrap_err().to_string();
        assert!(e.contains(r#"starts with "\x7fEL\xff", expected "GGUF""#), "{e}");
        let mut b = sample();
        b[4] = 1;
        assert!(matches!(GgufFile::from_bytes(b).unwrap_err(), Error::Gguf(GgufError::UnsupportedVersion(1))));
        // A tensor count that cannot fit in the file.
        let mut b = sample();
        b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(
            GgufFile::from_bytes(b).unwrap_err(),
            Error::Gguf(GgufError::Overflow { .. } | GgufError::Truncated { .. })
        ));
        // Duplicate key and duplicate tensor names.
        let dup = build(vec![("k", Value::U8(1))], &[]);
        let mut w = dup.clone();
        // Patch the kv count to 2 and append the same entry again before padding.
        w.truncate(24 + 8 + 1 + 4 + 1);
        w[16..24].copy_from_slice(&2u64.to_le_bytes());
        let entry = w[24..].to_vec();
        w.extend_from_slice(&entry);
        assert_eq!(GgufFile::from_bytes(w).unwrap_err().to_string(), "duplicate metadata key \"k\"");
    }

    #[test]
    fn empty_tensor_with_huge_dims() {
        // Found by the fuzzer: 0 elements, but the product of the other dims overflows.
        let mut w = GgufWriter::new();
        w.add_tensor("t", &[0, 1 << 32, 1 << 32], GgmlType::F32).unwrap();
        let mut out = Vec::new();
        w.write_header(&mut out).unwrap();
        w.write_tensor_data(&mut out, &[]).unwrap();
        let e = GgufFile::from_bytes(out).unwrap_err();
        assert!(matches!(e, Error::Gguf(GgufError::BadShape { .. })), "{e}");
        // An ordinary empty tensor is fine.
        let mut w = GgufWriter::new();
        w.add_tensor("t", &[0, 3], GgmlType::F32).unwrap();
        let mut out = Vec::new();
        w.write_header(&mut out).unwrap();
        w.write_tensor_data(&mut out, &[]).unwrap();
        let f = GgufFile::from_bytes(out).unwrap();
        let t = f.tensor("t").unwrap();
        assert_eq!((t.n_elements, t.n_rows(), t.nbytes), (0, 0, 0));
        assert_eq!(f.dequantize("t").unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn rejects_bad_shapes_and_offsets() {
        // A Q8_0 tensor whose row is not a multiple of 32.
        let mut w = GgufWriter::new();
        w.add_tensor("t", &[32], GgmlType::Q8_0).unwrap();
        let mut out = Vec::new();
        w.write_header(&mut out).unwrap();
        w.write_tensor_data(&mut out, &[0u8; 34]).unwrap();
        let dims_at = 24 + 8 + 1 + 4;
        let mut b = out.clone();
        b[dims_at..dims_at + 8].copy_from_slice(&33u64.to_le_bytes());
        assert!(matches!(GgufFile::from_bytes(b).unwrap_err(), Error::Gguf(GgufError::BadShape { .. })));
        let mut b = out.clone();
        b[dims_at + 8 + 4..dims_at + 16 + 4].copy_from_slice(&3u64.to_le_bytes());
        assert!(matches!(GgufFile::from_bytes(b).unwrap_err(), Error::Gguf(GgufError::Misaligned { .. })));
        let mut b = out.clone();
        b[dims_at + 8 + 4..dims_at + 16 + 4].copy_from_slice(&32u64.to_le_bytes());
        assert!(matches!(GgufFile::from_bytes(b).unwrap_err(), Error::Gguf(GgufError::OutOfBounds { .. })));
        let mut b = out.clone();
        b[dims_at + 8..dims_at + 12].copy_from_slice(&4u32.to_le_bytes());
        assert!(matches!(
            GgufFile::from_bytes(b).unwrap_err(),
            Error::Gguf(GgufError::UnknownTensorType { type_id: 4, .. })
        ));
    }

    /// Metadata arrays whose items (a 32-byte value each in memory, one byte a u8 in the
    /// file) would pass [`crate::gguf::reader::MAX_METADATA_ITEMS`] are refused before they
    /// are made: a 16 MB file must not take half a gigabyte and more.
    #[test]
    fn refuses_metadata_arrays_past_the_item_budget() {
        use crate::gguf::reader::MAX_METADATA_ITEMS;
        let file = |count: u64| {
            let mut b = Vec::new();
            b.extend_from_slice(b"GGUF");
            b.extend_from_slice(&3u32.to_le_bytes());
            b.extend_from_slice(&0u64.to_le_bytes()); // tensors
            b.extend_from_slice(&1u64.to_le_bytes()); // metadata entries
            b.extend_from_slice(&1u64.to_le_bytes());
            b.push(b'x');
            b.extend_from_slice(&9u32.to_le_bytes()); // an array
            b.extend_from_slice(&0u32.to_le_bytes()); // of u8
            b.extend_from_slice(&count.to_le_bytes());
            b.resize(b.len() + count as usize, 0);
            b
        };
        let e = GgufFile::from_bytes(file(MAX_METADATA_ITEMS + 1)).unwrap_err();
        assert!(matches!(&e, Error::Gguf(GgufError::Overflow { detail, .. }) if detail.contains("at most")), "{e}");
        assert!(GgufFile::from_bytes(file(1000)).is_ok());
    }
}
