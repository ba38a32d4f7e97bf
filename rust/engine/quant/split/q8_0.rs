//! Q8_0 (blocks of 34 bytes: f16 d, then 32 signed quants) for the tensor-core kernel
//! (shaders/cuda/q8_0.cu: short rows by default, all with `DS4_CUDA_Q8=mma`), which multiplies tiles of 16 rows by one block
//! at a time. (The float-x kernel's layout is `split_scale_first` in `mod.rs`.)
//!
//! - **Tiles.** Each whole group of 16 rows of a matrix (counted from the matrix's first row)
//!   is stored as one run of `16 * row_bytes` bytes: for each block `k`, 512 quant bytes at
//!   `512 k` in the order of the m16n8k32 A operand, then the scales. Lane `l` (`g = l / 4`,
//!   `t = l % 4`) finds its 16 bytes at `512 k + 16 l`: row `g`'s bytes `4t..4t+4`, row
//!   `g + 8`'s same, row `g`'s bytes `16+4t..20+4t`, row `g + 8`'s same. The scales follow at
//!   `512 n_blocks`: for each block 32 bytes, rows `g` and `g + 8`'s f16 at `32 k + 4 g`. A
//!   warp reads a tile's block with one contiguous 512-byte load and its scales with 32 bytes.
//! - **The last rows** of a matrix whose row count is not a multiple of 16 stay row by row:
//!   the quant bytes of blocks `2j` and `2j + 1` as one 64-byte pair at `64 j`, in which the 16
//!   bytes at `64 j + 16 t` are block `2j`'s bytes `4t..4t+4` and `16+4t..20+4t`, then block
//!   `2j+1`'s same (a lane's A operand of one row for two blocks); a last odd block puts its 8
//!   bytes per `t` at `64 j + 8 t`. Then the row's scales, in block order.
//!
//! A matrix here is a *plane*: the rows of a 2-D tensor, or of one expert of a 3-D one, so
//! that every expert's rows start a tile.

/// Rows of a tile.
pub(crate) const TILE_ROWS: usize = 16;

/// Where block `k` (of `nb`) of a row-by-row row puts its bytes `4t..4t+4` (and, 4 bytes
/// further, `16+4t..20+4t`) in the payload.
fn at(k: usize, nb: usize, t: usize) -> usize {
    let base = 64 * (k / 2);
    if k.is_multiple_of(2) && k + 1 == nb {
        base + 8 * t
    } else {
        base + 16 * t + 8 * (k % 2)
    }
}

/// GGUF row `src` to the row-by-row layout `dst`.
fn split_row(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 34;
    let (pay, hdr) = dst.split_at_mut(32 * nb);
    for (k, b) in src.chunks_exact(34).enumerate() {
        hdr[2 * k..2 * k + 2].copy_from_slice(&b[..2]);
        let q = &b[2..];
        for t in 0..4 {
            let o = at(k, nb, t);
            pay[o..o + 4].copy_from_slice(&q[4 * t..4 * t + 4]);
            pay[o + 4..o + 8].copy_from_slice(&q[16 + 4 * t..20 + 4 * t]);
        }
    }
}

/// The inverse of [`split_row`].
#[cfg(test)]
fn unsplit_row(src: &[u8], dst: &mut [u8]) {
    let nb = src.len() / 34;
    let (pay, hdr) = src.split_at(32 * nb);
    for (k, b) in dst.chunks_exact_mut(34).enumerate() {
        b[..2].copy_from_slice(&hdr[2 * k..2 * k + 2]);
        let q = &mut b[2..];
        for t in 0..4 {
            let o = at(k, nb, t);
            q[4 * t..4 * t + 4].copy_from_slice(&pay[o..o + 4]);
            q[16 + 4 * t..20 + 4 * t].copy_from_slice(&pay[o + 4..o + 8]);
        }
    }
}

/// For lane `l`'s 16 bytes of a tile's block: the (row, first quant byte) of each 4 bytes.
fn lane_parts(l: usize) -> [(usize, usize); 4] {
    let (g, t) = (l / 4, l % 4);
    [(g, 4 * t), (g + 8, 4 * t), (g, 16 + 4 * t), (g + 8, 16 + 4 * t)]
}

/// 16 GGUF rows `src` (`row_bytes` each) to the tile `dst`.
fn split_tile(src: &[u8], row_bytes: usize, dst: &mut [u8]) {
    let nb = row_bytes / 34;
    let (pay, hdr) = dst.split_at_mut(512 * nb);
    for k in 0..nb {
        let block = |r: usize| &src[r * row_bytes + 34 * k..][..34];
        for l in 0..32 {
            for (i, (r, q)) in lane_parts(l).into_iter().enumerate() {
                pay[512 * k + 16 * l + 4 * i..][..4].copy_from_slice(&block(r)[2 + q..2 + q + 4]);
            }
        }
        for g in 0..8 {
            for h in 0..2 {
                hdr[32 * k + 4 * g + 2 * h..][..2].copy_from_slice(&block(g + 8 * h)[..2]);
            }
        }
    }
}

/// The inverse of [`split_tile`].
#[cfg(test)]
fn unsplit_tile(src: &[u8], row_bytes: usize, dst: &mut [u8]) {
    let nb = row_bytes / 34;
    let (pay, hdr) = src.split_at(512 * nb);
    for k in 0..nb {
        let mut block = |r: usize, off: usize, bytes: &[u8]| {
            dst[r * row_bytes + 34 * k + off..][..bytes.len()].copy_from_slice(bytes);
        };
        for l in 0..32 {
            for (i, (r, q)) in lane_parts(l).into_iter().enumerate() {
                block(r, 2 + q, &pay[512 * k + 16 * l + 4 * i..][..4]);
            }
        }
        for g in 0..8 {
            for h in 0..2 {
                block(g + 8 * h, 0, &hdr[32 * k + 4 * g + 2 * h..][..2]);
            }
        }
    }
}

/// Rewrites `rows` (whole GGUF rows of `row_bytes`), which start at row `pos` of a plane of
/// `plane` rows, in the device layout: tiles, and the plane's last `plane % 16` rows row by
/// row. `pos` must start a tile and `rows` must end at a tile's end or a plane's end.
pub(super) fn split(rows: &mut [u8], row_bytes: usize, plane: usize, pos: usize) {
    walk(rows, row_bytes, plane, pos, split_tile, split_row);
}

/// The inverse of [`split`].
#[cfg(test)]
pub(super) fn unsplit(rows: &mut [u8], row_bytes: usize, plane: usize, pos: usize) {
    walk(rows, row_bytes, plane, pos, unsplit_tile, unsplit_row);
}

/// Applies `tile` to each whole tile of `rows` and `row` to each row of a plane's tail (from a
/// copy of the source bytes).
fn walk(
    rows: &mut [u8],
    row_bytes: usize,
    plane: usize,
    pos: usize,
    tile: fn(&[u8], usize, &mut [u8]),
    row: fn(&[u8], &mut [u8]),
) {
    debug_assert!(plane > 0 && pos.is_multiple_of(TILE_ROWS) && pos < plane);
    let n = rows.len() / row_bytes;
    let mut src = vec![0u8; TILE_ROWS * row_bytes];
    let mut r = 0;
    while r < n {
        let p = (pos + r) % plane;
        if plane - p >= TILE_ROWS {
            debug_assert!(r + TILE_ROWS <= n, "a piece ends inside a tile");
            let t = &mut rows[r * row_bytes..(r + TILE_ROWS) * row_bytes];
            src.copy_from_slice(t);
            tile(&src, row_bytes, t);
            r += TILE_ROWS;
        } else {
            let t = &mut rows[r * row_bytes..(r + 1) * row_bytes];
            src[..row_bytes].copy_from_slice(t);
            row(&src[..row_bytes], t);
            r += 1;
        }
    }
}

/// Whether the rows `first..first + n` of a plane-structured tensor (`plane` rows a plane) can
/// be multiplied as one matrix by the kernel, which takes the first `n / 16` tiles as tiles and
/// the rest row by row: the range starts a tile, and its last rows, if not a whole tile, are a
/// plane's tail.
pub(crate) fn takes_rows(first: usize, n: usize, plane: usize) -> bool {
    let pos = first % plane;
    if !pos.is_multiple_of(TILE_ROWS) || n == 0 {
        return false;
    }
    if pos + n <= plane {
        n.is_multiple_of(TILE_ROWS) || pos + n == plane
    } else {
        plane.is_multiple_of(TILE_ROWS) && n.is_multiple_of(TILE_ROWS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::split::random_rows;
    use crate::quant::GgmlType;

    /// A tile: lane l's 16 bytes of block k are its m16n8k32 A operand; the scales of rows g
    /// and g + 8 at 32 k + 4 g.
    #[test]
    fn tiles_in_fragment_order_then_scales() {
        let nb = 3;
        let (src, rb) = random_rows(GgmlType::Q8_0, nb * 32, 16, 5);
        let mut dst = src.clone();
        split(&mut dst, rb, 16, 0);
        let quant = |r: usize, k: usize, i: usize| src[r * rb + 34 * k + 2 + i];
        // Block 2, lane 13 (g = 3, t = 1).
        let lane = &dst[512 * 2 + 16 * 13..][..16];
        let want: Vec<u8> = [(3, 4), (11, 4), (3, 20), (11, 20)]
            .iter()
            .flat_map(|&(r, i)| (i..i + 4).map(move |j| quant(r, 2, j)))
            .collect();
        assert_eq!(lane, &want[..]);
        assert_eq!(&dst[512 * nb + 32 + 4 * 3 + 2..][..2], &src[11 * rb + 34..][..2], "block 1, row 11's scale");
    }

    /// Rows past the last whole tile of a plane: row by row, block pairs in fragment order.
    #[test]
    fn a_planes_tail_is_row_by_row() {
        let nb = 19;
        let (src, rb) = random_rows(GgmlType::Q8_0, nb * 32, 1, 3);
        let mut dst = src.clone();
        split(&mut dst, rb, 1, 0);
        let quant = |k: usize, i: usize| src[34 * k + 2 + i];
        // Pair 8 (blocks 16, 17), lane t = 2: block 16 bytes 8..12, 24..28, then block 17's.
        let lane = &dst[64 * 8 + 16 * 2..][..16];
        let want: Vec<u8> = [(16, 8), (16, 24), (17, 8), (17, 24)]
            .iter()
            .flat_map(|&(k, i)| (i..i + 4).map(move |j| quant(k, j)))
            .collect();
        assert_eq!(lane, &want[..]);
        // The lone block 18: lane 3's 8 bytes at 64 * 9 + 24.
        let lone: Vec<u8> = (12..16).chain(28..32).map(|j| quant(18, j)).collect();
        assert_eq!(&dst[64 * 9 + 24..][..8], &lone[..]);
        assert_eq!(&dst[32 * nb + 2 * 17..][..2], &src[34 * 17..34 * 17 + 2]);
    }

    /// Planes of 37 rows: two tiles and 5 tail rows each, undone exactly; a plane-structured
    /// split equals splitting each plane alone.
    #[test]
    fn planes_split_alone_and_undo() {
        let (orig, rb) = random_rows(GgmlType::Q8_0, 5 * 32, 3 * 37, 11);
        let mut all = orig.clone();
        split(&mut all, rb, 37, 0);
        let mut each = orig.clone();
        for p in each.chunks_exact_mut(37 * rb) {
            split(p, rb, 37, 0);
        }
        assert_eq!(all, each);
        // The second plane from its second tile on, as an upload piece would be.
        let mut piece = orig[(37 + 16) * rb..2 * 37 * rb].to_vec();
        split(&mut piece, rb, 37, 16);
        assert_eq!(piece, all[(37 + 16) * rb..2 * 37 * rb]);
        unsplit(&mut all, rb, 37, 0);
        assert_eq!(all, orig);
    }

    #[test]
    fn which_row_ranges_the_kernel_takes() {
        // Whole planes, tiles from a tile start, a tail that ends its plane.
        assert!(takes_rows(0, 37, 37) && takes_rows(37, 37, 37) && takes_rows(37 + 16, 21, 37));
        assert!(takes_rows(0, 32, 64) && takes_rows(32, 64, 64) && takes_rows(16, 5, 21));
        // Not a tile start; a partial tile inside a plane; planes with tails spanned.
        assert!(!takes_rows(8, 8, 24) && !takes_rows(0, 20, 37) && !takes_rows(0, 74, 37));
        assert!(!takes_rows(0, 0, 16));
    }
}
