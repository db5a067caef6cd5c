//! The offload stream's tuning (`ZEROFLOW_STREAM_CHUNK_MIB`, `ZEROFLOW_COPY_STORES`) as a user sets
//! it for `zeroflow train`: it changes how the step travels, not what it computes, and a value it
//! does not accept exits 2 before anything is written.

use std::path::Path;
use std::process::{Command, Output};

use super::{MINI, read_lines, scratch, text};

/// Stage 2 with the optimizer offloaded and one micro-step per step: the streaming step.
const OFFLOAD: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
}"#;

/// `OFFLOAD` with two micro-steps per step (summed on the device where it is asked to).
const OFFLOAD_ACCUMULATING: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
}"#;

/// `zeroflow train` of `MINI` with `OFFLOAD` for 4 steps into `dir/run`, with `tuning` set (and
/// only that) of the two variables, logging at info level.
fn train_tuned(dir: &Path, tuning: &[(&str, &str)]) -> Output {
    train_with(dir, OFFLOAD, tuning)
}

/// [`train_tuned`] with the DeepSpeed config `ds`.
fn train_with(dir: &Path, ds: &str, tuning: &[(&str, &str)]) -> Output {
    let config = dir.join("ds.json");
    std::fs::write(&config, ds).unwrap();
    let (config, out) = (config.to_str().unwrap(), dir.join("run"));
    let args = ["--config", config, "--model", MINI, "--steps", "4", "--eval-every", "2", "--out"];
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .arg("train")
        .args(args)
        .arg(&out)
        .env("ZEROFLOW_LOG", "info")
        .env_remove("ZEROFLOW_STREAM_CHUNK_MIB")
        .env_remove("ZEROFLOW_COPY_STORES")
        .env_remove("ZEROFLOW_OVERLAP_FORWARD")
        .env_remove("ZEROFLOW_ACCUMULATE_ON")
        .env_remove("ZEROFLOW_DEVICE_SHARE")
        .envs(tuning.iter().copied())
        .output()
        .expect("run zeroflow")
}

/// Every step's loss and gradient norm, as metrics.jsonl has them.
fn losses_and_norms(dir: &Path) -> Vec<(serde_json::Value, serde_json::Value)> {
    let lines = read_lines(&dir.join("run").join("metrics.jsonl"));
    let steps = lines.iter().filter(|l| l.get("loss").is_some());
    steps.map(|l| (l["loss"].clone(), l["grad_norm"].clone())).collect()
}

/// 1e-4 MiB of f32 (the CPU device's dtype) is 26 elements: the stream goes in hundreds of
/// uneven chunks, with ordinary stores, and every step's loss and norm are the default's.
#[test]
fn offload_stream_tuning_is_logged_and_trains_exactly_as_the_default() {
    let default_dir = scratch("stream_tuning_default");
    let run = train_tuned(&default_dir, &[]);
    assert!(run.status.success(), "stderr: {}", text(&run.stderr));
    assert!(!text(&run.stderr).contains("offload stream tuned"), "{}", text(&run.stderr));

    let tuned_dir = scratch("stream_tuning_tuned");
    let tuning = [("ZEROFLOW_STREAM_CHUNK_MIB", "1e-4"), ("ZEROFLOW_COPY_STORES", "Normal")];
    let run = train_tuned(&tuned_dir, &tuning);
    let stderr = text(&run.stderr);
    assert!(run.status.success(), "stderr: {stderr}");
    assert!(
        stderr.contains("chunks of 26 elements") && stderr.contains("normal stores"),
        "the chosen tuning is logged: {stderr}"
    );
    let default = losses_and_norms(&default_dir);
    assert_eq!(default.len(), 4);
    assert_eq!(losses_and_norms(&tuned_dir), default);
}

/// The exact step's CPU work overlapped with the next forward (the default) against the step
/// done before it (`ZEROFLOW_OVERLAP_FORWARD=off`), in chunks of 26 elements that the forward
/// opens a few at a time, with evaluations between steps: the same losses, norms and eval losses;
/// with one micro-step per step, and with two summed on the device.
#[test]
fn the_step_overlapped_with_the_next_forward_trains_exactly_as_the_step_before_it() {
    let chunk = ("ZEROFLOW_STREAM_CHUNK_MIB", "1e-4");
    let on_device = ("ZEROFLOW_ACCUMULATE_ON", "device");
    let runs =
        [("on", "overlapped with the next forward"), ("off", "done before the next forward")];
    for (name, ds) in [("one", OFFLOAD), ("summed", OFFLOAD_ACCUMULATING)] {
        let mut seen = Vec::new();
        for (overlap, logged) in runs {
            let dir = scratch(&format!("stream_tuning_overlap_{name}_{overlap}"));
            let run =
                train_with(&dir, ds, &[chunk, on_device, ("ZEROFLOW_OVERLAP_FORWARD", overlap)]);
            let stderr = text(&run.stderr);
            assert!(run.status.success(), "stderr: {stderr}");
            assert!(stderr.contains(logged), "the choice is logged: {stderr}");
            let lines = read_lines(&dir.join("run").join("metrics.jsonl"));
            let evals: Vec<_> = lines.iter().filter_map(|l| l.get("eval_loss").cloned()).collect();
            assert_eq!(evals.len(), 2, "{lines:?}");
            seen.push((losses_and_norms(&dir), evals));
        }
        assert_eq!(seen[0].0.len(), 4, "{name}");
        assert_eq!(seen[0], seen[1], "{name}");
    }
}

/// Half the optimizer's partition held and stepped on the device (`ZEROFLOW_DEVICE_SHARE=0.5`),
/// its state in device memory or staged from host memory (`ZEROFLOW_DEVICE_SHARE_STATE`), with
/// the step before the next forward and overlapped with it, against the CPU stepping it all: the
/// same losses, norms and eval losses, and the share and its state's place in the log and in the
/// run's recorded settings; with one micro-step per step, and with two summed on the device. With
/// two summed on the host, where the share cannot act, the run is refused before it starts,
/// saying so; a host state with `fit` too, and a host state alone takes the default share.
#[test]
fn the_device_share_trains_exactly_as_the_cpu_alone_and_is_refused_where_it_cannot_act() {
    let chunk = ("ZEROFLOW_STREAM_CHUNK_MIB", "1e-4");
    let on_device = ("ZEROFLOW_ACCUMULATE_ON", "device");
    for (name, ds) in [("one", OFFLOAD), ("summed", OFFLOAD_ACCUMULATING)] {
        let mut seen = Vec::new();
        for (share, overlap, place) in [
            ("0", "off", "device"),
            ("0.5", "off", "device"),
            ("0.5", "on", "device"),
            ("0.5", "off", "host"),
            ("0.5", "on", "host"),
        ] {
            let dir = scratch(&format!("stream_tuning_share_{name}_{share}_{overlap}_{place}"));
            let share_var = ("ZEROFLOW_DEVICE_SHARE", share);
            let place_var = ("ZEROFLOW_DEVICE_SHARE_STATE", place);
            let overlap_var = ("ZEROFLOW_OVERLAP_FORWARD", overlap);
            let run = train_with(&dir, ds, &[chunk, on_device, share_var, place_var, overlap_var]);
            let stderr = text(&run.stderr);
            assert!(run.status.success(), "{name}: stderr: {stderr}");
            let logged = format!(
                "{share} of the partition's optimizer state stepped on the device (its state in \
                 {place} memory)"
            );
            assert!(stderr.contains(&logged), "{name}: the share is logged: {stderr}");
            let summary: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join("run").join("summary.json")).unwrap(),
            )
            .unwrap();
            let recorded = &summary["settings"]["offload"]["device_share_state"];
            assert_eq!(recorded.as_str(), Some(place), "{name}: {summary}");
            let lines = read_lines(&dir.join("run").join("metrics.jsonl"));
            let evals: Vec<_> = lines.iter().filter_map(|l| l.get("eval_loss").cloned()).collect();
            seen.push((losses_and_norms(&dir), evals));
        }
        assert_eq!(seen[0].0.len(), 4, "{name}");
        assert_eq!(seen[1], seen[0], "{name}: the share before the forward");
        assert_eq!(seen[2], seen[0], "{name}: the share overlapped with the forward");
        assert_eq!(seen[3], seen[0], "{name}: the share staged, before the forward");
        assert_eq!(seen[4], seen[0], "{name}: the share staged, overlapped with the forward");
    }

    let dir = scratch("stream_tuning_share_accumulating_on_the_host");
    let on_host = ("ZEROFLOW_ACCUMULATE_ON", "host");
    let run = train_with(&dir, OFFLOAD_ACCUMULATING, &[on_host, ("ZEROFLOW_DEVICE_SHARE", "0.5")]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("ZEROFLOW_DEVICE_SHARE") && stderr.contains("set it to 0"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let dir = scratch("stream_tuning_share_fit_with_a_host_state");
    let fit = [("ZEROFLOW_DEVICE_SHARE", "fit"), ("ZEROFLOW_DEVICE_SHARE_STATE", "host")];
    let run = train_with(&dir, OFFLOAD, &fit);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("give a fraction instead"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    // A host state alone takes the default staged share, and says so.
    let dir = scratch("stream_tuning_share_default_with_a_host_state");
    let run = train_with(&dir, OFFLOAD, &[("ZEROFLOW_DEVICE_SHARE_STATE", "host")]);
    let stderr = text(&run.stderr);
    assert!(run.status.success(), "{stderr}");
    assert!(stderr.contains("device share 0.4 (the default with its state in host memory)"));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("run").join("summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["settings"]["offload"]["device_share"].as_f64(), Some(0.4), "{summary}");
}

/// `ZEROFLOW_DEVICE_SHARE=fit` on the CPU device, whose memory is the host's: the memory plan
/// chooses 0 and says why, the run records the share it used, and trains as with share 0.
#[test]
fn the_device_share_that_fits_is_0_on_the_cpu_device_and_says_why() {
    let mut seen = Vec::new();
    for share in ["fit", "0"] {
        let dir = scratch(&format!("stream_tuning_share_{share}"));
        let run = train_with(&dir, OFFLOAD, &[("ZEROFLOW_DEVICE_SHARE", share)]);
        let stderr = text(&run.stderr);
        assert!(run.status.success(), "{share}: stderr: {stderr}");
        if share == "fit" {
            assert!(stderr.contains("device share fit: 0 of"), "{stderr}");
            assert!(stderr.contains("no GPU's memory to fill"), "{stderr}");
        }
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("run").join("summary.json")).unwrap(),
        )
        .unwrap();
        let recorded = &summary["settings"]["offload"]["device_share"];
        assert_eq!(recorded.as_f64(), Some(0.0), "{share}: {summary}");
        seen.push(losses_and_norms(&dir));
    }
    assert_eq!(seen[0].len(), 4);
    assert_eq!(seen[0], seen[1]);
}

#[test]
fn a_bad_offload_stream_tuning_exits_2_naming_the_variable() {
    for (name, value, accepted) in [
        ("ZEROFLOW_STREAM_CHUNK_MIB", "0", "positive number of MiB"),
        ("ZEROFLOW_STREAM_CHUNK_MIB", "32MiB", "positive number of MiB"),
        ("ZEROFLOW_COPY_STORES", "streaming", "normal or non-temporal"),
        ("ZEROFLOW_OVERLAP_FORWARD", "sometimes", "on or off"),
        ("ZEROFLOW_DEVICE_SHARE", "1", "fraction at least 0 and below 1"),
    ] {
        let dir = scratch(&format!("stream_tuning_bad_{value}"));
        let run = train_tuned(&dir, &[(name, value)]);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{name}={value}: {stderr}");
        assert!(stderr.contains(name) && stderr.contains(accepted), "{name}={value}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!dir.join("run").exists(), "{name}={value}: the output directory was created");
    }
}
