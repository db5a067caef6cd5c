//! `zeroflow train`: what a run is made of ([`Setup`], checked from the flags before anything is
//! written), the training loop ([`run`]), and what it leaves behind (metrics, plot, summary).

mod data;
mod output;
mod plot;
mod run;
mod schedule;

use std::num::{NonZeroU32, NonZeroU64};
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use zeroflow_core::config::{self, Config, Context, MixedPrecision, Overrides};
use zeroflow_gpt::GptConfig;

use crate::InputError;
use crate::cmd::train::Args;

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

/// Everything a run needs, checked.
#[derive(Debug)]
pub struct Setup {
    pub model: GptConfig,
    pub data: Data,
    pub config: Config,
    /// Where `config` came from, for the summary.
    pub config_file: Option<PathBuf>,
    pub steps: u64,
    pub eval_every: u64,
    pub log_every: u64,
    pub out: PathBuf,
    pub seed: u64,
}

impl Setup {
    /// Checks the flags, the model, the data and the config, and that the output directory may be
    /// written; creates nothing.
    pub fn from_args(args: Args) -> anyhow::Result<Setup> {
        if args.device == DeviceKind::Cuda {
            return Err(input("the CUDA model is not built yet; use --device cpu"));
        }
        let spec = data::Spec::parse(&args.data)?;
        let model = match &args.model {
            Some(text) => {
                text.parse::<GptConfig>().map_err(|e| input(format!("--model {text}: {e}")))?
            }
            None => GptConfig { vocab_size: spec.default_vocab(), ..GptConfig::TINY },
        };
        let steps = args.steps.get();
        let config = resolve_config(&args, &model, steps)?;
        let out = match &args.out {
            Some(dir) => dir.clone(),
            None => PathBuf::from("runs").join(utc_stamp()),
        };
        check_out_dir(&out, args.force)?;
        let batch = &config.batch;
        let micro_steps = steps * batch.gradient_accumulation_steps;
        let data =
            Data::open(&spec, &model, batch.micro_batch_size_per_gpu, micro_steps, args.seed)?;
        Ok(Setup {
            model,
            data,
            config,
            config_file: args.config.clone(),
            steps,
            eval_every: args.eval_every,
            log_every: args.log_every.get(),
            out,
            seed: args.seed,
        })
    }
}

/// An [`InputError`] with `message`.
fn input(message: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(InputError(message.into()))
}

/// The resolved config of the run: `--config` or [`DEFAULT_CONFIG`], its `"auto"` values filled
/// from the flags. A flag that contradicts a value written in the file is an error.
fn resolve_config(args: &Args, model: &GptConfig, steps: u64) -> anyhow::Result<Config> {
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
    let context = Context { world_size: NonZeroU32::MIN, overrides };
    let (resolved, name) = match &args.config {
        Some(file) => {
            let resolved = config::resolve_file(file, &context)
                .map_err(|e| input(format!("config {}: {e}", file.display())))?;
            (resolved, file.display().to_string())
        }
        None => (
            config::resolve_str(DEFAULT_CONFIG, &context).expect("the default config is valid"),
            "the default config".to_owned(),
        ),
    };
    for warning in &resolved.warnings {
        tracing::warn!("{name}: {warning}");
    }
    for auto_value in &resolved.auto_values {
        tracing::debug!("{name}: {auto_value}");
    }
    let config = resolved.config;
    check_flags_agree(args, &config, &name)?;
    if config.precision != MixedPrecision::Fp32 {
        let precision = format!("{:?}", config.precision.precision()).to_lowercase();
        return Err(input(format!(
            "{name} enables {precision}, but only fp32 works on the CPU: set {precision}.enabled \
             to false (mixed precision needs --device cuda)"
        )));
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
