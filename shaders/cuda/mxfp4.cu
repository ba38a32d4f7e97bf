// MXFP4: blocks of 32 E2M1 weights, 17 bytes: an E8M0 exponent e, then 16 bytes whose low
// nibbles are weights 0..15 and high nibbles weights 16..31; w = kvalue(nibble) * 2^(e-128)
// (rust/engine/quant/mxfp4.rs). kvalue is the doubled E2M1 value, computed here from its bits
// rather than looked up (a 16-entry table indexed per lane would serialize in constant memory).

__device__ __forceinline__ float mxfp4_kvalue(u32 nib) {
    const int e = (nib >> 1) & 3;
    const int m = nib & 1;
    const int mag = e == 0 ? m : (1 << e) + m * (1 << (e - 1));
    const float f = u8f((u32)mag);
    return (nib & 8) ? 0.0f - f : f;
}

// 2^(e-128) as ggml_e8m0_to_fp32_half builds it (subnormal patterns for e < 2).
__device__ __forceinline__ float e8m0_to_fp32_half(u32 e) {
    return __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
}

struct FmtMXFP4 {
    static constexpr int BLOCK_ELEMS = 32;
    static constexpr int BLOCK_BYTES = 17;
    static constexpr int TILE_ELEMS = 2048;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const u8* b = t + 17 * (g >> 3);
        const float d = e8m0_to_fp32_half(b[0]);
        const int j = 4 * (g & 7);  // first element of the group in the block
        const u8* q = b + 1 + (j & 15);
        const int shift = j < 16 ? 0 : 4;
        return make_float4(d * mxfp4_kvalue((q[0] >> shift) & 15u), d * mxfp4_kvalue((q[1] >> shift) & 15u),
                           d * mxfp4_kvalue((q[2] >> shift) & 15u), d * mxfp4_kvalue((q[3] >> shift) & 15u));
    }
};

MV_KERNELS(mxfp4, FmtMXFP4)
