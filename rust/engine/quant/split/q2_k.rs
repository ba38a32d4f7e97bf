//! Q2_K (super-blocks of 84 bytes: 16 scale bytes, 64 bytes of 2-bit quants qs, f16 d, f16
//! dmin) split: the qs of every super-block, then per super-block 20 header bytes: the scale
//! bytes reordered, then d and dmin. Scale byte `8h + 2s + f` (half `h` of the quants, shift
//! `s`, 16-quant half `f`) moves to `8h + 4f + s`: a lane that holds quants `16f..16f + 16` of
//! half `h` reads the four scales of its shifts as one 32-bit word.

/// The split position of GGUF scale byte `8h + 2s + f`, for each GGUF position.
fn scale_at(g: usize) -> usize {
    let (h, s, f) = (g / 8, g % 8 / 2, g % 2);
    8 * h + 4 * f + s
}

/// GGUF row `src` to the split row `dst`.
pub(super) fn split(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 84;
    let (pay, hdr) = dst.split_at_mut(64 * nb);
    for (k, b) in src.chunks_exact(84).enumerate() {
        pay[64 * k..64 * k + 64].copy_from_slice(&b[16..80]);
        let h = &mut hdr[20 * k..20 * k + 20];
        for g in 0..16 {
            h[scale_at(g)] = b[g];
        }
        h[16..20].copy_from_slice(&b[80..84]);
    }
}

/// The inverse of [`split`].
#[cfg(test)]
pub(super) fn unsplit(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 84;
    let (pay, hdr) = src.split_at(64 * nb);
    for (k, b) in dst.chunks_exact_mut(84).enumerate() {
        b[16..80].copy_from_slice(&pay[64 * k..64 * k + 64]);
        let h = &hdr[20 * k..20 * k + 20];
        for g in 0..16 {
            b[g] = h[scale_at(g)];
        }
        b[80..84].copy_from_slice(&h[16..20]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::split::random_rows;
    use crate::quant::GgmlType;

    #[test]
    fn scales_of_a_lane_are_one_word() {
        let (src, rb) = random_rows(GgmlType::Q2_K, 512, 1, 4);
        let mut dst = vec![0u8; rb];
        split(&src, &mut dst);
        assert_eq!(&dst[64..128], &src[84 + 16..84 + 80]);
        let h = &dst[128 + 20..];
        // Half 1, quants 16.., shift 2: GGUF byte 8 + 4 + 1, split byte 8 + 4 + 2.
        assert_eq!(h[8 + 4 + 2], src[84 + 8 + 2 * 2 + 1]);
        assert_eq!(&h[16..20], &src[84 + 80..84 + 84]);
    }
}
