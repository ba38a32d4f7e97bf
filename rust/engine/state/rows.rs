//! Append-only rows in shared chunks.

use std::sync::Arc;

/// Rows per chunk: big enough that the chunk list stays short, small enough that copying the
/// chunk being filled (on the first write after a snapshot) is cheap.
const CHUNK_ROWS: usize = 64;

/// An append-only list of `width`-wide f32 rows. Cloning it is O(number of chunks) and
/// shares the row data; a clone never sees rows appended to the other.
#[derive(Clone, Debug)]
pub struct RowStore {
    width: usize,
    len: usize,
    chunks: Vec<Arc<Vec<f32>>>,
}

impl RowStore {
    pub fn new(width: usize) -> Self {
        RowStore { width, len: 0, chunks: Vec::new() }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn width(&self) -> usize {
        self.width
    }

    /// Row `i` (`i < len()`).
    #[inline]
    pub fn row(&self, i: usize) -> &[f32] {
        let c = &self.chunks[i / CHUNK_ROWS];
        let o = (i % CHUNK_ROWS) * self.width;
        &c[o..o + self.width]
    }

    pub fn push(&mut self, row: &[f32]) {
        debug_assert_eq!(row.len(), self.width);
        if self.len.is_multiple_of(CHUNK_ROWS) {
            self.chunks.push(Arc::new(Vec::with_capacity(CHUNK_ROWS * self.width)));
        }
        let last = self.chunks.last_mut().expect("a chunk was just ensured");
        // Copy-on-write: a snapshot sharing this chunk keeps its own shorter copy.
        let chunk = Arc::make_mut(last);
        chunk.truncate((self.len % CHUNK_ROWS) * self.width);
        chunk.extend_from_slice(row);
        self.len += 1;
    }

    /// Drops the rows from `len` on (no-op if there are fewer).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.chunks.truncate(len.div_ceil(CHUNK_ROWS));
        if !len.is_multiple_of(CHUNK_ROWS) {
            let last = self.chunks.last_mut().expect("a partial chunk remains");
            Arc::make_mut(last).truncate((len % CHUNK_ROWS) * self.width);
        }
        self.len = len;
    }

    /// Every row's values, in order (for digests and tests).
    pub fn iter_values(&self) -> impl Iterator<Item = f32> + '_ {
        (0..self.len).flat_map(move |i| self.row(i).iter().copied())
    }

    /// Bytes of row data.
    pub fn nbytes(&self) -> usize {
        self.len * self.width * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_are_isolated() {
        let mut a = RowStore::new(3);
        for i in 0..70 {
            a.push(&[i as f32; 3]);
        }
        let snap = a.clone();
        for i in 70..200 {
            a.push(&[i as f32; 3]);
        }
        let mut b = snap.clone();
        b.push(&[-1.0; 3]);
        assert_eq!(snap.len(), 70);
        assert_eq!(b.row(70), &[-1.0; 3]);
        assert_eq!(a.row(70), &[70.0; 3]);
        assert_eq!(a.row(199), &[199.0; 3]);
        assert_eq!(b.row(69), &[69.0; 3]);
    }

    #[test]
    fn truncate_then_push() {
        let mut a = RowStore::new(2);
        for i in 0..130 {
            a.push(&[i as f32; 2]);
        }
        let snap = a.clone();
        for cut in [129, 128, 64, 63, 1, 0] {
            let mut b = snap.clone();
            b.truncate(cut);
            assert_eq!(b.len(), cut);
            b.push(&[-1.0; 2]);
            assert_eq!(b.row(cut), &[-1.0; 2]);
            if cut > 0 {
                assert_eq!(b.row(cut - 1), &[(cut - 1) as f32; 2]);
            }
        }
        assert_eq!(snap.row(129), &[129.0; 2]);
    }
}
