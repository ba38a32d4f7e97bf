// IQ2_XXS: super-blocks of 256 weights, 66 bytes: f16 d, then 8 groups of 32 weights, each
// two little-endian u32 words. Word 0 holds four 8-bit indices into the lattice
// `iq2xxs_grid` (8 coordinates each); word 1 four 7-bit sign indices (bits 0..28) and a 4-bit
// scale s (bits 28..32). db = d * (0.5 + s) * 0.25; w = +-db * grid coordinate
// (rust/engine/quant/iq2_xxs.rs). The sign table ksigns_iq2xs is `i | parity(i) << 7`,
// computed here with popc. `iq2xxs_grid` is emitted by the host from quant/tables.rs into
// the program, before this file; each block copies it to shared memory (random per-lane
// indices into constant memory would serialize, and into global memory touch many lines).
//
// A lane's unit is one group of 32 weights: its scale is converted once and its four grid
// rows fetched once. The tile (4 super-blocks, 264 bytes) is staged in 8-byte loads: 264 is
// not a multiple of 16.

struct FmtIQ2_XXS {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int BLOCK_BYTES = 66;
    static constexpr int UNIT = 32;
    static constexpr int VEC = 8;
    static constexpr int LUT_BYTES = 256 * 8;

    static __device__ __forceinline__ void init_lut(u8* smem, int tid) {
        for (int i = tid; i < 256; i += 32 * MV_WARPS) {
            ((u64*)smem)[i] = iq2xxs_grid[i];
        }
    }

    struct Unit {
        float db;
        u32 sg;    // the 8 sign bits of each 8-weight part, in bytes 0..3
        u64 g[4];  // the grid rows of the 4 parts
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& st, const u8* lut) {
        const u8* b = t + 66 * (u >> 3);
        const u8* q = b + 2 + 8 * (u & 7);
        const u32 aux0 = ld_u32_a2(q);
        const u32 aux1 = ld_u32_a2(q + 4);
        st.db = f16_bits_to_f32(ld_u16(b)) * (0.5f + u8f(aux1 >> 28)) * 0.25f;
        u32 sg = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 si = (aux1 >> (7 * k)) & 127u;
            sg |= (si | ((__popc(si) & 1u) << 7)) << (8 * k);
            st.g[k] = ((const u64*)lut)[(aux0 >> (8 * k)) & 0xffu];
        }
        st.sg = sg;
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        const int k = j >> 1;
        const int half = j & 1;
        const u32 coords = (u32)(s.g[k] >> (32 * half));
        const int b0 = 8 * k + 4 * half;  // sign bit of the chunk's first weight
        float w[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const float a = s.db * byte_f(coords, i);
            w[i] = __uint_as_float(__float_as_uint(a) ^ ((s.sg << (31 - (b0 + i))) & 0x80000000u));
        }
        return make_float4(w[0], w[1], w[2], w[3]);
    }
};

MV_KERNELS(iq2_xxs, FmtIQ2_XXS)
