//! Lookup tables of the quantized formats. Each table has exactly one Rust definition here;
//! CPU kernels use it directly and GPU kernels emit it into their shader source, so there are
//! no per-language copies to keep in sync.

/// The IQ2_XXS lattice: 256 rows of 8 coordinates. Byte `k` of row `i` (little-endian) is
/// coordinate `k` of grid point `i`; every byte is one of 0x08, 0x19, 0x2b (8, 25, 43).
///
/// Values from ggml's `iq2xxs_grid` (`ggml/src/ggml-common.h`, MIT licence), which equals
/// gguf-py's 2-bit packed `IQ2_XXS.grid_hex` (`gguf/quants.py`) mapped through
/// {0 -> 0x08, 1 -> 0x19, 2 -> 0x2b}. Which 256 of the 3^8 lattice points are used is learned
/// data, not a formula, so the table is transcribed; a unit test checks it against the
/// packed form.
#[rustfmt::skip]
pub const IQ2XXS_GRID: [u64; 256] = [
    0x0808080808080808, 0x080808080808082b, 0x0808080808081919, 0x0808080808082b08,
    0x0808080808082b2b, 0x0808080808190819, 0x0808080808191908, 0x08080808082b0808,
    0x08080808082b082b, 0x08080808082b2b08, 0x08080808082b2b2b, 0x0808080819080819,
    0x0808080819081908, 0x0808080819190808, 0x0808080819192b08, 0x08080808192b0819,
    0x08080808192b1908, 0x080808082b080808, 0x080808082b08082b, 0x080808082b082b2b,
    0x080808082b2b082b, 0x0808081908080819, 0x0808081908081908, 0x0808081908190808,
    0x0808081908191919, 0x0808081919080808, 0x080808192b081908, 0x080808192b192b08,
    0x0808082b08080808, 0x0808082b0808082b, 0x0808082b082b082b, 0x0808082b2b08082b,
    0x0808190808080819, 0x0808190808081908, 0x0808190808190808, 0x08081908082b0819,
    0x08081908082b1908, 0x0808190819080808, 0x080819081908082b, 0x0808190819082b08,
    0x08081908192b0808, 0x080819082b080819, 0x080819082b081908, 0x080819082b190808,
    0x080819082b2b1908, 0x0808191908080808, 0x080819190808082b, 0x0808191908082b08,
    0x08081919082b0808, 0x080819191908192b, 0x08081919192b2b19, 0x080819192b080808,
    0x080819192b190819, 0x0808192b08082b19, 0x0808192b08190808, 0x0808192b19080808,
    0x0808192b2b081908, 0x0808192b2b2b1908, 0x08082b0808080808, 0x08082b0808081919,
    0x08082b0808082b08, 0x08082b0808191908, 0x08082b08082b2b08, 0x08082b0819080819,
    0x08082b0819081908, 0x08082b0819190808, 0x08082b081919082b, 0x08082b082b082b08,
    0x08082b1908081908, 0x08082b1919080808, 0x08082b2b0808082b, 0x08082b2b08191908,
    0x0819080808080819, 0x0819080808081908, 0x0819080808190808, 0x08190808082b0819,
    0x0819080819080808, 0x08190808192b0808, 0x081908082b081908, 0x081908082b190808,
    0x081908082b191919, 0x0819081908080808, 0x0819081908082b08, 0x08190819082b0808,
    0x0819081919190808, 0x0819081919192b2b, 0x081908192b080808, 0x0819082b082b1908,
    0x0819082b19081919, 0x0819190808080808, 0x0819190808082b08, 0x08191908082b0808,
    0x08191908082b1919, 0x0819190819082b19, 0x081919082b080808, 0x0819191908192b08,
    0x08191919192b082b, 0x0819192b08080808, 0x0819192b0819192b, 0x08192b0808080819,
    0x08192b0808081908, 0x08192b0808190808, 0x08192b0819080808, 0x08192b082b080819,
    0x08192b1908080808, 0x08192b1908081919, 0x08192b192b2b0808, 0x08192b2b19190819,
    0x082b080808080808, 0x082b08080808082b, 0x082b080808082b2b, 0x082b080819081908,
    0x082b0808192b0819, 0x082b08082b080808, 0x082b08082b08082b, 0x082b0819082b2b19,
    0x082b081919082b08, 0x082b082b08080808, 0x082b082b0808082b, 0x082b190808080819,
    0x082b190808081908, 0x082b190808190808, 0x082b190819080808, 0x082b19081919192b,
    0x082b191908080808, 0x082b191919080819, 0x082b1919192b1908, 0x082b192b2b190808,
    0x082b2b0808082b08, 0x082b2b08082b0808, 0x082b2b082b191908, 0x082b2b2b19081908,
    0x1908080808080819, 0x1908080808081908, 0x1908080808190808, 0x1908080808192b08,
    0x19080808082b0819, 0x19080808082b1908, 0x1908080819080808, 0x1908080819082b08,
    0x190808081919192b, 0x19080808192b0808, 0x190808082b080819, 0x190808082b081908,
    0x190808082b190808, 0x1908081908080808, 0x19080819082b0808, 0x19080819192b0819,
    0x190808192b080808, 0x190808192b081919, 0x1908082b08080819, 0x1908082b08190808,
    0x1908082b19082b08, 0x1908082b1919192b, 0x1908082b192b2b08, 0x1908190808080808,
    0x1908190808082b08, 0x19081908082b0808, 0x190819082b080808, 0x190819082b192b19,
    0x190819190819082b, 0x19081919082b1908, 0x1908192b08080808, 0x19082b0808080819,
    0x19082b0808081908, 0x19082b0808190808, 0x19082b0819080808, 0x19082b0819081919,
    0x19082b1908080808, 0x19082b1919192b08, 0x19082b19192b0819, 0x19082b192b08082b,
    0x19082b2b19081919, 0x19082b2b2b190808, 0x1919080808080808, 0x1919080808082b08,
    0x1919080808190819, 0x1919080808192b19, 0x19190808082b0808, 0x191908082b080808,
    0x191908082b082b08, 0x1919081908081908, 0x191908191908082b, 0x191908192b2b1908,
    0x1919082b2b190819, 0x191919082b190808, 0x191919082b19082b, 0x1919191908082b2b,
    0x1919192b08080819, 0x1919192b19191908, 0x19192b0808080808, 0x19192b0808190819,
    0x19192b0808192b19, 0x19192b08192b1908, 0x19192b1919080808, 0x19192b2b08082b08,
    0x192b080808081908, 0x192b080808190808, 0x192b080819080808, 0x192b0808192b2b08,
    0x192b081908080808, 0x192b081919191919, 0x192b082b08192b08, 0x192b082b192b0808,
    0x192b190808080808, 0x192b190808081919, 0x192b191908190808, 0x192b19190819082b,
    0x192b19192b081908, 0x192b2b081908082b, 0x2b08080808080808, 0x2b0808080808082b,
    0x2b08080808082b2b, 0x2b08080819080819, 0x2b0808082b08082b, 0x2b08081908081908,
    0x2b08081908192b08, 0x2b08081919080808, 0x2b08082b08190819, 0x2b08190808080819,
    0x2b08190808081908, 0x2b08190808190808, 0x2b08190808191919, 0x2b08190819080808,
    0x2b081908192b0808, 0x2b08191908080808, 0x2b0819191908192b, 0x2b0819192b191908,
    0x2b08192b08082b19, 0x2b08192b19080808, 0x2b08192b192b0808, 0x2b082b080808082b,
    0x2b082b1908081908, 0x2b082b2b08190819, 0x2b19080808081908, 0x2b19080808190808,
    0x2b190808082b1908, 0x2b19080819080808, 0x2b1908082b2b0819, 0x2b1908190819192b,
    0x2b1908192b080808, 0x2b19082b19081919, 0x2b19190808080808, 0x2b191908082b082b,
    0x2b19190819081908, 0x2b19191919190819, 0x2b192b082b080819, 0x2b192b19082b0808,
    0x2b2b08080808082b, 0x2b2b080819190808, 0x2b2b08082b081919, 0x2b2b081908082b19,
    0x2b2b082b08080808, 0x2b2b190808192b08, 0x2b2b2b0819190808, 0x2b2b2b1908081908,
];

/// The IQ2 sign table (ggml's `ksigns_iq2xs`): 7 stored sign bits plus an 8th bit that makes
/// the number of set bits even. Entry `i` = `i | (popcount(i) & 1) << 7`.
pub const KSIGNS_IQ2XS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = (i as u8) | (((i as u32).count_ones() as u8 & 1) << 7);
        i += 1;
    }
    t
};

/// MXFP4 element values (ggml's `kvalues_mxfp4`): the E2M1 values of the OCP microscaling
/// spec, doubled so that they are integers (which is why the block scale is halved).
/// Nibble bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa:
/// {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}.
pub const KVALUES_MXFP4: [i8; 16] = {
    let mut t = [0i8; 16];
    let mut i = 0;
    while i < 16 {
        let e = (i >> 1) & 3;
        let m = (i & 1) as i8;
        // Doubled E2M1: subnormal (e = 0) is m; normal is 2^e * (1 + m/2).
        let mag = if e == 0 { m } else { (1i8 << e) + m * (1i8 << (e - 1)) };
        t[i] = if i & 8 != 0 { -mag } else { mag };
        i += 1;
    }
    t
};

/// [`IQ2XXS_GRID`] as f32 rows (for the CPU SIMD kernels: one 32-byte load per 8 weights).
#[repr(C, align(32))]
pub(crate) struct GridF32(pub(crate) [[f32; 8]; 256]);

pub(crate) static IQ2XXS_GRID_F32: GridF32 = GridF32({
    let mut t = [[0f32; 8]; 256];
    let mut i = 0;
    while i < 256 {
        let mut k = 0;
        while k < 8 {
            t[i][k] = ((IQ2XXS_GRID[i] >> (8 * k)) & 0xff) as u8 as f32;
            k += 1;
        }
        i += 1;
    }
    t
});

/// [`KSIGNS_IQ2XS`] expanded to f32 sign-bit masks (lane `k` is `0x8000_0000` when bit `k` is
/// set): XOR-ing a row of [`IQ2XXS_GRID_F32`] with one applies the signs.
#[repr(C, align(32))]
pub(crate) struct SignMasks(pub(crate) [[u32; 8]; 128]);

pub(crate) static IQ2XXS_SIGN_MASKS: SignMasks = SignMasks({
    let mut t = [[0u32; 8]; 128];
    let mut i = 0;
    while i < 128 {
        let mut k = 0;
        while k < 8 {
            if KSIGNS_IQ2XS[i] & (1 << k) != 0 {
                t[i][k] = 0x8000_0000;
            }
            k += 1;
        }
        i += 1;
    }
    t
});

/// [`KSIGNS_IQ2XS`] expanded to i8 signs, 8 per entry as a little-endian u64 (byte `k` is -1
/// when bit `k` is set, else 1): for `_mm256_sign_epi8` in the 8-bit activation dot.
pub(crate) static IQ2XXS_SIGNS_I8: [u64; 128] = {
    let mut t = [0u64; 128];
    let mut i = 0;
    while i < 128 {
        let mut k = 0;
        while k < 8 {
            let b: u64 = if KSIGNS_IQ2XS[i] & (1 << k) != 0 { 0xff } else { 0x01 };
            t[i] |= b << (8 * k);
            k += 1;
        }
        i += 1;
    }
    t
};

#[cfg(test)]
mod tests {
    use super::*;

    /// gguf-py's `IQ2_XXS.grid_hex` (gguf/quants.py): the same grid with each coordinate
    /// packed in 2 bits (0x08 -> 0, 0x19 -> 1, 0x2b -> 2), 4 coordinates per byte, low bits
    /// first, each byte written as two hex digits.
    const GRID_HEX: &str = concat!(
        "00000200050008000a00110014002000220028002a0041004400500058006100",
        "6400800082008a00a20001010401100115014001840198010002020222028202",
        "010404041004210424044004420448046004810484049004a404000502050805",
        "200546056905800591050906100640068406a406000805080808140828084108",
        "440850085208880804094009020a140a01100410101021104010601084109010",
        "951000110811201150115a118011241245120014081420142514491480141815",
        "6215001616160118041810184018811800190519a019511a002002200a204420",
        "6120802082202921482100220222012404241024402456240025412564259026",
        "082820289428442a014004401040184021402440404048405640604081408440",
        "9040004120416141804185410142104248425642684200440844204480449944",
        "124524450046014804481048404845480049584961498249454a904a00500850",
        "1150195020508050885004514251a4519152905492540a550156545600581158",
        "195864584059085a046010604060686000615561186260620064056410651265",
        "84654268008002800a8041808280048118814081118201840484108415844084",
        "608400854685948509864086608602880489118a0490109024904090a1901691",
        "8091459200942294449451958198209902a050a085a009a100a218a450a804a9",
    );

    #[test]
    fn iq2xxs_grid_matches_packed_form() {
        let hex = GRID_HEX.as_bytes();
        assert_eq!(hex.len(), 1024);
        let nib = |c: u8| (c as char).to_digit(16).unwrap() as u8;
        let map = [0x08u64, 0x19, 0x2b];
        for (i, row) in IQ2XXS_GRID.iter().enumerate() {
            let mut want = 0u64;
            for b in 0..2 {
                let p = 4 * i + 2 * b;
                let byte = (nib(hex[p]) << 4) | nib(hex[p + 1]);
                for j in 0..4 {
                    let c = (byte >> (2 * j)) & 3;
                    assert!(c < 3, "row {i}: code 3 is not a grid value");
                    want |= map[c as usize] << (8 * (4 * b + j));
                }
            }
            assert_eq!(*row, want, "row {i}");
        }
    }

    #[test]
    fn iq2xxs_grid_bytes_and_checksum() {
        let mut sum = 0u64;
        let mut xor = 0u64;
        for &row in &IQ2XXS_GRID {
            for k in 0..8 {
                assert!(matches!((row >> (8 * k)) as u8, 0x08 | 0x19 | 0x2b));
            }
            sum = sum.wrapping_add(row);
            xor ^= row;
        }
        // Computed from gguf-py's decoded grid.
        assert_eq!(sum, 10026840302681211747);
        assert_eq!(xor, 0x3232003211);
        // Spot checks against ggml-common.h.
        assert_eq!(IQ2XXS_GRID[0], 0x0808080808080808);
        assert_eq!(IQ2XXS_GRID[1], 0x080808080808082b);
        assert_eq!(IQ2XXS_GRID[255], 0x2b2b2b1908081908);
    }

    #[test]
    fn ksigns_match_ggml() {
        // The first and last 16 entries of ggml's ksigns_iq2xs.
        let head = [0u8, 129, 130, 3, 132, 5, 6, 135, 136, 9, 10, 139, 12, 141, 142, 15];
        let tail = [240u8, 113, 114, 243, 116, 245, 246, 119, 120, 249, 250, 123, 252, 125, 126, 255];
        assert_eq!(KSIGNS_IQ2XS[..16], head);
        assert_eq!(KSIGNS_IQ2XS[112..], tail);
        for &s in &KSIGNS_IQ2XS {
            assert_eq!(s.count_ones() % 2, 0);
        }
    }

    #[test]
    fn kvalues_mxfp4() {
        assert_eq!(KVALUES_MXFP4, [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12]);
    }

    #[test]
    fn f32_tables_follow_the_integer_tables() {
        for i in 0..256 {
            for k in 0..8 {
                assert_eq!(IQ2XXS_GRID_F32.0[i][k], ((IQ2XXS_GRID[i] >> (8 * k)) & 0xff) as f32);
            }
        }
        for i in 0..128 {
            for k in 0..8 {
                assert_eq!(IQ2XXS_SIGN_MASKS.0[i][k] != 0, KSIGNS_IQ2XS[i] >> k & 1 == 1);
            }
        }
    }
}
