//! The split row layout of Q8_0, Q2_K and IQ2_XXS that the CUDA backend keeps in device
//! memory: each row's blocks split into their payloads (the quant bytes, 16-byte multiples)
//! and their headers (scales), payloads first.
//!
//! In GGUF order the blocks of these formats are 34, 84 and 66 bytes, so a block's quant
//! bytes are only 2- or 4-byte aligned and a kernel must either stage rows through shared
//! memory or read them in small pieces. Split, the payloads of a row are one contiguous run of
//! 32- or 64-byte pieces: lane `l` of a warp reads bytes `512 c + 16 l` of it with one 16-byte
//! load (`shaders/cuda/common.cuh`, `matvec_split`), and the headers follow at `n_blocks *
//! payload` in block order. A row keeps its size, so the split happens in place at upload
//! and every product, row or expert offset the host computes stays valid.
//!
//! | format | block | payload (GGUF bytes) | header, in the order written |
//! |---|---|---|---|
//! | Q8_0 | 34 | `2..34` (32 quants) | `0..2` (d) |
//! | IQ2_XXS | 66 | `2..66` (8 groups of 8) | `0..2` (d) |
//! | Q2_K | 84 | `16..80` (qs) | the 16 scale bytes reordered (below), then `80..84` (d, dmin) |
//!
//! Q2_K scale byte `8h + 2s + f` (half `h` of the quants, shift `s`, 16-quant half `f`) moves
//! to `8h + 4f + s`: a lane that holds quants `16f..16f + 16` of half `h` reads the four
//! scales of its shifts as one 32-bit word.

use crate::quant::GgmlType;

/// Whether `ty` has a split layout (rows of it are stored split on the device).
pub(crate) fn is_split(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::IQ2_XXS)
}

/// `(payload start, payload bytes)` within a GGUF block of a split format.
fn payload(ty: GgmlType) -> (usize, usize) {
    match ty {
        GgmlType::Q8_0 => (2, 32),
        GgmlType::IQ2_XXS => (2, 64),
        GgmlType::Q2_K => (16, 64),
        _ => unreachable!("no split layout"),
    }
}

/// Writes the header of GGUF block `b` to `out` (the block minus its payload).
fn header(ty: GgmlType, b: &[u8], out: &mut [u8]) {
    match ty {
        GgmlType::Q8_0 | GgmlType::IQ2_XXS => out.copy_from_slice(&b[..2]),
        GgmlType::Q2_K => {
            for h in 0..2 {
                for f in 0..2 {
                    for s in 0..4 {
                        out[8 * h + 4 * f + s] = b[8 * h + 2 * s + f];
                    }
                }
            }
            out[16..20].copy_from_slice(&b[80..84]);
        }
        _ => unreachable!("no split layout"),
    }
}

/// Rewrites `rows` (whole rows of `ty`, GGUF order) in the split layout, in place.
/// `row_bytes` must be the format's row size for a whole number of blocks.
pub(crate) fn split_rows(ty: GgmlType, row_bytes: usize, rows: &mut [u8]) {
    let bb = ty.block_bytes();
    let (p0, pn) = payload(ty);
    let hn = bb - pn;
    let nb = row_bytes / bb;
    debug_assert!(row_bytes == nb * bb && rows.len().is_multiple_of(row_bytes));
    let mut tmp = vec![0u8; row_bytes];
    for row in rows.chunks_exact_mut(row_bytes) {
        let (pay, hdr) = tmp.split_at_mut(nb * pn);
        for (k, b) in row.chunks_exact(bb).enumerate() {
            pay[k * pn..(k + 1) * pn].copy_from_slice(&b[p0..p0 + pn]);
            header(ty, b, &mut hdr[k * hn..(k + 1) * hn]);
        }
        row.copy_from_slice(&tmp);
    }
}

/// The inverse of [`split_rows`] (tests: the layout loses nothing).
#[cfg(test)]
pub(crate) fn unsplit_rows(ty: GgmlType, row_bytes: usize, rows: &mut [u8]) {
    let bb = ty.block_bytes();
    let (p0, pn) = payload(ty);
    let hn = bb - pn;
    let nb = row_bytes / bb;
    let mut tmp = vec![0u8; row_bytes];
    for row in rows.chunks_exact_mut(row_bytes) {
        let (pay, hdr) = row.split_at(nb * pn);
        for (k, b) in tmp.chunks_exact_mut(bb).enumerate() {
            b[p0..p0 + pn].copy_from_slice(&pay[k * pn..(k + 1) * pn]);
            let h = &hdr[k * hn..(k + 1) * hn];
            match ty {
                GgmlType::Q8_0 | GgmlType::IQ2_XXS => b[..2].copy_from_slice(h),
                _ => {
                    for hh in 0..2 {
                        for f in 0..2 {
                            for s in 0..4 {
                                b[8 * hh + 2 * s + f] = h[8 * hh + 4 * f + s];
                            }
                        }
                    }
                    b[80..84].copy_from_slice(&h[16..20]);
                }
            }
        }
        row.copy_from_slice(&tmp);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::testutil::Rng;

    #[test]
    fn splitting_is_a_permutation_of_each_row() {
        let mut rng = Rng(5);
        assert!(!is_split(GgmlType::F16) && !is_split(GgmlType::Q4_K));
        for ty in [GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::IQ2_XXS] {
            assert!(is_split(ty));
            for n_in in [ty.block_elems(), 7 * ty.block_elems(), 4096] {
                let row_bytes = ty.row_bytes(n_in as u64).unwrap() as usize;
                let orig: Vec<u8> = (0..3 * row_bytes).map(|_| rng.next_u64() as u8).collect();
                let mut m = orig.clone();
                split_rows(ty, row_bytes, &mut m);
                // Row by row, the payloads come first in block order.
                let (p0, pn) = payload(ty);
                let nb = row_bytes / ty.block_bytes();
                for r in 0..3 {
                    for k in 0..nb {
                        let b = &orig[r * row_bytes + k * ty.block_bytes()..];
                        assert_eq!(&m[r * row_bytes + k * pn..][..pn], &b[p0..p0 + pn], "{ty} row {r} block {k}");
                    }
                }
                if ty == GgmlType::Q2_K {
                    // Scale 8h + 2s + f at 8h + 4f + s of the block's header.
                    let h = &m[nb * pn..];
                    assert_eq!(h[8 + 4 + 2], orig[8 + 2 * 2 + 1]);
                    assert_eq!(&h[16..20], &orig[80..84]);
                }
                assert_ne!(m, orig);
                unsplit_rows(ty, row_bytes, &mut m);
                assert_eq!(m, orig, "{ty} x {n_in}");
            }
        }
    }
}
