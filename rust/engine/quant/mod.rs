//! Quantized weight formats: dequantization, fused dot products, and the few quantizers and
//! float conversions the engine needs.
//!
//! Supported formats: F32, F16, BF16, Q8_0, Q4_K, Q2_K, IQ2_XXS and MXFP4 (one file each;
//! F32/F16/BF16 share `float.rs`). All data is little-endian and may sit at any byte offset
//! (rows come straight out of a memory-mapped file), so blocks are read byte-wise.
//!
//! Numerics:
//! - [`dequantize`] is bit-identical to gguf-py's `gguf.quants.dequantize` for every block
//!   whose scales are finite: the same float32 operations in the same order, never fused.
//! - [`dot`] is a deterministic function of `(row, x)`: a fixed reduction order that depends
//!   on nothing else (no threads, no data-dependent paths). The scalar kernel is the
//!   reference (the exact dequantized weights, multiplied and summed in f64); the SIMD
//!   kernel works in f32 with several accumulators, flushed into f64 every block or few
//!   blocks. Both agree with a float64 dot of the dequantized row to within 1e-5 relative
//!   to `sum |w_i * x_i|`.
//! - Nothing panics on any input that passes the length checks, whatever the bit patterns
//!   (NaN or infinite scales just produce NaN or infinite outputs).
//! - A matrix product is not always [`dot`] with float `x`: IQ2_XXS and Q2_K products take
//!   their input as 8-bit activations ([`act8`], [`RowDot::dot_act8`]), on every backend.

pub mod act8;
mod float;
mod iq2_xxs;
mod mxfp4;
mod q2_k;
mod q4_k;
mod q8_0;
pub(crate) mod simd;
#[cfg(any(feature = "cuda", test))]
pub(crate) mod split;
pub mod tables;
pub mod types;

pub use types::GgmlType;

use crate::{Error, Result};

/// Which implementation of [`dot_with`] to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Portable scalar code: the reference.
    Scalar,
    /// Vectorized code (x86-64 with AVX2, FMA and F16C, detected at run time).
    Simd,
}

impl Kernel {
    /// [`Kernel::Simd`] if this CPU can run it, else [`Kernel::Scalar`].
    pub fn best() -> Kernel {
        if Self::simd_available() {
            Kernel::Simd
        } else {
            Kernel::Scalar
        }
    }

    /// Whether [`Kernel::Simd`] can run on this CPU (detected once, then cached).
    pub fn simd_available() -> bool {
        simd::available()
    }
}

/// One block format. `dequantize_blocks`, `dot_scalar` and `dot_simd` take whole blocks:
/// `src.len() == n * BLOCK_BYTES` and `dst.len() == x.len() == n * BLOCK_ELEMS` (the public
/// functions check this before calling; the kernels never index out of bounds even if not).
pub(crate) trait BlockFormat {
    const TYPE: GgmlType;
    const BLOCK_ELEMS: usize;
    const BLOCK_BYTES: usize;

    /// The exact (oracle-identical) scalar dequantization.
    fn dequantize_blocks(src: &[u8], dst: &mut [f32]);

    /// Dequantization as exposed: the same code, compiled for AVX2 when the CPU has it
    /// (auto-vectorized; still bit-identical because Rust never contracts into FMA).
    fn dequantize(src: &[u8], dst: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd::available() {
            // SAFETY: the CPU supports AVX2, FMA and F16C (checked just above).
            return unsafe { dequantize_avx2::<Self>(src, dst) };
        }
        Self::dequantize_blocks(src, dst)
    }

    /// Scalar reference dot product.
    fn dot_scalar(src: &[u8], x: &[f32]) -> f32;

    /// SIMD dot product.
    ///
    /// # Safety
    /// [`simd::available`] must be true.
    unsafe fn dot_simd(src: &[u8], x: &[f32]) -> f32;
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequantize_avx2<F: BlockFormat + ?Sized>(src: &[u8], dst: &mut [f32]) {
    F::dequantize_blocks(src, dst)
}

/// A `#[repr(C)]` block struct that may be viewed in place over a byte slice.
///
/// # Safety
/// Implementors must have alignment 1, no padding, and accept every bit pattern (i.e. be
/// made only of `u8`/`i8` arrays).
pub(crate) unsafe trait ByteBlock: Sized {}

/// Views `src` as whole blocks (a trailing partial block, if any, is ignored).
#[inline(always)]
pub(crate) fn as_blocks<B: ByteBlock>(src: &[u8]) -> &[B] {
    const { assert!(std::mem::align_of::<B>() == 1 && std::mem::size_of::<B>() > 0) };
    let n = src.len() / std::mem::size_of::<B>();
    // SAFETY: `B: ByteBlock` has alignment 1, no padding and no invalid bit patterns, and
    // `n * size_of::<B>() <= src.len()` bytes are in bounds and live for the borrow.
    unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<B>(), n) }
}

/// The scalar reference dot shared by the block formats: dequantize (exactly) up to 256
/// elements at a time into a stack buffer and accumulate `w * x` in f64 over 8 fixed lanes.
#[inline(always)]
pub(crate) fn dot_via_dequant<F: BlockFormat + ?Sized>(src: &[u8], x: &[f32]) -> f32 {
    let chunk_blocks = (256 / F::BLOCK_ELEMS).max(1);
    let mut buf = [0f32; 256];
    let mut acc = [0f64; 8];
    for (s, xs) in src.chunks(chunk_blocks * F::BLOCK_BYTES).zip(x.chunks(chunk_blocks * F::BLOCK_ELEMS)) {
        let n = xs.len().min(buf.len());
        let w = &mut buf[..n];
        F::dequantize_blocks(s, w);
        accumulate_f64(&mut acc, w, xs);
    }
    finish_f64(&acc) as f32
}

/// `acc[i % 8] += w[i] * x[i]` in f64.
#[inline(always)]
pub(crate) fn accumulate_f64(acc: &mut [f64; 8], w: &[f32], x: &[f32]) {
    let mut wc = w.chunks_exact(8);
    let mut xc = x.chunks_exact(8);
    for (w8, x8) in (&mut wc).zip(&mut xc) {
        for k in 0..8 {
            acc[k] += w8[k] as f64 * x8[k] as f64;
        }
    }
    for (k, (&a, &b)) in wc.remainder().iter().zip(xc.remainder()).enumerate() {
        acc[k] += a as f64 * b as f64;
    }
}

/// The fixed-order total of the 8 f64 lanes.
#[inline(always)]
pub(crate) fn finish_f64(acc: &[f64; 8]) -> f64 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Runs `$body` with `$F` bound to the format type of `$ty`, or returns
/// `UnsupportedType { op: $op }`.
macro_rules! with_format {
    ($ty:expr, $op:literal, $F:ident => $body:expr) => {
        match $ty {
            GgmlType::F32 => {
                type $F = float::F32;
                $body
            }
            GgmlType::F16 => {
                type $F = float::F16;
                $body
            }
            GgmlType::BF16 => {
                type $F = float::BF16;
                $body
            }
            GgmlType::Q8_0 => {
                type $F = q8_0::Q8_0;
                $body
            }
            GgmlType::Q4_K => {
                type $F = q4_k::Q4K;
                $body
            }
            GgmlType::Q2_K => {
                type $F = q2_k::Q2K;
                $body
            }
            GgmlType::IQ2_XXS => {
                type $F = iq2_xxs::IQ2XXS;
                $body
            }
            GgmlType::MXFP4 => {
                type $F = mxfp4::MXFP4;
                $body
            }
            other => return Err(Error::UnsupportedType { type_name: other.name(), op: $op }),
        }
    };
}

/// Checks that `src` is exactly one row of `n` elements of `F`.
fn check_row<F: BlockFormat>(op: &str, src: &[u8], n: usize) -> Result<()> {
    if !n.is_multiple_of(F::BLOCK_ELEMS) {
        return Err(Error::invalid(format!(
            "{op}: {} rows need a multiple of {} elements, got {n}",
            F::TYPE,
            F::BLOCK_ELEMS
        )));
    }
    let want = n / F::BLOCK_ELEMS * F::BLOCK_BYTES;
    if src.len() != want {
        return Err(Error::invalid(format!(
            "{op}: a {} row of {n} elements is {want} bytes, got {} bytes",
            F::TYPE,
            src.len()
        )));
    }
    Ok(())
}

/// Dequantizes one row (or any whole number of blocks) into `dst`: `dst.len()` elements
/// from exactly `ty.row_bytes(dst.len())` bytes of `src`. Bit-identical to gguf-py.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    with_format!(ty, "dequantize", F => {
        check_row::<F>("dequantize", src, dst.len())?;
        F::dequantize(src, dst);
        Ok(())
    })
}

/// Fused dot product of one quantized row (`src`, `x.len()` elements) with `x`, using the
/// best kernel for this CPU ([`Kernel::best`]).
pub fn dot(ty: GgmlType, src: &[u8], x: &[f32]) -> Result<f32> {
    dot_with(ty, src, x, Kernel::best())
}

/// [`dot`] with an explicit kernel. Asking for [`Kernel::Simd`] on a CPU without it is an
/// `InvalidArgument` error.
pub fn dot_with(ty: GgmlType, src: &[u8], x: &[f32], kernel: Kernel) -> Result<f32> {
    with_format!(ty, "dot", F => {
        check_row::<F>("dot", src, x.len())?;
        match kernel {
            Kernel::Scalar => Ok(F::dot_scalar(src, x)),
            Kernel::Simd => {
                if !simd::available() {
                    return Err(Error::invalid(
                        "dot: the SIMD kernel needs AVX2, FMA and F16C, which this CPU lacks",
                    ));
                }
                // SAFETY: the SIMD features were detected just above.
                Ok(unsafe { F::dot_simd(src, x) })
            }
        }
    })
}

/// A row's dot with 8-bit activations (see [`RowDot::dot_act8`]).
type Act8Dot = unsafe fn(&[u8], &[u8]) -> f32;

/// A fused-dot kernel chosen once for a type, a row length and a [`Kernel`], for the many
/// rows of a matrix product: the type dispatch, CPU feature check and length arithmetic
/// happen here instead of once per row. Its results are bit-identical to [`dot_with`].
///
/// A type whose products take 8-bit activations ([`act8::takes_act8`]) has a second kernel,
/// [`RowDot::dot_act8`], which is the one a matrix product uses.
#[derive(Clone, Copy)]
pub struct RowDot {
    f: unsafe fn(&[u8], &[f32]) -> f32,
    act8: Option<Act8Dot>,
    n: usize,
    row_bytes: usize,
}

impl std::fmt::Debug for RowDot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowDot").field("n", &self.n).field("row_bytes", &self.row_bytes).finish()
    }
}

impl RowDot {
    /// The kernel for rows of `n` elements of `ty`.
    pub fn new(ty: GgmlType, n: usize, kernel: Kernel) -> Result<Self> {
        with_format!(ty, "dot", F => {
            if !n.is_multiple_of(F::BLOCK_ELEMS) {
                return Err(Error::invalid(format!(
                    "dot: {} rows need a multiple of {} elements, got {n}", F::TYPE, F::BLOCK_ELEMS
                )));
            }
            let f: unsafe fn(&[u8], &[f32]) -> f32 = match kernel {
                Kernel::Scalar => F::dot_scalar,
                Kernel::Simd if simd::available() => F::dot_simd,
                Kernel::Simd => {
                    return Err(Error::invalid("dot: the SIMD kernel needs AVX2, FMA and F16C, which this CPU lacks"))
                }
            };
            let act8: Option<Act8Dot> = match (ty, kernel) {
                (GgmlType::IQ2_XXS, Kernel::Scalar) => Some(iq2_xxs::dot_act8_scalar),
                (GgmlType::IQ2_XXS, Kernel::Simd) => Some(iq2_xxs::dot_act8_simd),
                (GgmlType::Q2_K, Kernel::Scalar) => Some(q2_k::dot_act8_scalar),
                (GgmlType::Q2_K, Kernel::Simd) => Some(q2_k::dot_act8_simd),
                _ => None,
            };
            debug_assert_eq!(act8.is_some(), act8::takes_act8(ty));
            Ok(RowDot { f, act8, n, row_bytes: n / F::BLOCK_ELEMS * F::BLOCK_BYTES })
        })
    }

    /// Whether products with this kernel's type take 8-bit activations ([`act8`]): then
    /// [`RowDot::dot_act8`] is the product's dot.
    pub fn takes_act8(&self) -> bool {
        self.act8.is_some()
    }

    /// `row · x` with `x` quantized ([`act8::quantize_row`], `act8::bytes(n)` bytes). Panics if
    /// the type takes no 8-bit activations or the lengths are wrong.
    #[inline]
    pub fn dot_act8(&self, row: &[u8], qx: &[u8]) -> f32 {
        let f = self.act8.expect("RowDot: this type takes float activations");
        assert!(
            row.len() == self.row_bytes && qx.len() == act8::bytes(self.n),
            "RowDot: row or vector of the wrong length"
        );
        // SAFETY: as in `dot`.
        unsafe { f(row, qx) }
    }

    /// The best kernel ([`Kernel::best`]) for rows of `n` elements of `ty`.
    pub fn best(ty: GgmlType, n: usize) -> Result<Self> {
        Self::new(ty, n, Kernel::best())
    }

    /// `row · x`. Panics if the lengths are not those the kernel was made for.
    #[inline]
    pub fn dot(&self, row: &[u8], x: &[f32]) -> f32 {
        assert!(row.len() == self.row_bytes && x.len() == self.n, "RowDot: row or vector of the wrong length");
        // SAFETY: a SIMD kernel is only chosen after its CPU features were detected, and the
        // lengths are exactly those the kernel expects.
        unsafe { (self.f)(row, x) }
    }
}

/// Quantizes `src` to Q8_0, bit-identical to `gguf.quants.quantize(x, Q8_0)` (and ggml's
/// `quantize_row_q8_0_ref`): per block of 32, `d = max|x| / 127`, `q = round(x / d)` (half
/// away from zero, as `x * (1/d)`), `d` stored as f16. `src.len()` must be a multiple of 32
/// and `dst.len() == src.len() / 32 * 34`.
pub fn quantize_q8_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    if !src.len().is_multiple_of(32) {
        return Err(Error::invalid(format!(
            "quantize_q8_0: the input length must be a multiple of 32, got {}",
            src.len()
        )));
    }
    let want = src.len() / 32 * 34;
    if dst.len() != want {
        return Err(Error::invalid(format!(
            "quantize_q8_0: {} elements quantize to {want} bytes, got a {}-byte buffer",
            src.len(),
            dst.len()
        )));
    }
    q8_0::quantize(src, dst);
    Ok(())
}

fn check_same_len(op: &str, a: usize, b: usize) -> Result<()> {
    if a != b {
        return Err(Error::invalid(format!("{op}: source has {a} elements but destination has {b}")));
    }
    Ok(())
}

/// f32 -> f16 bit patterns, round-to-nearest-even, identical to numpy's
/// `astype(np.float16)` (overflow to infinity; NaN keeps its sign and top payload bits and
/// stays NaN, without being quieted).
pub fn f32_to_f16(src: &[f32], dst: &mut [u16]) -> Result<()> {
    check_same_len("f32_to_f16", src.len(), dst.len())?;
    float::f32_to_f16_slice(src, dst);
    Ok(())
}

/// f16 bit patterns -> f32, exact, identical to numpy's `astype(np.float32)` (NaN payloads
/// are shifted, not quieted).
pub fn f16_to_f32(src: &[u16], dst: &mut [f32]) -> Result<()> {
    check_same_len("f16_to_f32", src.len(), dst.len())?;
    float::f16_to_f32_slice(src, dst);
    Ok(())
}

/// f32 -> bf16 bit patterns as gguf-py's BF16 quantizer (ggml's `ggml_compute_fp32_to_bf16`):
/// NaN is quieted (top 16 bits kept, bit 6 of the bf16 set), everything else is rounded to
/// nearest even (overflowing to infinity).
pub fn f32_to_bf16(src: &[f32], dst: &mut [u16]) -> Result<()> {
    check_same_len("f32_to_bf16", src.len(), dst.len())?;
    float::f32_to_bf16_slice(src, dst);
    Ok(())
}

/// bf16 bit patterns -> f32 (exact: the bits shifted left by 16).
pub fn bf16_to_f32(src: &[u16], dst: &mut [f32]) -> Result<()> {
    check_same_len("bf16_to_f32", src.len(), dst.len())?;
    float::bf16_to_f32_slice(src, dst);
    Ok(())
}

#[cfg(test)]
pub(crate) mod testutil {
    /// A tiny deterministic xorshift64* generator for tests.
    pub(crate) struct Rng(pub u64);

    impl Rng {
        pub(crate) fn next_u64(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        pub(crate) fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| (self.next_u64() >> 32) as u8).collect()
        }

        /// Uniform in [-1, 1).
        pub(crate) fn f32(&mut self) -> f32 {
            ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }

        pub(crate) fn f32s(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f32()).collect()
        }
    }

    /// Float64 dot of the dequantized row, and `sum |w_i x_i|`.
    pub(crate) fn reference_dot(w: &[f32], x: &[f32]) -> (f64, f64) {
        let mut s = 0f64;
        let mut a = 0f64;
        for (&w, &x) in w.iter().zip(x) {
            s += w as f64 * x as f64;
            a += (w as f64 * x as f64).abs();
        }
        (s, a)
    }

    /// Checks scalar and SIMD dots of `src` against the f64 reference and each other.
    pub(crate) fn check_dots(ty: super::GgmlType, src: &[u8], x: &[f32]) {
        use super::*;
        let mut w = vec![0f32; x.len()];
        dequantize(ty, src, &mut w).unwrap();
        let (want, mag) = reference_dot(&w, x);
        let tol = 1e-5 * mag + f64::MIN_POSITIVE;
        let s = dot_with(ty, src, x, Kernel::Scalar).unwrap();
        assert!(((s as f64) - want).abs() <= tol, "{ty} scalar: {s} vs {want} (mag {mag})");
        // Deterministic.
        assert_eq!(s.to_bits(), dot_with(ty, src, x, Kernel::Scalar).unwrap().to_bits());
        if Kernel::simd_available() {
            let v = dot_with(ty, src, x, Kernel::Simd).unwrap();
            assert!(((v as f64) - want).abs() <= tol, "{ty} simd: {v} vs {want} (mag {mag})");
            assert!(((v as f64) - (s as f64)).abs() <= tol, "{ty} simd {v} vs scalar {s}");
            assert_eq!(v.to_bits(), dot_with(ty, src, x, Kernel::Simd).unwrap().to_bits());
            assert_eq!(v.to_bits(), dot(ty, src, x).unwrap().to_bits());
        }
    }

    /// The 8-bit activation dot of a type that takes them, against an oracle: the f64 dot of
    /// the dequantized row (gguf-identical) with the values the activations stand for
    /// (`q * d`), within 1e-6 of `sum |w x|`; scalar and SIMD give the same bits; and the
    /// quantization moves the float product by less than a percent of `sum |w x|` (each x
    /// moves by at most half its block's step, amax / 254). Rows of 1 to 33 blocks of random
    /// `ty` blocks (scales at `scale_offsets`), with a zero activation block and an outlier.
    pub(crate) fn check_act8_dots(ty: super::GgmlType, scale_offsets: &[usize], seed: u64) {
        use super::*;
        let mut rng = Rng(seed);
        let be = ty.block_elems();
        for nb in [1usize, 2, 5, 16, 33] {
            let n = nb * be;
            let src = random_blocks(&mut rng, ty, nb, scale_offsets);
            let mut x = rng.f32s(n);
            x[..32].fill(0.0); // a zero block (d = 0)
            x[40] *= 50.0; // an outlier that coarsens its block
            let qx = act8::quantize_rows(&x, n).unwrap();
            let mut w = vec![0f32; n];
            dequantize(ty, &src, &mut w).unwrap();
            let (want, mag) = reference_dot(&w, &act8::dequantize_row(&qx, n));
            let dot = RowDot::new(ty, n, Kernel::Scalar).unwrap();
            assert!(dot.takes_act8(), "{ty}");
            let s = dot.dot_act8(&src, &qx);
            assert!((s as f64 - want).abs() <= 1e-6 * mag, "{ty} nb {nb}: {s} vs {want} (mag {mag})");
            if Kernel::simd_available() {
                let dot = RowDot::new(ty, n, Kernel::Simd).unwrap();
                assert_eq!(dot.dot_act8(&src, &qx).to_bits(), s.to_bits(), "{ty} nb {nb}: SIMD");
            }
            let (exact, mag) = reference_dot(&w, &x);
            assert!((s as f64 - exact).abs() <= 0.01 * mag, "{ty} nb {nb}: {s} vs {exact} (mag {mag})");
        }
    }

    /// Checks the AVX2 and (where the CPU has it) AVX-512 kernels of a format directly, each
    /// against the f64 reference: `dot_with(Simd)` only runs the best one.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn check_kernels(
        ty: super::GgmlType,
        src: &[u8],
        x: &[f32],
        avx2: unsafe fn(&[u8], &[f32]) -> f32,
        avx512: unsafe fn(&[u8], &[f32]) -> f32,
    ) {
        let mut w = vec![0f32; x.len()];
        super::dequantize(ty, src, &mut w).unwrap();
        let (want, mag) = reference_dot(&w, x);
        let tol = 1e-5 * mag + f64::MIN_POSITIVE;
        if super::simd::available() {
            // SAFETY: AVX2/FMA/F16C detected.
            let v = unsafe { avx2(src, x) };
            assert!(((v as f64) - want).abs() <= tol, "{ty} avx2: {v} vs {want} (mag {mag})");
        }
        if super::simd::avx512() {
            // SAFETY: AVX-512 F/BW (and AVX2/FMA/F16C) detected.
            let v = unsafe { avx512(src, x) };
            assert!(((v as f64) - want).abs() <= tol, "{ty} avx512: {v} vs {want} (mag {mag})");
        }
    }

    /// Random blocks of `ty` with finite, sane f16 scales written at `scale_offsets`
    /// (byte offsets within each block).
    pub(crate) fn random_blocks(
        rng: &mut Rng,
        ty: super::GgmlType,
        nblocks: usize,
        scale_offsets: &[usize],
    ) -> Vec<u8> {
        let bb = ty.block_bytes();
        let mut v = rng.bytes(nblocks * bb);
        for b in v.chunks_exact_mut(bb) {
            for &o in scale_offsets {
                // |scale| in [2^-9, 2^-7): small positive or negative normal f16 values.
                let h = 0x1800u16 | (rng.next_u64() as u16 & 0x8fff & !0x0800);
                b[o..o + 2].copy_from_slice(&h.to_le_bytes());
            }
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    const SUPPORTED: [GgmlType; 8] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q2_K,
        GgmlType::IQ2_XXS,
        GgmlType::MXFP4,
    ];

    #[test]
    fn supported_matches_types_table() {
        for t in GgmlType::all() {
            let mut d = vec![0f32; t.block_elems()];
            let src = vec![0u8; t.block_bytes()];
            let r = dequantize(t, &src, &mut d);
            assert_eq!(r.is_ok(), t.is_supported(), "{t}");
            assert_eq!(SUPPORTED.contains(&t), t.is_supported(), "{t}");
            if !t.is_supported() {
                assert!(matches!(r, Err(Error::UnsupportedType { op: "dequantize", .. })));
                assert!(matches!(dot(t, &src, &d), Err(Error::UnsupportedType { op: "dot", .. })));
            }
        }
    }

    #[test]
    fn length_mismatches_are_errors() {
        for t in SUPPORTED {
            let be = t.block_elems();
            let bb = t.block_bytes();
            let src = vec![0u8; 4 * bb];
            let mut d = vec![0f32; 4 * be];
            assert!(dequantize(t, &src, &mut d).is_ok());
            assert!(matches!(dequantize(t, &src[..3 * bb], &mut d), Err(Error::InvalidArgument(_))));
            assert!(matches!(dequantize(t, &src[1..], &mut d), Err(Error::InvalidArgument(_))));
            assert!(matches!(dot(t, &src, &d[1..]), Err(Error::InvalidArgument(_))));
            if be > 1 {
                let mut odd = vec![0f32; be + 1];
                let e = dequantize(t, &src[..bb], &mut odd).unwrap_err();
                assert!(e.to_string().contains("multiple"), "{e}");
            }
            let x = vec![1f32; 4 * be];
            assert!(dot_with(t, &src, &x, Kernel::Scalar).is_ok());
            // Empty rows are fine.
            assert_eq!(dot(t, &[], &[]).unwrap(), 0.0);
        }
        let mut q = vec![0u8; 34];
        assert!(quantize_q8_0(&[0.0; 31], &mut q).is_err());
        assert!(quantize_q8_0(&[0.0; 32], &mut q[..33]).is_err());
        assert!(f32_to_f16(&[0.0; 3], &mut [0u16; 2]).is_err());
        assert!(f16_to_f32(&[0; 3], &mut [0f32; 4]).is_err());
        assert!(f32_to_bf16(&[0.0; 3], &mut [0u16; 2]).is_err());
        assert!(bf16_to_f32(&[0; 3], &mut [0f32; 4]).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // Any bit pattern (NaN/inf scales included) must be handled without panicking.
        let mut rng = Rng(0x1234_5678);
        for t in SUPPORTED {
            for nb in [1usize, 3, 9, 17] {
                let n = nb * t.block_elems();
                let src = rng.bytes(nb * t.block_bytes());
                let mut d = vec![0f32; n];
                dequantize(t, &src, &mut d).unwrap();
                let x = rng.f32s(n);
                dot_with(t, &src, &x, Kernel::Scalar).unwrap();
                dot(t, &src, &x).unwrap();
            }
        }
        let mut all = vec![0xffu8; 34 * 4];
        dequantize(GgmlType::Q8_0, &all, &mut [0f32; 128]).unwrap();
        all.fill(0x7c);
        dot(GgmlType::Q8_0, &all, &[1.0; 128]).unwrap();
    }

    #[test]
    fn kernel_best() {
        assert_eq!(Kernel::best() == Kernel::Simd, Kernel::simd_available());
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            Kernel::simd_available(),
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
        );
    }
}
