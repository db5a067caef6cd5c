//! The disk a checkpoint goes to: the space it needs and has, and sizes as people read them.

use std::path::Path;

use super::CheckpointError;

/// Refuses a checkpoint of `needed` bytes at `dir` (not made yet) where the file system of its
/// parent has fewer bytes free ([`CheckpointError::NoSpace`]); allowed where that cannot be asked.
pub fn space_for(dir: &Path, needed: u64) -> Result<(), CheckpointError> {
    check_space(dir, needed, free_bytes(dir))
}

/// Refuses a checkpoint of `needed` bytes at `dir` where its file system has `free` bytes free
/// and they are fewer (`None`: unknown, so not refused).
pub(super) fn check_space(
    dir: &Path,
    needed: u64,
    free: Option<u64>,
) -> Result<(), CheckpointError> {
    match free {
        Some(free) if free < needed => {
            Err(CheckpointError::NoSpace { path: dir.to_path_buf(), needed, free })
        }
        _ => Ok(()),
    }
}

/// Bytes of disk as people read them: `128.5 GB`, `6.6 MB`, `900 B` (powers of 1000, as disks
/// are sold and `df -H` prints).
pub fn disk_size(bytes: u64) -> String {
    let b = bytes as f64;
    match bytes {
        0..1_000 => format!("{bytes} B"),
        1_000..1_000_000 => format!("{:.1} kB", b / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b / 1e6),
        _ => format!("{:.1} GB", b / 1e9),
    }
}

thread_local! {
    /// What [`free_bytes`] says on this thread instead of asking the file system ([`pretend_free`]).
    static PRETENDED_FREE: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Tests: from now on [`free_bytes`] says `bytes` on this thread (`None`: asks the file system
/// again), so that a run's saves can be refused for want of space without filling a disk.
#[doc(hidden)]
pub fn pretend_free(bytes: Option<u64>) {
    PRETENDED_FREE.with(|free| free.set(bytes));
}

/// The bytes free for this process (`statvfs`'s available blocks) on the file system that holds
/// `path`, or would hold it once made (its nearest existing ancestor's), or `None` where that
/// cannot be asked.
pub fn free_bytes(path: &Path) -> Option<u64> {
    if let Some(bytes) = PRETENDED_FREE.with(std::cell::Cell::get) {
        return Some(bytes);
    }
    let path = path.ancestors().find(|dir| dir.exists())?;
    let stat = rustix::fs::statvfs(path).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// Whether `a` and `b` (either may not exist yet: their nearest existing ancestors are asked) are
/// on one file system, so that what is written to one takes the other's free space; `false`
/// where that cannot be asked.
pub fn same_file_system(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        let device = |path: &Path| {
            let path = std::path::absolute(path).ok()?;
            let existing = path.ancestors().find(|dir| dir.exists())?;
            existing.metadata().ok().map(|meta| meta.dev())
        };
        matches!((device(a), device(b)), (Some(a), Some(b)) if a == b)
    }
    #[cfg(not(unix))]
    {
        let _ = (a, b);
        false
    }
}
