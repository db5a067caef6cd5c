//! `zeroflow bench step` from the outside, on the CPU: the report's breakdown and throughput
//! figures are consistent with one another.

use std::process::Command;

const MODEL: &str = r#"{"n_layer":2,"n_head":2,"d_model":64,"vocab_size":256,"context":64}"#;

fn bench_step(mode: &str) -> serde_json::Value {
    let args = ["bench", "step", "--model", MODEL, "--mode", mode, "--micro-batch", "2"];
    let out = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(args)
        .args(["--steps", "3", "--warmup", "1", "--json"])
        .output()
        .expect("runs");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

#[test]
fn the_breakdown_splits_the_step_and_the_flops_follow_the_throughput() {
    for mode in ["gpu", "offload", "offload-delayed", "zenflow", "zenflow-inline"] {
        let r = bench_step(mode);
        let number = |key: &str| r[key].as_f64().unwrap_or_else(|| panic!("{key} in {r}"));
        let (forward, backward) = (number("forward_s_mean"), number("backward_s_mean"));
        let compute = number("forward_backward_s_mean");
        // The forward is timed in its own passes after the steps, so on a loaded machine it
        // may come out longer than a whole step's forward + backward: only its sign is certain.
        assert!(forward > 0.0 && compute > 0.0, "{mode}: forward {forward} of {compute}");
        assert!((forward + backward - compute).abs() < 1e-12, "{mode}: {r}");
        let exposed = number("exposed_optimizer_s_mean");
        assert!((compute + exposed - number("s_per_step_mean")).abs() < 1e-12, "{mode}: {r}");
        // 6 N + 12 L d T per token, at the measured tokens/s.
        let want = 6.0 * number("parameters") + 12.0 * 2.0 * 64.0 * 64.0;
        assert_eq!(number("flops_per_token"), want, "{mode}");
        let tflops = number("tokens_per_s") * want / 1e12;
        assert!((number("model_tflops") - tflops).abs() <= 1e-9 * tflops, "{mode}: {r}");
        assert_eq!(r["times"].as_array().map(Vec::len), Some(3), "{mode}: {r}");
        // The optimizer's parts: every step waits for the norm; only the streamed offload step
        // (plain `offload`: one micro-step, no delayed update) runs AdamW on this thread.
        assert!(number("norm_wait_s_mean") > 0.0, "{mode}: {r}");
        let adam = number("cpu_adam_s_mean");
        assert_eq!(adam > 0.0, mode == "offload", "{mode}: CPU AdamW {adam} s per step");
        // The CPU's part inside forward and backward: the step left to the next forward (on
        // by default for the exact offload step, one micro-step), part of the CPU wait.
        let (wait, inside) =
            (number("cpu_wait_s_mean"), number("cpu_wait_in_forward_backward_s_mean"));
        assert!((0.0..=wait + 1e-12).contains(&inside), "{mode}: {inside} of {wait}: {r}");
        assert!(inside <= backward.max(0.0) + forward + 1e-12, "{mode}: {r}");
        assert_eq!(inside > 0.0, mode == "offload", "{mode}: {inside} s within forward+backward");
        for key in ["chunk_wait_s_mean", "upload_wait_s_mean"] {
            assert!(number(key) >= 0.0 && number(key) <= number("s_per_step_mean"), "{mode}: {r}");
        }
        // The host the row ran on, as `zeroflow env` describes it: the CPU AdamW's SIMD level
        // among it.
        let env = Command::new(env!("CARGO_BIN_EXE_zeroflow")).args(["env", "--json"]).output();
        let env: serde_json::Value = serde_json::from_slice(&env.expect("runs").stdout).unwrap();
        for key in ["cpu_model", "host_cores", "simd"] {
            assert_eq!(r["host"][key], env[key], "{mode}: {key}");
        }
        assert!(["scalar", "avx2", "avx512"].contains(&r["host"]["simd"].as_str().unwrap()));
        // The hypervisor's steal in each timed step, and over them as a fraction of the host's
        // CPU time: known on Linux, where /proc/stat has it (counted in ticks of the kernel's
        // clock, so over steps of milliseconds the fraction may come out above 1).
        if cfg!(target_os = "linux") {
            let steal = r["host_steal_s_per_step"].as_array().expect("a list");
            assert_eq!(steal.len(), 3, "{mode}: {r}");
            let steal: Vec<f64> = steal.iter().map(|s| s.as_f64().expect("known")).collect();
            assert!(steal.iter().all(|&s| s >= 0.0), "{mode}: {r}");
            let fraction = number("host_steal_fraction");
            assert!(fraction.is_finite(), "{mode}: {r}");
            assert_eq!(fraction > 0.0, steal.iter().sum::<f64>() > 0.0, "{mode}: {r}");
        }
    }
}

/// `--state-dtype bf16`: the offloaded step keeps its Adam moments in bf16 (reported in the
/// settings), which the memory plan counts as 4 bytes per parameter less and the process holds
/// less for; with `--mode gpu` it is an input error naming the flag.
#[test]
fn sixteen_bit_moments_hold_less_host_memory_and_are_refused_on_the_gpu_path() {
    let run = |dtype: &str| {
        // 32 M parameters: 4 bytes each of them stand well above the process's other changes.
        let model = r#"{"n_layer":2,"n_head":4,"d_model":512,"vocab_size":50304,"context":64}"#;
        let args = ["bench", "step", "--model", model, "--mode", "offload", "--seq", "32"];
        let out = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .args(args)
            .args(["--micro-batch", "1", "--steps", "1", "--warmup", "1", "--json"])
            .args(["--state-dtype", dtype])
            .output()
            .expect("runs");
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        assert!(out.status.success(), "{}\n{}", text(&out.stdout), text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("one JSON object")
    };
    let (fp32, bf16) = (run("fp32"), run("bf16"));
    assert_eq!(fp32["settings"]["optimizer_state_dtype"], "fp32");
    assert_eq!(bf16["settings"]["optimizer_state_dtype"], "bf16");
    let bytes =
        |r: &serde_json::Value, key: &str| r[key].as_f64().unwrap_or_else(|| panic!("{key}"));
    let parameters = bytes(&fp32, "parameters");
    let planned = bytes(&fp32, "planned_host_bytes") - bytes(&bf16, "planned_host_bytes");
    // Two moments of 2 bytes less each, over the partition (the parameters and the flat
    // layout's padding).
    let ratio = planned / (4.0 * parameters);
    assert!((1.0..1.001).contains(&ratio), "{planned} bytes less for {parameters} parameters");
    // Measured: at least three quarters of that (the rest is the allocator's and the OS's).
    let held = bytes(&fp32, "peak_rss_bytes") - bytes(&bf16, "peak_rss_bytes");
    assert!(held >= 3.0 * parameters, "{held} bytes less for {parameters} parameters");

    let out = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["bench", "step", "--model", "tiny", "--mode", "gpu", "--state-dtype", "bf16"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--state-dtype bf16") && stderr.contains("--mode gpu"), "{stderr}");
}
