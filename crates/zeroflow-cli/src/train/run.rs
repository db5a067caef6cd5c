//! The training loop: one rank, the model (on the CPU device or a GPU) driven through the ZeRO
//! engine.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::json;
use signal_hook::consts::{SIGINT, SIGTERM};
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
use super::output::{Progress, Recorder, StepRecord};
use super::schedule::LrSchedule;
use super::{DeviceKind, Setup, Start};
use crate::dist::{Group, affinity};
use crate::settings::{self, Effective};

pub(crate) type ModelEngine<M> = Engine<<M as Model>::Device, <M as Model>::Comm, <M as Model>::P>;

/// Trains as `setup` says (from its start: fresh, `--init-from` or `--resume`), saves
/// checkpoints, writes the metrics, plot and summary, and prints the final evaluation loss (next
/// to the entropy floor where it is known). SIGINT or SIGTERM ends the run after the current step
/// with a checkpoint and the summary; a second one exits at once with code 130.
pub fn run(setup: Setup) -> anyhow::Result<()> {
    match setup.device {
        DeviceKind::Cpu => run_on(setup, backend::open_cpu),
        DeviceKind::Cuda => {
            let device = settings::cuda_device_options(&setup.settings);
            let open = backend::CudaOpen { device, attention: setup.attention };
            run_on(setup, open.opener())
        }
    }
}

pub(super) fn run_on<M: Model>(
    mut setup: Setup,
    open: impl backend::OpenFn<M>,
) -> anyhow::Result<()> {
    let start = Instant::now();
    let mut trainer = Trainer::<M>::new(&setup, open)?;
    // Caught from here on: before, there is nothing to save, and a signal must end a rank that
    // waits at the rendezvous or in NCCL's initialisation (the launcher stopping a failed job).
    let stop = stop_on_signals()?;
    // Off unless ZEROFLOW_STEP_TIMEOUT is set; ticked after each step, checkpoint and evaluation.
    let watchdog = crate::dist::step_watchdog(&setup.dist)?;
    let tick = || watchdog.iter().for_each(crate::dist::Watchdog::tick);
    // Rank 0 writes the metrics, the plot, the summary and the progress; every rank trains.
    let leader = setup.dist.rank == 0;
    if leader {
        log_start(&setup);
    }
    let first = setup.start_step() + 1;
    let mut recorder = match &setup.start {
        _ if !leader => Recorder::discard(&setup.out),
        Start::Resume { point, .. } => {
            checkpoints::set_aside(&point.damaged)?;
            tracing::info!("resuming from {} at step {}", point.dir.display(), first - 1);
            settings::warn_on_resume(&point.extra.settings, &trainer.settings, &point.dir);
            Recorder::resume(&setup.out, first - 1, setup.eval_every)?
        }
        _ => Recorder::create(&setup.out)?,
    };
    let progress =
        if leader { Progress::new(setup.steps, setup.log_every) } else { Progress::Silent };
    let mut eval_loss = recorder.eval.last().map_or(f64::NAN, |&(_, loss)| loss);
    if let Start::InitFrom { .. } = setup.start {
        eval_loss = trainer.evaluate(&setup.data.eval)?;
        recorder.eval(0, eval_loss)?;
        progress.println(&eval_line(0, eval_loss, setup.data.floor));
    }
    let mut done = first - 1;
    for step in first..=setup.steps {
        let record = trainer.step(step, &mut setup.data.train)?;
        tick();
        recorder.step(&record)?;
        progress.step(&record);
        done = step;
        // Every rank stops after the same step: a signal may reach the ranks at different times.
        let interrupted = trainer.group().any(stop.load(Ordering::Relaxed))?;
        let last = step == setup.steps || interrupted;
        if last || (setup.save_every > 0 && step.is_multiple_of(setup.save_every)) {
            // Saved before the flush below: the delayed update's pending weights are part of
            // the state, so a resumed run continues exactly as this one would have.
            let dir = trainer.save(step, &setup)?;
            tick();
            progress.println(&format!("step {step}: saved {}", dir.display()));
        }
        if interrupted {
            progress.println(&format!("interrupted: stopped after step {step}"));
            break;
        }
        if last {
            // The delayed update may still hold the last step's weights.
            trainer.engine.flush()?;
        }
        if last || (setup.eval_every > 0 && step.is_multiple_of(setup.eval_every)) {
            eval_loss = trainer.evaluate(&setup.data.eval)?;
            tick();
            recorder.eval(step, eval_loss)?;
            progress.println(&eval_line(step, eval_loss, setup.data.floor));
        }
    }
    progress.finish();
    // The last barrier: from here a rank's process ending is the job ending, not a lost rank.
    trainer.group.take().expect("the group is taken once, here").finish()?;
    if !leader {
        return Ok(());
    }
    let summary = summary(&setup, &trainer, &recorder, done, eval_loss, start.elapsed());
    recorder.finish(setup.data.floor, &summary)?;
    tracing::info!("{done} steps; wrote {}", setup.out.display());
    println!("{}", final_line(eval_loss, setup.data.floor));
    Ok(())
}

/// A flag that the first SIGINT or SIGTERM sets; the second exits the process with code 130.
fn stop_on_signals() -> anyhow::Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        // Registered first, so it sees the flag as the previous signal left it.
        signal_hook::flag::register_conditional_shutdown(signal, 130, Arc::clone(&stop))
            .context("cannot handle signals")?;
        signal_hook::flag::register(signal, Arc::clone(&stop)).context("cannot handle signals")?;
    }
    Ok(stop)
}

fn summary<M: Model>(
    setup: &Setup,
    trainer: &Trainer<M>,
    recorder: &Recorder,
    done: u64,
    eval_loss: f64,
    wall: Duration,
) -> serde_json::Value {
    let train_s = trainer.train_time.as_secs_f64();
    let tokens = done * trainer.tokens_per_step;
    let (resumed_from, init_from) = match &setup.start {
        Start::Resume { point, .. } => (Some(point.dir.display().to_string()), None),
        Start::InitFrom { dir, .. } => (None, Some(dir.display().to_string())),
        Start::Seed => (None, None),
    };
    json!({
        "final_eval_loss": eval_loss,
        "entropy_floor": setup.data.floor,
        "over_floor": setup.data.floor.map(|floor| eval_loss / floor - 1.0),
        "final_train_loss": recorder.train.last().map(|&(_, loss)| loss),
        "steps": done,
        "interrupted": done < setup.steps,
        "tokens": tokens,
        "tokens_per_s": tokens as f64 / train_s,
        "wall_s": wall.as_secs_f64(),
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
         tokens (micro-batch {}, accumulation {}), ZeRO stage {}, lr {} ({}); data: {}",
        model.num_params(),
        model.n_layer,
        model.d_model,
        setup.steps,
        batch.train_batch_size,
        model.context,
        batch.micro_batch_size_per_gpu,
        batch.gradient_accumulation_steps,
        config.zero.stage.number(),
        config.optimizer.lr,
        config.scheduler.map_or("constant", |s| s.type_name()),
        setup.data.description,
    );
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
    /// Time spent in training steps (evaluation excluded).
    train_time: Duration,
    /// The side channel to the other ranks (taken for its last barrier at the end of the run).
    group: Option<Group>,
    /// The run-time settings in effect, for the summary and the checkpoints.
    settings: Effective,
}

impl<M: Model> Trainer<M> {
    fn new(setup: &Setup, open: impl backend::OpenFn<M>) -> anyhow::Result<Self> {
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
            open(model, micro_batch, &layout, &setup.dist)?;
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
        let mut train_time = Duration::ZERO;
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
            tokens_per_step: accum * batch * model.context as u64 * world as u64,
            micro_batch: Batch::default(),
            train_time,
            group: Some(group),
            settings,
        })
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
            return checkpoints::save(out, step, keep, &meta, &weights, tensors, &parts, &zenflow);
        }
        let share = checkpoints::Share {
            rank,
            weights: weights.as_deref(),
            part: (rank < parts).then_some(&snapshot.part),
            zenflow: snapshot.zenflow.as_ref().filter(|_| rank < parts),
        };
        let group = self.group.as_mut().expect("the group lives until the end of the run");
        checkpoints::save_ranks(&setup.out, step, setup.keep, &meta, &self.tensors, share, group)
    }

    /// The checkpoint's `state.json`: the engine's counters and layout, `parts` optimizer parts,
    /// and the trainer's [`Extra`].
    fn meta(&self, step: u64, setup: &Setup, snapshot: &Snapshot, parts: usize) -> Meta {
        let extra = Extra {
            model: setup.model,
            config: setup.config.to_json(),
            data: setup.data_arg.clone(),
            data_position: setup.data.train.position(),
            seed: setup.seed,
            step,
            lr_schedule: LrPosition { iteration: step, next_lr: self.schedule.lr(step) },
            train_s: self.train_time.as_secs_f64(),
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
    /// weights.
    fn evaluate(&mut self, eval: &[Batch]) -> anyhow::Result<f64> {
        // The forward below runs on the compute stream outside the engine's backward, so nothing
        // orders it after the weights' last writer (the comm stream's all-gather with several
        // ranks, the upload with offload): wait for every stream. Evaluation is rare.
        self.engine.device().synchronize()?;
        let mut sum = 0.0;
        for batch in eval {
            self.model.set_batch(&batch.inputs, &batch.targets)?;
            self.model.forward(self.engine.params())?;
            sum += f64::from(self.model.loss()?);
        }
        // Every rank evaluated its slice of the same set: the mean is the whole set's loss.
        let local = sum / eval.len() as f64;
        Ok(self.group().mean(local)?)
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

fn eval_line(step: u64, eval_loss: f64, floor: Option<f64>) -> String {
    match floor {
        Some(floor) => format!(
            "step {step}: eval loss {eval_loss:.4} ({:+.1}% over the floor {floor:.4})",
            100.0 * (eval_loss / floor - 1.0)
        ),
        None => format!("step {step}: eval loss {eval_loss:.4}"),
    }
}

/// The line a run ends with, e.g. `final eval loss 1.12 nats/token; entropy floor 1.09 (+2.6%)`.
fn final_line(eval_loss: f64, floor: Option<f64>) -> String {
    match floor {
        Some(floor) => format!(
            "final eval loss {eval_loss:.3} nats/token; entropy floor {floor:.3} ({:+.1}%)",
            100.0 * (eval_loss / floor - 1.0)
        ),
        None => format!("final eval loss {eval_loss:.3} nats/token"),
    }
}
