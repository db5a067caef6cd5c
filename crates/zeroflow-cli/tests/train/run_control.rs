//! How a run is steered and stopped: what a resume continues to (its planned total, on its
//! planned learning-rate schedule), which data it accepts, the run directories two runs get, the
//! signals, and the progress lines without a terminal.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::{MINI, read_lines, scratch, text, train};

/// The binary's `train::signals::GRACE`: signals within it of the first are the same request.
const GRACE: Duration = Duration::from_secs(1);

/// A constant learning rate: a resumed run may change its total of steps freely.
const CONSTANT_LR: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}
}"#;

fn checkpoint(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step-{step:08}"))
}

fn zeroflow_in(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .current_dir(dir)
        .arg("train")
        .args(args)
        .env("ZEROFLOW_LOG", "warn")
        .output()
        .expect("run zeroflow")
}

/// Each step's learning rate in metrics.jsonl, by step.
fn lrs(run: &Path) -> Vec<(u64, f64)> {
    read_lines(&run.join("metrics.jsonl"))
        .iter()
        .filter_map(|l| Some((l["step"].as_u64()?, l.get("lr")?.as_f64()?)))
        .collect()
}

/// The words of `text`, as arguments.
fn words(text: &str) -> Vec<&str> {
    text.split_whitespace().collect()
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// A run of 8 steps (the default config: warm-up and cosine decay sized from the total) stopped
/// after its checkpoint at step 4 continues, with `--resume latest` alone, to step 8 on the same
/// schedule: every resumed step's learning rate is the uninterrupted run's (regression: it went on
/// to 1,000 steps, re-warming the learning rate). A new total that would re-plan the schedule is
/// refused, saying how to do it on purpose; `--extend-schedule` does it.
#[test]
fn a_resume_finishes_its_planned_run_on_its_planned_schedule() {
    let dir = scratch("resume_planned_total");
    let (straight, split) = (dir.join("straight"), dir.join("split"));
    let base = ["--model", MINI, "--micro-batch", "2", "--steps", "8", "--save-every", "4"];
    for out in [&straight, &split] {
        let run = train(&[&base[..], &["--out", out.to_str().unwrap()]].concat());
        assert!(run.status.success(), "{}", text(&run.stderr));
    }
    // As if the run had stopped after its checkpoint at step 4.
    std::fs::remove_dir_all(checkpoint(&split, 8)).unwrap();
    let out = split.to_str().unwrap();
    let resumed = train(&["--resume", "latest", "--out", out]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    let (want, got) = (lrs(&straight), lrs(&split));
    assert_eq!(got.len(), 8, "{got:?}");
    assert_eq!(got[4], want[4], "the first resumed step's learning rate");
    assert_eq!(got, want);
    assert_eq!(json(&split.join("summary.json"))["steps"], 8);

    let longer = train(&["--resume", "latest", "--out", out, "--steps", "12"]);
    let stderr = text(&longer.stderr);
    assert_eq!(longer.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("planned 8 steps") && stderr.contains("--extend-schedule"), "{stderr}");
    assert!(!checkpoint(&split, 12).exists());
    let extended =
        train(&["--resume", "latest", "--out", out, "--steps", "12", "--extend-schedule"]);
    let stderr = text(&extended.stderr);
    assert!(extended.status.success(), "{stderr}");
    assert!(stderr.contains("re-planned over 12 steps"), "{stderr}");
    assert_eq!(lrs(&split).len(), 12);
}

/// A run started with `--weight-decay` and `--warmup` (which fill the default config's "auto"
/// values) and resumed with `--resume latest` alone continues with them: its last checkpoint's
/// weights are the uninterrupted run's bit for bit (regression: the resume took the defaults,
/// weight decay 0 and a warm-up of 5 % of the steps, warning only that the config differed). A
/// `--config` given at the resume whose learning rate is a number is taken, with the warning,
/// not refused as a conflict with a `--lr` the command never gave. A checkpoint from before the
/// 1-D parameters were left out of weight decay resumes, saying the run changes from there.
#[test]
fn a_resume_keeps_the_flags_that_filled_the_config() {
    let dir = scratch("resume_keeps_flags");
    let (straight, split) = (dir.join("straight"), dir.join("split"));
    let base = [
        &["--model", MINI][..],
        &words("--micro-batch 2 --steps 6 --save-every 3 --weight-decay 0.5 --warmup 4 --lr 2e-2"),
    ]
    .concat();
    for out in [&straight, &split] {
        let run = train(&[&base[..], &["--out", out.to_str().unwrap()]].concat());
        assert!(run.status.success(), "{}", text(&run.stderr));
    }
    let weights = |run: &Path| std::fs::read(checkpoint(run, 6).join("model.safetensors")).unwrap();
    std::fs::remove_dir_all(checkpoint(&split, 6)).unwrap();
    let out = split.to_str().unwrap();
    let resumed = train(&["--resume", "latest", "--out", out]);
    let stderr = text(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    assert!(!stderr.contains("differs"), "{stderr}");
    assert_eq!(lrs(&split), lrs(&straight));
    assert!(weights(&split) == weights(&straight), "the resumed run's weights at step 6");
    let state = json(&checkpoint(&split, 6).join("state.json"));
    assert_eq!(state["extra"]["config"]["optimizer"]["params"]["weight_decay"], 0.5);
    assert_eq!(state["extra"]["decay_skips_1d"], true);

    // A config file with its own learning rate, at the resume.
    std::fs::remove_dir_all(checkpoint(&split, 6)).unwrap();
    let config = dir.join("own-lr.json");
    std::fs::write(&config, CONSTANT_LR).unwrap();
    let own = train(&["--resume", "latest", "--out", out, "--config", config.to_str().unwrap()]);
    let stderr = text(&own.stderr);
    assert!(own.status.success(), "{stderr}");
    assert!(stderr.contains("the config differs") && stderr.contains("optimizer"), "{stderr}");
    let state = json(&checkpoint(&split, 6).join("state.json"));
    assert_eq!(state["extra"]["config"]["optimizer"]["params"]["lr"], 1e-2);

    // The checkpoint as a zeroflow that decayed every parameter wrote it.
    std::fs::remove_dir_all(checkpoint(&split, 6)).unwrap();
    let state_path = checkpoint(&split, 3).join("state.json");
    let mut old = json(&state_path);
    old["extra"].as_object_mut().unwrap().remove("decay_skips_1d");
    std::fs::write(&state_path, serde_json::to_vec_pretty(&old).unwrap()).unwrap();
    let older = train(&["--resume", "latest", "--out", out]);
    let stderr = text(&older.stderr);
    assert!(older.status.success(), "{stderr}");
    assert!(stderr.contains("from step 4 on they take none"), "{stderr}");
}

/// A run resumed with `--resume latest` alone evaluates, saves, keeps, samples and exports as its
/// start asked (regression: it went back to the paced defaults and 3 checkpoints kept, wrote no
/// samples and exported nothing). An export directory that holds files by then is left alone,
/// saying so.
#[test]
fn a_resume_evaluates_saves_samples_and_exports_as_the_run_asked() {
    let dir = scratch("resume_steering");
    let (run, export) = (dir.join("run"), dir.join("exported"));
    let flags = words("--micro-batch 2 --steps 6 --eval-every 1 --save-every 1 --keep 10");
    let sample = ["--sample-every", "1", "--sample-prompt", "1,2,3"];
    let args = [&["--model", MINI][..], &flags, &sample].concat();
    let paths = ["--out", run.to_str().unwrap(), "--export", export.to_str().unwrap()];
    let first = train(&[&args[..], &paths].concat());
    assert!(first.status.success(), "{}", text(&first.stderr));
    // As if the run had stopped after its checkpoint at step 4.
    for step in [5, 6] {
        std::fs::remove_dir_all(checkpoint(&run, step)).unwrap();
    }
    std::fs::remove_dir_all(&export).unwrap();
    std::fs::remove_file(run.join("samples.jsonl")).unwrap();
    let out = run.to_str().unwrap();
    let resumed = train(&["--resume", "latest", "--out", out]);
    let stderr = text(&resumed.stderr);
    assert!(resumed.status.success(), "{stderr}");
    assert!(checkpoint(&run, 5).is_dir(), "saved every step");
    assert!(checkpoint(&run, 1).is_dir(), "kept 10 checkpoints, not the default 3");
    let evaluated: Vec<u64> = read_lines(&run.join("metrics.jsonl"))
        .iter()
        .filter(|line| line.get("eval_loss").is_some())
        .filter_map(|line| line["step"].as_u64())
        .collect();
    assert!(evaluated.ends_with(&[5, 6]), "evaluated every step: {evaluated:?}");
    let sampled: Vec<u64> =
        read_lines(&run.join("samples.jsonl")).iter().filter_map(|l| l["step"].as_u64()).collect();
    assert_eq!(sampled, [5, 6]);
    assert!(export.join("config.json").is_file(), "exported at the end");

    // On past the end: the export of step 6 is kept, not overwritten.
    let before = std::fs::read(export.join("config.json")).unwrap();
    let more = train(&["--resume", "latest", "--out", out, "--steps", "7", "--extend-schedule"]);
    let stderr = text(&more.stderr);
    assert!(more.status.success(), "{stderr}");
    assert!(stderr.contains("holds files by now"), "{stderr}");
    assert_eq!(std::fs::read(export.join("config.json")).unwrap(), before);
}

/// Files are read in rows shuffled each epoch from the seed by default, in file order with
/// `--shuffle=off`: other losses from the first step, and the run header says which. A shuffled
/// run resumed continues its order (its last weights are the uninterrupted run's); a `--shuffle`
/// that differs from the checkpoint's is refused; a checkpoint from before the option resumes in
/// file order, as its run read.
#[test]
fn files_are_read_in_a_shuffled_order_that_a_resume_continues() {
    let dir = scratch("shuffle");
    let corpus = dir.join("corpus.txt");
    let lines: String = (0..400).map(|i| format!("line {i}: {}\n", "xyz".repeat(i % 11))).collect();
    std::fs::write(&corpus, lines).unwrap();
    let model = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":256,"context":16}"#;
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let data = ["--model", model, "--data", corpus.to_str().unwrap()];
        let args =
            [&data[..], &words("--micro-batch 2 --steps 6 --save-every 3 --eval-every 0")].concat();
        let output = train(&[&args[..], &["--out", out.to_str().unwrap()], extra].concat());
        assert!(output.status.success(), "{}", text(&output.stderr));
        (out, text(&output.stderr))
    };
    let zeroflow_log_info = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let data = ["--model", model, "--data", corpus.to_str().unwrap()];
        let args = [&data[..], &words("--steps 1 --micro-batch 2")].concat();
        let output = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .arg("train")
            .args([&args[..], &["--out", out.to_str().unwrap()], extra].concat())
            .env("ZEROFLOW_LOG", "info")
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", text(&output.stderr));
        text(&output.stderr)
    };
    let header = zeroflow_log_info("header-on", &[]);
    assert!(header.contains("rows shuffled each epoch"), "{header}");
    // 400 lines of 10 to 41 bytes less the tenth held out, in steps of 2 rows of 16.
    let bytes = std::fs::metadata(&corpus).unwrap().len();
    let epoch = (bytes - bytes / 10 - 1) / 32;
    let said = format!("one epoch of the training data is {epoch} steps ({epoch} micro-batches)");
    assert!(header.contains(&said), "{header}");
    assert!(!zeroflow_log_info("header-off", &["--shuffle=off"]).contains("shuffled"));

    let first_loss = |out: &Path| read_lines(&out.join("metrics.jsonl"))[0]["loss"].as_f64();
    let (shuffled, _) = run("shuffled", &[]);
    let (in_order, _) = run("in-order", &["--shuffle=off"]);
    assert!(first_loss(&shuffled).is_some() && first_loss(&shuffled) != first_loss(&in_order));
    let state = json(&checkpoint(&shuffled, 3).join("state.json"));
    assert_eq!(state["extra"]["shuffle"], true);
    // Each step's line says the epochs read by its end.
    let epochs: Vec<f64> = read_lines(&shuffled.join("metrics.jsonl"))
        .iter()
        .filter_map(|line| line.get("epoch").and_then(serde_json::Value::as_f64))
        .collect();
    let per_step = 1.0 / epoch as f64;
    assert_eq!(epochs.len(), 6, "{epochs:?}");
    assert!((epochs[5] - 6.0 * per_step).abs() < 1e-12, "{epochs:?} against {per_step}");

    let weights = |out: &Path| std::fs::read(checkpoint(out, 6).join("model.safetensors")).unwrap();
    for (name, flags, straight) in
        [("split-on", &[][..], &shuffled), ("split-off", &["--shuffle=off"][..], &in_order)]
    {
        let (split, _) = run(name, flags);
        std::fs::remove_dir_all(checkpoint(&split, 6)).unwrap();
        let out = split.to_str().unwrap();
        if name == "split-on" {
            let refused = train(&["--resume", "latest", "--out", out, "--shuffle=off"]);
            let stderr = text(&refused.stderr);
            assert_eq!(refused.status.code(), Some(2), "{stderr}");
            assert!(stderr.contains("--shuffle=off differs from the checkpoint's on"), "{stderr}");
        } else {
            // As a zeroflow from before the option wrote it.
            let state_path = checkpoint(&split, 3).join("state.json");
            let mut old = json(&state_path);
            old["extra"].as_object_mut().unwrap().remove("shuffle");
            std::fs::write(&state_path, serde_json::to_vec_pretty(&old).unwrap()).unwrap();
        }
        let resumed = train(&["--resume", "latest", "--out", out]);
        assert!(resumed.status.success(), "{}", text(&resumed.stderr));
        assert!(weights(&split) == weights(straight), "{name}: the resumed run's weights");
    }
}

/// `--epochs N` trains N passes over the data: the steps are N times an epoch's (the count the
/// run header gives), its learning-rate schedule sized from them, and a resume continues to that
/// total. It needs files (the synthetic corpus has none) and goes with neither `--steps` nor
/// `--resume`.
#[test]
fn epochs_set_the_steps_from_the_data() {
    let dir = scratch("epochs");
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, "a few words, then a few more.\n".repeat(100)).unwrap();
    let model = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":256,"context":16}"#;
    let run = dir.join("run");
    let data =
        ["--model", model, "--data", corpus.to_str().unwrap(), "--out", run.to_str().unwrap()];
    let trained =
        train(&[&data[..], &words("--micro-batch 4 --epochs 1.5 --save-every 5")].concat());
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    // 3,000 bytes less the tenth held out, in steps of 4 rows of 16.
    let epoch = (3000 - 300 - 1) / 64;
    let steps = (1.5 * epoch as f64).ceil() as u64;
    let lines = read_lines(&run.join("metrics.jsonl"));
    let last = lines.iter().rev().find_map(|l| l.get("epoch").map(|_| l["step"].as_u64()));
    assert_eq!(last, Some(Some(steps)), "{lines:?}");
    let state = json(&checkpoint(&run, steps).join("state.json"));
    assert_eq!(state["extra"]["run"]["steps"], steps);
    let schedule = &state["extra"]["config"]["scheduler"]["params"];
    assert_eq!(schedule["total_num_steps"], steps, "{schedule}");
    // Resumed from an earlier checkpoint, it ends at the same total.
    std::fs::remove_dir_all(checkpoint(&run, steps)).unwrap();
    let resumed = train(&["--resume", "latest", "--out", run.to_str().unwrap()]);
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert!(checkpoint(&run, steps).is_dir());

    let synthetic =
        train(&["--model", MINI, "--epochs", "1", "--out", dir.join("s").to_str().unwrap()]);
    assert_eq!(synthetic.status.code(), Some(2), "{}", text(&synthetic.stderr));
    assert!(text(&synthetic.stderr).contains("no epochs"), "{}", text(&synthetic.stderr));
    let both = train(&[&data[..], &["--epochs", "1", "--steps", "3"]].concat());
    assert_eq!(both.status.code(), Some(2), "{}", text(&both.stderr));
}

/// A checkpoint of a run trained on a GPU (its config in bf16), resumed without `--device`, is
/// refused, saying to add `--device cuda` (regression: it went on on the CPU in fp32, warning
/// only that the config differed in bf16); `--device cpu` given on purpose continues there.
#[test]
fn a_gpu_runs_checkpoint_resumed_without_device_asks_for_it() {
    let dir = scratch("resume_gpu_run_device");
    let run = dir.join("run");
    let args = ["--model", MINI, "--micro-batch", "2", "--steps", "4", "--save-every", "2"];
    let first = train(&[&args[..], &["--out", run.to_str().unwrap()]].concat());
    assert!(first.status.success(), "{}", text(&first.stderr));
    std::fs::remove_dir_all(checkpoint(&run, 4)).unwrap();
    // The checkpoint as a GPU run of the default config writes it (bf16 enabled).
    let state_path = checkpoint(&run, 2).join("state.json");
    let mut state = json(&state_path);
    state["extra"]["config"]["bf16"] = serde_json::json!({"enabled": true});
    std::fs::write(&state_path, serde_json::to_vec_pretty(&state).unwrap()).unwrap();
    let out = run.to_str().unwrap();
    let refused = train(&["--resume", "latest", "--out", out]);
    let stderr = text(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("trained on a GPU (in bf16); add --device cuda"), "{stderr}");
    assert!(!checkpoint(&run, 4).exists());
    let on_cpu = train(&["--resume", "latest", "--out", out, "--device", "cpu"]);
    let stderr = text(&on_cpu.stderr);
    assert!(on_cpu.status.success(), "{stderr}");
    assert!(stderr.contains("the config differs") && stderr.contains("bf16"), "{stderr}");
    assert!(checkpoint(&run, 4).is_dir());
}

/// A run started with a relative `--data` resumes from another directory, and under another
/// spelling of the same file; a checkpoint from before paths were resolved (a relative `data`, no
/// fingerprints) still resumes from the directory its run started in; a changed file is refused,
/// saying what changed.
#[test]
fn a_resume_finds_its_data_from_anywhere_and_refuses_a_changed_file() {
    let dir = scratch("resume_data_paths");
    let (home, elsewhere) = (dir.join("home"), dir.join("elsewhere"));
    std::fs::create_dir_all(home.join("sub")).unwrap();
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(home.join("corpus.txt"), "hello zeroflow ".repeat(300)).unwrap();
    std::fs::write(home.join("ds.json"), CONSTANT_LR).unwrap();
    let model = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":256,"context":16}"#;
    let run = home.join("run");
    let args = ["--model", model, "--config", "ds.json", "--data", "corpus.txt", "--steps", "2"];
    // Every path relative to `home`.
    let first = zeroflow_in(&home, &[&args[..], &["--out", "run"]].concat());
    assert!(first.status.success(), "{}", text(&first.stderr));
    let state = json(&checkpoint(&run, 2).join("state.json"));
    let recorded = state["extra"]["data"].as_str().unwrap().to_owned();
    assert!(Path::new(&recorded).is_absolute() && recorded.ends_with("corpus.txt"), "{recorded}");
    assert_eq!(state["extra"]["data_files"].as_array().unwrap().len(), 1);
    let out = run.to_str().unwrap();
    let resume = |cwd: &Path, steps: &str, extra: &[&str]| {
        zeroflow_in(
            cwd,
            &[&["--resume", "latest", "--out", out, "--steps", steps][..], extra].concat(),
        )
    };
    let from_elsewhere = resume(&elsewhere, "3", &[]);
    assert!(from_elsewhere.status.success(), "{}", text(&from_elsewhere.stderr));
    let detour = home.join("sub").join("..").join("corpus.txt");
    let spelled = resume(&elsewhere, "4", &["--data", detour.to_str().unwrap()]);
    assert!(spelled.status.success(), "{}", text(&spelled.stderr));

    // The checkpoint as an older zeroflow wrote it.
    let state_path = checkpoint(&run, 4).join("state.json");
    let mut old = json(&state_path);
    old["extra"]["data"] = "corpus.txt".into();
    old["extra"].as_object_mut().unwrap().remove("data_files");
    std::fs::write(&state_path, serde_json::to_vec_pretty(&old).unwrap()).unwrap();
    let lost = resume(&elsewhere, "5", &[]);
    let stderr = text(&lost.stderr);
    assert_eq!(lost.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("relative to the directory its run was started in"), "{stderr}");
    let from_home = resume(&home, "5", &[]);
    assert!(from_home.status.success(), "{}", text(&from_home.stderr));

    let mut bytes = std::fs::read(home.join("corpus.txt")).unwrap();
    let before = bytes.len();
    bytes.extend_from_slice(b"more text");
    std::fs::write(home.join("corpus.txt"), &bytes).unwrap();
    let changed = resume(&elsewhere, "6", &[]);
    let stderr = text(&changed.stderr);
    assert_eq!(changed.status.code(), Some(2), "{stderr}");
    let said = format!("was {before} bytes and is {} now", bytes.len());
    assert!(stderr.contains("the data changed") && stderr.contains(&said), "{stderr}");
    assert!(!checkpoint(&run, 6).exists());
}

/// Two runs started at once with the default `--out` each get their own directory under `runs/`
/// (regressions: both wrote into `runs/<UTC second>`, interleaving their metrics, and the second
/// failed at its first checkpoint; later, a start could refuse `runs/<UTC second>` as
/// not empty, since another had claimed it between the set-up's check and its own claim).
#[test]
fn runs_started_at_once_get_a_run_directory_each() {
    let dir = scratch("default_out_at_once");
    let args =
        ["train", "--model", MINI, "--micro-batch", "2", "--steps", "6", "--save-every", "2"];
    let start = || {
        Command::new(env!("CARGO_BIN_EXE_zeroflow"))
            .current_dir(&dir)
            .args(args)
            .env("ZEROFLOW_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start zeroflow")
    };
    let children: Vec<Child> = (0..3).map(|_| start()).collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(output.status.success(), "{}", text(&output.stderr));
    }
    let runs: Vec<PathBuf> =
        std::fs::read_dir(dir.join("runs")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(runs.len(), 3, "{runs:?}");
    for run in &runs {
        let steps: Vec<u64> = read_lines(&run.join("metrics.jsonl"))
            .iter()
            .filter(|l| l.get("loss").is_some())
            .map(|l| l["step"].as_u64().unwrap())
            .collect();
        assert_eq!(steps, (1..=6).collect::<Vec<_>>(), "{}", run.display());
        assert!(checkpoint(run, 6).is_dir(), "{}", run.display());
    }
}

/// Starts a long CPU run of `model` in `run` with `flags`, and waits for its first step.
fn start_long_run(dir: &Path, run: &Path, model: &str, flags: &[&str]) -> Child {
    let config = dir.join("ds.json");
    std::fs::write(&config, CONSTANT_LR).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["train", "--model", model, "--steps", "100000", "--config"])
        .arg(&config)
        .args(flags)
        .arg("--out")
        .arg(run)
        .env("ZEROFLOW_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start zeroflow");
    let metrics = run.join("metrics.jsonl");
    while std::fs::read_to_string(&metrics).map_or(true, |m| m.is_empty()) {
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn signal(child: &Child, name: &str) {
    let sent = Command::new("kill").args([&format!("-{name}"), &child.id().to_string()]).status();
    assert!(sent.unwrap().success(), "kill -{name}");
}

/// SIGINT and SIGTERM say at once what will happen, stop after the current step (abandoning an
/// evaluation: the run evaluates every step), save a checkpoint there, write the summary, and exit
/// with 130 and 143 (regression: they were silent and exited 0, so `train && export` went on). The
/// last line names the step the run stopped at and the step of the eval loss it prints; the run
/// resumes from its checkpoint.
#[test]
fn sigint_and_sigterm_save_a_checkpoint_and_exit_130_and_143() {
    for (name, status) in [("INT", 130), ("TERM", 143)] {
        let dir = scratch(&format!("signal_{name}"));
        let run = dir.join("run");
        // An evaluation after every step: the signal often arrives during one.
        let flags = ["--eval-every", "1", "--save-every", "0"];
        let child = start_long_run(&dir, &run, MINI, &flags);
        signal(&child, name);
        let output = child.wait_with_output().unwrap();
        let (stdout, stderr) = (text(&output.stdout), text(&output.stderr));
        assert_eq!(output.status.code(), Some(status), "SIG{name}: {stderr}");
        assert!(stderr.contains(&format!("SIG{name} during step")), "{stderr}");
        assert!(stderr.contains(&format!("exiting with status {status}")), "{stderr}");
        let again =
            format!("continue with: zeroflow train --resume latest --out {}", run.display());
        assert!(stderr.contains(&again), "{stderr}");
        let lines = read_lines(&run.join("metrics.jsonl"));
        let last = lines.iter().filter(|l| l.get("loss").is_some()).count() as u64;
        let last_eval = lines.iter().rev().find(|l| l.get("eval_loss").is_some());
        let last_eval = last_eval.and_then(|l| l["step"].as_u64());
        assert!(checkpoint(&run, last).join("state.json").is_file(), "a checkpoint at {last}");
        let final_line = stdout.lines().last().unwrap_or_default();
        assert!(
            final_line.starts_with(&format!("interrupted at step {last} of 100000")),
            "{final_line}"
        );
        assert!(!final_line.contains("NaN"), "{final_line}");
        match last_eval {
            Some(step) => assert!(final_line.contains(&format!("at step {step} ")), "{final_line}"),
            None => assert!(final_line.contains("no evaluation yet"), "{final_line}"),
        }
        let summary = json(&run.join("summary.json"));
        assert_eq!(
            (summary["steps"].as_u64(), summary["interrupted"].as_bool()),
            (Some(last), Some(true))
        );
        let more = (last + 2).to_string();
        let resumed =
            train(&["--resume", "latest", "--out", run.to_str().unwrap(), "--steps", &more]);
        assert!(resumed.status.success(), "{}", text(&resumed.stderr));
        assert!(checkpoint(&run, last + 2).is_dir());
    }
}

/// A second signal a second or more after the first exits at once, without saving or a summary.
/// The test sends SIGINT, waits for its notice (so the first signal has been caught), stops the
/// process (SIGSTOP), waits out the grace, queues SIGTERM and lets it go on; where the run had
/// already saved and exited before the SIGSTOP, that attempt shows nothing and is repeated. What a
/// write cut short leaves (`.step-N.partial-PID`, also after SIGKILL) is removed when the run
/// resumes.
#[test]
fn a_second_signal_exits_at_once_and_a_resume_removes_unfinished_checkpoints() {
    let dir = scratch("second_signal");
    let run = dir.join("run");
    // Steps long enough that the run is still in one when it is stopped.
    let model = r#"{"n_layer":2,"n_head":2,"d_model":128,"vocab_size":64,"context":64}"#;
    let mut attempts = 0;
    let (output, stderr) = loop {
        attempts += 1;
        let _ = std::fs::remove_dir_all(&run);
        let mut child =
            start_long_run(&dir, &run, model, &["--eval-every", "0", "--save-every", "1"]);
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines().map(Result::unwrap);
        // A checkpoint to resume from below.
        while !checkpoint(&run, 1).is_dir() {
            std::thread::sleep(Duration::from_millis(20));
        }
        signal(&child, "INT");
        let mut seen: Vec<String> = stderr.by_ref().take_while(|l| !l.contains("SIGINT")).collect();
        signal(&child, "STOP");
        if child.try_wait().unwrap().is_some() && attempts < 5 {
            // It had finished (checkpoint, summary, exit) before the SIGSTOP: try again.
            continue;
        }
        std::thread::sleep(GRACE + Duration::from_millis(500));
        signal(&child, "TERM");
        signal(&child, "CONT");
        seen.extend(stderr);
        break (child.wait_with_output().unwrap(), seen);
    };
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(143), "{stderr:?}");
    assert!(!stdout.contains("interrupted at step"), "it stopped at once: {stdout}");
    assert!(!run.join("summary.json").exists(), "it wrote no summary");

    let planted = run.join("checkpoints").join(".step-00999999.partial-4242");
    std::fs::create_dir_all(planted.join("optim")).unwrap();
    let newest = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().to_str()?.strip_prefix("step-")?.parse::<u64>().ok())
        .max()
        .expect("a checkpoint of an earlier step");
    let more = (newest + 1).to_string();
    let resumed = train(&["--resume", "latest", "--out", run.to_str().unwrap(), "--steps", &more]);
    let said = text(&resumed.stderr);
    assert!(resumed.status.success(), "{said}");
    assert!(said.contains("removed") && said.contains(".step-00999999.partial-4242"), "{said}");
    let left: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains(".partial-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A signal within a second of the first is the same request (regression: a `timeout` that
/// expired or was signalled sends its signal to the run and then to the run's process group, and
/// the second exited at once, so the run ended without its checkpoint). The test sends SIGINT,
/// waits for its notice, stops the process, queues SIGTERM and lets it go on: the run saves,
/// writes its summary and exits with the first signal's status. An attempt whose two signals
/// came more than half the grace apart (a slow machine) proves nothing and is repeated, as one
/// where the run had finished before the SIGSTOP.
#[test]
fn a_signal_within_a_second_of_the_first_is_the_same_request() {
    let dir = scratch("signal_burst");
    let run = dir.join("run");
    let model = r#"{"n_layer":2,"n_head":2,"d_model":128,"vocab_size":64,"context":64}"#;
    let attempt = || {
        let _ = std::fs::remove_dir_all(&run);
        let mut child = start_long_run(&dir, &run, model, &["--eval-every", "0"]);
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines().map(Result::unwrap);
        let sent = Instant::now();
        signal(&child, "INT");
        let mut seen: Vec<String> = stderr.by_ref().take_while(|l| !l.contains("SIGINT")).collect();
        signal(&child, "STOP");
        if child.try_wait().unwrap().is_some() {
            return None; // It had finished (checkpoint, summary, exit) before the SIGSTOP.
        }
        signal(&child, "TERM");
        signal(&child, "CONT");
        let in_time = sent.elapsed() < GRACE / 2;
        seen.extend(stderr);
        let output = child.wait_with_output().unwrap();
        in_time.then_some((output, seen))
    };
    let (output, stderr) =
        (0..5).find_map(|_| attempt()).expect("no attempt sent its two signals in time");
    assert_eq!(output.status.code(), Some(130), "{stderr:?}");
    let stdout = text(&output.stdout);
    let last =
        read_lines(&run.join("metrics.jsonl")).iter().filter(|l| l.get("loss").is_some()).count();
    assert!(stdout.contains(&format!("interrupted at step {last} of")), "{stdout}");
    assert!(checkpoint(&run, last as u64).join("state.json").is_file(), "a checkpoint at {last}");
    let summary = json(&run.join("summary.json"));
    assert_eq!(summary["interrupted"].as_bool(), Some(true));
}

/// Without a terminal, progress lines come by time as well as every `--log-every` steps
/// (`ZEROFLOW_PROGRESS_SECS` sets the interval): with a tiny interval every step has its line
/// although `--log-every` asks for one in 1000; with the default 30 s a short run prints only the
/// last step's. The model build and the checkpoints say so too. (What the watcher thread says of
/// a long activity: `train::output`'s unit tests.)
#[test]
fn without_a_terminal_progress_lines_come_by_time_too() {
    let dir = scratch("progress_by_time");
    let run_with = |interval: Option<&str>, name: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_zeroflow"));
        command
            .args(["train", "--model", MINI, "--micro-batch", "2", "--steps", "6"])
            .args(["--log-every", "1000", "--eval-every", "2", "--save-every", "3"])
            .arg("--out")
            .arg(dir.join(name))
            .env("ZEROFLOW_LOG", "info");
        if let Some(interval) = interval {
            command.env("ZEROFLOW_PROGRESS_SECS", interval);
        }
        let output = command.output().unwrap();
        assert!(output.status.success(), "{}", text(&output.stderr));
        text(&output.stderr)
    };
    let steps_shown = |stderr: &str| -> Vec<u64> {
        BufReader::new(stderr.as_bytes())
            .lines()
            .map(Result::unwrap)
            .filter_map(|line| {
                let (_, rest) = line.split_once(" step ")?;
                rest.split_once("/6 loss")?.0.parse().ok()
            })
            .collect()
    };
    let quiet = run_with(None, "default");
    assert_eq!(steps_shown(&quiet), [6], "{quiet}");
    let timed = run_with(Some("0.000001"), "timed");
    assert_eq!(steps_shown(&timed), [1, 2, 3, 4, 5, 6], "{timed}");
    assert!(timed.contains("model ready on") && timed.contains("step 3: saved"), "{timed}");
    let bad = Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(["train", "--model", MINI, "--steps", "1", "--out"])
        .arg(dir.join("bad"))
        .env("ZEROFLOW_PROGRESS_SECS", "soon")
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("ZEROFLOW_PROGRESS_SECS=soon"), "{}", text(&bad.stderr));
}

/// After a resume, `summary.json`'s `wall_s` is the whole run's wall-clock time (up to the
/// checkpoint, plus this process's `process_wall_s`), so it is at least `train_s`, which is
/// the whole run's too (regression: `wall_s` was this process's alone, less than `train_s`).
#[test]
fn after_a_resume_wall_time_covers_the_whole_run() {
    let dir = scratch("resume_wall_time");
    std::fs::write(dir.join("ds.json"), CONSTANT_LR).unwrap();
    let run = dir.join("run");
    let config = dir.join("ds.json");
    let base =
        ["--model", MINI, "--config", config.to_str().unwrap(), "--out", run.to_str().unwrap()];
    let first = train(&[&base[..], &["--steps", "30"]].concat());
    assert!(first.status.success(), "{}", text(&first.stderr));
    let saved = json(&checkpoint(&run, 30).join("state.json"))["extra"]["wall_s"].as_f64().unwrap();
    let second = train(&["--resume", "latest", "--out", run.to_str().unwrap(), "--steps", "31"]);
    assert!(second.status.success(), "{}", text(&second.stderr));
    let summary = json(&run.join("summary.json"));
    let seconds = |key: &str| summary[key].as_f64().unwrap_or_else(|| panic!("{key}: {summary}"));
    let (wall, process, train_s) =
        (seconds("wall_s"), seconds("process_wall_s"), seconds("train_s"));
    assert!(wall >= train_s, "wall_s {wall} < train_s {train_s}");
    // wall_s is the saved run's time plus this process's, from one reading of the clock.
    assert!((wall - (saved + process)).abs() <= 1e-6 * wall.max(1.0), "{summary}");
    assert!(process < wall);
    // The hypervisor's share of the machine's CPU time over this process (where Linux says).
    if cfg!(target_os = "linux") {
        let steal = seconds("host_steal_fraction");
        assert!(steal >= 0.0 && steal.is_finite(), "{summary}");
    }
}
