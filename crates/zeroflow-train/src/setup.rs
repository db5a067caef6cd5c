//! What a run is made of ([`Setup`], checked from the options before anything is written: fresh,
//! `--init-from` a Hugging Face directory, or `--resume` a checkpoint).

use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::time::Instant;

use zeroflow_core::config::Config;
use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Float, bf16};
use zeroflow_engine::{EngineOptions, checkpoint};
use zeroflow_gpt::GptConfig;

use crate::checkpoints;
use crate::data::{self, Data, EvalSet};
use crate::data_files::{self, DataFile};
use crate::dist::DistEnv;
use crate::dist::affinity::{self, BindMode, Binding};
use crate::error::{Result, input, io};
use crate::plan::{Caller, GivenMemory, MachineMemory, MemoryPlan, PlanInputs, PlanMode};
use crate::resume_point::{self, Extra, ResumePoint, Steering};
use crate::sample::{SampleOptions, Sampler};
use crate::settings::{self, Requested};
use crate::startup_tokens::{self, DataRole};
use crate::{Family, ModelSpec};
use crate::{init_from, limits, open, resume, run_config};

/// How many optimizer steps a run takes unless told: enough for `tiny` to get within 5% of the
/// synthetic corpus' entropy floor.
pub const DEFAULT_STEPS: u64 = 1000;

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    /// An NVIDIA GPU.
    Cuda,
}

/// The values that fill a config's `"auto"` entries (`None`: zeroflow's default).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AutoValues {
    pub micro_batch: Option<NonZeroU64>,
    pub accum: Option<NonZeroU64>,
    pub lr: Option<f64>,
    pub warmup: Option<NonZeroU64>,
    pub weight_decay: Option<f64>,
}

impl AutoValues {
    /// Each of these values, else `other`'s.
    pub fn or(self, other: AutoValues) -> AutoValues {
        AutoValues {
            micro_batch: self.micro_batch.or(other.micro_batch),
            accum: self.accum.or(other.accum),
            lr: self.lr.or(other.lr),
            warmup: self.warmup.or(other.warmup),
            weight_decay: self.weight_decay.or(other.weight_decay),
        }
    }

    /// The values a resolved config `config` (a checkpoint's) gives them. Its warm-up is left
    /// out where the schedule is re-planned on purpose (`extend_schedule`: the default warm-up is
    /// then sized from the new total, as `--extend-schedule` says).
    pub fn of_config(config: &serde_json::Value, extend_schedule: bool) -> AutoValues {
        let number = |pointer: &str| config.pointer(pointer).and_then(serde_json::Value::as_u64);
        let real = |pointer: &str| config.pointer(pointer).and_then(serde_json::Value::as_f64);
        AutoValues {
            micro_batch: number("/train_micro_batch_size_per_gpu").and_then(NonZeroU64::new),
            accum: number("/gradient_accumulation_steps").and_then(NonZeroU64::new),
            lr: real("/optimizer/params/lr"),
            warmup: number("/scheduler/params/warmup_num_steps")
                .and_then(NonZeroU64::new)
                .filter(|_| !extend_schedule),
            weight_decay: real("/optimizer/params/weight_decay"),
        }
    }
}

/// What a `train` command asks for: its flags, each as `zeroflow train --help` describes it.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    pub config: Option<PathBuf>,
    pub model: Option<String>,
    pub data: Option<String>,
    pub device: DeviceKind,
    /// Whether `--device` was given (else `device` is the default, the CPU).
    pub device_given: bool,
    pub gpu: Option<usize>,
    pub steps: Option<NonZeroU64>,
    pub extend_schedule: bool,
    /// `--eval-every`; `None`: [`DEFAULT_EVAL_EVERY`], paced ([`Setup::eval_pace`]).
    pub eval_every: Option<u64>,
    /// `--eval-tokens`: tokens of the evaluation set (default: see [`data::Shape::eval_tokens`]).
    pub eval_tokens: Option<NonZeroU64>,
    /// `--eval-data`: what to evaluate on instead of a held-out part of `--data`.
    pub eval_data: Option<String>,
    /// `--chat-template`: the chat template of data tokenized at start-up instead of the model's
    /// (a resumed run's default: its checkpoint's).
    pub chat_template: Option<PathBuf>,
    /// `--chat-template-kwargs`: variables for the chat template of data tokenized at start-up
    /// (a resumed run's default: its checkpoint's).
    pub chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    pub seq: Option<NonZeroU64>,
    /// `--log-every`; `None`: [`DEFAULT_LOG_EVERY`].
    pub log_every: Option<NonZeroU64>,
    pub out: Option<PathBuf>,
    /// `--save-every`; `None`: [`DEFAULT_SAVE_EVERY`], paced ([`Setup::save_pace`]).
    pub save_every: Option<u64>,
    /// `--keep`; `None`: [`DEFAULT_KEEP`].
    pub keep: Option<NonZeroU64>,
    pub resume: Option<String>,
    pub init_from: Option<PathBuf>,
    /// `--export`: the Hugging Face directory the final weights are written to.
    pub export: Option<PathBuf>,
    pub force: bool,
    pub seed: Option<u64>,
    /// `--sample-every` and `--sample-prompt` ([`crate::sample`]).
    pub sample: Option<SampleOptions>,
    /// `--shuffle`; `None`: on for files (a resumed run: as its checkpoint).
    pub shuffle: Option<bool>,
    /// `--epochs`: the run's steps are this many passes over the training data (counted once it
    /// is opened); instead of `steps`, never with a resume.
    pub epochs: Option<f64>,
    pub auto: AutoValues,
    /// What the flags ask of the run-time settings (the layer above the environment's).
    pub settings: Requested,
    /// What to do with the memory plan before anything is allocated.
    pub plan: PlanMode,
}

/// How the weights and the optimizer start.
#[derive(Debug)]
pub enum Start {
    /// Fresh weights from the seed.
    Seed,
    /// The weights of a Hugging Face directory (`--init-from`), fresh optimizer state.
    InitFrom { hf: Box<init_from::HfModel> },
    /// Everything from a checkpoint (`--resume`).
    Resume { point: Box<ResumePoint> },
}

/// Everything a run needs, checked.
#[derive(Debug)]
pub struct Setup {
    pub device: DeviceKind,
    pub model: ModelSpec,
    pub data: Data,
    /// `--data` resolved to an absolute path (or as the resumed checkpoint recorded it).
    pub data_arg: String,
    /// The data files with their fingerprints, for the checkpoints.
    pub data_files: Vec<DataFile>,
    /// `--eval-data` (resolved) and `--eval-tokens`, for the checkpoints.
    pub eval_data: Option<String>,
    pub eval_tokens: Option<u64>,
    /// Whether documents of data tokenized at start-up were asked to be held out for evaluation
    /// (without `--eval-data`), for the checkpoints: a resume holds out the same.
    pub documents_held_out: bool,
    /// `--chat-template` (an absolute path) and `--chat-template-kwargs` (or the resumed
    /// checkpoint's), for the checkpoints.
    pub chat_template: Option<PathBuf>,
    pub chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    pub config: Config,
    /// Where `config` came from, for the summary.
    pub config_file: Option<PathBuf>,
    pub steps: u64,
    /// Tokens per training sequence (`--seq`; at most the model's context).
    pub seq: usize,
    pub eval_every: u64,
    /// Where `--eval-every` was not given, the pace of evaluations ([`DEFAULT_PACE`]).
    pub eval_pace: Option<Pace>,
    pub log_every: u64,
    pub save_every: u64,
    /// Where `--save-every` was not given, the pace of saves ([`DEFAULT_PACE`]).
    pub save_pace: Option<Pace>,
    pub keep: u64,
    pub out: PathBuf,
    /// `--export`: the Hugging Face directory rank 0 writes the final weights to at the end of
    /// the run (at a stop where that step's checkpoint was refused), checked new (or empty) and
    /// with room for them.
    pub export: Option<PathBuf>,
    /// Where `out` is the default `runs/<UTC time>`, claimed for this run during its set-up
    /// ([`crate::run_dir::claim`]): removed with the set-up unless the run keeps it once its
    /// model is built ([`Claimed::keep`]).
    pub(crate) claimed: Claimed,
    pub seed: u64,
    pub start: Start,
    /// This process's rank in the job (one process unless a launcher says otherwise).
    pub dist: DistEnv,
    /// The CPUs near its GPU that this rank's threads were bound to (`--device cuda`,
    /// `--cpu-bind`); `None`: unbound, the host's cores shared evenly between its ranks.
    pub cpu_binding: Option<Binding>,
    /// The run-time settings, every layer resolved ([`settings::resolve`]).
    pub settings: Requested,
    /// The attention the model runs ([`settings::attention`]).
    pub attention: zeroflow_nn::AttentionKind,
    /// The samples during training, where asked for.
    pub sampler: Option<Sampler>,
    /// What the run was asked to do besides training (its flags, or a resumed checkpoint's), for
    /// its checkpoints.
    pub steering: Steering,
}

impl Setup {
    /// Checks the options, the model, the data, the config, the checkpoint or initial weights,
    /// and that the output directory may be written, for the process at `dist` in its job (as
    /// the launcher's environment says) with `env` as what the `ZEROFLOW_*` variables ask for;
    /// creates and changes nothing, except that with `--device cuda` it first binds this rank's
    /// threads to its GPU's CPUs ([`affinity::bind_for_gpu`]).
    pub fn from_options(options: TrainOptions, dist: DistEnv, env: Requested) -> Result<Setup> {
        let dist = job(&options, dist)?;
        // First, before anything starts a thread (rayon's pool, the optimizer's): they inherit
        // the binding. The config is resolved later; its `cpu_bind` is looked up here.
        let bind = options
            .settings
            .cpu_bind
            .or(env.cpu_bind)
            .or_else(|| options.config.as_deref().and_then(config_cpu_bind));
        let cpu_binding = (options.device == DeviceKind::Cuda)
            .then(|| affinity::bind_for_gpu(&dist, bind.unwrap_or(BindMode::Auto)))
            .flatten();
        let setup = Setup::for_rank(options, dist, env)?;
        // Last, so that a mistake in the flags or the config is reported first.
        if setup.device == DeviceKind::Cuda {
            open::check_cuda_gpu(setup.dist.local_rank)?;
        }
        Ok(Setup { cpu_binding, ..setup })
    }

    /// [`Setup::from_options`] for the rank `dist` (placed in its job already), without binding
    /// threads or looking for the GPU.
    pub fn for_rank(mut args: TrainOptions, dist: DistEnv, env: Requested) -> Result<Setup> {
        let planned = prepare(&mut args, &dist, env, GivenMemory::default())?;
        let Prepared { resume, hf, model, seed, steps, config, config_file, seq, .. } = planned;
        let (settings, attention, spec) = (planned.settings, planned.attention, planned.spec);
        let machine = planned.machine;
        if dist.rank == 0 {
            tracing::info!("{}", planned.plan.summary(&machine));
        }
        if args.plan == PlanMode::Check {
            planned.plan.check_before_start(&machine)?;
        }
        let (out, claimed, keep) =
            run_out(&args, &dist, resume.as_ref(), &config, steps, &planned.plan)?;
        let start = initial_state(resume, hf, &model, dist.world_size)?;
        let batch = &config.batch;
        let shape = data::Shape {
            batch: batch.micro_batch_size_per_gpu,
            micro_steps: steps * batch.gradient_accumulation_steps,
            rank: dist.rank,
            world_size: dist.world_size,
            seq,
            eval_tokens: args.eval_tokens.map(|n| n.get() as usize),
            packed: settings.pack.unwrap_or(false),
            shuffled: planned.shuffle,
        };
        // A `.jsonl`, and text where the model comes from a directory (its tokenizer's tokens,
        // not bytes), are tokenized here with that directory's tokenizer.
        let model_dir = model_dir(&start);
        if let (data::Spec::Text(paths), None, 0) = (&spec, &model_dir, dist.rank)
            && let Some(warning) = bytes_warning(&paths[0], &model, args.model.as_deref())
        {
            tracing::warn!("{warning}");
        }
        let chat = chat_options(&args)?;
        let conversations = spec.holds_conversations();
        let inputs = DataInputs {
            args: &args,
            dist: &dist,
            model: &model,
            start: &start,
            out: &out,
            model_dir: model_dir.as_deref(),
            chat: &chat,
            data_arg: &planned.data_arg,
        };
        let (data, spec, hold_documents) = training_data(inputs, spec, shape, seed)?;
        // `--epochs`: the steps, now that the data says how many an epoch is, and the config
        // resolved again with them (its schedule's total and default warm-up).
        let (steps, config) = match args.epochs {
            Some(epochs) => {
                let steps = steps_of_epochs(epochs, &data, &config)?;
                let shape = (steps, dist.world_size);
                (steps, resolve_config(&args, &model, shape, None, AutoValues::default(), false)?)
            }
            None => (steps, config),
        };
        let sampler = args.sample.as_ref().map(|sample| {
            let chat = conversations.then_some(&chat);
            Sampler::new(sample, &model, &spec, model_dir.as_deref(), chat, &out)
        });
        Ok(Setup {
            device: args.device,
            model,
            data,
            data_arg: planned.data_arg,
            data_files: planned.data_files,
            eval_data: args
                .eval_data
                .as_deref()
                .map(|e| data_files::resolve(e).unwrap_or(e.into())),
            eval_tokens: args.eval_tokens.map(NonZeroU64::get),
            documents_held_out: hold_documents,
            chat_template: chat.template.clone(),
            chat_template_kwargs: args.chat_template_kwargs.clone(),
            config,
            config_file,
            steps,
            seq,
            steering: Steering {
                eval_every: args.eval_every,
                save_every: args.save_every,
                keep: args.keep.map(NonZeroU64::get),
                log_every: args.log_every.map(NonZeroU64::get),
                export: args.export.as_deref().map(absolute),
                sample: args.sample.clone(),
            },
            eval_every: args.eval_every.unwrap_or(DEFAULT_EVAL_EVERY),
            eval_pace: args.eval_every.is_none().then_some(DEFAULT_PACE),
            log_every: args.log_every.map_or(DEFAULT_LOG_EVERY, NonZeroU64::get),
            save_every: args.save_every.unwrap_or(DEFAULT_SAVE_EVERY),
            save_pace: args.save_every.is_none().then_some(DEFAULT_PACE),
            keep,
            out,
            export: args.export,
            claimed,
            seed,
            start,
            dist,
            cpu_binding: None,
            settings,
            attention,
            sampler: sampler.transpose()?,
        })
    }

    /// The Hugging Face directory the run's model came from (`--init-from`, or the resumed run's):
    /// its tokenizer encodes the data, and an export copies its tokenizer files.
    pub fn model_dir(&self) -> Option<PathBuf> {
        model_dir(&self.start)
    }

    /// The step the run has already reached (0 unless resuming).
    pub fn start_step(&self) -> u64 {
        match &self.start {
            Start::Resume { point, .. } => point.extra.step,
            _ => 0,
        }
    }
}

/// The run directory (`--out`, the resumed run's, or a fresh `runs/<UTC time>`, claimed now: see
/// [`Claimed`]), the checkpoints to keep, and on rank 0 the warning where the disk would fill and
/// the check of `--export`'s directory.
fn run_out(
    args: &TrainOptions,
    dist: &DistEnv,
    resume: Option<&ResumePoint>,
    config: &Config,
    steps: u64,
    plan: &MemoryPlan,
) -> Result<(PathBuf, Claimed, u64)> {
    let out = match resume {
        Some(point) => resume_out(point, args, config, steps)?,
        None => fresh_out(args)?,
    };
    // The default `runs/<UTC time>` is claimed now, before anything is written into it (the
    // tokens of data tokenized at start-up): another run started in the same second gets
    // another. A set-up that fails from here removes it again.
    let mut claimed = Claimed(None);
    let out = match resume.is_none() && args.out.is_none() {
        true => claimed.claim(&out)?,
        false => out,
    };
    let keep = args.keep.map_or(DEFAULT_KEEP, NonZeroU64::get);
    let (checkpoint_bytes, weights_bytes) = (plan.checkpoint_disk_bytes, plan.weights_disk_bytes);
    if dist.rank == 0
        && let Some(warning) = checkpoints::disk_warning(
            &out,
            checkpoint_bytes,
            keep,
            args.export.as_deref().map(|dir| (dir, weights_bytes)),
        )
    {
        tracing::warn!("{warning}");
    }
    if dist.rank == 0
        && let Some(dir) = &args.export
    {
        check_export(dir, &out, weights_bytes)?;
    }
    Ok((out, claimed, keep))
}

/// `--chat-template` (made absolute, and checked to be a file) and `--chat-template-kwargs`.
fn chat_options(args: &TrainOptions) -> Result<zeroflow_data::ChatOptions> {
    let template = args.chat_template.as_deref().map(std::path::absolute).transpose();
    let template = template.map_err(|e| input(format!("--chat-template: {e}")))?;
    if let Some(file) = template.as_deref().filter(|file| !file.is_file()) {
        return Err(input(format!("--chat-template {}: no such file", file.display())));
    }
    let variables = args.chat_template_kwargs.clone().unwrap_or_default();
    Ok(zeroflow_data::ChatOptions { template, variables })
}

/// What [`training_data`] reads the run's data for.
struct DataInputs<'a> {
    args: &'a TrainOptions,
    dist: &'a DistEnv,
    model: &'a ModelSpec,
    start: &'a Start,
    /// The run directory, where data tokenized at start-up goes.
    out: &'a Path,
    /// The model's Hugging Face directory, whose tokenizer encodes text and conversations.
    model_dir: Option<&'a Path>,
    chat: &'a zeroflow_data::ChatOptions,
    /// `--data` as given (resolved), beside which `zeroflow tokenize --hold-out` keeps its
    /// held-out documents.
    data_arg: &'a str,
}

/// The run's data: `spec` (and `--eval-data`) tokenized at start-up where they must be, with the
/// tokenizer of the model's directory and the chat options, the evaluation set chosen, and the
/// training stream at the checkpoint's position when resuming; with the training data's spec as
/// tokenized, and whether documents are held out for evaluation.
fn training_data(
    inputs: DataInputs<'_>,
    spec: data::Spec,
    shape: data::Shape,
    seed: u64,
) -> Result<(Data, data::Spec, bool)> {
    let DataInputs { args, dist, model, start, out, model_dir, chat, data_arg } = inputs;
    // Without --eval-data, documents spread over data tokenized at start-up are held out for
    // evaluation (a run resumed from a checkpoint from before, which held out a tail, goes on
    // doing so).
    let hold_documents = args.eval_data.is_none()
        && match start {
            Start::Resume { point, .. } => point.extra.documents_held_out == Some(true),
            _ => true,
        };
    let hold_out = hold_documents.then(|| shape.eval_tokens.unwrap_or(data::EVAL_TOKENS) as u64);
    let tokenized = |spec, role, hold_out| {
        let at = startup_tokens::RankOnHost { rank: dist.rank, local_rank: dist.local_rank };
        startup_tokens::tokenized_at_start(spec, role, model_dir, out, at, chat, hold_out)
    };
    if let Some(dir) = model_dir
        && let Some(tokenizer) = zeroflow_data::Tokenizer::of_dir(dir).ok().flatten()
    {
        spec.check_tokenized_with(&tokenizer, dir, "--data")?;
    }
    let given_shards = matches!(spec, data::Spec::Shards(_));
    let tokenized_data = tokenized(spec, DataRole::Train, hold_out)?;
    let (spec, held_out) = (tokenized_data.spec, tokenized_data.held_out);
    // A directory of `zeroflow tokenize --hold-out`'s shards: the documents it held out.
    let held_out = match (held_out, &spec) {
        (None, data::Spec::Shards(_)) if hold_documents => data::Spec::held_out_beside(data_arg)?,
        (held_out, _) => held_out,
    };
    let eval_spec = args.eval_data.as_deref().map(data::Spec::parse).transpose()?;
    let eval_spec = eval_spec.map(|spec| tokenized(spec, DataRole::Eval, None)).transpose()?;
    let eval = EvalSet::of(eval_spec.as_ref().map(|given| &given.spec), held_out.as_ref());
    if given_shards && hold_documents && matches!(eval, EvalSet::Tail) && dist.rank == 0 {
        tracing::info!(
            "eval: the end of --data's last shard (no {}/ beside the shards): data that comes \
             sorted is evaluated on its last part alone; `zeroflow tokenize --hold-out N` holds \
             out documents spread over all of it, or give --eval-data",
            zeroflow_data::HELD_OUT_DIR
        );
    }
    let data = open_data(&spec, eval, model, shape, seed, start)?;
    Ok((data, spec, hold_documents))
}

/// [`Setup::model_dir`] of a run that starts as `start` says.
fn model_dir(start: &Start) -> Option<PathBuf> {
    match start {
        Start::InitFrom { hf } => Some(hf.dir.clone()),
        Start::Resume { point, .. } => point.extra.run.init_from.as_ref().map(PathBuf::from),
        Start::Seed => None,
    }
}

/// Refuses `--export dir` where it holds anything, is the run directory `out` itself, or where
/// its file system has less free space than the weights take (`bytes`).
fn check_export(dir: &Path, out: &Path, bytes: u64) -> Result<()> {
    if absolute(dir) == absolute(out) {
        return Err(input(format!(
            "--export {}: the run directory (--out) itself; the Hugging Face directory must be \
             one of its own (a new directory inside --out will do)",
            dir.display()
        )));
    }
    crate::export::check_dir(dir, bytes)
        .map_err(|reason| input(format!("--export {}: {reason}", dir.display())))
}

/// The checkpoints a run keeps where `--keep` is not given.
pub const DEFAULT_KEEP: u64 = 3;

/// The steps between progress lines where `--log-every` is not given.
pub const DEFAULT_LOG_EVERY: u64 = 50;

/// The steps between checkpoints where `--save-every` is not given.
pub const DEFAULT_SAVE_EVERY: u64 = 200;

/// The steps between evaluations where `--eval-every` is not given.
pub const DEFAULT_EVAL_EVERY: u64 = 100;

/// How often a periodic piece of work (a save, an evaluation) comes at most: where the last one
/// took `from_seconds` or more, the next waits until `times` as long has passed since it ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    pub times: f64,
    pub from_seconds: f64,
}

impl Pace {
    /// Whether the next one is due, the last having ended at `ended` after `seconds`; where not,
    /// how long after the last it waits for.
    pub fn due(&self, ended: std::time::Instant, seconds: f64) -> Result<(), f64> {
        let wait = self.times * seconds;
        match seconds >= self.from_seconds && ended.elapsed().as_secs_f64() < wait {
            true => Err(wait),
            false => Ok(()),
        }
    }
}

/// The pace of saves and evaluations whose interval is not given: at most about 1/21 of the run
/// each (llama-8b's 112 GB checkpoint would take about a minute at the disk's 2 GB/s, and its
/// evaluation of a million tokens about 40 s, both estimates, where 200 of its steps take four
/// minutes); work under a second (a small model's) is never held back.
pub const DEFAULT_PACE: Pace = Pace { times: 20.0, from_seconds: 1.0 };

/// What a run is, up to its memory plan: nothing read of the weights or the data yet.
struct Prepared {
    resume: Option<ResumePoint>,
    hf: Option<init_from::HfModel>,
    model: ModelSpec,
    seed: u64,
    steps: u64,
    config: Config,
    config_file: Option<PathBuf>,
    seq: usize,
    settings: Requested,
    attention: zeroflow_nn::AttentionKind,
    data_arg: String,
    spec: data::Spec,
    data_files: Vec<DataFile>,
    /// Whether the training rows are shuffled ([`shuffle`]).
    shuffle: bool,
    plan: MemoryPlan,
    /// What the machine has, read once for the run before anything is allocated.
    machine: MachineMemory,
}

/// The memory plan of the run `options` ask for on the rank `dist`, and this machine's memory
/// (or the memory `given` of another), stopping before anything is read or allocated
/// (`zeroflow plan`).
pub fn plan(
    mut options: TrainOptions,
    dist: DistEnv,
    env: Requested,
    given: GivenMemory,
) -> Result<(MemoryPlan, MachineMemory)> {
    let prepared = prepare(&mut options, &dist, env, given)?;
    Ok((prepared.plan, prepared.machine))
}

/// The checks and resolutions of [`Setup::for_rank`] up to the memory plan.
fn prepare(
    args: &mut TrainOptions,
    dist: &DistEnv,
    env: Requested,
    given: GivenMemory,
) -> Result<Prepared> {
    let resume = match &args.resume {
        Some(arg) => Some(resume_point::find(arg, args.out.as_deref())?),
        None => None,
    };
    if let Some(point) = &resume {
        resume::check_device(point, args.device, args.device_given)?;
        steer_as_saved(args, &point.extra.steering);
        args.eval_data = args.eval_data.take().or_else(|| point.extra.eval_data.clone());
        args.chat_template =
            args.chat_template.take().or_else(|| point.extra.chat_template.clone());
        args.chat_template_kwargs =
            args.chat_template_kwargs.take().or_else(|| point.extra.chat_template_kwargs.clone());
        args.eval_tokens =
            args.eval_tokens.or_else(|| point.extra.eval_tokens.and_then(NonZeroU64::new));
    }
    let saved = resume.as_ref().map(|point| (&point.extra, point.dir.as_path()));
    let (data_arg, spec, data_files) = run_data(args, resume.as_ref())?;
    let hf = args.init_from.as_deref().map(init_from::read).transpose()?;
    let model = choose_model(args.model.as_deref(), saved, hf.as_ref(), &spec)?;
    let seed = same_as_saved("--seed", args.seed, saved.map(|(e, d)| (e.seed, d)))?.unwrap_or(0);
    let shuffle = shuffle(args.shuffle, &spec, saved)?;
    let steps = resume::total_steps(args.steps.map(NonZeroU64::get), resume.as_ref());
    // A resumed run that was given a config file keeps its resolved config, unless --config
    // says otherwise (a run of the default config resolves it again, to the same values).
    let saved_config = resume
        .as_ref()
        .filter(|point| point.extra.run.config_file.is_some())
        .map(|point| &point.extra.config);
    // The resumed run's flags default to the checkpoint's values, so that the command that
    // started a run, with `--resume latest` added, continues it.
    let saved_autos = resume.as_ref().map_or_else(AutoValues::default, |point| {
        AutoValues::of_config(&point.extra.config, args.extend_schedule)
    });
    if let Some(epochs) = args.epochs {
        check_epochs(epochs, &spec)?;
    }
    let (shape, quiet) = ((steps, dist.world_size), args.epochs.is_some());
    let config = resolve_config(args, &model, shape, saved_config, saved_autos, quiet)?;
    let config_file = args.config.clone().or_else(|| {
        saved_config?;
        resume.as_ref()?.extra.run.config_file.as_ref().map(PathBuf::from)
    });
    // A resumed run reads rows of the length it was saved with (the data position counts them).
    let saved_seq = saved.and_then(|(extra, dir)| Some((extra.seq?, dir)));
    let seq = same_as_saved("--seq", args.seq.map(NonZeroU64::get), saved_seq)?;
    let seq = training_seq(seq.and_then(NonZeroU64::new), &model)?;
    let machine =
        MachineMemory::this_or_given(args.device, dist.local_rank, dist.local_world_size, given);
    limits::check_micro_batch(
        &model,
        config.batch.micro_batch_size_per_gpu,
        seq,
        args.device,
        machine.host_available,
    )
    .map_err(input)?;
    let mut settings =
        settings::resolve(args.settings, env, settings::from_config(&config.zeroflow));
    if let Some(point) = &resume {
        // Attention is the GPU's choice: the CPU model has only gemm.
        let on_gpu = args.device == DeviceKind::Cuda && resume::trained_on(point) == args.device;
        settings = settings.over(settings::from_checkpoint(&point.extra.settings, on_gpu));
    }
    let attention = settings::attention(args.device, &model, &settings)?;
    let resumed = resume.is_some();
    let run = (seq, &settings, attention);
    let mut inputs = train_plan_inputs(args, &model, &config, dist, run, (resumed, &machine))?;
    // `--device-share fit`: the trainer builds its engine with the share the plan chose.
    crate::plan::resolve_fit(&mut settings, &mut inputs, || machine.gpu_elsewhere)?;
    // ZenFlow's window in host memory where only that fits.
    crate::plan::resolve_zenflow_aside(&mut settings, &mut inputs, &machine)?;
    let plan = MemoryPlan::new(inputs)?;
    Ok(Prepared {
        resume,
        hf,
        model,
        seed,
        steps,
        config,
        config_file,
        seq,
        settings,
        attention,
        data_arg,
        spec,
        data_files,
        shuffle,
        plan,
        machine,
    })
}

/// `--epochs` must be a positive number, of data that has epochs (files, not the synthetic
/// corpus).
fn check_epochs(epochs: f64, spec: &data::Spec) -> Result<()> {
    if !(epochs.is_finite() && epochs > 0.0) {
        return Err(input(format!("--epochs {epochs}: give a positive number of passes")));
    }
    if matches!(spec, data::Spec::Synthetic) {
        return Err(input(
            "--epochs: the synthetic corpus is a stream made for the run, with no epochs; give \
             --steps",
        ));
    }
    Ok(())
}

/// The optimizer steps of `epochs` passes over `data` (rounded up, at least 1), said.
fn steps_of_epochs(epochs: f64, data: &data::Data, config: &Config) -> Result<u64> {
    let accum = config.batch.gradient_accumulation_steps;
    let (micro_steps, epoch) =
        data.epoch_micro_steps.zip(data.epoch_steps(accum)).ok_or_else(|| {
            input("--epochs: the data has no epochs (the synthetic corpus); give --steps")
        })?;
    let steps = ((epochs * epoch).ceil() as u64).max(1);
    tracing::info!(
        "--epochs {epochs}: {steps} steps ({micro_steps} micro-batches of {} sequences an epoch, \
         {accum} a step)",
        config.batch.micro_batch_size_per_gpu
    );
    Ok(steps)
}

/// Whether the training rows are read in an order shuffled each epoch: `--shuffle`, else on for
/// files, as `transformers`' `Trainer` shuffles its dataset (the synthetic corpus is a random
/// stream: never, and asking for it is said to change nothing). A resumed run reads as its
/// checkpoint did (in order where it predates the option); a `--shuffle` that differs is an
/// error.
fn shuffle(flag: Option<bool>, spec: &data::Spec, saved: Option<(&Extra, &Path)>) -> Result<bool> {
    if matches!(spec, data::Spec::Synthetic) {
        if flag == Some(true) {
            tracing::warn!(
                "--shuffle: the synthetic corpus is a random stream; nothing to shuffle"
            );
        }
        return Ok(false);
    }
    let saved = saved.map(|(extra, dir)| (extra.shuffle.unwrap_or(false), dir));
    let to_name = |on: bool| if on { "on" } else { "off" };
    match (flag, saved) {
        (Some(given), Some((saved, dir))) if given != saved => Err(input(format!(
            "--shuffle={} differs from the checkpoint's {} ({}): the rows a run reads from its \
             position depend on it; drop --shuffle to continue the run as it was saved",
            to_name(given),
            to_name(saved),
            dir.join("state.json").display()
        ))),
        (_, Some((saved, _))) => Ok(saved),
        (given, None) => Ok(given.unwrap_or(true)),
    }
}

/// What the memory plan of a rank of the run is of, with the engine's options as the trainer
/// will make them (the config's, tuned by the run-time settings), on `machine`.
fn train_plan_inputs(
    args: &TrainOptions,
    model: &ModelSpec,
    config: &Config,
    dist: &DistEnv,
    (seq, settings, attention): (usize, &Requested, zeroflow_nn::AttentionKind),
    (resumed, machine): (bool, &MachineMemory),
) -> Result<PlanInputs> {
    let mut options =
        EngineOptions::from_config(config, 1).map_err(|e| input(format!("the config: {e}")))?;
    if options.offload().is_some() {
        match args.device {
            DeviceKind::Cpu => settings::tune_offload::<f32>(settings, &mut options)?,
            DeviceKind::Cuda => settings::tune_offload::<bf16>(settings, &mut options)?,
        }
    }
    let activation_checkpointing =
        args.device == DeviceKind::Cuda && settings.activation_checkpointing.unwrap_or(false);
    Ok(PlanInputs {
        model: model.clone(),
        device: args.device,
        options,
        world_size: dist.world_size,
        rank: dist.rank,
        micro_batch: config.batch.micro_batch_size_per_gpu as usize,
        seq,
        model_options: zeroflow_nn::PlanOptions {
            attention,
            activation_checkpointing,
            packed: settings.pack.unwrap_or(false),
        },
        caller: Caller::Train { resumed, samples: args.sample.is_some() },
        gpu_memory: machine.gpu_total,
    })
}

/// The run's `--data` (the checkpoint's when resuming), what it names, and its files'
/// fingerprints, checked against the checkpoint's; `--data` is recorded resolved, so that the run
/// resumes from any directory.
fn run_data(
    args: &TrainOptions,
    resume: Option<&ResumePoint>,
) -> Result<(String, data::Spec, Vec<DataFile>)> {
    let data_arg = match resume {
        Some(point) => resume::data_arg(args.data.clone(), point)?,
        None => args.data.clone().unwrap_or_else(|| "synthetic".to_owned()),
    };
    let spec = data::Spec::parse(&data_arg)?;
    let data_files = data_files::fingerprints(spec.files())?;
    if let Some(point) = resume {
        resume::check_data_unchanged(point, &data_files)?;
    }
    Ok((data_files::resolve(&data_arg).unwrap_or(data_arg), spec, data_files))
}

/// The run directory of a run that does not resume: `--out`, else `runs/<UTC time>`; refused
/// where it holds files (unless `--force`) or an earlier run's checkpoints.
fn fresh_out(args: &TrainOptions) -> Result<PathBuf> {
    let Some(out) = args.out.clone() else {
        // Claimed afresh ([`Claimed`]): `runs/<UTC time>`, or with a suffix where it is taken.
        return Ok(PathBuf::from("runs").join(utc_stamp()));
    };
    check_out_dir(&out, args.force)?;
    if let Some((_, newest)) = crate::checkpoints::list(&out)?.last() {
        // `--force` replaces files, never a run: a new run's checkpoints beside the earlier
        // one's would make `--resume latest` take the newest step of either.
        let forced = match args.force {
            true => " (--force replaces files, not an earlier run's checkpoints)",
            false => "",
        };
        return Err(input(format!(
            "--out {}: holds checkpoints of an earlier run ({}){forced}; continue it with \
             --resume latest, choose another --out, or remove {} to start again there",
            out.display(),
            newest.display(),
            out.join("checkpoints").display()
        )));
    }
    Ok(out)
}

/// The default run directory a set-up claimed ([`crate::run_dir::claim`]), removed again (with
/// an emptied `runs/`) when dropped before [`Claimed::keep`]: by a set-up that fails, or with the
/// [`Setup`] of a run that fails to build its model.
#[derive(Debug)]
pub(crate) struct Claimed(Option<PathBuf>);

impl Claimed {
    fn claim(&mut self, wanted: &Path) -> Result<PathBuf> {
        let dir = crate::run_dir::claim(wanted)?;
        self.0 = Some(dir.clone());
        Ok(dir)
    }

    /// The run holds the directory for good.
    pub(crate) fn keep(&mut self) {
        self.0 = None;
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        if let Some(dir) = self.0.take() {
            let _ = std::fs::remove_dir_all(&dir);
            if let Some(parent) = dir.parent() {
                let _ = std::fs::remove_dir(parent);
            }
        }
    }
}

/// The run's data, its training stream at the checkpoint's position when resuming.
fn open_data(
    spec: &data::Spec,
    eval: EvalSet<'_>,
    model: &ModelSpec,
    shape: data::Shape,
    seed: u64,
    start: &Start,
) -> Result<Data> {
    let mut data = Data::open(spec, eval, model.vocab_size(), shape, seed)?;
    if let Start::Resume { point, .. } = start {
        data.train.seek(point.extra.data_position).map_err(|e| {
            input(format!("--resume {}: the data position: {e}", point.dir.display()))
        })?;
    }
    Ok(data)
}

/// `--seq`, checked against the model's context (and the Llama family's sliding window); the
/// family's default ([`ModelSpec::default_seq`]) when not given.
pub fn training_seq(flag: Option<NonZeroU64>, model: &ModelSpec) -> Result<usize> {
    let context = model.context();
    let seq = match flag.map(|seq| seq.get()) {
        None => model.default_seq(),
        Some(seq) if seq <= context as u64 => seq as usize,
        Some(seq) => {
            return Err(input(format!(
                "--seq {seq} is longer than the model's context of {context} tokens; give at \
                 most {context} (or a model with a longer context)"
            )));
        }
    };
    crate::with_family!(model, family => family.check_seq(seq))?;
    Ok(seq)
}

/// This process's place in the job, `dist` from the launcher's environment, with `--gpu` as its
/// GPU. Several ranks need `--device cuda` (one GPU each) and a run directory they agree on.
pub fn job(args: &TrainOptions, mut dist: DistEnv) -> Result<DistEnv> {
    if let Some(gpu) = args.gpu {
        if args.device != DeviceKind::Cuda {
            return Err(input("--gpu chooses a GPU: it needs --device cuda"));
        }
        if dist.world_size > 1 {
            return Err(input(format!(
                "--gpu {gpu}: under a launcher each rank trains on the GPU of its LOCAL_RANK; \
                 drop --gpu (choose the GPUs with CUDA_VISIBLE_DEVICES)"
            )));
        }
        dist.local_rank = gpu;
    }
    if dist.world_size == 1 {
        return Ok(dist);
    }
    if args.device == DeviceKind::Cpu {
        return Err(input(format!(
            "this process is rank {} of {}, but --device cpu trains in one process: train on \
             several ranks with --device cuda (one GPU each)",
            dist.rank, dist.world_size
        )));
    }
    if args.out.is_none() && args.resume.is_none() {
        return Err(input(format!(
            "--out is needed with {} ranks: every rank writes its part of the checkpoints into \
             the same run directory (on a file system all hosts share)",
            dist.world_size
        )));
    }
    Ok(dist)
}

/// The model: `--model` ([`ModelSpec::parse`]), else the checkpoint's when resuming, else the
/// model of `--init-from`'s config.json, else `tiny` with the data's vocabulary. A `--model`
/// other than the checkpoint's is an error.
fn choose_model(
    flag: Option<&str>,
    saved: Option<(&Extra, &Path)>,
    hf: Option<&init_from::HfModel>,
    spec: &data::Spec,
) -> Result<ModelSpec> {
    let given = match flag {
        Some(text) => {
            Some(ModelSpec::parse(text).map_err(|e| input(format!("--model {text}: {e}")))?)
        }
        None => None,
    };
    let saved = saved.map(|(extra, dir)| (extra.model.clone(), dir));
    Ok(same_as_saved("--model", given, saved)?
        .or_else(|| hf.and_then(|hf| hf.model.clone()))
        .unwrap_or(ModelSpec::Gpt2(GptConfig {
            vocab_size: spec.default_vocab(),
            ..GptConfig::TINY
        })))
}

/// What to say where text (`file`, the first of the data) is read as bytes, ids 0 to 255, by a
/// model trained from scratch whose vocabulary is larger (`--model` `flag`): most of its
/// embedding never trains, and a tokenizer was more likely meant; the tokenizer.json beside a
/// `--model` config.json is named where there is one.
fn bytes_warning(file: &Path, model: &ModelSpec, flag: Option<&str>) -> Option<String> {
    let vocab = model.vocab_size();
    if vocab <= 256 {
        return None;
    }
    let beside = flag.map(Path::new).and_then(Path::parent).map(|dir| dir.join("tokenizer.json"));
    let tokenizer = match beside.filter(|t| t.is_file()) {
        Some(found) => found.display().to_string(),
        None => "T".into(),
    };
    Some(format!(
        "--data {} is text, read as bytes (ids 0 to 255) by a model of {vocab} tokens trained from \
         scratch: the rest of its vocabulary never trains. To train on a tokenizer's tokens, \
         tokenize first (`zeroflow tokenize --tokenizer {tokenizer} {} --out DIR`) and give \
         --data DIR",
        file.display(),
        file.display()
    ))
}

/// How the run starts, with the initial weights checked against the model's tensors (read when
/// the engine is built, in the run's own type: [`Start::weights`]).
fn initial_state(
    resume: Option<ResumePoint>,
    hf: Option<init_from::HfModel>,
    model: &ModelSpec,
    world_size: usize,
) -> Result<Start> {
    let layout = model.flat_layout(world_size)?;
    let tensors = model.tensors(&layout)?;
    Ok(match (resume, hf) {
        (Some(point), _) => {
            point.loaded.check_tensors(&tensors).map_err(|e| resume_point::resume_error(&e))?;
            Start::Resume { point: Box::new(point) }
        }
        (None, Some(hf)) => {
            hf.check(model, &tensors)?;
            Start::InitFrom { hf: Box::new(hf) }
        }
        (None, None) => Start::Seed,
    })
}

impl Start {
    /// The weights the run starts from, as `P` in the flat buffer of `layout` (whose tensors are
    /// `family`'s): fresh from `seed`, or read from the `--init-from` directory or the checkpoint
    /// straight into their buffer (no f32 copy of a large model beside them).
    pub fn weights<F: Family, P: Float>(
        &self,
        seed: u64,
        family: &F,
        layout: &FlatLayout,
    ) -> Result<Vec<P>> {
        match self {
            Start::Seed => {
                let mut weights = vec![P::default(); layout.padded_len()];
                family.init(layout, seed, &mut weights)?;
                Ok(weights)
            }
            Start::InitFrom { hf } => hf.flat_weights(layout, &family.tensors(layout)?),
            Start::Resume { point } => {
                let (started, bytes) = (Instant::now(), point.loaded.model.file_bytes());
                let tensors = family.tensors(layout)?;
                let weights = point.loaded.flat_weights(&tensors, layout.padded_len());
                let weights = weights.map_err(|e| resume_point::resume_error(&e))?;
                tracing::info!(
                    "read the checkpoint's weights ({}) in {:.1} s",
                    checkpoint::disk_size(bytes),
                    started.elapsed().as_secs_f64()
                );
                Ok(weights)
            }
        }
    }
}

/// When resuming, `--eval-every`, `--save-every`, `--keep`, `--log-every`, `--export` and the
/// samples default to what the run's start asked for, so that `--resume latest` alone continues
/// it. An export directory that holds files by now (the run's own export, where it ended before)
/// is not written again: said, with the flag that exports elsewhere.
fn steer_as_saved(args: &mut TrainOptions, saved: &Steering) {
    args.eval_every = args.eval_every.or(saved.eval_every);
    args.save_every = args.save_every.or(saved.save_every);
    args.keep = args.keep.or(saved.keep.and_then(NonZeroU64::new));
    args.log_every = args.log_every.or(saved.log_every.and_then(NonZeroU64::new));
    args.sample = args.sample.take().or_else(|| saved.sample.clone());
    if let (None, Some(dir)) = (&args.export, &saved.export) {
        let empty = |dir: &Path| std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
        if !dir.exists() || empty(dir) {
            tracing::info!("exporting at the end into {}, as the run asked", dir.display());
            args.export = Some(dir.clone());
        } else {
            tracing::warn!(
                "the run's --export {} holds files by now (an earlier export?): this run exports \
                 nowhere unless --export names a new directory",
                dir.display()
            );
        }
    }
}

/// `path` made absolute against the working directory (as it is where that fails).
fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The `zeroflow.cpu_bind` of the config file, looked up before the config is resolved (binding
/// comes before anything else); `None` where the file does not say or cannot be read (resolving
/// it reports why).
fn config_cpu_bind(config_file: &Path) -> Option<BindMode> {
    let text = std::fs::read_to_string(config_file).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    let name = value.pointer("/zeroflow/cpu_bind")?.as_str()?;
    settings::names::CPU_BIND.iter().find(|(n, _)| *n == name).map(|&(_, mode)| mode)
}

/// A flag's value when resuming: the checkpoint's, unless the flag says otherwise (an error).
fn same_as_saved<T: PartialEq + serde::Serialize>(
    flag: &str,
    given: Option<T>,
    saved: Option<(T, &Path)>,
) -> Result<Option<T>> {
    match (given, saved) {
        (Some(given), Some((saved, dir))) if given != saved => {
            let json = |value: &T| serde_json::to_string(value).expect("serialisable");
            Err(input(format!(
                "{flag} {} differs from the checkpoint's {} ({}); drop {flag} to continue the \
                 run as it was saved",
                json(&given),
                json(&saved),
                dir.join("state.json").display()
            )))
        }
        (Some(value), _) | (None, Some((value, _))) => Ok(Some(value)),
        (None, None) => Ok(None),
    }
}

/// Checks that the run can continue from `point` with this config and step count, and returns
/// its run directory.
fn resume_out(
    point: &ResumePoint,
    args: &TrainOptions,
    config: &Config,
    steps: u64,
) -> Result<PathBuf> {
    let dir = point.dir.display();
    if let Some(out) = &args.out
        && std::fs::canonicalize(out).ok() != std::fs::canonicalize(&point.run_dir).ok()
    {
        return Err(input(format!(
            "--out {}: --resume {dir} continues in its run directory {}; drop --out",
            out.display(),
            point.run_dir.display()
        )));
    }
    let saved = &point.extra.config;
    let now = config.to_json();
    for key in ["train_micro_batch_size_per_gpu", "gradient_accumulation_steps"] {
        if saved.get(key) != now.get(key) {
            return Err(input(format!(
                "--resume {dir}: the checkpoint's {key} is {}, this run's {}; give the batch \
                 flags and config it was saved with",
                saved.get(key).unwrap_or(&serde_json::Value::Null),
                now.get(key).unwrap_or(&serde_json::Value::Null),
            )));
        }
    }
    let changed: Vec<&str> = now
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(key, value)| saved.get(key.as_str()) != Some(value))
        // A schedule re-planned on purpose is said by check_schedule.
        .filter(|(key, _)| !(args.extend_schedule && key.as_str() == "scheduler"))
        .map(|(key, _)| key.as_str())
        .collect();
    resume::check_schedule(point, config, steps, args.extend_schedule)?;
    if let Some(change) = resume::weight_decay_rule_change(point, config) {
        tracing::warn!("{change}");
    }
    if !changed.is_empty() {
        tracing::warn!(
            "the config differs from the checkpoint's ({dir}) in {}; continuing with this run's",
            changed.join(", ")
        );
    }
    Ok(point.run_dir.clone())
}

/// The resolved config of the run, through the resolution `zeroflow config` shares
/// ([`run_config::resolve`]); its warnings are logged, unless `quiet` (a provisional resolution
/// that `--epochs` makes again once the data says how many steps the run is).
fn resolve_config(
    args: &TrainOptions,
    model: &ModelSpec,
    (steps, world_size): (u64, usize),
    saved: Option<&serde_json::Value>,
    resumed: AutoValues,
    quiet: bool,
) -> Result<Config> {
    let flags = run_config::RunFlags {
        config_file: args.config.as_deref(),
        saved_config: saved,
        device: Some(args.device),
        auto: args.auto,
        resumed,
        steps,
        world_size,
        hidden_size: model.hidden_size(),
        fine_tune: args.init_from.is_some(),
    };
    let run_config::RunConfig { resolved, name } = run_config::resolve(&flags)?;
    if quiet {
        return Ok(resolved.config);
    }
    for warning in &resolved.warnings {
        tracing::warn!("{name}: {warning}");
    }
    for auto_value in &resolved.auto_values {
        let lr_flag = flags.auto.lr.or(flags.resumed.lr);
        if flags.fine_tune && lr_flag.is_none() && auto_value.path == "optimizer.params.lr" {
            tracing::info!(
                "{name}: {auto_value} (the default for a model from --init-from; --lr sets it)"
            );
        } else {
            tracing::debug!("{name}: {auto_value}");
        }
    }
    Ok(resolved.config)
}

/// Refuses an output directory that holds anything, unless `force`.
fn check_out_dir(out: &Path, force: bool) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(input(format!(
            "--out {}: exists and is not a directory; choose another --out",
            out.display()
        )));
    }
    let non_empty = out.is_dir()
        && std::fs::read_dir(out).map_err(io(format!("read {}", out.display())))?.next().is_some();
    if non_empty && !force {
        return Err(input(format!(
            "--out {}: the directory is not empty; choose another --out, or pass --force to \
             write into it (its metrics.jsonl, loss.svg and summary.json are replaced)",
            out.display()
        )));
    }
    Ok(())
}

/// The current UTC time as `YYYYmmdd-HHMMSS`, for default run directories.
fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", rest / 3600, rest / 60 % 60, rest % 60)
}
