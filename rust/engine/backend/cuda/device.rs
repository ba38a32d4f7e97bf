//! Plain device buffers and launches of the decode kernels by name.
//!
//! The matrix-product kernels are launched through their descriptor tables (see the module
//! above); the kernels of the device-resident decode (`shaders/cuda/decode_*.cu`) take plain
//! parameters: device pointers, ints and floats, passed here as [`Arg`]s.

use std::ffi::{c_void, CString};

use cudarc::driver::result as cu;
use cudarc::driver::sys;

use super::context::{driver_err, Context};
use crate::{Error, Result};

/// Waits for what was queued on the legacy stream (`CU_STREAM_LEGACY`, where the synchronous
/// memsets and copies run), not for the whole context: a context-wide wait (cuCtxSynchronize)
/// is refused while another thread captures a graph on one of the context's streams
/// (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED), and invalidates that capture, which broke a
/// session's first step when another thread allocated a buffer meanwhile (seen in the CUDA
/// tests run in parallel on a cold driver cache, where a capture lasts seconds). Waiting for
/// the legacy stream is allowed then: it does not encompass the context's streams, which are
/// non-blocking, and is all these callers need.
pub(crate) fn sync_legacy(what: &str) -> Result<()> {
    // SAFETY: CU_STREAM_LEGACY is ((CUstream)0x1) in cuda.h, a handle valid in every context.
    unsafe { cu::stream::synchronize(1usize as sys::CUstream) }.map_err(driver_err(what))
}

/// One device allocation, freed on drop (the owner keeps its context alive and bound).
pub(crate) struct DevBuf {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) bytes: usize,
}

impl DevBuf {
    /// `bytes` bytes (at least 4), zeroed.
    pub(crate) fn zeroed(bytes: usize) -> Result<Self> {
        let bytes = bytes.max(4).next_multiple_of(16);
        // SAFETY: a plain allocation, freed in Drop; zeroed before anyone reads it.
        unsafe {
            let ptr = cu::malloc_sync(bytes).map_err(driver_err("allocating device memory"))?;
            let b = DevBuf { ptr, bytes };
            cu::memset_d8_sync(ptr, 0, bytes).map_err(driver_err("clearing device memory"))?;
            // The memset runs on the legacy stream, which the context's non-blocking stream
            // does not wait for: finish it before anything is queued that may read the buffer.
            sync_legacy("clearing device memory")?;
            Ok(b)
        }
    }

    /// A buffer holding a copy of `data`.
    pub(crate) fn from_slice<T: Copy>(data: &[T]) -> Result<Self> {
        let b = Self::zeroed(std::mem::size_of_val(data))?;
        b.write(0, data)?;
        Ok(b)
    }

    /// The device address of byte `off`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn at(&self, off: usize) -> u64 {
        self.ptr + off as u64
    }

    /// Copies `data` to byte offset `off`, synchronously.
    pub(crate) fn write<T: Copy>(&self, off: usize, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        if off + std::mem::size_of_val(data) > self.bytes {
            return Err(Error::invalid("device write past the end of a buffer"));
        }
        // SAFETY: the range is inside the allocation. A "synchronous" copy from pageable
        // memory may still be in flight on the legacy stream when it returns, and the
        // context's non-blocking stream does not wait for that stream: finish it here.
        unsafe {
            cu::memcpy_htod_sync(self.ptr + off as u64, data).map_err(driver_err("copying to the device"))?;
            sync_legacy("copying to the device")
        }
    }

    /// `len` values of type `T` from byte offset `off`, synchronously (callers sync the
    /// context's stream first: this copy does not wait for it).
    pub(crate) fn read<T: Copy + Default>(&self, off: usize, len: usize) -> Result<Vec<T>> {
        let mut out = vec![T::default(); len];
        if len == 0 {
            return Ok(out);
        }
        if off + std::mem::size_of_val(out.as_slice()) > self.bytes {
            return Err(Error::invalid("device read past the end of a buffer"));
        }
        // SAFETY: the range is inside the allocation; the copy is synchronous.
        unsafe { cu::memcpy_dtoh_sync(&mut out, self.ptr + off as u64) }
            .map_err(driver_err("copying from the device"))?;
        Ok(out)
    }

    /// Every value, as `T`.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn read_all<T: Copy + Default>(&self) -> Result<Vec<T>> {
        self.read(0, self.bytes / std::mem::size_of::<T>())
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed`, freed once.
        unsafe { cu::free_sync(self.ptr).ok() };
    }
}

/// A kernel parameter: the kernels take `T*` (any pointer), `int` and `float`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Arg {
    Ptr(u64),
    I32(i32),
    F32(f32),
}

/// Bytes of `f`'s static shared memory (its `__shared__` arrays), which count with a launch's
/// dynamic bytes against the block's limit.
pub(crate) fn static_smem(f: sys::CUfunction) -> Result<usize> {
    // SAFETY: the caller's `f` is a function of a loaded module.
    let bytes = unsafe {
        cu::function::get_function_attribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
    }
    .map_err(driver_err("reading a kernel's shared memory"))?;
    Ok(bytes.max(0) as usize)
}

/// Blocks of `threads` threads (no dynamic shared memory) of `f` that one SM holds at once,
/// by its registers and static shared memory.
pub(crate) fn blocks_per_sm(f: sys::CUfunction, threads: u32) -> Result<usize> {
    // SAFETY: the caller's `f` is a function of a loaded module.
    let blocks = unsafe { cu::occupancy::max_active_block_per_multiprocessor(f, threads as i32, 0) }
        .map_err(driver_err("reading a kernel's occupancy"))?;
    Ok(blocks.max(1) as usize)
}

impl Context {
    /// The kernel called `name` in the loaded module.
    pub(crate) fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let cname = CString::new(name).map_err(|_| Error::invalid("kernel name with a NUL byte"))?;
        // SAFETY: the module is loaded and the context bound by the caller.
        unsafe { cu::module::get_function(self.module(), cname) }
            .map_err(|e| Error::Backend(format!("CUDA: no kernel {name}: {e}")))
    }

    /// Launches `f` on the context's stream over `grid` blocks of `block` threads with `smem`
    /// bytes of dynamic shared memory (more than 48 KiB is opted into here). On sm_90 and
    /// later the launch allows programmatic dependent launch: the kernel's blocks may be placed
    /// while the previous kernel's last blocks finish, and wait for it in `ds4_grid_deps`
    /// (shaders/cuda/common.cuh), which every kernel calls first; `DS4_CUDA_PDL=0` turns it off.
    pub(crate) fn launch_args(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_with(self.stream, self.pdl, self.priority, f, grid, block, smem, args)
    }

    /// [`Context::launch_args`] on `stream` (of this context), with programmatic dependent
    /// launch only if `pdl`, at the stream's own priority.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn launch_on(
        &self,
        stream: sys::CUstream,
        pdl: bool,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        self.launch_with(stream, pdl, None, f, grid, block, smem, args)
    }

    /// [`Context::launch_on`] at scheduling priority `priority` when given.
    #[allow(clippy::too_many_arguments)]
    fn launch_with(
        &self,
        stream: sys::CUstream,
        pdl: bool,
        priority: Option<i32>,
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(());
        }
        self.check_args(f, args)?;
        // Each parameter's bytes in an 8-byte cell (little-endian: an int or float in the low
        // half); the driver copies as many bytes as the kernel's parameter has.
        let mut cells: Vec<u64> = args
            .iter()
            .map(|a| match *a {
                Arg::Ptr(p) => p,
                Arg::I32(i) => u64::from(i as u32),
                Arg::F32(x) => u64::from(x.to_bits()),
            })
            .collect();
        let mut params: Vec<*mut c_void> = cells.iter_mut().map(|c| (c as *mut u64).cast()).collect();
        // SAFETY: the caller passes arguments matching the kernel's signature; `cells` outlives
        // the launch call (the driver copies the parameters at launch).
        unsafe {
            // Without opting in, a block's static and dynamic shared memory together may not
            // pass 48 KiB (ds4_route's static arrays plus a step's dynamic ones can). The
            // static size is asked for only where it decides.
            const DEFAULT: usize = 48 * 1024;
            let smem_bytes = smem as usize;
            if smem_bytes > DEFAULT || (smem > 0 && smem_bytes + static_smem(f)? > DEFAULT) {
                cu::function::set_function_attribute(
                    f,
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )
                .map_err(driver_err("allowing a kernel its shared memory"))?;
            }
            if !pdl && priority.is_none() {
                return cu::launch_kernel(f, grid, (block, 1, 1), smem, stream, &mut params)
                    .map_err(driver_err("launching a kernel"));
            }
            let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
            let mut count = 0;
            if pdl {
                attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[count].value.programmaticStreamSerializationAllowed = 1;
                count += 1;
            }
            if let Some(p) = priority {
                attrs[count].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
                attrs[count].value.priority = p;
                count += 1;
            }
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: stream,
                attrs: attrs.as_mut_ptr(),
                numAttrs: count as u32,
            };
            sys::cuLaunchKernelEx(&cfg, f, params.as_mut_ptr(), std::ptr::null_mut())
                .result()
                .map_err(driver_err("launching a kernel"))
        }
    }

    /// Checks `args` against `f`'s parameters when the driver describes them
    /// ([`Context::param_info`]): as many arguments as parameters, a pointer for each 8-byte
    /// one, an int or float for each 4-byte one. A wrong list is an error here; launched, the
    /// driver would read past the arguments or hand the kernel a wrong half of one.
    pub(crate) fn check_args(&self, f: sys::CUfunction, args: &[Arg]) -> Result<()> {
        if !self.param_info {
            return Ok(());
        }
        let mut cache = self.param_sizes.lock().map_err(|_| Error::Backend("CUDA: parameter cache poisoned".into()))?;
        // SAFETY: `f` is a function of this context's module (every caller looks it up there).
        let entry = cache.entry(f as usize).or_insert_with(|| unsafe { super::context::param_sizes(f) });
        let Some(sizes) = entry.as_deref() else { return Ok(()) };
        let bad = |why: String| Err(Error::Backend(format!("CUDA: a kernel launch with the wrong arguments: {why}")));
        if sizes.len() != args.len() {
            return bad(format!("{} arguments for {} parameters", args.len(), sizes.len()));
        }
        for (i, (&size, a)) in sizes.iter().zip(args).enumerate() {
            let want = match a {
                Arg::Ptr(_) => 8,
                Arg::I32(_) | Arg::F32(_) => 4,
            };
            if size != want {
                return bad(format!("argument {i} has {want} bytes, the parameter {size}"));
            }
        }
        Ok(())
    }

    /// [`Context::launch_args`] by kernel name (tests and one-off launches).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn launch_named(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        let f = self.function(name)?;
        self.launch_args(f, grid, block, smem, args)
    }
}
