// Q2_K: super-blocks of 256 weights, 84 bytes: 16 scale bytes (scale in the low nibble, min
// in the high nibble), 64 bytes of 2-bit quants, then f16 d and f16 dmin. Weight
// 128h + 32s + l is (qs[32h + l] >> 2s) & 3 with scale byte 8h + 2s + (l >= 16);
// w = (d * sc) * q - dmin * m (rust/engine/quant/q2_k.rs). A group of 4 elements is 4 quant
// bytes at a 4-byte aligned tile offset, all in one sub-block.

struct FmtQ2_K {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int BLOCK_BYTES = 84;
    static constexpr int TILE_ELEMS = 4096;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const u8* b = t + 84 * (g >> 6);
        const int ie = 4 * (g & 63);
        const int h = ie >> 7;
        const int s = (ie >> 5) & 3;
        const int l = ie & 31;
        const u32 sc = b[8 * h + 2 * s + (l >> 4)];
        const float dl = f16_bits_to_f32(ld_u16(b + 80)) * u8f(sc & 15u);
        const float ml = f16_bits_to_f32(ld_u16(b + 82)) * u8f(sc >> 4);
        const u32 q = ld_u32_a4(b + 16 + 32 * h + l) >> (2 * s);
        return make_float4(dl * u8f(q & 3u) - ml, dl * u8f((q >> 8) & 3u) - ml, dl * u8f((q >> 16) & 3u) - ml,
                           dl * u8f((q >> 24) & 3u) - ml);
    }
};

MV_KERNELS(q2_k, FmtQ2_K)
