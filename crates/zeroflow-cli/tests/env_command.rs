//! `zeroflow env` and the GPU benchmarks from the outside: what they report and their exit codes,
//! on whatever machine the tests run (CPU-only in CI).

use std::process::Command;

fn zeroflow(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_zeroflow")).args(args).output().expect("runs");
    let text = |b: Vec<u8>| String::from_utf8(b).expect("utf-8");
    (out.status.code().unwrap_or(-1), text(out.stdout), text(out.stderr))
}

fn env_json() -> serde_json::Value {
    let (code, stdout, stderr) = zeroflow(&["env", "--json"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    serde_json::from_str(&stdout).expect("one JSON object")
}

/// True where the driver sees at least one GPU.
fn has_gpu(env: &serde_json::Value) -> bool {
    env["cuda"]["gpus"].as_array().is_some_and(|gpus| !gpus.is_empty())
}

#[test]
fn env_reports_the_host_the_gpus_and_every_cuda_library() {
    let env = env_json();
    assert!(env["host_cores"].as_u64().is_some_and(|cores| cores >= 1), "{env}");
    assert!(env["host_memory_gib"].as_f64().is_some_and(|gib| gib > 0.0), "{env}");
    for library in ["libnvrtc", "libcublasLt", "libnccl"] {
        let entry = &env["cuda"]["libraries"][library];
        assert!(entry["summary"].is_string(), "{library} is reported: {env}");
        assert!(entry["file"].is_string() || entry["error"].is_string(), "{library}: {env}");
    }
    for gpu in env["cuda"]["gpus"].as_array().into_iter().flatten() {
        assert!(gpu["name"].is_string() && gpu["memory_bytes"].is_u64(), "{gpu}");
        assert!(gpu["compute_capability"].as_str().is_some_and(|cc| cc.contains('.')), "{gpu}");
    }
    if has_gpu(&env) {
        assert!(env["cuda"]["cuda_version"].is_string(), "{env}");
    }
}

#[test]
fn env_exits_zero_and_says_so_where_there_is_no_gpu() {
    let (code, stdout, stderr) = zeroflow(&["env"]);
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    for line in ["cores ", "memory ", "gpu ", "libnvrtc", "libcublasLt", "libnccl"] {
        assert!(stdout.contains(line), "`{line}` is reported: {stdout}");
    }
    if !has_gpu(&env_json()) {
        let gpu_line = stdout.lines().find(|l| l.starts_with("gpu ")).expect("a gpu line");
        assert!(gpu_line.contains("no GPU"), "{gpu_line}");
        assert!(gpu_line.contains("zeroflow runs on the CPU"), "{gpu_line}");
    }
}

#[test]
fn bench_copy_without_a_gpu_fails_with_a_clear_message() {
    if has_gpu(&env_json()) {
        println!("skipped: this machine has a GPU (scripts/gpu-run.sh runs the benchmark)");
        return;
    }
    for args in [&["bench", "copy"][..], &["bench", "copy", "--json"]] {
        let (code, stdout, stderr) = zeroflow(args);
        assert_eq!(code, 1, "{args:?}: {stdout}\n{stderr}");
        assert!(stderr.contains("no CUDA GPU found"), "{stderr}");
        assert!(stdout.is_empty(), "nothing measured, nothing printed: {stdout}");
    }
}
