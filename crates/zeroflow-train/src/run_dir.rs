//! The default run directory, `runs/<UTC time>`, made for one run alone: two runs started in the
//! same second must not write into one directory (their metrics would interleave and the second
//! would fail at its first checkpoint).

use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use crate::error::{Result, TrainError, io};

/// How many names [`claim`] tries after the first.
const MAX_SUFFIX: u32 = 1000;

/// Creates `wanted` (its parents as needed), or where it exists `wanted-2`, `wanted-3`, ...: the
/// directory is created, not merely found free, so no other process can be handed the same one.
pub fn claim(wanted: &Path) -> Result<PathBuf> {
    if let Some(parent) = wanted.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(io(format!("create {}", parent.display())))?;
    }
    let name = wanted.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    for suffix in 1..=MAX_SUFFIX + 1 {
        let dir = if suffix == 1 {
            wanted.to_path_buf()
        } else {
            wanted.with_file_name(format!("{name}-{suffix}"))
        };
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io(format!("create {}", dir.display()))(e)),
        }
    }
    Err(TrainError::RunDirsTaken { wanted: wanted.to_path_buf(), tried: MAX_SUFFIX })
}

#[cfg(test)]
mod tests {
    use super::claim;

    #[test]
    fn a_taken_name_gets_the_next_free_suffix_and_every_claim_its_own_directory() {
        let dir = std::env::temp_dir().join(format!("zeroflow-run-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let wanted = dir.join("runs").join("20261201-121314");
        let first = claim(&wanted).unwrap();
        let second = claim(&wanted).unwrap();
        let third = claim(&wanted).unwrap();
        assert_eq!(first, wanted);
        assert_eq!(second, wanted.with_file_name("20261201-121314-2"));
        assert_eq!(third, wanted.with_file_name("20261201-121314-3"));
        assert!(first.is_dir() && second.is_dir() && third.is_dir());
        // Threads claiming at once never share one.
        let claimed: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8).map(|_| s.spawn(|| claim(&wanted).unwrap())).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut unique = claimed.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), claimed.len(), "{claimed:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
