// Q8_0: blocks of 32 weights, 34 bytes: an f16 scale d, then 32 signed bytes q; w = q * d
// (the order of rust/engine/quant/q8_0.rs). A lane's unit is one block, at a 2-byte aligned
// tile offset: its scale is converted once, its 32 bytes read as 16 halfwords.

struct FmtQ8_0 {
    static constexpr int BLOCK_ELEMS = 32;
    static constexpr int BLOCK_BYTES = 34;
    static constexpr int UNIT = 32;
    static constexpr int VEC = 16;
    MV_NO_LUT

    struct Unit {
        float d;
        u32 q[8];  // the quant words, each byte's sign bit flipped (see sbyte_f)
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& s, const u8*) {
        const u8* b = t + 34 * u;
        s.d = f16_bits_to_f32(ld_u16(b));
#pragma unroll
        for (int i = 0; i < 8; i++) {
            s.q[i] = ld_u32_a2(b + 2 + 4 * i) ^ 0x80808080u;
        }
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        const u32 q = s.q[j];
        return make_float4(sbyte_f(q, 0) * s.d, sbyte_f(q, 1) * s.d, sbyte_f(q, 2) * s.d, sbyte_f(q, 3) * s.d);
    }
};

MV_KERNELS(q8_0, FmtQ8_0)
