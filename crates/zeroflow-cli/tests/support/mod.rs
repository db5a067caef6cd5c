//! What the CLI's test binaries share: the tiny model their runs train, and scratch directories.

use std::path::{Path, PathBuf};

/// One layer of width 16 over the synthetic corpus' 64 symbols, context 16.
#[allow(dead_code, reason = "not every test binary trains")]
pub const MINI: &str = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":64,"context":16}"#;

/// A fresh, empty directory for one test, under the target's scratch space: `group/name`.
pub fn scratch_in(group: &str, name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(group).join(name);
    // Leftovers of an earlier run are removed; a missing directory is fine.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}
