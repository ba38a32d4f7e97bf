//! Plain float formats: F32, F16 and BF16 (one element per "block"), and the f16/bf16
//! conversions, bit-identical to numpy (`astype(np.float16)` / `astype(np.float32)`) and to
//! gguf-py's BF16 quantizer.

use super::{dot_via_dequant, BlockFormat, GgmlType};

// ---------------------------------------------------------------------------------------
// Scalar conversions (the definitions; the SIMD paths must agree with them bit for bit).

/// f16 bits -> f32, as numpy's `npy_halfbits_to_floatbits`: exact; NaN payloads are shifted
/// into place, never quieted.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h & 0x8000) as u32) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = (h & 0x3ff) as u32;
    let bits = match exp {
        0x1f => sign | 0x7f80_0000 | (man << 13),
        0 => {
            // Zero or subnormal: man * 2^-24, exact in f32.
            sign | (man as f32 * (1.0 / 16_777_216.0)).to_bits()
        }
        _ => sign | ((exp as u32 + 112) << 23) | (man << 13),
    };
    f32::from_bits(bits)
}

/// f32 -> f16 bits, as numpy's `npy_floatbits_to_halfbits`: round to nearest even,
/// overflow to infinity, NaN -> NaN with the top 10 payload bits (forced non-zero).
#[inline(always)]
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    let f = x.to_bits();
    let sign = ((f >> 16) & 0x8000) as u16;
    let a = f & 0x7fff_ffff;
    if a > 0x7f80_0000 {
        let m = ((a & 0x007f_ffff) >> 13) as u16;
        return sign | 0x7c00 | if m == 0 { 1 } else { m };
    }
    if a >= 0x4780_0000 {
        // >= 65536 (or infinity): infinity.
        return sign | 0x7c00;
    }
    if a >= 0x3880_0000 {
        // Normal half range [2^-14, 65536): rebias the exponent, round the mantissa to 10
        // bits (a carry into the exponent, up to infinity, is the right answer).
        let m = a - (112 << 23);
        return sign | ((m + 0x0fff + ((m >> 13) & 1)) >> 13) as u16;
    }
    if a < 0x3300_0000 {
        // Below 2^-25: rounds to zero.
        return sign;
    }
    // Subnormal half: value = mant * 2^(e-150); in units of 2^-24 that is mant >> (126-e).
    let e = a >> 23; // 102..=112
    let mant = (a & 0x007f_ffff) | 0x0080_0000;
    let shift = 126 - e; // 14..=24
    let q = mant >> shift;
    let rem = mant & ((1 << shift) - 1);
    let half = 1 << (shift - 1);
    let q = if rem > half || (rem == half && q & 1 == 1) { q + 1 } else { q };
    sign | q as u16
}

/// f32 -> bf16 bits as gguf-py's `BF16.quantize_blocks` (= ggml's
/// `ggml_compute_fp32_to_bf16`): NaN is quieted keeping the top 16 bits; otherwise round
/// to nearest even.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let mut n = x.to_bits();
    if n & 0x7fff_ffff > 0x7f80_0000 {
        n = (n & 0xffff_0000) | (64 << 16);
    }
    // No overflow: the largest non-NaN input is 0xff80_0000.
    ((n as u64 + (0x7fff + ((n >> 16) & 1)) as u64) >> 16) as u16
}

#[inline(always)]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

// ---------------------------------------------------------------------------------------
// Slice conversions.

pub(crate) fn f16_to_f32_slice(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        let n = src.len().min(dst.len());
        // SAFETY: SIMD features detected; `src` holds `n` u16 = `2n` readable bytes.
        return unsafe { avx2::f16_bytes_to_f32(src.as_ptr().cast(), &mut dst[..n]) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16_to_f32(s);
    }
}

pub(crate) fn f32_to_f16_slice(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: SIMD features detected.
        return unsafe { avx2::f32_to_f16(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_to_f16(s);
    }
}

pub(crate) fn f32_to_bf16_slice(src: &[f32], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if super::simd::available() {
        // SAFETY: SIMD features detected.
        return unsafe { avx2::f32_to_bf16(src, dst) };
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16(s);
    }
}

pub(crate) fn bf16_to_f32_slice(src: &[u16], dst: &mut [f32]) {
    // A shift per element: the compiler vectorizes this well on its own.
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s);
    }
}

// ---------------------------------------------------------------------------------------
// Formats.

pub(crate) struct F32;
pub(crate) struct F16;
pub(crate) struct BF16;

impl BlockFormat for F32 {
    const TYPE: GgmlType = GgmlType::F32;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 4;

    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
        }
    }

    fn dot_scalar(src: &[u8], x: &[f32]) -> f32 {
        dot_via_dequant::<Self>(src, x)
    }

    unsafe fn dot_simd(src: &[u8], x: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller guarantees the SIMD features.
        return unsafe { avx2::dot_f32(src, x) };
        #[cfg(not(target_arch = "x86_64"))]
        Self::dot_scalar(src, x)
    }
}

impl BlockFormat for F16 {
    const TYPE: GgmlType = GgmlType::F16;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 2;

    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *d = f16_to_f32(u16::from_le_bytes([s[0], s[1]]));
        }
    }

    fn dequantize(src: &[u8], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::simd::available() {
            let n = dst.len().min(src.len() / 2);
            // SAFETY: SIMD features detected; `src` has at least `2n` bytes.
            return unsafe { avx2::f16_bytes_to_f32(src.as_ptr(), &mut dst[..n]) };
        }
        Self::dequantize_blocks(src, dst)
    }

    fn dot_scalar(src: &[u8], x: &[f32]) -> f32 {
        dot_via_dequant::<Self>(src, x)
    }

    unsafe fn dot_simd(src: &[u8], x: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if super::simd::avx512() {
            // SAFETY: AVX-512 F/BW detected (and the AVX2 set, which it implies here).
            return unsafe { avx512::dot_f16(src, x) };
        }
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller guarantees the SIMD features.
        return unsafe { avx2::dot_f16(src, x) };
        #[cfg(not(target_arch = "x86_64"))]
        Self::dot_scalar(src, x)
    }
}

impl BlockFormat for BF16 {
    const TYPE: GgmlType = GgmlType::BF16;
    const BLOCK_ELEMS: usize = 1;
    const BLOCK_BYTES: usize = 2;

    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
            *d = bf16_to_f32(u16::from_le_bytes([s[0], s[1]]));
        }
    }

    fn dot_scalar(src: &[u8], x: &[f32]) -> f32 {
        dot_via_dequant::<Self>(src, x)
    }

    unsafe fn dot_simd(src: &[u8], x: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller guarantees the SIMD features.
        return unsafe { avx2::dot_bf16(src, x) };
        #[cfg(not(target_arch = "x86_64"))]
        Self::dot_scalar(src, x)
    }
}

// ---------------------------------------------------------------------------------------
// AVX2 / F16C kernels.

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::x86::*;
    use std::arch::x86_64::*;

    /// Dot of `n = min(src.len() / $esz, x.len())` elements, `$load(p)` giving 8 weights
    /// from byte pointer `p`: 4 accumulators, flushed to f64 every 256 elements; the < 8
    /// trailing elements are added in f64 by `$scalar`. Prefetches the weights ahead
    /// ([`prefetch`]).
    macro_rules! dense_dot {
        ($src:expr, $x:expr, $esz:expr, |$p:ident| $load:expr, |$s:ident| $scalar:expr) => {{
            let src: &[u8] = $src;
            let x: &[f32] = $x;
            let n = (src.len() / $esz).min(x.len());
            let sp = src.as_ptr();
            let xp = x.as_ptr();
            let mut acc64 = Acc64::new();
            let mut i = 0;
            macro_rules! load {
                ($j:expr) => {{
                    let $p = sp.add(($j) * $esz);
                    $load
                }};
            }
            while i + 8 <= n {
                let end = (i + 256).min(n);
                let (mut a0, mut a1, mut a2, mut a3) =
                    (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
                // SAFETY (of the loads below): every group read lies below `end <= n`, so
                // its elements of `src` and `x` are in bounds.
                while i + 32 <= end {
                    let p = sp.add(i * $esz);
                    for c in (0..32 * $esz).step_by(64) {
                        prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_L1 + c));
                        prefetch::<_MM_HINT_T1>(p.wrapping_add(PREFETCH_L2 + c));
                    }
                    a0 = _mm256_fmadd_ps(load!(i), load_ps(xp.add(i)), a0);
                    a1 = _mm256_fmadd_ps(load!(i + 8), load_ps(xp.add(i + 8)), a1);
                    a2 = _mm256_fmadd_ps(load!(i + 16), load_ps(xp.add(i + 16)), a2);
                    a3 = _mm256_fmadd_ps(load!(i + 24), load_ps(xp.add(i + 24)), a3);
                    i += 32;
                }
                while i + 8 <= end {
                    a0 = _mm256_fmadd_ps(load!(i), load_ps(xp.add(i)), a0);
                    i += 8;
                }
                acc64.add(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
            }
            let mut tail = 0f64;
            while i < n {
                let $s = &src[i * $esz..i * $esz + $esz];
                tail += $scalar as f64 * x[i] as f64;
                i += 1;
            }
            (acc64.total() + tail) as f32
        }};
    }

    /// # Safety
    /// AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f32(src: &[u8], x: &[f32]) -> f32 {
        dense_dot!(src, x, 4, |p| _mm256_loadu_ps(p.cast()), |s| { f32::from_le_bytes([s[0], s[1], s[2], s[3]]) })
    }

    /// # Safety
    /// AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(src: &[u8], x: &[f32]) -> f32 {
        dense_dot!(src, x, 2, |p| _mm256_cvtph_ps(_mm_loadu_si128(p.cast())), |s| {
            super::f16_to_f32(u16::from_le_bytes([s[0], s[1]]))
        })
    }

    /// # Safety
    /// AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_bf16(src: &[u8], x: &[f32]) -> f32 {
        dense_dot!(
            src,
            x,
            2,
            |p| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))),
            |s| super::bf16_to_f32(u16::from_le_bytes([s[0], s[1]]))
        )
    }

    /// f16 (little-endian bytes at `src`, `2 * dst.len()` of them) -> f32 with F16C; groups
    /// of 8 that contain a NaN go through the scalar code (F16C quiets NaNs, numpy does not).
    ///
    /// # Safety
    /// SIMD features available; `src..src + 2 * dst.len()` readable.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f16_bytes_to_f32(src: *const u8, dst: &mut [f32]) {
        let n = dst.len();
        let dp = dst.as_mut_ptr();
        let abs_mask = _mm_set1_epi16(0x7fff);
        let inf = _mm_set1_epi16(0x7c00);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n: 16 source bytes readable, 8 destination floats writable.
            let h = _mm_loadu_si128(src.add(2 * i).cast());
            let nan = _mm_cmpgt_epi16(_mm_and_si128(h, abs_mask), inf);
            if _mm_movemask_epi8(nan) == 0 {
                _mm256_storeu_ps(dp.add(i), _mm256_cvtph_ps(h));
            } else {
                for k in i..i + 8 {
                    let b = [*src.add(2 * k), *src.add(2 * k + 1)];
                    *dp.add(k) = super::f16_to_f32(u16::from_le_bytes(b));
                }
            }
            i += 8;
        }
        while i < n {
            // SAFETY: i < n.
            let b = [*src.add(2 * i), *src.add(2 * i + 1)];
            *dp.add(i) = super::f16_to_f32(u16::from_le_bytes(b));
            i += 1;
        }
    }

    /// f32 -> f16 with F16C (round to nearest even), NaN groups through the scalar code.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n for both slices.
            let v = _mm256_loadu_ps(sp.add(i));
            if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v)) == 0 {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
                _mm_storeu_si128(dp.add(i).cast(), h);
            } else {
                for k in i..i + 8 {
                    *dp.add(k) = super::f32_to_f16(*sp.add(k));
                }
            }
            i += 8;
        }
        for k in i..n {
            dst[k] = super::f32_to_f16(src[k]);
        }
    }

    /// f32 -> bf16, the scalar rule on 8 lanes at a time.
    ///
    /// # Safety
    /// AVX2, FMA and F16C available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
        let n = src.len().min(dst.len());
        let (sp, dp) = (src.as_ptr(), dst.as_mut_ptr());
        let abs_mask = _mm256_set1_epi32(0x7fff_ffff);
        let inf = _mm256_set1_epi32(0x7f80_0000);
        let hi_mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let quiet = _mm256_set1_epi32(64 << 16);
        let bias = _mm256_set1_epi32(0x7fff);
        let one = _mm256_set1_epi32(1);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n for both slices.
            let v = _mm256_loadu_si256(sp.add(i).cast());
            let nan = _mm256_cmpgt_epi32(_mm256_and_si256(v, abs_mask), inf);
            let q = _mm256_or_si256(_mm256_and_si256(v, hi_mask), quiet);
            let v = _mm256_blendv_epi8(v, q, nan);
            let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(v), one);
            let r = _mm256_srli_epi32::<16>(_mm256_add_epi32(v, _mm256_add_epi32(bias, lsb)));
            // Lanes are <= 0xffff: unsigned saturation is exact; fix the lane order after.
            let p = _mm256_packus_epi32(r, r);
            let p = _mm256_permute4x64_epi64::<0b1000>(p);
            _mm_storeu_si128(dp.add(i).cast(), _mm256_castsi256_si128(p));
            i += 8;
        }
        for k in i..n {
            dst[k] = super::f32_to_bf16(src[k]);
        }
    }
}

/// The AVX-512 F16 kernel: [`avx2::dot_f16`] on 16 lanes (flushed to f64 every 512
/// elements; the < 16 trailing elements in f64), prefetching the weights ahead.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
mod avx512 {
    use super::super::simd::x86::{prefetch, PREFETCH_L1, PREFETCH_L2};
    use super::super::simd::x86_512::Acc64x16;
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW, AVX2, FMA and F16C available.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(super) unsafe fn dot_f16(src: &[u8], x: &[f32]) -> f32 {
        let n = (src.len() / 2).min(x.len());
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        // SAFETY (of every call): elements j..j+16 are below n, so in bounds of src and x.
        let w = |j: usize| unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(2 * j).cast())) };
        let xv = |j: usize| unsafe { _mm512_loadu_ps(xp.add(j)) };
        let mut acc64 = Acc64x16::new();
        let mut i = 0;
        while i + 16 <= n {
            let end = (i + 512).min(n);
            let mut a = [_mm512_setzero_ps(); 4];
            while i + 64 <= end {
                let p = sp.wrapping_add(2 * i);
                for c in [0, 64] {
                    prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_L1 + c));
                    prefetch::<_MM_HINT_T1>(p.wrapping_add(PREFETCH_L2 + c));
                }
                for (k, ak) in a.iter_mut().enumerate() {
                    *ak = _mm512_fmadd_ps(w(i + 16 * k), xv(i + 16 * k), *ak);
                }
                i += 64;
            }
            while i + 16 <= end {
                a[0] = _mm512_fmadd_ps(w(i), xv(i), a[0]);
                i += 16;
            }
            acc64.add(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
        }
        let mut tail = 0f64;
        for (s, &xi) in src[2 * i..2 * n].chunks_exact(2).zip(&x[i..n]) {
            tail += super::f16_to_f32(u16::from_le_bytes([s[0], s[1]])) as f64 * xi as f64;
        }
        (acc64.total() + tail) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{self as q, GgmlType};
    use super::{f16_to_f32, f32_to_bf16, f32_to_f16};

    /// Interesting f32 bit patterns: zeros, subnormals, the f16 rounding boundaries,
    /// overflow, infinities, NaNs of both kinds.
    fn edge_f32_bits() -> Vec<u32> {
        let mut v = vec![
            0,
            1,
            0x0000_1000,
            0x007f_ffff,
            0x0080_0000,
            0x3300_0000,
            0x3300_0001,
            0x337f_ffff,
            0x3380_0000,
            0x3380_0001,
            0x387f_c000,
            0x387f_e000,
            0x387f_f000,
            0x3880_0000,
            0x3f80_0000,
            0x3f80_1000,
            0x3f80_3000,
            0x3f80_0fff,
            0x477f_e000,
            0x477f_efff,
            0x477f_f000,
            0x4780_0000,
            0x7f7f_ffff,
            0x7f80_0000,
            0x7f80_0001,
            0x7f80_2000,
            0x7fc0_0000,
            0x7fff_ffff,
            0x7f80_8000,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_8000,
        ];
        let neg: Vec<u32> = v.iter().map(|b| b | 0x8000_0000).collect();
        v.extend(neg);
        v
    }

    #[test]
    fn f16_known_values() {
        assert_eq!(f32_to_f16(1.0), 0x3c00);
        assert_eq!(f32_to_f16(-2.0), 0xc000);
        assert_eq!(f32_to_f16(65504.0), 0x7bff);
        assert_eq!(f32_to_f16(65520.0), 0x7c00); // ties to even: up to infinity
        assert_eq!(f32_to_f16(f32::from_bits(0x3300_0000)), 0); // 2^-25 ties to zero
        assert_eq!(f32_to_f16(f32::from_bits(0x3300_0001)), 1);
        assert_eq!(f32_to_f16(f32::from_bits(0x7f80_0001)), 0x7c01); // numpy keeps NaN
        assert_eq!(f32_to_f16(f32::from_bits(0xffc0_0000)), 0xfe00);
        assert_eq!(f16_to_f32(0x7c01).to_bits(), 0x7f80_2000); // not quieted
        assert_eq!(f16_to_f32(0x0001), f32::from_bits(0x3380_0000));
        assert_eq!(f16_to_f32(0x8000).to_bits(), 0x8000_0000);
        assert_eq!(f16_to_f32(0x3555), half::f16::from_bits(0x3555).to_f32());
    }

    #[test]
    fn f16_round_trips_every_half() {
        for h in 0..=u16::MAX {
            let f = f16_to_f32(h);
            if (h & 0x7fff) <= 0x7c00 {
                assert_eq!(f.to_bits(), half::f16::from_bits(h).to_f32().to_bits(), "{h:#x}");
            }
            assert_eq!(f32_to_f16(f), h, "{h:#x}");
        }
    }

    #[test]
    fn f32_to_f16_matches_half_on_finite() {
        // `half` rounds to nearest even too (it differs only on NaN payloads).
        let mut rng = Rng(99);
        for _ in 0..200_000 {
            let b = rng.next_u64() as u32;
            let f = f32::from_bits(b);
            if !f.is_nan() {
                assert_eq!(f32_to_f16(f), half::f16::from_f32(f).to_bits(), "{b:#x}");
            }
        }
    }

    #[test]
    fn slices_match_scalar() {
        let mut rng = Rng(7);
        let mut bits = edge_f32_bits();
        bits.extend((0..1000).map(|_| rng.next_u64() as u32));
        bits.extend((0..1000).map(|_| (rng.f32() * 70000.0).to_bits()));
        let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut h = vec![0u16; src.len()];
        q::f32_to_f16(&src, &mut h).unwrap();
        let mut b = vec![0u16; src.len()];
        q::f32_to_bf16(&src, &mut b).unwrap();
        for i in 0..src.len() {
            assert_eq!(h[i], f32_to_f16(src[i]), "{:#x}", bits[i]);
            assert_eq!(b[i], f32_to_bf16(src[i]), "{:#x}", bits[i]);
        }
        let all: Vec<u16> = (0..=u16::MAX).collect();
        let mut f = vec![0f32; all.len()];
        q::f16_to_f32(&all, &mut f).unwrap();
        let mut g = vec![0f32; all.len()];
        q::bf16_to_f32(&all, &mut g).unwrap();
        let bytes: Vec<u8> = all.iter().flat_map(|h| h.to_le_bytes()).collect();
        let mut d = vec![0f32; all.len()];
        q::dequantize(GgmlType::F16, &bytes, &mut d).unwrap();
        for (i, &h) in all.iter().enumerate() {
            assert_eq!(f[i].to_bits(), f16_to_f32(h).to_bits(), "{h:#x}");
            assert_eq!(d[i].to_bits(), f[i].to_bits(), "{h:#x}");
            assert_eq!(g[i].to_bits(), (h as u32) << 16);
        }
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80); // tie to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82); // tie to even
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f7f_8000)), 0x7f80); // to infinity
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0); // quieted
        assert_eq!(f32_to_bf16(f32::from_bits(0xffff_ffff)), 0xffff);
    }

    #[test]
    fn dots_agree() {
        let mut rng = Rng(3);
        for n in [0usize, 1, 7, 8, 9, 255, 256, 257, 1000, 4096] {
            let x = rng.f32s(n);
            let w = rng.f32s(n);
            let f32b: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
            check_dots(GgmlType::F32, &f32b, &x);
            let f16b: Vec<u8> = w.iter().flat_map(|&v| f32_to_f16(v).to_le_bytes()).collect();
            check_dots(GgmlType::F16, &f16b, &x);
            #[cfg(target_arch = "x86_64")]
            check_kernels(GgmlType::F16, &f16b, &x, super::avx2::dot_f16, super::avx512::dot_f16);
            let bf16b: Vec<u8> = w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
            check_dots(GgmlType::BF16, &bf16b, &x);
        }
    }

    #[test]
    fn unaligned_rows() {
        let mut rng = Rng(5);
        let x = rng.f32s(100);
        let raw = rng.bytes(4 * 100 + 3);
        for off in 0..3 {
            let mut b = raw[off..off + 400].to_vec();
            for c in b.chunks_exact_mut(4) {
                c[1] &= 0x3f; // finite f16 values
                c[3] &= 0x3f; // finite f16 and f32 values
            }
            let mut buf = vec![0u8; 403];
            buf[off..off + 400].copy_from_slice(&b);
            check_dots(GgmlType::F32, &buf[off..off + 400], &x);
            check_dots(GgmlType::F16, &buf[off..off + 200], &x[..100]);
            #[cfg(target_arch = "x86_64")]
            check_kernels(GgmlType::F16, &buf[off..off + 200], &x[..100], super::avx2::dot_f16, super::avx512::dot_f16);
        }
    }
}
