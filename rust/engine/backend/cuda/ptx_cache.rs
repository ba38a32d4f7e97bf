//! The kernels' PTX kept on disk between processes. NVRTC takes tens of seconds to compile
//! ds4's kernel program (about 40 s of one core of a build machine), which every process that
//! opened a CUDA model paid before its first token; with this cache only the first process
//! after a change of the program, its options or NVRTC does. (The driver keeps its own cache
//! of the PTX's translation to the GPU's code, in `~/.nv/ComputeCache` by default.)
//!
//! Where: `$DS4_CACHE_DIR/cuda-ptx`, else `$XDG_CACHE_HOME/ds4/cuda-ptx`, else
//! `$HOME/.cache/ds4/cuda-ptx`; `DS4_CUDA_CACHE=0` turns it off.
//!
//! A file is named by a digest of its key and starts with the key itself: the format's
//! version, the NVRTC version, the compile options in their order, and the program text's
//! length and 128-bit digest; then the PTX's length, then the PTX. A file is used only when
//! that header is the one expected, byte for byte, and the PTX has its length, so a changed
//! program, option or NVRTC is a miss, never stale code. The digest is not cryptographic: it
//! tells programs apart, and the folder is the user's own. Nothing here is ever an error: a
//! missing, unreadable or malformed file is a miss, and a failed write leaves no file (written
//! to a temporary name, then renamed).

use std::path::{Path, PathBuf};

/// The folder of the cache (see the module docs), or None when it is off or no folder is known.
pub(crate) fn dir() -> Option<PathBuf> {
    if std::env::var("DS4_CUDA_CACHE").is_ok_and(|v| v.trim() == "0") {
        return None;
    }
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    let root = var("DS4_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("ds4")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("ds4")))?;
    Some(root.join("cuda-ptx"))
}

/// What a compile's PTX depends on.
pub(crate) struct Key<'a> {
    /// NVRTC's version, (major, minor).
    pub nvrtc: (i32, i32),
    /// The options given to NVRTC, in order (the architecture among them).
    pub options: &'a [String],
    /// The program's text.
    pub source: &'a str,
}

impl Key<'_> {
    /// The header a file for this key starts with.
    fn header(&self) -> String {
        let (a, b) = digest(self.source.as_bytes());
        format!(
            "ds4-ptx 1\nnvrtc {}.{}\noptions {}\nsource {} {a:016x}{b:016x}\n",
            self.nvrtc.0,
            self.nvrtc.1,
            self.options.join("\u{1f}"),
            self.source.len()
        )
    }
}

/// The file in `dir` for the key whose header is `header`.
fn file(dir: &Path, header: &str) -> PathBuf {
    let (a, b) = digest(header.as_bytes());
    dir.join(format!("{a:016x}{b:016x}.ptx"))
}

/// The PTX kept for `key` in `dir`, if a file there holds it whole.
pub(crate) fn load(dir: &Path, key: &Key) -> Option<String> {
    let header = key.header();
    let text = std::fs::read_to_string(file(dir, &header)).ok()?;
    let rest = text.strip_prefix(&header)?;
    let (len, ptx) = rest.strip_prefix("ptx ")?.split_once('\n')?;
    (len.parse::<usize>().ok()? == ptx.len()).then(|| ptx.to_string())
}

/// Files the folder keeps: a store past this many removes the oldest (by modification time).
/// A user's folder holds one or two programs (10 MB each for ds4's); a developer's would grow
/// with every edit of a kernel.
const KEEP: usize = 8;

/// Keeps `ptx` for `key` in `dir` (created if need be); whether it was written.
pub(crate) fn store(dir: &Path, key: &Key, ptx: &str) -> bool {
    let header = key.header();
    let path = file(dir, &header);
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let text = format!("{header}ptx {}\n{ptx}", ptx.len());
    let done = std::fs::create_dir_all(dir).is_ok()
        && std::fs::write(&tmp, text).is_ok()
        && std::fs::rename(&tmp, &path).is_ok();
    if !done {
        let _ = std::fs::remove_file(&tmp);
    }
    prune(dir, KEEP);
    done
}

/// Removes all but the `keep` newest `.ptx` files of `dir`.
fn prune(dir: &Path, keep: usize) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "ptx"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    if files.len() <= keep {
        return;
    }
    files.sort();
    for (_, p) in &files[..files.len() - keep] {
        let _ = std::fs::remove_file(p);
    }
}

/// A 128-bit digest of `bytes`: two 64-bit lanes, each a multiply-rotate hash of the 8-byte
/// words (with different odd constants), the length and a final avalanche (splitmix64's).
fn digest(bytes: &[u8]) -> (u64, u64) {
    fn mix(mut z: u64) -> u64 {
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    let (mut a, mut b) = (0x243f_6a88_85a3_08d3u64, 0x1319_8a2e_0370_7344u64);
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        a = (a ^ w).wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29);
        b = (b ^ w.rotate_left(17)).wrapping_mul(0xc2b2_ae3d_27d4_eb4f).rotate_left(31);
    }
    let mut last = [0u8; 8];
    last[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
    let w = u64::from_le_bytes(last) ^ ((bytes.len() as u64) << 3).rotate_left(7);
    (mix(a ^ w ^ bytes.len() as u64), mix(b ^ w.rotate_left(17) ^ (bytes.len() as u64).rotate_left(32)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(options: &'a [String], source: &'a str) -> Key<'a> {
        Key { nvrtc: (12, 8), options, source }
    }

    fn tmp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ds4-ptx-cache-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// What is stored for a key is loaded back for that key, and for no other: another program
    /// text (even of the same length), option, option order or NVRTC version misses.
    #[test]
    fn a_stored_ptx_loads_only_for_its_key() {
        let dir = tmp_dir("keys");
        let opts = vec!["--gpu-architecture=compute_90".to_string(), "-DA=1".to_string()];
        let src = "extern \"C\" __global__ void k() {}";
        assert_eq!(load(&dir, &key(&opts, src)), None, "an empty cache misses");
        assert!(store(&dir, &key(&opts, src), "// ptx\n.version 8.0\n"));
        assert_eq!(load(&dir, &key(&opts, src)).as_deref(), Some("// ptx\n.version 8.0\n"));
        let other_src = "extern \"C\" __global__ void j() {}";
        assert_eq!(other_src.len(), src.len());
        assert_eq!(load(&dir, &key(&opts, other_src)), None);
        let swapped = vec![opts[1].clone(), opts[0].clone()];
        assert_eq!(load(&dir, &key(&swapped, src)), None);
        assert_eq!(load(&dir, &key(&opts[..1], src)), None);
        assert_eq!(load(&dir, &Key { nvrtc: (13, 0), options: &opts, source: src }), None);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A file cut short, or whose header was altered, is a miss, not an error; storing again
    /// repairs it.
    #[test]
    fn a_damaged_file_is_a_miss() {
        let dir = tmp_dir("damaged");
        let opts = vec!["--gpu-architecture=compute_80".to_string()];
        let k = key(&opts, "program");
        let ptx = "x".repeat(1000);
        assert!(store(&dir, &k, &ptx));
        let path = file(&dir, &k.header());
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 10]).unwrap();
        assert_eq!(load(&dir, &k), None, "truncated");
        let mut bad = full.clone();
        bad[3] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert_eq!(load(&dir, &k), None, "header changed");
        std::fs::write(&path, [0xffu8, 0xfe, 0x00]).unwrap();
        assert_eq!(load(&dir, &k), None, "not text");
        assert!(store(&dir, &k, &ptx));
        assert_eq!(load(&dir, &k).as_deref(), Some(ptx.as_str()));
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A folder that cannot be made (its parent is a file) stores nothing and says so.
    #[test]
    fn an_unwritable_folder_stores_nothing() {
        let file = std::env::temp_dir().join(format!("ds4-ptx-cache-file-{}", std::process::id()));
        std::fs::write(&file, b"not a folder").unwrap();
        let opts = vec![String::new()];
        let k = key(&opts, "p");
        assert!(!store(&file.join("sub"), &k, "ptx"));
        assert_eq!(load(&file.join("sub"), &k), None);
        let _ = std::fs::remove_file(&file);
    }

    /// Past KEEP files the oldest go: after KEEP + 3 stores the last KEEP keys load and the first
    /// three miss.
    #[test]
    fn the_folder_keeps_the_newest_files() {
        let dir = tmp_dir("prune");
        let opts = vec![String::new()];
        let sources: Vec<String> = (0..KEEP + 3).map(|i| format!("program {i}")).collect();
        for (i, s) in sources.iter().enumerate() {
            assert!(store(&dir, &key(&opts, s), "ptx"));
            // Distinct modification times, oldest first.
            let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_000_000 + i as u64);
            std::fs::File::options()
                .write(true)
                .open(file(&dir, &key(&opts, s).header()))
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        prune(&dir, KEEP);
        for (i, s) in sources.iter().enumerate() {
            assert_eq!(load(&dir, &key(&opts, s)).is_some(), i >= 3, "program {i}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The digest differs for inputs that differ in one bit, in length only (trailing zeros),
    /// or in the order of their words, and is the same for the same bytes.
    #[test]
    fn the_digest_tells_inputs_apart() {
        let base: Vec<u8> = (0..100u8).collect();
        let mut seen = std::collections::HashSet::new();
        assert!(seen.insert(digest(&base)));
        assert_eq!(digest(&base), digest(&base.clone()));
        for i in 0..base.len() {
            for bit in [0, 3, 7] {
                let mut v = base.clone();
                v[i] ^= 1 << bit;
                assert!(seen.insert(digest(&v)), "byte {i} bit {bit}");
            }
        }
        let mut longer = base.clone();
        longer.push(0);
        assert!(seen.insert(digest(&longer)));
        let mut shorter = base.clone();
        shorter.pop();
        assert!(seen.insert(digest(&shorter)));
        let mut swapped = base.clone();
        swapped[..16].rotate_left(8);
        assert!(seen.insert(digest(&swapped)));
        assert!(seen.insert(digest(b"")));
        assert!(seen.insert(digest(&[0])));
    }
}
