// Small-kernel lab: times some of ds4's decode kernels (not the products: lab.cu) from a cubin
// of the kernel program made by build_ptx.py, for each module given, so that two builds can be
// compared in one run on a GPU machine without Rust. See README.md.
//
//   nvcc -O2 -o ops_lab ops_lab.cu -lcuda && ./ops_lab before.cubin after.cubin
//
// Flash shapes (4 streams of 4096), one batch row unless said. Inputs are smooth made-up
// values (these kernels' timing does not depend on them). Prints per case the microseconds per
// launch (mean of 500 back-to-back launches after 20 warm-up ones, CUDA events, no
// programmatic dependent launch: each includes the launch gap, about 3.5 us for an empty
// kernel, the "swiglu of 6 values" line), registers and local memory.
#include <vector>

#include "lab_util.h"

// A device buffer of `floats` values around `v`.
static CUdeviceptr buf(size_t floats, float v) {
    std::vector<float> h(floats + 16);
    for (size_t i = 0; i < h.size(); i++) {
        h[i] = v * (1.0f + 0.001f * (float)(i % 97));
    }
    CUdeviceptr p;
    CK(cuMemAlloc(&p, h.size() * 4));
    CK(cuMemcpyHtoD(p, h.data(), h.size() * 4));
    return p;
}

static void time_kernel(const char* what, CUfunction f, int grid_x, int grid_y, int block, void** args) {
    auto launch = [&](int) { CK(cuLaunchKernel(f, grid_x, grid_y, 1, block, 1, 1, 0, 0, args, 0)); };
    const float us = lab_us_per_launch(launch, 20, 500);
    int regs = 0, local = 0;
    CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f));
    CK(cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f));
    printf("  %-40s %7.2f us/launch  %3d registers  %4d B local\n", what, us, regs, local);
}

// Microseconds of one launch alone (events around it, mean of 50: the launch latency included,
// so compare with the empty kernel's line), warm (the inputs in L2 from the launch before) and
// cold (a 256 MB memset between launches evicts them, as the decode's weight stream does to
// the small kernels' weights between layers). On the H200 hc_pre measured 12.6 us warm and
// 11.7 cold: where its inputs are does not explain its 12 us in the decode step.
static void time_alone(const char* what, CUfunction f, int grid_x, int grid_y, int block, void** args) {
    static CUdeviceptr evict = 0;
    const size_t evict_bytes = 256u << 20;
    if (!evict) {
        CK(cuMemAlloc(&evict, evict_bytes));
    }
    CUevent a, b;
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));
    float us[2] = {0, 0};
    for (int cold = 0; cold < 2; cold++) {
        for (int i = 0; i < 55; i++) {
            if (cold) {
                CK(cuMemsetD8Async(evict, (unsigned char)i, evict_bytes, 0));
            }
            CK(cuEventRecord(a, 0));
            CK(cuLaunchKernel(f, grid_x, grid_y, 1, block, 1, 1, 0, 0, args, 0));
            CK(cuEventRecord(b, 0));
            CK(cuEventSynchronize(b));
            float ms = 0;
            CK(cuEventElapsedTime(&ms, a, b));
            if (i >= 5) {
                us[cold] += 1000.0f * ms / 50;
            }
        }
    }
    cuEventDestroy(a);
    cuEventDestroy(b);
    printf("  %-40s alone: %7.2f us warm, %7.2f us cold\n", what, us[0], us[1]);
}

int main(int argc, char** argv) {
    if (argc < 2) {
        printf("usage: %s CUBIN...\n", argv[0]);
        return 2;
    }
    lab_init();
    int hc = 4, d = 4096, n_mix = (2 + hc) * hc, hc_d = hc * d;
    float hc_eps = 1e-6f, eps = 1e-6f;
    CUdeviceptr logits = buf(16 * n_mix, 0.1f), x = buf(16 * hc_d, 0.5f), y = buf(16 * d, 0.0f),
                mix = buf(16 * (hc + hc * hc), 0.0f), base = buf(n_mix, 0.2f), scale = buf(3, 1.0f),
                norm = buf(d, 1.0f), flat = buf(16 * hc_d, 0.0f), f = buf(16 * d, 0.3f), none = 0;
    for (int m = 1; m < argc; m++) {
        CUmodule mod;
        CK(cuModuleLoad(&mod, argv[m]));
        printf("%s\n", argv[m]);
        CUfunction hc_pre, rms_plain, hc_post, swiglu;
        CK(cuModuleGetFunction(&hc_pre, mod, "ds4_hc_pre"));
        CK(cuModuleGetFunction(&rms_plain, mod, "ds4_rms_plain"));
        CK(cuModuleGetFunction(&hc_post, mod, "ds4_hc_post"));
        CK(cuModuleGetFunction(&swiglu, mod, "ds4_swiglu"));
        // ds4_hc_pre with the decode's Sinkhorn (20 iterations) and with one (the rest of the
        // kernel), with and without the fused sublayer norm, at 1024 and 256 threads, 8 rows.
        for (int iters : {20, 1}) {
            for (bool with_norm : {true, false}) {
                CUdeviceptr* nm = with_norm ? &norm : &none;
                void* args[] = {&logits, &n_mix, &x, &y, &mix, &base, &scale, &hc, &d, &hc_eps, &iters, nm, &eps};
                char what[96];
                snprintf(what, sizeof what, "hc_pre, %d iterations%s", iters, with_norm ? ", norm" : "");
                time_kernel(what, hc_pre, 1, 1, 1024, args);
            }
        }
        {
            int iters = 20;
            void* args[] = {&logits, &n_mix, &x, &y, &mix, &base, &scale, &hc, &d, &hc_eps, &iters, &norm, &eps};
            time_kernel("hc_pre, 20 iterations, norm, 256 threads", hc_pre, 1, 1, 256, args);
            time_kernel("hc_pre, 20 iterations, norm, 8 rows", hc_pre, 8, 1, 1024, args);
            int none_iters = 0;
            void* args0[] = {&logits, &n_mix, &x, &y, &mix, &base, &scale,
                             &hc, &d, &hc_eps, &none_iters, &norm, &eps};
            time_alone("hc_pre, 0 iterations, norm (the decode's)", hc_pre, 1, 1, 1024, args0);
        }
        // ds4_hc_site (the site in one cluster launch, with the F16 projection), where the
        // module has it: with the norm, then with the attention site's expansion folded in.
        CUfunction hc_site;
        if (cuModuleGetFunction(&hc_site, mod, "ds4_hc_site") == CUDA_SUCCESS) {
            static CUdeviceptr proj = buf((size_t)n_mix * hc_d / 2, 0.01f);
            int row_bytes = 2 * hc_d, w_f16 = 1, iters0 = 0;
            void* args[] = {&proj, &row_bytes, &w_f16, &x,    &y,   &mix,  &base, &scale,
                            &hc,   &d,         &hc_eps, &iters0, &norm, &eps, &none, &none};
            time_kernel("hc_site, norm", hc_site, 8, 1, d / 8, args);
            time_alone("hc_site, norm", hc_site, 8, 1, d / 8, args);
            void* pargs[] = {&proj, &row_bytes, &w_f16, &x,    &y,   &mix, &base, &scale,
                             &hc,   &d,         &hc_eps, &iters0, &norm, &eps, &f,   &mix};
            time_kernel("hc_site, norm, expansion", hc_site, 8, 1, d / 8, pargs);
            time_kernel("hc_site, norm, 8 rows", hc_site, 8, 8, d / 8, args);
        }
        {
            CUfunction rms_weight;
            CK(cuModuleGetFunction(&rms_weight, mod, "ds4_rms_weight"));
            void* args[] = {&f, &y, &norm, &d, &eps};
            time_alone("rms_weight of 4096", rms_weight, 1, 1, 1024, args);
        }
        void* rms_args[] = {&x, &flat, &hc_d, &eps};
        time_kernel("rms_plain of 16384", rms_plain, 1, 1, 1024, rms_args);
        void* post_args[] = {&x, &f, &mix, &hc, &d};
        time_kernel("hc_post", hc_post, d / 256, 1, 256, post_args);
        int count = 6;
        float clamp = 10.0f;
        int act8 = 0;  // (width and act8: programs before ds4_swiglu took them ignore them)
        void* sw_args[] = {&f, &f, &y, &count, &clamp, &count, &act8};
        time_kernel("swiglu of 6 values (the launch gap)", swiglu, 1, 1, 256, sw_args);
        time_alone("swiglu of 6 values", swiglu, 1, 1, 256, sw_args);
    }
    return 0;
}
