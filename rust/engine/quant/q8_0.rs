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
        if super::simd::avx512() {
            // SAFETY: AVX-512 F/BW detected (and the AVX2 set, which it implies here).
            return unsafe { avx512::dot(src, x) };
        }
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
        let d = quantize_block(xs, &mut out[2..]);
        out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    }
}

/// One block of Q8_0's rule, shared with the 8-bit activations (`act8.rs`), which keep `d`
/// in f32: writes `q = round(x * (1 / d))` (ties away from zero; 0 when `d` is 0) into `q`
/// and returns `d = max |x| / 127` (NaN, the first NaN's, if any `x` is NaN).
pub(crate) fn quantize_block(xs: &[f32], q: &mut [u8]) -> f32 {
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
    for (o, &v) in q.iter_mut().zip(xs) {
        // |v * id| <= 127 (up to rounding), so the cast never saturates for finite input;
        // NaN becomes 0, as numpy's cast does on x86-64.
        *o = (v * id).round() as i8 as u8;
    }
    d
}

/// The SIMD kernels, which stream the weights from memory at batch 1, work on groups of 8
/// blocks (272 bytes): the 8 scales are converted together and read back as broadcast loads,
/// 4 accumulators take the blocks in turn, and each group is flushed into f64 (so each f32
/// lane sums at most 2 blocks' products). Leftover blocks (fewer than 8) go into one more
/// accumulator, flushed once. Each group prefetches the weights 1 KiB ahead into L1 and
/// 8 KiB ahead into L2 (see [`super::simd::x86::prefetch`]), past the end of the row: the
/// next rows of a matrix follow it.
#[cfg(target_arch = "x86_64")]
mod group {
    use super::super::simd::x86::{prefetch, PREFETCH_L1, PREFETCH_L2};
    use std::arch::x86_64::*;

    /// Blocks per group.
    pub(super) const BLOCKS: usize = 8;

    /// Prefetches the group that starts `PREFETCH_L1` and `PREFETCH_L2` bytes after `g` (5
    /// lines each: a group spans up to 5 lines).
    #[inline(always)]
    pub(super) fn prefetch_ahead(g: *const u8) {
        for c in 0..5 {
            prefetch::<_MM_HINT_T0>(g.wrapping_add(PREFETCH_L1 + 64 * c));
            prefetch::<_MM_HINT_T1>(g.wrapping_add(PREFETCH_L2 + 64 * c));
        }
    }

    /// The scales of the 8 blocks at `g`, as f32: exact, as the scalar conversion (F16C
    /// differs from it only in NaN payloads, and a NaN scale makes the dot NaN either way).
    ///
    /// # Safety
    /// AVX2, FMA and F16C available; the 8 blocks at `g` (272 bytes) readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scales(g: *const u8) -> __m256 {
        // SAFETY: block k's scale is bytes 34k..34k+2 of the group (readable: caller);
        // unaligned reads.
        let d = |k: usize| unsafe { g.add(34 * k).cast::<i16>().read_unaligned() };
        _mm256_cvtph_ps(_mm_setr_epi16(d(0), d(1), d(2), d(3), d(4), d(5), d(6), d(7)))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::x86::*;
    use super::group;
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

    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 34).min(x.len() / 32);
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        let mut acc64 = Acc64::new();
        let mut ds = [0f32; group::BLOCKS];
        let mut i = 0;
        while i + group::BLOCKS <= nb {
            // SAFETY: i + 8 <= nb: the group's 8 blocks and their 256 x values are in bounds;
            // `ds` holds 8 floats.
            unsafe {
                let (g, xg) = (sp.add(34 * i), xp.add(32 * i));
                group::prefetch_ahead(g);
                _mm256_storeu_ps(ds.as_mut_ptr(), group::scales(g));
                let mut a = [_mm256_setzero_ps(); 4];
                for k in 0..group::BLOCKS {
                    let s = block_qx(g.add(34 * k), xg.add(32 * k));
                    a[k % 4] = _mm256_fmadd_ps(s, broadcast_load(ds.as_ptr().add(k)), a[k % 4]);
                }
                acc64.add(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
            }
            i += group::BLOCKS;
        }
        if i < nb {
            let mut a = _mm256_setzero_ps();
            while i < nb {
                // SAFETY: i < nb: the block and its 32 x values are in bounds.
                unsafe {
                    let b = sp.add(34 * i);
                    let d = _mm256_set1_ps(f16_to_f32(b.cast::<u16>().read_unaligned()));
                    a = _mm256_fmadd_ps(block_qx(b, xp.add(32 * i)), d, a);
                }
                i += 1;
            }
            acc64.add(a);
        }
        acc64.total() as f32
    }
}

/// The AVX-512 kernel: [`avx2`] on 16 lanes, a block being two vectors (`vpmovsxbd` of 16
/// quant bytes each). Memory-bound when the weights stream from DRAM.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
pub(super) mod avx512 {
    use super::super::simd::x86::f16_to_f32;
    use super::super::simd::x86_512::{broadcast_load, Acc64x16};
    use super::group;
    use std::arch::x86_64::*;

    /// Sum over one block of `q * x` (unscaled), as 16 lanes.
    ///
    /// # Safety
    /// AVX-512 F/BW and the AVX2 set; `b..b+34` and `xb..xb+32` readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    unsafe fn block_qx(b: *const u8, xb: *const f32) -> __m512 {
        // SAFETY: the caller guarantees the block and x ranges are readable; unaligned loads.
        unsafe {
            let q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(2).cast())));
            let q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(18).cast())));
            _mm512_fmadd_ps(q1, _mm512_loadu_ps(xb.add(16)), _mm512_mul_ps(q0, _mm512_loadu_ps(xb)))
        }
    }

    /// # Safety
    /// AVX-512 F/BW, AVX2, FMA and F16C available.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(in super::super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 34).min(x.len() / 32);
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        let mut acc64 = Acc64x16::new();
        let mut ds = [0f32; group::BLOCKS];
        let mut i = 0;
        while i + group::BLOCKS <= nb {
            // SAFETY: i + 8 <= nb: the group's 8 blocks and their 256 x values are in bounds;
            // `ds` holds 8 floats.
            unsafe {
                let (g, xg) = (sp.add(34 * i), xp.add(32 * i));
                group::prefetch_ahead(g);
                _mm256_storeu_ps(ds.as_mut_ptr(), group::scales(g));
                let mut a = [_mm512_setzero_ps(); 4];
                for k in 0..group::BLOCKS {
                    let s = block_qx(g.add(34 * k), xg.add(32 * k));
                    a[k % 4] = _mm512_fmadd_ps(s, broadcast_load(ds.as_ptr().add(k)), a[k % 4]);
                }
                acc64.add(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
            }
            i += group::BLOCKS;
        }
        if i < nb {
            let mut a = _mm512_setzero_ps();
            while i < nb {
                // SAFETY: i < nb: the block and its 32 x values are in bounds.
                unsafe {
                    let b = sp.add(34 * i);
                    let d = _mm512_set1_ps(f16_to_f32(b.cast::<u16>().read_unaligned()));
                    a = _mm512_fmadd_ps(block_qx(b, xp.add(32 * i)), d, a);
                }
                i += 1;
            }
            acc64.add(a);
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
            #[cfg(target_arch = "x86_64")]
            check_kernels(GgmlType::Q8_0, &src, &x, super::avx2::dot, super::avx512::dot);
        }
    }
}
