//! `zeroflow train`: what a run is made of ([`Setup`], checked from the flags before anything is
//! written: fresh, `--init-from` a Hugging Face directory, or `--resume` a checkpoint), the
//! training loop ([`run`]), and what it leaves behind (metrics, plot, summary, checkpoints).

pub mod backend;
mod checkpoints;
mod data;
mod init;
#[cfg(test)]
mod multi_rank_tests;
mod output;
mod plot;
pub(crate) mod run;
mod schedule;

use std::num::{NonZeroU32, NonZeroU64};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use zeroflow_core::config::{self, Config, Context, MixedPrecision, Overrides};
use zeroflow_engine::checkpoint::{self, NamedTensor};
use zeroflow_gpt::{GptConfig, HfTensor, flat_layout, hf_tensors};

use crate::InputError;
use crate::cmd::train::Args;
use crate::dist::DistEnv;
use crate::dist::affinity::{self, BindMode, Binding};
use crate::settings::{self, Requested};

use checkpoints::ResumePoint;
pub use data::Data;
pub use run::run;

/// Defaults of the run that the flags and an `"auto"` in the config can change.
const DEFAULT_MICRO_BATCH: u64 = 16;
const DEFAULT_LR: f64 = 3e-3;

/// The config of a run without `--config`: AdamW with GPT betas, no weight decay, clipping at 1,
/// a linear warm-up over the first 5% of the steps and a cosine decay to 10% of the peak, ZeRO
/// stage 0 in fp32; the batch sizes, the peak learning rate and the step counts come from the
/// flags.
const DEFAULT_CONFIG: &str = r#"{
  "train_micro_batch_size_per_gpu": "auto",
  "gradient_accumulation_steps": "auto",
  "gradient_clipping": 1.0,
  "optimizer": {
    "type": "AdamW",
    "params": { "lr": "auto", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0 }
  },
  "scheduler": {
    "type": "WarmupCosineLR",
    "params": {
      "warmup_min_ratio": 0.0,
      "warmup_num_steps": "auto",
      "warmup_type": "linear",
      "cos_min_ratio": 0.1,
      "total_num_steps": "auto"
    }
  },
  "zero_optimization": { "stage": 0 }
}"#;

/// Where the model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceKind {
    Cpu,
    Cuda,
}

/// How the weights and the optimizer start.
#[derive(Debug)]
pub enum Start {
    /// Fresh weights from the seed.
    Seed,
    /// The weights of a Hugging Face directory (`--init-from`), fresh optimizer state.
    InitFrom { dir: PathBuf, weights: Vec<f32> },
    /// Everything from a checkpoint (`--resume`).
    Resume { point: Box<ResumePoint>, weights: Vec<f32> },
}

/// Everything a run needs, checked.
#[derive(Debug)]
pub struct Setup {
    pub device: DeviceKind,
    pub model: GptConfig,
    pub data: Data,
    /// `--data` as given (or as the resumed checkpoint recorded it).
    pub data_arg: String,
    pub config: Config,
    /// Where `config` came from, for the summary.
    pub config_file: Option<PathBuf>,
    pub steps: u64,
    pub eval_every: u64,
    pub log_every: u64,
    pub save_every: u64,
    pub keep: u64,
    pub out: PathBuf,
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
    pub attention: zeroflow_gpt::AttentionKind,
}

impl Setup {
    /// Checks the flags, the model, the data, the config, the checkpoint or initial weights, and
    /// that the output directory may be written; creates and changes nothing, except that with
    /// `--device cuda` it first binds this rank's threads to its GPU's CPUs
    /// ([`affinity::bind_for_gpu`]).
    pub fn from_args(args: Args) -> anyhow::Result<Setup> {
        let dist = job(&args)?;
        let env = settings::env::from_process()?;
        // First, before anything starts a thread (rayon's pool, the optimizer's): they inherit
        // the binding. The config is resolved later; its `cpu_bind` is looked up here.
        let flags = settings::from_flags(args.gpu, args.host);
        let bind = flags.cpu_bind.or(env.cpu_bind).or_else(|| config_cpu_bind(&args));
        let cpu_binding = (args.device == DeviceKind::Cuda)
            .then(|| affinity::bind_for_gpu(&dist, bind.unwrap_or(BindMode::Auto)))
            .flatten();
        let setup = Setup::for_rank(args, dist, env)?;
        Ok(Setup { cpu_binding, ..setup })
    }

    /// [`Setup::from_args`] for the rank `dist`, with `env` as what the environment asks for
    /// (the process environment is not read).
    pub(crate) fn for_rank(mut args: Args, dist: DistEnv, env: Requested) -> anyhow::Result<Setup> {
        let resume = match &args.resume {
            Some(arg) => Some(checkpoints::find(arg, args.out.as_deref())?),
            None => None,
        };
        if let Some(point) = &resume {
            default_to_saved(&mut args, &point.extra.config);
        }
        let saved = resume.as_ref().map(|point| (&point.extra, point.dir.as_path()));
        let data_arg =
            same_as_saved("--data", args.data.clone(), saved.map(|(e, d)| (e.data.clone(), d)))?
                .unwrap_or_else(|| "synthetic".to_owned());
        let spec = data::Spec::parse(&data_arg)?;
        let hf = args.init_from.as_deref().map(init::read).transpose()?;
        let model = choose_model(args.model.as_deref(), saved, hf.as_ref(), &spec)?;
        let seed =
            same_as_saved("--seed", args.seed, saved.map(|(e, d)| (e.seed, d)))?.unwrap_or(0);
        let steps = args.steps.get();
        let config = resolve_config(&args, &model, steps, dist.world_size)?;
        let flags = settings::from_flags(args.gpu, args.host);
        let settings = settings::resolve(flags, env, settings::from_config(&config.zeroflow));
        let attention = settings::attention(args.device, &model, &settings)?;
        let out = match &resume {
            Some(point) => resume_out(point, &args, &config, steps)?,
            None => {
                let out =
                    args.out.clone().unwrap_or_else(|| PathBuf::from("runs").join(utc_stamp()));
                check_out_dir(&out, args.force)?;
                if let Some((_, newest)) = checkpoints::list(&out)?.last() {
                    return Err(input(format!(
                        "--out {}: holds checkpoints of an earlier run ({}); continue it with \
                         --resume latest, or choose another --out",
                        out.display(),
                        newest.display()
                    )));
                }
                out
            }
        };
        let start = initial_state(resume, hf, &model, dist.world_size)?;
        let batch = &config.batch;
        let micro_steps = steps * batch.gradient_accumulation_steps;
        let shape = data::Shape {
            batch: batch.micro_batch_size_per_gpu,
            micro_steps,
            rank: dist.rank,
            world_size: dist.world_size,
        };
        let mut data = Data::open(&spec, &model, shape, seed)?;
        if let Start::Resume { point, .. } = &start {
            data.train.seek(point.extra.data_position).map_err(|e| {
                input(format!("--resume {}: the data position: {e}", point.dir.display()))
            })?;
        }
        Ok(Setup {
            device: args.device,
            model,
            data,
            data_arg,
            config,
            config_file: args.config.clone(),
            steps,
            eval_every: args.eval_every,
            log_every: args.log_every.get(),
            save_every: args.save_every,
            keep: args.keep.get(),
            out,
            seed,
            start,
            dist,
            cpu_binding: None,
            settings,
            attention,
        })
    }

    /// The step the run has already reached (0 unless resuming).
    pub fn start_step(&self) -> u64 {
        match &self.start {
            Start::Resume { point, .. } => point.extra.step,
            _ => 0,
        }
    }
}

/// This process's place in the job, from the launcher's environment. Several ranks need
/// `--device cuda` (one GPU each) and a run directory they agree on.
fn job(args: &Args) -> anyhow::Result<DistEnv> {
    let dist = DistEnv::from_process().map_err(InputError::from_display)?;
    if dist.world_size == 1 {
        return Ok(dist);
    }
    if args.device == DeviceKind::Cpu {
        return Err(input(format!(
            "this process is rank {} of {}, but --device cpu trains in one process: train on              several ranks with --device cuda (one GPU each)",
            dist.rank, dist.world_size
        )));
    }
    if args.out.is_none() && args.resume.is_none() {
        return Err(input(format!(
            "--out is needed with {} ranks: every rank writes its part of the checkpoints into              the same run directory (on a file system all hosts share)",
            dist.world_size
        )));
    }
    Ok(dist)
}

/// The model: `--model`, else the checkpoint's when resuming, else the shape in `--init-from`'s
/// config.json, else `tiny` with the data's vocabulary. A `--model` other than the checkpoint's is
/// an error.
fn choose_model(
    flag: Option<&str>,
    saved: Option<(&checkpoints::Extra, &Path)>,
    hf: Option<&init::HfModel>,
    spec: &data::Spec,
) -> anyhow::Result<GptConfig> {
    let given = match flag {
        Some(text) => {
            Some(text.parse::<GptConfig>().map_err(|e| input(format!("--model {text}: {e}")))?)
        }
        None => None,
    };
    Ok(same_as_saved("--model", given, saved.map(|(e, d)| (e.model, d)))?
        .or_else(|| hf.and_then(|hf| hf.config))
        .unwrap_or(GptConfig { vocab_size: spec.default_vocab(), ..GptConfig::TINY }))
}

/// How the run starts, with the initial weights checked against the model's tensors.
fn initial_state(
    resume: Option<ResumePoint>,
    hf: Option<init::HfModel>,
    model: &GptConfig,
    world_size: usize,
) -> anyhow::Result<Start> {
    let layout = flat_layout(model, world_size).context("cannot lay out the model")?;
    let tensors = hf_tensors(model, &layout)?;
    Ok(match (resume, hf) {
        (Some(point), _) => {
            let named = checkpoints_tensors(&tensors);
            let weights =
                checkpoint::flat_weights(&point.loaded, &named, layout.padded_len(), &point.dir)
                    .map_err(|e| checkpoints::resume_error(&e))?;
            Start::Resume { point: Box::new(point), weights }
        }
        (None, Some(hf)) => {
            let weights = hf.flat_weights(&tensors, layout.padded_len())?;
            Start::InitFrom { dir: hf.dir, weights }
        }
        (None, None) => Start::Seed,
    })
}

/// The checkpoint's tensors of a model: its Hugging Face names, shapes and flat ranges.
pub fn checkpoints_tensors(tensors: &[HfTensor]) -> Vec<NamedTensor> {
    tensors
        .iter()
        .map(|t| NamedTensor {
            name: t.name.clone(),
            shape: t.shape.clone(),
            flat: t.flat_range.clone(),
        })
        .collect()
}

/// When resuming, `--micro-batch`, `--accum` and `--lr` default to the checkpoint's values, so
/// that the command that started a run, with `--resume latest` added, continues it.
fn default_to_saved(args: &mut Args, saved: &serde_json::Value) {
    let number = |key: &str| saved.get(key).and_then(serde_json::Value::as_u64);
    args.micro_batch = args
        .micro_batch
        .or_else(|| number("train_micro_batch_size_per_gpu").and_then(NonZeroU64::new));
    args.accum =
        args.accum.or_else(|| number("gradient_accumulation_steps").and_then(NonZeroU64::new));
    args.lr = args
        .lr
        .or_else(|| saved.pointer("/optimizer/params/lr").and_then(serde_json::Value::as_f64));
}

/// The `zeroflow.cpu_bind` of `--config`, looked up before the config is resolved (binding comes
/// before anything else); `None` where the file does not say or cannot be read (resolving it
/// reports why).
fn config_cpu_bind(args: &Args) -> Option<BindMode> {
    let text = std::fs::read_to_string(args.config.as_ref()?).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    let name = value.pointer("/zeroflow/cpu_bind")?.as_str()?;
    settings::names::CPU_BIND.iter().find(|(n, _)| *n == name).map(|&(_, mode)| mode)
}

/// A flag's value when resuming: the checkpoint's, unless the flag says otherwise (an error).
fn same_as_saved<T: PartialEq + serde::Serialize>(
    flag: &str,
    given: Option<T>,
    saved: Option<(T, &Path)>,
) -> anyhow::Result<Option<T>> {
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
    args: &Args,
    config: &Config,
    steps: u64,
) -> anyhow::Result<PathBuf> {
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
        .map(|(key, _)| key.as_str())
        .collect();
    if !changed.is_empty() {
        // The default schedule is sized from --steps, so a longer resumed run changes it.
        tracing::warn!(
            "the config differs from the checkpoint's ({dir}) in {}; continuing with this run's",
            changed.join(", ")
        );
    }
    let at = point.extra.step;
    if steps <= at {
        return Err(input(format!(
            "--resume {dir}: the checkpoint is at step {at}, --steps is {steps}; pass a larger \
             --steps (the total, counting the checkpoint's)"
        )));
    }
    Ok(point.run_dir.clone())
}

/// An [`InputError`] with `message`.
fn input(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(InputError(message.into()))
}

/// The resolved config of the run: `--config` or [`DEFAULT_CONFIG`], its `"auto"` values filled
/// from the flags, for `world_size` ranks (`train_batch_size` is micro-batch × accumulation ×
/// ranks, as in DeepSpeed). A flag that contradicts a value written in the file is an error.
fn resolve_config(
    args: &Args,
    model: &GptConfig,
    steps: u64,
    world_size: usize,
) -> anyhow::Result<Config> {
    if let Some(lr) = args.lr
        && !(lr.is_finite() && lr > 0.0)
    {
        return Err(input(format!("--lr {lr}: the learning rate must be a positive number")));
    }
    let overrides = Overrides {
        micro_batch_size_per_gpu: Some(
            args.micro_batch.unwrap_or(NonZeroU64::new(DEFAULT_MICRO_BATCH).expect("non-zero")),
        ),
        gradient_accumulation_steps: args.accum,
        lr: Some(args.lr.unwrap_or(DEFAULT_LR)),
        total_num_steps: NonZeroU64::new(steps),
        warmup_num_steps: NonZeroU64::new((steps / 20).max(2)),
        hidden_size: NonZeroU64::new(model.d_model as u64),
        ..Overrides::default()
    };
    let world_size = u32::try_from(world_size)
        .ok()
        .and_then(NonZeroU32::new)
        .ok_or_else(|| input(format!("a job of {world_size} ranks is not supported")))?;
    let context = Context { world_size, overrides };
    let (resolved, name) = match &args.config {
        Some(file) => {
            let resolved = config::resolve_file(file, &context)
                .map_err(|e| input(format!("config {}: {e}", file.display())))?;
            (resolved, file.display().to_string())
        }
        None => {
            // The CUDA model computes in bf16; the CPU one in f32.
            let default = match args.device {
                DeviceKind::Cpu => DEFAULT_CONFIG.to_owned(),
                DeviceKind::Cuda => DEFAULT_CONFIG.replace(
                    r#""zero_optimization""#,
                    r#""bf16": { "enabled": true },
  "zero_optimization""#,
                ),
            };
            let resolved =
                config::resolve_str(&default, &context).expect("the default config is valid");
            (resolved, "the default config".to_owned())
        }
    };
    for warning in &resolved.warnings {
        tracing::warn!("{name}: {warning}");
    }
    for auto_value in &resolved.auto_values {
        tracing::debug!("{name}: {auto_value}");
    }
    let config = resolved.config;
    check_flags_agree(args, &config, &name)?;
    match (args.device, config.precision) {
        (DeviceKind::Cpu, MixedPrecision::Fp32)
        | (DeviceKind::Cuda, MixedPrecision::Bf16 { .. }) => {}
        (DeviceKind::Cpu, precision) => {
            let precision = format!("{:?}", precision.precision()).to_lowercase();
            return Err(input(format!(
                "{name} enables {precision}, but only fp32 works on the CPU: set \
                 {precision}.enabled to false (mixed precision needs --device cuda)"
            )));
        }
        (DeviceKind::Cuda, precision) => {
            let precision = format!("{:?}", precision.precision()).to_lowercase();
            return Err(input(format!(
                "{name} trains in {precision}, but the CUDA model computes in bf16: set \
                 bf16.enabled to true (and fp16.enabled to false)"
            )));
        }
    }
    Ok(config)
}

/// A flag that fills an `"auto"` must agree with the value the file writes.
fn check_flags_agree(args: &Args, config: &Config, name: &str) -> anyhow::Result<()> {
    let batch = &config.batch;
    let conflicts = [
        (
            "--micro-batch",
            args.micro_batch.map(|v| v.get() as f64),
            "train_micro_batch_size_per_gpu",
            batch.micro_batch_size_per_gpu as f64,
        ),
        (
            "--accum",
            args.accum.map(|v| v.get() as f64),
            "gradient_accumulation_steps",
            batch.gradient_accumulation_steps as f64,
        ),
        ("--lr", args.lr, "optimizer.params.lr", config.optimizer.lr),
    ];
    for (flag, given, key, resolved) in conflicts {
        if let Some(given) = given
            && given != resolved
        {
            return Err(input(format!(
                "{flag} {given} conflicts with {name}, where {key} is {resolved}; drop the flag \
                 or set {key} to \"auto\" in the config"
            )));
        }
    }
    Ok(())
}

/// Refuses an output directory that holds anything, unless `force`.
fn check_out_dir(out: &Path, force: bool) -> anyhow::Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(input(format!(
            "--out {}: exists and is not a directory; choose another --out",
            out.display()
        )));
    }
    let non_empty = out.is_dir()
        && std::fs::read_dir(out)
            .with_context(|| format!("cannot read {}", out.display()))?
            .next()
            .is_some();
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
