//! Byte-level BPE: the GPT-2 byte <-> char mapping and merging by rank.
//!
//! A piece of text is split into its UTF-8 bytes, each byte becomes the token of its byte-level
//! char (`Ġ` for a space, ...), then adjacent pairs are merged, always the pair of lowest merge
//! rank first and, among equal ranks, the leftmost one, until no pair has a rank. This is what
//! Hugging Face `tokenizers` computes with its priority queue; short words use a plain scan that
//! computes the same thing with less bookkeeping.

use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::OnceLock;

/// The GPT-2 byte -> char table (`bytes_to_unicode`): printable Latin-1 bytes map to
/// themselves, the others to U+0100 and up in byte order.
pub fn byte_to_char() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut n = 0u32;
        for b in 0..256u32 {
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            t[b as usize] = if printable {
                char::from_u32(b).expect("Latin-1")
            } else {
                n += 1;
                char::from_u32(0xFF + n).expect("U+0100..")
            };
        }
        t
    })
}

/// The byte of a byte-level char, if it is one.
pub fn char_to_byte(c: char) -> Option<u8> {
    let u = c as u32;
    match u {
        0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF => Some(u as u8),
        0x100..=0x143 => {
            // the 68 non-printable bytes, in order
            let k = u - 0x100;
            (0..=255u8).filter(|&b| !matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)).nth(k as usize)
        }
        _ => None,
    }
}

/// The bytes a token string stands for under the byte-level decoder: the byte of each char if
/// every char is a byte-level char, else the string's own UTF-8 (as `tokenizers` does for added
/// tokens such as `<｜User｜>`).
pub fn token_bytes(token: &str) -> Vec<u8> {
    token.chars().map(char_to_byte).collect::<Option<Vec<u8>>>().unwrap_or_else(|| token.as_bytes().to_vec())
}

/// The byte-level string of `bytes` (each byte as its char).
pub fn to_byte_level(bytes: &[u8]) -> String {
    let t = byte_to_char();
    bytes.iter().map(|&b| t[b as usize]).collect()
}

/// FxHash (rustc's hasher) with a final mix: fast for the integer and short byte-string keys
/// used here.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher(u64);

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let mut tail = 0u64;
        for (i, &b) in chunks.remainder().iter().enumerate() {
            tail |= u64::from(b) << (8 * i);
        }
        self.add(tail);
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i.into());
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i.into());
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    #[inline]
    fn finish(&self) -> u64 {
        // the multiply leaves the low bits depending only on the low input bits, and hashbrown
        // picks buckets with the low bits: fold the high bits down (murmur3's finalizer)
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }
}

pub(crate) type FxMap<K, V> = HashMap<K, V, BuildHasherDefault<FxHasher>>;

const NONE: u32 = u32::MAX;

/// Words up to this many symbols merge by scanning; longer ones use a priority queue.
const SCAN_MAX: usize = 48;

/// Merge ranks over token ids.
#[derive(Debug, Clone)]
pub struct Bpe {
    /// Token id of each byte's byte-level char (`NONE` if the vocabulary lacks it: such bytes
    /// are dropped, as `tokenizers` does without an unknown token).
    byte_ids: [u32; 256],
    /// (left id, right id) -> (rank, merged id).
    merges: FxMap<u64, (u32, u32)>,
}

#[inline]
fn key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

impl Bpe {
    /// `vocab` maps byte-level token strings to ids; `merges` are the (left, right) pairs in
    /// rank order. A later duplicate of a pair replaces the earlier one (as in `tokenizers`).
    /// Errors with the index of the first merge whose parts or result are not in the vocabulary.
    pub(crate) fn new<'a>(
        vocab: &FxMap<&str, u32>,
        merges: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, (usize, String)> {
        let bl = byte_to_char();
        let mut byte_ids = [NONE; 256];
        let mut buf = [0u8; 4];
        for (b, id) in byte_ids.iter_mut().enumerate() {
            if let Some(&v) = vocab.get(bl[b].encode_utf8(&mut buf) as &str) {
                *id = v;
            }
        }
        let mut map = FxMap::default();
        let mut joined = String::new();
        for (rank, (a, b)) in merges.into_iter().enumerate() {
            let missing = |s: &str| (rank, format!("merge {rank} ({a:?} {b:?}): {s:?} is not in the vocabulary"));
            let ia = *vocab.get(a).ok_or_else(|| missing(a))?;
            let ib = *vocab.get(b).ok_or_else(|| missing(b))?;
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let new = *vocab.get(joined.as_str()).ok_or_else(|| missing(&joined))?;
            let rank = u32::try_from(rank).map_err(|_| (rank, "too many merges".to_string()))?;
            map.insert(key(ia, ib), (rank, new));
        }
        Ok(Bpe { byte_ids, merges: map })
    }

    /// Number of distinct merges.
    pub fn n_merges(&self) -> usize {
        self.merges.len()
    }

    #[inline]
    fn rank(&self, a: u32, b: u32) -> Option<(u32, u32)> {
        self.merges.get(&key(a, b)).copied()
    }

    /// Appends the tokens of one piece (raw bytes) to `out`.
    pub fn encode_word(&self, bytes: &[u8], out: &mut Vec<u32>, scratch: &mut Scratch) {
        let syms = &mut scratch.syms;
        syms.clear();
        syms.extend(bytes.iter().map(|&b| self.byte_ids[b as usize]).filter(|&id| id != NONE));
        if syms.len() <= SCAN_MAX {
            self.merge_scan(syms);
            out.extend_from_slice(syms);
        } else {
            self.merge_heap(scratch, out);
        }
    }

    /// Repeatedly merges the leftmost pair of lowest rank.
    fn merge_scan(&self, syms: &mut Vec<u32>) {
        while syms.len() > 1 {
            let mut best: Option<(u32, usize, u32)> = None;
            for i in 0..syms.len() - 1 {
                if let Some((r, new)) = self.rank(syms[i], syms[i + 1]) {
                    if best.is_none_or(|(br, _, _)| r < br) {
                        best = Some((r, i, new));
                    }
                }
            }
            let Some((_, i, new)) = best else { break };
            syms[i] = new;
            syms.remove(i + 1);
        }
    }

    /// The same as `merge_scan` in O(n log n): a doubly linked list of symbols and a min-heap
    /// of (rank, position) candidates, stale entries skipped when popped.
    fn merge_heap(&self, scratch: &mut Scratch, out: &mut Vec<u32>) {
        let Scratch { syms, prev, next, heap } = scratch;
        let n = syms.len();
        prev.clear();
        next.clear();
        prev.extend((0..n).map(|i| if i == 0 { NONE } else { i as u32 - 1 }));
        next.extend((0..n).map(|i| if i + 1 == n { NONE } else { i as u32 + 1 }));
        heap.clear();
        for i in 0..n - 1 {
            if let Some((r, _)) = self.rank(syms[i], syms[i + 1]) {
                heap.push(std::cmp::Reverse((r, i as u32)));
            }
        }
        while let Some(std::cmp::Reverse((r, i))) = heap.pop() {
            let i = i as usize;
            let j = next[i];
            if syms[i] == NONE || j == NONE {
                continue;
            }
            let j = j as usize;
            // the pair at i may have changed since this entry was pushed: a rank names one pair
            match self.rank(syms[i], syms[j]) {
                Some((r2, new)) if r2 == r => {
                    syms[i] = new;
                    syms[j] = NONE;
                    let k = next[j];
                    next[i] = k;
                    if k != NONE {
                        prev[k as usize] = i as u32;
                        if let Some((rk, _)) = self.rank(new, syms[k as usize]) {
                            heap.push(std::cmp::Reverse((rk, i as u32)));
                        }
                    }
                    let p = prev[i];
                    if p != NONE {
                        if let Some((rp, _)) = self.rank(syms[p as usize], new) {
                            heap.push(std::cmp::Reverse((rp, p)));
                        }
                    }
                }
                _ => {}
            }
        }
        out.extend(syms.iter().copied().filter(|&s| s != NONE));
    }
}

/// Reusable buffers of [`Bpe::encode_word`].
#[derive(Default, Debug)]
pub struct Scratch {
    syms: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    heap: BinaryHeap<std::cmp::Reverse<(u32, u32)>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_round_trips() {
        let t = byte_to_char();
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(t[b as usize]), Some(b));
        }
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(char_to_byte('｜'), None);
        assert_eq!(token_bytes("<｜User｜>"), "<｜User｜>".as_bytes());
        assert_eq!(token_bytes("Ġhi"), b" hi");
    }

    /// A small random merge table over bytes 'a'..'d' and a check that the scan and the heap
    /// agree on random words, long ones included.
    #[test]
    fn scan_and_heap_agree() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        let bl = byte_to_char();
        let mut tokens: Vec<String> = (0..256).map(|b| bl[b].to_string()).collect();
        let mut pool: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let mut merges = Vec::new();
        for _ in 0..400 {
            let l = pool[rnd(pool.len() as u64) as usize].clone();
            let r = pool[rnd(pool.len() as u64) as usize].clone();
            let j = format!("{l}{r}");
            if j.len() > 10 {
                continue;
            }
            if !pool.contains(&j) {
                pool.push(j.clone());
                tokens.push(j);
            }
            merges.push((l, r));
        }
        let vocab: FxMap<&str, u32> = tokens.iter().enumerate().map(|(i, s)| (s.as_str(), i as u32)).collect();
        let bpe = Bpe::new(&vocab, merges.iter().map(|(a, b)| (a.as_str(), b.as_str()))).unwrap();
        let mut scratch = Scratch::default();
        for len in [2usize, 5, 17, 60, 200, 1000] {
            for _ in 0..20 {
                let word: Vec<u8> = (0..len).map(|_| b'a' + rnd(4) as u8).collect();
                let mut a: Vec<u32> = word.iter().map(|&b| bpe.byte_ids[b as usize]).collect();
                bpe.merge_scan(&mut a);
                scratch.syms = word.iter().map(|&b| bpe.byte_ids[b as usize]).collect();
                let mut b = Vec::new();
                bpe.merge_heap(&mut scratch, &mut b);
                assert_eq!(a, b, "word {:?}", String::from_utf8_lossy(&word));
            }
        }
    }
}
