// IQ2_XXS: super-blocks of 256 weights, 66 bytes: f16 d, then 8 groups of 32 weights, each
// two little-endian u32 words. Word 0 holds four 8-bit indices into the lattice
// `iq2xxs_grid` (8 coordinates each); word 1 four 7-bit sign indices (bits 0..28) and a 4-bit
// scale s (bits 28..32). db = d * (0.5 + s) * 0.25; w = +-db * grid coordinate
// (rust/engine/quant/iq2_xxs.rs). The sign table ksigns_iq2xs is `i | parity(i) << 7`,
// computed here with popc. `iq2xxs_grid` is emitted by the host from quant/tables.rs into
// the program, before this file.

struct FmtIQ2_XXS {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int BLOCK_BYTES = 66;
    static constexpr int TILE_ELEMS = 4096;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const u8* b = t + 66 * (g >> 6);
        const int ie = 4 * (g & 63);
        const int grp = ie >> 5;       // group of 32
        const int k = (ie >> 3) & 3;   // 8-weight part of the group
        const int half = (ie >> 2) & 1;  // which 4 of the 8
        const u8* q = b + 2 + 8 * grp;
        const u32 aux0 = ld_u32_a2(q);
        const u32 aux1 = ld_u32_a2(q + 4);
        const float db = f16_bits_to_f32(ld_u16(b)) * (0.5f + u8f(aux1 >> 28)) * 0.25f;
        const u64 grid = __ldg(&iq2xxs_grid[(aux0 >> (8 * k)) & 0xffu]);
        const u32 coords = (u32)(grid >> (32 * half));
        const u32 si = (aux1 >> (7 * k)) & 127u;
        const u32 signs = (si | ((__popc(si) & 1u) << 7)) >> (4 * half);
        const float w0 = db * u8f(coords & 0xffu);
        const float w1 = db * u8f((coords >> 8) & 0xffu);
        const float w2 = db * u8f((coords >> 16) & 0xffu);
        const float w3 = db * u8f(coords >> 24);
        return make_float4(signs & 1u ? -w0 : w0, signs & 2u ? -w1 : w1, signs & 4u ? -w2 : w2,
                           signs & 8u ? -w3 : w3);
    }
};

MV_KERNELS(iq2_xxs, FmtIQ2_XXS)
