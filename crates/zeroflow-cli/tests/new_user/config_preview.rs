//! `zeroflow config` resolves what `zeroflow train` resolves, and every shipped config resolves.

use super::*;

/// The shipped example configs: (path, the device they are for).
fn shipped_configs() -> Vec<(PathBuf, &'static str)> {
    let dir = repo_root().join("examples/configs");
    let mut configs: Vec<_> = std::fs::read_dir(&dir)
        .expect("examples/configs exists")
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "json"))
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (path, if name.starts_with("cpu-") { "cpu" } else { "cuda" })
        })
        .collect();
    configs.sort();
    configs
}

/// The Hugging Face ZeRO-2 config: the docs' ZeRO-2 example ("auto" everywhere the trainer
/// knows the value), with the docs' WarmupDecayLR scheduler (`total_num_steps: "auto"`) and an
/// "auto" reduce_bucket_size as in their ZeRO-3 example.
fn hf_zero2() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-zero2.json")
}

/// Regression (issue 24): `zeroflow config` refused every shipped example and the Hugging Face
/// ZeRO-2 config (`total_num_steps: "auto"`). Each resolves for the device it is written for.
#[test]
fn every_shipped_config_and_the_hugging_face_zero2_config_resolve() {
    let mut configs = shipped_configs();
    assert!(configs.len() >= 9, "the examples: {configs:?}");
    configs.push((hf_zero2(), "cpu"));
    configs.push((hf_zero2(), "cuda"));
    for (path, device) in configs {
        let run = zeroflow(&["config", path.to_str().unwrap(), "--device", device]);
        let stderr = text(&run.stderr);
        assert!(run.status.success(), "{} on {device}: {stderr}", path.display());
        let resolved: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON");
        assert_eq!(resolved["train_micro_batch_size_per_gpu"], 16, "{}", path.display());
        let bf16 = resolved["bf16"]["enabled"].as_bool();
        assert_eq!(bf16, Some(device == "cuda"), "{}: {resolved}", path.display());
    }
}

/// Regression (issue 24): `config` filled "auto" with micro-batch 1, lr 0.001 and warm-up 1000,
/// `train` with 16, --lr and 5 % of --steps. With the same flags both resolve the same config,
/// value for value (train's summary.json records what it used).
#[test]
fn config_and_train_resolve_the_same_values_from_the_same_flags() {
    let dir = scratch("same_resolution");
    for (name, path) in
        [("hf", hf_zero2()), ("cpu", repo_root().join("examples/configs/cpu-zero2-offload.json"))]
    {
        let path = path.to_str().unwrap();
        let flags = [
            "--model",
            MINI,
            "--steps",
            "3",
            "--micro-batch",
            "2",
            "--lr",
            "2e-3",
            "--warmup",
            "2",
        ];
        let preview = zeroflow(&[&["config", path, "--device", "cpu"][..], &flags].concat());
        assert!(preview.status.success(), "{}", text(&preview.stderr));
        let previewed: serde_json::Value = serde_json::from_slice(&preview.stdout).expect("JSON");

        let out = dir.join(name);
        let out = out.to_str().unwrap();
        let run_flags =
            ["--config", path, "--out", out, "--eval-every", "0", "--eval-tokens", "64"];
        let run = zeroflow(&[&["train"][..], &flags, &run_flags].concat());
        assert!(run.status.success(), "{}", text(&run.stderr));
        let summary = read_json(&Path::new(out).join("summary.json"));
        assert_eq!(summary["config"], previewed, "{name}");
        assert_eq!(previewed["optimizer"]["params"]["lr"], 2e-3, "{previewed}");
    }
}

/// The defaults agree too: without flags, `config` fills micro-batch 16, lr 3e-3 and a warm-up of
/// 5 % of the default 1000 steps, as `train` does.
#[test]
fn configs_defaults_are_trains_defaults() {
    let path = repo_root().join("examples/configs/cpu-zero2.json");
    let run = zeroflow(&["config", path.to_str().unwrap()]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let resolved: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON");
    assert_eq!(resolved["train_micro_batch_size_per_gpu"], 16);
    assert_eq!(resolved["optimizer"]["params"]["lr"], 3e-3);
    let params = &resolved["scheduler"]["params"];
    assert_eq!(
        (params["warmup_num_steps"].as_u64(), params["total_num_steps"].as_u64()),
        (Some(50), Some(1000)),
        "{resolved}"
    );
}

/// Issue 24, item 8: the CPU example configs train on the CPU (a few steps each), and the run
/// header states the precision, stage, offload and ZenFlow as resolved.
#[test]
fn the_cpu_example_configs_train_on_the_cpu_and_the_header_says_what_was_resolved() {
    let dir = scratch("cpu_configs");
    let cases = [
        ("cpu-zero1.json", "ZeRO stage 1, no optimizer offload, no ZenFlow"),
        ("cpu-zero2.json", "ZeRO stage 2, no optimizer offload, no ZenFlow"),
        ("cpu-zero2-offload.json", "ZeRO stage 2, optimizer offloaded to the CPU, no ZenFlow"),
        ("cpu-zero2-zenflow.json", "ZeRO stage 2, optimizer offloaded to the CPU, ZenFlow"),
    ];
    for (file, header) in cases {
        let config = repo_root().join("examples/configs").join(file);
        let out = dir.join(file);
        let run = zeroflow(&[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--model",
            MINI,
            "--steps",
            "2",
            "--micro-batch",
            "2",
            "--eval-every",
            "0",
            "--eval-tokens",
            "64",
            "--out",
            out.to_str().unwrap(),
        ]);
        let stderr = text(&run.stderr);
        assert!(run.status.success(), "{file}: {stderr}");
        assert!(stderr.contains(&format!("fp32, {header}")), "{file}: {stderr}");
        assert_eq!(step_lines(&out).len(), 2, "{file}");
    }
}

/// Issue 24, item 8: the bf16-on-CPU error names the config key and the fixes.
#[test]
fn a_bf16_config_on_the_cpu_names_the_key_and_the_fix() {
    let config = repo_root().join("examples/configs/zero2-bf16.json");
    let run = zeroflow(&["train", "--config", config.to_str().unwrap(), "--steps", "2"]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    for needle in ["bf16.enabled", "false", "examples/configs/cpu-", "--device cuda"] {
        assert!(stderr.contains(needle), "{needle:?} in {stderr}");
    }
}

/// Issue 24, item 8: an unknown key in a section DeepSpeed validates strictly is an error, as in
/// DeepSpeed; an unknown top-level key stays a warning.
#[test]
fn unknown_keys_fail_in_strict_sections_and_warn_at_the_top() {
    let dir = scratch("strict_keys");
    let strict = dir.join("strict.json");
    std::fs::write(
        &strict,
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_com": true}}"#,
    )
    .unwrap();
    let run = zeroflow(&["config", strict.to_str().unwrap()]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.starts_with("error: zero_optimization.overlap_com: unknown key"), "{stderr}");
    assert!(stderr.contains("did you mean \"overlap_comm\""), "{stderr}");

    let lax = dir.join("lax.json");
    std::fs::write(&lax, r#"{"train_batch_size": 8, "mystery": 1}"#).unwrap();
    let run = zeroflow(&["config", lax.to_str().unwrap()]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(text(&run.stderr).contains("warning: unknown key mystery"), "{}", text(&run.stderr));
}
