//! The split row layouts of Q8_0, Q2_K and IQ2_XXS that the CUDA backend keeps in device
//! memory: each row's blocks split into their payloads (the quant bytes, 16-byte multiples)
//! and their headers (scales), payloads first, each format arranged for its kernel
//! (`shaders/cuda/<format>.cu`, read by `matvec_split` in `shaders/cuda/common.cuh`; Q8_0 has
//! a second layout for its tensor-core kernel in `q8_0.cu`).
//!
//! In GGUF order the blocks of these formats are 34, 84 and 66 bytes, so a block's quant
//! bytes are only 2- or 4-byte aligned and a kernel must either stage rows through shared
//! memory or read them in small pieces. Split, the payloads of a row are one contiguous run
//! that a warp reads with one 16-byte load per lane: in 512-byte *chunks* (16 Q8_0 blocks, 8
//! super-blocks of the others, lane `l` bytes `512 c + 16 l`), or, for Q8_0 on the tensor
//! cores, in the operand order of its tiles (`q8_0.rs`); the headers follow at
//! `n_blocks * payload`. A row keeps its size and stays where it was (the split never mixes
//! rows), so the split happens in place at upload and every product, row or expert offset
//! the host computes stays valid.
//!
//! Each format's file (`q8_0.rs`, `q2_k.rs`, `iq2_xxs.rs`) defines its layout: `split`, from a
//! GGUF row to a split one, and, for the tests, `unsplit`, its inverse.

mod iq2_xxs;
mod q2_k;
pub(crate) mod q8_0;

use crate::quant::GgmlType;

/// Whether `ty` has a split layout (rows of it are stored split on the device).
pub(crate) fn is_split(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q2_K | GgmlType::IQ2_XXS)
}

/// Rewrites `rows` (whole rows of `ty`, GGUF order) in the split layout, in place.
/// `row_bytes` must be the format's row size for a whole number of blocks. `tiles`: for Q8_0,
/// the tensor-core kernel's layout (`q8_0.rs`), which groups rows in tiles of their *plane*:
/// `Some((plane, pos))` when `rows` start at row `pos` of a plane of `plane` rows, at a tile's
/// start, and end at a tile's or a plane's end; `None` for the float-x kernel's layout. The
/// other formats split each row alone and ignore it.
pub(crate) fn split_rows(ty: GgmlType, row_bytes: usize, rows: &mut [u8], tiles: Option<(usize, usize)>) {
    let nb = row_bytes / ty.block_bytes();
    debug_assert!(row_bytes == nb * ty.block_bytes() && rows.len().is_multiple_of(row_bytes));
    if let (GgmlType::Q8_0, Some((plane, pos))) = (ty, tiles) {
        return q8_0::split(rows, row_bytes, plane, pos);
    }
    let mut src = vec![0u8; row_bytes];
    for row in rows.chunks_exact_mut(row_bytes) {
        src.copy_from_slice(row);
        match ty {
            GgmlType::Q8_0 => split_scale_first(34, &src, row),
            GgmlType::Q2_K => q2_k::split(&src, row),
            GgmlType::IQ2_XXS => iq2_xxs::split(&src, row),
            _ => unreachable!("no split layout for {ty}"),
        }
    }
}

/// The inverse of [`split_rows`] (tests: the layout loses nothing).
#[cfg(test)]
pub(crate) fn unsplit_rows(ty: GgmlType, row_bytes: usize, rows: &mut [u8], tiles: Option<(usize, usize)>) {
    if let (GgmlType::Q8_0, Some((plane, pos))) = (ty, tiles) {
        return q8_0::unsplit(rows, row_bytes, plane, pos);
    }
    let mut src = vec![0u8; row_bytes];
    for row in rows.chunks_exact_mut(row_bytes) {
        src.copy_from_slice(row);
        match ty {
            GgmlType::Q8_0 => unsplit_scale_first(34, &src, row),
            GgmlType::Q2_K => q2_k::unsplit(&src, row),
            GgmlType::IQ2_XXS => iq2_xxs::unsplit(&src, row),
            _ => unreachable!("no split layout for {ty}"),
        }
    }
}

/// The split of a format whose blocks are a 2-byte scale, then the payload (Q8_0 for the
/// float-x kernel, IQ2_XXS):
/// the payloads of all blocks of GGUF row `src` (blocks of `block` bytes), then the scales,
/// both in block order, into `dst`.
fn split_scale_first(block: usize, src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / block;
    let (pay, hdr) = dst.split_at_mut((block - 2) * nb);
    for (k, (b, p)) in src.chunks_exact(block).zip(pay.chunks_exact_mut(block - 2)).enumerate() {
        hdr[2 * k..2 * k + 2].copy_from_slice(&b[..2]);
        p.copy_from_slice(&b[2..]);
    }
}

/// The inverse of [`split_scale_first`].
#[cfg(test)]
fn unsplit_scale_first(block: usize, src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / block;
    let (pay, hdr) = src.split_at((block - 2) * nb);
    for (k, (b, p)) in dst.chunks_exact_mut(block).zip(pay.chunks_exact(block - 2)).enumerate() {
        b[..2].copy_from_slice(&hdr[2 * k..2 * k + 2]);
        b[2..].copy_from_slice(p);
    }
}

/// Test rows: `count` rows of `n_in` random bytes' worth of blocks of `ty`, and their size.
#[cfg(test)]
pub(crate) fn random_rows(ty: GgmlType, n_in: usize, count: usize, seed: u64) -> (Vec<u8>, usize) {
    let mut rng = crate::quant::testutil::Rng(seed);
    let row_bytes = ty.row_bytes(n_in as u64).expect("row bytes") as usize;
    ((0..count * row_bytes).map(|_| rng.next_u64() as u8).collect(), row_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitting_is_undone_by_unsplitting() {
        assert!(!is_split(GgmlType::F16) && !is_split(GgmlType::Q4_K));
        for ty in [GgmlType::Q8_0, GgmlType::Q2_K, GgmlType::IQ2_XXS] {
            assert!(is_split(ty));
            // One block, a partial chunk after whole ones, whole chunks only.
            for n_in in [ty.block_elems(), 7 * ty.block_elems(), 19 * ty.block_elems(), 4096] {
                // Q8_0 tiles: one tile and a tail of 3 rows.
                for tiles in [None, Some((19, 0))] {
                    let (orig, row_bytes) = random_rows(ty, n_in, 19, n_in as u64);
                    let mut m = orig.clone();
                    split_rows(ty, row_bytes, &mut m, tiles);
                    assert_ne!(m, orig, "{ty} x {n_in}");
                    unsplit_rows(ty, row_bytes, &mut m, tiles);
                    assert_eq!(m, orig, "{ty} x {n_in}");
                }
            }
        }
    }
}
