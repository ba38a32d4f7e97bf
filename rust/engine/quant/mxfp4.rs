//! MXFP4: blocks of 32 E2M1 weights with one E8M0 scale. `x = kvalues[nibble] * 2^(e-128)`
//! ([`KVALUES_MXFP4`] are the E2M1 values doubled, hence the halved scale). The low nibble
//! of `qs[j]` is weight `j`, the high nibble weight `j + 16`.
//!
//! [`KVALUES_MXFP4`]: crate::quant::tables::KVALUES_MXFP4

use super::tables::KVALUES_MXFP4;
use super::{as_blocks, dot_via_dequant, BlockFormat, ByteBlock, GgmlType};

/// One MXFP4 block, exactly as stored (17 bytes, alignment 1).
#[repr(C)]
pub(crate) struct BlockMXFP4 {
    /// E8M0 scale exponent.
    pub(crate) e: u8,
    pub(crate) qs: [u8; 16],
}

const _: () = assert!(std::mem::size_of::<BlockMXFP4>() == 17);

// SAFETY: only bytes: alignment 1, no padding, every bit pattern valid.
unsafe impl ByteBlock for BlockMXFP4 {}

/// 2^(e-128) as f32, built from bits exactly like ggml's `ggml_e8m0_to_fp32_half` (and
/// gguf-py's `MXFP4.e8m0_to_fp32_half`): subnormal patterns for e < 2. Never NaN or inf
/// (e = 255 gives 2^127).
#[inline(always)]
pub(crate) fn e8m0_to_fp32_half(e: u8) -> f32 {
    let bits = if e < 2 { 0x0020_0000u32 << e } else { ((e as u32) - 1) << 23 };
    f32::from_bits(bits)
}

pub(crate) struct MXFP4;

impl BlockFormat for MXFP4 {
    const TYPE: GgmlType = GgmlType::MXFP4;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 17;

    /// gguf-py: `d * kvalues[q].astype(float32)`.
    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (b, out) in as_blocks::<BlockMXFP4>(src).iter().zip(dst.chunks_exact_mut(32)) {
            let d = e8m0_to_fp32_half(b.e);
            let (lo, hi) = out.split_at_mut(16);
            for ((&q, l), h) in b.qs.iter().zip(lo).zip(hi) {
                *l = d * KVALUES_MXFP4[(q & 0x0f) as usize] as f32;
                *h = d * KVALUES_MXFP4[(q >> 4) as usize] as f32;
            }
        }
    }

    fn dot_scalar(src: &[u8], x: &[f32]) -> f32 {
        dot_via_dequant::<Self>(src, x)
    }

    unsafe fn dot_simd(src: &[u8], x: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller guarantees the SIMD features.
        return unsafe { avx2::dot(src, x) };
        #[cfg(not(target_arch = "x86_64"))]
        Self::dot_scalar(src, x)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::x86::*;
    use super::super::tables::KVALUES_MXFP4;
    use super::e8m0_to_fp32_half;
    use std::arch::x86_64::*;

    /// Sum over one block of `kvalue * x` (unscaled), as 8 lanes.
    ///
    /// # Safety
    /// SIMD features; `b..b+17` and `xb..xb+32` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_qx(kv: __m128i, b: *const u8, xb: *const f32) -> __m256 {
        // SAFETY: the caller guarantees the ranges (16 quant bytes at b+1).
        unsafe {
            let q = _mm_loadu_si128(b.add(1).cast());
            let m = _mm_set1_epi8(0x0f);
            let lo = _mm_shuffle_epi8(kv, _mm_and_si128(q, m));
            let hi = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16::<4>(q), m));
            let e0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
            let e1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(lo)));
            let e2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
            let e3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(hi)));
            let s0 = _mm256_mul_ps(e0, load_ps(xb));
            let s1 = _mm256_mul_ps(e1, load_ps(xb.add(8)));
            let s0 = _mm256_fmadd_ps(e2, load_ps(xb.add(16)), s0);
            let s1 = _mm256_fmadd_ps(e3, load_ps(xb.add(24)), s1);
            _mm256_add_ps(s0, s1)
        }
    }

    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 17).min(x.len() / 32);
        // SAFETY: KVALUES_MXFP4 is 16 bytes.
        let kv = unsafe { _mm_loadu_si128(KVALUES_MXFP4.as_ptr().cast()) };
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        let mut acc64 = Acc64::new();
        let mut i = 0;
        // Groups of up to 8 blocks (256 weights) into 4 accumulators, then into f64.
        while i < nb {
            let end = (i + 8).min(nb);
            let mut a = [_mm256_setzero_ps(); 4];
            while i + 4 <= end {
                for (k, ak) in a.iter_mut().enumerate() {
                    let (b, xb) = (sp.add(17 * (i + k)), xp.add(32 * (i + k)));
                    // SAFETY: i + k < nb: the block and its 32 x values are in bounds.
                    let (s, e) = unsafe { (block_qx(kv, b, xb), *b) };
                    *ak = _mm256_fmadd_ps(s, _mm256_set1_ps(e8m0_to_fp32_half(e)), *ak);
                }
                i += 4;
            }
            while i < end {
                let (b, xb) = (sp.add(17 * i), xp.add(32 * i));
                // SAFETY: i < nb: the block and its 32 x values are in bounds.
                let (s, e) = unsafe { (block_qx(kv, b, xb), *b) };
                a[0] = _mm256_fmadd_ps(s, _mm256_set1_ps(e8m0_to_fp32_half(e)), a[0]);
                i += 1;
            }
            acc64.add(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
        }
        acc64.total() as f32
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::*;
    use super::e8m0_to_fp32_half;

    #[test]
    fn scales() {
        assert_eq!(e8m0_to_fp32_half(128), 1.0);
        assert_eq!(e8m0_to_fp32_half(127), 0.5);
        assert_eq!(e8m0_to_fp32_half(2), f32::MIN_POSITIVE); // 2^-126
        assert_eq!(e8m0_to_fp32_half(1).to_bits(), 0x0040_0000); // 2^-127, subnormal
        assert_eq!(e8m0_to_fp32_half(0).to_bits(), 0x0020_0000); // 2^-128, subnormal
        assert_eq!(e8m0_to_fp32_half(255), 2f32.powi(127));
        for e in 0..=255u8 {
            assert_eq!(e8m0_to_fp32_half(e) as f64, 2f64.powi(e as i32 - 128));
        }
    }

    #[test]
    fn known_block() {
        let mut b = vec![0u8; 17];
        b[0] = 129; // d = 2
        for j in 0..16 {
            b[1 + j] = j as u8 | ((15 - j as u8) << 4);
        }
        let mut out = [0f32; 32];
        dequantize(GgmlType::MXFP4, &b, &mut out).unwrap();
        let kv = [0., 1., 2., 3., 4., 6., 8., 12., 0., -1., -2., -3., -4., -6., -8., -12.];
        for j in 0..16 {
            assert_eq!(out[j], 2.0 * kv[j]);
            assert_eq!(out[j + 16], 2.0 * kv[15 - j]);
        }
    }

    #[test]
    fn simd_matches_scalar() {
        let mut rng = Rng(8);
        for nb in [1usize, 3, 4, 7, 8, 9, 31, 128, 200] {
            let mut src = rng.bytes(nb * 17);
            for b in src.chunks_exact_mut(17) {
                b[0] = 110 + b[0] % 30; // sane scales
            }
            let x = rng.f32s(nb * 32);
            check_dots(GgmlType::MXFP4, &src, &x);
        }
        // Extreme but finite scales: subnormal and huge.
        for e in [0u8, 1, 2, 200] {
            let mut src = rng.bytes(4 * 17);
            for b in src.chunks_exact_mut(17) {
                b[0] = e;
            }
            let x = rng.f32s(4 * 32);
            check_dots(GgmlType::MXFP4, &src, &x);
        }
    }
}
