// MXFP4: blocks of 32 E2M1 weights, 17 bytes: an E8M0 exponent e, then 16 bytes whose low
// nibbles are weights 0..15 and high nibbles weights 16..31; w = kvalue(nibble) * 2^(e-128)
// (rust/engine/quant/mxfp4.rs). kvalue, the doubled E2M1 value, is a 16-float table in shared
// memory: 16 words in 16 distinct banks, so any pattern of lookups is conflict-free. A lane's
// unit is one block (at an odd tile offset: read bytewise once).

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
    static constexpr int UNIT = 32;
    static constexpr int VEC = 16;
    static constexpr int LUT_BYTES = 64;

    static __device__ __forceinline__ void init_lut(u8* smem, int tid) {
        if (tid < 16) {
            ((float*)smem)[tid] = mxfp4_kvalue((u32)tid);
        }
    }

    struct Unit {
        float d;
        u32 q[4];
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& s, const u8*) {
        const u8* b = t + 17 * u;
        s.d = e8m0_to_fp32_half(b[0]);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            s.q[i] = ld_u32_a1(b + 1 + 4 * i);
        }
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8* lut) {
        const float* kv = (const float*)lut;
        const u32 q = s.q[j & 3] >> (j < 4 ? 0 : 4);
        return make_float4(s.d * kv[q & 15u], s.d * kv[(q >> 8) & 15u], s.d * kv[(q >> 16) & 15u],
                           s.d * kv[(q >> 24) & 15u]);
    }
};

MV_KERNELS(mxfp4, FmtMXFP4)
