// Q4_K: super-blocks of 256 weights, 144 bytes: f16 d, f16 dmin, 12 bytes of packed 6-bit
// scales and mins, 128 bytes of nibbles. Weights 64j..64j+31 are the low nibbles of
// qs[32j..32j+32] (sub-block 2j), weights 64j+32..64j+63 their high nibbles (sub-block
// 2j+1); w = (d * sc) * q - dmin * m (rust/engine/quant/q4_k.rs). A lane's unit is one
// sub-block of 32 weights: one scale and min, 32 nibbles of 8 aligned words.

struct FmtQ4_K {
    static constexpr int BLOCK_ELEMS = 256;
    static constexpr int BLOCK_BYTES = 144;
    static constexpr int UNIT = 32;
    static constexpr int VEC = 16;
    MV_NO_LUT

    struct Unit {
        float dl, ml;
        u32 q[8];  // nibbles of the sub-block in the low half of each byte
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& st, const u8*) {
        const u8* b = t + 144 * (u >> 3);
        const int is = u & 7;  // sub-block
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
        st.dl = f16_bits_to_f32(ld_u16(b)) * u8f(sc);
        st.ml = 0.0f - f16_bits_to_f32(ld_u16(b + 2)) * u8f(m);
        const uint4* q = (const uint4*)(b + 16 + 32 * (is >> 1));
        const int sh = 4 * (is & 1);
        const uint4 a = q[0], c = q[1];
        st.q[0] = (a.x >> sh) & 0x0f0f0f0fu;
        st.q[1] = (a.y >> sh) & 0x0f0f0f0fu;
        st.q[2] = (a.z >> sh) & 0x0f0f0f0fu;
        st.q[3] = (a.w >> sh) & 0x0f0f0f0fu;
        st.q[4] = (c.x >> sh) & 0x0f0f0f0fu;
        st.q[5] = (c.y >> sh) & 0x0f0f0f0fu;
        st.q[6] = (c.z >> sh) & 0x0f0f0f0fu;
        st.q[7] = (c.w >> sh) & 0x0f0f0f0fu;
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        const u32 q = s.q[j];
        return make_float4(fmaf(s.dl, byte_f(q, 0), s.ml), fmaf(s.dl, byte_f(q, 1), s.ml),
                           fmaf(s.dl, byte_f(q, 2), s.ml), fmaf(s.dl, byte_f(q, 3), s.ml));
    }
};

MV_KERNELS(q4_k, FmtQ4_K)
