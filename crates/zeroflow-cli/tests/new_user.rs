//! What a new user meets first (issue 24), from the outside: `zeroflow config` previewing what
//! `train` resolves, the CPU example configs, the messages of common mistakes, the flags users
//! expect, and `zeroflow models`. The binary is a debug build: runs use a tiny model and few steps.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

#[path = "new_user/config_preview.rs"]
mod config_preview;
#[path = "new_user/flags.rs"]
mod flags;
#[path = "new_user/messages.rs"]
mod messages;

mod support;
use support::MINI;

/// A fresh, empty directory for one test.
fn scratch(name: &str) -> PathBuf {
    support::scratch_in("new_user", name)
}

fn zeroflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(args)
        .env("ZEROFLOW_LOG", "info")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("run zeroflow")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The repository's root (the examples live there).
fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read_json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("valid JSON")
}

/// Every line of metrics.jsonl that records a training step.
fn step_lines(out: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .expect("metrics.jsonl exists")
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).expect("JSON"))
        .filter(|line| line.get("loss").is_some())
        .collect()
}
