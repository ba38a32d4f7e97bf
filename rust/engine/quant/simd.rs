//! CPU feature detection and helpers shared by the SIMD kernels.
//!
//! The x86-64 SIMD kernels need AVX2, FMA and F16C (every CPU with AVX2 and FMA has F16C,
//! but it is checked anyway). Where the CPU also has AVX-512 (F and BW), the formats whose
//! AVX2 kernels are compute-bound (Q4_K, Q2_K) use 512-bit kernels instead, and so do the
//! streaming ones (Q8_0, F16), which also prefetch ([`x86::prefetch`]). Detection runs once;
//! the result is cached in an atomic.

use std::sync::atomic::{AtomicU8, Ordering};

const UNKNOWN: u8 = 0;
const NO: u8 = 1;
const YES: u8 = 2;

static SIMD: AtomicU8 = AtomicU8::new(UNKNOWN);
static AVX512: AtomicU8 = AtomicU8::new(UNKNOWN);

#[inline]
fn cached(flag: &AtomicU8, detect: fn() -> bool) -> bool {
    match flag.load(Ordering::Relaxed) {
        YES => true,
        NO => false,
        _ => {
            let ok = detect();
            flag.store(if ok { YES } else { NO }, Ordering::Relaxed);
            ok
        }
    }
}

/// Whether the SIMD kernels can run on this CPU (cached after the first call).
#[inline]
pub(crate) fn available() -> bool {
    cached(&SIMD, detect)
}

/// Whether the AVX-512 kernels can run too (implies [`available`]).
#[inline]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn avx512() -> bool {
    cached(&AVX512, detect_avx512)
}

#[cfg(target_arch = "x86_64")]
fn detect_avx512() -> bool {
    available() && std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bw")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_avx512() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn detect() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> bool {
    false
}

/// AVX2/FMA/F16C helpers. Every function here is `unsafe` only because it requires those
/// CPU features: callers must have checked [`available`] (the kernels that call them are
/// `#[target_feature]` functions entered only after that check). Functions that also read
/// through a raw pointer say so in their own `# Safety` section.
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    /// Sum of the 4 lanes of `v`, in a fixed order: (l0+l2) + (l1+l3).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn hsum_pd(v: __m256d) -> f64 {
        let s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd::<1>(v));
        let s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
        _mm_cvtsd_f64(s)
    }

    /// An f32 accumulator that is flushed into f64 after each chunk of work (a block or a
    /// few), so that long rows keep f64-accurate totals while the inner loops stay f32.
    /// The reduction order is fixed: lanes are widened and added lane-wise; the final sum
    /// is `hsum_pd(lo + hi)`.
    pub(crate) struct Acc64 {
        lo: __m256d,
        hi: __m256d,
    }

    impl Acc64 {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn new() -> Self {
            Acc64 { lo: _mm256_setzero_pd(), hi: _mm256_setzero_pd() }
        }

        /// Adds the 8 lanes of `v` (as f64) to the accumulator.
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn add(&mut self, v: __m256) {
            self.lo = _mm256_add_pd(self.lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
            self.hi = _mm256_add_pd(self.hi, _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)));
        }

        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        pub(crate) unsafe fn total(&self) -> f64 {
            hsum_pd(_mm256_add_pd(self.lo, self.hi))
        }
    }

    /// f16 (bit pattern) to f32 with F16C. Exact for every non-NaN input.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn f16_to_f32(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    /// Loads 8 bytes from `p` (any alignment) into the low half of an `__m128i`.
    ///
    /// # Safety
    /// `p..p+8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn load8(p: *const u8) -> __m128i {
        // SAFETY: the caller guarantees 8 readable bytes; `_mm_loadl_epi64` has no
        // alignment requirement.
        unsafe { _mm_loadl_epi64(p.cast()) }
    }

    /// `*p` broadcast to 8 lanes by a load (`vbroadcastss ymm, m32`); see
    /// [`super::x86_512::broadcast_load`] for why this is asm.
    ///
    /// # Safety
    /// `p` readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn broadcast_load(p: *const f32) -> __m256 {
        let v: __m256;
        // SAFETY: reads 4 bytes at `p` (readable, by the caller's contract); no other effect.
        unsafe {
            std::arch::asm!(
                "vbroadcastss {v}, dword ptr [{p}]",
                p = in(reg) p,
                v = out(ymm_reg) v,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
        v
    }

    /// How far ahead of the weights being read the streaming kernels prefetch into L1 (bytes).
    pub(crate) const PREFETCH_L1: usize = 1024;
    /// How far ahead they prefetch into L2 (bytes).
    pub(crate) const PREFETCH_L2: usize = 8192;

    /// Software prefetch of the cache line holding `p`, `HINT` one of `_MM_HINT_T0` (into
    /// L1) or `_MM_HINT_T1` (into L2). A hint only: `p` may point anywhere (past the end of
    /// a slice, or at unmapped memory), it is never dereferenced, and it cannot fault. Form
    /// it with `wrapping_add`, since it may be out of bounds.
    ///
    /// The streaming kernels (Q8_0, F16, and the AVX2 F32/BF16 ones) read each weight once,
    /// and a single thread with only the hardware prefetchers keeps too few DRAM reads in
    /// flight (the L2 streamer also stops at every 4 KiB page): they prefetch
    /// [`PREFETCH_L1`] bytes ahead into L1 and [`PREFETCH_L2`] bytes ahead into L2, which
    /// measurably raises their DRAM and L3 throughput.
    #[inline(always)]
    pub(crate) fn prefetch<const HINT: i32>(p: *const u8) {
        // SAFETY: `prefetcht0/t1` (SSE, part of the x86-64 baseline) has no architectural
        // effect and never faults, whatever the address; nothing is read in Rust's sense.
        unsafe { _mm_prefetch::<HINT>(p.cast()) }
    }

    /// Loads 8 f32 from `p` (any alignment).
    ///
    /// # Safety
    /// `p..p+8` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn load_ps(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable floats; `loadu` has no alignment requirement.
        unsafe { _mm256_loadu_ps(p) }
    }
}

/// AVX-512 (F + BW) helpers; same contract as [`x86`], with [`avx512`] checked instead.
/// The 512-bit intrinsics are stable since Rust 1.89.
#[cfg(target_arch = "x86_64")]
#[clippy::msrv = "1.89"]
pub(crate) mod x86_512 {
    use super::x86::hsum_pd;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// `*p` broadcast to 16 lanes by a load (`vbroadcastss zmm, m32`), which needs no shuffle
    /// unit: written as asm because the compiler turns a broadcast of a value it has just
    /// stored back into register shuffles, which compete with the lookups for port 5.
    ///
    /// # Safety
    /// AVX-512F available; `p` readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(crate) unsafe fn broadcast_load(p: *const f32) -> __m512 {
        let v: __m512;
        // SAFETY: reads 4 bytes at `p` (readable, by the caller's contract); no other effect.
        unsafe {
            asm!(
                "vbroadcastss {v}, dword ptr [{p}]",
                p = in(reg) p,
                v = out(zmm_reg) v,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
        v
    }

    /// `v` unchanged, through an empty asm statement: stops the compiler from fusing the
    /// shuffles before and after into a longer sequence of its own.
    ///
    /// # Safety
    /// AVX-512F available.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(crate) unsafe fn opaque(mut v: __m512i) -> __m512i {
        // SAFETY: an empty instruction string: no effect at all.
        unsafe {
            asm!("/* {v} */", v = inout(zmm_reg) v, options(pure, nomem, nostack, preserves_flags));
        }
        v
    }

    /// The two f16 values at `p` (a block's `d` and `dmin`) as `(d, -dmin)` broadcast to 16
    /// lanes each.
    ///
    /// # Safety
    /// AVX-512 F/BW available; `p..p+4` readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(crate) unsafe fn d_negdmin(p: *const u8) -> (__m512, __m512) {
        // SAFETY: 4 readable bytes (caller).
        let pair = unsafe { _mm256_set1_epi32(p.cast::<i32>().read_unaligned()) };
        // [d, dmin] in every lane pair; negate the odd lanes (exact).
        let f = _mm512_cvtph_ps(pair);
        let f = _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(f),
            _mm512_set1_epi64(0x8000_0000_0000_0000u64 as i64),
        ));
        (_mm512_moveldup_ps(f), _mm512_movehdup_ps(f))
    }

    /// The 4 floats at `p` repeated in each 128-bit lane (`vbroadcastf32x4 zmm, m128`), a
    /// load for the same reason as [`broadcast_load`].
    ///
    /// # Safety
    /// AVX-512F available; `p..p+4` readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub(crate) unsafe fn broadcast4_load(p: *const f32) -> __m512 {
        let v: __m512;
        // SAFETY: reads 16 bytes at `p` (readable, by the caller's contract); no other effect.
        unsafe {
            asm!(
                "vbroadcastf32x4 {v}, xmmword ptr [{p}]",
                p = in(reg) p,
                v = out(zmm_reg) v,
                options(pure, readonly, nostack, preserves_flags)
            );
        }
        v
    }

    /// [`super::x86::Acc64`] for 16-lane vectors.
    pub(crate) struct Acc64x16 {
        lo: __m512d,
        hi: __m512d,
    }

    impl Acc64x16 {
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        pub(crate) unsafe fn new() -> Self {
            Acc64x16 { lo: _mm512_setzero_pd(), hi: _mm512_setzero_pd() }
        }

        /// Adds the 16 lanes of `v` (as f64) to the accumulator.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        pub(crate) unsafe fn add(&mut self, v: __m512) {
            self.lo = _mm512_add_pd(self.lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            self.hi = _mm512_add_pd(self.hi, _mm512_cvtps_pd(hi));
        }

        /// The fixed-order total.
        #[inline]
        #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
        pub(crate) unsafe fn total(&self) -> f64 {
            let s = _mm512_add_pd(self.lo, self.hi);
            hsum_pd(_mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd::<1>(s)))
        }
    }
}
