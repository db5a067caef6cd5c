//! `zeroflow config FILE`: validate a DeepSpeed JSON config and print its resolved values, as
//! `zeroflow train` with the same flags would resolve it (one code path: [`run_config::resolve`]).
//!
//! The resolved config goes to stdout as pretty JSON under DeepSpeed's key names; warnings
//! (`warning: …`) and the values that `"auto"` entries became (`note: …`) go to stderr. Any
//! problem with the file is an [`InputError`]: `error: <json.path>: <message>` and exit code 2.

use std::io::{self, Write};
use std::num::{NonZeroU32, NonZeroU64};
use std::path::PathBuf;

use zeroflow_gpt::GptConfig;
use zeroflow_train::ModelSpec;

use crate::InputError;
use crate::cmd::train::DEFAULT_STEPS;
use crate::train::DeviceFlag;
use zeroflow_train::run_config::{self, RunFlags};
use zeroflow_train::setup::AutoValues;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The DeepSpeed JSON config file.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Data-parallel world size that the batch sizes are derived for.
    #[arg(long, value_name = "N", default_value_t = NonZeroU32::MIN)]
    pub world_size: NonZeroU32,
    /// The device `train` would run on: checks the precision against it and fills an "auto"
    /// bf16/fp16 as `train --device` does. Default: not checked, "auto" precisions off.
    #[arg(long, value_enum)]
    pub device: Option<DeviceFlag>,
    /// Model size or JSON shape, as `train --model` (an "auto" reduce_bucket_size is its hidden
    /// size squared). Default: tiny.
    #[arg(long, value_name = "NAME|JSON")]
    pub model: Option<String>,
    /// Optimizer steps, as `train --steps` (fills an "auto" total_num_steps; 5% of it is the
    /// default warm-up).
    #[arg(long, value_name = "N", default_value_t = NonZeroU64::new(DEFAULT_STEPS).expect("non-zero"))]
    pub steps: NonZeroU64,
    #[command(flatten)]
    pub auto: crate::cmd::train::AutoFlags,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = match &args.model {
        Some(text) => ModelSpec::parse(text)
            .map_err(|e| InputError::from_display(format!("--model {text}: {e}")))?,
        None => ModelSpec::Gpt2(GptConfig::TINY),
    };
    let flags = RunFlags {
        config_file: Some(&args.file),
        saved_config: None,
        device: args.device.map(Into::into),
        auto: args.auto.values(),
        resumed: AutoValues::default(),
        steps: args.steps.get(),
        world_size: args.world_size.get() as usize,
        hidden_size: model.hidden_size(),
        fine_tune: false,
    };
    run_config::check_flag_values(&flags)?;
    let run = run_config::resolve_unchecked(&flags).map_err(InputError::from_display)?;
    run_config::check(&flags, &run)?;
    let resolved = run.resolved;
    let mut stderr = io::stderr().lock();
    for warning in &resolved.warnings {
        // A closed stderr must not turn a valid config into a failure.
        let _ = writeln!(stderr, "warning: {warning}");
    }
    for auto_value in &resolved.auto_values {
        let _ = writeln!(stderr, "note: {auto_value}");
    }
    print_ignoring_closed_pipe(&resolved.config.to_resolved_json())
}

/// Prints to stdout; a reader that went away early (`zeroflow config x.json | head`) is not an
/// error.
fn print_ignoring_closed_pipe(text: &str) -> anyhow::Result<()> {
    match writeln!(io::stdout().lock(), "{text}") {
        Err(error) if error.kind() != io::ErrorKind::BrokenPipe => Err(error.into()),
        _ => Ok(()),
    }
}
