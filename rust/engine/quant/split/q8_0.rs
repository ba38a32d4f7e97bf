//! Q8_0 (blocks of 34 bytes: f16 d, then 32 signed quants) split: the 32 quants of every
//! block, then the 2-byte scales, both in block order.

/// GGUF row `src` to the split row `dst`.
pub(super) fn split(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 34;
    let (pay, hdr) = dst.split_at_mut(32 * nb);
    for (k, b) in src.chunks_exact(34).enumerate() {
        hdr[2 * k..2 * k + 2].copy_from_slice(&b[..2]);
        pay[32 * k..32 * k + 32].copy_from_slice(&b[2..]);
    }
}

/// The inverse of [`split`].
#[cfg(test)]
pub(super) fn unsplit(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 34;
    let (pay, hdr) = src.split_at(32 * nb);
    for (k, b) in dst.chunks_exact_mut(34).enumerate() {
        b[..2].copy_from_slice(&hdr[2 * k..2 * k + 2]);
        b[2..].copy_from_slice(&pay[32 * k..32 * k + 32]);
    }
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
