// Q4_K: super-blocks of 256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit
// scales and mins, 128 bytes of nibbles. Weights 64j..64j+31 are the low nibbles of
// qs[32j..32j+32] (sub-block 2j), weights 64j+32..64j+63 their high nibbles (sub-block
// 2j+1); w = (d * sc) * q - dmin * m (rust/engine/quant/q4_k.rs). A group of 4 elements is 4
// quant bytes at a 4-byte aligned tile offset.

struct FmtQ4_K {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int BLOCK_BYTES = 144;
    static constexpr int TILE_ELEMS = 2048;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const u8* b = t + 144 * (g >> 6);
        const int ie = 4 * (g & 63);  // element in the block
        const int j = ie >> 6;
        const int hi = (ie >> 5) & 1;
        const int is = 2 * j + hi;  // sub-block
        const u8* s = b + 4;
        u32 sc, m;
        // ggml's get_scale_min_k4.
        if (is < 4) {
            sc = s[is] & 63u;
            m = s[is + 4] & 63u;
        } else {
            sc = (s[is + 4] & 0x0fu) | ((u32)(s[is - 4] >> 6) << 4);
            m = (u32)(s[is + 4] >> 4) | ((u32)(s[is] >> 6) << 4);
        }
        const float dl = f16_bits_to_f32(ld_u16(b)) * u8f(sc);
        const float ml = f16_bits_to_f32(ld_u16(b + 2)) * u8f(m);
        u32 q = ld_u32_a4(b + 16 + 32 * j + (ie & 31));
        if (hi) {
            q >>= 4;
        }
        return make_float4(dl * u8f(q & 15u) - ml, dl * u8f((q >> 8) & 15u) - ml, dl * u8f((q >> 16) & 15u) - ml,
                           dl * u8f((q >> 24) & 15u) - ml);
    }
};

MV_KERNELS(q4_k, FmtQ4_K)
