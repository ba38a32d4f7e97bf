//! Q8_0: blocks of 32 weights, `x = d * q` with an f16 scale and 32 signed bytes.

use super::float::{f16_to_f32, f32_to_f16};
use super::{as_blocks, dot_via_dequant, BlockFormat, ByteBlock, GgmlType};

/// One Q8_0 block, exactly as stored (34 bytes, alignment 1).
#[repr(C)]
pub(crate) struct BlockQ8_0 {
    /// Scale, f16 bits, little-endian.
    pub(crate) d: [u8; 2],
    pub(crate) qs: [i8; 32],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);

// SAFETY: only byte arrays: alignment 1, no padding, every bit pattern valid.
unsafe impl ByteBlock for BlockQ8_0 {}

pub(crate) struct Q8_0;

impl BlockFormat for Q8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    const BLOCK_ELEMS: usize = 32;
    const BLOCK_BYTES: usize = 34;

    /// gguf-py: `x.view(int8).astype(float32) * d.view(float16).astype(float32)`.
    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (b, out) in as_blocks::<BlockQ8_0>(src).iter().zip(dst.chunks_exact_mut(32)) {
            let d = f16_to_f32(u16::from_le_bytes(b.d));
            for (o, &q) in out.iter_mut().zip(&b.qs) {
                *o = q as f32 * d;
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

/// The Q8_0 quantizer of gguf-py (`Q8_0.quantize_blocks`, "bit-exact with ggml-quants.c"):
/// `d = max|x| / 127` (float32), `id = 1/d` (0 when d == 0), `q = round_half_away(x * id)`,
/// `d` to f16 by numpy's rounding. `dst.len() == src.len() / 32 * 34` (checked by caller).
pub(crate) fn quantize(src: &[f32], dst: &mut [u8]) {
    for (xs, out) in src.chunks_exact(32).zip(dst.chunks_exact_mut(34)) {
        // numpy's max propagates NaN.
        let mut amax = 0f32;
        for &v in xs {
            let a = v.abs();
            if a > amax || a.is_nan() {
                amax = a;
            }
            if amax.is_nan() {
                break;
            }
        }
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
        for (o, &v) in out[2..].iter_mut().zip(xs) {
            // |v * id| <= 127 (up to rounding), so the cast never saturates for finite
            // input; NaN becomes 0, as numpy's cast does on x86-64.
            *o = (v * id).round() as i8 as u8;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::x86::*;
    use std::arch::x86_64::*;

    /// Sum over one block of `q * x` (unscaled), as 8 lanes: two chains of two.
    ///
    /// # Safety
    /// SIMD features; `b..b+34` and `xb..xb+32` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block_qx(b: *const u8, xb: *const f32) -> __m256 {
        // SAFETY: the caller guarantees the block and x ranges are readable.
        unsafe {
            let q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(b.add(2))));
            let q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(b.add(10))));
            let q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(b.add(18))));
            let q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(b.add(26))));
            let s0 = _mm256_mul_ps(q0, load_ps(xb));
            let s1 = _mm256_mul_ps(q1, load_ps(xb.add(8)));
            let s0 = _mm256_fmadd_ps(q2, load_ps(xb.add(16)), s0);
            let s1 = _mm256_fmadd_ps(q3, load_ps(xb.add(24)), s1);
            _mm256_add_ps(s0, s1)
        }
    }

    /// The block's scale, broadcast.
    ///
    /// # Safety
    /// SIMD features; `b..b+2` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(b: *const u8) -> __m256 {
        // SAFETY: the caller guarantees two readable bytes.
        let h = unsafe { u16::from_le_bytes([*b, *b.add(1)]) };
        _mm256_set1_ps(f16_to_f32(h))
    }

    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 34).min(x.len() / 32);
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        let mut acc64 = Acc64::new();
        let mut i = 0;
        // Groups of up to 8 blocks (256 weights) into 4 accumulators, then into f64.
        while i < nb {
            let end = (i + 8).min(nb);
            let mut a = [_mm256_setzero_ps(); 4];
            while i + 4 <= end {
                for (k, ak) in a.iter_mut().enumerate() {
                    let (b, xb) = (sp.add(34 * (i + k)), xp.add(32 * (i + k)));
                    // SAFETY: i + k < nb: the block and its 32 x values are in bounds.
                    let (s, d) = unsafe { (block_qx(b, xb), scale(b)) };
                    *ak = _mm256_fmadd_ps(s, d, *ak);
                }
                i += 4;
            }
            while i < end {
                let (b, xb) = (sp.add(34 * i), xp.add(32 * i));
                // SAFETY: i < nb: the block and its 32 x values are in bounds.
                let (s, d) = unsafe { (block_qx(b, xb), scale(b)) };
                a[0] = _mm256_fmadd_ps(s, d, a[0]);
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

    #[test]
    fn known_block() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
        for k in 0..32 {
            b[2 + k] = (k as i8 - 16) as u8;
        }
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut out).unwrap();
        for (k, &v) in out.iter().enumerate() {
            assert_eq!(v, (k as f32 - 16.0) * 0.5);
        }
        b[2] = 0x80; // -128
        dequantize(GgmlType::Q8_0, &b, &mut out).unwrap();
        assert_eq!(out[0], -64.0);
    }

    #[test]
    fn quantize_known_block_and_round_trip() {
        let x: Vec<f32> = (0..32).map(|k| (k as f32 - 16.0) / 4.0).collect();
        let mut q = vec![0u8; 34];
        quantize_q8_0(&x, &mut q).unwrap();
        // amax = 4: d = 4/127, q = round(x * (1/d)).
        assert_eq!(u16::from_le_bytes([q[0], q[1]]), super::f32_to_f16(4.0 / 127.0));
        assert_eq!(q[2] as i8, -127);
        assert_eq!(q[18] as i8, 0);
        assert_eq!(q[33] as i8, 119); // 3.75 * 31.75 = 119.06
        let mut back = [0f32; 32];
        dequantize(GgmlType::Q8_0, &q, &mut back).unwrap();
        for (a, b) in x.iter().zip(&back) {
            assert!((a - b).abs() <= 4.0 / 127.0 * 0.57, "{a} {b}");
        }
        // Zeros: d = 0, q = 0.
        quantize_q8_0(&[0.0; 32], &mut q).unwrap();
        assert!(q.iter().all(|&b| b == 0));
        // Half-way values round away from zero: with amax = 127, id = 1.
        let mut y = [0f32; 32];
        y[0] = 127.0;
        y[1] = 2.5;
        y[2] = -2.5;
        y[3] = 0.5;
        quantize_q8_0(&y, &mut q).unwrap();
        assert_eq!(&q[2..6], &[127u8, 3, (-3i8) as u8, 1]);
    }

    #[test]
    fn round_trip_random() {
        let mut rng = Rng(11);
        let x: Vec<f32> = (0..32 * 64).map(|_| rng.f32() * 3.0).collect();
        let mut q = vec![0u8; 34 * 64];
        quantize_q8_0(&x, &mut q).unwrap();
        let mut back = vec![0f32; x.len()];
        dequantize(GgmlType::Q8_0, &q, &mut back).unwrap();
        for (xs, bs) in x.chunks(32).zip(back.chunks(32)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in xs.iter().zip(bs) {
                // Half a step, plus up to 127 * (f16 rounding of d) = 0.062 step.
                assert!((a - b).abs() <= amax / 127.0 * 0.57, "{a} {b}");
            }
        }
        // Re-quantizing the dequantized values is stable.
        let mut q2 = vec![0u8; q.len()];
        quantize_q8_0(&back, &mut q2).unwrap();
        let mut back2 = vec![0f32; x.len()];
        dequantize(GgmlType::Q8_0, &q2, &mut back2).unwrap();
        for (a, b) in back.iter().zip(&back2) {
            assert!((a - b).abs() <= 1e-3 * a.abs().max(1e-3), "{a} {b}");
        }
    }

    #[test]
    fn simd_matches_scalar() {
        let mut rng = Rng(1);
        for nb in [1usize, 3, 4, 7, 8, 9, 31, 128, 200] {
            let src = random_blocks(&mut rng, GgmlType::Q8_0, nb, &[0]);
            let x = rng.f32s(nb * 32);
            check_dots(GgmlType::Q8_0, &src, &x);
        }
    }
}
