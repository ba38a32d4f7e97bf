// Q8_0: blocks of 32 weights, 34 bytes: an f16 scale d, then 32 signed bytes q; w = q * d
// (the order of rust/engine/quant/q8_0.rs). A group of 4 elements is 4 quant bytes of one
// block, at a 2-byte aligned tile offset.

struct FmtQ8_0 {
    static constexpr int BLOCK_ELEMS = 32;
    static constexpr int BLOCK_BYTES = 34;
    static constexpr int TILE_ELEMS = 1024;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const u8* b = t + 34 * (g >> 3);
        const float d = f16_bits_to_f32(ld_u16(b));
        const u32 q = ld_u32_a2(b + 2 + 4 * (g & 7));
        return make_float4(s8f(q & 0xffu) * d, s8f((q >> 8) & 0xffu) * d, s8f((q >> 16) & 0xffu) * d, s8f(q >> 24) * d);
    }
};

MV_KERNELS(q8_0, FmtQ8_0)
