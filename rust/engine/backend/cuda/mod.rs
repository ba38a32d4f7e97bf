//! The CUDA backend: the matrix products of the forward pass on an NVIDIA GPU.
//!
//! - [`CudaBackend::new`] opens a device and compiles the kernels of `shaders/cuda/` with
//!   NVRTC (once per process). The driver and NVRTC libraries are loaded at run time, so a
//!   build with the `cuda` feature runs anywhere; without them (or without a GPU) `new`
//!   returns [`Error::BackendUnavailable`].
//! - [`CudaBackend::upload`] copies a GGUF file's tensor data to device memory once. A
//!   product whose `raw` image was uploaded runs on the GPU; a product on any other image (or
//!   of a shape the kernels do not take: an F32/F16/BF16 matrix with `n_in % 4 != 0`) runs on
//!   the CPU reference instead. The choice depends only on the matrix, never on the batch, so
//!   row invariance holds either way.
//! - [`Backend::matmul_many`] packs every input into one pinned buffer, makes one
//!   host-to-device copy (inputs and a table of product descriptors), makes one launch per
//!   kernel (format and batch size) for all the products of that kernel, one device-to-host
//!   copy of all the outputs and waits once: a decode step calls it about ten times per layer,
//!   and each launch and synchronization costs microseconds.
//!
//! Row invariance (see [`crate::backend`]): each output element is reduced by the same lane
//! assignment, `fmaf` chain, warp butterfly and sum of input slices whatever the batch size
//! (see `shaders/cuda/common.cuh`; how few-row matrices are split depends on the shape only);
//! batches of more than 16 rows run in chunks of at most 16 through the same kernels. GPU results agree with the CPU reference to rounding, not
//! bitwise: the two reduce in different orders.
//!
//! Testing: `cargo test --features cuda cuda` runs the tests of `tests.rs`; without a GPU
//! they print "skipped" and pass, and the NVRTC compile test runs wherever libnvrtc loads
//! (e.g. `LD_LIBRARY_PATH` at the lib dir of pip's `nvidia-cuda-nvrtc-cu12`). On a GPU
//! machine without Rust: build `cargo test --release --features cuda --no-run` and
//! `cargo bench --features cuda --bench cuda --no-run` here, copy the two executables over,
//! and run `<tests> backend::cuda --test-threads=1` and `<bench> --bench`.

pub(crate) mod context;
pub(crate) mod decode;
pub(crate) mod device;
mod ptx_cache;
#[cfg(test)]
mod tests;
mod weights;

use std::sync::Mutex;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use self::context::{
    driver_err, tensor_cores, tile_elems, Context, MAX_BATCH, MQ_WARP_ROWS, MV_ROWS, MV_WARPS, THREADS,
};
use self::device::Arg;
use self::weights::DeviceImage;
use super::{cpu, Backend};
use crate::gguf::GgufFile;
use crate::model::weights::Mat;
use crate::quant::{act8, GgmlType};
use crate::{Error, Result};

pub use self::context::{compile, kernel_source, nvrtc_available};

/// Whether a CUDA device can be used: the driver and NVRTC load, device 0 exists and the
/// kernels compile for it. Opens (and drops) a backend, so it costs a compilation the first
/// time in a process.
pub fn cuda_available() -> bool {
    CudaBackend::new(0).is_ok()
}

/// The name of device 0 ("NVIDIA H200"), or `None` when no device can be opened.
pub fn device_name() -> Option<String> {
    CudaBackend::new(0).ok().map(|b| b.device_name().to_string())
}

/// Host and device buffers of the products' inputs and outputs, grown on demand.
struct Scratch {
    /// Pinned host memory (for asynchronous copies), `host_cap` floats.
    host: *mut f32,
    host_cap: usize,
    dev: sys::CUdeviceptr,
    dev_cap: usize,
    /// Arrival counters of the products whose inputs are split over several blocks, all zero
    /// between launches (each kernel re-arms what it used), `counters_cap` ints.
    counters: sys::CUdeviceptr,
    counters_cap: usize,
}

impl Scratch {
    /// Makes room for `floats` floats on both sides (contents not kept).
    fn reserve(&mut self, floats: usize) -> Result<()> {
        if floats > self.host_cap {
            let cap = floats.next_power_of_two().max(1 << 16);
            if !self.host.is_null() {
                // SAFETY: allocated by malloc_host below; nothing in flight (calls sync).
                unsafe { cu::free_host(self.host.cast()) }.map_err(driver_err("freeing pinned memory"))?;
                self.host = std::ptr::null_mut();
                self.host_cap = 0;
            }
            // SAFETY: a plain pinned allocation, freed in Drop or here.
            self.host = unsafe { cu::malloc_host(cap * 4, 0) }.map_err(driver_err("allocating pinned memory"))?.cast();
            self.host_cap = cap;
        }
        if floats > self.dev_cap {
            let cap = floats.next_power_of_two().max(1 << 16);
            if self.dev != 0 {
                // SAFETY: allocated below; nothing in flight.
                unsafe { cu::free_sync(self.dev) }.map_err(driver_err("freeing device memory"))?;
                self.dev = 0;
                self.dev_cap = 0;
            }
            // SAFETY: a plain allocation, freed in Drop or here.
            self.dev = unsafe { cu::malloc_sync(cap * 4) }.map_err(driver_err("allocating device memory"))?;
            self.dev_cap = cap;
        }
        Ok(())
    }

    /// Makes room for `n` zeroed counters (kept: they are zero whenever nothing runs).
    fn reserve_counters(&mut self, n: usize) -> Result<()> {
        if n > self.counters_cap {
            let cap = n.next_power_of_two().max(1 << 12);
            if self.counters != 0 {
                // SAFETY: allocated below; nothing in flight (every call syncs).
                unsafe { cu::free_sync(self.counters) }.map_err(driver_err("freeing device memory"))?;
                self.counters = 0;
                self.counters_cap = 0;
            }
            // SAFETY: a plain allocation, freed in Drop or here, zeroed before use.
            unsafe {
                self.counters = cu::malloc_sync(cap * 4).map_err(driver_err("allocating device memory"))?;
                cu::memset_d8_sync(self.counters, 0, cap * 4).map_err(driver_err("clearing counters"))?;
                // (On the legacy stream: finish it before the backend's stream uses them.)
                device::sync_legacy("clearing counters")?;
            }
            self.counters_cap = cap;
        }
        Ok(())
    }

    fn host(&mut self, len: usize) -> &mut [f32] {
        assert!(len <= self.host_cap);
        if len == 0 {
            return &mut [];
        }
        // SAFETY: `host` holds `host_cap` floats of pinned memory owned by this struct.
        unsafe { std::slice::from_raw_parts_mut(self.host, len) }
    }
}

/// What the backend's mutex guards. Field order is drop order: buffers before the context.
struct Inner {
    images: Vec<DeviceImage>,
    scratch: Scratch,
    ctx: Context,
}

// SAFETY: the pinned and device pointers are owned by `Inner` and only used behind the
// backend's mutex, with the context bound by the using thread.
unsafe impl Send for Inner {}

impl Inner {
    /// The uploaded image of the file whose bytes are `raw`.
    fn image(&self, raw: &[u8]) -> Option<&DeviceImage> {
        self.images.iter().find(|i| i.is(raw))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.ctx.bind().is_ok() {
            self.ctx.sync().ok();
            self.images.clear();
            // SAFETY: owned allocations, freed once, nothing in flight.
            unsafe {
                if !self.scratch.host.is_null() {
                    cu::free_host(self.scratch.host.cast()).ok();
                }
                if self.scratch.dev != 0 {
                    cu::free_sync(self.scratch.dev).ok();
                }
                if self.scratch.counters != 0 {
                    cu::free_sync(self.scratch.counters).ok();
                }
            }
        }
    }
}

/// Matrix products on one CUDA device. See the module documentation.
pub struct CudaBackend {
    inner: Mutex<Inner>,
    name: String,
    compute_capability: (i32, i32),
}

/// One product chunk of at most 16 batch rows as the kernels read it (`MvDesc` in
/// shaders/cuda/common.cuh): device addresses, shape, and where its blocks start.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Desc {
    w: u64,
    x: u64,
    y: u64,
    part: u64,
    row_bytes: i64,
    n_out: i32,
    n_in: i32,
    n: i32,
    slices: i32,
    block_start: i32,
    counter: i32,
    group: i32,
    /// Floats from one row of y to the next: `n_out`, or more when the product fills some
    /// columns of wider rows (the decode's o_a groups write their ranks side by side).
    y_stride: i32,
    /// Output rows of a row group: [`warp_rows`] of the format.
    warp_rows: i32,
    /// Keeps the size (80 bytes) a multiple of 16: the x rows placed after a table of
    /// descriptors must stay 16-byte aligned.
    pad: i32,
}

impl Desc {
    #[cfg(test)]
    /// Its row blocks (`mv_row_blocks` in common.cuh).
    fn row_blocks(&self) -> usize {
        (self.n_out as usize).div_ceil(MV_WARPS / self.group as usize * self.warp_rows as usize)
    }
}

/// Output rows of one row group (the rows a warp computes) of a `ty` product on `rows` rows of
/// `n_in` elements: two 16-row tiles for Q8_0 on the tensor cores (`MQ_WARP_ROWS`,
/// shaders/cuda/q8_0.cu), `MV_ROWS` for the other kernels.
pub(crate) fn warp_rows(ty: GgmlType, n_in: usize, rows: usize) -> usize {
    if tensor_cores(ty, n_in, rows) {
        MQ_WARP_ROWS
    } else {
        MV_ROWS
    }
}

/// Floats of scratch one [`Desc`] takes.
const DESC_FLOATS: usize = std::mem::size_of::<Desc>() / 4;

/// Blocks a product should have at least to keep every SM busy (one per SM of an H200).
const TARGET_BLOCKS: usize = 132;

/// How many warps of a block share each row group of `w`'s products (1, 2 or 4): the warps of
/// a group take turns over the row's 512-byte chunks (`matvec_split`, shaders/cuda/common.cuh),
/// so that a matrix with few rows still has enough warps, and loads in flight, to keep the
/// memory busy. Each warp keeps at least two chunks (the next one's loads overlap the current
/// one's arithmetic), and matrices with many rows, which fill the GPU anyway, are not split:
/// on an H200 a Q8_0 1024 x 4096 product takes 6.9 us with 4 warps per group against 10.0 us
/// with 1, but an 8192 x 4096 one 17.5 us with 2 against 15.6 us with 1. 1 for the staged
/// formats (Q4_K, MXFP4). Depends only on the shape: the group's sums are added in warp order
/// (row invariance). (Measurements: scripts/kernel_lab/HISTORY.md, "cuda/mod.rs: group".)
pub(crate) fn group(w: &Mat) -> usize {
    if matches!(w.ty, GgmlType::Q4_K | GgmlType::MXFP4) {
        return 1;
    }
    // Counted in row groups of `warp_rows` (4 rows; 32 in the tensor-core Q8_0 kernel, whose
    // rows run out sooner) and in chunks a warp keeps (two; four block pairs on the tensor
    // cores).
    let row_groups = w.n_out.div_ceil(warp_rows(w.ty, w.n_in, w.n_out));
    let per_warp = if tensor_cores(w.ty, w.n_in, w.n_out) { 4 } else { 2 };
    let by_rows = match row_groups {
        0..=512 => 4,
        513..=1024 => 2,
        _ => 1,
    };
    let by_chunks = match w.n_in.div_ceil(tile_elems(w.ty, w.n_in, w.n_out)) / per_warp {
        0 | 1 => 1,
        2 | 3 => 2,
        _ => MV_WARPS,
    };
    by_rows.min(by_chunks)
}

/// Most batch rows of one product chunk of a `ty` matrix of `rows` rows of `n_in` elements: 8 for
/// the quantized formats of `matvec_split` (Q8_0, Q2_K, IQ2_XXS), whose 16-row kernels run
/// slower per row than two 8-row chunks (on an H200 a Q8_0 4096 x 8192 product takes 140.6 us
/// for 16 rows and 61.6 us for 8; at 128 registers the 16-row kernels spill in their inner
/// loop, and with more registers fewer warps fit and they were slower still), 16 for the others
/// (Q8_0 on the tensor cores covers 8 batch rows per product). Every chunk size computes a row
/// the same way (row invariance), so this changes only the speed. (Tried and dropped: chunks of
/// 4 rows for the float-x Q8_0 kernel, so that a verify's o_a, q_a and shared expert run the
/// 4-row kernel twice; slower.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "cuda/mod.rs: chunk_rows".)
pub(crate) fn chunk_rows(ty: GgmlType, n_in: usize, rows: usize) -> usize {
    match ty {
        GgmlType::Q8_0 if tensor_cores(ty, n_in, rows) => MAX_BATCH,
        GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::IQ2_XXS => MAX_BATCH / 2,
        _ => MAX_BATCH,
    }
}

/// Row blocks of `w`'s products: blocks of `MV_WARPS / group` row groups of [`warp_rows`].
pub(crate) fn row_blocks(w: &Mat) -> usize {
    row_blocks_in(w, group(w))
}

/// Row blocks of `w`'s products at warp group `g`.
fn row_blocks_in(w: &Mat, g: usize) -> usize {
    w.n_out.div_ceil(rows_per_block(w, g))
}

/// Output rows of one block of `w`'s products at warp group `g`: `MV_WARPS / g` row groups of
/// [`warp_rows`].
pub(crate) fn rows_per_block(w: &Mat, g: usize) -> usize {
    MV_WARPS / g * warp_rows(w.ty, w.n_in, w.n_out)
}

/// The warp group and input slices of `w`'s products when one launch runs them with others of
/// the same shape, `rows` output rows in all: those of a single matrix of `rows` rows, whose
/// row blocks the launch has. For the decode's o_a, eight 1024 x 4096 products (the output
/// groups, side by side in one launch): alone each would take 4 warps a row group, together
/// they fill the GPU with 1 (on an H200, Flash decode steps at 2K took 9.27 ms with this
/// against 9.57 with each product's own split). Like [`group`] and [`slices`], a function of
/// shapes only, never of the batch (row invariance). The launch also runs the whole matrix's
/// kernel ([`tensor_cores`] of `rows` rows): o_a's groups are row ranges of one plane, whose
/// kernel chose the weights' device layout. (The host's products of the groups take the same
/// kernel and split one by one, through `DeviceImage::kernel_mat`.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "cuda/mod.rs: split_in_launch".)
pub(crate) fn split_in_launch(w: &Mat, rows: usize) -> (usize, usize) {
    let whole = Mat { n_out: rows.max(w.n_out), ..*w };
    (group(&whole), slices(&whole))
}

/// In how many slices of its input the kernels split the rows of `w`: 1 for matrices with
/// enough rows to fill the GPU, more for few rows (the hyper-connection and router products,
/// 24 or 6 rows of 16384 inputs), so that they do not run on a handful of SMs; a slice keeps
/// at least one tile per warp of a group. Depends only on the shape, never on the batch: the
/// slices' partial sums are added in slice order, so the split is part of each row's fixed
/// reduction order (row invariance). (Tried and dropped: the float formats aiming at twice the
/// blocks, Flash's router in 4 slices and its HCA compressors in 2: faster in the lab at 8
/// batch rows, but Flash steps took 8.89 ms against 8.67.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "cuda/mod.rs: slices".)
fn slices(w: &Mat) -> usize {
    let tiles = w.n_in.div_ceil(tile_elems(w.ty, w.n_in, w.n_out));
    // The Q8_0 kernel's warps are few (32 rows each) and its chunks short: it asks for four
    // blocks an SM and two chunks a warp.
    let (target, per_warp) =
        if tensor_cores(w.ty, w.n_in, w.n_out) { (4 * TARGET_BLOCKS, 2) } else { (TARGET_BLOCKS, 1) };
    let want = (target / row_blocks(w)).clamp(1, 32).min((tiles / group(w) / per_warp).max(1));
    // No empty slice: the kernels give each slice ceil(tiles / slices) tiles.
    tiles.div_ceil(tiles.div_ceil(want))
}

/// One product placed in the scratch buffers (offsets in floats).
struct Placed {
    spec: usize,
    /// The matrix whose shape chooses its kernel and split ([`DeviceImage::kernel_mat`]).
    kernel: Mat,
    n: usize,
    x_off: usize,
    y_off: usize,
}

impl CudaBackend {
    /// Opens device `ordinal` and compiles the kernels for it. [`Error::BackendUnavailable`]
    /// when the driver, NVRTC or the device is missing; never panics.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics when a library symbol is missing; a backend that cannot start must be
        // an error the caller can handle, whatever the installed driver.
        let ctx = std::panic::catch_unwind(|| Context::new(ordinal)).unwrap_or_else(|p| {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            Err(Error::BackendUnavailable(format!("CUDA: {msg}")))
        })?;
        Ok(CudaBackend {
            name: ctx.name.clone(),
            compute_capability: ctx.compute_capability,
            inner: Mutex::new(Inner {
                images: Vec::new(),
                scratch: Scratch {
                    host: std::ptr::null_mut(),
                    host_cap: 0,
                    dev: 0,
                    dev_cap: 0,
                    counters: 0,
                    counters_cap: 0,
                },
                ctx,
            }),
        })
    }

    /// The device's name ("NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.name
    }

    /// The device's number of streaming multiprocessors.
    pub fn multiprocessors(&self) -> usize {
        self.lock().ctx.multiprocessors as usize
    }

    /// The device's compute capability ((9, 0) on Hopper).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Copies the tensor data of `file` to device memory (once: a second upload of the same
    /// image does nothing), calling `progress(bytes_done, bytes_total)` as it goes. Products
    /// on `file.raw()` then run on the GPU. `file` must stay open (its image mapped at the
    /// same address) while the backend may see its image, or be [`CudaBackend::release`]d.
    pub fn upload(&self, file: &GgufFile, progress: impl FnMut(u64, u64)) -> Result<()> {
        let base = file.data_offset() as usize;
        // A plane is a 2-D tensor's rows, or the rows of one expert (dims[1]) of a 3-D one.
        let tensors: Vec<(Mat, usize)> = file
            .tensors()
            .iter()
            .filter_map(|t| {
                let m = Mat {
                    ty: t.ggml_type,
                    n_in: t.row_len() as usize,
                    n_out: t.n_rows() as usize,
                    start: base + t.offset as usize,
                    row_bytes: t.ggml_type.row_bytes(t.row_len())? as usize,
                };
                let plane = if t.dims.len() >= 3 { t.dims[1] as usize } else { m.n_out };
                Some((m, plane))
            })
            .collect();
        self.upload_planes(file.raw(), base, &tensors, progress)
    }

    /// [`CudaBackend::upload`] for any image: copies `raw[data_offset..]`; matrices must lie
    /// in that range to run on the GPU. `tensors` lists the image's tensors (each as the
    /// matrix of all its rows): those of the formats with a split device layout (Q8_0, Q2_K,
    /// IQ2_XXS, see `crate::quant::split`) are stored split, and products of those formats
    /// run on the GPU only on rows of a listed tensor (on the CPU otherwise).
    pub fn upload_image(
        &self,
        raw: &[u8],
        data_offset: usize,
        tensors: &[Mat],
        progress: impl FnMut(u64, u64),
    ) -> Result<()> {
        let planes: Vec<(Mat, usize)> = tensors.iter().map(|&m| (m, m.n_out)).collect();
        self.upload_planes(raw, data_offset, &planes, progress)
    }

    /// [`CudaBackend::upload_image`] with each tensor's plane (its rows per expert for a 3-D
    /// tensor of experts: Q8_0's device tiles are counted per plane, see
    /// [`crate::quant::split`]).
    fn upload_planes(
        &self,
        raw: &[u8],
        data_offset: usize,
        tensors: &[(Mat, usize)],
        progress: impl FnMut(u64, u64),
    ) -> Result<()> {
        let mut g = self.lock();
        if g.images.iter().any(|i| i.is(raw)) {
            return Ok(());
        }
        g.ctx.bind()?;
        let img = DeviceImage::upload(raw, data_offset, tensors, progress)?;
        g.images.push(img);
        Ok(())
    }

    /// Frees the device copy of `raw`'s image, if any.
    pub fn release(&self, raw: &[u8]) -> Result<()> {
        let mut g = self.lock();
        g.ctx.bind()?;
        g.ctx.sync()?;
        g.images.retain(|i| !i.is(raw));
        Ok(())
    }

    /// The device table derived from the tensor at image offset `key` of the uploaded image
    /// `raw`, made by `make` the first time it is asked for (under the backend's lock, with its
    /// context bound) and shared after that; None when `raw` has no device copy.
    pub(crate) fn derived(
        &self,
        raw: &[u8],
        key: usize,
        make: impl FnOnce() -> Result<device::DevBuf>,
    ) -> Result<Option<std::sync::Arc<device::DevBuf>>> {
        let mut g = self.lock();
        g.ctx.bind()?;
        let Some(img) = g.images.iter_mut().find(|i| i.is(raw)) else { return Ok(None) };
        if let Some((_, t)) = img.derived.iter().find(|(k, _)| *k == key) {
            return Ok(Some(std::sync::Arc::clone(t)));
        }
        let t = std::sync::Arc::new(make()?);
        img.derived.push((key, std::sync::Arc::clone(&t)));
        Ok(Some(t))
    }

    /// Whether `raw` has a device copy.
    pub fn is_uploaded(&self, raw: &[u8]) -> bool {
        self.lock().images.iter().any(|i| i.is(raw))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves nothing half-updated that matters here.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `w` runs on the GPU (given its image has a device copy).
    fn gpu_shape(img: &DeviceImage, w: &Mat) -> bool {
        let float = matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
        let supported = context::FORMATS.iter().any(|&(t, _)| t == w.ty);
        supported
            && w.n_in > 0
            && w.n_out > 0
            && w.n_out <= (u32::MAX / 2) as usize
            && w.n_in <= i32::MAX as usize
            && (!float || w.n_in.is_multiple_of(4))
            && w.ty.row_bytes(w.n_in as u64) == Some(w.row_bytes as u64)
            && img.holds(w.start, w.nbytes())
            && (!crate::quant::split::is_split(w.ty) || img.holds_split(w))
    }

    /// Launches kernel `f` (`smem` bytes of shared memory) over the `count` descriptors at
    /// device address `table`, which together have `blocks` thread blocks.
    fn launch(
        ctx: &Context,
        f: (sys::CUfunction, u32),
        table: u64,
        count: usize,
        blocks: usize,
        counters: u64,
    ) -> Result<()> {
        // `early` 0: the host uploads each table just before its launch (common.cuh
        // ds4_grid_launch).
        let (mut tp, mut cnt, mut cp, mut early) = (table, count as i32, counters, 0i32);
        let mut params: [*mut std::ffi::c_void; 4] =
            [(&raw mut tp).cast(), (&raw mut cnt).cast(), (&raw mut cp).cast(), (&raw mut early).cast()];
        // SAFETY: the parameters match the kernels' signature (pointer, int, pointer, int); the
        // table and everything it points at are inside live allocations.
        unsafe { cu::launch_kernel(f.0, (blocks as u32, 1, 1), (THREADS, 1, 1), f.1, ctx.stream, &mut params) }
            .map_err(driver_err("launching a kernel"))
    }

    /// The descriptor of the product of `w` (its rows at device address `w_at`) with `n <= 16`
    /// rows at device `x` into device `y` (partial sums at `part` when split, counters from
    /// `counter`), and its block count. `kernel`: the matrix whose shape chooses the kernel and
    /// the split ([`DeviceImage::kernel_mat`]: `w`, or the plane `w`'s rows belong to).
    #[allow(clippy::too_many_arguments)]
    fn desc(w_at: u64, w: &Mat, kernel: &Mat, x: u64, y: u64, part: u64, n: usize, counter: usize) -> (Desc, usize) {
        Self::desc_split(w_at, w, kernel, x, y, part, n, counter, (group(kernel), slices(kernel)))
    }

    /// [`CudaBackend::desc`] at warp group and input slices `(g, s)` ([`split_in_launch`]); the
    /// warp rows and the block count follow `kernel`.
    #[allow(clippy::too_many_arguments)]
    fn desc_split(
        w_at: u64,
        w: &Mat,
        kernel: &Mat,
        x: u64,
        y: u64,
        part: u64,
        n: usize,
        counter: usize,
        (g, s): (usize, usize),
    ) -> (Desc, usize) {
        let d = Desc {
            w: w_at,
            x,
            y,
            part,
            row_bytes: w.row_bytes as i64,
            n_out: w.n_out as i32,
            n_in: w.n_in as i32,
            n: n as i32,
            slices: s as i32,
            block_start: 0,
            counter: counter as i32,
            group: g as i32,
            y_stride: w.n_out as i32,
            warp_rows: warp_rows(kernel.ty, kernel.n_in, kernel.n_out) as i32,
            pad: 0,
        };
        (d, w.n_out.div_ceil(rows_per_block(kernel, g)) * s)
    }

    /// Times `iters` launches of the product of each of `mats` in turn (they should be at
    /// least as large as the L2 cache together) with `n` rows of zeros, by CUDA events, after
    /// one warm-up round. Returns the seconds of all the launches. For benchmarks.
    #[doc(hidden)]
    pub fn time_launches(&self, raw: &[u8], mats: &[Mat], n: usize, iters: u64) -> Result<f64> {
        self.time_products(raw, mats, n, iters, false)
    }

    /// [`CudaBackend::time_launches`] for the products of a prompt's steps on the tensor cores
    /// (`decode/gemm.rs`, `shaders/cuda/gemm.cu`): F16 or float-x Q8_0 matrices, `n <= 64`
    /// rows. For benchmarks.
    #[doc(hidden)]
    pub fn time_prefill_launches(&self, raw: &[u8], mats: &[Mat], n: usize, iters: u64) -> Result<f64> {
        self.time_products(raw, mats, n, iters, true)
    }

    /// The two above: the decode's product kernel of `mats`, or (`prefill`) the tensor-core one.
    fn time_products(&self, raw: &[u8], mats: &[Mat], n: usize, iters: u64, prefill: bool) -> Result<f64> {
        let what = if prefill { "time_prefill_launches" } else { "time_launches" };
        let mut g = self.lock();
        let g = &mut *g;
        g.ctx.bind()?;
        let img = g.images.iter().find(|i| i.is(raw)).ok_or_else(|| Error::invalid(format!("{what}: not uploaded")))?;
        let cannot = || Error::invalid(format!("{what}: matrices the kernels cannot take"));
        let most = if prefill { decode::gemm::GEMM_MAX_ROWS } else { MAX_BATCH };
        if mats.is_empty() || n == 0 || n > most || mats.iter().any(|m| !Self::gpu_shape(img, m)) {
            return Err(cannot());
        }
        let (n_in, n_out) = mats.iter().fold((0, 0), |(a, b), m| (a.max(m.n_in), b.max(m.n_out)));
        // Scratch: the descriptors, x, y, the partial sums of the most split product.
        let slices_of = |m: &Mat| if prefill { decode::gemm::slices(m, m.n_out) } else { slices(m) };
        let table_len = DESC_FLOATS * mats.len();
        let x_len = (n * n_in).next_multiple_of(4);
        let y_len = n * n_out;
        let part_len = mats.iter().map(|m| match slices_of(m) {
            1 => 0,
            s => s * n * m.n_out,
        });
        g.scratch.reserve(table_len + x_len + y_len + part_len.max().unwrap_or(0))?;
        let dev = g.scratch.dev;
        let x = dev + 4 * table_len as u64;
        let y = x + 4 * x_len as u64;
        let part = y + 4 * y_len as u64;
        // One kernel for all of them.
        let f = if prefill {
            let sm80 = g.ctx.compute_capability.0 >= 8;
            // (Tiled Q8_0 too: ds4_gemm_q8_0_mq.)
            let kernel = |m: &Mat| decode::gemm::kernel(m, true);
            let kind = kernel(&mats[0]).ok_or_else(cannot)?;
            if mats
                .iter()
                .any(|m| kernel(m) != Some(kind) || !decode::gemm::takes(m, img.addr(m.start), x, n, sm80, true))
            {
                return Err(cannot());
            }
            (g.ctx.function(kind.name())?, 0)
        } else {
            let stem0 = context::stem(mats[0].ty, mats[0].n_in, mats[0].n_out);
            if mats.iter().any(|m| context::stem(m.ty, m.n_in, m.n_out) != stem0) {
                return Err(Error::invalid(format!("{what}: matrices of one kernel")));
            }
            g.ctx
                .kernel(mats[0].ty, mats[0].n_in, mats[0].n_out, n)
                .ok_or_else(|| Error::Backend("CUDA: no kernel".into()))?
        };
        let descs: Vec<(Desc, usize)> = mats
            .iter()
            .map(|m| {
                let at = img.addr(m.start);
                if prefill {
                    decode::gemm::desc(at, m, m.n_out, x, y, m.n_out, part, n, 0)
                } else {
                    Self::desc(at, m, m, x, y, part, n, 0)
                }
            })
            .collect();
        // A split product's row blocks (its blocks are row blocks times slices).
        g.scratch.reserve_counters(descs.iter().map(|d| d.1 / d.0.slices as usize).max().unwrap_or(0))?;
        let table: Vec<Desc> = descs.iter().map(|d| d.0).collect();
        // SAFETY: inside the scratch allocation; synchronous.
        unsafe {
            cu::memset_d8_sync(x, 0, 4 * x_len).map_err(driver_err("clearing x"))?;
            cu::memcpy_htod_sync(dev, &table).map_err(driver_err("copying descriptors"))?;
        }
        let counters = g.scratch.counters;
        let launch = |i: usize| {
            let at = dev + (i * std::mem::size_of::<Desc>()) as u64;
            if prefill {
                // (descriptors, count, counters: gemm.cu's kernels take no `early`.)
                let args = [Arg::Ptr(at), Arg::I32(1), Arg::Ptr(counters)];
                g.ctx.launch_args(f.0, (descs[i].1 as u32, 1, 1), THREADS, f.1, &args)
            } else {
                Self::launch(&g.ctx, f, at, 1, descs[i].1, counters)
            }
        };
        Self::time_rounds(&g.ctx, mats.len(), iters, launch)
    }

    /// One warm-up round of `count` launches, then `iters` launches timed by CUDA events
    /// (launch `i % count` each), in seconds.
    fn time_rounds(ctx: &Context, count: usize, iters: u64, launch: impl Fn(usize) -> Result<()>) -> Result<f64> {
        for i in 0..count {
            launch(i)?;
        }
        let ev = || cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).map_err(driver_err("creating an event"));
        let start = ev()?;
        let end = match ev() {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: created above, destroyed once.
                unsafe { cu::event::destroy(start).ok() };
                return Err(e);
            }
        };
        let run = || -> Result<f32> {
            // SAFETY: events and stream of this context; the launches as above.
            unsafe {
                cu::event::record(start, ctx.stream).map_err(driver_err("recording an event"))?;
                for i in 0..iters {
                    launch(i as usize % count)?;
                }
                cu::event::record(end, ctx.stream).map_err(driver_err("recording an event"))?;
                cu::event::synchronize(end).map_err(driver_err("running the kernels"))?;
                cu::event::elapsed(start, end).map_err(driver_err("timing"))
            }
        };
        let ms = run();
        // SAFETY: created above, destroyed once.
        unsafe {
            cu::event::destroy(start).ok();
            cu::event::destroy(end).ok();
        }
        Ok(f64::from(ms?) / 1e3)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn decoder(
        self: std::sync::Arc<Self>,
        model: &crate::Model,
        ctx: usize,
        precision: crate::state::KvPrecision,
    ) -> Option<Result<Box<dyn super::DeviceDecoder>>> {
        decode::decoder_for(self, model, ctx, precision)
    }

    fn matmul_many(&self, raw: &[u8], specs: &[(&Mat, &[f32])]) -> Result<Vec<Vec<f32>>> {
        let mut guard = self.lock();
        let Inner { images, scratch, ctx } = &mut *guard;
        let Some(img) = images.iter().find(|i| i.is(raw)) else {
            // Not uploaded: the CPU reference (documented on the module).
            drop(guard);
            return cpu::matmul_many_new(raw, specs);
        };
        let mut outs: Vec<Vec<f32>> = Vec::with_capacity(specs.len());
        let mut placed = Vec::with_capacity(specs.len());
        let mut on_cpu = Vec::new();
        let mut x_len = 0usize;
        for (i, &(w, x)) in specs.iter().enumerate() {
            let n = x.len() / w.n_in.max(1);
            if w.n_in == 0 || x.len() != n * w.n_in {
                return Err(Error::invalid("matmul: input of the wrong size"));
            }
            outs.push(vec![0f32; n * w.n_out]);
            if n == 0 {
                continue;
            }
            if Self::gpu_shape(img, w) {
                // Each x starts 16-byte aligned for the kernels' float4 loads (n_in % 4 == 0
                // for every GPU format, so each of its rows is aligned too).
                placed.push(Placed { spec: i, kernel: img.kernel_mat(w), n, x_off: x_len, y_off: 0 });
                x_len += (n * w.n_in).next_multiple_of(4);
            } else {
                on_cpu.push(i);
            }
        }
        // Scratch layout, in floats: the descriptor table, the inputs, the outputs, the partial
        // sums of split products. The table and the inputs go over in one copy.
        let table_len = DESC_FLOATS
            * placed
                .iter()
                .map(|p| p.n.div_ceil(chunk_rows(p.kernel.ty, p.kernel.n_in, p.kernel.n_out)))
                .sum::<usize>();
        let x_end = table_len + x_len;
        let mut total = x_end;
        let mut counters = 0;
        for p in placed.iter_mut() {
            p.x_off += table_len;
            p.y_off = total;
            total += p.n * specs[p.spec].0.n_out;
        }
        let y_end = total;
        for p in &placed {
            let (w, k) = (specs[p.spec].0, &p.kernel);
            if slices(k) > 1 {
                total += slices(k) * p.n * w.n_out;
                counters += p.n.div_ceil(chunk_rows(k.ty, k.n_in, k.n_out)) * row_blocks(k);
            }
        }
        if !placed.is_empty() {
            ctx.bind()?;
            scratch.reserve(total)?;
            scratch.reserve_counters(counters)?;
            let queued = Self::queue(ctx, img, scratch, specs, &placed, [table_len, x_end, y_end]);
            if queued.is_err() {
                // Nothing may still be writing into the buffers once this call has returned.
                ctx.sync().ok();
            }
            queued?;
        }
        // The products the GPU does not take run on the CPU meanwhile.
        if !on_cpu.is_empty() {
            let sub: Vec<(&Mat, &[f32])> = on_cpu.iter().map(|&i| specs[i]).collect();
            let ys = cpu::matmul_many_new(raw, &sub);
            if ys.is_err() && !placed.is_empty() {
                ctx.sync().ok();
            }
            for (i, y) in on_cpu.iter().zip(ys?) {
                outs[*i] = y;
            }
        }
        if !placed.is_empty() {
            ctx.sync()?;
            let host = scratch.host(y_end);
            for p in &placed {
                let len = outs[p.spec].len();
                outs[p.spec].copy_from_slice(&host[p.y_off..p.y_off + len]);
            }
        }
        Ok(outs)
    }
}

impl CudaBackend {
    /// Queues the input copy, the launches and the output copy of the `placed` products. In
    /// the scratch buffers (floats): the descriptor table `0..table_len`, the inputs up to
    /// `x_end`, the outputs up to `y_end`, then the partial sums.
    ///
    /// The product chunks (at most `chunk_rows` batch rows each) are grouped by kernel (format and
    /// batch size): one launch per group runs all of its products, its blocks finding their
    /// product in the table. A decode step's call has one to three groups.
    fn queue(
        ctx: &Context,
        img: &DeviceImage,
        scratch: &mut Scratch,
        specs: &[(&Mat, &[f32])],
        placed: &[Placed],
        [table_len, x_end, y_end]: [usize; 3],
    ) -> Result<()> {
        let dev = scratch.dev;
        let at = |off: usize| dev + 4 * off as u64;
        // (kernel stem, batch size, descriptor, blocks), in call order.
        let mut chunks = Vec::with_capacity(table_len / DESC_FLOATS);
        let mut part = y_end;
        let mut counter = 0;
        for p in placed {
            let (w, k) = (specs[p.spec].0, &p.kernel);
            let stem = context::stem(k.ty, k.n_in, k.n_out).expect("a GPU format");
            let mut r = 0;
            while r < p.n {
                let c = (p.n - r).min(chunk_rows(k.ty, k.n_in, k.n_out));
                let nb = context::BATCH_SIZES.iter().copied().find(|&b| b >= c).expect("c <= 16");
                let x = at(p.x_off + r * w.n_in);
                let y = at(p.y_off + r * w.n_out);
                let (d, blocks) = Self::desc(img.addr(w.start), w, k, x, y, at(part), c, counter);
                if d.slices > 1 {
                    part += d.slices as usize * c * w.n_out;
                    counter += blocks / d.slices as usize;
                }
                chunks.push((stem, nb, d, blocks));
                r += c;
            }
        }
        chunks.sort_by_key(|c| (c.0, c.1));
        // Groups of one kernel: (first chunk, chunks, blocks); block starts within the group.
        let mut groups: Vec<(usize, usize, usize)> = Vec::new();
        for i in 0..chunks.len() {
            let same = i > 0 && (chunks[i].0, chunks[i].1) == (chunks[i - 1].0, chunks[i - 1].1);
            if !same {
                groups.push((i, 0, 0));
            }
            let g = groups.last_mut().expect("pushed above");
            chunks[i].2.block_start = i32::try_from(g.2).map_err(|_| Error::invalid("matmul: too many blocks"))?;
            g.1 += 1;
            g.2 += chunks[i].3;
        }
        let host = scratch.host(y_end);
        for p in placed {
            let (w, x) = specs[p.spec];
            let slot = &mut host[p.x_off..p.x_off + x.len()];
            if act8::takes_act8(w.ty) {
                // Each row as 8-bit activations in its own slot of n_in floats (act8.rs; the
                // kernels read row r at byte 4 r n_in): the CPU's bytes exactly.
                for (row, xr) in slot.chunks_exact_mut(w.n_in).zip(x.chunks_exact(w.n_in)) {
                    // SAFETY: the row's floats seen as its 4 * n_in bytes (u8 has alignment 1
                    // and every byte value is valid; the floats are not used meanwhile).
                    let bytes = unsafe { std::slice::from_raw_parts_mut(row.as_mut_ptr().cast::<u8>(), 4 * row.len()) };
                    act8::quantize_row(xr, &mut bytes[..act8::bytes(w.n_in)])?;
                }
            } else {
                slot.copy_from_slice(x);
            }
        }
        let table: Vec<Desc> = chunks.iter().map(|c| c.2).collect();
        // SAFETY: `table_len` floats at the start of the pinned buffer hold the table exactly
        // (Desc is 16 plain 4-byte words); the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(table.as_ptr().cast::<u8>(), host.as_mut_ptr().cast::<u8>(), table_len * 4)
        };
        // SAFETY: the pinned and device buffers hold at least `y_end` floats; the caller
        // synchronizes the stream before the pinned buffer is read, reused or freed.
        unsafe { cu::memcpy_htod_async(dev, &host[..x_end], ctx.stream) }.map_err(driver_err("copying inputs"))?;
        for &(first, count, blocks) in &groups {
            let (stem, nb) = (chunks[first].0, chunks[first].1);
            let f = ctx.kernel_named(stem, nb).ok_or_else(|| Error::Backend(format!("CUDA: no kernel {stem}")))?;
            let table = dev + (first * std::mem::size_of::<Desc>()) as u64;
            Self::launch(ctx, f, table, count, blocks, scratch.counters)?;
        }
        let host = scratch.host(y_end);
        // SAFETY: as above.
        unsafe { cu::memcpy_dtoh_async(&mut host[x_end..y_end], at(x_end), ctx.stream) }
            .map_err(driver_err("copying outputs"))
    }
}
