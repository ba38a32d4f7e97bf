//! Device copies of file images: the tensor data region of a GGUF file, copied once into one
//! plain device allocation and found again by the host address range of the image. Tensors of
//! the split formats are stored in their split row layout ([`crate::quant::split`]).

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use rayon::prelude::*;

use super::context::{driver_err, tensor_cores};
use crate::model::weights::Mat;
use crate::quant::split::{is_split, q8_0, split_rows};
use crate::{Error, Result};

/// Bytes past the end of every image copy: the kernels stage weights in 16-byte loads and may
/// read up to 15 bytes past the end of a matrix's last row.
pub(crate) const PAD: usize = 256;
/// Bytes per host-to-device copy of an upload (one progress step).
const CHUNK: usize = 64 << 20;
/// Device memory left free after an upload, for the kernels' buffers and the driver.
const HEADROOM: usize = 512 << 20;

/// The device copy of `raw[data_offset..]` of one image `raw`.
pub(crate) struct DeviceImage {
    /// Host address and length of the whole image (what `matmul_many` receives as `raw`).
    pub(crate) host_ptr: usize,
    pub(crate) host_len: usize,
    /// Offset in the image of the first byte copied.
    pub(crate) data_offset: usize,
    pub(crate) dptr: sys::CUdeviceptr,
    /// The tensors stored split, sorted by start, not overlapping: image offsets
    /// `start..start + nbytes()` of rows of `n_in` elements of `ty`, with the rows of one
    /// plane (a 2-D tensor's rows, a 3-D tensor's rows per expert; Q8_0's tiles are counted
    /// per plane).
    split: Vec<(Mat, usize)>,
    /// Device tables derived from the image's tensors, by the image offset of the tensor they
    /// come from ([`super::CudaBackend::derived`]): made once for every session of the model,
    /// freed with the image or, when a decoder still holds one, with that decoder.
    pub(crate) derived: Vec<(usize, std::sync::Arc<super::device::DevBuf>)>,
}

impl DeviceImage {
    /// Whether `raw` is the image this is a copy of (same address and length).
    pub(crate) fn is(&self, raw: &[u8]) -> bool {
        raw.as_ptr() as usize == self.host_ptr && raw.len() == self.host_len
    }

    /// The device address of image offset `off` (`off >= data_offset`).
    pub(crate) fn addr(&self, off: usize) -> sys::CUdeviceptr {
        self.dptr + (off - self.data_offset) as u64
    }

    /// Whether bytes `start..start + len` of the image are in the copy.
    pub(crate) fn holds(&self, start: usize, len: usize) -> bool {
        start >= self.data_offset && start.checked_add(len).is_some_and(|e| e <= self.host_len)
    }

    /// The plane rows of the split tensor holding the rows of `w` (a split format): one of the
    /// same format and row length that was split at upload, `w` at a row boundary of it and,
    /// when the plane is on Q8_0's tensor cores, a range that kernel takes (`q8_0::takes_rows`:
    /// from a tile's start, ending at a tile's or a plane's end).
    fn split_plane(&self, w: &Mat) -> Option<usize> {
        let i = self.split.partition_point(|(t, _)| t.start <= w.start);
        let (t, plane) = self.split.get(i.checked_sub(1)?)?;
        let tiled = tensor_cores(t.ty, t.n_in, *plane);
        let inside = t.ty == w.ty
            && t.n_in == w.n_in
            && t.row_bytes == w.row_bytes
            && (w.start - t.start).is_multiple_of(t.row_bytes)
            && w.start + w.nbytes() <= t.start + t.nbytes()
            && (!tiled || q8_0::takes_rows((w.start - t.start) / t.row_bytes, w.n_out, *plane));
        inside.then_some(*plane)
    }

    /// Whether the rows of `w` (a split format) are stored split ([`DeviceImage::split_plane`]).
    pub(crate) fn holds_split(&self, w: &Mat) -> bool {
        self.split_plane(w).is_some()
    }

    /// `w` with the rows that choose the kernel of its products: its plane's when its rows are
    /// stored split (the plane's kernel laid them out at upload: Flash's o_a groups, 1024 of
    /// its 8192 rows, take the tensor cores with it), else its own. The products then split
    /// as the plane's do, so their rows are the plane's product's bit for bit.
    pub(crate) fn kernel_mat(&self, w: &Mat) -> Mat {
        match self.split_plane(w) {
            Some(plane) => Mat { n_out: plane, ..*w },
            None => *w,
        }
    }

    /// Copies `raw[data_offset..]` to a new device allocation, in chunks of [`CHUNK`] bytes,
    /// calling `progress(done, total)` after each. The context must be bound. `tensors` are
    /// the image's tensors (rows of `n_in` elements of `ty` each) with their plane's rows;
    /// those of a split format are stored split, the others as they are. Tensors that overlap
    /// an earlier one, lie outside the data, whose rows are not whole blocks or not whole
    /// planes are copied as they are (and products on them of a split format then run on the
    /// CPU).
    pub(crate) fn upload(
        raw: &[u8],
        data_offset: usize,
        tensors: &[(Mat, usize)],
        mut progress: impl FnMut(u64, u64),
    ) -> Result<Self> {
        let data = raw
            .get(data_offset..)
            .ok_or_else(|| Error::invalid(format!("CUDA upload: data offset {data_offset} past the image end")))?;
        let (free, total) = cu::mem_get_info().map_err(driver_err("querying free memory"))?;
        let need = data.len() + PAD;
        if need + HEADROOM > free {
            return Err(Error::Backend(format!(
                "CUDA: the weights need {:.2} GiB of device memory (plus {} MiB headroom) but only {:.2} of {:.2} GiB are free",
                need as f64 / (1u64 << 30) as f64,
                HEADROOM >> 20,
                free as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64
            )));
        }
        // SAFETY: a plain allocation; freed in Drop (or below on error).
        let dptr = unsafe { cu::malloc_sync(need) }.map_err(driver_err("allocating the weights"))?;
        let mut split: Vec<(Mat, usize)> = tensors
            .iter()
            .filter(|(t, plane)| {
                is_split(t.ty)
                    && t.n_out > 0
                    && *plane > 0
                    && t.n_out.is_multiple_of(*plane)
                    && t.ty.row_bytes(t.n_in as u64) == Some(t.row_bytes as u64)
                    && t.n_in.is_multiple_of(t.ty.block_elems())
                    && t.start >= data_offset
                    && t.start.checked_add(t.nbytes()).is_some_and(|e| e <= raw.len())
            })
            .copied()
            .collect();
        split.sort_by_key(|(t, _)| t.start);
        let mut end = 0;
        split.retain(|(t, _)| {
            let keep = t.start >= end;
            if keep {
                end = t.start + t.nbytes();
            }
            keep
        });
        let mut img = DeviceImage {
            host_ptr: raw.as_ptr() as usize,
            host_len: raw.len(),
            data_offset,
            dptr,
            split,
            derived: Vec::new(),
        };
        // The padding is zeroed so that what the kernels over-read is defined.
        // SAFETY: the PAD bytes after the data are inside the allocation.
        unsafe { cu::memset_d8_sync(dptr + data.len() as u64, 0, PAD) }.map_err(driver_err("clearing the padding"))?;
        let total_bytes = data.len() as u64;
        progress(0, total_bytes);
        // Copies raw[from..to] as it is, or split when `rows` (the tensor) is given.
        let mut stage: Vec<u8> = Vec::new();
        let mut copy = |from: usize, to: usize, rows: Option<(Mat, usize)>| -> Result<()> {
            let mut at = from;
            while at < to {
                let (next, src): (usize, &[u8]) = match rows {
                    None => {
                        let next = (at + CHUNK).min(to);
                        (next, &raw[at..next])
                    }
                    Some((t, plane)) => {
                        let row = (at - t.start) / t.row_bytes;
                        let tiled = tensor_cores(t.ty, t.n_in, plane);
                        let (end, par) = piece(t.n_out, plane, row, (CHUNK / t.row_bytes).max(1), tiled);
                        let next = t.start + t.row_bytes * end;
                        stage.clear();
                        stage.extend_from_slice(&raw[at..next]);
                        split_piece(&t, plane, row, par, tiled, &mut stage);
                        (next, &stage)
                    }
                };
                // SAFETY: the destination range is inside the allocation; the copy is
                // synchronous, so the source only needs to live for the call.
                unsafe { cu::memcpy_htod_sync(dptr + (at - data_offset) as u64, src) }
                    .map_err(driver_err("copying the weights"))?;
                at = next;
                progress((at - data_offset) as u64, total_bytes);
            }
            Ok(())
        };
        let mut at = data_offset;
        for &(t, plane) in &img.split {
            copy(at, t.start, None)?;
            copy(t.start, t.start + t.nbytes(), Some((t, plane)))?;
            at = t.start + t.nbytes();
        }
        copy(at, raw.len(), None)?;
        img.split.shrink_to_fit();
        // The copies ran on the legacy stream, which the backend's non-blocking stream does not
        // wait for: finish them before any kernel may read the weights.
        super::device::sync_legacy("copying the weights")?;
        Ok(img)
    }
}

impl Drop for DeviceImage {
    fn drop(&mut self) {
        // SAFETY: allocated by `upload`, freed once; the owner binds the context first.
        unsafe { cu::free_sync(self.dptr).ok() };
    }
}

/// The upload piece of a split tensor of `n` rows (`plane` rows a plane) that starts at row
/// `row`, about `rows` rows long: its end row, and the rows of the parts it is split in, in
/// parallel. Rows split alone (`tiled` false) may be cut anywhere: `rows` rows, parts of 64.
/// The Q8_0 tiles (`tiled`) need pieces and parts that each start a tile of their plane
/// ([`piece_end`]; parts of whole planes when a plane has a tail), so that the split of each
/// part alone is the split of the whole.
fn piece(n: usize, plane: usize, row: usize, rows: usize, tiled: bool) -> (usize, usize) {
    if !tiled {
        return ((row + rows).min(n), 64);
    }
    let par = if plane.is_multiple_of(q8_0::TILE_ROWS) { 64 } else { plane };
    (piece_end(row, n, plane, rows), par)
}

/// Splits `rows` (the rows from `row` on of split tensor `t`, `plane` rows a plane) in place,
/// in parallel parts of `par` rows ([`piece`]).
fn split_piece(t: &Mat, plane: usize, row: usize, par: usize, tiled: bool, rows: &mut [u8]) {
    let rb = t.row_bytes;
    rows.par_chunks_mut(rb * par).enumerate().for_each(|(i, c)| {
        split_rows(t.ty, rb, c, tiled.then_some((plane, (row + i * par) % plane)));
    });
}

/// The end row of a piece of tiled rows: a multiple of 64 rows when the planes have no tail
/// (every 64-row piece then starts a tile), else whole planes, or whole tiles up to the
/// plane's end for a plane larger than a piece.
fn piece_end(row: usize, n: usize, plane: usize, rows: usize) -> usize {
    let end = if plane.is_multiple_of(q8_0::TILE_ROWS) {
        row + rows.next_multiple_of(64)
    } else if plane <= rows {
        row + rows / plane * plane
    } else {
        let plane_end = (row / plane + 1) * plane;
        (row + rows.next_multiple_of(q8_0::TILE_ROWS)).min(plane_end)
    };
    end.min(n)
}

#[cfg(test)]
mod tests {
    use super::{piece, piece_end, split_piece};
    use crate::model::weights::Mat;
    use crate::quant::split::{random_rows, split_rows};
    use crate::quant::GgmlType;

    /// The upload's pieces and parallel parts give the bytes of the whole tensor split plane by
    /// plane (the layout the kernels read), for the tiled Q8_0 layout and for the row-local
    /// ones, with planes that have a tail, pieces shorter and longer than a plane, and tensors
    /// that end inside a piece. (The split is a byte permutation: random bytes will do.)
    #[test]
    fn upload_pieces_split_as_the_whole() {
        let cases = [
            (GgmlType::Q8_0, true, 3, 37, 50),
            (GgmlType::Q8_0, true, 3, 37, 20),
            (GgmlType::Q8_0, true, 4, 37, 100),
            (GgmlType::Q8_0, true, 2, 200, 150),
            (GgmlType::Q8_0, true, 2, 160, 100),
            (GgmlType::Q8_0, true, 1, 200, 7),
            (GgmlType::Q8_0, false, 3, 37, 50),
            (GgmlType::Q2_K, false, 2, 150, 64),
            (GgmlType::IQ2_XXS, false, 4, 40, 30),
        ];
        for (i, (ty, tiled, planes, plane, rows)) in cases.into_iter().enumerate() {
            let n_in = 2 * ty.block_elems();
            let (raw, rb) = random_rows(ty, n_in, planes * plane, i as u64 + 1);
            let t = Mat { ty, n_in, n_out: planes * plane, start: 0, row_bytes: rb };
            let mut whole = raw.clone();
            for p in whole.chunks_mut(plane * rb) {
                split_rows(ty, rb, p, tiled.then_some((plane, 0)));
            }
            let mut got = Vec::with_capacity(raw.len());
            let mut row = 0;
            while row < t.n_out {
                let (end, par) = piece(t.n_out, plane, row, rows, tiled);
                assert!(end > row && end <= t.n_out, "{ty} {planes}x{plane} by {rows}: {row}..{end}");
                let mut stage = raw[row * rb..end * rb].to_vec();
                split_piece(&t, plane, row, par, tiled, &mut stage);
                got.extend_from_slice(&stage);
                row = end;
            }
            assert!(got == whole, "{ty} tiled={tiled} {planes}x{plane} by {rows}");
        }
    }

    /// Upload pieces cover the tensor; each starts at a tile start of its plane and ends at a
    /// tile's or a plane's end, so that the Q8_0 split of each piece alone is the split of the
    /// whole.
    #[test]
    fn upload_pieces_start_tiles() {
        for (n, plane, rows) in
            [(3 * 37, 37, 50), (3 * 37, 37, 20), (10 * 64, 64, 100), (5000, 5000, 1000), (40, 40, 1)]
        {
            let mut row = 0;
            while row < n {
                let end = piece_end(row, n, plane, rows);
                assert!(end > row && end <= n, "{n} {plane} {rows}: {row}..{end}");
                assert!((row % plane).is_multiple_of(16), "{n} {plane} {rows}: piece at {row}");
                assert!(end == n || (end % plane).is_multiple_of(16));
                row = end;
            }
        }
    }
}
