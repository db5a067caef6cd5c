//! The training loop with several ranks, on the CPU: one thread per rank, each with its own
//! device, the ranks' communicators in one process, and the real rendezvous and side channel over
//! localhost. What `train --device cuda` does with one process per GPU, minus NCCL. Also, in the
//! same process, what needs a hook no command has: a disk with too little room for the
//! checkpoints (`checkpoint::pretend_free`), a stop requested at a chosen step.

use std::path::{Path, PathBuf};
use std::thread;
use std::time::Duration;

use clap::Parser;
use zeroflow_device::CpuDevice;
use zeroflow_device::cpu::CpuComm;
use zeroflow_engine::checkpoint;
use zeroflow_gpt::{CpuGpt, GptConfig, GptError, GradsReady};
use zeroflow_train::dist::env::Master;
use zeroflow_train::dist::testing::free_port;
use zeroflow_train::dist::{self, DistEnv};
use zeroflow_train::observer::{Activity, StopHandle, TrainObserver};
use zeroflow_train::open::OpenFn;
use zeroflow_train::setup::{DEFAULT_PACE, Pace};
use zeroflow_train::{Buffer, Model, ModelSpec, Opened, Setup};

use crate::cmd::train::Args;
use crate::settings::Requested;

/// One layer of width 16 over the synthetic corpus' 64 symbols, context 16.
const MINI: &str = r#"{"n_layer":1,"n_head":2,"d_model":16,"vocab_size":64,"context":16}"#;

/// ZeRO-2 with the optimizer offloaded: the partitioned path of the GPU runs.
const ZERO2_OFFLOAD: &str = r#"{
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": 1.0,
  "optimizer": { "type": "AdamW", "params": { "lr": 1e-2, "weight_decay": 0.01 } },
  "zero_optimization": { "stage": 2, "offload_optimizer": { "device": "cpu" } }
}"#;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

/// [`super::run_on`] of the GPT-2 shape `setup` holds, opened by `open`.
fn run_gpt2<M: Model>(setup: Setup, open: impl OpenFn<GptConfig, M>) -> anyhow::Result<()> {
    let shape = match &setup.model {
        ModelSpec::Gpt2(shape) => *shape,
        other => anyhow::bail!("these tests train GPT-2, not {}", other.family()),
    };
    super::run_on(setup, &shape, open)
}

/// Ranks are threads here: a lost rank fails the others' next barrier instead of ending the
/// process.
fn log_lost() -> dist::OnLost {
    std::sync::Arc::new(|lost: &dist::Lost| eprintln!("lost {lost}"))
}

/// A scratch directory and `ZERO2_OFFLOAD` written in it as `zero2.json`.
fn scratch_with_zero2(name: &str) -> (PathBuf, PathBuf) {
    let dir = scratch(name);
    let config = dir.join("zero2.json");
    std::fs::write(&config, ZERO2_OFFLOAD).unwrap();
    (dir, config)
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeroflow-ranks-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Trains `world` ranks in this process with the `train` flags `flags`; each rank's result.
fn train_ranks(world: usize, flags: &[String]) -> Vec<anyhow::Result<()>> {
    train_ranks_with(world, flags, None)
}

/// [`train_ranks`] where the ranks find `free` bytes free on every disk
/// ([`checkpoint::pretend_free`]; `None`: what the disks have).
fn train_ranks_with(world: usize, flags: &[String], free: Option<u64>) -> Vec<anyhow::Result<()>> {
    let port = free_port();
    let devices: Vec<CpuDevice> = (0..world).map(|_| CpuDevice::new().unwrap()).collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(60));
    let handles: Vec<_> = devices
        .into_iter()
        .zip(comms)
        .enumerate()
        .map(|(rank, (device, comm))| {
            let argv: Vec<String> =
                ["train".to_owned()].into_iter().chain(flags.to_vec()).collect();
            thread::spawn(move || {
                checkpoint::pretend_free(free);
                let args = Cli::try_parse_from(argv)?.args;
                let dist = DistEnv {
                    rank,
                    local_rank: rank,
                    world_size: world,
                    local_world_size: world,
                    master: Some(Master { addr: "127.0.0.1".into(), port }),
                    rendezvous_timeout: Duration::from_secs(20),
                    step_timeout: None,
                };
                let setup = Setup::for_rank(args.options(), dist, Requested::default())?;
                run_gpt2(setup, move |model, micro_batch, seq, layout, dist| {
                    let gpt = CpuGpt::new(&device, model, layout, micro_batch, seq)?;
                    let (_, group) = dist::join_with(dist, || Ok(Vec::new()), log_lost())?;
                    Ok(Opened { device, comm, model: gpt, group })
                })
            })
        })
        .collect();
    let results: Vec<anyhow::Result<()>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    for (rank, result) in results.iter().enumerate() {
        if let Err(e) = result {
            eprintln!("rank {rank}: {e:#}");
        }
    }
    results
}

fn flags(config: &Path, out: &Path, extra: &[&str]) -> Vec<String> {
    let common = ["--model", MINI, "--eval-every", "0", "--log-every", "100"];
    let paths = ["--config", config.to_str().unwrap(), "--out", out.to_str().unwrap()];
    common.iter().chain(&paths).chain(extra).map(|s| s.to_string()).collect()
}

/// The training losses of metrics.jsonl, by step.
fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter_map(|value| value.get("loss").and_then(serde_json::Value::as_f64))
        .collect()
}

fn summary(out: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap()
}

fn assert_close(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-4 * w.abs(), "{got:?} vs {want:?}");
    }
}

#[test]
fn two_ranks_train_as_one_rank_with_their_global_batch() {
    let (dir, config) = scratch_with_zero2("global-batch");
    let (one, two) = (dir.join("one"), dir.join("two"));
    let steps = ["--steps", "6", "--save-every", "0"];
    // Each rank reads its own half of every step's 8 sequences.
    for result in
        train_ranks(1, &flags(&config, &one, &[&steps[..], &["--micro-batch", "8"]].concat()))
    {
        result.unwrap();
    }
    for result in
        train_ranks(2, &flags(&config, &two, &[&steps[..], &["--micro-batch", "4"]].concat()))
    {
        result.unwrap();
    }
    let (one_losses, two_losses) = (losses(&one), losses(&two));
    assert_eq!(one_losses.len(), 6);
    assert_close(&two_losses, &one_losses);
    let (one_summary, two_summary) = (summary(&one), summary(&two));
    assert_eq!(two_summary["world_size"], 2);
    assert_eq!(two_summary["config"]["train_batch_size"], 8);
    assert_eq!(two_summary["tokens"], one_summary["tokens"]);
    let eval = |s: &serde_json::Value| s["final_eval_loss"].as_f64().unwrap();
    assert_close(&[eval(&two_summary)], &[eval(&one_summary)]);
    // The last checkpoint holds one optimizer part per rank, which together resume one rank.
    let saved = checkpoint::load::<f32>(&two.join("checkpoints/step-00000006")).unwrap();
    assert_eq!((saved.meta.world_size, saved.parts.len()), (2, 2));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ZERO2_OFFLOAD` with ZeRO stage `stage`, the optimizer offloaded or on the device.
fn zero_config(stage: u8, offload: bool) -> String {
    let offload = if offload { r#", "offload_optimizer": { "device": "cpu" }"# } else { "" };
    let zero = format!(r#""zero_optimization": {{ "stage": {stage}{offload} }}"#);
    let config = ZERO2_OFFLOAD.replace(
        r#""zero_optimization": { "stage": 2, "offload_optimizer": { "device": "cpu" } }"#,
        &zero,
    );
    assert!(config.contains(&zero));
    config
}

/// The relative L2 distance between two checkpoints' weights: over all of them, and the largest
/// tensor by tensor.
fn weights_distance(a: &Path, b: &Path) -> (f64, f64) {
    let (a, b) = (checkpoint::load::<f32>(a).unwrap(), checkpoint::load::<f32>(b).unwrap());
    assert_eq!(a.tensors.len(), b.tensors.len());
    let (mut diff_total, mut size_total, mut worst) = (0.0f64, 0.0f64, 0.0f64);
    for (name, (shape, values)) in &a.tensors {
        let (other_shape, other) = &b.tensors[name];
        assert_eq!(shape, other_shape, "{name}");
        let diff: f64 = values.iter().zip(other).map(|(x, y)| f64::from(x - y).powi(2)).sum();
        let size: f64 = other.iter().map(|&y| f64::from(y).powi(2)).sum();
        (diff_total, size_total) = (diff_total + diff, size_total + size);
        worst = worst.max((diff / size.max(f64::MIN_POSITIVE)).sqrt());
    }
    ((diff_total / size_total).sqrt(), worst)
}

#[test]
fn every_stage_with_and_without_offload_trains_two_ranks_as_one() {
    // What the two-GPU acceptance runs compare in bf16 (scripts/gpu-multi-matrix.sh), here in f32:
    // the losses and the final weights of one rank with the global batch and of two ranks.
    let dir = scratch("matrix");
    let steps = ["--steps", "4", "--save-every", "0"];
    for (stage, offload) in [(1, false), (1, true), (2, false), (2, true)] {
        let name = format!("zero{stage}{}", if offload { "-offload" } else { "" });
        let config = dir.join(format!("{name}.json"));
        std::fs::write(&config, zero_config(stage, offload)).unwrap();
        let (one, two) = (dir.join(format!("{name}-one")), dir.join(format!("{name}-two")));
        let runs = [(1, &one, "8"), (2, &two, "4")];
        for (world, out, micro_batch) in runs {
            let extra = [&steps[..], &["--micro-batch", micro_batch]].concat();
            for result in train_ranks(world, &flags(&config, out, &extra)) {
                result.unwrap();
            }
        }
        assert_eq!(losses(&one).len(), 4, "{name}");
        assert_close(&losses(&two), &losses(&one));
        let last = "checkpoints/step-00000004";
        let (all, worst) = weights_distance(&one.join(last), &two.join(last));
        // The attention's key bias has no gradient in exact arithmetic (the softmax ignores it),
        // so AdamW turns its rounding noise into updates: its tensor is the worst, at ~1e-4, and
        // makes most of the whole model's ~2e-6. A rank's partition left out of an update or of
        // the all-gather would show at 1e-2 and more.
        assert!(
            all <= 1e-5 && worst <= 1e-3,
            "{name}: the final weights differ by {all:e} \
            (relative L2), {worst:e} in the worst tensor"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_ranks_resume_their_checkpoint_exactly() {
    let (dir, config) = scratch_with_zero2("resume");
    let (whole, split) = (dir.join("whole"), dir.join("split"));
    let batch = ["--micro-batch", "4", "--save-every", "3"];
    for result in train_ranks(2, &flags(&config, &whole, &[&batch[..], &["--steps", "6"]].concat()))
    {
        result.unwrap();
    }
    for result in train_ranks(2, &flags(&config, &split, &[&batch[..], &["--steps", "3"]].concat()))
    {
        result.unwrap();
    }
    let resume = ["--steps", "6", "--resume", "latest"];
    for result in train_ranks(2, &flags(&config, &split, &[&batch[..], &resume].concat())) {
        result.unwrap();
    }
    assert_eq!(losses(&split), losses(&whole));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Checkpoints refused for want of disk space (rank 0 finds too little, and tells the others)
/// do not end the run: every rank goes on, the summary lists them, and `--export` writes the
/// final weights, byte for byte what `zeroflow export` writes from a run on a disk with room.
/// Without `--export` the last save, refused too, ends every rank with the error.
#[test]
fn saves_refused_for_disk_space_go_on_and_the_export_keeps_the_final_weights() {
    let (dir, config) = scratch_with_zero2("no-space");
    // MINI has 4,592 parameters: an f32 checkpoint takes 16 bytes of each (73 kB), its weights
    // alone 4 (18 kB).
    let free = Some(40_000);
    let (roomy, full, lost) = (dir.join("roomy"), dir.join("full"), dir.join("lost"));
    let batch = ["--micro-batch", "4", "--save-every", "2", "--steps", "4"];
    for result in train_ranks(2, &flags(&config, &roomy, &batch)) {
        result.unwrap();
    }
    let export = ["--export", dir.join("exported").to_str().unwrap()].map(str::to_owned);
    let flagged = [flags(&config, &full, &batch), export.to_vec()].concat();
    for result in train_ranks_with(2, &flagged, free) {
        result.unwrap();
    }
    assert_eq!(losses(&full), losses(&roomy), "the refused saves change nothing");
    assert_eq!(summary(&full)["checkpoints_refused"], serde_json::json!([2, 4]));
    assert!(!full.join("checkpoints").exists() || checkpoints_of(&full).is_empty());
    let later = dir.join("later");
    zeroflow_train::export::export(&roomy.join("checkpoints/step-00000004"), &later).unwrap();
    for name in ["config.json", "model.safetensors"] {
        let at_end = std::fs::read(dir.join("exported").join(name)).unwrap();
        assert!(at_end == std::fs::read(later.join(name)).unwrap(), "{name} differs");
    }
    for (rank, result) in
        train_ranks_with(2, &flags(&config, &lost, &batch), free).into_iter().enumerate()
    {
        let error = format!("{:#}", result.expect_err("the last save is refused"));
        assert!(error.contains("not enough disk space"), "rank {rank}: {error}");
    }
    assert_eq!(losses(&lost).len(), 4, "every step was taken before the last save");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where a checkpoint fits the disk but would leave too little room for the final weights that
/// `--export` writes to the same file system at the end, the saves are refused (every rank alike)
/// and the run goes on to export them; the same disk without `--export` takes the checkpoints.
/// A save for a stop is the exception: a run stopped to be resumed keeps its checkpoint.
#[test]
fn saves_that_would_crowd_out_the_export_are_refused_but_not_a_stops() {
    let (dir, config) = scratch_with_zero2("export-room");
    // MINI's f32 checkpoint takes 73 kB and its weights 18 kB: one fits 80 kB, not both.
    let free = Some(80_000);
    let batch = ["--micro-batch", "4", "--save-every", "2", "--steps", "4"];
    let (kept, exporting) = (dir.join("kept"), dir.join("exporting"));
    for result in train_ranks_with(2, &flags(&config, &kept, &batch), free) {
        result.unwrap();
    }
    assert_eq!(checkpoints_of(&kept).len(), 2, "saved at 2 and 4 (--keep 2, the default)");
    assert_eq!(summary(&kept)["checkpoints_refused"], serde_json::json!([]));
    let export = ["--export", dir.join("exported").to_str().unwrap()].map(str::to_owned);
    let flagged = [flags(&config, &exporting, &batch), export.to_vec()].concat();
    for result in train_ranks_with(2, &flagged, free) {
        result.unwrap();
    }
    assert_eq!(summary(&exporting)["checkpoints_refused"], serde_json::json!([2, 4]));
    assert!(!exporting.join("checkpoints").exists() || checkpoints_of(&exporting).is_empty());
    let weights = std::fs::read(dir.join("exported/model.safetensors")).unwrap();
    let later = dir.join("later");
    zeroflow_train::export::export(&kept.join("checkpoints/step-00000004"), &later).unwrap();
    assert!(weights == std::fs::read(later.join("model.safetensors")).unwrap());
    // Stopped after step 2 of 5, one process: the checkpoint is saved and nothing exported.
    let stopped = dir.join("stopped");
    let export_dir = dir.join("not-written");
    let stop_flags = flags(&config, &stopped, &["--steps", "5", "--save-every", "0"]);
    let export = ["--export", export_dir.to_str().unwrap()].map(str::to_owned);
    let outcome = stop_after(2, &[stop_flags, export.to_vec()].concat(), free);
    assert_eq!(outcome.saved, Some(stopped.join("checkpoints/step-00000002")));
    assert_eq!((outcome.exported, export_dir.exists()), (None, false));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Trains one process with the `train` flags `flags`, where every disk has `free` bytes free,
/// and requests a stop once step `step` is recorded (as a signal does).
fn stop_after(step: u64, flags: &[String], free: Option<u64>) -> zeroflow_train::run::Outcome {
    checkpoint::pretend_free(free);
    let setup = single_setup(flags);
    let stop = StopHandle::default();
    let mut observer = StopAfter { step, stop: stop.clone() };
    let outcome = run_single(setup, &mut observer, &stop);
    checkpoint::pretend_free(None);
    outcome.unwrap()
}

/// The set-up of one process of `train` with the flags `flags`.
fn single_setup(flags: &[String]) -> Setup {
    let argv = ["train".to_owned()].into_iter().chain(flags.to_vec());
    let args = Cli::try_parse_from(argv).unwrap().args;
    Setup::for_rank(args.options(), DistEnv::single(), Requested::default()).unwrap()
}

/// Runs `setup` (a GPT-2) on the CPU in this process, `observer` watching, `stop` its stop.
fn run_single(
    setup: Setup,
    observer: &mut dyn TrainObserver,
    stop: &StopHandle,
) -> anyhow::Result<zeroflow_train::run::Outcome> {
    let ModelSpec::Gpt2(shape) = setup.model.clone() else { panic!("these tests train GPT-2") };
    let opener = zeroflow_train::open::cpu_opener(false);
    Ok(zeroflow_train::run::run_on(setup, &shape, opener, observer, stop)?)
}

/// A run of one process stopped by a request after step 2 (as a signal stops it): with room on
/// the disk, it leaves its checkpoint and `--export` writes nothing (the stopped run is resumed
/// from the checkpoint, into the same directory); where its checkpoint is refused for want of
/// space, `--export` gets the weights of step 2 instead, those a roomy run's checkpoint holds.
#[test]
fn a_stopped_run_exports_only_where_its_checkpoint_was_refused() {
    let (dir, config) = scratch_with_zero2("stopped");
    let stopped = |out: &Path, export: &Path, free: Option<u64>| {
        let export = ["--export", export.to_str().unwrap()].map(str::to_owned);
        stop_after(2, &[flags(&config, out, &["--steps", "5"]), export.to_vec()].concat(), free)
    };
    let (roomy, full) = (dir.join("roomy"), dir.join("full"));
    let kept = stopped(&roomy, &dir.join("not-written"), None);
    assert!(kept.interrupted && kept.done == 2, "{kept:?}");
    assert_eq!(kept.saved, Some(roomy.join("checkpoints/step-00000002")));
    assert_eq!((kept.exported, dir.join("not-written").exists()), (None, false));
    // MINI's f32 checkpoint takes 73 kB, its weights 18 kB.
    let refused = stopped(&full, &dir.join("exported"), Some(40_000));
    assert!(refused.interrupted && refused.done == 2, "{refused:?}");
    assert_eq!((refused.saved, refused.exported), (None, Some(dir.join("exported"))));
    assert_eq!(summary(&full)["checkpoints_refused"], serde_json::json!([2]));
    let later = dir.join("later");
    zeroflow_train::export::export(&roomy.join("checkpoints/step-00000002"), &later).unwrap();
    for name in ["config.json", "model.safetensors"] {
        let at_stop = std::fs::read(dir.join("exported").join(name)).unwrap();
        assert!(at_stop == std::fs::read(later.join(name)).unwrap(), "{name} differs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Where `--save-every` (`--eval-every`) is not given, a save (an evaluation) waits until the
/// pace's multiple of the last one's duration has passed: with a pace no run reaches, those after
/// the first wait for the end; with none, every one is made. A given interval sets no pace.
#[test]
fn saves_and_evaluations_by_default_keep_their_pace() {
    let (dir, config) = scratch_with_zero2("pace");
    let run = |name: &str, pace: Option<Pace>| {
        let out = dir.join(name);
        let mut setup = single_setup(&flags(&config, &out, &["--steps", "7"]));
        assert_eq!((setup.save_every, setup.save_pace), (200, Some(DEFAULT_PACE)), "the default");
        assert_eq!((setup.eval_every, setup.eval_pace), (0, None), "--eval-every 0 given");
        (setup.save_every, setup.save_pace, setup.eval_every, setup.eval_pace) = (2, pace, 2, pace);
        let (mut quiet, stop) =
            (StopAfter { step: 0, stop: StopHandle::default() }, Default::default());
        run_single(setup, &mut quiet, &stop).unwrap();
        let mut saved: Vec<String> = checkpoints_of(&out)
            .iter()
            .map(|dir| dir.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        saved.sort();
        let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let evaluated: Vec<u64> = metrics
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|line| line.get("eval_loss").is_some())
            .filter_map(|line| line["step"].as_u64())
            .collect();
        (saved, evaluated)
    };
    let step = |n: u64| format!("step-{n:08}");
    let (saved, evaluated) = run("unpaced", None);
    assert_eq!(saved, [step(4), step(6), step(7)], "--keep 3 of 2, 4, 6, 7");
    assert_eq!(evaluated, [2, 4, 6, 7]);
    let (saved, evaluated) = run("paced", Some(Pace { times: 1e9, from_seconds: 0.0 }));
    assert_eq!(saved, [step(2), step(7)], "4 and 6 wait, the end does not");
    assert_eq!(evaluated, [2, 7]);
    // The default: work under a second is never held back; longer work waits 20 times as long.
    let now = std::time::Instant::now();
    assert_eq!(DEFAULT_PACE.due(now, 0.5), Ok(()));
    assert_eq!(DEFAULT_PACE.due(now, 2.0), Err(40.0));
    let earlier = now.checked_sub(Duration::from_secs(50)).expect("the clock is past 50 s");
    assert_eq!(DEFAULT_PACE.due(earlier, 2.0), Ok(()));
    let given = single_setup(&flags(&config, &dir.join("given"), &["--save-every", "5"]));
    assert_eq!((given.save_every, given.save_pace), (5, None));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A sample says so while it is written (on the CPU it can take a while for a large model): the
/// run's activities go step, sample, then the next step.
#[test]
fn a_sample_is_an_activity_of_its_own() {
    let (dir, config) = scratch_with_zero2("sampling");
    let sample = ["--steps", "3", "--sample-every", "2", "--sample-prompt", "1,2,3"];
    let setup = single_setup(&flags(&config, &dir.join("run"), &sample));
    struct Seen(Vec<Activity>);
    impl TrainObserver for Seen {
        fn doing(&mut self, activity: Activity) {
            self.0.push(activity);
        }
    }
    let (mut seen, stop) = (Seen(Vec::new()), StopHandle::default());
    run_single(setup, &mut seen, &stop).unwrap();
    let at = |wanted: Activity| seen.0.iter().position(|a| *a == wanted).unwrap_or(usize::MAX);
    let (step_2, sampled, step_3) = (
        at(Activity::Step { step: 2, steps: 3 }),
        at(Activity::Sampling { step: 2 }),
        at(Activity::Step { step: 3, steps: 3 }),
    );
    let last = at(Activity::Sampling { step: 3 });
    assert!(step_2 < sampled && sampled < step_3 && step_3 < last, "{:?}", seen.0);
    assert!(last < usize::MAX, "a sample after the last step: {:?}", seen.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Requests a stop once step `step` is recorded.
struct StopAfter {
    step: u64,
    stop: StopHandle,
}

impl TrainObserver for StopAfter {
    fn on_step(&mut self, record: &zeroflow_train::metrics::StepRecord) {
        if record.step == self.step {
            self.stop.request();
        }
    }
}

/// The checkpoint directories under a run directory.
fn checkpoints_of(out: &Path) -> Vec<PathBuf> {
    let entries = std::fs::read_dir(out.join("checkpoints")).unwrap();
    entries.map(|entry| entry.unwrap().path()).collect()
}

#[test]
fn a_rank_that_fails_fails_the_others_instead_of_hanging() {
    // Rank 1 is given data that does not exist: it fails before the rendezvous, so rank 0 gives
    // up waiting for it and names it.
    let (dir, config) = scratch_with_zero2("missing-rank");
    let out = dir.join("run");
    let port = free_port();
    let devices: Vec<CpuDevice> = (0..2).map(|_| CpuDevice::new().unwrap()).collect();
    let mut comms = CpuComm::group(&devices, Duration::from_secs(60));
    let (device, comm) = (devices.into_iter().next().unwrap(), comms.remove(0));
    let argv: Vec<String> =
        ["train".to_owned()].into_iter().chain(flags(&config, &out, &["--steps", "2"])).collect();
    let args = Cli::try_parse_from(argv).unwrap().args;
    let dist = DistEnv {
        rank: 0,
        local_rank: 0,
        world_size: 2,
        local_world_size: 2,
        master: Some(Master { addr: "127.0.0.1".into(), port }),
        rendezvous_timeout: Duration::from_millis(500),
        step_timeout: None,
    };
    let setup = Setup::for_rank(args.options(), dist, Requested::default()).unwrap();
    let error = run_gpt2(setup, move |model, micro_batch, seq, layout, dist| {
        let gpt = CpuGpt::new(&device, model, layout, micro_batch, seq)?;
        let (_, group) = dist::join_with(dist, || Ok(Vec::new()), log_lost())?;
        Ok(Opened { device, comm, model: gpt, group })
    })
    .unwrap_err();
    assert!(format!("{error:#}").contains("rank 1 of 2 did not join"), "{error:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_partitioning_rank_0_saves_the_one_optimizer_part() {
    let dir = scratch("stage0");
    let config = dir.join("zero0.json");
    let zero0 = ZERO2_OFFLOAD
        .replace(r#""stage": 2, "offload_optimizer": { "device": "cpu" }"#, r#""stage": 0"#);
    assert_ne!(zero0, ZERO2_OFFLOAD);
    std::fs::write(&config, zero0).unwrap();
    let out = dir.join("run");
    let run = ["--micro-batch", "4", "--steps", "2", "--save-every", "0"];
    for result in train_ranks(2, &flags(&config, &out, &run)) {
        result.unwrap();
    }
    let saved = checkpoint::load::<f32>(&out.join("checkpoints/step-00000002")).unwrap();
    assert_eq!((saved.meta.world_size, saved.parts.len()), (1, 1));
    assert_eq!(saved.parts[0].flat.start, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The CPU model, failing in its forward from the `fail_at`-th on (a rank that fails mid-run).
struct FailingGpt {
    gpt: CpuGpt,
    forwards: u64,
    fail_at: Option<u64>,
}

impl Model for FailingGpt {
    type Device = CpuDevice;
    type Comm = CpuComm;
    type P = f32;
    type Error = GptError;

    fn set_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: Option<&[u32]>,
    ) -> Result<(), GptError> {
        match positions {
            None => self.gpt.set_batch(inputs, targets),
            Some(positions) => self.gpt.set_packed_batch(inputs, targets, positions),
        }
    }

    fn forward(&mut self, params: &Buffer<Self>) -> Result<(), GptError> {
        self.forwards += 1;
        if self.fail_at.is_some_and(|at| self.forwards >= at) {
            let reason = format!("injected failure at forward {}", self.forwards);
            return Err(GptError::Kernel { kernel: "forward", reason });
        }
        self.gpt.forward(params)
    }

    fn loss(&mut self) -> Result<f32, GptError> {
        self.gpt.loss()
    }

    fn backward(
        &mut self,
        params: &Buffer<Self>,
        grads: &Buffer<Self>,
        loss_scale: f64,
        on_ready: &mut dyn FnMut(&GradsReady),
    ) -> Result<(), GptError> {
        self.gpt.backward(params, grads, loss_scale, on_ready)
    }
}

/// Rank 1 of 2 fails in the forward of step 3 (ZeRO-2, the gradients reduce-scattered between
/// the ranks). Rank 0 fails too, with an error naming rank 1, and every thread ends: its step-3
/// collectives, which rank 1 never joins, fail at once when rank 1's communicator goes, instead
/// of holding rank 0's device (which waits for its streams when dropped) for the communicators'
/// timeout, an hour here.
#[test]
fn a_rank_that_fails_mid_run_ends_every_rank_with_an_error_naming_it() {
    let dir = scratch("fails-mid-run");
    let config = dir.join("zero2.json");
    std::fs::write(&config, zero_config(2, false)).unwrap();
    let out = dir.join("run");
    let flags = flags(&config, &out, &["--micro-batch", "4", "--steps", "6", "--save-every", "0"]);
    let port = free_port();
    let devices: Vec<CpuDevice> = (0..2).map(|_| CpuDevice::new().unwrap()).collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(3600));
    let handles: Vec<_> = devices
        .into_iter()
        .zip(comms)
        .enumerate()
        .map(|(rank, (device, comm))| {
            let argv: Vec<String> = ["train".to_owned()].into_iter().chain(flags.clone()).collect();
            thread::spawn(move || -> anyhow::Result<()> {
                let args = Cli::try_parse_from(argv)?.args;
                let dist = DistEnv {
                    rank,
                    local_rank: rank,
                    world_size: 2,
                    local_world_size: 2,
                    master: Some(Master { addr: "127.0.0.1".into(), port }),
                    rendezvous_timeout: Duration::from_secs(20),
                    step_timeout: None,
                };
                let setup = Setup::for_rank(args.options(), dist, Requested::default())?;
                run_gpt2(setup, move |model, micro_batch, seq, layout, dist| {
                    let gpt = CpuGpt::new(&device, model, layout, micro_batch, seq)?;
                    let (_, group) = dist::join_with(dist, || Ok(Vec::new()), log_lost())?;
                    let fail_at = (rank == 1).then_some(3);
                    let model = FailingGpt { gpt, forwards: 0, fail_at };
                    Ok(Opened { device, comm, model, group })
                })
            })
        })
        .collect();
    let results: Vec<anyhow::Result<()>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let message = |rank: usize| format!("{:#}", results[rank].as_ref().unwrap_err());
    assert!(message(1).contains("injected failure at forward 3"), "rank 1: {}", message(1));
    // Through the communicator, or through the side channel where rank 0 reaches it first.
    let rank_0 = message(0);
    assert!(
        rank_0.contains("rank 1 left the group") || rank_0.contains("rank 1 is gone"),
        "rank 0: {rank_0}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
