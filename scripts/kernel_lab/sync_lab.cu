// What a dependent step costs: a chain of phases, each a one-row product's shape (every block
// reads a slice of the phase's weights and the whole of the previous phase's output, then
// writes its slice of this phase's output), run four ways:
//   kernels     a launch a phase, back to back on a stream;
//   graph       the same launches as a CUDA graph;
//   graph+pdl   the graph with programmatic dependent launch: a phase's blocks ask L2 for
//               their weights and load their first ones before griddepcontrol.wait, and let
//               the next phase launch once their wait is over (as the engine's products do,
//               shaders/cuda/common.cuh);
//   persistent  one cooperative launch a run: every block walks the phases, does its part of
//               each phase it takes part in, and waits for the phase before on a count in
//               global memory (each block of a phase adds one after a fence); it asks for its
//               next phase's weights before that wait, so a block with no part in a one-block
//               phase is already loading the next one's.
// and once with no dependencies at all (every phase reads the first input: the floor of the
// bytes and the work). The question it answers: how much of a decode layer's ~160-200 us
// beyond its ~55 us of bytes (README, "A decode layer's critical path") a persistent kernel
// could take back, before anyone writes one.
//
// Each phase's sums are the same arithmetic in every mode, so the last output must be the same
// bits in all of them; a check run of each mode first fills every output with NaN, so a phase
// that read its input before it was written shows as a difference.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/sync_lab scripts/kernel_lab/sync_lab.cu && /tmp/sync_lab [BLOCKS_PER_SM]
#include "lab_rt.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// Floats of every phase's input and output (a Flash row).
#define X_LEN 4096
#define THREADS 256
// 16-byte loads a thread has in flight.
#define UNROLL 8
// Ints between two phases' counts: a 128-byte line each, so that the blocks polling one
// phase's count do not share a line with the adds to the next ones'.
#define COUNT_STRIDE 32

struct Phase {
    const uint4* w;   // the phase's weights
    long long n16;    // their 16-byte words
    int blocks;       // blocks taking part: blocks 0 .. blocks - 1
    int wait_on;      // the phase whose output is this one's input (-1: none)
    int wait_count;   // that phase's blocks
    const float* x;   // input, X_LEN floats
    float* y;         // output, X_LEN floats
};

// What a block does before it may read its input: the L2 prefetch of its slice of the
// weights (each warp's lane 0 a share) and its first UNROLL loads a thread.
struct Pre {
    uint4 v[UNROLL];
    long long lo, hi;
};

__device__ __forceinline__ void phase_pre(const Phase& ph, int b, Pre& pre) {
    pre.lo = ph.n16 * b / ph.blocks;
    pre.hi = ph.n16 * (b + 1) / ph.blocks;
    const int warps = THREADS / 32, warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0 && pre.hi > pre.lo) {
        const long long n = pre.hi - pre.lo;
        const long long a = pre.lo + n * warp / warps, e = pre.lo + n * (warp + 1) / warps;
        if (e > a) {
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ph.w + a), "r"((u32)((e - a) * 16))
                         : "memory");
        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const long long i = pre.lo + threadIdx.x + (long long)u * THREADS;
        pre.v[u] = i < pre.hi ? __ldg(ph.w + i) : make_uint4(0, 0, 0, 0);
    }
}

// A weight word as a float in [1, 2).
__device__ __forceinline__ float wf(u32 v) {
    return __uint_as_float((v & 0x007fffffu) | 0x3f800000u);
}

__device__ __forceinline__ void eat(float& acc, const uint4 v, long long i, const float* xs) {
    const int k = (int)((i * 4) & (X_LEN - 1));
    acc = fmaf(wf(v.x), xs[k], acc);
    acc = fmaf(wf(v.y), xs[k + 1], acc);
    acc = fmaf(wf(v.z), xs[k + 2], acc);
    acc = fmaf(wf(v.w), xs[k + 3], acc);
}

// The rest, once the input is there: the input to shared memory (from L2: other blocks wrote
// it), the dot of the slice with it, the block's sum in a fixed order, the block's slice of the
// output.
__device__ __forceinline__ void phase_main(const Phase& ph, int b, const Pre& pre, const float* x, float* xs,
                                           float* red) {
    for (int i = threadIdx.x; i < X_LEN; i += THREADS) {
        xs[i] = __ldcg(x + i);
    }
    __syncthreads();
    float acc = 0.0f;
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
        const long long i = pre.lo + threadIdx.x + (long long)u * THREADS;
        if (i < pre.hi) {
            eat(acc, pre.v[u], i, xs);
        }
    }
    for (long long base = pre.lo + (long long)UNROLL * THREADS; base < pre.hi; base += (long long)UNROLL * THREADS) {
        uint4 v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const long long i = base + threadIdx.x + (long long)u * THREADS;
            v[u] = i < pre.hi ? __ldg(ph.w + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const long long i = base + threadIdx.x + (long long)u * THREADS;
            if (i < pre.hi) {
                eat(acc, v[u], i, xs);
            }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    }
    if ((threadIdx.x & 31) == 0) {
        red[threadIdx.x >> 5] = acc;
    }
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < THREADS / 32; i++) {
        s += red[i];
    }
    const int s0 = X_LEN * b / ph.blocks, s1 = X_LEN * (b + 1) / ph.blocks;
    for (int j = s0 + threadIdx.x; j < s1; j += THREADS) {
        ph.y[j] = fmaf(xs[j], 0.5f, 1.0f + 1e-9f * s);
    }
    __syncthreads();  // xs and red are reused by the block's next phase
}

// One phase a launch (kernels, graph, graph+pdl). With pdl, the wait for the previous launch
// comes after the weights' first loads, and the next launch may start once it is over.
__global__ void __launch_bounds__(THREADS) phase_kernel(Phase ph, int pdl) {
    __shared__ float xs[X_LEN];
    __shared__ float red[THREADS / 32];
    Pre pre;
    phase_pre(ph, blockIdx.x, pre);
    if (pdl) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
    phase_main(ph, blockIdx.x, pre, ph.x, xs, red);
}

__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Every phase in one launch; counts[COUNT_STRIDE p] gets one from each block of phase p (after a fence),
// epoch e waits for (e + 1) times the producer's blocks, so the counts need no reset between
// runs. deps == 0: no waits, every phase reads x0 (the floor).
__global__ void __launch_bounds__(THREADS) persistent_kernel(const Phase* phases, int count, int* counts, int epoch,
                                                             int deps, const float* x0) {
    __shared__ float xs[X_LEN];
    __shared__ float red[THREADS / 32];
    for (int p = 0; p < count; p++) {
        const Phase ph = phases[p];
        if ((int)blockIdx.x >= ph.blocks) {
            continue;
        }
        Pre pre;
        phase_pre(ph, blockIdx.x, pre);
        if (deps && ph.wait_on >= 0) {
            if (threadIdx.x == 0) {
                const int target = ph.wait_count * (epoch + 1);
                long long spins = 0;
                while (ld_acquire(counts + COUNT_STRIDE * ph.wait_on) < target) {
                    if (++spins > (1ll << 22)) {
                        __trap();  // seconds with no progress: a bug here, not a slow phase
                    }
                }
                __threadfence();
            }
            __syncthreads();
        }
        phase_main(ph, blockIdx.x, pre, deps ? ph.x : x0, xs, red);
        if (deps && threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counts + COUNT_STRIDE * p, 1);
        }
    }
}

// Pseudo-random words.
__global__ void fill_kernel(u32* p, long long n, u32 seed) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        u32 h = (u32)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        p[i] = h;
    }
}

struct Spec {
    double mb;     // weights, MB
    bool one;      // one block (else the grid)
    const char* what;
};

struct Case {
    const char* name;
    std::vector<Spec> phases;  // a layer's
};

int main(int argc, char** argv) {
    const int bps = argc > 1 ? atoi(argv[1]) : 2;
    const int layers = 43, copies = 8, runs = 10, trials = 5;
    int sms, coop;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, 0));
    int fit = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, persistent_kernel, THREADS, 0));
    if (!coop || fit < bps) {
        printf("cooperative launch %d, %d blocks of persistent_kernel an SM fit, %d asked\n", coop, fit, bps);
        return 1;
    }
    const int grid = sms * bps;
    printf("%d SMs, grid %d blocks of %d threads, %d layers a run (weights cycle through %d copies)\n", sms, grid,
           THREADS, layers, copies);
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    std::vector<Case> cases;
    cases.push_back({"16 phases, no weights, every block", std::vector<Spec>(16, Spec{0.0, false, ""})});
    {
        std::vector<Spec> alt;
        for (int i = 0; i < 8; i++) {
            alt.push_back({0.0, false, ""});
            alt.push_back({0.0, true, ""});
        }
        cases.push_back({"16 phases, no weights, every other one block", alt});
    }
    // The main-stream chain of a Flash decode layer (an HCA layer's shapes, the shared expert's
    // bytes in the routed products' phases as if it ran beside them): MB of weights, one block?
    cases.push_back({"a Flash decode layer (20 phases)",
                     {{0.79, false, "hc site"},        {6.7, false, "q_a, kv"},     {0.0, true, "q_a norm"},
                      {35.7, false, "q_b"},            {0.0, true, "finish rows"},  {0.0, true, "compressors"},
                      {1.0, false, "attention logits"}, {1.0, false, "attention"},  {35.7, false, "o_a"},
                      {35.7, false, "o_b"},            {0.79, false, "hc site"},    {2.1, false, "router"},
                      {0.0, true, "route"},            {0.0, true, "gather"},       {43.8, false, "gate, up"},
                      {0.0, true, "swiglu"},           {25.4, false, "down"},       {0.0, true, "combine"},
                      {0.0, true, "hc post"},          {0.0, true, "norm"}}});

    float *x0, *ybuf;
    CK(cudaMalloc(&x0, X_LEN * 4));
    {
        std::vector<float> h(X_LEN);
        for (int i = 0; i < X_LEN; i++) {
            h[i] = 1.0f + 0.001f * (float)(i % 97);
        }
        CK(cudaMemcpy(x0, h.data(), X_LEN * 4, cudaMemcpyHostToDevice));
    }

    for (const Case& c : cases) {
        const int per = (int)c.phases.size(), count = per * layers;
        // The layer's weights, `copies` times.
        std::vector<long long> off(per + 1, 0);
        for (int p = 0; p < per; p++) {
            off[p + 1] = off[p] + (((long long)(c.phases[p].mb * 1e6) + 4095) & ~4095ll) / 16;
        }
        const long long layer16 = std::max(off[per], 1ll);
        uint4* w;
        CK(cudaMalloc(&w, layer16 * 16 * copies));
        fill_kernel<<<1024, 256, 0, st>>>((u32*)w, layer16 * 4 * copies, 12345u);
        CK(cudaMalloc(&ybuf, (size_t)count * X_LEN * 4));
        std::vector<Phase> ph(count), floor_ph(count);
        int dependent = 0;
        for (int l = 0; l < layers; l++) {
            for (int p = 0; p < per; p++) {
                const int g = l * per + p;
                Phase& q = ph[g];
                q.w = w + (l % copies) * layer16 + off[p];
                q.n16 = off[p + 1] - off[p];
                q.blocks = c.phases[p].one ? 1 : grid;
                q.wait_on = g - 1;
                q.wait_count = g > 0 ? ph[g - 1].blocks : 0;
                q.x = g > 0 ? ybuf + (size_t)(g - 1) * X_LEN : x0;
                q.y = ybuf + (size_t)g * X_LEN;
                dependent += g > 0;
                floor_ph[g] = q;
                floor_ph[g].wait_on = -1;
                floor_ph[g].x = x0;
            }
        }
        Phase *dph, *dfloor;
        int* counts;
        CK(cudaMalloc(&dph, count * sizeof(Phase)));
        CK(cudaMalloc(&dfloor, count * sizeof(Phase)));
        CK(cudaMalloc(&counts, (size_t)count * COUNT_STRIDE * 4));
        CK(cudaMemcpy(dph, ph.data(), count * sizeof(Phase), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dfloor, floor_ph.data(), count * sizeof(Phase), cudaMemcpyHostToDevice));
        CK(cudaDeviceSynchronize());  // the copies (legacy stream) before st's work
        double mb = 0;
        for (const Spec& s : c.phases) {
            mb += s.mb;
        }
        printf("\n%s: %.1f MB a layer, %d phases a run, %d of them wait\n", c.name, mb, count, dependent);

        auto launch_all = [&](int pdl) {
            for (int g = 0; g < count; g++) {
                cudaLaunchConfig_t cfg = {};
                cfg.gridDim = dim3(ph[g].blocks);
                cfg.blockDim = dim3(THREADS);
                cfg.stream = st;
                cudaLaunchAttribute at[1];
                at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
                at[0].val.programmaticStreamSerializationAllowed = 1;
                cfg.attrs = at;
                cfg.numAttrs = pdl ? 1 : 0;
                CK(cudaLaunchKernelEx(&cfg, phase_kernel, ph[g], pdl));
            }
        };
        cudaGraphExec_t graphs[2];
        for (int pdl = 0; pdl < 2; pdl++) {
            cudaGraph_t gr;
            CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
            launch_all(pdl);
            CK(cudaStreamEndCapture(st, &gr));
            CK(cudaGraphInstantiate(&graphs[pdl], gr, 0));
            CK(cudaGraphDestroy(gr));
        }
        int epoch = 0;
        auto persistent = [&](int deps) {
            const Phase* table = deps ? dph : dfloor;
            int e = epoch++;
            void* args[] = {(void*)&table, (void*)&count, (void*)&counts, (void*)&e, (void*)&deps, (void*)&x0};
            CK(cudaLaunchCooperativeKernel((void*)persistent_kernel, dim3(grid), dim3(THREADS), args, 0, st));
        };
        const char* names[] = {"kernels", "graph", "graph+pdl", "persistent", "no dependencies"};
        auto run = [&](int mode) {
            switch (mode) {
                case 0: launch_all(0); break;
                case 1: CK(cudaGraphLaunch(graphs[0], st)); break;
                case 2: CK(cudaGraphLaunch(graphs[1], st)); break;
                case 3: persistent(1); break;
                default: persistent(0); break;
            }
        };
        // The check: every output NaN, one run, the last output back.
        std::vector<float> ref(X_LEN), got(X_LEN);
        float floor_us = 0;
        for (int mode = 0; mode < 5; mode++) {
            CK(cudaMemsetAsync(counts, 0, (size_t)count * COUNT_STRIDE * 4, st));
            epoch = 0;
            CK(cudaMemsetAsync(ybuf, 0xff, (size_t)count * X_LEN * 4, st));
            run(mode);
            CK(cudaStreamSynchronize(st));
            CK(cudaGetLastError());
            CK(cudaMemcpy(got.data(), ybuf + (size_t)(count - 1) * X_LEN, X_LEN * 4, cudaMemcpyDeviceToHost));
            if (mode == 0) {
                ref = got;
            }
            int nan = 0;
            for (float v : got) {
                nan += std::isnan(v);
            }
            const bool same = memcmp(ref.data(), got.data(), X_LEN * 4) == 0;
            for (int i = 0; i < 3; i++) {
                run(mode);
            }
            std::vector<float> us;
            cudaEvent_t a, b;
            CK(cudaEventCreate(&a));
            CK(cudaEventCreate(&b));
            for (int t = 0; t < trials; t++) {
                CK(cudaEventRecord(a, st));
                for (int r = 0; r < runs; r++) {
                    run(mode);
                }
                CK(cudaEventRecord(b, st));
                CK(cudaEventSynchronize(b));
                float ms;
                CK(cudaEventElapsedTime(&ms, a, b));
                us.push_back(1000.0f * ms / runs);
            }
            CK(cudaEventDestroy(a));
            CK(cudaEventDestroy(b));
            std::sort(us.begin(), us.end());
            const float med = us[trials / 2];
            if (mode == 4) {
                floor_us = med;
            }
            printf("  %-16s %9.1f us a run  %7.2f a layer  %6.2f a phase  (%.2f TB/s)  %s%s\n", names[mode], med,
                   med / layers, med / count, mb * layers / med,
                   mode == 4 ? "" : (same ? "same bits" : "DIFFERENT BITS"), nan ? " (NaN in the output)" : "");
        }
        printf("  (the floor, no dependencies: %.2f us a layer)\n", floor_us / layers);
        for (int pdl = 0; pdl < 2; pdl++) {
            CK(cudaGraphExecDestroy(graphs[pdl]));
        }
        CK(cudaFree(w));
        CK(cudaFree(ybuf));
        CK(cudaFree(dph));
        CK(cudaFree(dfloor));
        CK(cudaFree(counts));
    }
    return 0;
}
