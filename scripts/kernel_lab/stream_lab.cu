// What reading N bytes once costs on this GPU, as a floor for the one-row products: the time
// a launch of a kernel that only streams a buffer (and folds it into one word a block) takes,
// for the sizes of Flash's products, with each launch reading a different copy so that L2
// never holds it. Three ways of reading:
//   ldg U    every thread issues U 16-byte loads before it uses any (registers hold them);
//   bulk S K one thread a block issues Hopper bulk copies (cp.async.bulk, completion counted on
//            an mbarrier) into S stages of K KB of shared memory, the warps fold each stage;
// timed back to back on one stream and as a CUDA graph of the same launches.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/stream_lab scripts/kernel_lab/stream_lab.cu && /tmp/stream_lab
#include "lab_rt.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

template <int U>
__global__ void __launch_bounds__(256) ldg_sum(const uint4* __restrict__ p, long long n16, u32* out) {
    u32 acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n16; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            v[u] = __ldg(p + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    for (; i < n16; i += stride) {
        const uint4 v = __ldg(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) {
        out[blockIdx.x] = acc;
    }
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// Block b reads bytes [b * per, (b + 1) * per) (per a multiple of the stage size), in stages.
template <int S>
__global__ void __launch_bounds__(256) bulk_sum(const char* __restrict__ p, long long per, int stage_bytes,
                                                long long total, u32* out) {
    extern __shared__ __align__(128) char smem[];
    __shared__ __align__(8) unsigned long long bar[S];
    const long long base = (long long)blockIdx.x * per;
    long long mine = total - base;
    if (mine > per) mine = per;
    if (mine <= 0) return;
    const int steps = (int)((mine + stage_bytes - 1) / stage_bytes);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++) {
            asm volatile("mbarrier.init.shared.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])));
        }
        asm volatile("fence.mbarrier_init.release.cluster;");
    }
    __syncthreads();
    auto issue = [&](int k) {
        const int s = k % S;
        long long off = base + (long long)k * stage_bytes;
        int bytes = stage_bytes;
        if (off + bytes > base + mine) bytes = (int)(base + mine - off);
        asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[s])), "r"(bytes));
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                smem_addr(smem + s * stage_bytes)),
            "l"(p + off), "r"(bytes), "r"(smem_addr(&bar[s]))
            : "memory");
    };
    if (threadIdx.x == 0) {
        for (int k = 0; k < S && k < steps; k++) issue(k);
    }
    u32 acc = 0;
    for (int k = 0; k < steps; k++) {
        const int s = k % S;
        const u32 phase = (k / S) & 1;
        u32 done = 0;
        while (!done) {
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(smem_addr(&bar[s])), "r"(phase)
                : "memory");
        }
        const uint4* q = (const uint4*)(smem + s * stage_bytes);
        for (int i = threadIdx.x; i < stage_bytes / 16; i += blockDim.x) {
            const uint4 v = q[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        __syncthreads();
        if (threadIdx.x == 0 && k + S < steps) issue(k + S);
    }
    if (acc == 0x12345678u) {
        out[blockIdx.x] = acc;
    }
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const long long pool = 2ll << 30;  // copies cycle through 2 GB
    char* buf;
    CK(cudaMalloc(&buf, pool));
    CK(cudaMemset(buf, 1, pool));
    u32* out;
    CK(cudaMalloc(&out, 1 << 20));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    const double mbs[] = {2.2, 4.35, 8.7, 17.4, 35.6, 71.3};
    printf("device SMs %d\n", sms);
    for (double mb : mbs) {
        const long long bytes = ((long long)(mb * 1e6) + 4095) & ~4095ll;
        const int copies = (int)(pool / bytes) > 64 ? 64 : (int)(pool / bytes);
        auto time = [&](auto launch, const char* name) {
            const int iters = 200;
            for (int i = 0; i < 20; i++) launch(i);
            cudaEvent_t a, b;
            CK(cudaEventCreate(&a));
            CK(cudaEventCreate(&b));
            CK(cudaEventRecord(a, st));
            for (int i = 0; i < iters; i++) launch(i);
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            float ms;
            CK(cudaEventElapsedTime(&ms, a, b));
            const float stream_us = 1000 * ms / iters;
            // The same launches as a graph.
            cudaGraph_t g;
            cudaGraphExec_t ge;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            for (int i = 0; i < 100; i++) launch(i);
            CK(cudaStreamEndCapture(st, &g));
            CK(cudaGraphInstantiate(&ge, g, 0));
            CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(a, st));
            for (int r = 0; r < 5; r++) CK(cudaGraphLaunch(ge, st));
            CK(cudaEventRecord(b, st));
            CK(cudaEventSynchronize(b));
            CK(cudaEventElapsedTime(&ms, a, b));
            const float graph_us = 1000 * ms / 500;
            CK(cudaGetLastError());
            printf("%7.2f MB  %-22s stream %7.2f us  graph %7.2f us  (%.2f TB/s)\n", bytes / 1e6, name, stream_us,
                   graph_us, bytes / graph_us / 1e6);
            cudaGraphExecDestroy(ge);
            cudaGraphDestroy(g);
        };
        const long long n16 = bytes / 16;
        for (int bps : {4, 8}) {
            const int grid = sms * bps;
            auto l1 = [&](int i) {
                ldg_sum<1><<<grid, 256, 0, st>>>((const uint4*)(buf + (i % copies) * bytes), n16, out);
            };
            auto l4 = [&](int i) {
                ldg_sum<4><<<grid, 256, 0, st>>>((const uint4*)(buf + (i % copies) * bytes), n16, out);
            };
            auto l8 = [&](int i) {
                ldg_sum<8><<<grid, 256, 0, st>>>((const uint4*)(buf + (i % copies) * bytes), n16, out);
            };
            char nm[64];
            snprintf(nm, 64, "ldg1 grid %d", grid);
            time(l1, nm);
            snprintf(nm, 64, "ldg4 grid %d", grid);
            time(l4, nm);
            snprintf(nm, 64, "ldg8 grid %d", grid);
            time(l8, nm);
        }
        for (int kb : {8, 16, 32}) {
            for (int bps : {1, 2, 3}) {
                const int stage = kb * 1024;
                const int S = 4;
                const int smem = S * stage;
                if (smem * bps > 220 * 1024) continue;
                CK(cudaFuncSetAttribute(bulk_sum<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                const int grid = sms * bps;
                long long per = (bytes + grid - 1) / grid;
                per = (per + 15) & ~15ll;
                auto lb = [&](int i) {
                    bulk_sum<4><<<grid, 256, smem, st>>>(buf + (i % copies) * bytes, per, stage, bytes, out);
                };
                char nm[64];
                snprintf(nm, 64, "bulk4x%dK grid %d", kb, grid);
                time(lb, nm);
            }
        }
    }
    return 0;
}
