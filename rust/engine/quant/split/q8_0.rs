//! Q8_0 (blocks of 34 bytes: f16 d, then 32 signed quants) split: the 32 quants of every
//! block, then the 2-byte scales, both in block order.

/// GGUF row `src` to the split row `dst`.
pub(super) fn split(src: &[u8], dst: &mut [u8]) {
    super::split_scale_first(34, src, dst);
}

/// The inverse of [`split`].
#[cfg(test)]
pub(super) fn unsplit(src: &[u8], dst: &mut [u8]) {
    super::unsplit_scale_first(34, src, dst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::split::random_rows;
    use crate::quant::GgmlType;

    #[test]
    fn quants_then_scales_in_block_order() {
        let (src, rb) = random_rows(GgmlType::Q8_0, 19 * 32, 1, 3);
        let mut dst = vec![0u8; rb];
        split(&src, &mut dst);
        assert_eq!(&dst[32 * 17..32 * 18], &src[34 * 17 + 2..34 * 18]);
        assert_eq!(&dst[32 * 19 + 2 * 17..][..2], &src[34 * 17..34 * 17 + 2]);
    }
}
