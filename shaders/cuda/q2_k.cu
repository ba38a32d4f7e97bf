// Q2_K: super-blocks of 256 weights, 84 bytes in GGUF: 16 scale bytes (scale in the low
// nibble, min in the high nibble), 64 bytes of 2-bit quants qs, then f16 d and f16 dmin.
// Weight 128 h + 32 s + l is (qs[32 h + l] >> 2 s) & 3 with scale byte 8 h + 2 s + (l >= 16);
// w = (d * sc) * q - dmin * m (rust/engine/quant/q2_k.rs).
//
// On the device rows are split (rust/engine/quant/split/): the qs of all super-blocks, then
// per super-block 20 header bytes: the scale bytes reordered so that byte 8 h + 4 f + s is
// the scale of half h, shift s, quants 16 f..16 f + 16, then d and dmin. Lane l's 16 bytes of
// chunk c are qs[16 (l & 3)..] of super-block 8 c + l / 4: half h = (l & 3) / 2, quants
// 16 f.. with f = l & 1, all four shifts: 64 weights, four scales (one 32-bit word).
//
// x comes as 8-bit activations (rust/engine/quant/act8.rs; the layout as in iq2_xxs.cu): every
// writer of a Q2_K product's input quantizes it (the host for its products, ds4_swiglu for the
// routed experts' down). Per shift the lane's 16 weights are one sub-block, inside one
// activation block of scale dx: with sq = sum(q * x8) and sx = sum(x8) (dp4a, exact),
// acc = fmaf(dx, dl * sq - ml * sx, acc), dl = d * scale and ml = dmin * min. With float x this
// kernel was bound by L1 (a lane's float4 of x per 4 weights, the warp's 32 of them on 32
// lines) and by the byte-to-float conversions: six 4096 x 2048 products took 23.2 us at one
// batch row on an H200.

struct FmtQ2_K {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int PAY = 64;
    static constexpr int CB = 8;
    MV_NO_LUT

    // Rows of expert products are short (one or two chunks): more resident warps pay more
    // than holding the next chunk (a Q2_K chunk and its headers are 6 registers per row).
    static constexpr int PREFETCH = 0;

    struct Chunk {
        uint4 v;
        u32 sc;  // the four scale bytes of the lane's half and quants, shift s in byte s
        u32 dd;  // the f16 bits of d (low half) and dmin (high half)
    };

    static __device__ __forceinline__ void load(const u8* row, int nb, int c, int lane, bool vec, Chunk& h) {
        const long long pay = (long long)nb * PAY;
        ld_lane16(row, pay, c, lane, vec, h.v);
        if (mv_lane_in(pay, c, lane)) {
            const u8* hp = row + pay + 20ll * (CB * c + (lane >> 2));
            h.sc = ld_u32_a2(hp + 8 * ((lane & 3) >> 1) + 4 * (lane & 1));
            h.dd = ld_u32_a2(hp + 16);
        }
    }

    template <int NB>
    static __device__ __forceinline__ void dot(const Chunk (&hh)[MV_ROWS], int nb, int c, int lane,
                                               const float* __restrict__ x, int n_in, int n,
                                               float (&acc)[MV_ROWS][NB], const u8*) {
        if (!mv_lane_in((long long)nb * PAY, c, lane)) {
            return;
        }
        const int sb = CB * c + (lane >> 2);
        // The lane's elements: e0 + 32 s + 0..15 for shift s, in activation block 8 sb + 4 h + s.
        const int e0 = 256 * sb + 128 * ((lane & 3) >> 1) + 16 * (lane & 1);
        float dl[MV_ROWS][4], ml[MV_ROWS][4];
#pragma unroll
        for (int q = 0; q < MV_ROWS; q++) {
            const float d = f16_bits_to_f32(hh[q].dd & 0xffffu);
            const float dmin = f16_bits_to_f32(hh[q].dd >> 16);
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const u32 b = (hh[q].sc >> (8 * s)) & 0xffu;
                dl[q][s] = d * u8f(b & 15u);
                ml[q][s] = dmin * u8f(b >> 4);
            }
        }
        // One batch row at a time, so that only its activations are live (at 8 rows the
        // kernel stays inside the register cap); each acc[q][r] still takes its four shifts in
        // order, whatever NB (row invariance). (Tried and dropped: the two-row kernel loading
        // both rows' activations before either row's dp4a chains, the same bits; it spilled,
        // and Flash verifies were slower.) (Measurements: scripts/kernel_lab/HISTORY.md,
        // "q2_k.cu: FmtQ2_K::dot".)
#pragma unroll
        for (int r = 0; r < NB; r++) {
            if (r < n) {
                const char* xr = (const char*)(x + (long long)r * n_in);
                const float4 dx = __ldg((const float4*)(xr + n_in) + (e0 >> 7));
                int4 xv[4];
                int sx[4];
#pragma unroll
                for (int s = 0; s < 4; s++) {
                    xv[s] = __ldg((const int4*)(xr + e0 + 32 * s));
                    int t = __dp4a(0x01010101, xv[s].x, 0);
                    t = __dp4a(0x01010101, xv[s].y, t);
                    t = __dp4a(0x01010101, xv[s].z, t);
                    sx[s] = __dp4a(0x01010101, xv[s].w, t);
                }
#pragma unroll
                for (int q = 0; q < MV_ROWS; q++) {
#pragma unroll
                    for (int s = 0; s < 4; s++) {
                        int sq = __dp4a((int)((hh[q].v.x >> (2 * s)) & 0x03030303u), xv[s].x, 0);
                        sq = __dp4a((int)((hh[q].v.y >> (2 * s)) & 0x03030303u), xv[s].y, sq);
                        sq = __dp4a((int)((hh[q].v.z >> (2 * s)) & 0x03030303u), xv[s].z, sq);
                        sq = __dp4a((int)((hh[q].v.w >> (2 * s)) & 0x03030303u), xv[s].w, sq);
                        const float dxs = s == 0 ? dx.x : s == 1 ? dx.y : s == 2 ? dx.z : dx.w;
                        const float t = dl[q][s] * (float)sq - ml[q][s] * (float)sx[s];
                        acc[q][r] = fmaf(dxs, t, acc[q][r]);
                    }
                }
            }
        }
    }
};

// At one batch row, six resident blocks a SM instead of four (80 registers, a few bytes of
// spills): an expert's row is one chunk, so each warp loads once, computes once and exits,
// and more warps in flight pay more than registers. On an H200, six 4096 x 2048 products (the
// routed down, pseudo-random weights): 16.2 -> 14.8 us, the same bits. At two or more rows
// the cap costs more than it gains (20.0 -> 21.8 us at two), and eight blocks lose at one
// row too (16.5 us).
template <>
struct MvMinBlocks<FmtQ2_K, 1> {
    static constexpr int value = 6;
};

MVS_KERNELS(q2_k, FmtQ2_K)
