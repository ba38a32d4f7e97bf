//! Q4_K: super-blocks of 256 weights in 8 sub-blocks of 32, each with a 6-bit scale and a
//! 6-bit min: `x = (d * sc) * q - (dmin * m)`, q a 4-bit nibble.

use super::float::f16_to_f32;
use super::{as_blocks, dot_via_dequant, BlockFormat, ByteBlock, GgmlType};

/// One Q4_K block, exactly as stored (144 bytes, alignment 1).
#[repr(C)]
pub(crate) struct BlockQ4K {
    /// Super-block scale of the scales, f16 bits.
    pub(crate) d: [u8; 2],
    /// Super-block scale of the mins, f16 bits.
    pub(crate) dmin: [u8; 2],
    /// 8 scales and 8 mins, 6 bits each, packed as `get_scale_min_k4` reads them.
    pub(crate) scales: [u8; 12],
    /// 4-bit quants: for each 64 weights, 32 bytes; low nibbles first 32, high nibbles next.
    pub(crate) qs: [u8; 128],
}

const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);

// SAFETY: only byte arrays: alignment 1, no padding, every bit pattern valid.
unsafe impl ByteBlock for BlockQ4K {}

/// The 8 (scale, min) pairs: ggml's `get_scale_min_k4` / gguf-py's `Q4_K.get_scale_min`.
#[inline(always)]
pub(crate) fn scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// [`scales_mins`] with SSSE3 shuffles: from the 16 bytes at `hdr` (a block's `d`, `dmin`
/// and `scales`), the 16 bytes `[sc0..sc8, m0..m8]`.
///
/// # Safety
/// AVX2 available; `hdr..hdr+16` readable.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales_mins_x86(hdr: *const u8) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    const Z: i8 = -128; // pshufb: zero this byte
                        // SAFETY: the caller guarantees 16 readable bytes.
    let h = unsafe { _mm_loadu_si128(hdr.cast()) };
    // Scale byte k of the block is header byte 4 + k.
    let s2 = _mm_srli_epi16::<2>(h); // bits 6-7 of each byte at 4-5 (masked below)
    let s4 = _mm_and_si128(_mm_srli_epi16::<4>(h), _mm_set1_epi8(0x0f));
    let p = _mm_and_si128(
        _mm_shuffle_epi8(h, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, Z, Z, Z, Z)),
        _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0),
    );
    let q = _mm_shuffle_epi8(s4, _mm_setr_epi8(Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, Z, 12, 13, 14, 15));
    let r = _mm_and_si128(
        _mm_shuffle_epi8(s2, _mm_setr_epi8(Z, Z, Z, Z, 4, 5, 6, 7, Z, Z, Z, Z, 8, 9, 10, 11)),
        _mm_set1_epi8(0x30),
    );
    _mm_or_si128(_mm_or_si128(p, q), r)
}

pub(crate) struct Q4K;

impl BlockFormat for Q4K {
    const TYPE: GgmlType = GgmlType::Q4_K;
    const BLOCK_ELEMS: usize = 256;
    const BLOCK_BYTES: usize = 144;

    /// gguf-py: `dl = d * sc`, `ml = dmin * m` (float32), `x = dl * q - ml`.
    #[inline(always)]
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]) {
        for (b, out) in as_blocks::<BlockQ4K>(src).iter().zip(dst.chunks_exact_mut(256)) {
            let d = f16_to_f32(u16::from_le_bytes(b.d));
            let dmin = f16_to_f32(u16::from_le_bytes(b.dmin));
            let (sc, m) = scales_mins(&b.scales);
            for (j, (q, out)) in b.qs.chunks_exact(32).zip(out.chunks_exact_mut(64)).enumerate() {
                let (lo, hi) = out.split_at_mut(32);
                let (dl0, ml0) = (d * sc[2 * j] as f32, dmin * m[2 * j] as f32);
                let (dl1, ml1) = (d * sc[2 * j + 1] as f32, dmin * m[2 * j + 1] as f32);
                for ((&q, l), h) in q.iter().zip(lo).zip(hi) {
                    *l = dl0 * (q & 0x0f) as f32 - ml0;
                    *h = dl1 * (q >> 4) as f32 - ml1;
                }
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

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::super::simd::x86::*;
    use std::arch::x86_64::*;

    /// Weights `q * dl - ml` of the low and high nibbles of 8 quant bytes.
    ///
    /// # Safety
    /// SIMD features; `q..q+8` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(q: *const u8, dl0: __m256, nml0: __m256, dl1: __m256, nml1: __m256) -> (__m256, __m256) {
        // SAFETY: the caller guarantees the range.
        let z = unsafe { _mm256_cvtepu8_epi32(load8(q)) };
        let lo = _mm256_cvtepi32_ps(_mm256_and_si256(z, _mm256_set1_epi32(0x0f)));
        let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(z));
        (_mm256_fmadd_ps(lo, dl0, nml0), _mm256_fmadd_ps(hi, dl1, nml1))
    }

    /// # Safety
    /// SIMD features available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 144).min(x.len() / 256);
        let mut acc64 = Acc64::new();
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        for i in 0..nb {
            // SAFETY: i < nb: the block's 144 bytes and 256 x values are in bounds.
            let (b, xb) = unsafe { (sp.add(144 * i), xp.add(256 * i)) };
            // Lanes 0..8: d * sc, lanes 8..16: -(dmin * m), kept in memory so that each is a
            // broadcast load.
            let mut dm = [0f32; 16];
            // SAFETY: the block's 16 header bytes are in bounds; `dm` holds 16 floats.
            unsafe {
                let scm = super::scales_mins_x86(b);
                let d = f16_to_f32(u16::from_le_bytes([*b, *b.add(1)]));
                let dmin = f16_to_f32(u16::from_le_bytes([*b.add(2), *b.add(3)]));
                let sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(scm));
                let m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(scm)));
                _mm256_storeu_ps(dm.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(d), sc));
                _mm256_storeu_ps(dm.as_mut_ptr().add(8), _mm256_mul_ps(_mm256_set1_ps(-dmin), m));
            }
            let mut acc = [_mm256_setzero_ps(); 8];
            for j in 0..4 {
                // SAFETY: 2j + 9 < 16.
                let (dl0, nml0, dl1, nml1) = unsafe {
                    let p = dm.as_ptr().add(2 * j);
                    (broadcast_load(p), broadcast_load(p.add(8)), broadcast_load(p.add(1)), broadcast_load(p.add(9)))
                };
                for c in 0..4 {
                    // SAFETY: j, c < 4: quant bytes 16 + 32j + 8c .. +8 of the 144, and x
                    // offsets 64j + 8c .. +8 and +32 of the block's 256 are in bounds.
                    unsafe {
                        let (wl, wh) = weights(b.add(16 + 32 * j + 8 * c), dl0, nml0, dl1, nml1);
                        let xj = xb.add(64 * j + 8 * c);
                        acc[2 * c] = _mm256_fmadd_ps(wl, load_ps(xj), acc[2 * c]);
                        acc[2 * c + 1] = _mm256_fmadd_ps(wh, load_ps(xj.add(32)), acc[2 * c + 1]);
                    }
                }
            }
            let s0 = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let s1 = _mm256_add_ps(_mm256_add_ps(acc[4], acc[5]), _mm256_add_ps(acc[6], acc[7]));
            acc64.add(_mm256_add_ps(s0, s1));
        }
        acc64.total() as f32
    }
}

/// The AVX-512 kernel: each sub-block's 16 possible weights `dl*q - ml` form one 16-lane
/// table, and a `vpermps` on the zero-extended quant bytes (whose low 4 bits are the low
/// nibble; shifted by 4 for the high nibble) looks up 16 weights at once.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
pub(super) mod avx512 {
    use super::super::simd::x86_512::{broadcast_load, d_negdmin, Acc64x16};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX-512 F/BW, AVX2, FMA and F16C available.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(in super::super) unsafe fn dot(src: &[u8], x: &[f32]) -> f32 {
        let nb = (src.len() / 144).min(x.len() / 256);
        let (sp, xp) = (src.as_ptr(), x.as_ptr());
        let iota = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        let mut acc64 = Acc64x16::new();
        let mut acc = [_mm512_setzero_ps(); 4];
        for i in 0..nb {
            // SAFETY: i < nb: the block's 144 bytes and 256 x values are in bounds, and all
            // reads below stay inside them.
            unsafe {
                let (b, xb) = (sp.add(144 * i), xp.add(256 * i));
                // Lanes 0..8: d * sc; lanes 8..16: -(dmin * m) (as the dequantizer computes
                // them, up to the sign).
                let scm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(super::scales_mins_x86(b)));
                let (d, ndmin) = d_negdmin(b);
                let f = _mm512_mask_blend_ps(0xff00, d, ndmin);
                let mut dm = [0f32; 16];
                _mm512_storeu_ps(dm.as_mut_ptr(), _mm512_mul_ps(f, scm));
                for j in 0..4 {
                    let p = dm.as_ptr().add(2 * j);
                    let t0 = _mm512_fmadd_ps(iota, broadcast_load(p), broadcast_load(p.add(8)));
                    let t1 = _mm512_fmadd_ps(iota, broadcast_load(p.add(1)), broadcast_load(p.add(9)));
                    for c in 0..2 {
                        let z = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(16 + 32 * j + 16 * c).cast()));
                        let xj = xb.add(64 * j + 16 * c);
                        let wl = _mm512_permutexvar_ps(z, t0);
                        acc[c] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xj), acc[c]);
                        let wh = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(z), t1);
                        acc[2 + c] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xj.add(32)), acc[2 + c]);
                    }
                }
            }
            // Into f64 every 2 blocks (each f32 lane then sums 8 products).
            if i % 2 == 1 || i + 1 == nb {
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
    use super::scales_mins;

    /// Packs 8 six-bit scales and mins the way `get_scale_min_k4` unpacks them.
    fn pack(sc: [u8; 8], m: [u8; 8]) -> [u8; 12] {
        let mut s = [0u8; 12];
        for j in 0..4 {
            s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
        }
        s
    }

    #[test]
    fn scale_unpacking() {
        let sc = [1, 2, 3, 63, 17, 33, 48, 62];
        let m = [0, 5, 60, 7, 63, 16, 31, 40];
        assert_eq!(scales_mins(&pack(sc, m)), (sc, m));
        #[cfg(target_arch = "x86_64")]
        if Kernel::simd_available() {
            let mut rng = Rng(12);
            for _ in 0..1000 {
                let hdr = rng.bytes(16);
                let mut s = [0u8; 12];
                s.copy_from_slice(&hdr[4..]);
                let (sc, m) = scales_mins(&s);
                let mut got = [0u8; 16];
                // SAFETY: AVX2 detected; 16 readable and writable bytes.
                unsafe {
                    let v = super::scales_mins_x86(hdr.as_ptr());
                    std::arch::x86_64::_mm_storeu_si128(got.as_mut_ptr().cast(), v);
                }
                assert_eq!(got[..8], sc);
                assert_eq!(got[8..], m);
            }
        }
    }

    #[test]
    fn known_block() {
        let mut b = vec![0u8; 144];
        b[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1
        b[2..4].copy_from_slice(&0x3800u16.to_le_bytes()); // dmin = 0.5
        let sc = [1, 2, 3, 4, 5, 6, 7, 8];
        let m = [0, 1, 2, 3, 4, 5, 6, 63];
        b[4..16].copy_from_slice(&pack(sc, m));
        for l in 0..128 {
            b[16 + l] = (l % 16) as u8 | (((l + 3) % 16) as u8) << 4;
        }
        let mut out = [0f32; 256];
        dequantize(GgmlType::Q4_K, &b, &mut out).unwrap();
        for j in 0..4 {
            for l in 0..32 {
                let byte = 32 * j + l;
                let lo = (byte % 16) as f32;
                let hi = ((byte + 3) % 16) as f32;
                assert_eq!(out[64 * j + l], sc[2 * j] as f32 * lo - 0.5 * m[2 * j] as f32);
                assert_eq!(out[64 * j + 32 + l], sc[2 * j + 1] as f32 * hi - 0.5 * m[2 * j + 1] as f32);
            }
        }
    }

    #[test]
    fn simd_matches_scalar() {
        let mut rng = Rng(2);
        for nb in [1usize, 2, 5, 16, 33] {
            let src = random_blocks(&mut rng, GgmlType::Q4_K, nb, &[0, 2]);
            let x = rng.f32s(nb * 256);
            check_dots(GgmlType::Q4_K, &src, &x);
            #[cfg(target_arch = "x86_64")]
            check_kernels(GgmlType::Q4_K, &src, &x, super::avx2::dot, super::avx512::dot);
        }
    }
}
