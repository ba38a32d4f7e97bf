//! The device, its stream, and the kernels: NVRTC compilation of `shaders/cuda/*.cu` (once
//! per process and architecture) and the module loaded from it.
//!
//! Everything here goes through cudarc's thin `result` layer over the driver API rather than
//! its safe layer: the backend needs device pointers into one large weights allocation, one
//! stream and explicit control of every synchronization, which the safe layer's per-buffer
//! event tracking would add to.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use cudarc::nvrtc;

use super::ptx_cache;
use crate::quant::tables::IQ2XXS_GRID;
use crate::quant::GgmlType;
use crate::{Error, Result};

/// The kernel sources, in the order they are concatenated (after [`tables_source`] for those
/// that use tables): the shared header, then one file per format family.
pub(crate) const SOURCES: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../../../shaders/cuda/common.cuh")),
    ("float.cu", include_str!("../../../../shaders/cuda/float.cu")),
    ("q8_0.cu", include_str!("../../../../shaders/cuda/q8_0.cu")),
    ("q4_k.cu", include_str!("../../../../shaders/cuda/q4_k.cu")),
    ("q2_k.cu", include_str!("../../../../shaders/cuda/q2_k.cu")),
    ("mxfp4.cu", include_str!("../../../../shaders/cuda/mxfp4.cu")),
    ("iq2_xxs.cu", include_str!("../../../../shaders/cuda/iq2_xxs.cu")),
    ("decode_ops.cu", include_str!("../../../../shaders/cuda/decode_ops.cu")),
    ("decode_attn.cu", include_str!("../../../../shaders/cuda/decode_attn.cu")),
    ("decode_moe.cu", include_str!("../../../../shaders/cuda/decode_moe.cu")),
    ("decode_step.cu", include_str!("../../../../shaders/cuda/decode_step.cu")),
    ("gemm.cu", include_str!("../../../../shaders/cuda/gemm.cu")),
    ("gemm_experts.cu", include_str!("../../../../shaders/cuda/gemm_experts.cu")),
];

/// Batch sizes the kernels are instantiated for: a chunk of `n` rows runs the smallest one
/// `>= n` (the kernels take `n` and skip the rest).
pub(crate) const BATCH_SIZES: [usize; 5] = [1, 2, 4, 8, 16];
/// Most batch rows one launch computes.
pub(crate) const MAX_BATCH: usize = 16;
/// Warps per product block (`MV_WARPS` in common.cuh).
pub(crate) const MV_WARPS: usize = 4;
/// Output rows per row group, the rows one warp holds (`MV_ROWS` in common.cuh).
pub(crate) const MV_ROWS: usize = 4;
/// Output rows per row group of the Q8_0 tensor-core kernel (`MQ_WARP_ROWS` in q8_0.cu).
pub(crate) const MQ_WARP_ROWS: usize = 32;
/// Threads per block (`32 * MV_WARPS`).
pub(crate) const THREADS: u32 = 128;

/// Rows of at most this many elements go to Q8_0's tensor-core kernel by default (see
/// [`tensor_cores`]).
pub(crate) const Q8_MMA_MAX_IN: usize = 1024;

/// Rows of at least this many elements also go to Q8_0's tensor-core kernel by default (see
/// [`tensor_cores`]): Flash's o_b (4096 x 8192), which it reads as fast as the float-x kernel
/// at one batch row and 2.8 times faster at eight (H200 lab); in the engine (Flash) verifies
/// of 8 rows took 28.44 ms against 30.63. (Tried and dropped: the shared expert's down
/// (4096 x 2048) as well, and all Q8_0 on the tensor cores (`DS4_CUDA_Q8=mma`); steps slower.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "context.rs: Q8_MMA_MIN_IN".)
pub(crate) const Q8_MMA_MIN_IN: usize = 8192;

/// Matrices (planes) of at least this many rows go to Q8_0's tensor-core kernel by default,
/// whatever their row length (see [`tensor_cores`]): Flash's o_a (8192 x 4096, its eight
/// 1024-row group products with it: `DeviceImage::kernel_mat`) and the LM head. With o_a there
/// steps kept their speed and verifies got faster (H200, Flash: 8 rows 24.82 ms against 26.35).
/// A prompt's steps run this layout's products on `ds4_gemm_q8_0_mq` (64 rows a descriptor)
/// instead. (Tried and dropped: q_a and kv as well; faster verifies, slower steps.)
/// (Measurements: scripts/kernel_lab/HISTORY.md, "context.rs: Q8_MMA_MIN_ROWS".)
pub(crate) const Q8_MMA_MIN_ROWS: usize = 8192;

/// Whether this process multiplies `ty` matrices of `rows` rows (a plane: a 2-D tensor, one
/// expert of a 3-D one) of `n_in` elements on the tensor cores: Q8_0 ones through the exact
/// 8-bit integer kernel (flat in the batch size, shaders/cuda/q8_0.cu) rather than the float-x
/// kernel (faster at one batch row on long rows of matrices that fill the GPU a few times,
/// slower at several batch rows). `DS4_CUDA_Q8`, read once: `mma` for all Q8_0 matrices, `fma`
/// for none; by default those whose rows have at most `DS4_CUDA_Q8_MMA_MAX_IN` elements
/// ([`Q8_MMA_MAX_IN`]: Flash's q_b) or at least `DS4_CUDA_Q8_MMA_MIN_IN` ([`Q8_MMA_MIN_IN`]:
/// its o_b), and those of at least `DS4_CUDA_Q8_MMA_MIN_ROWS` rows ([`Q8_MMA_MIN_ROWS`]: its
/// o_a, and the head, which the tensor-core kernel reads faster even at one row); also any
/// listed in `DS4_CUDA_Q8_MMA_SHAPES` (`NIN`x`ROWS`, comma-separated; entries that do not
/// parse are ignored).
///
/// `DS4_CUDA_Q8_MMA_SHAPES=4096x1024` puts Flash's q_a on the tensor cores as well: it then
/// leaves kv's launch (10.6 + 8.4 us against 9.7 for both), which made steps 0.18 ms slower
/// (H200, 2026-12-02).
/// The choice depends only on the shape, never on the batch, and the device layout of the
/// weights follows it, so a row computes the same way in every batch (row invariance). A
/// product on some rows of a plane makes the plane's choice (`DeviceImage::kernel_mat`; the
/// decoder's o_a launch, program.rs): the plane's kernel laid its rows out.
pub(crate) fn tensor_cores(ty: GgmlType, n_in: usize, rows: usize) -> bool {
    static BOUNDS: OnceLock<(usize, usize, usize)> = OnceLock::new();
    let (max_in, min_in, min_rows) = *BOUNDS.get_or_init(|| {
        let var = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        match std::env::var("DS4_CUDA_Q8").as_deref() {
            Ok("mma") => (usize::MAX, 0, 0),
            Ok("fma") => (0, usize::MAX, usize::MAX),
            _ => (
                var("DS4_CUDA_Q8_MMA_MAX_IN", Q8_MMA_MAX_IN),
                var("DS4_CUDA_Q8_MMA_MIN_IN", Q8_MMA_MIN_IN),
                var("DS4_CUDA_Q8_MMA_MIN_ROWS", Q8_MMA_MIN_ROWS),
            ),
        }
    });
    static SHAPES: OnceLock<Vec<(usize, usize)>> = OnceLock::new();
    let shapes = SHAPES.get_or_init(|| q8_mma_shapes(&std::env::var("DS4_CUDA_Q8_MMA_SHAPES").unwrap_or_default()));
    ty == GgmlType::Q8_0 && (n_in <= max_in || n_in >= min_in || rows >= min_rows || shapes.contains(&(n_in, rows)))
}

/// The `(n_in, rows)` shapes of a `DS4_CUDA_Q8_MMA_SHAPES` setting ("4096x1024,4096x8192"),
/// without the entries that do not parse.
fn q8_mma_shapes(setting: &str) -> Vec<(usize, usize)> {
    let shape = |s: &str| s.trim().split_once('x').and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
    setting.split(',').filter_map(shape).collect()
}

/// The stem of Q8_0's tensor-core kernels.
const MQ_STEM: &str = "q8_0_mq";

/// The kernel name stem of format `ty` for `rows` rows of `n_in` elements in this process
/// (Q8_0: "q8_0" or "q8_0_mq").
pub(crate) fn stem(ty: GgmlType, n_in: usize, rows: usize) -> Option<&'static str> {
    if tensor_cores(ty, n_in, rows) {
        return Some(MQ_STEM);
    }
    FORMATS.iter().find(|(t, _)| *t == ty).map(|(_, s)| *s)
}

/// Elements of a kernel tile of format `ty` (matrices of `rows` rows of `n_in` elements), the
/// unit of the input splits ([`crate::backend::cuda`] `slices`): one 512-byte payload chunk
/// for the kernels that load rows directly (`matvec_split` in shaders/cuda/common.cuh: the
/// float formats and the split formats), one block pair for Q8_0's tensor-core kernel
/// (q8_0.cu), `32 * F::UNIT` for the staged ones (`matvec`: Q4_K, MXFP4).
pub(crate) fn tile_elems(ty: GgmlType, n_in: usize, rows: usize) -> usize {
    match ty {
        GgmlType::F32 => 128,
        GgmlType::F16 | GgmlType::BF16 => 256,
        GgmlType::Q8_0 if tensor_cores(ty, n_in, rows) => 64,
        GgmlType::Q8_0 => 512,
        GgmlType::Q2_K | GgmlType::IQ2_XXS => 2048,
        _ => 1024,
    }
}

/// The formats with kernels, and their kernel name stems.
pub(crate) const FORMATS: [(GgmlType, &str); 8] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q2_K, "q2_k"),
    (GgmlType::IQ2_XXS, "iq2_xxs"),
    (GgmlType::MXFP4, "mxfp4"),
];

/// The lookup tables of the kernels, emitted from the one Rust definition of each
/// ([`crate::quant::tables`]) so there is no second copy to keep in sync.
pub(crate) fn tables_source() -> String {
    let mut s = String::from(
        "// IQ2_XXS lattice: ggml's iq2xxs_grid (ggml/src/ggml-common.h, MIT licence), emitted from\n\
         // rust/engine/quant/tables.rs IQ2XXS_GRID.\n\
         __device__ const unsigned long long iq2xxs_grid[256] = {\n",
    );
    for row in IQ2XXS_GRID.chunks(4) {
        let cells: Vec<String> = row.iter().map(|v| format!("0x{v:016x}ull")).collect();
        s.push_str("    ");
        s.push_str(&cells.join(", "));
        s.push_str(",\n");
    }
    s.push_str("};\n\n");
    s
}

/// The whole NVRTC program: the shared header, the tables, then every format's kernels.
pub fn kernel_source() -> String {
    assemble(SOURCES.iter().map(|(name, text)| (format!("shaders/cuda/{name}"), text.to_string())))
}

/// The sources as one text, each file after a line that names it, the tables after the first.
fn assemble(files: impl IntoIterator<Item = (String, String)>) -> String {
    let mut s = String::new();
    for (i, (name, text)) in files.into_iter().enumerate() {
        if i == 1 {
            s.push_str(&tables_source());
        }
        s.push_str(&format!("// ---- {name}\n{text}\n"));
    }
    s
}

/// What [`compile`] compiles: [`kernel_source`], or with `DS4_CUDA_SOURCES=DIR` the files of
/// [`SOURCES`]' names read from DIR instead of the embedded ones (an empty value counts as
/// unset). That is for kernel work on a GPU machine without Rust: one build runs and A/Bs
/// several versions of the shaders, each in its own process. A file missing from DIR is an
/// error, not a fallback, so an A/B never mixes versions unknowingly.
pub(crate) fn compile_source(dir: Option<&std::path::Path>) -> Result<String> {
    let Some(dir) = dir else { return Ok(kernel_source()) };
    let files = SOURCES.iter().map(|(name, _)| {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| Error::Backend(format!("CUDA: DS4_CUDA_SOURCES: cannot read {}: {e}", path.display())))?;
        Ok((path.display().to_string(), text))
    });
    Ok(assemble(files.collect::<Result<Vec<_>>>()?))
}

/// Where NVRTC can come from, for the error that says it was not found.
const NVRTC_HINT: &str = "install a CUDA toolkit, or `pip install nvidia-cuda-nvrtc-cu12`, \
    or set DS4_CUDA_LIB to the folder that holds libnvrtc.so";

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { nvrtc::sys::is_culib_present() || preload_nvrtc() }
}

/// Loads NVRTC from where a CUDA toolkit installs it when it is not on the loader's path.
///
/// cudarc opens `libnvrtc.so.13` (and its other candidates) by name, and NVRTC itself opens
/// `libnvrtc-builtins.so.*` by name: a toolkit under `/usr/local/cuda-13.0/...` that is not in
/// `LD_LIBRARY_PATH` is found by neither. Opening both by absolute path first, and keeping
/// them loaded for the life of the process, makes those later by-name opens find the loaded
/// objects (the dynamic loader matches already loaded libraries by their soname). Searched:
/// the folders of `$DS4_CUDA_LIB` (a path list), `$CUDA_HOME`, `$CUDA_PATH`, then
/// `/usr/local/cuda*` (newest first), in their `lib64`, `lib` and `targets/*/lib` folders;
/// last, the folders of `$_DS4_PIP_CUDA_LIBS`, which the Python package sets at import to
/// where pip's NVIDIA wheels (`nvidia-cuda-nvrtc-cu12`, CUDA 13's `nvidia/cu13`) keep NVRTC:
/// a machine with a driver and PyTorch, say, but no toolkit.
fn preload_nvrtc() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        let paths = |var: &str| std::env::var_os(var).map(|v| std::env::split_paths(&v).collect::<Vec<_>>());
        let mut roots: Vec<std::path::PathBuf> = paths("DS4_CUDA_LIB").unwrap_or_default();
        roots.extend(["CUDA_HOME", "CUDA_PATH"].iter().filter_map(std::env::var_os).map(std::path::PathBuf::from));
        if let Ok(dir) = std::fs::read_dir("/usr/local") {
            let mut cudas: Vec<_> = dir
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("cuda")))
                .collect();
            cudas.sort();
            roots.extend(cudas.into_iter().rev());
        }
        roots.extend(paths("_DS4_PIP_CUDA_LIBS").unwrap_or_default());
        for root in roots {
            let mut dirs = vec![root.clone(), root.join("lib64"), root.join("lib")];
            if let Ok(t) = std::fs::read_dir(root.join("targets")) {
                dirs.extend(t.flatten().map(|e| e.path().join("lib")));
            }
            for dir in dirs {
                let Ok(entries) = std::fs::read_dir(&dir) else { continue };
                let mut names: Vec<_> = entries.flatten().map(|e| e.path()).collect();
                names.sort();
                let is = |p: &std::path::Path, stem: &str| {
                    p.file_name().is_some_and(|n| n.to_string_lossy().starts_with(stem))
                };
                let Some(main) = names.iter().rev().find(|p| is(p, "libnvrtc.so.")) else { continue };
                // SAFETY: loading NVRTC runs only its initializers; the handles are leaked on
                // purpose so the libraries stay loaded.
                unsafe {
                    for b in names.iter().filter(|p| is(p, "libnvrtc-builtins.so")) {
                        if let Ok(lib) = libloading::Library::new(b) {
                            std::mem::forget(lib);
                        }
                    }
                    match libloading::Library::new(main) {
                        Ok(lib) => std::mem::forget(lib),
                        Err(_) => continue,
                    }
                    if nvrtc::sys::is_culib_present() {
                        return true;
                    }
                }
            }
        }
        false
    })
}

/// Whether the driver library (libcuda) can be loaded.
pub(crate) fn driver_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

/// Compiles [`kernel_source`] to PTX for `arch` (`compute_90`, ...), once per process: later
/// calls, from any backend instance, get the cached text.
///
/// `--fmad=false`: the kernels spell every fused multiply-add they want as `fmaf`, and nothing
/// else may be contracted, so that each kernel instantiation (batch size) rounds alike.
pub fn compile(arch: &str) -> Result<Arc<String>> {
    compile_with(arch, &[])
}

/// [`compile`] with `-D` options after the process's own (tests compare kernel variants that
/// must give the same bits).
pub(crate) fn compile_with(arch: &str, defines: &[&str]) -> Result<Arc<String>> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<String>>>> = OnceLock::new();
    if !nvrtc_available() {
        return Err(Error::BackendUnavailable(format!("CUDA: libnvrtc not found ({NVRTC_HINT})")));
    }
    let cache = CACHE.get_or_init(Default::default);
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    let key = [arch].iter().chain(defines).copied().collect::<Vec<_>>().join(" -D");
    if let Some(p) = cache.get(&key) {
        return Ok(Arc::clone(p));
    }
    let mut options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    // How kernels let the next one launch (shaders/cuda/common.cuh ds4_grid_deps): by default
    // the decode's products read their weights before waiting for the previous kernel
    // (ds4_grid_launch); for A/B timing, `DS4_CUDA_PDL=exit` has every kernel let the next one
    // launch as it exits, `=start` as it starts.
    match std::env::var("DS4_CUDA_PDL").as_deref() {
        Ok("start") => options.push("-DDS4_PDL_TRIGGER_AT_START".into()),
        Ok("exit") => {}
        _ => options.push("-DDS4_PDL_EARLY".into()),
    }
    if std::env::var("DS4_CUDA_INDEX").is_ok_and(|v| v == "row") {
        // For A/B timing and tests: the indexer's scores one thread per row and its top-k
        // digit by one thread's loop, rather than per (row, head) and by a block scan
        // (decode_attn.cu DS4_INDEX_WIDE_ON): the same results, longer latency.
        options.push("-DDS4_INDEX_ROW".into());
    }
    // For A/B timing of compile-time variants in the engine: `DS4_CUDA_DEFINES="A=1 B"` adds
    // -DA=1 -DB. The switches the kernels document (MV_MIN_BLOCKS, MV_MIN_BLOCKS_Q8_0_1, ...)
    // change only how work is scheduled, never the results; other defines are unsupported.
    if let Ok(defs) = std::env::var("DS4_CUDA_DEFINES") {
        options.extend(defs.split_whitespace().map(|d| format!("-D{d}")));
    }
    options.extend(defines.iter().map(|d| format!("-D{d}")));
    let source = compile_source(
        std::env::var_os("DS4_CUDA_SOURCES").filter(|d| !d.is_empty()).as_ref().map(std::path::Path::new),
    )?;
    let ptx = Arc::new(nvrtc_ptx(source, options, arch, ptx_cache::dir().as_deref())?);
    cache.insert(key, Arc::clone(&ptx));
    Ok(ptx)
}

/// NVRTC's version, (major, minor), when it says.
fn nvrtc_version() -> Option<(i32, i32)> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loaded (the caller checked); the out-pointers are live locals.
    let r = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (r == nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// The PTX of `source` compiled by NVRTC with `options` (and `--fmad=false`) for `arch`: from
/// the disk cache in `cache_dir` when it holds it (ptx_cache.rs), else compiled, and then kept
/// there.
pub(crate) fn nvrtc_ptx(source: String, options: Vec<String>, arch: &str, cache_dir: Option<&Path>) -> Result<String> {
    // The key's options: those given, and what CompileOptions adds below.
    let mut key_options = options.clone();
    key_options.extend(["--fmad=false".to_string(), "name=ds4_kernels.cu".to_string()]);
    let cached = cache_dir
        .zip(nvrtc_version())
        .map(|(dir, nvrtc)| (dir, ptx_cache::Key { nvrtc, options: &key_options, source: &source }));
    if let Some(ptx) = cached.as_ref().and_then(|(dir, key)| ptx_cache::load(dir, key)) {
        return Ok(ptx);
    }
    let opts =
        nvrtc::CompileOptions { fmad: Some(false), options, name: Some("ds4_kernels.cu".into()), ..Default::default() };
    let ptx = nvrtc::compile_ptx_with_opts(&source, opts)
        .map_err(|e| {
            let msg = match &e {
                nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => format!("{other:?}"),
            };
            Error::Backend(format!("CUDA: NVRTC failed to compile the kernels for {arch}:\n{msg}"))
        })?
        .to_src();
    if let Some((dir, key)) = &cached {
        ptx_cache::store(dir, key, &ptx);
    }
    Ok(ptx)
}

/// A driver error as an engine error.
pub(crate) fn driver_err(what: &str) -> impl Fn(cu::DriverError) -> Error + '_ {
    move |e| Error::Backend(format!("CUDA: {what}: {e}"))
}

/// One device: its context (the primary one), a stream of this backend, the loaded kernels.
pub(crate) struct Context {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: sys::CUstream,
    module: sys::CUmodule,
    /// `(kernel name stem, batch size) -> (kernel, bytes of dynamic shared memory)`.
    kernels: HashMap<(&'static str, usize), (sys::CUfunction, u32)>,
    pub(crate) name: String,
    pub(crate) compute_capability: (i32, i32),
    pub(crate) multiprocessors: i32,
    /// The most dynamic shared memory a block may opt in to (bytes).
    pub(crate) smem_optin: usize,
    /// Whether decode launches allow programmatic dependent launch (sm_90 and later, unless
    /// `DS4_CUDA_PDL=0`; see `Context::launch_args`).
    pub(crate) pdl: bool,
    /// The scheduling priority of the launches on the context's stream (`Context::launch_args`)
    /// when `DS4_CUDA_PRIORITY=1`: the device's greatest, so that a decode step's side branch
    /// (its own stream, default priority) takes only the SMs its main branch leaves. Off by
    /// default: on an H200 (Flash at 2100 tokens) steps and verifies with it were within the noise.
    /// (Measurements: scripts/kernel_lab/HISTORY.md, "context.rs: priority".)
    pub(crate) priority: Option<i32>,
    /// Whether the driver reports kernels' parameters (`cuFuncGetParamInfo`, CUDA 12.4 and
    /// later): then every launch by name is checked against them (`Context::check_args`).
    pub(crate) param_info: bool,
    /// Parameter sizes in bytes by kernel handle, as the driver reported them (`None`: it
    /// could not say for this kernel).
    pub(crate) param_sizes: std::sync::Mutex<HashMap<usize, Option<Vec<usize>>>>,
}

/// The sizes in bytes of `f`'s parameters, in order, as the driver reports them; `None` when
/// it cannot. Panics (in cudarc's loader) when the driver lacks the entry points: call it
/// under `catch_unwind` until one call has succeeded.
///
/// # Safety
/// `f` is a function of a loaded module.
pub(crate) unsafe fn param_sizes(f: sys::CUfunction) -> Option<Vec<usize>> {
    // cuFuncGetParamInfo answers CUDA_ERROR_INVALID_VALUE past the last parameter (the count
    // query came later, in CUDA 13.2).
    let mut sizes = Vec::new();
    for i in 0..256 {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: per the caller; the out-pointers are live locals.
        match unsafe { sys::cuFuncGetParamInfo(f, i, &mut offset, &mut size) } {
            sys::CUresult::CUDA_SUCCESS => sizes.push(size),
            sys::CUresult::CUDA_ERROR_INVALID_VALUE => return Some(sizes),
            _ => return None,
        }
    }
    None
}

// SAFETY: the raw handles (stream, module, functions) are plain driver handles, valid in any
// thread once the context is bound; the backend binds it at the start of every call and
// serializes all use behind a mutex.
unsafe impl Send for Context {}

impl Context {
    /// Opens device `ordinal`, compiles (or takes from the cache) and loads the kernels.
    pub(crate) fn new(ordinal: usize) -> Result<Self> {
        let unavailable = |m: String| Error::BackendUnavailable(format!("CUDA: {m}"));
        if !driver_available() {
            return Err(unavailable("the driver library (libcuda) was not found".into()));
        }
        if !nvrtc_available() {
            return Err(unavailable(format!("libnvrtc was not found ({NVRTC_HINT})")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| unavailable(format!("no usable device {ordinal}: {e}")))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let compute_capability = ctx.compute_capability().map_err(driver_err("compute capability"))?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver_err("multiprocessor count"))?;
        let smem_optin = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(driver_err("shared memory per block"))?
            .max(48 * 1024) as usize;
        let (major, minor) = compute_capability;
        if major < 6 {
            return Err(unavailable(format!("{name} (sm_{major}{minor}) is older than sm_60")));
        }
        let ptx = compile(&format!("compute_{major}{minor}"))?;
        ctx.bind_to_thread().map_err(driver_err("binding the context"))?;
        let stream =
            cu::stream::create(cu::stream::StreamKind::NonBlocking).map_err(driver_err("creating a stream"))?;
        let image = CString::new(ptx.as_bytes()).map_err(|_| Error::Backend("CUDA: PTX holds a NUL byte".into()))?;
        // SAFETY: a NUL-terminated PTX image; the context is bound.
        let module = match unsafe { cu::module::load_data(image.as_ptr().cast()) } {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: the stream was created above and is used by nothing else.
                unsafe { cu::stream::destroy(stream).ok() };
                return Err(Error::Backend(format!("CUDA: loading the kernels' PTX on {name}: {e}")));
            }
        };
        let pdl = major >= 9 && !std::env::var("DS4_CUDA_PDL").is_ok_and(|v| v == "0");
        let priority = if std::env::var("DS4_CUDA_PRIORITY").is_ok_and(|v| v == "1") {
            let (mut least, mut greatest) = (0i32, 0i32);
            // SAFETY: the context is bound; the out-pointers are live locals.
            unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
                .result()
                .map_err(driver_err("stream priorities"))?;
            (greatest != least).then_some(greatest)
        } else {
            None
        };
        let mut me = Context {
            ctx,
            stream,
            module,
            kernels: HashMap::new(),
            name,
            compute_capability,
            multiprocessors,
            smem_optin,
            pdl,
            priority,
            param_info: false,
            param_sizes: std::sync::Mutex::new(HashMap::new()),
        };
        for stem in FORMATS.iter().map(|f| f.1).chain([MQ_STEM]) {
            for nb in BATCH_SIZES {
                let fname = CString::new(format!("ds4_mv_{stem}_{nb}")).expect("no NUL in kernel names");
                // SAFETY: the module is loaded and the context bound.
                let f =
                    unsafe { cu::module::get_function(me.module, fname) }.map_err(driver_err("looking up a kernel"))?;
                // The kernel's shared memory size, as the program computes it (ds4_smem_*):
                // more than the default 48 KiB needs opting in per function.
                let gname = CString::new(format!("ds4_smem_{stem}_{nb}")).expect("no NUL in symbol names");
                let mut smem = [0i32; 1];
                // SAFETY: a 4-byte int global of the loaded module; synchronous copy.
                unsafe {
                    let (ptr, _) =
                        cu::module::get_global(me.module, gname).map_err(driver_err("finding a kernel size"))?;
                    cu::memcpy_dtoh_sync(&mut smem, ptr).map_err(driver_err("reading a kernel size"))?;
                    cu::function::set_function_attribute(
                        f,
                        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem[0],
                    )
                    .map_err(driver_err("allowing a kernel its shared memory"))?;
                }
                me.kernels.insert((stem, nb), (f, smem[0] as u32));
            }
        }
        // The parameter check is on when the driver describes a known kernel right (a product
        // kernel: a descriptor table, a count, the counters); older drivers lack the entry
        // points, and cudarc panics on a missing one.
        if let Some(&(f, _)) = me.kernels.get(&("f32", 1)) {
            // SAFETY: a function of the module loaded above.
            let sizes = std::panic::catch_unwind(|| unsafe { param_sizes(f) }).ok().flatten();
            me.param_info = sizes.as_deref() == Some(&[8, 4, 8][..]);
        }
        Ok(me)
    }

    /// The kernel for `ty` matrices of `rows` rows of `n_in` elements and a chunk of `n`
    /// (1..=16) batch rows: the one instantiated for the smallest batch size `>= n`.
    pub(crate) fn kernel(&self, ty: GgmlType, n_in: usize, rows: usize, n: usize) -> Option<(sys::CUfunction, u32)> {
        let nb = BATCH_SIZES.iter().copied().find(|&b| b >= n)?;
        self.kernel_named(stem(ty, n_in, rows)?, nb)
    }

    /// The kernel `ds4_mv_{stem}_{nb}` and its dynamic shared memory.
    pub(crate) fn kernel_named(&self, stem: &'static str, nb: usize) -> Option<(sys::CUfunction, u32)> {
        self.kernels.get(&(stem, nb)).copied()
    }

    /// The loaded module (the decode kernels are looked up in it by name).
    pub(crate) fn module(&self) -> sys::CUmodule {
        self.module
    }

    /// The name of a product kernel ("ds4_mv_q8_0_4"), for profiles.
    pub(crate) fn product_kernel_name(&self, f: sys::CUfunction) -> Option<String> {
        self.kernels.iter().find(|(_, v)| v.0 == f).map(|((stem, nb), _)| format!("ds4_mv_{stem}_{nb}"))
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver_err("binding the context"))
    }

    /// Waits for the stream.
    pub(crate) fn sync(&self) -> Result<()> {
        // SAFETY: the stream belongs to this context.
        unsafe { cu::stream::synchronize(self.stream) }.map_err(driver_err("running the kernels"))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the stream and module were created by this context and are dropped once.
            unsafe {
                cu::stream::synchronize(self.stream).ok();
                cu::stream::destroy(self.stream).ok();
                cu::module::unload(self.module).ok();
            }
        }
    }
}

#[cfg(test)]
mod shape_setting_tests {
    use super::q8_mma_shapes;

    /// `DS4_CUDA_Q8_MMA_SHAPES`: `NINxROWS` entries, spaces allowed, the malformed ones dropped.
    #[test]
    fn q8_mma_shapes_parse() {
        assert_eq!(q8_mma_shapes("4096x1024,4096x8192"), vec![(4096, 1024), (4096, 8192)]);
        assert_eq!(q8_mma_shapes(" 64x32 , x5, 7x, 8y9,,3x4"), vec![(64, 32), (3, 4)]);
        assert!(q8_mma_shapes("").is_empty());
    }
}
