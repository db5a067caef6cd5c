//! Checkpoints of `zeroflow train`: exact resume (straight, after a crash; after a signal in
//! `run_control.rs`),
//! `--init-from` an exported model, and checkpoints that cannot be used, which exit 2 and change
//! nothing on disk.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{MINI, read_lines, scratch, text, train};

/// A schedule that does not depend on `--steps` (the default config's warm-up and decay are sized
/// from it, so a run cut short at N is not the first half of a run of 2N): WarmupLR over 3 steps.
const CONSTANT_AFTER_WARMUP: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3}}
}"#;

/// Stage 2 with the optimizer offloaded, the delayed update after 2 steps, and accumulation 2.
const OFFLOAD_DELAYED: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "gradient_accumulation_steps": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
  "zeroflow": {"delayed_update": {"enabled": true, "warmup_steps": 2}}
}"#;

/// ZenFlow with the CPU step overlapped: a quarter of each weight's columns on the device every
/// step, the rest every 2 steps on the CPU, reselected every 4; N = 5 cuts a window in two.
const ZENFLOW: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                        "zenflow": {"topk_ratio": 0.25, "select_strategy": "step",
                                    "select_interval": 4, "update_interval": 2,
                                    "overlap_step": true}}
}"#;

/// Stage 2 with the optimizer offloaded and the exact step: where the device share acts.
const OFFLOAD_EXACT: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
}"#;

const N: u64 = 5;

fn checkpoint(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step-{step:08}"))
}

/// `zeroflow train` with the config `config` (written beside the run), MINI, and `args`.
fn train_with(config: &str, dir: &Path, args: &[&str]) -> std::process::Output {
    let file = dir.join("ds.json");
    std::fs::write(&file, config).unwrap();
    let base = ["--config", file.to_str().unwrap(), "--model", MINI];
    let run = train(&[&base[..], args].concat());
    assert!(run.status.success(), "{args:?}: {}", text(&run.stderr));
    run
}

/// The step lines of `metrics.jsonl` without the timing, and the evaluation lines.
fn curves(run: &Path) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
    let mut lines = read_lines(&run.join("metrics.jsonl"));
    for line in &mut lines {
        line.as_object_mut().unwrap().remove("tokens_per_s");
    }
    lines.into_iter().partition(|line| line.get("loss").is_some())
}

/// The tensors of a safetensors file with their dtype, shape and bytes, and its metadata. (The
/// file's bytes are not compared: safetensors writes the metadata map in hash order.)
pub(crate) type Contents =
    (Vec<(String, String, Vec<usize>, Vec<u8>)>, Option<Vec<(String, String)>>);

pub(crate) fn tensors(path: &Path) -> Contents {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = file
        .tensors()
        .into_iter()
        .map(|(name, v)| (name, format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    tensors.sort();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut metadata: Option<Vec<(String, String)>> =
        metadata.metadata().clone().map(|m| m.into_iter().collect());
    if let Some(m) = &mut metadata {
        m.sort();
    }
    (tensors, metadata)
}

/// The final weights and optimizer state (bit for bit), and the metrics, of two runs are the
/// same; the weights file is byte-identical.
fn assert_same_run(straight: &Path, resumed: &Path, name: &str) {
    let file = |run: &Path, file: &str| checkpoint(run, 2 * N).join(file);
    let model = |run: &Path| std::fs::read(file(run, "model.safetensors")).unwrap();
    assert!(model(straight) == model(resumed), "{name}: model.safetensors differs");
    let optim = |run: &Path| tensors(&file(run, "optim/rank-0.safetensors"));
    assert!(optim(straight) == optim(resumed), "{name}: the optimizer state differs");
    let (steps, evals) = curves(straight);
    assert_eq!(steps.len() as u64, 2 * N);
    assert_eq!(curves(resumed), (steps, evals), "{name}: metrics.jsonl");
}

/// `--steps 2N` straight and `--steps N`, then `--resume latest --steps 2N`, end with the same
/// bytes in the final checkpoint and the same metrics, with a warm-up schedule, with offload,
/// accumulation and the delayed update (whose pending weights the checkpoint must carry), and with
/// ZenFlow (whose selection, window and running CPU step the checkpoint must carry).
#[test]
fn resume_latest_continues_bit_identically() {
    for (name, config) in [
        ("warmup", CONSTANT_AFTER_WARMUP),
        ("offload_delayed", OFFLOAD_DELAYED),
        ("zenflow", ZENFLOW),
    ] {
        let dir = scratch(&format!("resume_{name}"));
        let (straight, split) = (dir.join("straight"), dir.join("split"));
        let (half, full) = (N.to_string(), (2 * N).to_string());
        train_with(config, &dir, &["--steps", &full, "--out", straight.to_str().unwrap()]);
        train_with(config, &dir, &["--steps", &half, "--out", split.to_str().unwrap()]);
        assert!(checkpoint(&split, N).join("state.json").is_file(), "{name}: saved at the end");
        let out = split.to_str().unwrap();
        train_with(config, &dir, &["--resume", "latest", "--steps", &full, "--out", out]);
        assert_same_run(&straight, &split, name);
        let state: serde_json::Value = serde_json::from_slice(
            &std::fs::read(checkpoint(&split, 2 * N).join("state.json")).unwrap(),
        )
        .unwrap();
        let extra = &state["extra"];
        assert_eq!(extra["step"], 2 * N);
        assert_eq!(extra["model"]["d_model"], 16);
        assert!(extra["data_position"]["offset"].as_u64().unwrap() > 0, "{extra}");
    }
}

/// A run whose device share holds half the optimizer (its state on the device only) saves the
/// whole state and resumes with any share: `--steps N` at share 0.5 then `--resume latest --steps
/// 2N` at 0, and the other way round, each end with the final checkpoint's bytes and the metrics
/// of `--steps 2N` at share 0 straight.
#[test]
fn a_device_share_saves_the_whole_state_and_resumes_with_any_share() {
    let dir = scratch("resume_device_share");
    let (half, full) = (N.to_string(), (2 * N).to_string());
    let straight = dir.join("straight");
    let out = straight.to_str().unwrap();
    train_with(OFFLOAD_EXACT, &dir, &["--device-share", "0", "--steps", &full, "--out", out]);
    for (name, first, then) in [("half_then_none", "0.5", "0"), ("none_then_half", "0", "0.5")] {
        let split = dir.join(name);
        let out = split.to_str().unwrap();
        train_with(OFFLOAD_EXACT, &dir, &["--device-share", first, "--steps", &half, "--out", out]);
        let resume = ["--device-share", then, "--resume", "latest", "--steps", &full, "--out", out];
        train_with(OFFLOAD_EXACT, &dir, &resume);
        assert_same_run(&straight, &split, name);
        // The resumed run held the share it was asked for.
        let summary = std::fs::read_to_string(split.join("summary.json")).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
        let recorded = summary["settings"]["offload"]["device_share"].as_f64();
        assert_eq!(recorded, then.parse().ok(), "{name}: {summary}");
    }
}

/// A run trained on rows shorter than the model's context resumes on rows of the same length
/// without being told (`state.json` keeps `--seq`), bit-identically; a resume that asks for
/// another length is refused, naming both (exit 2), and changes nothing.
#[test]
fn a_resume_keeps_the_runs_sequence_length() {
    let dir = scratch("resume_seq");
    let (straight, split) = (dir.join("straight"), dir.join("split"));
    let (half, full) = (N.to_string(), (2 * N).to_string());
    let config = CONSTANT_AFTER_WARMUP;
    train_with(
        config,
        &dir,
        &["--seq", "8", "--steps", &full, "--out", straight.to_str().unwrap()],
    );
    train_with(config, &dir, &["--seq", "8", "--steps", &half, "--out", split.to_str().unwrap()]);
    let out = split.to_str().unwrap();
    let file = dir.join("ds.json");
    let other = train(&[
        "--config",
        file.to_str().unwrap(),
        "--resume",
        "latest",
        "--steps",
        &full,
        "--seq",
        "16",
        "--out",
        out,
    ]);
    assert_eq!(other.status.code(), Some(2), "{}", text(&other.stderr));
    let said = text(&other.stderr);
    assert!(said.contains("--seq 16 differs from the checkpoint's 8"), "{said}");
    assert!(!checkpoint(&split, 2 * N).exists(), "a refused resume wrote a checkpoint");
    train_with(config, &dir, &["--resume", "latest", "--steps", &full, "--out", out]);
    assert_same_run(&straight, &split, "seq 8");
}

/// A crash while writing the checkpoint after step N leaves a hidden partial directory; a damaged
/// newest checkpoint (truncated by the disk, since writes are atomic) is passed over. `--resume
/// latest` continues from the newest good checkpoint, still bit-identically, keeps the damaged
/// one aside instead of deleting it, and removes the partial directory.
#[test]
fn resume_latest_skips_partial_and_damaged_checkpoints() {
    let dir = scratch("resume_after_crash");
    let (straight, split) = (dir.join("straight"), dir.join("split"));
    let config = CONSTANT_AFTER_WARMUP;
    let (full, every) = ((2 * N).to_string(), "2");
    train_with(
        config,
        &dir,
        &["--steps", &full, "--save-every", every, "--out", straight.to_str().unwrap()],
    );
    let half = N.to_string();
    train_with(
        config,
        &dir,
        &["--steps", &half, "--save-every", every, "--out", split.to_str().unwrap()],
    );
    // Checkpoints at 2, 4 and 5 (the end); then a crash during the write of step 6 ...
    let partial = split.join("checkpoints").join(format!(".step-{:08}.partial-99999", N + 1));
    std::fs::create_dir_all(partial.join("optim")).unwrap();
    std::fs::write(partial.join("model.safetensors"), b"partial").unwrap();
    // ... and the newest complete one truncated.
    let newest = checkpoint(&split, N).join("model.safetensors");
    let bytes = std::fs::read(&newest).unwrap();
    std::fs::write(&newest, &bytes[..bytes.len() / 2]).unwrap();
    let out = split.to_str().unwrap();
    let run = train_with(config, &dir, &["--resume", "latest", "--steps", &full, "--out", out]);
    let stderr = text(&run.stderr);
    assert!(stderr.contains("damaged") || stderr.is_empty(), "{stderr}");
    assert_same_run(&straight, &split, "after a crash");
    let aside = split.join("checkpoints").join(format!(".step-{N:08}.damaged"));
    assert_eq!(std::fs::read(aside.join("model.safetensors")).unwrap(), &bytes[..bytes.len() / 2]);
    assert!(!partial.exists(), "the partial directory, never a checkpoint, is removed");
}

/// A checkpoint exported with `zeroflow export` starts a new run with its weights: the new run's
/// step-0 evaluation equals the exporting run's final one, with the shape from its config.json.
#[test]
fn init_from_an_exported_checkpoint_starts_from_its_weights() {
    for config in [CONSTANT_AFTER_WARMUP, OFFLOAD_DELAYED] {
        init_from_export(config);
    }
}

/// Trains with `config`, exports the final checkpoint, and starts a run from the export: its
/// step-0 eval loss equals the exporting run's final one (taken after the delayed update's last
/// weights arrived, which the export must carry too). The run's own `--export` wrote the same
/// files (the device's weights once the last update arrived; the checkpoint, saved before,
/// holds them as its master weights).
fn init_from_export(config: &str) {
    let dir = scratch(if config == OFFLOAD_DELAYED { "init_from_delayed" } else { "init_from" });
    let (first, at_end) = (dir.join("first"), dir.join("at-end"));
    let args = ["--steps", "3", "--out", first.to_str().unwrap()];
    train_with(config, &dir, &[&args[..], &["--export", at_end.to_str().unwrap()]].concat());
    let exported = dir.join("exported");
    let export = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["export", checkpoint(&first, 3).to_str().unwrap(), "--out"])
        .arg(&exported)
        .output()
        .unwrap();
    assert!(export.status.success(), "{}", text(&export.stderr));
    let relative = |dir: &Path| -> Vec<(PathBuf, Vec<u8>)> {
        let files = contents(dir).into_iter();
        files.map(|(path, bytes)| (path.strip_prefix(dir).unwrap().to_path_buf(), bytes)).collect()
    };
    let exported_files = relative(&exported);
    assert_eq!(exported_files.len(), 2, "config.json and model.safetensors");
    assert!(relative(&at_end) == exported_files, "train --export wrote other files than export");
    let second = dir.join("second");
    let init = exported.to_str().unwrap();
    let run = train(&[
        "--init-from",
        init,
        "--micro-batch",
        "2",
        "--steps",
        "2",
        "--out",
        second.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let eval = |run: &Path| -> Vec<(u64, f64)> {
        read_lines(&run.join("metrics.jsonl"))
            .iter()
            .filter_map(|l| Some((l["step"].as_u64()?, l.get("eval_loss")?.as_f64()?)))
            .collect()
    };
    let (exporting, imported) = (eval(&first), eval(&second));
    assert_eq!(imported[0].0, 0, "{imported:?}");
    assert_eq!(imported[0].1, exporting.last().unwrap().1, "step-0 loss = the exported final loss");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(second.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["model"], serde_json::from_str::<serde_json::Value>(MINI).unwrap());
}

/// Every file under `dir` with its bytes, to show that nothing changed.
fn contents(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut all = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(next) = stack.pop() {
        for entry in std::fs::read_dir(&next).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                all.push((path.clone(), Vec::new()));
                stack.push(path);
            } else {
                all.push((path.clone(), std::fs::read(&path).unwrap()));
            }
        }
    }
    all.sort();
    all
}

/// Missing, foreign, truncated and mismatched checkpoints, `latest` with nothing to resume, and
/// an `--init-from` directory without weights: exit 2 with a message saying what is wrong, and
/// every file as it was.
#[test]
fn unusable_checkpoints_exit_2_and_change_nothing() {
    let dir = scratch("unusable");
    let run = dir.join("run");
    let good = checkpoint(&run, 2);
    let ok = train(&[
        "--model",
        MINI,
        "--micro-batch",
        "2",
        "--steps",
        "2",
        "--out",
        run.to_str().unwrap(),
    ]);
    assert!(ok.status.success(), "{}", text(&ok.stderr));
    let edit = |name: &str, file: &str, change: &dyn Fn(Vec<u8>) -> Vec<u8>| -> String {
        let copy = dir.join(name).join("checkpoints").join("step-00000002");
        std::fs::create_dir_all(copy.join("optim")).unwrap();
        for f in ["state.json", "model.safetensors", "optim/rank-0.safetensors"] {
            std::fs::copy(good.join(f), copy.join(f)).unwrap();
        }
        std::fs::write(copy.join(file), change(std::fs::read(copy.join(file)).unwrap())).unwrap();
        copy.to_str().unwrap().to_owned()
    };
    let replace = |from: &'static str, to: &'static str| {
        move |b: Vec<u8>| String::from_utf8(b).unwrap().replace(from, to).into_bytes()
    };
    let truncated = edit("truncated", "model.safetensors", &|b| b[..b.len() - 9].to_vec());
    let foreign = edit("foreign", "state.json", &replace("zeroflow-checkpoint", "other-trainer"));
    let bf16 = edit("bf16", "state.json", &replace("\"F32\"", "\"BF16\""));
    let empty = dir.join("empty");
    std::fs::create_dir_all(empty.join("checkpoints")).unwrap();
    let no_weights = dir.join("no_weights");
    std::fs::create_dir_all(&no_weights).unwrap();
    std::fs::write(no_weights.join("config.json"), "{}").unwrap();
    let (good_s, run_s) = (good.to_str().unwrap(), run.to_str().unwrap());
    let new_out = dir.join("new");
    let missing = dir.join("missing").join("checkpoints").join("step-00000002");
    let cases: &[(&str, Vec<&str>, &str)] = &[
        ("missing", vec!["--resume", missing.to_str().unwrap()], "no state.json"),
        ("foreign", vec!["--resume", &foreign], "not a zeroflow checkpoint"),
        ("truncated", vec!["--resume", &truncated], "damaged"),
        ("other dtype", vec!["--resume", &bf16], "weights are BF16"),
        (
            "latest, no checkpoints",
            vec!["--resume", "latest", "--out", empty.to_str().unwrap()],
            "no checkpoints in",
        ),
        ("latest without --out", vec!["--resume", "latest"], "--resume latest needs --out"),
        (
            "other model",
            vec![
                "--resume",
                good_s,
                "--model",
                r#"{"n_layer":2,"n_head":2,"d_model":16,"vocab_size":64,"context":16}"#,
            ],
            "--model",
        ),
        ("already there", vec!["--resume", good_s, "--steps", "2"], "pass a larger --steps"),
        (
            "other out",
            vec!["--resume", good_s, "--out", empty.to_str().unwrap()],
            "continues in its run directory",
        ),
        (
            "init-from without weights",
            vec!["--init-from", no_weights.to_str().unwrap(), "--out", new_out.to_str().unwrap()],
            "model.safetensors",
        ),
        (
            "init-from with resume",
            vec!["--init-from", run_s, "--resume", good_s],
            "cannot be used with",
        ),
    ];
    let before = contents(&dir);
    for (name, args, message) in cases {
        let out = train(args);
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {stderr}");
        assert!(stderr.contains(message), "{name}: expected `{message}` in: {stderr}");
        assert!(contents(&dir) == before, "{name}: changed files");
    }
}
