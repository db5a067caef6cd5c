//! The flags users expect (issue 24, item 10), each shown to take effect.

use super::*;

fn train_ok(args: &[&str]) -> Output {
    let run = zeroflow(&[&["train"][..], args].concat());
    assert!(run.status.success(), "{args:?}: {}", text(&run.stderr));
    run
}

/// The step whose learning rate is the highest: the first after the warm-up.
fn peak_lr_step(out: &Path) -> u64 {
    let lines = step_lines(out);
    let lr = |line: &serde_json::Value| line["lr"].as_f64().expect("lr");
    let peak = lines.iter().max_by(|a, b| lr(a).total_cmp(&lr(b))).expect("steps");
    peak["step"].as_u64().expect("step")
}

#[test]
fn warmup_sets_the_length_of_the_learning_rates_warm_up() {
    let dir = scratch("warmup");
    let base = [
        "--model",
        MINI,
        "--steps",
        "10",
        "--micro-batch",
        "2",
        "--eval-every",
        "0",
        "--eval-tokens",
        "64",
    ];
    let default = dir.join("default");
    train_ok(&[&base[..], &["--out", default.to_str().unwrap()]].concat());
    // 5 % of 10 steps, raised to DeepSpeed's minimum of 2: the peak is at step 3.
    assert_eq!(peak_lr_step(&default), 3);
    let long = dir.join("long");
    train_ok(&[&base[..], &["--warmup", "6", "--out", long.to_str().unwrap()]].concat());
    assert_eq!(peak_lr_step(&long), 7);
    let too_long = zeroflow(&[&["train"][..], &base, &["--warmup", "11"]].concat());
    assert_eq!(too_long.status.code(), Some(2), "{}", text(&too_long.stderr));
}

#[test]
fn seq_sets_the_training_sequence_length_up_to_the_context() {
    let dir = scratch("seq");
    let out = dir.join("run");
    let run = train_ok(&[
        "--model",
        MINI,
        "--seq",
        "8",
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
    assert!(stderr.contains("2 sequences of 8 tokens"), "the run header: {stderr}");
    let summary = read_json(&out.join("summary.json"));
    assert_eq!(summary["tokens"], 2 * 2 * 8, "{summary}");
    let long = zeroflow(&["train", "--model", MINI, "--seq", "17", "--steps", "2"]);
    let stderr = text(&long.stderr);
    assert_eq!(long.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--seq 17") && stderr.contains("context of 16"), "{stderr}");
}

#[test]
fn weight_decay_fills_the_optimizer_and_changes_the_training() {
    let dir = scratch("weight_decay");
    let base = [
        "--model",
        MINI,
        "--steps",
        "4",
        "--micro-batch",
        "2",
        "--lr",
        "1e-2",
        "--eval-every",
        "0",
        "--eval-tokens",
        "64",
    ];
    let losses = |decay: &str| {
        let out = dir.join(decay);
        let run = train_ok(
            &[&base[..], &["--weight-decay", decay, "--out", out.to_str().unwrap()]].concat(),
        );
        // Said where it decays: the 1-D parameters (norms, biases) take none.
        let said = text(&run.stderr).contains("not on the");
        assert_eq!(said, decay != "0", "{}", text(&run.stderr));
        let summary = read_json(&out.join("summary.json"));
        let used = summary["config"]["optimizer"]["params"]["weight_decay"].as_f64();
        assert_eq!(used, Some(decay.parse().unwrap()), "{summary}");
        step_lines(&out).iter().map(|l| l["loss"].as_f64().unwrap()).collect::<Vec<_>>()
    };
    let (without, with) = (losses("0"), losses("0.5"));
    // The same seed and data: the first step's loss is the same, later ones differ by the decay.
    assert_eq!(without[0], with[0]);
    assert_ne!(without[3], with[3]);
}

/// The same training (the synthetic training stream does not depend on the evaluation), evaluated
/// over 64 and over 256 tokens of the held-out stream: the final eval losses are means over
/// different data, so they differ, and the default (16,384 tokens) differs from both.
#[test]
fn eval_tokens_sets_how_much_data_an_evaluation_reads() {
    let dir = scratch("eval_tokens");
    let final_eval = |tokens: Option<&str>| {
        let out = dir.join(tokens.unwrap_or("default"));
        let mut flags = vec![
            "--model",
            MINI,
            "--steps",
            "2",
            "--micro-batch",
            "2",
            "--eval-every",
            "0",
            "--out",
            out.to_str().unwrap(),
        ];
        flags.extend(tokens.map(|t| ["--eval-tokens", t]).into_iter().flatten());
        train_ok(&flags);
        let summary = read_json(&out.join("summary.json"));
        let lines = step_lines(&out);
        let eval_tokens = summary["eval_tokens"].as_u64().expect("the eval set's size");
        (
            summary["final_eval_loss"].as_f64().expect("an eval loss"),
            lines[1]["loss"].clone(),
            eval_tokens,
        )
    };
    let (small, small_train, small_tokens) = final_eval(Some("64"));
    let (large, large_train, large_tokens) = final_eval(Some("256"));
    let (default, _, default_tokens) = final_eval(None);
    assert_eq!(small_train, large_train, "the training is the same");
    assert_eq!((small_tokens, large_tokens, default_tokens), (64, 256, 16_384));
    assert!(small != large && large != default && small != default, "{small} {large} {default}");
}

#[test]
fn gpu_needs_cuda_and_one_process() {
    let run = zeroflow(&["train", "--gpu", "1", "--steps", "2"]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--gpu") && stderr.contains("--device cuda"), "{stderr}");
}

/// `bench step --mode offload` given to `train` or `plan` says that their mode comes from the
/// config and names the example config of that mode for the device, which then plans (clap
/// alone suggested --model).
#[test]
fn mode_says_the_config_sets_the_mode_and_names_one_that_plans() {
    let cases = [
        ("gpu", None, "cpu-zero2.json"),
        ("offload", None, "cpu-zero2-offload.json"),
        ("zenflow", Some("cuda"), "zero2-zenflow-bf16.json"),
        ("offload-delayed", Some("cuda"), "zero2-offload-bf16.json"),
    ];
    // Where a run would write if --mode were let through (briefly: two steps).
    let out = scratch("mode");
    let out = out.to_str().unwrap();
    for (command, (mode, device, config)) in ["train", "plan"].into_iter().cycle().zip(cases) {
        let mut args = vec![command, "--model", MINI, "--mode", mode, "--steps", "2", "--out", out];
        args.extend(device.map(|device| ["--device", device]).into_iter().flatten());
        let run = zeroflow(&args);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{args:?}: {stderr}");
        let named = format!("--config examples/configs/{config}");
        assert!(stderr.contains(&named) && stderr.contains("bench step"), "{args:?}: {stderr}");
        assert!(!stderr.contains("similar argument"), "{args:?}: {stderr}");
        // The config named plans that mode (a GPU's plan for an 80 GiB one, which needs none).
        let path = repo_root().join("examples/configs").join(config);
        let mut plan = vec!["plan", "--model", MINI, "--json", "--config", path.to_str().unwrap()];
        if device.is_some() {
            plan.extend(["--device", "cuda", "--gpu-memory", "80"]);
        }
        let planned = zeroflow(&plan);
        assert!(planned.status.success(), "{plan:?}: {}", text(&planned.stderr));
    }
}

#[test]
fn launch_accepts_torchruns_spelling_of_nproc_per_node() {
    let run = zeroflow(&["launch", "--nproc_per_node", "2", "--", "dist-check"]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let stdout = text(&run.stdout);
    assert!(stdout.contains("[rank 1]"), "two ranks ran: {stdout}");
}

#[test]
fn every_new_flag_is_in_the_help() {
    let help = text(&zeroflow(&["train", "--help"]).stdout);
    for flag in ["--seq", "--warmup", "--weight-decay", "--eval-tokens", "--eval-data", "--gpu"] {
        assert!(help.contains(flag), "{flag} in train --help");
    }
    let help = text(&zeroflow(&["config", "--help"]).stdout);
    for flag in [
        "--micro-batch",
        "--accum",
        "--lr",
        "--steps",
        "--warmup",
        "--weight-decay",
        "--device",
        "--model",
    ] {
        assert!(help.contains(flag), "{flag} in config --help");
    }
    assert!(text(&zeroflow(&["launch", "--help"]).stdout).contains("--nproc_per_node"));
}

#[test]
fn models_lists_every_named_size_with_parameters_and_memory_per_mode() {
    let run = zeroflow(&["models"]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let table = text(&run.stdout);
    for name in ["tiny", "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt-1.3b"] {
        assert!(table.lines().any(|line| line.starts_with(name)), "{name} in {table}");
    }
    assert!(table.contains("124439808") && table.contains("offload: GPU / host"), "{table}");
    assert!(table.contains("bf16 weights and gradients"), "the assumptions are stated: {table}");

    let run = zeroflow(&["models", "--json", "--world-size", "2"]);
    let out: serde_json::Value = serde_json::from_slice(&run.stdout).expect("JSON");
    let gpt2 = out["models"].as_array().unwrap().iter().find(|m| m["name"] == "gpt2-124m").unwrap();
    let params = 124_439_808f64;
    // The engine's buffers: bf16 weights and gradients whole on each GPU (2 + 2 B), the rest
    // halved by ZeRO-2 over 2 ranks: the reduced bf16 partition, fp32 master weights, moments and
    // accumulator (2 + 16 B); offload: the 12 B on the host with 96 MiB of staging. The padded
    // layout adds less than a thousandth.
    let per_param = |mode: &str, memory: &str, staging: f64| {
        (gpt2["memory"][mode][memory].as_f64().unwrap() - staging) / params
    };
    let gpu = per_param("gpu", "gpu_bytes", 0.0);
    assert!((gpu - (4.0 + 18.0 / 2.0)).abs() < 1e-3 * gpu, "{gpu} B/param");
    let host = per_param("offload", "host_bytes", 96.0 * f64::from(1 << 20));
    assert!((host - 12.0 / 2.0).abs() < 1e-3 * host, "{host} B/param");
}
