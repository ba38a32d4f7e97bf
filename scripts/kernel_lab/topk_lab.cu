// Top-k lab: times ds4_index_topk (decode_attn.cu, the indexer's selection of 512 of a CSA
// row's compressed rows) from cubins of the kernel program made by build_ptx.py, one per
// version to compare, in one run on a GPU machine without Rust. See README.md.
//
//   nvcc -O2 -o topk_lab topk_lab.cu -lcuda && ./topk_lab before.cubin after.cubin
//
// Flash's shapes: ratio 4, top 512, rows of 525 scores (a 2100-token context) and 8192 (32K),
// one row and eight, with the engine's 1024 threads a block and with 512. Scores are
// pseudo-random normals times 0.05 (their top bytes mostly equal, as an indexer's are). Prints
// per case the microseconds of a launch back to back (mean of 500 after 20 warm-up ones; the
// launch gap included, about 3.5 us for an empty kernel) and alone (events around one launch,
// mean of 50), and checks that every case selects the same indices as the first cubin's with
// 1024 threads.
#include <cmath>
#include <vector>

#include "lab_util.h"

int main(int argc, char** argv) {
    if (argc < 2) {
        printf("usage: %s CUBIN...\n", argv[0]);
        return 2;
    }
    lab_init();
    const int ratio = 4, topk = 512, max_rows = 8, stride = 8192 + 64;
    std::vector<float> h((size_t)max_rows * stride);
    unsigned s = 12345u;
    auto uni = [&]() {
        s = s * 1664525u + 1013904223u;
        return ((s >> 8) + 0.5f) / 16777216.0f;
    };
    for (auto& v : h) {
        v = 0.05f * sqrtf(-2.0f * logf(uni())) * cosf(6.2831853f * uni());
    }
    CUdeviceptr scores, sel, nsel, step;
    CK(cuMemAlloc(&scores, h.size() * 4));
    CK(cuMemcpyHtoD(scores, h.data(), h.size() * 4));
    CK(cuMemAlloc(&sel, (size_t)max_rows * topk * 4));
    CK(cuMemAlloc(&nsel, max_rows * 4));
    CK(cuMemAlloc(&step, 4));
    CUevent a, b;
    CK(cuEventCreate(&a, 0));
    CK(cuEventCreate(&b, 0));
    std::vector<int> first_sel[2][2];
    for (int m = 1; m < argc; m++) {
        CUmodule mod;
        CK(cuModuleLoad(&mod, argv[m]));
        CUfunction f;
        CK(cuModuleGetFunction(&f, mod, "ds4_index_topk"));
        int regs = 0, local = 0;
        CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f));
        CK(cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f));
        printf("%s (%d registers, %d B local)\n", argv[m], regs, local);
        for (int ci = 0; ci < 2; ci++) {
            const int n_vis = ci == 0 ? 525 : 8192;
            const int pos = ratio * n_vis - 1;  // row 0 sees n_vis scores
            CK(cuMemcpyHtoD(step, &pos, 4));
            for (int bi = 0; bi < 4; bi++) {
                const int rows = bi % 2 == 0 ? 1 : 8, ri = bi % 2, threads = bi < 2 ? 1024 : 512;
                int st = stride, rt = ratio, k = topk;
                void* args[] = {&scores, &st, &rt, &k, &sel, &nsel, &step};
                // A block a row, as the engine launches it (grid g1 = (rows, 1, 1)).
                auto launch_x = [&](int) { CK(cuLaunchKernel(f, rows, 1, 1, threads, 1, 1, 0, 0, args, 0)); };
                const float us = lab_us_per_launch(launch_x, 20, 500);
                float alone = 0;
                for (int i = 0; i < 55; i++) {
                    CK(cuEventRecord(a, 0));
                    launch_x(i);
                    CK(cuEventRecord(b, 0));
                    CK(cuEventSynchronize(b));
                    float ms = 0;
                    CK(cuEventElapsedTime(&ms, a, b));
                    if (i >= 5) {
                        alone += 1000.0f * ms / 50;
                    }
                }
                std::vector<int> got((size_t)rows * topk);
                CK(cuMemcpyDtoH(got.data(), sel, got.size() * 4));
                const char* same = "";
                if (m == 1 && bi < 2) {
                    first_sel[ci][ri] = got;
                } else {
                    same = got == first_sel[ci][ri] ? ", same selection" : ", SELECTION DIFFERS";
                }
                printf("  %5d scores, %d row%s, %4d threads: %6.2f us/launch back to back, %6.2f us alone%s\n",
                       n_vis, rows, rows == 1 ? " " : "s", threads, us, alone, same);
            }
        }
        CK(cuModuleUnload(mod));
    }
    return 0;
}
