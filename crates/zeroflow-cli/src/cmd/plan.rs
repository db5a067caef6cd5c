//! `zeroflow plan`: the memory plan of a `train` command ([`zeroflow_train::plan`]), from the
//! same arguments, computed before anything is read or allocated.

use zeroflow_train::dist::DistEnv;

use crate::InputError;
use crate::settings;

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    train: super::train::Args,
    /// Print one JSON object (with gpu_total_bytes and host_total_bytes) instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    let dist =
        DistEnv::from_lookup(|name| std::env::var(name).ok()).map_err(InputError::from_display)?;
    let env = settings::env::from_process()?;
    let (plan, machine) = zeroflow_train::setup::plan(args.train.options(), dist, env)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan.to_json(&machine))?);
    } else {
        print!("{}", plan.table(&machine));
    }
    Ok(())
}
