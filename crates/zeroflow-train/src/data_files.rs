//! The data of a run as its checkpoints record it: `--data` resolved to an absolute path (so a
//! run resumes from any directory, under any spelling of the same file), and a fingerprint of each
//! file (its size and a hash of its first and last [`EDGE`] bytes), cheap for shards of gigabytes
//! and enough to notice a file replaced, truncated, appended to or rewritten at either end.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, input};

/// Bytes hashed at each end of a file.
pub const EDGE: u64 = 64 * 1024;

/// One data file as a checkpoint records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFile {
    /// Its canonical path.
    pub path: PathBuf,
    pub bytes: u64,
    /// FNV-1a (64 bits, hex) of its first and last [`EDGE`] bytes (all of it when smaller).
    pub edge_hash: String,
}

/// `--data` with its path made absolute and canonical: the directory or file, or for a glob its
/// directory (the pattern, in the file name, kept as written). `synthetic` stays as it is.
pub fn resolve(data: &str) -> std::io::Result<String> {
    if data == "synthetic" {
        return Ok(data.to_owned());
    }
    let path = Path::new(data);
    let resolved = match path.file_name().and_then(|name| name.to_str()) {
        Some(name) if name.contains(['*', '?']) => {
            let dir = match path.parent() {
                Some(dir) if !dir.as_os_str().is_empty() => dir,
                _ => Path::new("."),
            };
            std::fs::canonicalize(dir)?.join(name)
        }
        _ => std::fs::canonicalize(path)?,
    };
    Ok(resolved.to_string_lossy().into_owned())
}

/// The fingerprints of `paths`, in order.
pub fn fingerprints(paths: &[PathBuf]) -> Result<Vec<DataFile>> {
    paths
        .iter()
        .map(|path| {
            fingerprint(path)
                .map_err(|e| input(format!("--data: cannot read {}: {e}", path.display())))
        })
        .collect()
}

fn fingerprint(path: &Path) -> std::io::Result<DataFile> {
    let mut file = File::open(path)?;
    let bytes = file.metadata()?.len();
    let mut hash = Fnv1a::default();
    let mut head = Vec::new();
    (&mut file).take(EDGE.min(bytes)).read_to_end(&mut head)?;
    hash.write(&head);
    if bytes > EDGE {
        let tail_start = bytes.saturating_sub(EDGE).max(EDGE);
        file.seek(SeekFrom::Start(tail_start))?;
        let mut tail = Vec::new();
        file.take(bytes - tail_start).read_to_end(&mut tail)?;
        hash.write(&tail);
    }
    let path = std::fs::canonicalize(path)?;
    Ok(DataFile { path, bytes, edge_hash: format!("{:016x}", hash.0) })
}

/// How the files `now` differ from those `saved`, or `None` where they are the same.
pub fn difference(saved: &[DataFile], now: &[DataFile]) -> Option<String> {
    for old in saved {
        let Some(new) = now.iter().find(|new| new.path == old.path) else {
            return Some(format!("{} is no longer part of --data", old.path.display()));
        };
        if new.bytes != old.bytes {
            return Some(format!(
                "{} was {} bytes and is {} now",
                old.path.display(),
                old.bytes,
                new.bytes
            ));
        }
        if new.edge_hash != old.edge_hash {
            return Some(format!(
                "the contents of {} differ (same size; its first or last {} KiB changed)",
                old.path.display(),
                EDGE / 1024
            ));
        }
    }
    now.iter()
        .find(|new| !saved.iter().any(|old| old.path == new.path))
        .map(|added| format!("{} was added to --data", added.path.display()))
}

/// The 64-bit FNV-1a hash: stable across Rust releases and platforms, unlike `std`'s hasher.
struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Fnv1a(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zeroflow-data-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn fnv1a_matches_its_reference_values() {
        let hash = |text: &str| {
            let mut h = Fnv1a::default();
            h.write(text.as_bytes());
            h.0
        };
        assert_eq!(hash(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(hash("a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(hash("foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn any_spelling_of_a_file_resolves_to_one_path() {
        let dir = scratch("spelling");
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("corpus.txt"), "text").unwrap();
        let plain = resolve(dir.join("corpus.txt").to_str().unwrap()).unwrap();
        let detour = resolve(dir.join("sub/../corpus.txt").to_str().unwrap()).unwrap();
        assert_eq!(plain, detour);
        assert!(Path::new(&plain).is_absolute());
        let glob = resolve(dir.join("sub/../*.txt").to_str().unwrap()).unwrap();
        assert_eq!(Path::new(&glob), Path::new(&plain).with_file_name("*.txt"));
        assert_eq!(resolve("synthetic").unwrap(), "synthetic");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A change at either end of a large file, or to its size, is noticed; the same bytes under
    /// another name of the same file are not a change.
    #[test]
    fn fingerprints_notice_changes_at_either_end_and_in_size() {
        let dir = scratch("fingerprints");
        let path = dir.join("shard.bin");
        let bytes: Vec<u8> = (0..3 * EDGE as usize).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let saved = fingerprints(std::slice::from_ref(&path)).unwrap();
        let same = fingerprints(&[dir.join(".").join("shard.bin")]).unwrap();
        assert_eq!(difference(&saved, &same), None);
        for (what, at) in [("first", 10), ("last", bytes.len() - 10)] {
            let mut changed = bytes.clone();
            changed[at] ^= 1;
            std::fs::write(&path, &changed).unwrap();
            let now = fingerprints(std::slice::from_ref(&path)).unwrap();
            let said = difference(&saved, &now).unwrap_or_default();
            assert!(said.contains("contents") && said.contains("differ"), "{what}: {said}");
        }
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        let now = fingerprints(std::slice::from_ref(&path)).unwrap();
        let said = difference(&saved, &now).unwrap_or_default();
        assert!(said.contains(&format!("was {} bytes", bytes.len())), "{said}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
