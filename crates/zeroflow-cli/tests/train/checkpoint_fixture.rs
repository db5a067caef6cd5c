//! A checkpoint written before `state.json` recorded the model family (`tests/fixtures/
//! checkpoint-before-family`): it still resumes, continuing the run it was saved from, and still
//! exports; a checkpoint of a family this zeroflow does not know is refused, naming it.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{MINI, read_lines, scratch, text, train};

/// The fixture's config (`ds.json`): WarmupLR over 3 steps, then constant.
const FIXTURE_CONFIG: &str = "tests/fixtures/checkpoint-before-family/ds.json";

/// A copy of the fixture run directory in a fresh scratch directory `name`/run.
fn fixture_copy(name: &str) -> PathBuf {
    let from =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint-before-family");
    let run = scratch(name).join("run");
    copy_dir(&from, &run);
    run
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        let target = to.join(path.file_name().unwrap());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

fn step_4(run: &Path) -> PathBuf {
    run.join("checkpoints").join("step-00000004")
}

fn state(checkpoint: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(checkpoint.join("state.json")).unwrap()).unwrap()
}

/// (step, loss) pairs.
type Curve = Vec<(u64, f64)>;

/// The training and the evaluation losses of a run's metrics.
fn losses(run: &Path) -> (Curve, Curve) {
    let lines = read_lines(&run.join("metrics.jsonl"));
    let pick = |key: &str| -> Curve {
        lines.iter().filter_map(|l| Some((l["step"].as_u64()?, l.get(key)?.as_f64()?))).collect()
    };
    (pick("loss"), pick("eval_loss"))
}

fn export(checkpoint: &Path, out: &Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["export", checkpoint.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .output()
        .unwrap()
}

/// `--resume latest` from the old checkpoint (step 4 of 4) to step 8 keeps the saved metrics of
/// steps 1-4 and continues: steps 5-8 have the losses of a straight 8-step run of the same config
/// (to 1e-4, far below what a fresh start, lost optimizer moments or a reset data stream would
/// change), and the new checkpoint is tagged `gpt2` with the same shape.
#[test]
fn a_checkpoint_from_before_the_family_tag_resumes_where_it_stopped() {
    let run = fixture_copy("fixture_resume");
    let saved = state(&step_4(&run));
    assert!(saved["extra"]["model"].get("family").is_none(), "the fixture is untagged");
    let (saved_steps, _) = losses(&run);
    let straight = run.with_file_name("straight");
    let config = Path::new(env!("CARGO_MANIFEST_DIR")).join(FIXTURE_CONFIG);
    let args = ["--model", MINI, "--steps", "8", "--eval-every", "2", "--out"];
    let config_args = ["--config", config.to_str().unwrap()];
    let fresh = train(&[&config_args[..], &args[..], &[straight.to_str().unwrap()]].concat());
    assert!(fresh.status.success(), "{}", text(&fresh.stderr));
    let resumed = train(&[
        "--resume",
        "latest",
        "--steps",
        "8",
        "--eval-every",
        "2",
        "--out",
        run.to_str().unwrap(),
    ]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));

    let ((steps, evals), (straight_steps, straight_evals)) = (losses(&run), losses(&straight));
    assert_eq!(steps[..4], saved_steps[..], "the saved steps are kept as they were");
    assert_eq!(steps.iter().map(|s| s.0).collect::<Vec<_>>(), (1..=8).collect::<Vec<_>>());
    let close = |a: &[(u64, f64)], b: &[(u64, f64)]| {
        a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.0 == b.0 && (a.1 - b.1).abs() < 1e-4)
    };
    assert!(close(&steps[4..], &straight_steps[4..]), "{steps:?}\n{straight_steps:?}");
    // The fixture's evaluations (steps 2 and 4) were of the evaluation set of its day (16
    // micro-batches of the held-out stream); those after the resume are of today's, as are the
    // straight run's.
    assert_eq!(evals.len(), straight_evals.len());
    let after = |e: &[(u64, f64)]| e.iter().filter(|e| e.0 > 4).copied().collect::<Vec<_>>();
    assert!(close(&after(&evals), &after(&straight_evals)), "{evals:?}\n{straight_evals:?}");
    let new = state(&run.join("checkpoints").join("step-00000008"));
    let mut model = new["extra"]["model"].clone();
    assert_eq!(model["family"], "gpt2");
    model.as_object_mut().unwrap().remove("family");
    assert_eq!(model, saved["extra"]["model"], "the same shape, now tagged");
}

/// `zeroflow export` of the old checkpoint writes GPT-2's config.json for its shape and its
/// weights unchanged: the same tensors, bytes for bytes (the file's metadata now says `"format":
/// "pt"`, as `save_pretrained`'s does).
#[test]
fn a_checkpoint_from_before_the_family_tag_exports_as_gpt2() {
    let run = fixture_copy("fixture_export");
    let out = run.with_file_name("exported");
    let exported = export(&step_4(&run), &out);
    assert!(exported.status.success(), "{}", text(&exported.stderr));
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!((config["n_layer"].as_u64(), config["n_embd"].as_u64()), (Some(1), Some(16)));
    let weights = |dir: &Path| crate::checkpoints::tensors(&dir.join("model.safetensors")).0;
    let (exported, saved) = (weights(&out), weights(&step_4(&run)));
    assert!(!saved.is_empty());
    assert!(exported == saved, "the weights are the checkpoint's");
}

/// A checkpoint whose `extra.model` names a family this zeroflow does not have is an input error
/// (exit 2) for both export and resume, naming the family and the one it knows.
#[test]
fn a_checkpoint_of_an_unknown_family_is_refused_by_name() {
    let run = fixture_copy("fixture_unknown_family");
    let mut edited = state(&step_4(&run));
    edited["extra"]["model"]["family"] = "mamba".into();
    std::fs::write(step_4(&run).join("state.json"), edited.to_string()).unwrap();

    let exported = export(&step_4(&run), &run.with_file_name("exported"));
    let stderr = text(&exported.stderr);
    assert_eq!(exported.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("unknown model family \"mamba\" (this zeroflow knows gpt2, llama)"),
        "{stderr}"
    );
    let resumed = train(&["--resume", "latest", "--steps", "8", "--out", run.to_str().unwrap()]);
    let stderr = text(&resumed.stderr);
    assert_eq!(resumed.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("unknown model family \"mamba\""), "{stderr}");
}
