//! Q2_K: super-blocks of 256 weights in 16 sub-blocks of 16, each with a 4-bit scale and a
//! 4-bit min: `x = (d * (sc & 0xF)) * q - (dmin * (sc >> 4))`, q 2 bits.
//!
//! Element order: two halves of 128 weights, each reading 32 quant bytes; within a half,
//! shift `s` in {0, 2, 4, 6} gives weights `32*(s/2) + l` = `(qs[l] >> s) & 3` for l < 32,
//! sub-block `8*half + 2*(s/2) + (l >= 16)`.

use super::float::f16_to_f32;
use super::{act8, as_blocks, dot_via_dequant, BlockFormat, ByteBlock, GgmlType};

/// One Q2_K block, exactly as stored (84 bytes, alignment 1; the f16 scales come last).
#[repr(C)]
pub(crate) struct BlockQ2K {
    /// Per sub-block: scale in the low nibble, min in the high nibble.
    pub(crate) scales: [u8; 16],
    pub(crate) qs: [u8; 64],
    /// Super-block scale of the scales, f16 bits.
    pub(crate) d: [u8; 2],
    /// Super-block scale of the mins, f16 bits.
    pub(crate) dmin: [u8; 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ2K>() == 84);

// SAFETY: only byte arrays: alignment 1, no padding, every bit pattern valid.
unsafe impl ByteBlock for BlockQ2K {}

/// The 32 weights of one shift of one half: `q[l] >> SHIFT & 3` with sub-block scale byte
/// `sa` for l < 16 and `sb` for l >= 16.
#[inline(always)]
fn run<const SHIFT: u32>(d: f32, dmin: f32, sa: u8, sb: u8, q: &[u8], out: &mut [f32]) {
    for (part, sc) in [sa, sb].into_iter().enumerate() {
        let dl = d * (sc & 0x0f) as f32;
        let ml = dmin * (sc >> 4) as f32;
        for (o, &q) in out[16 * part..16 * part + 16].iter_mut().zip(&q[16 * part..16 * part + 16]) {
            *o = dl * ((q >> SHIFT) & 3) as f32 - ml;
        }
    }
}

pub(crate) struct Q2K;

impl BlockFormat for Q2K {
    const TYPE: GgmlType = GgmlType::Q2_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 84;

    /// gguf-py: `dl = d * (sc & 0xF)`, `ml = dmin * (sc >> 4)` (float32), `x = dl * q - ml`.
    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (b, out) in as_blocks::<BlockQ2K>(src).iter().zip(dst.chunks_exact_mut(256)) {
            let d = f16_to_f32(u16::from_le_bytes(b.d));
            let dmin = f16_to_f32(u16::from_le_bytes(b.dmin));
            for (h, (q, out)) in b.qs.chunks_exact(32).zip(out.chunks_exact_mut(128)).enumerate() {
                let (o0, rest) = out.split_at_mut(32);
                let (o1, rest) = rest.split_at_mut(32);
                let (o2, o3) = rest.split_at_mut(32);
                let sc = &b.scales[8 * h..8 * h + 8];
                run::<0>(d, dmin, sc[0], sc[1], q, o0);
                run::<2>(d, dmin, sc[2], sc[3], q, o1);
                run::<4>(d, dmin, sc[4], sc[5], q, o2);
                run::<6>(d, dmin, sc[6], sc[7], q, o3);
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

/// The dot of a row with 8-bit activations `qx` ([`act8`], the product's input), the
/// reference. Per sub-block `j` of 16 weights (elements `16 j..16 j + 16` of its super-block,
/// scale byte `sc`): the exact i32 sums `sq = sum(q * x8)` and `sx = sum(x8)`, then the term
/// `dx * ((d * (sc & 15)) * sq - (dmin * (sc >> 4)) * sx)` in f32, `dx` the scale of the
/// activation block of 32 that holds the sub-block; the terms summed in f64 in row order.
pub(crate) fn dot_act8_scalar(src: &[u8], qx: &[u8]) -> f32 {
    let blocks = as_blocks::<BlockQ2K>(src);
    let n = 256 * blocks.len();
    let mut acc = 0f64;
    for (i, b) in blocks.iter().enumerate() {
        let d = f16_to_f32(u16::from_le_bytes(b.d));
        let dmin = f16_to_f32(u16::from_le_bytes(b.dmin));
        for (j, &sc) in b.scales.iter().enumerate() {
            // Sub-block j = 8 half + 2 (shift / 2) + part: quants qs[32 half + 16 part ..] >> shift.
            let (half, shift, part) = (j / 8, 2 * ((j % 8) / 2), j % 2);
            let q = &b.qs[32 * half + 16 * part..32 * half + 16 * part + 16];
            let e = 256 * i + 16 * j;
            let (mut sq, mut sx) = (0i32, 0i32);
            for (&qb, &xb) in q.iter().zip(&qx[e..e + 16]) {
                let x8 = xb as i8 as i32;
                sq += ((qb >> shift) & 3) as i32 * x8;
                sx += x8;
            }
            acc += f64::from(act8_term(d, dmin, sc, sq, sx, act8::scale(qx, n, e / 32)));
        }
    }
    acc as f32
}

/// One sub-block's term of [`dot_act8_scalar`] from its integer sums: the float operations of
/// every kernel, in this order.
#[inline(always)]
fn act8_term(d: f32, dmin: f32, sc: u8, sq: i32, sx: i32, dx: f32) -> f32 {
    let dl = d * (sc & 0x0f) as f32;
    let ml = dmin * (sc >> 4) as f32;
    dx * (dl * sq as f32 - ml * sx as f32)
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
pub(super) mod avx2 {
    use super::super::simd::x86::*;
    use std::arch::x86_64::*;

    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 84).min(x.len() / 256);
        let mut acc64 = Acc64::new();
        let three = _mm256_set1_epi8(3);
        let nib = _mm256_set1_epi32(0x0f);
        for i in 0..nb {
            let b = &src[84 * i..84 * i + 84];
            let xb = &x[256 * i..256 * i + 256];
            let d = _mm256_set1_ps(f16_to_f32(u16::from_le_bytes([b[80], b[81]])));
            let dmin = _mm256_set1_ps(f16_to_f32(u16::from_le_bytes([b[82], b[83]])));
            // The 16 sub-block scales and (negated) mins, computed 8 at a time and kept in
            // memory so that each is a broadcast load.
            let mut dl = [0f32; 16];
            let mut nml = [0f32; 16];
            for h in 0..2 {
                // SAFETY: bytes 8h..8h+8 of the 16 scale bytes are in bounds.
                let sc = unsafe { _mm256_cvtepu8_epi32(load8(b.as_ptr().add(8 * h))) };
                let lo = _mm256_cvtepi32_ps(_mm256_and_si256(sc, nib));
                let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(sc));
                // Same operations as the dequantizer: d * sc, dmin * m (then negated).
                let dlv = _mm256_mul_ps(d, lo);
                let mlv = _mm256_mul_ps(dmin, hi);
                let nmlv = _mm256_sub_ps(_mm256_setzero_ps(), mlv);
                // SAFETY: 8 floats at 8h of 16-float arrays.
                unsafe {
                    _mm256_storeu_ps(dl.as_mut_ptr().add(8 * h), dlv);
                    _mm256_storeu_ps(nml.as_mut_ptr().add(8 * h), nmlv);
                }
            }
            let (mut a0, mut a1, mut a2, mut a3) =
                (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
            for h in 0..2 {
                // SAFETY: quant bytes 16 + 32h .. 16 + 32h + 32 of the 84 are in bounds.
                let q = unsafe { _mm256_loadu_si256(b.as_ptr().add(16 + 32 * h).cast()) };
                macro_rules! shift {
                    ($s:literal) => {{
                        let v = _mm256_and_si256(_mm256_srli_epi16::<{ 2 * $s }>(q), three);
                        let lo = _mm256_castsi256_si128(v);
                        let hi = _mm256_extracti128_si256::<1>(v);
                        let r = 8 * h + 2 * $s;
                        // SAFETY: r + 1 < 16.
                        let (dla, nmla, dlb, nmlb) = unsafe {
                            (
                                broadcast_load(dl.as_ptr().add(r)),
                                broadcast_load(nml.as_ptr().add(r)),
                                broadcast_load(dl.as_ptr().add(r + 1)),
                                broadcast_load(nml.as_ptr().add(r + 1)),
                            )
                        };
                        let e0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                        let e1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(lo)));
                        let e2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                        let e3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(hi)));
                        // SAFETY: x offsets 128h + 32s + 0..32 lie within the block's 256.
                        let xp = unsafe { xb.as_ptr().add(128 * h + 32 * $s) };
                        unsafe {
                            a0 = _mm256_fmadd_ps(_mm256_fmadd_ps(e0, dla, nmla), load_ps(xp), a0);
                            a1 = _mm256_fmadd_ps(_mm256_fmadd_ps(e1, dla, nmla), load_ps(xp.add(8)), a1);
                            a2 = _mm256_fmadd_ps(_mm256_fmadd_ps(e2, dlb, nmlb), load_ps(xp.add(16)), a2);
                            a3 = _mm256_fmadd_ps(_mm256_fmadd_ps(e3, dlb, nmlb), load_ps(xp.add(24)), a3);
                        }
                    }};
                }
                shift!(0);
                shift!(1);
                shift!(2);
                shift!(3);
            }
            acc64.add(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        }
        acc64.total() as f32
    }

    /// [`super::dot_act8_scalar`] with 256-bit lanes, a super-block at a time: for each half
    /// and shift, the 32 quants (unsigned, 0..3) times the 32 activations of one block
    /// (`maddubs`, pairs in i16: at most 2 * 3 * 128, no saturation) and the activations times
    /// 1, in i32; the 128-bit lanes hold the shift's two sub-blocks, whose sums two rounds of
    /// `hadd` gather for four shifts at once (sub-blocks 0, 2, 4, 6 | 1, 3, 5, 7 of a half).
    /// The 16 terms are then the scalar float operations in 8-wide lanes (no fused
    /// multiply-add), put back in sub-block order and added in f64 in that order: the same
    /// bits as the scalar reference.
    ///
    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn dot_act8(src: &[u8], qx: &[u8]) -> f32 {
        let nb = src.len() / 84;
        let n = 256 * nb;
        assert!(qx.len() >= super::act8::bytes(n));
        let ones8 = _mm256_set1_epi8(1);
        let ones16 = _mm256_set1_epi16(1);
        let three = _mm256_set1_epi8(3);
        let nib = _mm256_set1_epi32(0x0f);
        // A half's sub-blocks sit in the lanes as 0, 2, 4, 6, 1, 3, 5, 7 (see `gather`).
        let to_lanes = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
        let to_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let x_block = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3);
        let mut acc = 0f64;
        let mut terms = [0f32; 16];
        for i in 0..nb {
            let b = &src[84 * i..84 * i + 84];
            let d = _mm256_set1_ps(f16_to_f32(u16::from_le_bytes([b[80], b[81]])));
            let dmin = _mm256_set1_ps(f16_to_f32(u16::from_le_bytes([b[82], b[83]])));
            // SAFETY: the block's 84 bytes and the 256 activations and 8 scales of super-block
            // i are in bounds (i < nb, qx.len() >= bytes(n) asserted above).
            let (scales, xs8) =
                unsafe { (_mm_loadu_si128(b.as_ptr().cast()), _mm256_loadu_ps(qx.as_ptr().add(n + 32 * i).cast())) };
            for half in 0..2 {
                // SAFETY: bytes 16 + 32 half .. + 32 of the 84-byte block.
                let qv = unsafe { _mm256_loadu_si256(b.as_ptr().add(16 + 32 * half).cast()) };
                let mut sq = [_mm256_setzero_si256(); 4];
                let mut sx = [_mm256_setzero_si256(); 4];
                for s in 0..4 {
                    let q = _mm256_and_si256(_mm256_srl_epi16(qv, _mm_cvtsi32_si128(2 * s as i32)), three);
                    // SAFETY: as above, activations 256 i + 128 half + 32 s .. + 32.
                    let x = unsafe { _mm256_loadu_si256(qx.as_ptr().add(256 * i + 128 * half + 32 * s).cast()) };
                    sq[s] = _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), ones16);
                    sx[s] = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x), ones16);
                }
                // [s0, s1, s2, s3] of the 128-bit lane sums: sub-blocks 0, 2, 4, 6 | 1, 3, 5, 7.
                let gather =
                    |v: [__m256i; 4]| _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                let (sq, sx) = (_mm256_cvtepi32_ps(gather(sq)), _mm256_cvtepi32_ps(gather(sx)));
                // The half's 8 scale bytes, in the lanes' order.
                let sc = if half == 0 { scales } else { _mm_unpackhi_epi64(scales, scales) };
                let sc = _mm256_permutevar8x32_epi32(_mm256_cvtepu8_epi32(sc), to_lanes);
                let dl = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sc, nib)));
                let ml = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(sc)));
                let dx = _mm256_permutevar8x32_ps(xs8, _mm256_add_epi32(x_block, _mm256_set1_epi32(4 * half as i32)));
                let t = _mm256_mul_ps(dx, _mm256_sub_ps(_mm256_mul_ps(dl, sq), _mm256_mul_ps(ml, sx)));
                // SAFETY: 8 floats into terms[8 half..8 half + 8].
                unsafe { _mm256_storeu_ps(terms.as_mut_ptr().add(8 * half), _mm256_permutevar8x32_ps(t, to_order)) };
            }
            for &t in &terms {
                acc += f64::from(t);
            }
        }
        acc as f32
    }
}

/// The AVX-512 kernel: weights by table lookup instead of int-to-float conversion.
///
/// The 64 quant bytes are transposed so that 32-bit lane `k` holds byte `k` of each of the
/// four 16-byte rows `c` (row `c` covers weights `128*(c/2) + 16*(c%2) + k`, at shifts
/// 0, 2, 4, 6). For each shift `s`, one 16-entry table holds `dl*q - ml` of the four
/// sub-blocks that shift touches (one per row), at lane `4*q + c`. A lane's index is its
/// 2-bit quant with the row number planted just below it (in bits that shift does not
/// use), so one rotate + `vpermps` + FMA handles 16 weights; the tables are built from
/// broadcast loads, leaving the shuffle port to the lookups.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
pub(super) mod avx512 {
    use super::super::simd::x86_512::{broadcast4_load, d_negdmin, opaque, Acc64x16};
    use std::arch::x86_64::*;

    /// Row `c`'s number planted at bit `8c + 2s - 2` (mod 32) for shift `s`: two bits that
    /// belong to the field of shift `s - 1` (or, for s = 0, to shift 3 of the byte below).
    const fn plant(s: u32) -> i32 {
        let mut v = 0u32;
        let mut c = 0u32;
        while c < 4 {
            v |= c.rotate_left((8 * c + 2 * s + 30) % 32);
            c += 1;
        }
        v as i32
    }

    /// # Safety
    /// AVX-512 F/BW, AVX2, FMA and F16C available.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(in super::super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 84).min(x.len() / 256);
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        // SAFETY (of the constant load): 16 x 32 bits.
        let gather = unsafe {
            let g: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];
            _mm512_loadu_si512(g.as_ptr().cast())
        };
        let tbytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
        // Scale bytes in table order: shift s, row c -> sub-block 8*(c/2) + 2*s + c%2.
        let sc_order = _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
        let qval = _mm512_setr_ps(0., 0., 0., 0., 1., 1., 1., 1., 2., 2., 2., 2., 3., 3., 3., 3.);
        let keep = [0x0303_0303, 0x0c0c_0c0c, 0x3030_3030, 0xc0c0_c0c0u32 as i32].map(|m| _mm512_set1_epi32(m));
        let planted = [plant(0), plant(1), plant(2), plant(3)].map(|m| _mm512_set1_epi32(m));
        let nib = _mm512_set1_epi32(0x0f);
        let mut acc64 = Acc64x16::new();
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut dl = [0f32; 16];
        let mut nml = [0f32; 16];
        for i in 0..nb {
            // SAFETY: i < nb: the block's 84 bytes and 256 x values are in bounds, and every
            // read below stays inside them (or inside `dl` / `nml`).
            unsafe {
                let (b, xb) = (sp.add(84 * i), xp.add(256 * i));
                let (d, ndmin) = d_negdmin(b.add(80));
                let sc = _mm_shuffle_epi8(_mm_loadu_si128(b.cast()), sc_order);
                let sc = _mm512_cvtepu8_epi32(sc);
                let dlv = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(sc, nib)));
                let nmlv = _mm512_mul_ps(ndmin, _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(sc)));
                _mm512_storeu_ps(dl.as_mut_ptr(), dlv);
                _mm512_storeu_ps(nml.as_mut_ptr(), nmlv);
                let q = _mm512_loadu_si512(b.add(16).cast());
                let v = _mm512_shuffle_epi8(opaque(_mm512_permutexvar_epi32(gather, q)), tbytes);
                macro_rules! shift {
                    ($s:literal, $r0:literal, $r1:literal, $r2:literal, $r3:literal) => {{
                        // Keep the field of shift s in every byte, plant the row numbers.
                        let vs = _mm512_ternarylogic_epi32::<0xea>(v, keep[$s], planted[$s]);
                        let t = _mm512_fmadd_ps(
                            qval,
                            broadcast4_load(dl.as_ptr().add(4 * $s)),
                            broadcast4_load(nml.as_ptr().add(4 * $s)),
                        );
                        let xs = xb.add(32 * $s);
                        let w0 = _mm512_permutexvar_ps(_mm512_ror_epi32::<$r0>(vs), t);
                        acc[0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xs), acc[0]);
                        let w1 = _mm512_permutexvar_ps(_mm512_ror_epi32::<$r1>(vs), t);
                        acc[1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xs.add(16)), acc[1]);
                        let w2 = _mm512_permutexvar_ps(_mm512_ror_epi32::<$r2>(vs), t);
                        acc[2] = _mm512_fmadd_ps(w2, _mm512_loadu_ps(xs.add(128)), acc[2]);
                        let w3 = _mm512_permutexvar_ps(_mm512_ror_epi32::<$r3>(vs), t);
                        acc[3] = _mm512_fmadd_ps(w3, _mm512_loadu_ps(xs.add(144)), acc[3]);
                    }};
                }
                // Row c is rotated right by 8c + 2s - 2 (mod 32).
                shift!(0, 30, 6, 14, 22);
                shift!(1, 0, 8, 16, 24);
                shift!(2, 2, 10, 18, 26);
                shift!(3, 4, 12, 20, 28);
            }
            // Into f64 every 4 blocks (each f32 lane then sums 16 products).
            if i % 4 == 3 || i + 1 == nb {
                acc64.add(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
                acc = [_mm512_setzero_ps(); 4];
            }
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
        let mut b = vec![0u8; 84];
        for r in 0..16 {
            b[r] = (r as u8 % 16) | (((15 - r) as u8) << 4); // scale r, min 15 - r
        }
        for l in 0..64 {
            // Quants: byte l holds (l%4, (l+1)%4, (l+2)%4, (l+3)%4) at shifts 0, 2, 4, 6.
            let mut v = 0u8;
            for s in 0..4 {
                v |= (((l + s) % 4) as u8) << (2 * s);
            }
            b[16 + l] = v;
        }
        b[80..82].copy_from_slice(&0x4000u16.to_le_bytes()); // d = 2
        b[82..84].copy_from_slice(&0x3400u16.to_le_bytes()); // dmin = 0.25
        let mut out = [0f32; 256];
        dequantize(GgmlType::Q2_K, &b, &mut out).unwrap();
        for half in 0..2 {
            for s in 0..4 {
                for l in 0..32 {
                    let r = 8 * half + 2 * s + l / 16;
                    let q = ((32 * half + l + s) % 4) as f32;
                    let want = 2.0 * r as f32 * q - 0.25 * (15 - r) as f32;
                    assert_eq!(out[128 * half + 32 * s + l], want, "{half} {s} {l}");
                }
            }
        }
    }

    /// The 8-bit activation dot against the dequantized oracle (`testutil::check_act8_dots`).
    #[test]
    fn act8_dot_matches_the_dequantized_oracle() {
        check_act8_dots(GgmlType::Q2_K, &[80, 82], 12);
    }

    #[test]
    fn simd_matches_scalar() {
        let mut rng = Rng(4);
        for nb in [1usize, 2, 5, 16, 33] {
            let src = random_blocks(&mut rng, GgmlType::Q2_K, nb, &[80, 82]);
            let x = rng.f32s(nb * 256);
            check_dots(GgmlType::Q2_K, &src, &x);
            #[cfg(target_arch = "x86_64")]
            check_kernels(GgmlType::Q2_K, &src, &x, super::avx2::dot, super::avx512::dot);
        }
    }
}
