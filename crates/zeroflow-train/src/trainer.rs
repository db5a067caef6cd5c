//! One rank's trainer: the engine, the family's model on its device, and what a step, an
//! evaluation and a checkpoint need (`Trainer`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Element as _, Float};
use zeroflow_data::{Batch, DataLoader};
use zeroflow_device::Device as _;
use zeroflow_engine::checkpoint::{self, Meta, NamedTensor, ParamEntry, PartFile};
use zeroflow_engine::{Engine, EngineError, EngineOptions, Restore, StepReport};

use crate::checkpoints;
use crate::dist::{Group, affinity};
use crate::error::{Result, TrainError, input};
use crate::metrics::StepRecord;
use crate::observer::{Activity, StopHandle, TrainObserver};
use crate::open::OpenFn;
use crate::resume_point::{Extra, LrPosition, RunInfo};
use crate::schedule::LrSchedule;
use crate::settings::{self, Effective};
use crate::setup::{Setup, Start};
use crate::{Family, Model, Opened};

/// The engine a model of `M` is trained through.
pub type ModelEngine<M> = Engine<<M as Model>::Device, <M as Model>::Comm, <M as Model>::P>;

/// The engine, the model on its device, and what a step needs.
pub(crate) struct Trainer<M: Model> {
    pub(crate) engine: ModelEngine<M>,
    model: M,
    pub(crate) device_description: String,
    /// The checkpoint's tensors: Hugging Face names over the flat buffer.
    tensors: Vec<NamedTensor>,
    schedule: LrSchedule,
    pub(crate) tokens_per_step: u64,
    /// Optimizer steps per epoch of the training data, where it has epochs (files; not the
    /// synthetic corpus): a step's `epoch` is its count over this.
    steps_per_epoch: Option<f64>,
    /// The micro-batches of a step, reused.
    micro_batches: Vec<Batch>,
    /// Ranks in the job.
    world: usize,
    /// Whether the training data carries loss masks (the counted targets then differ between
    /// micro-batches and are summed over the step's, on every rank).
    masked: bool,
    /// Time spent in training steps (evaluation excluded), over the whole run.
    pub(crate) train_time: Duration,
    /// The run's wall-clock time before this process: up to the checkpoint it resumed from.
    pub(crate) wall_before: Duration,
    /// When this process started the run.
    started: Instant,
    /// The side channel to the other ranks (taken for its last barrier at the end of the run).
    pub(crate) group: Option<Group>,
    /// The run-time settings in effect, for the summary and the checkpoints.
    pub(crate) settings: Effective,
}

impl<M: Model> Trainer<M> {
    /// Builds the engine from `setup`, taking the weights (and a resumed checkpoint's optimizer
    /// state) out of it once the engine holds them: nothing of the model is kept twice in host
    /// memory for the run.
    pub(crate) fn new<F: Family>(
        setup: &mut Setup,
        family: &F,
        open: impl OpenFn<F, M>,
        started: Instant,
    ) -> Result<Self> {
        if let Start::Resume { point, .. } = &setup.start {
            let stored = point.loaded.weights_dtype;
            if !checkpoint::weights_convert_exactly::<M::P>(stored) {
                return Err(input(format!(
                    "--resume {}: its weights are {stored} and this run trains in {}, which would \
                     round them; resume with the precision it was saved with",
                    point.dir.display(),
                    M::P::DTYPE
                )));
            }
        }
        let world = setup.dist.world_size;
        let layout = family.flat_layout(world)?;
        // The weights in the model's element type, drawn or read straight into it: no f32 copy
        // (4 B per parameter) at a large model's host peak.
        let initial: Vec<M::P> = setup.start.weights(setup.seed, family, &layout)?;
        let setup = &*setup;
        let config = &setup.config;
        let micro_batch = config.batch.micro_batch_size_per_gpu as usize;
        let Opened { device, comm, model: gpt, group } =
            open(family, micro_batch, setup.seq, &layout, &setup.dist)?;
        let device_description = device.describe();
        device.pinned_budget().set_limit(settings::pinned_budget(&setup.settings));
        let (options, settings) = engine_options::<M::P>(setup)?;
        let mut engine = Engine::with_weights(device, comm, layout.clone(), options, initial)
            .map_err(|e| config_error(setup, e))?;
        let (mut train_time, mut wall_before) = (Duration::ZERO, Duration::ZERO);
        if let Start::Resume { point, .. } = &setup.start {
            let meta = &point.loaded.meta;
            // The optimizer state is read from the checkpoint's files a piece at a time into the
            // engine's own (no second copy of it at the peak of a resume).
            let restore = Restore {
                parts: point.loaded.parts.as_slice().into(),
                optimizer_steps: meta.optimizer_steps,
                micro_steps: meta.micro_steps,
                upload_pending: meta.upload_pending,
                scaler: &meta.scaler,
                zenflow: &point.loaded.zenflow,
            };
            let bytes = point.loaded.parts.iter().map(PartFile::file_bytes).sum();
            let (bytes, started) = (checkpoint::disk_size(bytes), Instant::now());
            tracing::info!("reading the checkpoint's optimizer state ({bytes})");
            // The engine was built with the checkpoint's weights: they are not given twice.
            let restored = engine.restore(None, restore);
            restored.map_err(|e| input(format!("--resume {}: {e}", point.dir.display())))?;
            let seconds = started.elapsed().as_secs_f64();
            tracing::info!("restored the checkpoint's optimizer state ({bytes}) in {seconds:.1} s");
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
            tensors: family.tensors(&layout)?,
            schedule: LrSchedule::from_config(config),
            tokens_per_step: accum * batch * setup.seq as u64 * world as u64,
            steps_per_epoch: setup.data.epoch_steps(accum),
            micro_batches: vec![Batch::default(); accum as usize],
            world,
            masked: setup.data.train.masked(),
            train_time,
            wall_before,
            started,
            group: Some(group),
            settings,
        })
    }

    /// The run's wall-clock time so far, every process that trained it included.
    pub(crate) fn wall_time(&self) -> Duration {
        self.wall_before + self.started.elapsed()
    }

    pub(crate) fn group(&mut self) -> &mut Group {
        self.group.as_mut().expect("the group lives until the end of the run")
    }

    /// The engine's current device weights as f32, in its flat layout (the weights a checkpoint
    /// of this step saves; waits for the device, and for a step left to the next forward).
    pub(crate) fn host_weights(&mut self) -> Result<(Vec<f32>, &FlatLayout)> {
        self.engine.complete_step()?;
        use zeroflow_device::DeviceBuffer as _;
        let (device, params) = (self.engine.device(), self.engine.params());
        // Converted a piece at a time as it comes down: the host holds the f32 weights and one
        // piece, not a whole copy in the device's type beside them.
        const PIECE: usize = 16 << 20;
        let (mut weights, mut staging) = (Vec::with_capacity(params.len()), None);
        for start in (0..params.len()).step_by(PIECE) {
            let range = start..(start + PIECE).min(params.len());
            let piece = device.download_range_via(params, range, &mut staging)?;
            weights.extend(piece.into_iter().map(Float::to_f32));
        }
        Ok((weights, self.engine.layout()))
    }

    /// Writes the engine's current device weights (a delayed update's pending ones not applied:
    /// [`Engine::flush`] first) as the Hugging Face directory `dir` of `family`, with the
    /// tokenizer files of `tokenizer`: fetched from the device a piece at a time as they are
    /// written, in the type the model trains in ([`crate::export::write_hf_dir`]).
    pub(crate) fn export<F: Family>(
        &mut self,
        family: &F,
        dir: &std::path::Path,
        tokenizer: zeroflow_hf::TokenizerSource<'_>,
    ) -> Result<zeroflow_hf::Saved> {
        self.engine.complete_step()?;
        let (device, params) = (self.engine.device(), self.engine.params());
        let len = self.engine.layout().padded_len();
        let weights = checkpoint::Elements::downloaded(device, params, len);
        crate::export::write_hf_dir(dir, &family.hf_config(), &weights, &self.tensors, tokenizer)
    }

    /// Saves the checkpoint of `step`: the engine's current device weights (not flushed), its
    /// optimizer state and counters, and what the trainer needs to continue ([`Extra`]). With
    /// several ranks, rank 0 writes the weights and `state.json` and each rank its optimizer part
    /// ([`checkpoints::save_ranks`]); every rank calls it at the same steps.
    pub(crate) fn save(
        &mut self,
        step: u64,
        setup: &Setup,
        room: Option<checkpoints::ExportRoom<'_>>,
    ) -> Result<PathBuf> {
        let (rank, world) = (setup.dist.rank, setup.dist.world_size);
        let (params, extra) = (self.param_entries(), self.extra(step, setup));
        let padded = self.engine.layout().padded_len();
        // The optimizer state as it lies (lent where it is in host memory) and the weights, fetched
        // from the device a piece at a time as they are written. The weights are stored in the
        // type the model trains in (bf16 on a GPU: 2 bytes per parameter, not the 4 of f32,
        // whose fp32 master weights are in the optimizer parts beside them); every rank holds
        // the same weights.
        let state = self.engine.checkpoint_state()?;
        // Stages 1 and 2 partition the optimizer state, one part per rank; without partitioning
        // every rank holds all of it, and rank 0's copy is the checkpoint's one part.
        let parts = if state.part.flat.len() < padded { world } else { 1 };
        let meta = Meta {
            format: checkpoint::FORMAT.into(),
            version: checkpoint::VERSION,
            optimizer_steps: state.optimizer_steps,
            micro_steps: state.micro_steps,
            // The number of optimizer parts, which `checkpoint::load` reads back.
            world_size: parts,
            scaler: state.scaler.clone(),
            upload_pending: state.upload_pending,
            weights_dtype: M::P::DTYPE.name().into(),
            optimizer_state_dtype: state.moments.name().into(),
            params,
            extra,
        };
        if world == 1 {
            let (out, keep, tensors) = (&setup.out, setup.keep, &self.tensors);
            let parts = [state.part];
            let weights = &state.weights;
            let saved = checkpoints::save(out, step, keep, &meta, weights, tensors, &parts, room);
            return Ok(saved?);
        }
        let share = checkpoints::Share {
            rank,
            weights: (rank == 0).then_some(&state.weights),
            part: (rank < parts).then_some(&state.part),
        };
        let group = self.group.as_mut().expect("the group lives until the end of the run");
        Ok(checkpoints::save_ranks(
            &setup.out,
            step,
            setup.keep,
            &meta,
            &self.tensors,
            share,
            room,
            group,
        )?)
    }

    /// The trainer's [`Extra`] of a checkpoint of `step`, as `state.json` holds it.
    fn extra(&self, step: u64, setup: &Setup) -> serde_json::Value {
        let extra = Extra {
            model: setup.model.clone(),
            config: setup.config.to_json(),
            data: setup.data_arg.clone(),
            data_files: setup.data_files.clone(),
            data_position: setup.data.train.position(),
            eval_data: setup.eval_data.clone(),
            eval_tokens: setup.eval_tokens,
            documents_held_out: Some(setup.documents_held_out),
            chat_template: setup.chat_template.clone(),
            chat_template_kwargs: setup.chat_template_kwargs.clone(),
            seq: Some(setup.seq as u64),
            seed: setup.seed,
            step,
            lr_schedule: LrPosition { iteration: step, next_lr: self.schedule.lr(step) },
            train_s: self.train_time.as_secs_f64(),
            wall_s: Some(self.wall_time().as_secs_f64()),
            settings: self.settings.to_json(),
            decay_skips_1d: true,
            steering: setup.steering.clone(),
            shuffle: Some(setup.data.train.is_shuffled()),
            run: RunInfo {
                zeroflow_version: env!("CARGO_PKG_VERSION").to_owned(),
                config_file: setup.config_file.as_ref().map(|p| p.display().to_string()),
                data_description: setup.data.description.clone(),
                // Resolved (`export` copies its tokenizer files from any directory), and kept
                // across a resume.
                init_from: match &setup.start {
                    Start::InitFrom { hf } => Some(
                        std::fs::canonicalize(&hf.dir)
                            .unwrap_or(hf.dir.clone())
                            .display()
                            .to_string(),
                    ),
                    Start::Resume { point, .. } => point.extra.run.init_from.clone(),
                    Start::Seed => None,
                },
                steps: setup.steps,
                eval_every: setup.eval_every,
            },
        };
        serde_json::to_value(&extra).expect("serialisable")
    }

    /// The layout's parameters, as `state.json` lists them.
    fn param_entries(&self) -> Vec<ParamEntry> {
        let params = self.engine.layout().params().iter();
        params
            .map(|p| ParamEntry { name: p.name.clone(), shape: p.shape.clone(), offset: p.offset })
            .collect()
    }

    /// Optimizer step `step` (from 1): its micro-batches' forward and backward, then the update.
    ///
    /// The objective is the mean loss over the targets that count in the whole step (every
    /// micro-batch of every rank; all of them without a loss mask), as transformers normalises
    /// gradient accumulation: each micro-batch's backward is weighted by its share of the
    /// counted targets ([`Trainer::counted_weight`]). A step with nothing counted has zero
    /// gradients and reports a loss of 0.
    pub(crate) fn step(&mut self, step: u64, data: &mut DataLoader) -> Result<StepRecord> {
        let start = Instant::now();
        self.engine.set_lr(self.schedule.lr(step - 1))?;
        // What the optimizer step uses, as the engine holds it.
        let lr = self.engine.lr();
        let mut report = StepReport::Accumulated;
        let epoch = data.position().epoch;
        let mut batches = std::mem::take(&mut self.micro_batches);
        for batch in &mut batches {
            data.next_into(batch).map_err(|e| input(format!("--data: {e}")))?;
        }
        let (weight, counted) = self.counted_weight(&batches)?;
        // Σ over this rank's micro-batches of (mean loss × counted targets), and of the means.
        let (mut loss_sum, mut mean_sum) = (0.0, 0.0);
        for batch in &batches {
            self.model
                .set_batch(&batch.inputs, &batch.targets, batch.positions())
                .map_err(TrainError::model)?;
            forward_backward(&mut self.engine, &mut self.model, weight)?;
            let mean = f64::from(self.model.loss().map_err(TrainError::model)?);
            loss_sum += mean * batch.counted() as f64;
            mean_sum += mean;
            report = self.engine.step()?;
        }
        self.micro_batches = batches;
        // Every rank reads the same stream positions, so every rank reports the same epochs
        // (ZenFlow's epoch-based selection counts them).
        for _ in epoch..data.position().epoch {
            self.engine.end_epoch();
        }
        self.train_time += start.elapsed();
        // The mean over every rank's counted targets, so that every rank sees the same loss and
        // the log reads as one process with the global batch. Without a mask every micro-batch
        // counts alike: the mean of the means, computed as it always was.
        let loss = if !self.masked {
            let accum = self.micro_batches.len() as f64;
            self.group().mean(mean_sum / accum)?
        } else if counted > 0.0 {
            self.group().mean(loss_sum)? * self.world as f64 / counted
        } else {
            0.0
        };
        if !loss.is_finite() {
            return Err(TrainError::NonFiniteLoss { loss, step });
        }
        let (grad_norm, loss_scale) = match report {
            StepReport::Stepped { grad_norm, loss_scale, .. } => (Some(grad_norm), loss_scale),
            StepReport::Skipped { loss_scale } => (None, loss_scale),
            StepReport::Accumulated => unreachable!("the last micro-step of a window steps"),
        };
        let tokens = step * self.tokens_per_step;
        let tokens_per_s = tokens as f64 / self.train_time.as_secs_f64();
        let speculation = self.engine.speculation_stats();
        let epoch = self.steps_per_epoch.filter(|&steps| steps > 0.0).map(|e| step as f64 / e);
        Ok(StepRecord { step, loss, lr, grad_norm, loss_scale, tokens_per_s, speculation, epoch })
    }

    /// The weight of each micro-batch's backward, and the targets that count in the step (all
    /// ranks). A model's backward is the gradient of its micro-batch's summed loss over all its
    /// `positions` (ignored targets lose 0) divided by `positions`, times the weight; the engine
    /// averages over the step's `accum × world` micro-batches; so `weight = positions × accum ×
    /// world / counted` makes every counted target's gradient `1 / counted`: the weight is
    /// exactly 1 without a loss mask, and 0 where nothing counts.
    fn counted_weight(&mut self, batches: &[Batch]) -> Result<(f64, f64)> {
        let local: usize = batches.iter().map(Batch::counted).sum();
        let counted = if self.masked {
            self.group().mean(local as f64)? * self.world as f64
        } else {
            (local * self.world) as f64
        };
        let positions = batches.first().map_or(0, |b| b.targets.len());
        let all = (positions * batches.len() * self.world) as f64;
        Ok((if counted > 0.0 { all / counted } else { 0.0 }, counted))
    }

    /// The mean loss over the evaluation set (every rank's slice) with the engine's current
    /// weights after step `after`; `None` where a signal (on any rank) abandoned it.
    pub(crate) fn evaluate(
        &mut self,
        after: u64,
        eval: &[Batch],
        stop: &StopHandle,
        observer: &mut dyn TrainObserver,
    ) -> Result<Option<f64>> {
        // The forward below runs on the compute stream outside the engine's backward, so nothing
        // orders it after the weights' last writer (the comm stream's all-gather with several
        // ranks, the upload with offload): wait for every stream, after the CPU work of a step
        // left to the next forward. Evaluation is rare.
        self.engine.complete_step()?;
        self.engine.device().synchronize()?;
        // Σ (mean loss × counted targets) and Σ counted targets: the mean over the whole set's
        // counted targets (the padding of the last micro-batches counts for nothing).
        let (mut sum, mut counted) = (0.0, 0.0);
        let mut evaluated = 0;
        for (i, batch) in eval.iter().enumerate() {
            if stop.requested() {
                break;
            }
            observer.doing(Activity::Evaluating { after, batch: i + 1, batches: eval.len() });
            self.model
                .set_batch(&batch.inputs, &batch.targets, batch.positions())
                .map_err(TrainError::model)?;
            self.model.forward(self.engine.params()).map_err(TrainError::model)?;
            let mean = f64::from(self.model.loss().map_err(TrainError::model)?);
            sum += mean * batch.counted() as f64;
            counted += batch.counted() as f64;
            evaluated += 1;
        }
        // Every rank abandons it where one did.
        if self.group().any(evaluated < eval.len())? {
            return Ok(None);
        }
        // Every rank evaluated its slice of the same set (Data::open checked that some of it
        // counts).
        let (sum, counted) = (self.group().mean(sum)?, self.group().mean(counted)?);
        Ok(Some(if counted > 0.0 { sum / counted } else { 0.0 }))
    }
}

/// The engine's options for parameters of type `P` (the config's, tuned by the run-time
/// settings), and the settings in effect.
fn engine_options<P: Float>(setup: &Setup) -> Result<(EngineOptions, Effective)> {
    // The ranks of one host share its cores: those near its GPU where bound.
    let threads = affinity::optimizer_threads(setup.cpu_binding.as_ref(), &setup.dist);
    let mut options =
        EngineOptions::from_config(&setup.config, threads).map_err(|e| config_error(setup, e))?;
    settings::apply_offload::<P>(&setup.settings, &mut options, setup.dist.rank)?;
    let settings = Effective::new(
        setup.device,
        setup.attention,
        &setup.settings,
        &options,
        P::DTYPE,
        setup.cpu_binding.as_ref(),
    );
    // The synthetic corpus is one endless stream (its entropy floor is known): no epochs end.
    if options.zenflow().is_some_and(|z| z.select_epochs().is_some()) && setup.data.floor.is_some()
    {
        tracing::warn!(
            "ZenFlow: select_strategy \"auto\"/\"epoch\" selects again when an epoch of the data \
             ends, and the synthetic corpus has none: the columns selected at the first step are \
             kept (select_strategy \"step\" with a select_interval reselects)"
        );
    }
    Ok((options, settings))
}

/// What the engine refuses at set-up is a combination the config asked for.
fn config_error(setup: &Setup, e: EngineError) -> TrainError {
    match e {
        EngineError::Config(reason) => input(match &setup.config_file {
            Some(file) => format!("config {}: {reason}", file.display()),
            None => format!("the default config: {reason}"),
        }),
        other => other.into(),
    }
}

/// One micro-step's forward and backward through the engine, the gradients scaled by `weight`
/// (1: the micro-batch's mean loss). The model reports each group of finished gradients to the
/// engine as backward queues it.
pub fn forward_backward<M: Model>(
    engine: &mut ModelEngine<M>,
    model: &mut M,
    weight: f64,
) -> Result<()> {
    engine.backward(|mut io, grads_ready| -> Result<()> {
        // The model's callback cannot fail: the engine's first error is kept and returned.
        let mut engine_error: Option<EngineError> = None;
        let params = io.params;
        model.forward_opening(params, &mut |end| io.open(end)).map_err(TrainError::model)?;
        let loss_scale = f64::from(io.loss_scale) * weight;
        model
            .backward(io.params, io.grads, loss_scale, &mut |ready| {
                if engine_error.is_none() {
                    engine_error = grads_ready(ready.flat_range.clone()).err();
                }
            })
            .map_err(TrainError::model)?;
        engine_error.map_or(Ok(()), |e| Err(e.into()))
    })
}

#[cfg(test)]
mod tests {
    use zeroflow_gpt::GptConfig;

    use super::*;

    /// The initial weights are drawn, or read, straight into the run's type, and are bit for bit
    /// the f32 weights rounded (what a run built before, through an f32 copy beside them): fresh
    /// GPT-2 and Llama weights at odd shapes (grouped-query attention, a vocabulary of 37), and an
    /// `--init-from` directory's F32 and BF16 weights; the same every time from the same seed.
    #[test]
    fn the_initial_weights_in_the_runs_type_are_the_f32_ones_rounded() {
        use zeroflow_core::{bf16, f16};

        use crate::ModelSpec;
        use crate::export::tests::tiny_llama;

        fn rounded<P: Float>(values: &[f32]) -> Vec<u64> {
            values.iter().map(|&w| P::from_f32(w).to_f64().to_bits()).collect()
        }
        fn bits<P: Float>(values: &[P]) -> Vec<u64> {
            values.iter().map(|w| w.to_f64().to_bits()).collect()
        }
        let specs = [
            ModelSpec::Gpt2(GptConfig {
                n_layer: 1,
                n_head: 3,
                d_model: 9,
                vocab_size: 37,
                context: 7,
            }),
            ModelSpec::Llama(crate::llama::LlamaSpec(zeroflow_llama::LlamaConfig {
                vocab_size: 37,
                ..tiny_llama()
            })),
        ];
        let root = std::env::temp_dir().join(format!("zeroflow-initial-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for spec in specs {
            crate::with_family!(&spec, family => {
                let layout = family.flat_layout(1).unwrap();
                let fresh: Vec<f32> = Start::Seed.weights(7, family, &layout).unwrap();
                assert!(fresh.iter().any(|&w| w != 0.0 && w != 1.0), "{spec:?}: drawn");
                let again: Vec<f32> = Start::Seed.weights(7, family, &layout).unwrap();
                assert_eq!(bits(&fresh), bits(&again), "{spec:?}: the same every time");
                let as_bf16: Vec<bf16> = Start::Seed.weights(7, family, &layout).unwrap();
                assert_eq!(bits(&as_bf16), rounded::<bf16>(&fresh), "{spec:?}: bf16");
                let as_f16: Vec<f16> = Start::Seed.weights(7, family, &layout).unwrap();
                assert_eq!(bits(&as_f16), rounded::<f16>(&fresh), "{spec:?}: f16");
                if let ModelSpec::Llama(llama) = &spec {
                    // A directory written in F32 and in BF16, read as f32 and as bf16.
                    let tensors = family.tensors(&layout).unwrap();
                    for dtype in [zeroflow_hf::SaveDtype::F32, zeroflow_hf::SaveDtype::Bf16] {
                        let dir = root.join(format!("{dtype:?}"));
                        let options = zeroflow_hf::SaveOptions {
                            dtype,
                            max_shard_bytes: 4096,
                            tokenizer_from: None,
                        };
                        zeroflow_llama::save_hf_dir(&dir, &llama.0, &layout, &fresh, &options)
                            .unwrap();
                        let hf = crate::init_from::read(&dir).unwrap();
                        // Its config.json's model (its extra fields differ from the spec's).
                        hf.check(&hf.model.clone().unwrap(), &tensors).unwrap();
                        let start = Start::InitFrom { hf: Box::new(hf) };
                        let read: Vec<f32> = start.weights(0, family, &layout).unwrap();
                        let stored = match dtype {
                            zeroflow_hf::SaveDtype::Bf16 => rounded::<bf16>(&fresh),
                            _ => bits(&fresh),
                        };
                        assert_eq!(bits(&read), stored, "{dtype:?} as f32");
                        let read_bf16: Vec<bf16> = start.weights(0, family, &layout).unwrap();
                        assert_eq!(bits(&read_bf16), rounded::<bf16>(&read), "{dtype:?} as bf16");
                    }
                }
            });
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
