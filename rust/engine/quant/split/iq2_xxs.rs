//! IQ2_XXS (super-blocks of 66 bytes: f16 d, then 8 groups of 8 bytes) split: the 64 group
//! bytes of every super-block, then the 2-byte d's, both in super-block order.

/// GGUF row `src` to the split row `dst`.
pub(super) fn split(src: &[u8], dst: &mut [u8]) {
    super::split_scale_first(66, src, dst);
}

/// The inverse of [`split`].
#[cfg(test)]
pub(super) fn unsplit(src: &[u8], dst: &mut [u8]) {
    super::unsplit_scale_first(66, src, dst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::split::random_rows;
    use crate::quant::GgmlType;

    #[test]
    fn groups_then_scales_in_block_order() {
        let (src, rb) = random_rows(GgmlType::IQ2_XXS, 19 * 256, 1, 6);
        let mut dst = vec![0u8; rb];
        split(&src, &mut dst);
        assert_eq!(&dst[64 * 17..64 * 18], &src[66 * 17 + 2..66 * 18]);
        assert_eq!(&dst[64 * 19 + 2 * 17..][..2], &src[66 * 17..66 * 17 + 2]);
    }
}
