//! `zeroflow plan`: the memory plan of a `train` command ([`zeroflow_train::plan`]), from the
//! same arguments, computed before anything is read or allocated; against this machine's memory,
//! or another's (`--gpu-memory`, `--host-memory`: will it fit the machine I am about to rent?).

use zeroflow_train::DeviceKind;
use zeroflow_train::dist::DistEnv;
use zeroflow_train::plan::GivenMemory;

use crate::InputError;
use crate::settings;

/// The help heading of `plan`'s own options (after `train`'s).
const THE_PLAN: &str = "The plan";

#[derive(Debug, clap::Args)]
pub struct PlanArgs {
    #[command(flatten)]
    train: super::train::Args,
    /// Print one JSON object (with gpu_total_bytes and host_total_bytes) instead of the table.
    #[arg(long, help_heading = THE_PLAN)]
    json: bool,
    /// Plan for a GPU of this much memory, with nothing else on it, instead of this machine's
    /// (which then needs no GPU): 80 (GiB), 80GiB, 94GB, 81559MiB. With --device cuda. The
    /// default device share (`fit`) is chosen for it.
    #[arg(long, help_heading = THE_PLAN, value_name = "SIZE", value_parser = parse_size)]
    gpu_memory: Option<u64>,
    /// Plan for a host with this much memory available instead of what this machine has: 256
    /// (GiB), 512GiB, 1TB.
    #[arg(long, help_heading = THE_PLAN, value_name = "SIZE", value_parser = parse_size)]
    host_memory: Option<u64>,
    /// Plan rank 0 of a job of N processes (one per GPU) on each of --nnodes hosts, as `zeroflow
    /// launch --nproc-per-node N` starts them: the optimizer partitioned over them, the host's
    /// memory shared by its N. Default: the launcher's environment, else one process.
    #[arg(long, help_heading = THE_PLAN, value_name = "N")]
    nproc_per_node: Option<std::num::NonZeroUsize>,
    /// With --nproc-per-node: the hosts of the job.
    #[arg(
        long,
        help_heading = THE_PLAN,
        value_name = "M",
        requires = "nproc_per_node",
        default_value = "1"
    )]
    nnodes: std::num::NonZeroUsize,
}

pub fn run(args: PlanArgs) -> anyhow::Result<()> {
    args.train.check_mode()?;
    let dist = match args.nproc_per_node {
        Some(per_node) => DistEnv {
            world_size: per_node.get() * args.nnodes.get(),
            local_world_size: per_node.get(),
            ..DistEnv::single()
        },
        None => DistEnv::from_lookup(|name| std::env::var(name).ok())
            .map_err(InputError::from_display)?,
    };
    let env = settings::env::from_process()?;
    let options = args.train.options();
    if args.gpu_memory.is_some() && options.device != DeviceKind::Cuda {
        return Err(InputError::from_display(
            "--gpu-memory plans a GPU's memory: add --device cuda",
        ));
    }
    let given = GivenMemory { gpu: args.gpu_memory, host: args.host_memory };
    let (plan, machine) = zeroflow_train::setup::plan(options, dist, env, given)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&plan.to_json(&machine))?);
    } else {
        print!("{}", plan.table(&machine));
    }
    Ok(())
}

/// A size of memory: a number of GiB, or a number with its unit (KiB, MiB, GiB, TiB and KB, MB,
/// GB, TB; case and a space between do not matter).
fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(text.len());
    let (number, unit) = (&text[..split], text[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "g" | "gib" => f64::from(1u32 << 30),
        "kib" => 1024.0,
        "mib" => f64::from(1u32 << 20),
        "tib" => f64::from(1u32 << 30) * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "{text:?}: the unit {unit:?} is none of GiB, GB, MiB, MB, TiB, TB"
            ));
        }
    };
    match number.parse::<f64>() {
        Ok(value) if value > 0.0 && (value * scale) < u64::MAX as f64 => Ok((value * scale) as u64),
        _ => Err(format!("{text:?}: not a positive size (say 80, 80GiB or 94GB)")),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_are_gib_by_default_or_in_their_unit() {
        let gib = 1u64 << 30;
        assert_eq!(parse_size("80"), Ok(80 * gib));
        assert_eq!(parse_size("80GiB"), Ok(80 * gib));
        assert_eq!(parse_size("94 GB"), Ok(94_000_000_000));
        assert_eq!(parse_size("81559MiB"), Ok(81_559 << 20));
        assert_eq!(parse_size("1.5TiB"), Ok(1536 * gib));
        assert_eq!(parse_size("0.5"), Ok(gib / 2));
        for bad in ["", "0", "GiB", "80 GiBs", "-1", "1e3"] {
            assert!(parse_size(bad).is_err(), "{bad:?} was taken");
        }
    }
}
