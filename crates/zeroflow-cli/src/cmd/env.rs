//! `zeroflow env`: what this machine is and what zeroflow found on it
//! (`zeroflow_train::machine`).

pub use zeroflow_train::machine::text_lines;

/// Print versions, devices, libraries, host cores and memory.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The environment as one JSON object; `zeroflow stress` and the benchmarks embed it.
pub fn collect() -> serde_json::Value {
    zeroflow_train::machine::describe(env!("CARGO_PKG_VERSION"), env!("ZEROFLOW_GIT_COMMIT"))
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let env = collect();
    if args.json {
        println!("{}", serde_json::to_string_pretty(&env)?);
        return Ok(());
    }
    for line in text_lines(&env) {
        println!("{line}");
    }
    Ok(())
}
