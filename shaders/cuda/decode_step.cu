// ds4 CUDA kernels of the device-resident decode: moving a step's state writes into one
// buffer for the host (rust/engine/backend/cuda/decode/mod.rs).

// One contiguous run of floats to copy: `len` floats from `src` to `dst + off` of the
// destination.
struct Ds4Copy {
    const float* src;
    long long off;
    long long len;
};

// Block i copies run i of `runs` into `dst`: what a step wrote to the device state (ring rows,
// compressor slots, emitted rows), packed for one device-to-host copy.
extern "C" __global__ void ds4_pack(const Ds4Copy* __restrict__ runs, float* __restrict__ dst) {
    ds4_grid_deps();
    const Ds4Copy c = runs[blockIdx.x];
    for (long long i = threadIdx.x; i < c.len; i += blockDim.x) {
        dst[c.off + i] = c.src[i];
    }
}
