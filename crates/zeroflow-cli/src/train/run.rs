//! The training loop: one rank, the model (on the CPU device or a GPU) driven through the ZeRO
//! engine.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;
use zeroflow_core::Float;
use zeroflow_data::{Batch, DataLoader};
use zeroflow_device::Device as _;
use zeroflow_engine::checkpoint::{self, Meta, NamedTensor, ParamEntry};
use zeroflow_engine::{
    Engine, EngineError, EngineOptions, Restore, Snapshot, StepReport, ZenFlowSnapshot,
};
use zeroflow_gpt::{flat_layout, hf_tensors, init_params};

use super::backend::{self, Model};
use super::checkpoints::{self, Extra, LrPosition, RunInfo};
use super::output::{self, Progress, Recorder, StepRecord};
use super::run_dir;
use super::signals::Stop;
use super::{DeviceKind, Setup, Start};
use crate::error::Exit;
use crate::settings::{self, Effective};
use zeroflow_train::ModelSpec;
use zeroflow_train::dist::{Group, affinity};
use zeroflow_train::schedule::LrSchedule;

pub(crate) type ModelEngine<M> = Engine<<M as Model>::Device, <M as Model>::Comm, <M as Model>::P>;

/// Trains as `setup` says (from its start: fresh, `--init-from` or `--resume`), saves
/// checkpoints, writes the metrics, plot and summary, and prints the final evaluation loss (next
/// to the entropy floor where it is known). SIGINT or SIGTERM ends the run after the current step
/// with a checkpoint and the summary, and an [`Exit`] error of status 130 or 143
/// ([`signals`](super::signals)).
pub fn run(setup: Setup) -> anyhow::Result<()> {
    match setup.device {
        DeviceKind::Cpu => run_on(setup, backend::open_cpu),
        DeviceKind::Cuda => {
            let device = settings::cuda_device_options(&setup.settings);
            let activation_checkpointing =
                settings::activation_checkpointing(setup.device, &setup.settings);
            let open =
                backend::CudaOpen { device, attention: setup.attention, activation_checkpointing };
            run_on(setup, open.opener())
        }
    }
}

pub(super) fn run_on<M: Model>(
    mut setup: Setup,
    open: impl backend::OpenFn<M>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    // Rank 0 writes the metrics, the plot, the summary and the progress; every rank trains.
    let leader = setup.dist.rank == 0;
    let interval = output::progress_interval()?;
    if leader {
        log_start(&setup);
    }
    let progress = if leader {
        Progress::new(setup.steps, setup.start_step(), setup.log_every, interval)
    } else {
        Progress::Silent
    };
    progress.doing(|| format!("building the model ({} parameters)", setup.model.num_params()));
    let mut trainer = Trainer::<M>::new(&setup, open, started)?;
    progress.println(&format!(
        "model ready on {} in {:.1} s",
        trainer.device_description,
        started.elapsed().as_secs_f64()
    ));
    // Caught from here on: before, there is nothing to save, and a signal must end a rank that
    // waits at the rendezvous or in NCCL's initialisation (the launcher stopping a failed job).
    let stop = Stop::on_signals()?;
    if leader && setup.default_out {
        setup.out = run_dir::claim(&setup.out)?;
    }
    if let Start::Resume { point, .. } = &setup.start {
        settings::warn_on_resume(&point.extra.settings, &trainer.settings, &point.dir);
    }
    let mut recorder = open_recorder(&setup, leader)?;
    let ended = train_steps(&mut setup, &mut trainer, &mut recorder, &progress, &stop)?;
    progress.finish();
    // The last barrier: from here a rank's process ending is the job ending, not a lost rank.
    trainer.group.take().expect("the group is taken once, here").finish()?;
    if leader {
        let summary = summary(&setup, &trainer, &recorder, &ended, started.elapsed());
        recorder.finish(setup.data.floor, &summary)?;
        tracing::info!("{} steps; wrote {}", ended.done, setup.out.display());
    }
    if ended.interrupted {
        let (code, signal) = stop.exit();
        if leader {
            println!(
                "{}",
                output::interrupted_line(
                    ended.done,
                    setup.steps,
                    ended.saved.as_deref(),
                    ended.last_eval,
                    setup.data.floor
                )
            );
        }
        let message = format!(
            "stopped by {signal}; continue with: zeroflow train --resume latest --out {}",
            setup.out.display()
        );
        return Err(Exit { code, message }.into());
    }
    if leader {
        println!("{}", output::final_line(ended.last_eval, setup.data.floor));
    }
    Ok(())
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
    /// A signal stopped the run (after `done`).
    interrupted: bool,
}

/// Rank 0's recorder (the others write nothing), after removing what an interrupted checkpoint
/// write left in the run directory, and when resuming setting aside damaged checkpoints.
fn open_recorder(setup: &Setup, leader: bool) -> anyhow::Result<Recorder> {
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
            checkpoints::set_aside(&point.damaged)?;
            let at = point.extra.step;
            tracing::info!("resuming from {} at step {at} of {}", point.dir.display(), setup.steps);
            Recorder::resume(&setup.out, at, setup.eval_every)
        }
        _ => Recorder::create(&setup.out),
    }
}

/// The training loop: every step, with its checkpoints and evaluations, until the last step or
/// a signal.
fn train_steps<M: Model>(
    setup: &mut Setup,
    trainer: &mut Trainer<M>,
    recorder: &mut Recorder,
    progress: &Progress,
    stop: &Stop,
) -> anyhow::Result<Ended> {
    // Off unless ZEROFLOW_STEP_TIMEOUT is set; ticked after each step, checkpoint and evaluation.
    let watchdog = zeroflow_train::dist::step_watchdog(&setup.dist)?;
    let tick = || watchdog.iter().for_each(zeroflow_train::dist::Watchdog::tick);
    let first = setup.start_step() + 1;
    let last_eval = recorder.eval.last().copied();
    let mut ended = Ended { done: first - 1, last_eval, saved: None, interrupted: false };
    if let Start::InitFrom { .. } = setup.start {
        let Some(loss) = trainer.evaluate(0, &setup.data.eval, stop, progress)? else {
            ended.interrupted = true;
            return Ok(ended);
        };
        recorder.eval(0, loss)?;
        progress.println(&output::eval_line(0, loss, setup.data.floor));
        ended.last_eval = Some((0, loss));
    }
    for step in first..=setup.steps {
        stop.at_step(step);
        progress.doing(|| format!("step {step}/{} running", setup.steps));
        let record = trainer.step(step, &mut setup.data.train)?;
        tick();
        recorder.step(&record)?;
        progress.step(&record);
        ended.done = step;
        // Every rank stops after the same step: a signal may reach the ranks at different times.
        let interrupted = trainer.group().any(stop.requested())?;
        let last = step == setup.steps;
        if last || interrupted || (setup.save_every > 0 && step.is_multiple_of(setup.save_every)) {
            // Saved before the flush below: the delayed update's pending weights are part of
            // the state, so a resumed run continues exactly as this one would have.
            ended.saved = Some(save_and_say(trainer, step, setup, progress)?);
            tick();
        }
        if interrupted {
            ended.interrupted = true;
            break;
        }
        if last {
            // The delayed update may still hold the last step's weights.
            trainer.engine.flush()?;
        }
        if last || (setup.eval_every > 0 && step.is_multiple_of(setup.eval_every)) {
            let Some(loss) = trainer.evaluate(step, &setup.data.eval, stop, progress)? else {
                // Abandoned for a signal: the run stops here, with a checkpoint of this step.
                if ended.saved.as_deref() != Some(checkpoints::step_dir(&setup.out, step).as_path())
                {
                    ended.saved = Some(save_and_say(trainer, step, setup, progress)?);
                }
                ended.interrupted = true;
                break;
            };
            tick();
            recorder.eval(step, loss)?;
            progress.println(&output::eval_line(step, loss, setup.data.floor));
            ended.last_eval = Some((step, loss));
        }
    }
    Ok(ended)
}

/// Saves the checkpoint of `step`, saying so.
fn save_and_say<M: Model>(
    trainer: &mut Trainer<M>,
    step: u64,
    setup: &Setup,
    progress: &Progress,
) -> anyhow::Result<PathBuf> {
    progress.doing(|| format!("saving the checkpoint of step {step}"));
    let saving = Instant::now();
    let dir = trainer.save(step, setup)?;
    let secs = saving.elapsed().as_secs_f64();
    progress.println(&format!("step {step}: saved {} in {secs:.1} s", dir.display()));
    Ok(dir)
}

/// `summary.json`. Its times: `wall_s` is the run's wall-clock time so far, every process that
/// trained it included (set-up, evaluations and checkpoints too; up to the checkpoint each resumed
/// from); `process_wall_s` is this process's; `train_s` the time in training steps alone, over the
/// whole run like `wall_s` (so `train_s` ≤ `wall_s`), which `tokens_per_s` divides by.
fn summary<M: Model>(
    setup: &Setup,
    trainer: &Trainer<M>,
    recorder: &Recorder,
    ended: &Ended,
    process_wall: Duration,
) -> serde_json::Value {
    let train_s = trainer.train_time.as_secs_f64();
    let tokens = ended.done * trainer.tokens_per_step;
    let (resumed_from, init_from) = match &setup.start {
        Start::Resume { point, .. } => (Some(point.dir.display().to_string()), None),
        Start::InitFrom { dir, .. } => (None, Some(dir.display().to_string())),
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
        "model": setup.model,
        "parameters": setup.model.num_params(),
        "resumed_from": resumed_from,
        "init_from": init_from,
        "checkpoints": checkpoints::list(&setup.out).ok().map(|all| {
            all.into_iter().map(|(_, dir)| dir.display().to_string()).collect::<Vec<_>>()
        }),
        "config_file": setup.config_file.as_ref().map(|p| p.display().to_string()),
        "config": setup.config.to_json(),
        "settings": trainer.settings.to_json(),
    })
}

fn log_start(setup: &Setup) {
    let (model, config) = (&setup.model, &setup.config);
    let batch = &config.batch;
    tracing::info!(
        "training {} parameters ({} layers, d_model {}) for {} steps of {} sequences of {} \
         tokens (micro-batch {}, accumulation {}), {}, ZeRO stage {}, {}, lr {} ({}); data: {}",
        model.num_params(),
        model.n_layer,
        model.d_model,
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
    );
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

/// The engine, the model on its device, and what a step needs.
struct Trainer<M: Model> {
    engine: ModelEngine<M>,
    model: M,
    device_description: String,
    /// The checkpoint's tensors: Hugging Face names over the flat buffer.
    tensors: Vec<NamedTensor>,
    schedule: LrSchedule,
    accum: u64,
    tokens_per_step: u64,
    /// Reused for every micro-batch.
    micro_batch: Batch,
    /// Time spent in training steps (evaluation excluded), over the whole run.
    train_time: Duration,
    /// The run's wall-clock time before this process: up to the checkpoint it resumed from.
    wall_before: Duration,
    /// When this process started the run.
    started: Instant,
    /// The side channel to the other ranks (taken for its last barrier at the end of the run).
    group: Option<Group>,
    /// The run-time settings in effect, for the summary and the checkpoints.
    settings: Effective,
}

impl<M: Model> Trainer<M> {
    fn new(setup: &Setup, open: impl backend::OpenFn<M>, started: Instant) -> anyhow::Result<Self> {
        let (model, config) = (&setup.model, &setup.config);
        let world = setup.dist.world_size;
        let layout = flat_layout(model, world).context("cannot lay out the model")?;
        let weights = match &setup.start {
            Start::Seed => {
                let mut weights = vec![0.0f32; layout.padded_len()];
                init_params(model, &layout, setup.seed, &mut weights)?;
                weights
            }
            Start::InitFrom { weights, .. } | Start::Resume { weights, .. } => weights.clone(),
        };
        let micro_batch = config.batch.micro_batch_size_per_gpu as usize;
        let backend::Opened { device, comm, model: gpt, group } =
            open(model, micro_batch, setup.seq, &layout, &setup.dist)?;
        let device_description = device.describe();
        // The ranks of one host share its cores: those near its GPU where bound.
        let threads = affinity::optimizer_threads(setup.cpu_binding.as_ref(), &setup.dist);
        // What the engine refuses at set-up is a combination the config asked for.
        let config_error = |e| match e {
            EngineError::Config(reason) => super::input(match &setup.config_file {
                Some(file) => format!("config {}: {reason}", file.display()),
                None => format!("the default config: {reason}"),
            }),
            other => other.into(),
        };
        let mut options = EngineOptions::from_config(config, threads).map_err(config_error)?;
        settings::apply_offload::<M::P>(&setup.settings, &mut options, setup.dist.rank)?;
        let settings = Effective::new(
            setup.device,
            setup.attention,
            &setup.settings,
            &options,
            <M::P as zeroflow_core::Element>::DTYPE,
            setup.cpu_binding.as_ref(),
        );
        // The synthetic corpus is one endless stream (its entropy floor is known): no epochs end.
        if options.zenflow().is_some_and(|z| z.select_epochs().is_some())
            && setup.data.floor.is_some()
        {
            tracing::warn!(
                "ZenFlow: select_strategy \"auto\"/\"epoch\" selects again when an epoch of the \
                 data ends, and the synthetic corpus has none: the columns selected at the first \
                 step are kept (select_strategy \"step\" with a select_interval reselects)"
            );
        }
        let convert =
            |weights: &[f32]| -> Vec<M::P> { weights.iter().map(|&w| M::P::from_f32(w)).collect() };
        let mut engine =
            Engine::with_weights(device, comm, layout.clone(), options, convert(&weights))
                .map_err(config_error)?;
        let (mut train_time, mut wall_before) = (Duration::ZERO, Duration::ZERO);
        if let Start::Resume { point, .. } = &setup.start {
            let meta = &point.loaded.meta;
            let restore = Restore {
                parts: &point.loaded.parts,
                optimizer_steps: meta.optimizer_steps,
                micro_steps: meta.micro_steps,
                upload_pending: meta.upload_pending,
                scaler: &meta.scaler,
                zenflow: &point.loaded.zenflow,
            };
            let restored = engine.restore(&convert(&weights), &restore);
            restored.map_err(|e| super::input(format!("--resume {}: {e}", point.dir.display())))?;
            train_time = Duration::from_secs_f64(point.extra.train_s.max(0.0));
            // Checkpoints from before wall_s was recorded: their training time, a lower bound.
            let wall = point.extra.wall_s.unwrap_or(point.extra.train_s);
            wall_before = Duration::from_secs_f64(wall.max(0.0));
        }
        let batch = config.batch.micro_batch_size_per_gpu;
        let accum = config.batch.gradient_accumulation_steps;
        Ok(Trainer {
            engine,
            model: gpt,
            device_description,
            tensors: super::checkpoints_tensors(&hf_tensors(model, &layout)?),
            schedule: LrSchedule::from_config(config),
            accum,
            tokens_per_step: accum * batch * setup.seq as u64 * world as u64,
            micro_batch: Batch::default(),
            train_time,
            wall_before,
            started,
            group: Some(group),
            settings,
        })
    }

    /// The run's wall-clock time so far, every process that trained it included.
    fn wall_time(&self) -> Duration {
        self.wall_before + self.started.elapsed()
    }

    fn group(&mut self) -> &mut Group {
        self.group.as_mut().expect("the group lives until the end of the run")
    }

    /// Saves the checkpoint of `step`: the engine's current device weights (not flushed), its
    /// optimizer state and counters, and what the trainer needs to continue ([`Extra`]). With
    /// several ranks, rank 0 writes the weights and `state.json` and each rank its optimizer part
    /// ([`checkpoints::save_ranks`]); every rank calls it at the same steps.
    fn save(&mut self, step: u64, setup: &Setup) -> anyhow::Result<PathBuf> {
        let snapshot = self.engine.snapshot()?;
        let (rank, world) = (setup.dist.rank, setup.dist.world_size);
        // Saved as f32 whatever the device trains in (bf16 and f16 widen exactly), so that every
        // checkpoint resumes and exports the same way. Every rank holds the same weights.
        let weights: Option<Vec<f32>> = if rank == 0 {
            let weights = self.engine.device().download(self.engine.params())?;
            Some(weights.into_iter().map(Float::to_f32).collect())
        } else {
            None
        };
        // Stages 1 and 2 partition the optimizer state, one part per rank; without partitioning
        // every rank holds all of it, and rank 0's copy is the checkpoint's one part.
        let parts =
            if snapshot.part.flat.len() < self.engine.layout().padded_len() { world } else { 1 };
        let meta = self.meta(step, setup, &snapshot, parts);
        if world == 1 {
            let weights = weights.expect("rank 0 downloads the weights");
            let (out, keep, tensors) = (&setup.out, setup.keep, &self.tensors);
            let zenflow: Vec<ZenFlowSnapshot> = snapshot.zenflow.iter().cloned().collect();
            let parts = [snapshot.part];
            let saved =
                checkpoints::save(out, step, keep, &meta, &weights, tensors, &parts, &zenflow);
            return Ok(saved?);
        }
        let share = checkpoints::Share {
            rank,
            weights: weights.as_deref(),
            part: (rank < parts).then_some(&snapshot.part),
            zenflow: snapshot.zenflow.as_ref().filter(|_| rank < parts),
        };
        let group = self.group.as_mut().expect("the group lives until the end of the run");
        Ok(checkpoints::save_ranks(
            &setup.out,
            step,
            setup.keep,
            &meta,
            &self.tensors,
            share,
            group,
        )?)
    }

    /// The checkpoint's `state.json`: the engine's counters and layout, `parts` optimizer parts,
    /// and the trainer's [`Extra`].
    fn meta(&self, step: u64, setup: &Setup, snapshot: &Snapshot, parts: usize) -> Meta {
        let extra = Extra {
            model: ModelSpec::Gpt2(setup.model),
            config: setup.config.to_json(),
            data: setup.data_arg.clone(),
            data_files: setup.data_files.clone(),
            data_position: setup.data.train.position(),
            seed: setup.seed,
            step,
            lr_schedule: LrPosition { iteration: step, next_lr: self.schedule.lr(step) },
            train_s: self.train_time.as_secs_f64(),
            wall_s: Some(self.wall_time().as_secs_f64()),
            settings: self.settings.to_json(),
            run: RunInfo {
                zeroflow_version: env!("CARGO_PKG_VERSION").to_owned(),
                config_file: setup.config_file.as_ref().map(|p| p.display().to_string()),
                data_description: setup.data.description.clone(),
                init_from: match &setup.start {
                    Start::InitFrom { dir, .. } => Some(dir.display().to_string()),
                    _ => None,
                },
                steps: setup.steps,
                eval_every: setup.eval_every,
            },
        };
        Meta {
            format: checkpoint::FORMAT.into(),
            version: checkpoint::VERSION,
            optimizer_steps: snapshot.optimizer_steps,
            micro_steps: snapshot.micro_steps,
            // The number of optimizer parts, which `checkpoint::load` reads back.
            world_size: parts,
            scaler: snapshot.scaler.clone(),
            upload_pending: snapshot.upload_pending,
            weights_dtype: "F32".into(),
            params: self
                .engine
                .layout()
                .params()
                .iter()
                .map(|p| ParamEntry {
                    name: p.name.clone(),
                    shape: p.shape.clone(),
                    offset: p.offset,
                })
                .collect(),
            extra: serde_json::to_value(&extra).expect("serialisable"),
        }
    }

    /// Optimizer step `step` (from 1): its micro-batches' forward and backward, then the update.
    fn step(&mut self, step: u64, data: &mut DataLoader) -> anyhow::Result<StepRecord> {
        let start = Instant::now();
        self.engine.set_lr(self.schedule.lr(step - 1))?;
        // What the optimizer step uses, as the engine holds it.
        let lr = self.engine.lr();
        let mut loss_sum = 0.0;
        let mut report = StepReport::Accumulated;
        let epoch = data.position().epoch;
        for _ in 0..self.accum {
            data.next_into(&mut self.micro_batch)
                .map_err(|e| super::input(format!("--data: {e}")))?;
            self.model.set_batch(&self.micro_batch.inputs, &self.micro_batch.targets)?;
            forward_backward(&mut self.engine, &mut self.model)?;
            loss_sum += f64::from(self.model.loss()?);
            report = self.engine.step()?;
        }
        // Every rank reads the same stream positions, so every rank reports the same epochs
        // (ZenFlow's epoch-based selection counts them).
        for _ in epoch..data.position().epoch {
            self.engine.end_epoch();
        }
        self.train_time += start.elapsed();
        // The mean over every rank's micro-batches (the ranks' batches are the same size), so that
        // every rank sees the same loss and the log reads as one process with the global batch.
        let local_loss = loss_sum / self.accum as f64;
        let loss = self.group().mean(local_loss)?;
        if !loss.is_finite() {
            anyhow::bail!("the training loss is {loss} at step {step}; try a smaller --lr");
        }
        let (grad_norm, loss_scale) = match report {
            StepReport::Stepped { grad_norm, loss_scale, .. } => (Some(grad_norm), loss_scale),
            StepReport::Skipped { loss_scale } => (None, loss_scale),
            StepReport::Accumulated => unreachable!("the last micro-step of a window steps"),
        };
        let tokens = step * self.tokens_per_step;
        let tokens_per_s = tokens as f64 / self.train_time.as_secs_f64();
        Ok(StepRecord { step, loss, lr, grad_norm, loss_scale, tokens_per_s })
    }

    /// The mean loss over the evaluation set (every rank's slice) with the engine's current
    /// weights after step `after`; `None` where a signal (on any rank) abandoned it.
    fn evaluate(
        &mut self,
        after: u64,
        eval: &[Batch],
        stop: &Stop,
        progress: &Progress,
    ) -> anyhow::Result<Option<f64>> {
        // The forward below runs on the compute stream outside the engine's backward, so nothing
        // orders it after the weights' last writer (the comm stream's all-gather with several
        // ranks, the upload with offload): wait for every stream. Evaluation is rare.
        self.engine.device().synchronize()?;
        let mut sum = 0.0;
        let mut evaluated = 0;
        for (i, batch) in eval.iter().enumerate() {
            if stop.requested() {
                break;
            }
            progress
                .doing(|| format!("evaluating after step {after}: batch {}/{}", i + 1, eval.len()));
            self.model.set_batch(&batch.inputs, &batch.targets)?;
            self.model.forward(self.engine.params())?;
            sum += f64::from(self.model.loss()?);
            evaluated += 1;
        }
        // Every rank abandons it where one did.
        if self.group().any(evaluated < eval.len())? {
            return Ok(None);
        }
        // Every rank evaluated its slice of the same set: the mean is the whole set's loss.
        let local = sum / eval.len() as f64;
        Ok(Some(self.group().mean(local)?))
    }
}

/// One micro-step's forward and backward through the engine. The model reports each group of
/// finished gradients to the engine as backward queues it.
pub(crate) fn forward_backward<M: Model>(
    engine: &mut ModelEngine<M>,
    model: &mut M,
) -> anyhow::Result<()> {
    engine.backward(|io, grads_ready| -> anyhow::Result<()> {
        // The model's callback cannot fail: the engine's first error is kept and returned.
        let mut engine_error: Option<EngineError> = None;
        model.forward(io.params)?;
        model.backward(io.params, io.grads, f64::from(io.loss_scale), &mut |ready| {
            if engine_error.is_none() {
                engine_error = grads_ready(ready.flat_range.clone()).err();
            }
        })?;
        engine_error.map_or(Ok(()), |e| Err(e.into()))
    })
}
