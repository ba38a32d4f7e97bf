//! IQ2_XXS: super-blocks of 256 weights in 8 groups of 32. Each group is two u32 words:
//! word 0 holds four 8-bit indices into the [`IQ2XXS_GRID`] lattice (8 weights each),
//! word 1 four 7-bit sign indices into [`KSIGNS_IQ2XS`] (bits 0..28) and a 4-bit scale `s`
//! (bits 28..32). `db = d * (0.5 + s) * 0.25`; `x = db * grid[k] * sign[k]`.
//!
//! [`IQ2XXS_GRID`]: crate::quant::tables::IQ2XXS_GRID
//! [`KSIGNS_IQ2XS`]: crate::quant::tables::KSIGNS_IQ2XS

use super::float::f16_to_f32;
use super::tables::{IQ2XXS_GRID, IQ2XXS_GRID_F32, IQ2XXS_SIGN_MASKS, KSIGNS_IQ2XS};
use super::{act8, as_blocks, dot_via_dequant, BlockFormat, ByteBlock, GgmlType};

/// One IQ2_XXS block, exactly as stored (66 bytes, alignment 1).
#[repr(C)]
pub(crate) struct BlockIQ2XXS {
    /// Super-block scale, f16 bits.
    pub(crate) d: [u8; 2],
    /// 8 groups of two little-endian u32 words (ggml declares `uint16_t qs[32]`).
    pub(crate) qs: [u8; 64],
}

const _: () = assert!(std::mem::size_of::<BlockIQ2XXS>() == 66);

// SAFETY: only byte arrays: alignment 1, no padding, every bit pattern valid.
unsafe impl ByteBlock for BlockIQ2XXS {}

#[inline(always)]
fn words(g: &[u8]) -> (u32, u32) {
    (u32::from_le_bytes([g[0], g[1], g[2], g[3]]), u32::from_le_bytes([g[4], g[5], g[6], g[7]]))
}

pub(crate) struct IQ2XXS;

impl BlockFormat for IQ2XXS {
    const TYPE: GgmlType = GgmlType::IQ2_XXS;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 66;

    /// gguf-py: `db = d * (0.5 + s) * 0.25` (float32, left to right), then
    /// `db * grid * sign` with `sign` = +-1.0 (left to right). Grid and signs come from
    /// `IQ2XXS_GRID_F32` / `IQ2XXS_SIGN_MASKS`, expansions of the integer tables.
    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (b, out) in as_blocks::<BlockIQ2XXS>(src).iter().zip(dst.chunks_exact_mut(256)) {
            let d = f16_to_f32(u16::from_le_bytes(b.d));
            for (g, out) in b.qs.chunks_exact(8).zip(out.chunks_exact_mut(32)) {
                let (aux0, aux1) = words(g);
                let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
                for (k, out) in out.chunks_exact_mut(8).enumerate() {
                    let grid = &IQ2XXS_GRID_F32.0[((aux0 >> (8 * k)) & 0xff) as usize];
                    let signs = &IQ2XXS_SIGN_MASKS.0[((aux1 >> (7 * k)) & 0x7f) as usize];
                    for ((o, &g), &m) in out.iter_mut().zip(grid).zip(signs) {
                        // `* -1.0` as a sign flip: identical for every non-NaN value, and
                        // `db * g` is NaN only when `d` is.
                        *o = f32::from_bits((db * g).to_bits() ^ m);
                    }
                }
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

/// The dot of a row with 8-bit activations `qx` ([`act8`], the product's input), the
/// reference: per group of 32, the exact i32 sum of `sign * grid * q`, times `db * d` in f32;
/// the group terms summed in f64 in row order.
pub(crate) fn dot_act8_scalar(src: &[u8], qx: &[u8]) -> f32 {
    let blocks = as_blocks::<BlockIQ2XXS>(src);
    let n = 256 * blocks.len();
    let mut acc = 0f64;
    for (i, b) in blocks.iter().enumerate() {
        let d = f16_to_f32(u16::from_le_bytes(b.d));
        for (g, grp) in b.qs.chunks_exact(8).enumerate() {
            let (aux0, aux1) = words(grp);
            let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
            let q = &qx[256 * i + 32 * g..256 * i + 32 * g + 32];
            let mut s = 0i32;
            for (k, q8) in q.chunks_exact(8).enumerate() {
                let grid = IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize];
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * k)) & 0x7f) as usize];
                for (j, &qj) in q8.iter().enumerate() {
                    let v = ((grid >> (8 * j)) & 0xff) as i32 * (qj as i8 as i32);
                    s += if (signs >> j) & 1 != 0 { -v } else { v };
                }
            }
            acc += f64::from((db * act8::scale(qx, n, 8 * i + g)) * s as f32);
        }
    }
    acc as f32
}

/// [`dot_act8_scalar`] with AVX2 where the CPU has it (the same bits).
///
/// # Safety
/// `simd` only if [`super::simd::available`].
pub(crate) unsafe fn dot_act8_simd(src: &[u8], qx: &[u8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the caller guarantees the SIMD features.
    return unsafe { avx2::dot_act8(src, qx) };
    #[cfg(not(target_arch = "x86_64"))]
    dot_act8_scalar(src, qx)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::simd::x86::*;
    use super::super::tables::{IQ2XXS_GRID_F32, IQ2XXS_SIGN_MASKS};
    use std::arch::x86_64::*;

    /// One group of 32 weights (the two words at `q`) times `x..x+32`, unscaled, plus the
    /// group's scale `db`.
    ///
    /// Table rows are 32 bytes, so a row's byte offset is its index << 5, taken straight
    /// from the packed words with one shift and one mask.
    ///
    /// # Safety
    /// SIMD features; `q..q+8` and `x..x+32` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn group(q: *const u8, x: *const f32, d: f32) -> (__m256, __m256) {
        let grid = IQ2XXS_GRID_F32.0.as_ptr().cast::<u8>();
        let signs = IQ2XXS_SIGN_MASKS.0.as_ptr().cast::<u8>();
        // SAFETY: the words are readable (caller); every offset is masked to lie inside its
        // table (grid: 256 rows, signs: 128 rows, 32 bytes each); `x..x+32` is readable.
        unsafe {
            let aux0 = q.cast::<u32>().read_unaligned().to_le();
            let aux1 = q.add(4).cast::<u32>().read_unaligned().to_le();
            let w = |g: u32, s: u32| {
                let g = _mm256_loadu_ps(grid.add(g as usize).cast());
                let m = _mm256_loadu_ps(signs.add(s as usize).cast());
                _mm256_xor_ps(g, m)
            };
            let s0 = _mm256_mul_ps(w((aux0 << 5) & 0x1fe0, (aux1 << 5) & 0xfe0), load_ps(x));
            let s1 = _mm256_mul_ps(w((aux0 >> 3) & 0x1fe0, (aux1 >> 2) & 0xfe0), load_ps(x.add(8)));
            let s0 = _mm256_fmadd_ps(w((aux0 >> 11) & 0x1fe0, (aux1 >> 9) & 0xfe0), load_ps(x.add(16)), s0);
            let s1 = _mm256_fmadd_ps(w((aux0 >> 19) & 0x1fe0, (aux1 >> 16) & 0xfe0), load_ps(x.add(24)), s1);
            let db = _mm256_set1_ps(d * (0.5 + (aux1 >> 28) as f32) * 0.25);
            (_mm256_add_ps(s0, s1), db)
        }
    }

    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 66).min(x.len() / 256);
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        let mut acc64 = Acc64::new();
        for i in 0..nb {
            // SAFETY: i < nb: the block's 66 bytes and 256 x values are in bounds; group
            // `ib < 8` reads bytes 2 + 8ib .. 10 + 8ib and x 32ib .. 32ib + 32 of them.
            unsafe {
                let (b, xb) = (sp.add(66 * i), xp.add(256 * i));
                let d = f16_to_f32(u16::from_le_bytes([*b, *b.add(1)]));
                let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for ib in (0..8).step_by(2) {
                    let (s, db) = group(b.add(2 + 8 * ib), xb.add(32 * ib), d);
                    a0 = _mm256_fmadd_ps(s, db, a0);
                    let (s, db) = group(b.add(10 + 8 * ib), xb.add(32 * ib + 32), d);
                    a1 = _mm256_fmadd_ps(s, db, a1);
                }
                acc64.add(_mm256_add_ps(a0, a1));
            }
        }
        acc64.total() as f32
    }
    /// [`super::dot_act8_scalar`] with 256-bit lanes, a super-block at a time: per group, the
    /// lattice bytes (unsigned) times the activations with the group's signs applied
    /// (`sign_epi8`), pairs added in i16 (`maddubs`: at most 2 * 43 * 127, no saturation),
    /// then in i32; the eight groups' horizontal sums are taken together (three rounds of
    /// `hadd`, then the two 128-bit halves), exactly. The terms `(db * d) * s` are the scalar
    /// float operations in 8-wide lanes, added in f64 in group order: the same bits as the
    /// scalar reference.
    ///
    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_act8(src: &[u8], qx: &[u8]) -> f32 {
        use super::super::tables::{IQ2XXS_GRID, IQ2XXS_SIGNS_I8};
        let nb = src.len() / 66;
        let n = 256 * nb;
        assert!(qx.len() >= super::act8::bytes(n));
        let ones = _mm256_set1_epi16(1);
        let mut acc = 0f64;
        let mut terms = [0f32; 8];
        for i in 0..nb {
            let b = &src[66 * i..66 * i + 66];
            let d = super::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            let mut p = [_mm256_setzero_si256(); 8];
            let mut db = [0f32; 8];
            for (g, (pg, dbg)) in p.iter_mut().zip(db.iter_mut()).enumerate() {
                let (aux0, aux1) = super::words(&b[2 + 8 * g..10 + 8 * g]);
                *dbg = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
                let gi = |k: u32| IQ2XXS_GRID[((aux0 >> (8 * k)) & 0xff) as usize] as i64;
                let si = |k: u32| IQ2XXS_SIGNS_I8[((aux1 >> (7 * k)) & 0x7f) as usize] as i64;
                // SAFETY: 256 i + 32 g + 32 <= n <= qx.len() (asserted above).
                let q = unsafe { _mm256_loadu_si256(qx.as_ptr().add(256 * i + 32 * g).cast()) };
                let grid = _mm256_set_epi64x(gi(3), gi(2), gi(1), gi(0));
                let signs = _mm256_set_epi64x(si(3), si(2), si(1), si(0));
                *pg = _mm256_madd_epi16(_mm256_maddubs_epi16(grid, _mm256_sign_epi8(q, signs)), ones);
            }
            // Lane g of the 128-bit halves of h: group g's (g < 4) or g - 4's sums of each half.
            let h =
                |a: usize| _mm256_hadd_epi32(_mm256_hadd_epi32(p[a], p[a + 1]), _mm256_hadd_epi32(p[a + 2], p[a + 3]));
            let (h0, h4) = (h(0), h(4));
            let s0 = _mm_add_epi32(_mm256_castsi256_si128(h0), _mm256_extracti128_si256::<1>(h0));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(h4), _mm256_extracti128_si256::<1>(h4));
            let sums = _mm256_cvtepi32_ps(_mm256_set_m128i(s4, s0));
            // SAFETY: the super-block's 8 activation scales, bytes n + 32 i .. + 32 (asserted).
            let dx = unsafe { _mm256_loadu_ps(qx.as_ptr().add(n + 32 * i).cast()) };
            // SAFETY: db holds 8 floats; terms takes 8.
            unsafe {
                let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(db.as_ptr()), dx), sums);
                _mm256_storeu_ps(terms.as_mut_ptr(), t);
            }
            for &t in &terms {
                acc += f64::from(t);
            }
        }
        acc as f32
    }
}

#[cfg(test)]
mod tests {
    use super::super::tables::{IQ2XXS_GRID, KSIGNS_IQ2XS};
    use super::super::testutil::*;
    use super::super::*;

    #[test]
    fn known_block() {
        let mut b = vec![0u8; 66];
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
        for ib in 0..8 {
            let idx = [ib as u8, 255 - ib as u8, 17 * ib as u8, 1];
            let signs = [0u32, 1, 0x7f, 0x55];
            let s = ib as u32 * 2; // scale nibble
            let aux1 = signs[0] | signs[1] << 7 | signs[2] << 14 | signs[3] << 21 | s << 28;
            b[2 + 8 * ib..6 + 8 * ib].copy_from_slice(&idx);
            b[6 + 8 * ib..10 + 8 * ib].copy_from_slice(&aux1.to_le_bytes());
        }
        let mut out = [0f32; 256];
        dequantize(GgmlType::IQ2_XXS, &b, &mut out).unwrap();
        for ib in 0..8 {
            let idx = [ib, 255 - ib, (17 * ib) % 256, 1];
            let signs = [0usize, 1, 0x7f, 0x55];
            let db = (0.5 + 2.0 * ib as f32) * 0.25;
            for k in 0..4 {
                for j in 0..8 {
                    let g = (IQ2XXS_GRID[idx[k]] >> (8 * j)) as u8 as f32;
                    let neg = KSIGNS_IQ2XS[signs[k]] >> j & 1 == 1;
                    let want = if neg { -db * g } else { db * g };
                    assert_eq!(out[32 * ib + 8 * k + j], want, "{ib} {k} {j}");
                }
            }
        }
        // Group 0 of block 0: grid row 0 (all 8), no signs, db = 0.125.
        assert_eq!(out[0], 1.0);
        // Sign index 1 -> ksigns 0x81: weights 0 and 7 negative.
        assert!(out[8] < 0.0 && out[15] < 0.0 && out[9] > 0.0);
    }

    /// The 8-bit activation dot against the dequantized oracle (`testutil::check_act8_dots`).
    #[test]
    fn act8_dot_matches_the_dequantized_oracle() {
        check_act8_dots(GgmlType::IQ2_XXS, &[0], 11);
        assert!(!RowDot::new(GgmlType::Q8_0, 32, Kernel::Scalar).unwrap().takes_act8());
    }

    #[test]
    fn simd_matches_scalar() {
        let mut rng = Rng(6);
        for nb in [1usize, 2, 5, 16, 33] {
            let src = random_blocks(&mut rng, GgmlType::IQ2_XXS, nb, &[0]);
            let x = rng.f32s(nb * 256);
            check_dots(GgmlType::IQ2_XXS, &src, &x);
        }
    }
}
