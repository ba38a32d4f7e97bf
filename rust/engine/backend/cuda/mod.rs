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
//!   host-to-device copy, launches every product, makes one device-to-host copy of all the
//!   outputs and waits once: a decode step calls it about ten times per layer, and each
//!   synchronization costs tens of microseconds.
//!
//! Row invariance (see [`crate::backend`]): each output element is reduced by the same lane
//! assignment, `fmaf` chain and warp butterfly whatever the batch size (see
//! `shaders/cuda/common.cuh`); batches of more than 16 rows run in chunks of at most 16
//! through the same kernels. GPU results agree with the CPU reference to rounding, not
//! bitwise: the two reduce in different orders.
//!
//! Testing: `cargo test --features cuda cuda` runs the tests of `tests.rs`; without a GPU
//! they print "skipped" and pass, and the NVRTC compile test runs wherever libnvrtc loads
//! (e.g. `LD_LIBRARY_PATH` at the lib dir of pip's `nvidia-cuda-nvrtc-cu12`). On a GPU
//! machine without Rust: build `cargo test --release --features cuda --no-run` and
//! `cargo bench --features cuda --bench cuda --no-run` here, copy the two executables over,
//! and run `<tests> backend::cuda --test-threads=1` and `<bench> --bench`.

mod context;
#[cfg(test)]
mod tests;
mod weights;

use std::sync::Mutex;

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use self::context::{driver_err, Context, MAX_BATCH, ROWS_PER_BLOCK};
use self::weights::DeviceImage;
use super::{cpu, Backend};
use crate::gguf::GgufFile;
use crate::model::weights::Mat;
use crate::quant::GgmlType;
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

/// One product placed in the scratch buffers (offsets in floats).
struct Placed {
    spec: usize,
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
                scratch: Scratch { host: std::ptr::null_mut(), host_cap: 0, dev: 0, dev_cap: 0 },
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
        self.upload_image(file.raw(), file.data_offset() as usize, progress)
    }

    /// [`CudaBackend::upload`] for any image: copies `raw[data_offset..]`; matrices must lie
    /// in that range to run on the GPU.
    pub fn upload_image(&self, raw: &[u8], data_offset: usize, progress: impl FnMut(u64, u64)) -> Result<()> {
        let mut g = self.lock();
        if g.images.iter().any(|i| i.is(raw)) {
            return Ok(());
        }
        g.ctx.bind()?;
        let img = DeviceImage::upload(raw, data_offset, progress)?;
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
    }

    /// Launches the product of `w` with `n <= 16` rows at device `x`, into device `y`.
    fn launch(ctx: &Context, img: &DeviceImage, w: &Mat, x: u64, y: u64, n: usize) -> Result<()> {
        let f = ctx.kernel(w.ty, n).ok_or_else(|| Error::Backend(format!("CUDA: no kernel for {}", w.ty)))?;
        let mut wp = img.addr(w.start);
        let mut n_out = w.n_out as i32;
        let mut n_in = w.n_in as i32;
        let mut row_bytes = w.row_bytes as i64;
        let (mut xp, mut yp, mut nn) = (x, y, n as i32);
        let mut params: [*mut std::ffi::c_void; 7] = [
            (&raw mut wp).cast(),
            (&raw mut n_out).cast(),
            (&raw mut n_in).cast(),
            (&raw mut row_bytes).cast(),
            (&raw mut xp).cast(),
            (&raw mut yp).cast(),
            (&raw mut nn).cast(),
        ];
        let grid = (w.n_out as u32).div_ceil(ROWS_PER_BLOCK);
        // SAFETY: the parameters match the kernel's signature (pointer, int, int, long long,
        // pointer, pointer, int); the weights, x and y ranges are inside live allocations.
        unsafe { cu::launch_kernel(f, (grid, 1, 1), (32 * ROWS_PER_BLOCK, 1, 1), 0, ctx.stream, &mut params) }
            .map_err(driver_err("launching a kernel"))
    }

    /// Times `iters` launches of the product of each of `mats` in turn (they should be at
    /// least as large as the L2 cache together) with `n` rows of zeros, by CUDA events, after
    /// one warm-up round. Returns the seconds of all the launches. For benchmarks.
    #[doc(hidden)]
    pub fn time_launches(&self, raw: &[u8], mats: &[Mat], n: usize, iters: u64) -> Result<f64> {
        let mut g = self.lock();
        let g = &mut *g;
        g.ctx.bind()?;
        let img =
            g.images.iter().find(|i| i.is(raw)).ok_or_else(|| Error::invalid("time_launches: image not uploaded"))?;
        let (n_in, n_out) = mats.iter().fold((0, 0), |(a, b), m| (a.max(m.n_in), b.max(m.n_out)));
        if mats.is_empty() || n == 0 || n > MAX_BATCH || mats.iter().any(|m| !Self::gpu_shape(img, m)) {
            return Err(Error::invalid("time_launches: matrices the kernels cannot take"));
        }
        let x_len = (n * n_in).next_multiple_of(4);
        g.scratch.reserve(x_len + n * n_out)?;
        let (x, y) = (g.scratch.dev, g.scratch.dev + 4 * x_len as u64);
        // SAFETY: inside the scratch allocation; synchronous.
        unsafe { cu::memset_d8_sync(x, 0, 4 * x_len) }.map_err(driver_err("clearing x"))?;
        for m in mats {
            Self::launch(&g.ctx, img, m, x, y, n)?;
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
                cu::event::record(start, g.ctx.stream).map_err(driver_err("recording an event"))?;
                for i in 0..iters {
                    Self::launch(&g.ctx, img, &mats[i as usize % mats.len()], x, y, n)?;
                }
                cu::event::record(end, g.ctx.stream).map_err(driver_err("recording an event"))?;
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
                placed.push(Placed { spec: i, n, x_off: x_len, y_off: 0 });
                x_len += (n * w.n_in).next_multiple_of(4);
            } else {
                on_cpu.push(i);
            }
        }
        let mut total = x_len;
        for p in placed.iter_mut() {
            p.y_off = total;
            total += p.n * specs[p.spec].0.n_out;
        }
        if !placed.is_empty() {
            ctx.bind()?;
            scratch.reserve(total)?;
            let queued = Self::queue(ctx, img, scratch, specs, &placed, x_len, total);
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
            let host = scratch.host(total);
            for p in &placed {
                let len = outs[p.spec].len();
                outs[p.spec].copy_from_slice(&host[p.y_off..p.y_off + len]);
            }
        }
        Ok(outs)
    }
}

impl CudaBackend {
    /// Queues the input copy, the launches and the output copy of the `placed` products
    /// (inputs in floats `0..x_len` of the scratch buffers, outputs in `x_len..total`).
    fn queue(
        ctx: &Context,
        img: &DeviceImage,
        scratch: &mut Scratch,
        specs: &[(&Mat, &[f32])],
        placed: &[Placed],
        x_len: usize,
        total: usize,
    ) -> Result<()> {
        let dev = scratch.dev;
        let host = scratch.host(total);
        for p in placed {
            let x = specs[p.spec].1;
            host[p.x_off..p.x_off + x.len()].copy_from_slice(x);
        }
        // SAFETY: the pinned and device buffers hold `total` floats; the caller synchronizes
        // the stream before the pinned buffer is read, reused or freed.
        unsafe { cu::memcpy_htod_async(dev, &host[..x_len], ctx.stream) }.map_err(driver_err("copying inputs"))?;
        for p in placed {
            let w = specs[p.spec].0;
            let mut r = 0;
            while r < p.n {
                let c = (p.n - r).min(MAX_BATCH);
                let x = dev + 4 * (p.x_off + r * w.n_in) as u64;
                let y = dev + 4 * (p.y_off + r * w.n_out) as u64;
                Self::launch(ctx, img, w, x, y, c)?;
                r += c;
            }
        }
        // SAFETY: as above.
        unsafe { cu::memcpy_dtoh_async(&mut host[x_len..total], dev + 4 * x_len as u64, ctx.stream) }
            .map_err(driver_err("copying outputs"))
    }
}
