//! The run-time settings as a user gives them to `zeroflow train` (docs/DESIGN.md, "The
//! configuration surface"): the config's `zeroflow` section, the `ZEROFLOW_*` variables over it,
//! the flags over both; what the run used is in `summary.json` and every checkpoint's
//! `state.json`, and a resume that changes the attention says so.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

use super::{MINI, read_lines, scratch, text};

/// Stage 2 with the optimizer offloaded, the offload stream tuned by the config.
const TUNED: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
  "zeroflow": {
    "attention": "gemm",
    "offload": {"stream_chunk_mib": 1e-4, "gather": "after-step", "cpu_threads": 2}
  }
}"#;

const VARIABLES: [&str; 13] = [
    "ZEROFLOW_ATTENTION",
    "ZEROFLOW_CUDA_WAIT",
    "ZEROFLOW_CPU_BIND",
    "ZEROFLOW_STREAM_CHUNK_MIB",
    "ZEROFLOW_COPY_STORES",
    "ZEROFLOW_STREAM_GATHER",
    "ZEROFLOW_CPU_THREADS",
    "ZEROFLOW_SPECULATION_BUDGET_MIB",
    "ZEROFLOW_ACCUMULATE_ON",
    "ZEROFLOW_PINNED_BUDGET_MIB",
    "ZEROFLOW_PACK",
    "ZEROFLOW_OVERLAP_FORWARD",
    "ZEROFLOW_DEVICE_SHARE",
];

/// `zeroflow train` with `args`, only the variables of `env` set among the settings'.
fn train_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_zeroflow"));
    command.arg("train").args(args).env("ZEROFLOW_LOG", "warn");
    for name in VARIABLES {
        command.env_remove(name);
    }
    command.envs(env.iter().copied()).output().expect("run zeroflow")
}

fn json_of(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("JSON")
}

/// The config asks for a chunk, a gather and 2 threads; the variable's chunk (2e-4 MiB of f32:
/// 52 elements) beats the config's (26), the flag's 3 threads beat the config's 2; what nobody
/// overrides is the config's; the flag's speculation budget and the variable's accumulation
/// place are recorded as given. The summary and the checkpoint record the same.
#[test]
fn the_settings_in_effect_are_in_the_summary_and_every_checkpoint() {
    let dir = scratch("settings_recorded");
    let config = dir.join("ds.json");
    std::fs::write(&config, TUNED).unwrap();
    let out = dir.join("run");
    let args = [
        "--config",
        config.to_str().unwrap(),
        "--model",
        MINI,
        "--steps",
        "2",
        "--cpu-threads",
        "3",
        "--speculation-budget-mib",
        "0.5",
        "--save-every",
        "1",
        "--out",
        out.to_str().unwrap(),
    ];
    let env = [("ZEROFLOW_STREAM_CHUNK_MIB", "2e-4"), ("ZEROFLOW_ACCUMULATE_ON", "host")];
    let run = train_with(&args, &env);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let summary = json_of(&out.join("summary.json"))["settings"].clone();
    assert_eq!(summary["attention"], "gemm");
    assert_eq!(summary["cuda_wait"], Value::Null, "the CPU device has no host waits");
    let offload = &summary["offload"];
    assert_eq!(offload["stream_chunk_elements"], 52, "{summary}");
    assert_eq!(offload["gather"], "after-step", "{summary}");
    assert_eq!(offload["cpu_threads"], 3, "{summary}");
    assert_eq!(offload["copy_stores"], "per-path", "{summary}");
    assert_eq!(offload["speculation_budget_mib"], 0.5, "{summary}");
    assert_eq!(offload["accumulate_on"], "host", "{summary}");
    assert_eq!(offload["overlap_forward"], true, "the default: {summary}");
    assert_eq!(offload["device_share"], 0.0, "the default: {summary}");
    for step in [1, 2] {
        let state = out.join("checkpoints").join(format!("step-{step:08}")).join("state.json");
        assert_eq!(json_of(&state)["extra"]["settings"], summary, "step {step}");
    }
}

/// The losses of every step of a run's `metrics.jsonl`.
fn losses(run: &Path) -> Vec<Value> {
    let lines = read_lines(&run.join("metrics.jsonl"));
    lines.into_iter().filter_map(|line| line.get("loss").cloned()).collect()
}

/// With no pinned memory allowed (`--pinned-budget-mib 0`, as on a machine that cannot pin),
/// an offloaded run trains to the end with the same losses as with pinned memory, warns once
/// on stderr with the bytes, the cost and the setting to raise, and records the budget; the
/// run with pinned memory says nothing of it.
#[test]
fn a_zero_pinned_budget_trains_on_with_the_same_losses_and_one_warning() {
    let dir = scratch("pinned_budget");
    let config = dir.join("ds.json");
    std::fs::write(&config, TUNED).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let base = ["--config", config.to_str().unwrap(), "--model", MINI, "--steps", "3"];
        let args = [&base[..], &["--out", out.to_str().unwrap()], extra].concat();
        let output = train_with(&args, &[]);
        assert!(output.status.success(), "{extra:?}: {}", text(&output.stderr));
        (out, text(&output.stderr))
    };
    let (pinned, quiet) = run("pinned", &[]);
    let (pageable, stderr) = run("pageable", &["--pinned-budget-mib", "0"]);
    assert!(!quiet.contains("pageable"), "nothing fell back, nothing said: {quiet}");
    assert_eq!(stderr.matches("are pageable, not pinned").count(), 1, "{stderr}");
    for part in ["within the pinned budget of 0.0 MiB", "estimated at about half the PCIe speed"] {
        assert!(stderr.contains(part), "{part:?} not in: {stderr}");
    }
    assert!(stderr.contains("raise --pinned-budget-mib"), "{stderr}");
    assert_eq!(losses(&pageable), losses(&pinned));
    assert_eq!(losses(&pinned).len(), 3);
    let summary = json_of(&pageable.join("summary.json"));
    assert_eq!(summary["settings"]["offload"]["pinned_budget_mib"], 0.0, "{summary}");
    let summary = json_of(&pinned.join("summary.json"));
    assert_eq!(summary["settings"]["offload"]["pinned_budget_mib"], Value::Null, "{summary}");
}

/// A checkpoint trained with flash attention (as on a GPU) resumed where the model runs gemm:
/// the run continues, and says which value changed from what to what.
#[test]
fn a_resume_that_changes_the_attention_warns_naming_both() {
    let dir = scratch("settings_resume");
    let out = dir.join("run");
    let base = ["--model", MINI, "--micro-batch", "2", "--out", out.to_str().unwrap()];
    let first = train_with(&[&base[..], &["--steps", "2"]].concat(), &[]);
    assert!(first.status.success(), "{}", text(&first.stderr));
    // Each resume runs on past its run's planned total, on purpose (--extend-schedule).
    let resume = [&base[..], &["--steps", "3", "--extend-schedule", "--resume", "latest"]].concat();
    let same = train_with(&resume, &[]);
    let stderr = text(&same.stderr);
    assert!(same.status.success(), "{stderr}");
    assert!(!stderr.contains("attention"), "nothing changed, nothing said: {stderr}");

    let state_path = out.join("checkpoints").join("step-00000003").join("state.json");
    let mut state = json_of(&state_path);
    assert_eq!(state["extra"]["settings"]["attention"], "gemm");
    state["extra"]["settings"]["attention"] = "flash".into();
    std::fs::write(&state_path, serde_json::to_string_pretty(&state).unwrap()).unwrap();
    let resume = [&base[..], &["--steps", "4", "--extend-schedule", "--resume", "latest"]].concat();
    let changed = train_with(&resume, &[]);
    let stderr = text(&changed.stderr);
    assert!(changed.status.success(), "a warning, not an error: {stderr}");
    assert!(
        stderr.contains("trained with attention flash")
            && stderr.contains("this run uses attention gemm"),
        "{stderr}"
    );
}

/// Flags, variables, and what the error must name.
type BadCase = (&'static [&'static str], &'static [(&'static str, &'static str)], &'static str);

/// A typo in any of the variables, `ZEROFLOW_CPU_BIND` included (once silently ignored), or a
/// flag's bad value, exits 2 before anything is written; so does flash asked of the CPU model.
#[test]
fn bad_settings_exit_2_and_write_nothing() {
    let cases: [BadCase; 7] = [
        (&[], &[("ZEROFLOW_CPU_BIND", "of")], "ZEROFLOW_CPU_BIND=\"of\""),
        (&[], &[("ZEROFLOW_ATTENTION", "flashy")], "ZEROFLOW_ATTENTION=\"flashy\""),
        (&[], &[("ZEROFLOW_CUDA_WAIT", "yield")], "ZEROFLOW_CUDA_WAIT=\"yield\""),
        (&["--gather", "later"], &[], "--gather"),
        (
            &[],
            &[("ZEROFLOW_SPECULATION_BUDGET_MIB", "-1")],
            "ZEROFLOW_SPECULATION_BUDGET_MIB=\"-1\"",
        ),
        (&["--accumulate-on", "gpu"], &[], "--accumulate-on"),
        (&["--attention", "flash"], &[], "attention flash"),
    ];
    for (i, (flags, env, named)) in cases.into_iter().enumerate() {
        let dir = scratch(&format!("settings_bad_{i}"));
        let out = dir.join("run");
        let args = [&["--model", MINI, "--steps", "1", "--out", out.to_str().unwrap()], flags];
        let run = train_with(&args.concat(), env);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{flags:?} {env:?}: {stderr}");
        assert!(stderr.contains(named), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(!out.exists(), "{flags:?} {env:?}: the output directory was created");
    }
}
