//! The training loop of one rank: the model (on the CPU device or a GPU) driven through the ZeRO
//! engine, step by step, with its evaluations and checkpoints, until the last step or a stop
//! request; and what it leaves in the run directory.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::checkpoints::{self, ExportRoom};
use crate::error::Result;
use crate::metrics::Recorder;
use crate::observer::{Activity, StopHandle, TrainObserver};
use crate::open::{self, CudaOpen, OpenFn};
use crate::resume_point;
use crate::settings;
use crate::setup::{DeviceKind, Setup, Start};
use crate::trainer::Trainer;
use crate::{Family, Model, with_family};

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    /// The last step taken.
    pub done: u64,
    /// The run's total of steps.
    pub steps: u64,
    /// The latest evaluation: its step and loss.
    pub last_eval: Option<(u64, f64)>,
    /// The newest checkpoint this process saved.
    pub saved: Option<PathBuf>,
    /// The Hugging Face directory the final weights were written to (`--export`, rank 0).
    pub exported: Option<PathBuf>,
    /// A stop request ended the run (after `done`).
    pub interrupted: bool,
    /// The run directory (claimed under another name where the default one was taken).
    pub out: PathBuf,
    /// The data's entropy floor, where known.
    pub floor: Option<f64>,
}

/// Trains as `setup` says (from its start: fresh, `--init-from` or `--resume`) on its device
/// (`cuda`: how a GPU is opened), saves checkpoints, and on rank 0 writes the metrics, the plot
/// and the summary. A request on `stop` ends the run after the current step, with a checkpoint
/// and the summary ([`Outcome::interrupted`]).
pub fn run(
    setup: Setup,
    cuda: CudaOpen,
    observer: &mut dyn TrainObserver,
    stop: &StopHandle,
) -> Result<Outcome> {
    let model = setup.model.clone();
    let packed = setup.settings.pack.unwrap_or(false);
    with_family!(model, family => match setup.device {
        DeviceKind::Cpu => run_on(setup, &family, open::cpu_opener(packed), observer, stop),
        DeviceKind::Cuda => run_on(setup, &family, cuda.packed_opener(packed), observer, stop),
    })
}

/// [`run`] with the model `family` opened by `open`.
pub fn run_on<F: Family, M: Model>(
    mut setup: Setup,
    family: &F,
    open: impl OpenFn<F, M>,
    observer: &mut dyn TrainObserver,
    stop: &StopHandle,
) -> Result<Outcome> {
    let started = Instant::now();
    let steal_at_start = crate::machine::cpu_steal();
    // Rank 0 writes the metrics, the plot and the summary; every rank trains.
    let leader = setup.dist.rank == 0;
    if leader {
        log_start(&setup, family);
    }
    observer.doing(Activity::Building { parameters: family.num_params() });
    // Where this fails, the default run directory claimed for the run (holding at most the
    // tokens of data tokenized at start-up) goes with the set-up, as a failed set-up's does.
    let mut trainer = Trainer::<M>::new(&mut setup, family, open, started)?;
    setup.claimed.keep();
    // The engine holds the checkpoint's optimizer state now (read from the files into its own)
    // and ZenFlow's: the resume point keeps only what the run reports and records.
    if let Start::Resume { point, .. } = &mut setup.start {
        point.loaded.zenflow = Vec::new();
    }
    let seconds = started.elapsed().as_secs_f64();
    observer.on_model_ready(&trainer.device_description, seconds).map_err(observer_error)?;
    if let Start::Resume { point, .. } = &setup.start {
        settings::warn_on_resume(&point.extra.settings, &trainer.settings, &point.dir);
    }
    let mut recorder = open_recorder(&setup, leader)?;
    let ended = train_steps(&mut setup, &mut trainer, &mut recorder, observer, stop)?;
    // `--export` at the end of the run; at a stop only where its checkpoint was refused (a run
    // stopped to be resumed has its checkpoint, and its directory stays free for the resumed run).
    let export = setup.export.clone().filter(|_| {
        !ended.interrupted || ended.refused.last().is_some_and(|&step| step == ended.done)
    });
    if export.is_some() {
        // Every rank: a stopped run's delayed update may still hold the last step's weights.
        trainer.engine.flush()?;
    }
    // The last barrier: from here a rank's process ending is the job ending, not a lost rank.
    trainer.group.take().expect("the group is taken once, here").finish()?;
    let exported = match &export {
        Some(dir) if leader => {
            observer.doing(Activity::Exporting { step: ended.done });
            Some((dir, export_weights(&mut trainer, family, &setup, &ended, dir)?))
        }
        _ => None,
    };
    observer.on_steps_done();
    let exported = exported.map(|(dir, (saved, seconds))| {
        tracing::info!(
            "wrote the weights of step {} to {} ({} in {} file(s), {seconds:.1} s)",
            ended.done,
            dir.display(),
            zeroflow_engine::checkpoint::disk_size(saved.total_size),
            saved.weight_files.len(),
        );
        dir.clone()
    });
    if leader {
        let wall = started.elapsed();
        let mut summary =
            summary(&setup, family, &trainer, &recorder, &ended, wall, exported.as_deref());
        summary["host_steal_fraction"] = json!(host_steal(steal_at_start, wall));
        let floor = setup.data.floor;
        recorder.finish(|train, eval| observer.loss_svg(train, eval, floor), &summary)?;
        tracing::info!("{} steps; wrote {}", ended.done, setup.out.display());
    }
    Ok(Outcome {
        done: ended.done,
        steps: setup.steps,
        last_eval: ended.last_eval,
        saved: ended.saved,
        exported,
        interrupted: ended.interrupted,
        out: setup.out,
        floor: setup.data.floor,
    })
}

/// The share of the machine's CPU time the hypervisor took over this process's `wall` time since
/// the reading `at_start` ([`crate::machine::cpu_steal`]; `None` where unknown), with a warning
/// above 1 %: a CPU optimizer on every core slows by far more than the share taken.
fn host_steal(at_start: Option<crate::machine::CpuSteal>, wall: Duration) -> Option<f64> {
    let (start, end) = at_start.zip(crate::machine::cpu_steal())?;
    let fraction = end.share(end.since(&start).as_secs_f64(), wall.as_secs_f64());
    if fraction > crate::machine::CpuSteal::WORTH_SAYING {
        tracing::warn!(
            "the hypervisor took {:.1} % of this machine's CPU time during this process's run \
             (steal: other work on the host it runs on); the CPU's part of each step (an \
             offloaded optimizer, the CPU device) can slow by far more than that",
            100.0 * fraction
        );
    }
    Some(fraction)
}

/// An observer's error as the run's.
fn observer_error(error: crate::observer::ObserverError) -> crate::TrainError {
    crate::TrainError::Observer(error)
}

/// How the steps of a run ended.
#[derive(Debug)]
struct Ended {
    /// The last step taken.
    done: u64,
    /// The latest evaluation: its step and loss.
    last_eval: Option<(u64, f64)>,
    /// The newest checkpoint this process saved.
    saved: Option<PathBuf>,
    /// The steps whose checkpoints were refused for want of disk space.
    refused: Vec<u64>,
    /// A signal stopped the run (after `done`).
    interrupted: bool,
    /// This process's saves and evaluations, as their paces see them.
    saves: Paced,
    evals: Paced,
}

/// Periodic work (saves or evaluations) as its [`crate::setup::Pace`] sees it.
#[derive(Debug, Default)]
struct Paced {
    /// When the last one ended, and how long it took.
    last: Option<(Instant, f64)>,
    /// Whether one has been put off already (said once).
    put_off: bool,
}

impl Paced {
    /// One ended now, having started at `started`.
    fn done(&mut self, started: Instant) {
        self.last = Some((Instant::now(), started.elapsed().as_secs_f64()));
    }
}

/// Rank 0's recorder (the others write nothing), after removing what an interrupted checkpoint
/// write left in the run directory, and when resuming setting aside damaged checkpoints.
fn open_recorder(setup: &Setup, leader: bool) -> Result<Recorder> {
    if !leader {
        return Ok(Recorder::discard(&setup.out));
    }
    for removed in checkpoints::remove_unfinished(&setup.out)? {
        tracing::warn!(
            "removed {}: a checkpoint whose writing was cut short (a second signal, or the \
             process killed)",
            removed.display()
        );
    }
    match &setup.start {
        Start::Resume { point, .. } => {
            resume_point::set_aside(&point.damaged)?;
            let at = point.extra.step;
            tracing::info!("resuming from {} at step {at} of {}", point.dir.display(), setup.steps);
            Recorder::resume(&setup.out, at, setup.eval_every)
        }
        _ => Recorder::create(&setup.out),
    }
}

/// The training loop: every step, with its checkpoints and evaluations, until the last step or
/// a stop request.
fn train_steps<M: Model>(
    setup: &mut Setup,
    trainer: &mut Trainer<M>,
    recorder: &mut Recorder,
    observer: &mut dyn TrainObserver,
    stop: &StopHandle,
) -> Result<Ended> {
    // Off unless ZEROFLOW_STEP_TIMEOUT is set; ticked after each step, checkpoint and evaluation.
    let watchdog = crate::dist::step_watchdog(&setup.dist)?;
    let tick = || watchdog.iter().for_each(crate::dist::Watchdog::tick);
    let first = setup.start_step() + 1;
    let last_eval = recorder.eval.last().copied();
    let mut ended = Ended {
        done: first - 1,
        last_eval,
        saved: None,
        refused: Vec::new(),
        interrupted: false,
        saves: Paced::default(),
        evals: Paced::default(),
    };
    if let Start::InitFrom { .. } = setup.start {
        let Some(loss) = trainer.evaluate(0, &setup.data.eval, stop, observer)? else {
            ended.interrupted = true;
            return Ok(ended);
        };
        recorder.eval(0, loss)?;
        observer.on_eval(0, loss, setup.data.floor);
        ended.last_eval = Some((0, loss));
    }
    for step in first..=setup.steps {
        stop.at_step(step);
        observer.doing(Activity::Step { step, steps: setup.steps });
        let record = trainer.step(step, &mut setup.data.train)?;
        tick();
        recorder.step(&record)?;
        observer.on_step(&record);
        ended.done = step;
        // Every rank stops after the same step: a signal may reach the ranks at different times.
        let interrupted = trainer.group().any(stop.requested())?;
        let last = step == setup.steps;
        let every = setup.save_every > 0 && step.is_multiple_of(setup.save_every);
        let every =
            every && !last && !interrupted && paced(Work::Save, setup, trainer, &mut ended)?;
        if last || interrupted || every {
            // Saved before the flush below: the delayed update's pending weights are part of
            // the state, so a resumed run continues exactly as this one would have.
            let why = match (last, interrupted) {
                (true, _) => Save::End,
                (false, true) => Save::Stop,
                (false, false) => Save::Every,
            };
            save_and_say(trainer, step, setup, observer, why, &mut ended)?;
            tick();
        }
        if let Some(sampler) = &setup.sampler
            && setup.dist.rank == 0
            && sampler.due(step, last || interrupted)
        {
            observer.doing(Activity::Sampling { step });
            let (weights, layout) = trainer.host_weights()?;
            sampler.sample(step, &setup.model, layout, weights)?;
        }
        if interrupted {
            ended.interrupted = true;
            break;
        }
        if last {
            // The delayed update may still hold the last step's weights.
            trainer.engine.flush()?;
        }
        let every = setup.eval_every > 0 && step.is_multiple_of(setup.eval_every);
        let every = every && !last && paced(Work::Eval, setup, trainer, &mut ended)?;
        if last || every {
            let evaluating = Instant::now();
            let Some(loss) = trainer.evaluate(step, &setup.data.eval, stop, observer)? else {
                // Abandoned for a signal: the run stops here, with a checkpoint of this step.
                if ended.saved.as_deref() != Some(checkpoints::step_dir(&setup.out, step).as_path())
                    && !ended.refused.contains(&step)
                {
                    save_and_say(trainer, step, setup, observer, Save::Stop, &mut ended)?;
                }
                ended.interrupted = true;
                break;
            };
            tick();
            recorder.eval(step, loss)?;
            observer.on_eval(step, loss, setup.data.floor);
            ended.last_eval = Some((step, loss));
            ended.evals.done(evaluating);
        }
    }
    Ok(ended)
}

/// Work done every so many steps, which a [`crate::setup::Pace`] may hold back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    Save,
    Eval,
}

/// Whether the periodic `work` of this step is due by its pace (where `--save-every` or
/// `--eval-every` was not given): rank 0's clock decides for every rank (a save and an evaluation
/// are collective). The first time one waits, the run says so.
fn paced<M: Model>(
    work: Work,
    setup: &Setup,
    trainer: &mut Trainer<M>,
    ended: &mut Ended,
) -> Result<bool> {
    let step = ended.done;
    let (pace, paced, flag, what) = match work {
        Work::Save => (setup.save_pace, &mut ended.saves, "--save-every", "checkpoint"),
        Work::Eval => (setup.eval_pace, &mut ended.evals, "--eval-every", "evaluation"),
    };
    let (Some(pace), Some((at, seconds))) = (pace, paced.last) else {
        return Ok(true);
    };
    let wait = match pace.due(at, seconds) {
        Err(wait) if setup.dist.rank == 0 => Some(wait),
        _ => None,
    };
    let early = trainer.group().any(wait.is_some())?;
    if let (Some(wait), false) = (wait, paced.put_off) {
        tracing::info!(
            "step {step}: the {what} waits until {wait:.0} s after the last one, which took \
             {seconds:.1} s, so that it takes about 5 % of the run ({flag} N: every N steps)"
        );
    }
    paced.put_off |= early;
    Ok(!early)
}

/// Why a checkpoint is saved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Save {
    /// `--save-every`.
    Every,
    /// The run's last step.
    End,
    /// A signal stops the run, to be resumed.
    Stop,
}

/// Saves the checkpoint of `step`, saying so, into `ended.saved`. A save refused for want of
/// disk space (nothing written) is a warning, in `ended.refused`, and the run goes on; unless it
/// is the run's last (at its end or a stop) and no `--export` is to write the final weights.
/// With `--export` on the same file system, a save that would leave the final weights too little
/// room is refused too, but for a stop's: a run stopped to be resumed needs its checkpoint, and
/// exports only where it was refused.
fn save_and_say<M: Model>(
    trainer: &mut Trainer<M>,
    step: u64,
    setup: &Setup,
    observer: &mut dyn TrainObserver,
    why: Save,
    ended: &mut Ended,
) -> Result<()> {
    observer.doing(Activity::Saving { step });
    let saving = Instant::now();
    let last = why != Save::Every;
    let room = match why {
        Save::Stop => None,
        Save::Every | Save::End => setup.export.as_deref().map(|dir| ExportRoom { dir }),
    };
    match trainer.save(step, setup, room) {
        Ok(dir) => {
            observer.on_checkpoint(step, &dir, saving.elapsed().as_secs_f64());
            ended.saved = Some(dir);
            ended.saves.done(saving);
        }
        Err(error) if error.is_no_space() && (!last || setup.export.is_some()) => {
            let then = match &setup.export {
                Some(dir) => format!("--export writes the final weights to {}", dir.display()),
                None => "a save at the end that is refused too ends the run".to_owned(),
            };
            tracing::warn!("step {step}: {error}; training goes on ({then})");
            ended.refused.push(step);
        }
        Err(error) => return Err(error),
    }
    Ok(())
}

/// Writes the run's final weights (those of step `ended.done`) as the Hugging Face directory
/// `dir` (`--export`): what was written, and in how many seconds.
fn export_weights<F: Family, M: Model>(
    trainer: &mut Trainer<M>,
    family: &F,
    setup: &Setup,
    ended: &Ended,
    dir: &std::path::Path,
) -> Result<(zeroflow_hf::Saved, f64)> {
    let (step, exporting) = (ended.done, Instant::now());
    let model_dir = setup.model_dir();
    let variables = setup.chat_template_kwargs.clone().unwrap_or_default();
    let template = (setup.chat_template.as_deref(), &variables);
    let tokenizer = crate::export::ExportTokenizer::of_run(model_dir.as_deref(), template);
    let saved = trainer.export(family, dir, tokenizer.source()).map_err(|error| {
        let newest = ended.saved.as_ref().map_or(String::new(), |saved| {
            format!("; `zeroflow export` writes the newest checkpoint, {}", saved.display())
        });
        error.context(format!(
            "cannot write the final weights (step {step}) to --export {}{newest}",
            dir.display()
        ))
    })?;
    Ok((saved, exporting.elapsed().as_secs_f64()))
}

/// `summary.json`. Its times: `wall_s` is the run's wall-clock time so far, every process that
/// trained it included (set-up, evaluations and checkpoints too; up to the checkpoint each resumed
/// from); `process_wall_s` is this process's; `train_s` the time in training steps alone, over the
/// whole run like `wall_s` (so `train_s` ≤ `wall_s`), which `tokens_per_s` divides by.
fn summary<F: Family, M: Model>(
    setup: &Setup,
    family: &F,
    trainer: &Trainer<M>,
    recorder: &Recorder,
    ended: &Ended,
    process_wall: Duration,
    exported: Option<&std::path::Path>,
) -> serde_json::Value {
    let train_s = trainer.train_time.as_secs_f64();
    let tokens = ended.done * trainer.tokens_per_step;
    let (resumed_from, init_from) = match &setup.start {
        Start::Resume { point, .. } => (Some(point.dir.display().to_string()), None),
        Start::InitFrom { hf } => (None, Some(hf.dir.display().to_string())),
        Start::Seed => (None, None),
    };
    let eval_loss = ended.last_eval.map(|(_, loss)| loss);
    json!({
        "final_eval_loss": eval_loss,
        "eval_step": ended.last_eval.map(|(step, _)| step),
        "entropy_floor": setup.data.floor,
        "over_floor": setup.data.floor.zip(eval_loss).map(|(floor, loss)| loss / floor - 1.0),
        "final_train_loss": recorder.train.last().map(|&(_, loss)| loss),
        "steps": ended.done,
        "interrupted": ended.interrupted,
        "tokens": tokens,
        "tokens_per_s": tokens as f64 / train_s,
        // The same reading of the clock as process_wall_s, so that the two agree exactly.
        "wall_s": (trainer.wall_before + process_wall).as_secs_f64(),
        "process_wall_s": process_wall.as_secs_f64(),
        "train_s": train_s,
        "seed": setup.seed,
        "device": trainer.device_description,
        "world_size": setup.dist.world_size,
        "data": setup.data.description,
        "eval_data": setup.data.eval_description,
        "eval_tokens": setup.data.eval_tokens,
        "model": family,
        "parameters": family.num_params(),
        "resumed_from": resumed_from,
        "init_from": init_from,
        "checkpoints": checkpoints::list(&setup.out).ok().map(|all| {
            all.into_iter().map(|(_, dir)| dir.display().to_string()).collect::<Vec<_>>()
        }),
        "checkpoints_refused": ended.refused,
        "exported": exported.map(|dir| dir.display().to_string()),
        "config_file": setup.config_file.as_ref().map(|p| p.display().to_string()),
        "config": setup.config.to_json(),
        "settings": trainer.settings.to_json(),
    })
}

fn log_start(setup: &Setup, model: &impl Family) {
    let config = &setup.config;
    let batch = &config.batch;
    tracing::info!(
        "training {} parameters ({} layers, d_model {}) for {} steps of {} sequences of {} \
         tokens (micro-batch {}, accumulation {}), {}, ZeRO stage {}, {}, lr {} ({}); data: {}; \
         eval: {}",
        model.num_params(),
        model.n_layer(),
        model.hidden_size(),
        setup.steps,
        batch.train_batch_size,
        setup.seq,
        batch.micro_batch_size_per_gpu,
        batch.gradient_accumulation_steps,
        precision_name(config.precision),
        config.zero.stage.number(),
        offload_description(&config.zero),
        config.optimizer.lr,
        config.scheduler.map_or("constant", |s| s.type_name()),
        setup.data.description,
        setup.data.eval_description,
    );
    if let Some(line) = epochs_line(setup) {
        tracing::info!("{line}");
    }
    let decay = config.optimizer.weight_decay;
    if decay > 0.0
        && let Ok(layout) = model.flat_layout(1)
    {
        let one_d = layout.params().iter().filter(|p| !p.takes_weight_decay());
        let (count, elements) = one_d.fold((0, 0), |(n, e), p| (n + 1, e + p.flat_range().len()));
        tracing::info!(
            "weight decay {decay} on the 2-D parameters; not on the {count} 1-D ones (norms' \
             weights, biases: {elements} elements), as transformers' Trainer leaves them out"
        );
    }
}

/// How many passes over the training data the run's steps make, for the run header (`None` for
/// the synthetic corpus): what `transformers`' `Trainer` calls epochs, which `--steps` sets here.
pub fn epochs_line(setup: &Setup) -> Option<String> {
    let micro_steps = setup.data.epoch_micro_steps.filter(|&micro| micro > 0)?;
    let accum = setup.config.batch.gradient_accumulation_steps.max(1);
    let epoch = setup.data.epoch_steps(accum)?;
    Some(format!(
        "one epoch of the training data is {epoch:.0} steps ({}); the run's {} steps read it {:.2} \
         times (--epochs 3 would be {:.0} steps)",
        match accum {
            1 => format!("{micro_steps} micro-batches"),
            _ => format!("{micro_steps} micro-batches, {accum} a step"),
        },
        setup.steps,
        setup.steps as f64 / epoch,
        (3.0 * epoch).ceil()
    ))
}

/// The precision as the run header states it.
fn precision_name(precision: zeroflow_core::config::MixedPrecision) -> &'static str {
    match precision.precision() {
        zeroflow_core::config::Precision::Fp32 => "fp32",
        zeroflow_core::config::Precision::Bf16 => "bf16 (fp32 master weights)",
        zeroflow_core::config::Precision::Fp16 => "fp16 (fp32 master weights)",
    }
}

/// Where the optimizer runs, as the run header states it: on the device, offloaded to the CPU,
/// or ZenFlow (offloaded, with the important columns on the device).
fn offload_description(zero: &zeroflow_core::config::ZeroConfig) -> String {
    match (&zero.offload_optimizer, &zero.zenflow) {
        (None, _) => "no optimizer offload, no ZenFlow".to_owned(),
        (Some(_), None) => "optimizer offloaded to the CPU, no ZenFlow".to_owned(),
        (Some(_), Some(zenflow)) => {
            format!("optimizer offloaded to the CPU, ZenFlow (topk_ratio {})", zenflow.topk_ratio)
        }
    }
}
