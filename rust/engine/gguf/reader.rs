//! Parsing and validation of the GGUF header, and access to tensor bytes.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::error::GgufError;
use super::value::{Value, ValueType};
use crate::quant::{self, GgmlType};
use crate::{Error, Result};

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor may have (ggml's limit).
pub const MAX_DIMS: usize = 4;
/// Most elements a tensor's shape may describe (zero dims counted as 1).
pub const MAX_ELEMENTS: u64 = 1 << 60;
/// Deepest nesting of arrays inside a metadata value. Real files nest at most once; the
/// limit keeps recursion bounded on hostile input.
const MAX_ARRAY_DEPTH: usize = 8;

/// Most array items the metadata may hold in all: a V4 tokenizer's arrays hold about 390 000
/// (tokens, types, merges), so this leaves room forty times over and bounds the parsed
/// metadata to about half a gigabyte.
pub const MAX_METADATA_ITEMS: u64 = 1 << 24;

/// One entry of the tensor directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGUF (`ne`) order: `dims[0]` is the row length (fastest varying).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset of the tensor's data from the start of the data section.
    pub offset: u64,
    /// Size of the tensor's data in bytes.
    pub nbytes: u64,
    /// Number of elements (product of `dims`).
    pub n_elements: u64,
}

impl TensorInfo {
    /// The shape in row-major (numpy) order: `dims` reversed.
    pub fn shape(&self) -> Vec<u64> {
        self.dims.iter().rev().copied().collect()
    }

    /// Elements per row (`dims[0]`), 1 for a scalar.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of all dims but the first; 0 for an empty tensor). Computed
    /// from the element count, which the reader checked for overflow; the plain product of
    /// the other dims can overflow when the row length is 0.
    pub fn n_rows(&self) -> u64 {
        self.n_elements.checked_div(self.row_len()).unwrap_or(0)
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open, fully validated GGUF file.
///
/// Tensor data is not copied: [`GgufFile::tensor_data`] returns slices of the memory map.
pub struct GgufFile {
    storage: Storage,
    path: Option<PathBuf>,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    metadata_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let storage = if len == 0 {
            // mmap of an empty file fails on some platforms; an empty file is just truncated.
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only and private to this process. As with every
            // mmap-based loader, another process truncating the file while it is mapped can
            // fault; the files we read are model weights that nobody rewrites in place.
            Storage::Mmap(unsafe { memmap2::Mmap::map(&file) }.map_err(io)?)
        };
        let mut f = Self::parse(storage)?;
        f.path = Some(path.to_path_buf());
        Ok(f)
    }

    /// Validates a GGUF image held in memory (tests, fuzzing, files from elsewhere).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self> {
        let header = parse_header(storage.bytes())?;
        Ok(GgufFile {
            storage,
            path: None,
            version: header.version,
            alignment: header.alignment,
            data_offset: header.data_offset,
            metadata_index: header.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect(),
            metadata: header.metadata,
            tensor_index: header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect(),
            tensors: header.tensors,
        })
    }

    /// The path this file was opened from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (from `general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute offset of the data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The whole file image (the memory map). Tensor `t` lives at
    /// `data_offset() + t.offset .. + t.nbytes`.
    pub fn raw(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Total size of the file in bytes.
    pub fn file_size(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The metadata value for `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// `general.architecture`, if present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }

    /// The tensor directory, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The directory entry of the tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of the tensor `name` (a slice of the map).
    pub fn tensor_data(&self, name: &str) -> Result<&[u8]> {
        let info = self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        Ok(self.bytes_of(info))
    }

    /// The raw bytes of a tensor of this file. Bounds were checked when the file was opened.
    pub fn bytes_of(&self, info: &TensorInfo) -> &[u8] {
        if info.nbytes == 0 {
            return &[];
        }
        let start = (self.data_offset + info.offset) as usize;
        &self.storage.bytes()[start..start + info.nbytes as usize]
    }

    /// Dequantizes the tensor `name` into a new vector of `n_elements` floats.
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let info = self.tensor(name).ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        let mut out = vec![0.0f32; usize::try_from(info.n_elements).map_err(|_| Error::invalid("tensor too large"))?];
        self.dequantize_into(info, &mut out)?;
        Ok(out)
    }

    /// Dequantizes a tensor of this file into `dst` (exactly `n_elements` long).
    pub fn dequantize_into(&self, info: &TensorInfo, dst: &mut [f32]) -> Result<()> {
        if dst.len() as u64 != info.n_elements {
            return Err(Error::invalid(format!(
                "tensor {:?} has {} elements, the destination holds {}",
                info.name,
                info.n_elements,
                dst.len()
            )));
        }
        // Rows are whole blocks, so the tensor is one run of blocks.
        quant::dequantize(info.ggml_type, self.bytes_of(info), dst)
    }
}

struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian reader over the file image.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Array items of the metadata read so far ([`MAX_METADATA_ITEMS`]).
    items: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed UTF-8 string.
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let start = self.pos as u64;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::InvalidUtf8 { what: what(), offset: start })
    }

    /// Fails unless `count` items of at least `min_size` bytes each can still fit; this bounds
    /// every allocation by the size of the file.
    fn check_count(&self, count: u64, min_size: u64, what: &dyn Fn() -> String) -> Result<(), GgufError> {
        let needed = count.checked_mul(min_size).ok_or_else(|| GgufError::Overflow {
            what: what(),
            detail: format!("{count} items of {min_size} bytes"),
        })?;
        if needed > self.remaining() {
            return Err(GgufError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value, GgufError> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => {
                let offset = self.pos as u64;
                match self.array::<1>(&what)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    value => return Err(GgufError::InvalidBool { key: key.to_string(), offset, value }),
                }
            }
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::TooDeep { key: key.to_string(), max_depth: MAX_ARRAY_DEPTH });
                }
                let elem_what = || format!("array element type of metadata key {key:?}");
                let type_id = self.u32(&elem_what)?;
                let elem = ValueType::from_id(type_id)
                    .ok_or_else(|| GgufError::UnknownValueType { key: key.to_string(), type_id })?;
                let count = self.u64(&|| format!("array length of metadata key {key:?}"))?;
                self.check_count(count, elem.min_size(), &what)?;
                // An item takes a `Value` in memory (32 bytes) whatever its size in the file
                // (one byte for a u8): the file's size alone would let a 100 MB array take 3 GB.
                self.items = self.items.saturating_add(count);
                if self.items > MAX_METADATA_ITEMS {
                    return Err(GgufError::Overflow {
                        what: what(),
                        detail: format!("metadata arrays hold at most {MAX_METADATA_ITEMS} items in all"),
                    });
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

fn parse_header(buf: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { buf, pos: 0, items: 0 };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;

    // Each metadata entry takes at least 8 (key length) + 4 (type) + 1 bytes.
    c.check_count(n_kv, 13, &|| format!("{n_kv} metadata entries"))?;
    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut seen_keys = HashMap::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&|| format!("key of metadata entry {i}"))?;
        let type_id = c.u32(&|| format!("value type of metadata key {key:?}"))?;
        let ty =
            ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType { key: key.clone(), type_id })?;
        let value = c.value(ty, &key, 0)?;
        if seen_keys.insert(key.clone(), ()).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.push((key, value));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) if *a != 0 && a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => return Err(GgufError::BadAlignment(format!("{v:?}"))),
    };

    // Each tensor entry takes at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset).
    c.check_count(n_tensors, 24, &|| format!("{n_tensors} tensor entries"))?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors as usize);
    let mut seen_names = HashMap::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&|| format!("name of tensor {i}"))?;
        let what = |field: &str| format!("{field} of tensor {name:?}");
        let n_dims = c.u32(&|| what("dimension count"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims { name, n_dims, max: MAX_DIMS });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&|| what("dimensions"))?);
        }
        let type_id = c.u32(&|| what("type"))?;
        let offset = c.u64(&|| what("data offset"))?;
        let ggml_type =
            GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType { name: name.clone(), type_id })?;
        let bad_shape = |reason: String| GgufError::BadShape { name: name.clone(), dims: dims.clone(), reason };
        // The shape, zero-sized dims counted as 1, must stay below 2^60 elements so that
        // 8-byte elements still fit a signed 64-bit byte count: an empty tensor with absurd
        // other dims is as malformed as a huge one, and no array library can represent it.
        dims.iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d.max(1)))
            .filter(|&n| n <= MAX_ELEMENTS)
            .ok_or_else(|| bad_shape("element count overflows".into()))?;
        let n_elements: u64 = dims.iter().product();
        let row_len = dims.first().copied().unwrap_or(1);
        let row_bytes = ggml_type.row_bytes(row_len).ok_or_else(|| {
            bad_shape(format!(
                "row length {row_len} is not a multiple of the {ggml_type} block size {}",
                ggml_type.block_elems()
            ))
        })?;
        let n_rows = n_elements.checked_div(row_len).unwrap_or(0);
        let nbytes = row_bytes.checked_mul(n_rows).ok_or_else(|| bad_shape("byte size overflows".into()))?;
        if offset % alignment != 0 {
            return Err(GgufError::Misaligned { name, offset, alignment });
        }
        if seen_names.insert(name.clone(), ()).is_some() {
            return Err(GgufError::DuplicateTensor(name));
        }
        tensors.push(TensorInfo { name, dims, ggml_type, offset, nbytes, n_elements });
    }

    let header_end = c.pos as u64;
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let data_len = (buf.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        let end = t.offset.checked_add(t.nbytes);
        match end {
            Some(end) if t.nbytes == 0 || end <= data_len => {}
            _ => {
                return Err(GgufError::OutOfBounds {
                    name: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    data_len,
                })
            }
        }
    }
    Ok(Header { version, alignment, data_offset, metadata, tensors })
}
