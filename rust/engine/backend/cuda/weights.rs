//! Device copies of file images: the tensor data region of a GGUF file, copied once into one
//! plain device allocation and found again by the host address range of the image.

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::context::driver_err;
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

    /// Copies `raw[data_offset..]` to a new device allocation, in chunks of [`CHUNK`] bytes,
    /// calling `progress(done, total)` after each. The context must be bound.
    pub(crate) fn upload(raw: &[u8], data_offset: usize, mut progress: impl FnMut(u64, u64)) -> Result<Self> {
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
        let img = DeviceImage { host_ptr: raw.as_ptr() as usize, host_len: raw.len(), data_offset, dptr };
        // The padding is zeroed so that what the kernels over-read is defined.
        // SAFETY: the PAD bytes after the data are inside the allocation.
        unsafe { cu::memset_d8_sync(dptr + data.len() as u64, 0, PAD) }.map_err(driver_err("clearing the padding"))?;
        let total_bytes = data.len() as u64;
        let mut done = 0usize;
        progress(0, total_bytes);
        for chunk in data.chunks(CHUNK) {
            // SAFETY: the destination range is inside the allocation; the copy is synchronous,
            // so the (memory-mapped) source only needs to live for the call.
            unsafe { cu::memcpy_htod_sync(dptr + done as u64, chunk) }.map_err(driver_err("copying the weights"))?;
            done += chunk.len();
            progress(done as u64, total_bytes);
        }
        // The copies ran on the legacy stream, which the backend's non-blocking stream does not
        // wait for: finish them before any kernel may read the weights.
        cu::ctx::synchronize().map_err(driver_err("copying the weights"))?;
        Ok(img)
    }
}

impl Drop for DeviceImage {
    fn drop(&mut self) {
        // SAFETY: allocated by `upload`, freed once; the owner binds the context first.
        unsafe { cu::free_sync(self.dptr).ok() };
    }
}
