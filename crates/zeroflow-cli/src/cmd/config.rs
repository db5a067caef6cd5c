//! `zeroflow config FILE`: validate a DeepSpeed JSON config and print its resolved values.
//!
//! The resolved config goes to stdout as pretty JSON under DeepSpeed's key names; warnings
//! (`warning: …`) and the values that `"auto"` entries became (`note: …`) go to stderr. Any
//! problem with the file is an [`InputError`]: `error: <json.path>: <message>` and exit code 2.

use std::io::{self, Write};
use std::num::NonZeroU32;
use std::path::PathBuf;

use zeroflow_core::config::{self, Context, Overrides};

use crate::InputError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The DeepSpeed JSON config file.
    #[arg(value_name = "FILE")]
    pub file: PathBuf,
    /// Data-parallel world size that the batch sizes are derived for.
    #[arg(long, value_name = "N", default_value_t = NonZeroU32::MIN)]
    pub world_size: NonZeroU32,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let context = Context { world_size: args.world_size, overrides: Overrides::default() };
    let resolved = config::resolve_file(&args.file, &context).map_err(InputError::from_display)?;
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
