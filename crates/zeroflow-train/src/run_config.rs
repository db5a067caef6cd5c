//! The one resolution of a run's config, shared by `zeroflow train` and `zeroflow config`: the
//! file (or the default config), its `"auto"` values filled from the flags and the model, checked
//! against the flags and the device. `zeroflow config` with `train`'s flags therefore shows what
//! `train` will use, value for value.

use crate::setup::AutoValues;
use std::num::{NonZeroU32, NonZeroU64};
use std::path::Path;

use zeroflow_core::config::{self, Config, ConfigError, Context, MixedPrecision, Overrides};

use crate::DeviceKind;
use crate::error::{Result, input};

/// Sequences per micro-step when neither the flags nor the config say.
pub const DEFAULT_MICRO_BATCH: u64 = 16;
/// The peak learning rate when neither the flags nor the config say, for a model trained from
/// scratch.
pub const DEFAULT_LR: f64 = 3e-3;
/// The peak learning rate when neither the flags nor the config say, for a trained model
/// (`--init-from`): [`DEFAULT_LR`] would undo much of what it learned in a few steps; 2e-5 is
/// what full fine-tunes of 1–8 B models commonly use.
pub const DEFAULT_FINE_TUNE_LR: f64 = 2e-5;

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
    "params": { "lr": "auto", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": "auto" }
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

/// What the command line says about a run's config.
#[derive(Clone, Copy, Debug)]
pub struct RunFlags<'a> {
    /// `--config`; `None`: the resumed checkpoint's config (`saved_config`), else the default
    /// config.
    pub config_file: Option<&'a Path>,
    /// The config a resumed checkpoint's run resolved, used when `--config` is not given.
    pub saved_config: Option<&'a serde_json::Value>,
    /// `--device`; `None` (only `zeroflow config` without `--device`): the precision is not
    /// checked against a device, and an `"auto"` precision stays fp32.
    pub device: Option<DeviceKind>,
    /// The flags that fill the config's `"auto"` values (`--micro-batch`, `--accum`, `--lr`,
    /// `--warmup`, `--weight-decay`); each given one must agree with a value the file writes.
    pub auto: AutoValues,
    /// A resumed checkpoint's values of the same (its run's resolved config): they fill what
    /// `auto` leaves unset, so that a run resumed with its own command continues with what its
    /// flags set; unlike a flag, they yield to a value a `--config` file writes.
    pub resumed: AutoValues,
    /// Optimizer steps of the run (fills `total_num_steps`; 5% of it is the default warm-up).
    pub steps: u64,
    pub world_size: usize,
    /// The model's hidden size (fills an `"auto"` `reduce_bucket_size` with its square).
    pub hidden_size: usize,
    /// The weights come from a trained model (`--init-from`): an `"auto"` lr without `--lr` is
    /// [`DEFAULT_FINE_TUNE_LR`], not [`DEFAULT_LR`].
    pub fine_tune: bool,
}

/// The resolved config, with the name to show for where it came from.
#[derive(Debug)]
pub struct RunConfig {
    pub resolved: config::Resolved,
    /// `the default config` or the file's path.
    pub name: String,
}

/// Resolves the run's config: `--config` or `DEFAULT_CONFIG`, its `"auto"` values filled from
/// the flags, for `world_size` ranks (`train_batch_size` is micro-batch × accumulation × ranks,
/// as in DeepSpeed). A problem with the file is reported as `config FILE: <json.path>: …`; a flag
/// that contradicts a value written in the file is an error, and so is a precision the device
/// cannot run.
pub fn resolve(flags: &RunFlags<'_>) -> Result<RunConfig> {
    check_flag_values(flags)?;
    let run = resolve_unchecked(flags).map_err(|e| match (e, flags.config_file) {
        // The message names the file already.
        (e @ ConfigError::Unreadable { .. }, _) => input(e.to_string()),
        (e, Some(file)) => input(format!("config {}: {e}", file.display())),
        (e, None) if flags.saved_config.is_some() => input(format!("the checkpoint's config: {e}")),
        (e, None) => input(e.to_string()),
    })?;
    check(flags, &run)?;
    Ok(run)
}

/// The middle of [`resolve`]: the config read and its `"auto"` values filled, not yet checked
/// against the flags and the device. `zeroflow config` calls [`check_flag_values`], this
/// (reporting its errors as they are: `<json.path>: …`), then [`check`].
pub fn resolve_unchecked(flags: &RunFlags<'_>) -> Result<RunConfig, ConfigError> {
    let auto = flags.auto.or(flags.resumed);
    let overrides = Overrides {
        micro_batch_size_per_gpu: Some(
            auto.micro_batch.unwrap_or(NonZeroU64::new(DEFAULT_MICRO_BATCH).expect("non-zero")),
        ),
        gradient_accumulation_steps: auto.accum,
        lr: Some(auto.lr.unwrap_or(if flags.fine_tune {
            DEFAULT_FINE_TUNE_LR
        } else {
            DEFAULT_LR
        })),
        weight_decay: auto.weight_decay,
        total_num_steps: NonZeroU64::new(flags.steps),
        warmup_num_steps: auto.warmup.or(NonZeroU64::new((flags.steps / 20).max(2))),
        hidden_size: NonZeroU64::new(flags.hidden_size as u64),
        // As Hugging Face fills "auto" precisions from --bf16: the CUDA model computes in bf16.
        precision: flags.device.map(|device| match device {
            DeviceKind::Cpu => config::Precision::Fp32,
            DeviceKind::Cuda => config::Precision::Bf16,
        }),
        ..Overrides::default()
    };
    let world_size = u32::try_from(flags.world_size)
        .ok()
        .and_then(NonZeroU32::new)
        .expect("the job's world size is at least 1 and fits a u32");
    let context = Context { world_size, overrides };
    Ok(match (flags.config_file, flags.saved_config) {
        (Some(file), _) => RunConfig {
            resolved: config::resolve_file(file, &context)?,
            name: file.display().to_string(),
        },
        (None, Some(saved)) => RunConfig {
            resolved: config::resolve_str(&saved.to_string(), &context)?,
            name: "the checkpoint's config".to_owned(),
        },
        (None, None) => {
            // The CUDA model computes in bf16; the CPU one in f32.
            let default = match flags.device {
                Some(DeviceKind::Cuda) => DEFAULT_CONFIG.replace(
                    r#""zero_optimization""#,
                    r#""bf16": { "enabled": true },
  "zero_optimization""#,
                ),
                _ => DEFAULT_CONFIG.to_owned(),
            };
            let resolved =
                config::resolve_str(&default, &context).expect("the default config is valid");
            RunConfig { resolved, name: "the default config".to_owned() }
        }
    })
}

/// The end of [`resolve`]: the flags' agreement with the values the file writes, and the
/// precision against the device.
pub fn check(flags: &RunFlags<'_>, run: &RunConfig) -> Result<()> {
    check_flags_agree(flags, &run.resolved.config, &run.name)?;
    if let Some(device) = flags.device {
        check_precision(device, run.resolved.config.precision, &run.name)?;
    }
    Ok(())
}

/// The start of [`resolve`]: the flags' own values.
pub fn check_flag_values(flags: &RunFlags<'_>) -> Result<()> {
    if u32::try_from(flags.world_size).is_err() || flags.world_size == 0 {
        return Err(input(format!("a job of {} ranks is not supported", flags.world_size)));
    }
    if let Some(lr) = flags.auto.lr
        && !(lr.is_finite() && lr > 0.0)
    {
        return Err(input(format!("--lr {lr}: the learning rate must be a positive number")));
    }
    if let Some(decay) = flags.auto.weight_decay
        && !(decay.is_finite() && decay >= 0.0)
    {
        return Err(input(format!("--weight-decay {decay}: must be a number of at least 0")));
    }
    if let Some(warmup) = flags.auto.warmup
        && warmup.get() > flags.steps
    {
        return Err(input(format!(
            "--warmup {warmup} is longer than the run (--steps {}); give at most --steps",
            flags.steps
        )));
    }
    Ok(())
}

/// The precision must be one the device runs; the message names the key to change.
fn check_precision(device: DeviceKind, precision: MixedPrecision, name: &str) -> Result<()> {
    match (device, precision) {
        (DeviceKind::Cpu, MixedPrecision::Fp32)
        | (DeviceKind::Cuda, MixedPrecision::Bf16 { .. }) => Ok(()),
        (DeviceKind::Cpu, precision) => {
            let precision = format!("{:?}", precision.precision()).to_lowercase();
            Err(input(format!(
                "{name} enables {precision} (\"{precision}\": {{\"enabled\": true}}), but only fp32 \
                 works on the CPU: set {precision}.enabled to false, or use a CPU config such as \
                 examples/configs/cpu-zero2-offload.json, or train with --device cuda"
            )))
        }
        (DeviceKind::Cuda, precision) => {
            let precision = format!("{:?}", precision.precision()).to_lowercase();
            Err(input(format!(
                "{name} trains in {precision}, but the CUDA model computes in bf16: set \
                 bf16.enabled to true (and fp16.enabled to false)"
            )))
        }
    }
}

/// A flag that fills an `"auto"` must agree with the value the file writes.
fn check_flags_agree(flags: &RunFlags<'_>, config: &Config, name: &str) -> Result<()> {
    let batch = &config.batch;
    let warmup = match config.scheduler {
        Some(config::Scheduler::WarmupLr(warmup))
        | Some(config::Scheduler::WarmupDecayLr { warmup, .. }) => Some(warmup.num_steps as f64),
        Some(config::Scheduler::WarmupCosineLr(cosine)) => Some(cosine.warmup_num_steps as f64),
        None => None,
    };
    let conflicts = [
        (
            "--micro-batch",
            flags.auto.micro_batch.map(|v| v.get() as f64),
            "train_micro_batch_size_per_gpu",
            Some(batch.micro_batch_size_per_gpu as f64),
        ),
        (
            "--accum",
            flags.auto.accum.map(|v| v.get() as f64),
            "gradient_accumulation_steps",
            Some(batch.gradient_accumulation_steps as f64),
        ),
        ("--lr", flags.auto.lr, "optimizer.params.lr", Some(config.optimizer.lr)),
        (
            "--weight-decay",
            flags.auto.weight_decay,
            "optimizer.params.weight_decay",
            Some(config.optimizer.weight_decay),
        ),
        (
            "--warmup",
            // DeepSpeed raises a warm-up of 1 to 2.
            flags.auto.warmup.map(|v| v.get().max(2) as f64),
            "scheduler.params.warmup_num_steps",
            warmup,
        ),
    ];
    for (flag, given, key, resolved) in conflicts {
        if let Some(given) = given
            && Some(given) != resolved
        {
            let resolved = resolved.map_or("absent (no scheduler)".to_owned(), |v| v.to_string());
            return Err(input(format!(
                "{flag} {given} conflicts with {name}, where {key} is {resolved}; drop the flag \
                 or set {key} to \"auto\" in the config"
            )));
        }
    }
    Ok(())
}
