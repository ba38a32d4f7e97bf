// Q2_K: super-blocks of 256 weights, 84 bytes: 16 scale bytes (scale in the low nibble, min
// in the high nibble), 64 bytes of 2-bit quants, then f16 d and f16 dmin. Weight
// 128h + 32s + l is (qs[32h + l] >> 2s) & 3 with scale byte 8h + 2s + (l >= 16);
// w = (d * sc) * q - dmin * m (rust/engine/quant/q2_k.rs). A lane's unit is the 32 weights
// of one (h, s): two scale bytes, and the 32 aligned quant bytes of qs[32h..] shifted by 2s.

struct FmtQ2_K {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int BLOCK_BYTES = 84;
    static constexpr int UNIT = 32;
    static constexpr int VEC = 16;
    MV_NO_LUT

    struct Unit {
        float dl[2], ml[2];
        u32 q[8];
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& st, const u8*) {
        const u8* b = t + 84 * (u >> 3);
        const int m = u & 7;  // 4h + s
        const int h = m >> 2;
        const int s = m & 3;
        const float d = f16_bits_to_f32(ld_u16(b + 80));
        const float dmin = f16_bits_to_f32(ld_u16(b + 82));
        const u32 sc = ld_u16(b + 8 * h + 2 * s);
        st.dl[0] = d * u8f(sc & 15u);
        st.ml[0] = 0.0f - dmin * u8f((sc >> 4) & 15u);
        st.dl[1] = d * u8f((sc >> 8) & 15u);
        st.ml[1] = 0.0f - dmin * u8f(sc >> 12);
        const u8* q = b + 16 + 32 * h;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            st.q[i] = (ld_u32_a4(q + 4 * i) >> (2 * s)) & 0x03030303u;
        }
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        const u32 q = s.q[j];
        const float dl = s.dl[j >> 2];
        const float ml = s.ml[j >> 2];
        return make_float4(fmaf(dl, byte_f(q, 0), ml), fmaf(dl, byte_f(q, 1), ml), fmaf(dl, byte_f(q, 2), ml),
                           fmaf(dl, byte_f(q, 3), ml));
    }
};

MV_KERNELS(q2_k, FmtQ2_K)
