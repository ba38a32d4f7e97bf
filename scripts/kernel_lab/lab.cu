// Kernel lab: times ds4's product kernels outside the engine, from a cubin (or PTX) of the
// kernel program made by build_ptx.py, with the descriptor settings given on each input line,
// so that kernel variants (other -D values, other .cu files, other warp groups) can be compared
// in one short run on a GPU machine that has no Rust. See README.md.
//
//   nvcc -O2 -o lab lab.cu -lcuda && ./lab < configs.txt
//
// A line: MODULE DESC_BYTES FORMAT NB N_OUT N_IN GROUP ROWS_PER_WARP TILE_ELEMS BLOCK_ELEMS
// BLOCK_BYTES EXPERTS. DESC_BYTES is the size of MvDesc in that program (80 now, 64 before
// warp groups); EXPERTS is how many products of the shape one launch runs (as the routed
// experts do). Every product reads a matrix of its own, and enough copies are cycled that the
// launches read DRAM, not L2. Prints per line: registers, blocks, slices, microseconds per
// launch (mean of 200 back-to-back launches after 20 warm-up ones, CUDA events), GB/s. With
// LAB_CHECK=REF.cubin each line also compares one launch's outputs with REF's same kernel.
//
// A prompt's tensor-core products (shaders/cuda/gemm.cu) with FORMAT gemm_q8_0, gemm_q8_0_mq
// or gemm_f16:
// NB is then the rows of a descriptor (up to 64), EXPERTS the descriptors over one matrix (a
// 256-row step: 4 of 64), GROUP and ROWS_PER_WARP are 1 and 32, and the slices follow gemm.rs.
// Their lines also print the tensor-core rate (2 n_out n_in rows / time).
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "lab_util.h"

// MvDesc of shaders/cuda/common.cuh (the first DESC_BYTES bytes are copied).
struct Desc {
    unsigned long long w, x, y, part;
    long long row_bytes;
    int n_out, n_in, n, slices, block_start, counter, group, y_stride, warp_rows, pad;
};

struct Config {
    char module[256];
    int desc_bytes;
    char format[32];
    int nb;
    long long n_out, n_in;
    int group, rows_per_warp, tile, block_elems, block_bytes, experts;
};

static std::map<std::string, CUmodule> modules;

// Fills `bytes` of device memory with pseudo-random bytes (xorshift64, a fixed seed): random
// IQ2_XXS lattice indices make the lookups hit shared-memory banks as real weights do, where a
// constant byte has every lane read the same entry. Scales may decode to NaN or infinity,
// which the kernels multiply as fast as any other value.
static void fill_random(CUdeviceptr dst, size_t bytes) {
    static std::vector<unsigned long long> pattern;
    const size_t piece = 16u << 20;
    if (pattern.empty()) {
        pattern.resize(piece / 8);
        unsigned long long s = 0x9E3779B97F4A7C15ull;
        for (auto& v : pattern) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v = s;
        }
    }
    // Each piece starts at another offset into the pattern, so that copies differ.
    for (size_t off = 0, k = 0; off < bytes; off += piece, k++) {
        const size_t n = bytes - off < piece ? bytes - off : piece;
        const size_t shift = (k * 4099 * 8) % (piece / 2);
        CK(cuMemcpyHtoD(dst + off, (const char*)pattern.data() + shift, n < piece - shift ? n : piece - shift));
        if (n > piece - shift) {
            CK(cuMemcpyHtoD(dst + off + (piece - shift), pattern.data(), n - (piece - shift)));
        }
    }
}

// The host's slice count (rust/engine/backend/cuda/mod.rs `slices`) for this shape.
// (The Q8_0 tensor-core kernel, 16 or 32 rows a warp, asks for 4 x 132 blocks and 2 tiles a warp.)
static int slice_count(int row_blocks, int tiles, int group, int rows_per_warp) {
    const bool mq = rows_per_warp >= 16;
    int want = (mq ? 528 : 132) / row_blocks;
    want = want < 1 ? 1 : want > 32 ? 32 : want;
    const int most = tiles / group / (mq ? 2 : 1) < 1 ? 1 : tiles / group / (mq ? 2 : 1);
    want = want > most ? most : want;
    const int per = (tiles + want - 1) / want;
    return (tiles + per - 1) / per;
}

// gemm.rs `slices` for one matrix of n_out x n_in: at least 256 warps, at least 8 units (32
// inputs) a slice, at most 32 slices.
static int gemm_slices(long long n_out, long long n_in) {
    const long long units = n_in / 32 < 1 ? 1 : n_in / 32;
    const long long warps = (n_out + 127) / 128 * 4;
    long long want = (256 + warps - 1) / warps;
    want = want < 1 ? 1 : want > 32 ? 32 : want;
    const long long most = units / 8 < 1 ? 1 : units / 8;
    want = want > most ? most : want;
    const long long per = (units + want - 1) / want;
    return (int)((units + per - 1) / per);
}

// Whether a line's FORMAT names a prompt's tensor-core product (gemm.cu) rather than matvec.
static bool is_gemm(const char* format) { return strncmp(format, "gemm_", 5) == 0; }

// The kernel `name` of module `path` (loaded once) and its dynamic shared memory.
static CUfunction kernel_of(const char* path, const char* format, int nb, int* smem) {
    if (!modules.count(path)) {
        CUmodule m;
        CK(cuModuleLoad(&m, path));
        modules[path] = m;
    }
    CUmodule mod = modules[path];
    char name[96];
    const bool gemm = is_gemm(format);
    if (gemm) {
        snprintf(name, sizeof name, "ds4_%s", format);
    } else {
        snprintf(name, sizeof name, "ds4_mv_%s_%d", format, nb);
    }
    CUfunction f;
    CK(cuModuleGetFunction(&f, mod, name));
    *smem = 0;
    CUdeviceptr g;
    size_t size;
    char sym[96];
    if (gemm) {
        snprintf(sym, sizeof sym, "ds4_smem_%s", format);
    } else {
        snprintf(sym, sizeof sym, "ds4_smem_%s_%d", format, nb);
    }
    if (cuModuleGetGlobal(&g, &size, mod, sym) == CUDA_SUCCESS) {
        CK(cuMemcpyDtoH(smem, g, 4));
    }
    // Static and dynamic shared memory together past 48 KiB need the opt-in too.
    if (*smem > 0) {
        CK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, *smem));
    }
    return f;
}

// LAB_CHECK=REF.cubin: one launch of the line's kernel and one of the same kernel of REF, with
// the same descriptors (the first copy of the weights) and pseudo-random x, must write the same
// bits (NaN matching NaN): what a variant that only changes how a kernel loads its data must
// keep. Prints the verdict under the timing line.
template <class Launch>
static void check(const Config& c, const char* ref, CUdeviceptr X, CUdeviceptr Y, Launch launch, CUfunction f,
                  int smem) {
    const bool gemm = is_gemm(c.format);
    const size_t rows = gemm ? (size_t)c.nb * c.experts : 16;
    std::vector<float> x(rows * c.n_in);
    unsigned long long s = 0x2545F4914F6CDD1Dull;
    for (auto& v : x) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v = (float)((s >> 40) & 0xffff) / 32768.0f - 1.0f;
    }
    CK(cuMemcpyHtoD(X, x.data(), x.size() * 4));
    const size_t ny = gemm ? rows * c.n_out : (size_t)16 * c.n_out * c.experts;
    std::vector<unsigned> a(ny), b(ny);
    int rsmem = 0;
    CUfunction g = kernel_of(ref, c.format, c.nb, &rsmem);
    CK(cuMemsetD8(Y, 0, ny * 4));
    launch(f, smem);  // (the split kernels re-arm their counters: they are zero again)
    CK(cuMemcpyDtoH(a.data(), Y, ny * 4));
    CK(cuMemsetD8(Y, 0, ny * 4));
    launch(g, rsmem);
    CK(cuMemcpyDtoH(b.data(), Y, ny * 4));
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < ny; i++) {
        const bool nan_a = (a[i] & 0x7fffffffu) > 0x7f800000u, nan_b = (b[i] & 0x7fffffffu) > 0x7f800000u;
        if (a[i] != b[i] && !(nan_a && nan_b)) {
            if (!bad) {
                first = i;
            }
            bad++;
        }
    }
    if (bad) {
        printf("  check vs %s: %zu of %zu outputs differ (first at %zu: %08x vs %08x)\n", ref, bad, ny, first,
               a[first], b[first]);
    } else {
        printf("  check vs %s: equal bit for bit\n", ref);
    }
}

static void run(const Config& c) {
    int smem = 0;
    CUfunction f = kernel_of(c.module, c.format, c.nb, &smem);
    int regs = 0;
    CK(cuFuncGetAttribute(&regs, CU_FUNC_ATTRIBUTE_NUM_REGS, f));

    const bool gemm = is_gemm(c.format);
    const long long row_bytes = c.n_in / c.block_elems * c.block_bytes;
    const long long mat = row_bytes * c.n_out;
    // Matrices a launch reads (a gemm line's descriptors share one) and rows of x and y.
    const int mats = gemm ? 1 : c.experts;
    const long long xrows = gemm ? (long long)c.nb * c.experts : 16;
    // LAB_COPIES=k: k copies instead (1: every launch reads the same matrix, from L2 when it
    // fits: what a product gains when its weights were fetched ahead).
    const char* ncopies = getenv("LAB_COPIES");
    const int copies = ncopies && atoi(ncopies) > 0 ? atoi(ncopies) : (int)((400ll << 20) / (mat * mats)) + 1;
    const int rows_per_block = 4 / c.group * c.rows_per_warp;
    const int row_blocks = (int)((c.n_out + rows_per_block - 1) / rows_per_block);
    const int tiles = (int)((c.n_in + c.tile - 1) / c.tile);
    // LAB_SLICES=k: k input slices (at most one per tile) instead of the host's choice.
    const char* force = getenv("LAB_SLICES");
    int slices = gemm ? gemm_slices(c.n_out, c.n_in) : slice_count(row_blocks, tiles, c.group, c.rows_per_warp);
    if (force && atoi(force) > 0) {
        const int per = (tiles + atoi(force) - 1) / atoi(force);
        slices = (tiles + per - 1) / per;
    }
    const int blocks = row_blocks * slices * c.experts;

    CUdeviceptr W, X, Y, P, C, T;
    CK(cuMemAlloc(&W, mat * mats * copies));
    fill_random(W, (size_t)(mat * mats * copies));
    CK(cuMemAlloc(&X, 4ll * xrows * c.n_in));
    CK(cuMemsetD8(X, 0, 4ll * xrows * c.n_in));
    CK(cuMemAlloc(&Y, 4ll * 16 * c.n_out * c.experts + 4ll * xrows * c.n_out));
    CK(cuMemAlloc(&P, 4ll * slices * 16 * c.n_out * c.experts + 4ll * slices * xrows * c.n_out + 16));
    CK(cuMemAlloc(&C, 4ll * row_blocks * c.experts + 16));
    CK(cuMemsetD8(C, 0, 4ll * row_blocks * c.experts + 16));
    std::vector<char> table((size_t)c.desc_bytes * c.experts * copies);
    for (int cp = 0; cp < copies; cp++) {
        for (int e = 0; e < c.experts; e++) {
            Desc d;
            memset(&d, 0, sizeof d);
            d.w = W + (unsigned long long)(cp * mats + (gemm ? 0 : e)) * mat;
            d.x = X + (gemm ? 4ull * e * c.nb * c.n_in : 0);
            d.y = Y + 4ull * e * c.nb * c.n_out;
            d.part = P + 4ull * e * slices * c.nb * c.n_out;
            d.row_bytes = row_bytes;
            d.n_out = (int)c.n_out;
            d.n_in = (int)c.n_in;
            d.n = c.nb;
            d.slices = slices;
            d.block_start = e * row_blocks * slices;
            d.counter = e * row_blocks;
            d.group = c.group;
            d.y_stride = (int)c.n_out;
            d.warp_rows = c.rows_per_warp;
            memcpy(&table[(size_t)(cp * c.experts + e) * c.desc_bytes], &d, c.desc_bytes);
        }
    }
    CK(cuMemAlloc(&T, table.size()));
    CK(cuMemcpyHtoD(T, table.data(), table.size()));

    auto launch = [&](int i) {
        CUdeviceptr t = T + (size_t)(i % copies) * c.experts * c.desc_bytes;
        int count = c.experts;
        int early = 0;  // (older cubins without the parameter ignore it)
        void* args[] = {&t, &count, &C, &early};
        CK(cuLaunchKernel(f, blocks, 1, 1, 128, 1, 1, smem, 0, args, 0));
    };
    const double us = lab_us_per_launch(launch, 20, 200);
    printf("%-24s %-8s nb=%-2d %6lldx%-6lld x%-2d G=%d rpw=%d regs=%3d blocks=%6d slices=%2d %8.2f us %6.0f GB/s",
           c.module, c.format, c.nb, c.n_out, c.n_in, c.experts, c.group, c.rows_per_warp, regs, blocks, slices, us,
           mat * mats / us / 1e3);
    if (gemm) {
        printf(" %6.1f T/s smem=%d", 2.0 * c.n_out * c.n_in * xrows / us / 1e6, smem);
    }
    printf("\n");
    if (const char* ref = getenv("LAB_CHECK")) {
        auto once = [&](CUfunction g, int gsmem) {
            CUdeviceptr t = T;
            int count = c.experts;
            int early = 0;
            void* args[] = {&t, &count, &C, &early};
            CK(cuLaunchKernel(g, blocks, 1, 1, 128, 1, 1, gsmem, 0, args, 0));
        };
        check(c, ref, X, Y, once, f, smem);
    }
    fflush(stdout);
    cuMemFree(W);
    cuMemFree(X);
    cuMemFree(Y);
    cuMemFree(P);
    cuMemFree(C);
    cuMemFree(T);
}

int main() {
    lab_init();
    Config c;
    while (scanf("%255s %d %31s %d %lld %lld %d %d %d %d %d %d", c.module, &c.desc_bytes, c.format, &c.nb, &c.n_out,
                 &c.n_in, &c.group, &c.rows_per_warp, &c.tile, &c.block_elems, &c.block_bytes, &c.experts) == 12) {
        run(c);
    }
    return 0;
}
