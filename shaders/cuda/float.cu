// F32, F16 and BF16 weights: plain little-endian floats, one element per "block". A group of
// 4 elements is 16 (F32) or 8 (F16, BF16) bytes at a 16- or 8-byte aligned tile offset.

struct FmtF32 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int BLOCK_BYTES = 4;
    static constexpr int TILE_ELEMS = 256;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        return *(const float4*)(t + 16 * g);
    }
};

struct FmtF16 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int BLOCK_BYTES = 2;
    static constexpr int TILE_ELEMS = 512;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const uint2 h = *(const uint2*)(t + 8 * g);
        return make_float4(f16_bits_to_f32(h.x & 0xffffu), f16_bits_to_f32(h.x >> 16), f16_bits_to_f32(h.y & 0xffffu),
                           f16_bits_to_f32(h.y >> 16));
    }
};

struct FmtBF16 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int BLOCK_BYTES = 2;
    static constexpr int TILE_ELEMS = 512;

    static __device__ __forceinline__ float4 dequant4(const u8* t, int g) {
        const uint2 h = *(const uint2*)(t + 8 * g);
        return make_float4(bf16_bits_to_f32(h.x & 0xffffu), bf16_bits_to_f32(h.x >> 16),
                           bf16_bits_to_f32(h.y & 0xffffu), bf16_bits_to_f32(h.y >> 16));
    }
};

MV_KERNELS(f32, FmtF32)
MV_KERNELS(f16, FmtF16)
MV_KERNELS(bf16, FmtBF16)
