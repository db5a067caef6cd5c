//! `zeroflow stress` from the outside: counts, the closing line, exit codes.

use std::process::Command;

fn zeroflow(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zeroflow")).args(args).output().expect("runs");
    let text = |b: Vec<u8>| String::from_utf8(b).expect("utf-8");
    (out.status.code().unwrap_or(-1), text(out.stdout), text(out.stderr))
}

#[test]
fn a_chaos_stress_run_reports_counts_environment_and_the_closing_line() {
    let (code, stdout, stderr) = zeroflow(&["stress", "--iters", "20", "--chaos", "5"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("command     "), "{stdout}");
    assert!(stdout.contains("\n  zeroflow "), "the environment is printed: {stdout}");
    assert!(stdout.trim_end().ends_with("stress: 20 passed, 0 failed"), "{stdout}");
}

/// Regression (issue 24): the text form printed the environment as a 3 KB JSON line. Text mode
/// prints text only.
#[test]
fn the_text_form_has_no_json() {
    let (code, stdout, stderr) = zeroflow(&["stress", "--iters", "2"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    for line in stdout.lines() {
        assert!(!line.contains('{') && line.len() < 400, "a JSON line in text mode: {line}");
    }
}

/// Regression (issue 24): `--world 4` panicked slicing the reference's weights, and the other
/// ranks waited forever. Several world sizes pass from the command line.
#[test]
fn worlds_of_three_four_and_eight_ranks_pass() {
    for world in ["3", "4", "8"] {
        let (code, stdout, stderr) = zeroflow(&["stress", "--world", world, "--iters", "2"]);
        assert_eq!(code, 0, "--world {world}: {stdout}\n{stderr}");
        assert!(stdout.contains("stress: 2 passed, 0 failed"), "{stdout}");
    }
}

#[test]
fn the_json_form_carries_the_same_counts() {
    let (code, stdout, _) = zeroflow(&["stress", "--iters", "5", "--chaos", "1", "--json"]);
    assert_eq!(code, 0);
    // All of stdout is the one JSON object (issue 24: no text line after it).
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("valid JSON");
    assert_eq!(report["passed"], 5);
    assert_eq!(report["failed"], 0);
    assert_eq!(report["chaos_seed"], 1);
}

#[test]
fn unsupported_choices_are_input_errors() {
    for args in [
        &["stress", "--device", "cuda", "--chaos", "1"][..],
        &["stress", "--device", "tpu"],
        &["stress", "--gpu-load"],
        &["stress", "--world", "0"],
    ] {
        let (code, _, stderr) = zeroflow(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.starts_with("error: "), "{stderr}");
    }
}
