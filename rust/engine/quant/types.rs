//! GGML tensor type ids and their block geometry.
//!
//! The table is data (ids and sizes as ggml defines them); it lets the GGUF reader validate
//! the size of every tensor, including types the engine cannot compute with, so that a file
//! holding e.g. a Q6_K tensor still opens and only reading that tensor fails.

/// A GGML tensor type, by its on-disk id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    IQ2_XXS = 16,
    IQ2_XS = 17,
    IQ3_XXS = 18,
    IQ1_S = 19,
    IQ4_NL = 20,
    IQ3_S = 21,
    IQ2_S = 22,
    IQ4_XS = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    IQ1_M = 29,
    BF16 = 30,
    TQ1_0 = 34,
    TQ2_0 = 35,
    MXFP4 = 39,
    NVFP4 = 40,
    Q1_0 = 41,
}

/// (type, name, elements per block, bytes per block), as ggml defines them.
const TABLE: &[(GgmlType, &str, usize, usize)] = &[
    (GgmlType::F32, "F32", 1, 4),
    (GgmlType::F16, "F16", 1, 2),
    (GgmlType::Q4_0, "Q4_0", 32, 18),
    (GgmlType::Q4_1, "Q4_1", 32, 20),
    (GgmlType::Q5_0, "Q5_0", 32, 22),
    (GgmlType::Q5_1, "Q5_1", 32, 24),
    (GgmlType::Q8_0, "Q8_0", 32, 34),
    (GgmlType::Q8_1, "Q8_1", 32, 40),
    (GgmlType::Q2_K, "Q2_K", 256, 84),
    (GgmlType::Q3_K, "Q3_K", 256, 110),
    (GgmlType::Q4_K, "Q4_K", 256, 144),
    (GgmlType::Q5_K, "Q5_K", 256, 176),
    (GgmlType::Q6_K, "Q6_K", 256, 210),
    (GgmlType::Q8_K, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, "IQ4_XS", 256, 136),
    (GgmlType::I8, "I8", 1, 1),
    (GgmlType::I16, "I16", 1, 2),
    (GgmlType::I32, "I32", 1, 4),
    (GgmlType::I64, "I64", 1, 8),
    (GgmlType::F64, "F64", 1, 8),
    (GgmlType::IQ1_M, "IQ1_M", 256, 56),
    (GgmlType::BF16, "BF16", 1, 2),
    (GgmlType::TQ1_0, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, "MXFP4", 32, 17),
    (GgmlType::NVFP4, "NVFP4", 64, 36),
    (GgmlType::Q1_0, "Q1_0", 128, 18),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, &'static str, usize, usize) {
        // The table is small and covers every variant (checked by a unit test).
        TABLE.iter().find(|e| e.0 == self).expect("every GgmlType is in TABLE")
    }

    /// The type with this on-disk id, or `None` for an id ggml does not define.
    pub fn from_id(id: u32) -> Option<Self> {
        TABLE.iter().find(|e| e.0 as u32 == id).map(|e| e.0)
    }

    /// The type with this name ("Q8_0", "IQ2_XXS", ...), case-insensitive.
    pub fn from_name(name: &str) -> Option<Self> {
        TABLE.iter().find(|e| e.1.eq_ignore_ascii_case(name)).map(|e| e.0)
    }

    /// The on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The ggml name ("Q8_0", ...).
    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_elems(self) -> usize {
        self.entry().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.entry().3
    }

    /// Bytes of a row of `n` elements, or `None` if `n` is not a whole number of blocks or
    /// the size overflows.
    pub fn row_bytes(self, n: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n.is_multiple_of(be) {
            return None;
        }
        (n / be).checked_mul(self.block_bytes() as u64)
    }

    /// Whether the engine can dequantize this type (and take dot products with it).
    pub fn is_supported(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q2_K
                | GgmlType::IQ2_XXS
                | GgmlType::MXFP4
        )
    }

    /// Whether this is an integer table type (I8..I64): read as integers, never dequantized.
    pub fn is_integer(self) -> bool {
        matches!(self, GgmlType::I8 | GgmlType::I16 | GgmlType::I32 | GgmlType::I64)
    }

    /// Every type ggml defines.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TABLE.iter().map(|e| e.0)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        let mut seen = std::collections::HashSet::new();
        for t in GgmlType::all() {
            assert!(seen.insert(t.id()));
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_id(4), None); // removed Q4_2
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn row_bytes() {
        assert_eq!(GgmlType::Q8_0.row_bytes(4096), Some(128 * 34));
        assert_eq!(GgmlType::Q2_K.row_bytes(2048), Some(8 * 84));
        assert_eq!(GgmlType::Q2_K.row_bytes(100), None);
        assert_eq!(GgmlType::F32.row_bytes(u64::MAX), None);
    }
}
