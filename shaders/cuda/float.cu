// F32, F16 and BF16 weights: plain little-endian floats, one element per "block". A lane's
// unit is 8 consecutive elements: 32 bytes (F32) or 16 bytes (F16, BF16) at an aligned tile
// offset. A row whose length is not a multiple of 8 ends in a partial unit (the kernel only
// reads its first n_in % 8 elements, in chunks of 4).

struct FmtF32 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int BLOCK_BYTES = 4;
    static constexpr int UNIT = 8;
    static constexpr int VEC = 16;
    MV_NO_LUT

    struct Unit {
        float4 v[2];
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& s, const u8*) {
        s.v[0] = *(const float4*)(t + 32 * u);
        s.v[1] = *(const float4*)(t + 32 * u + 16);
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        return s.v[j];
    }
};

struct FmtF16 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int BLOCK_BYTES = 2;
    static constexpr int UNIT = 8;
    static constexpr int VEC = 16;
    MV_NO_LUT

    struct Unit {
        uint4 h;
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& s, const u8*) {
        s.h = *(const uint4*)(t + 16 * u);
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        const u32 a = j == 0 ? s.h.x : s.h.z;
        const u32 b = j == 0 ? s.h.y : s.h.w;
        return make_float4(f16_bits_to_f32(a & 0xffffu), f16_bits_to_f32(a >> 16), f16_bits_to_f32(b & 0xffffu),
                           f16_bits_to_f32(b >> 16));
    }
};

struct FmtBF16 {
    static constexpr int BLOCK_ELEMS = 1;
    static constexpr int BLOCK_BYTES = 2;
    static constexpr int UNIT = 8;
    static constexpr int VEC = 16;
    MV_NO_LUT

    struct Unit {
        uint4 h;
    };

    static __device__ __forceinline__ void load(const u8* t, int u, Unit& s, const u8*) {
        s.h = *(const uint4*)(t + 16 * u);
    }

    static __device__ __forceinline__ float4 get(const Unit& s, int j, const u8*) {
        const u32 a = j == 0 ? s.h.x : s.h.z;
        const u32 b = j == 0 ? s.h.y : s.h.w;
        return make_float4(__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u), __uint_as_float(b << 16),
                           __uint_as_float(b & 0xffff0000u));
    }
};

MV_KERNELS(f32, FmtF32)
MV_KERNELS(f16, FmtF16)
MV_KERNELS(bf16, FmtBF16)
