//! Fuzz the GGUF reader: parse an arbitrary byte image, then touch everything the parsed file
//! hands out (metadata values, tensor bytes, dequantized rows). Any panic, out-of-bounds
//! slice, arithmetic overflow (debug assertions are on under cargo fuzz) or broken invariant
//! below is a bug in the reader or the dequantizers.
#![no_main]

use std::hint::black_box;
use std::sync::OnceLock;

use ds4::gguf::{GgufFile, Value};
use libfuzzer_sys::fuzz_target;

/// Tensors with more elements than this are not dequantized (keeps allocations small).
const MAX_ELEMENTS: u64 = 1 << 20;
/// Rows dequantized per tensor.
const MAX_ROWS: u64 = 4;
/// Tensors up to this many elements are also dequantized whole, through the reader.
const SMALL_TENSOR: u64 = 4096;

fn walk(v: &Value, depth: usize) {
    // The reader bounds nesting; a deep value here means it did not.
    assert!(depth <= 64, "metadata nested {depth} levels deep");
    black_box(v.value_type());
    black_box(v.as_u64());
    black_box(v.as_i64());
    black_box(v.as_f64());
    black_box(v.as_bool());
    black_box(v.as_str().map(str::len));
    if let Value::Array(elem_ty, items) = v {
        for item in items {
            assert_eq!(item.value_type(), *elem_ty, "array element of the wrong type");
            walk(item, depth + 1);
        }
    }
}

/// `DS4_FUZZ_VERBOSE=1` prints what the reader made of each input (for checking seeds:
/// `cargo fuzz run gguf_parse corpus/gguf_parse -- -runs=0`).
fn verbose() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| std::env::var_os("DS4_FUZZ_VERBOSE").is_some_and(|v| v != "0"))
}

fuzz_target!(|data: &[u8]| {
    let file = match GgufFile::from_bytes(data.to_vec()) {
        Ok(file) => file,
        Err(e) => {
            if verbose() {
                eprintln!("rejected ({} bytes): {e}", data.len());
            }
            return;
        }
    };
    if verbose() {
        eprintln!("accepted ({} bytes): {file:?}", data.len());
    }
    black_box((file.version(), file.alignment(), file.architecture()));
    assert!(file.data_offset() % file.alignment() == 0);

    for (key, value) in file.metadata() {
        // Keys are unique, so lookup finds this very entry.
        assert!(std::ptr::eq(file.get(key).expect("metadata key not found"), value));
        walk(value, 0);
    }

    for info in file.tensors() {
        let bytes = file.tensor_data(&info.name).expect("tensor in the directory has no data");
        assert_eq!(bytes.len() as u64, info.nbytes, "tensor {:?}", info.name);
        assert!(std::ptr::eq(file.tensor(&info.name).expect("tensor not found"), info));
        if info.nbytes > 0 {
            let end = file.data_offset() + info.offset + info.nbytes;
            assert!(end <= file.file_size(), "tensor {:?} ends past the file", info.name);
        }
        black_box((info.shape(), info.row_len()));
        // fuzz/crashes/gguf_parse-n_rows-mul-overflow.gguf once panicked here.
        black_box(info.n_rows());

        if !info.ggml_type.is_supported() || info.n_elements == 0 || info.n_elements > MAX_ELEMENTS {
            continue;
        }
        let row_len = info.row_len();
        let row_bytes = info.ggml_type.row_bytes(row_len).expect("accepted tensor has a bad row length");
        let rows = info.n_rows().min(MAX_ROWS);
        let n_bytes = (row_bytes * rows) as usize;
        let mut out = vec![0.0f32; (row_len * rows) as usize];
        // Any bit pattern is a valid payload (NaN scales give NaN outputs), and the lengths
        // are right by construction, so this must succeed.
        ds4::quant::dequantize(info.ggml_type, &bytes[..n_bytes], &mut out)
            .unwrap_or_else(|e| panic!("dequantize of tensor {:?} failed: {e}", info.name));
        // The whole-tensor path of the reader agrees with the row path, bit for bit.
        if info.n_elements <= SMALL_TENSOR {
            let all = file
                .dequantize(&info.name)
                .unwrap_or_else(|e| panic!("GgufFile::dequantize of {:?} failed: {e}", info.name));
            assert_eq!(all.len() as u64, info.n_elements);
            assert!(
                all.iter().zip(&out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "tensor {:?}: whole-tensor and row dequantization differ",
                info.name
            );
        }
    }
});
