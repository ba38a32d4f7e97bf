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

    /// Copies `raw[data_offset..]` to a new device allocation, in pieces of about [`CHUNK`]
    /// bytes, calling `progress(done, total)` after each, in the mode `DS4_CUDA_UPLOAD` names
    /// ([`UploadMode`]). The context must be bound. `tensors` are
    /// the image's tensors (rows of `n_in` elements of `ty` each) with their plane's rows;
    /// those of a split format are stored split, the others as they are. Tensors that overlap
    /// an earlier one, lie outside the data, whose rows are not whole blocks or not whole
    /// planes are copied as they are (and products on them of a split format then run on the
    /// CPU).
    pub(crate) fn upload(
        raw: &[u8],
        data_offset: usize,
        tensors: &[(Mat, usize)],
        progress: impl FnMut(u64, u64),
    ) -> Result<Self> {
        let mode = UploadMode::from_setting(std::env::var("DS4_CUDA_UPLOAD").ok().as_deref())?;
        Self::upload_with(raw, data_offset, tensors, progress, mode, CHUNK)
    }

    /// [`DeviceImage::upload`] in `mode`, in pieces of about `chunk` bytes.
    pub(crate) fn upload_with(
        raw: &[u8],
        data_offset: usize,
        tensors: &[(Mat, usize)],
        mut progress: impl FnMut(u64, u64),
        mode: UploadMode,
        chunk: usize,
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
        let pieces = pieces(raw.len(), data_offset, &img.split, chunk);
        let dst = |p: &Piece| dptr + (p.from - data_offset) as u64;
        // The pipelined copy, unless its pinned buffers cannot be had (then the plain one).
        let staging = match mode {
            UploadMode::Pipelined => Staging::new(pieces.iter().map(|p| p.to - p.from).max().unwrap_or(0)).ok(),
            UploadMode::Sync => None,
        };
        if let Some(mut st) = staging {
            for (k, p) in pieces.iter().enumerate() {
                let buf = st.take(k % 2, p.to - p.from)?;
                fill(raw, p, buf);
                st.send(k % 2, dst(p))?;
                progress((p.to - data_offset) as u64, total_bytes);
            }
            st.finish()?;
        } else {
            let mut stage: Vec<u8> = Vec::new();
            for p in &pieces {
                let src: &[u8] = if p.split.is_some() {
                    stage.resize(p.to - p.from, 0);
                    fill(raw, p, &mut stage);
                    &stage
                } else {
                    &raw[p.from..p.to]
                };
                // SAFETY: the destination range is inside the allocation; the copy is
                // synchronous, so the source only needs to live for the call.
                unsafe { cu::memcpy_htod_sync(dst(p), src) }.map_err(driver_err("copying the weights"))?;
                progress((p.to - data_offset) as u64, total_bytes);
            }
        }
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

/// How an upload copies the image (`DS4_CUDA_UPLOAD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UploadMode {
    /// Each piece copied from the host image (or, for a split tensor's piece, from a copy split
    /// on the host) by a synchronous copy from pageable memory: the host's copy, the split and
    /// the transfer of a piece one after another (`sync`).
    Sync,
    /// Two pinned buffers in turn: the host copies (on all cores) and splits a piece into one
    /// while the transfer of the other runs (unset, empty or `pipelined`). The same bytes on the
    /// device. Measured on an H200 machine (2026-12-04, the synthetic Flash file of 81 GB in
    /// the page cache, `Model.load` with the kernels' PTX cached): 3.1 to 3.4 s against 11.2 s
    /// for `sync`; a decode step's time is the same either way.
    Pipelined,
}

impl UploadMode {
    /// The mode `setting` names; anything else is refused with the setting's name.
    pub(crate) fn from_setting(setting: Option<&str>) -> Result<Self> {
        match setting.map(str::trim) {
            None | Some("" | "pipelined") => Ok(UploadMode::Pipelined),
            Some("sync") => Ok(UploadMode::Sync),
            Some(v) => Err(Error::invalid(format!("DS4_CUDA_UPLOAD takes sync or pipelined, not {v:?}"))),
        }
    }
}

/// A split tensor's piece: the tensor, its plane's rows, the piece's first row, the rows of
/// its parallel parts ([`piece`]) and whether the rows are tiled.
#[derive(Clone, Copy, Debug)]
struct SplitOf {
    t: Mat,
    plane: usize,
    row: usize,
    par: usize,
    tiled: bool,
}

/// One piece of an upload: image bytes `from..to`, copied as they are or split as a tensor's.
#[derive(Clone, Copy, Debug)]
struct Piece {
    from: usize,
    to: usize,
    split: Option<SplitOf>,
}

/// The pieces of an upload of `raw[data_offset..raw_len]`, in order and adjoining: the bytes
/// between split tensors in pieces of at most `chunk`, each split tensor (sorted, not
/// overlapping, inside the range) in pieces of about `chunk` bytes of whole rows ([`piece`]).
fn pieces(raw_len: usize, data_offset: usize, split: &[(Mat, usize)], chunk: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    let plain = |out: &mut Vec<Piece>, from: usize, to: usize| {
        let mut at = from;
        while at < to {
            let next = (at + chunk.max(1)).min(to);
            out.push(Piece { from: at, to: next, split: None });
            at = next;
        }
    };
    let mut at = data_offset;
    for &(t, plane) in split {
        plain(&mut out, at, t.start);
        let tiled = tensor_cores(t.ty, t.n_in, plane);
        let mut row = 0;
        while row < t.n_out {
            let (end, par) = piece(t.n_out, plane, row, (chunk / t.row_bytes).max(1), tiled);
            let from = t.start + t.row_bytes * row;
            out.push(Piece {
                from,
                to: t.start + t.row_bytes * end,
                split: Some(SplitOf { t, plane, row, par, tiled }),
            });
            row = end;
        }
        at = t.start + t.nbytes();
    }
    plain(&mut out, at, raw_len);
    out
}

/// Writes piece `p` of the image `raw` into `buf` (its length): the bytes, copied on all cores
/// in parts of 4 MiB, then split in place for a split tensor's piece.
fn fill(raw: &[u8], p: &Piece, buf: &mut [u8]) {
    const PART: usize = 4 << 20;
    buf.par_chunks_mut(PART).zip(raw[p.from..p.to].par_chunks(PART)).for_each(|(d, s)| d.copy_from_slice(s));
    if let Some(s) = p.split {
        split_piece(&s.t, s.plane, s.row, s.par, s.tiled, buf);
    }
}

/// The pinned buffers of a pipelined upload, each with the event of its last transfer, and the
/// stream the transfers run on. Dropping it waits for the transfers, then frees all.
struct Staging {
    bufs: [*mut u8; 2],
    cap: usize,
    events: [sys::CUevent; 2],
    sent: [bool; 2],
    stream: sys::CUstream,
    len: [usize; 2],
}

impl Staging {
    /// Two pinned buffers of `cap` bytes (the context bound).
    fn new(cap: usize) -> Result<Self> {
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(driver_err("creating an upload stream"))?;
        let mut st = Staging {
            bufs: [std::ptr::null_mut(); 2],
            cap,
            events: [std::ptr::null_mut(); 2],
            sent: [false; 2],
            stream,
            len: [0; 2],
        };
        for i in 0..2 {
            // SAFETY: a plain pinned allocation, freed in Drop; its bytes are written before
            // they are read.
            st.bufs[i] =
                unsafe { cu::malloc_host(cap.max(1), 0) }.map_err(driver_err("pinning upload buffers"))?.cast();
            st.events[i] = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(driver_err("creating an upload event"))?;
        }
        Ok(st)
    }

    /// Buffer `i`, once its last transfer is done, as `len` bytes to fill.
    fn take(&mut self, i: usize, len: usize) -> Result<&mut [u8]> {
        if len > self.cap {
            return Err(Error::Backend("CUDA upload: a piece larger than its buffer (internal)".into()));
        }
        if self.sent[i] {
            // SAFETY: an event of this context, recorded on the upload stream.
            unsafe { cu::event::synchronize(self.events[i]) }.map_err(driver_err("copying the weights"))?;
            self.sent[i] = false;
        }
        self.len[i] = len;
        // SAFETY: the buffer holds `cap` >= len bytes, and no transfer reads it now.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.bufs[i], len) })
    }

    /// Starts the transfer of buffer `i`'s bytes to `dst`.
    fn send(&mut self, i: usize, dst: sys::CUdeviceptr) -> Result<()> {
        // SAFETY: the buffer's `len` bytes were just filled and stay untouched until the event
        // says the transfer is done (`take`, `finish`, Drop); `dst` is inside the allocation.
        unsafe {
            let src = std::slice::from_raw_parts(self.bufs[i], self.len[i]);
            cu::memcpy_htod_async(dst, src, self.stream).map_err(driver_err("copying the weights"))?;
            cu::event::record(self.events[i], self.stream).map_err(driver_err("copying the weights"))?;
        }
        self.sent[i] = true;
        Ok(())
    }

    /// Waits for every transfer.
    fn finish(&mut self) -> Result<()> {
        // SAFETY: the upload stream of this context.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(driver_err("copying the weights"))?;
        self.sent = [false; 2];
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // SAFETY: the stream, events and buffers were made in `new` (null ones skipped); the
        // stream is drained before the buffers it reads are freed.
        unsafe {
            let _ = cu::stream::synchronize(self.stream);
            for i in 0..2 {
                if !self.events[i].is_null() {
                    let _ = cu::event::destroy(self.events[i]);
                }
                if !self.bufs[i].is_null() {
                    let _ = cu::free_host(self.bufs[i].cast());
                }
            }
            let _ = cu::stream::destroy(self.stream);
        }
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
    use super::{fill, piece, piece_end, pieces, split_piece, DeviceImage, UploadMode};
    use crate::model::weights::Mat;
    use crate::quant::split::{is_split, random_rows, split_rows};
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

    /// An image for the upload tests: a header, then tensors of the split formats (tiled Q8_0
    /// with a tail plane, row-split Q8_0, Q2_K, IQ2_XXS) with gaps of odd lengths, and an F16
    /// tensor (not split) at the end; the bytes random. Returns the image, the data offset and
    /// the tensors with their planes.
    fn test_image() -> (Vec<u8>, usize, Vec<(Mat, usize)>) {
        let offset = 96;
        let mut raw: Vec<u8> = (0..offset as u32).map(|i| (i * 7) as u8).collect();
        let mut tensors = Vec::new();
        let cases = [
            (GgmlType::Q8_0, 4096, 3, 37),
            (GgmlType::Q8_0, 64, 2, 5),
            (GgmlType::Q2_K, 512, 2, 30),
            (GgmlType::IQ2_XXS, 512, 3, 20),
            (GgmlType::F16, 64, 1, 9),
        ];
        for (i, (ty, n_in, planes, plane)) in cases.into_iter().enumerate() {
            raw.extend((0..13 * i + 5).map(|j| j as u8 ^ 0x5a));
            let (rows, rb) = random_rows(ty, n_in, planes * plane, 40 + i as u64);
            tensors.push((Mat { ty, n_in, n_out: planes * plane, start: raw.len(), row_bytes: rb }, plane));
            raw.extend_from_slice(&rows);
        }
        raw.extend(0..77u8);
        (raw, offset, tensors)
    }

    /// The pieces of an upload adjoin from the data offset to the image's end; plain ones hold
    /// at most the chunk, split ones whole rows of their tensor; and the bytes `fill` writes,
    /// piece after piece, are the image with each split tensor split plane by plane (what the
    /// device gets in either mode), for chunks smaller than a row up to larger than the image.
    #[test]
    fn upload_pieces_fill_the_split_image() {
        let (raw, offset, tensors) = test_image();
        let split: Vec<(Mat, usize)> = tensors.iter().copied().filter(|(t, _)| is_split(t.ty)).collect();
        let mut want = raw[offset..].to_vec();
        for (t, plane) in &split {
            let tiled = super::tensor_cores(t.ty, t.n_in, *plane);
            let at = t.start - offset;
            for p in want[at..at + t.nbytes()].chunks_mut(plane * t.row_bytes) {
                split_rows(t.ty, t.row_bytes, p, tiled.then_some((*plane, 0)));
            }
        }
        for chunk in [1, 100, 1000, 4096, 50_000, 1 << 26] {
            let ps = pieces(raw.len(), offset, &split, chunk);
            let mut got = Vec::new();
            let mut at = offset;
            for p in &ps {
                assert_eq!(p.from, at, "chunk {chunk}: pieces adjoin");
                assert!(p.to > p.from);
                match p.split {
                    None => assert!(p.to - p.from <= chunk),
                    Some(s) => {
                        assert_eq!(p.from, s.t.start + s.row * s.t.row_bytes);
                        assert!((p.to - s.t.start).is_multiple_of(s.t.row_bytes) && p.to <= s.t.start + s.t.nbytes());
                    }
                }
                let mut buf = vec![0u8; p.to - p.from];
                fill(&raw, p, &mut buf);
                got.extend_from_slice(&buf);
                at = p.to;
            }
            assert_eq!(at, raw.len(), "chunk {chunk}: pieces reach the end");
            assert!(got == want, "chunk {chunk}: the bytes sent are the split image");
        }
    }

    /// `DS4_CUDA_UPLOAD`: pipelined when unset, empty or `pipelined`; `sync`; anything else
    /// refused with the setting's name.
    #[test]
    fn upload_mode_setting_parses() {
        for v in [None, Some(""), Some("pipelined"), Some(" pipelined ")] {
            assert_eq!(UploadMode::from_setting(v).unwrap(), UploadMode::Pipelined, "{v:?}");
        }
        assert_eq!(UploadMode::from_setting(Some(" sync ")).unwrap(), UploadMode::Sync);
        let err = UploadMode::from_setting(Some("fast")).unwrap_err().to_string();
        assert!(err.contains("DS4_CUDA_UPLOAD") && err.contains("\"fast\""), "{err}");
    }

    /// On a GPU: the pipelined upload (two pinned buffers in turn) leaves the same device bytes
    /// as the synchronous one, with pieces far smaller than the image (many turns of the two
    /// buffers) and with one piece a tensor. Without a GPU it prints "skipped" and passes.
    #[test]
    fn pipelined_upload_writes_the_same_bytes() {
        let Some(_ctx) = crate::backend::cuda::decode::testutil::context() else { return };
        let (raw, offset, tensors) = test_image();
        let read = |img: &DeviceImage| {
            let mut v = vec![0u8; raw.len() - offset];
            // SAFETY: the image's allocation holds these bytes; a synchronous copy.
            unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut v, img.dptr) }.expect("reading back");
            v
        };
        let sync = DeviceImage::upload_with(&raw, offset, &tensors, |_, _| {}, UploadMode::Sync, 1 << 26).unwrap();
        let want = read(&sync);
        for chunk in [1000, 1 << 26] {
            let mut steps = Vec::new();
            let img =
                DeviceImage::upload_with(&raw, offset, &tensors, |d, _| steps.push(d), UploadMode::Pipelined, chunk)
                    .unwrap();
            assert!(read(&img) == want, "chunk {chunk}: the device bytes differ");
            assert_eq!(
                steps.last().copied(),
                Some((raw.len() - offset) as u64),
                "chunk {chunk}: progress ends at the total"
            );
            assert!(steps.windows(2).all(|w| w[0] <= w[1]), "chunk {chunk}: progress never goes back");
        }
    }
}
