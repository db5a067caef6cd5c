//! This process's place in a job, from the environment a launcher leaves: torchrun's `RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` (what `zeroflow
//! launch` sets), or Slurm's `SLURM_PROCID`, `SLURM_LOCALID`, `SLURM_NTASKS`,
//! `SLURM_NTASKS_PER_NODE` under `srun`. Nothing set means a job of one.

use std::fmt;
use std::time::Duration;

/// How long the ranks wait for each other at the rendezvous unless
/// `ZEROFLOW_RENDEZVOUS_TIMEOUT` (seconds) says otherwise.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(120);

/// The variable that overrides [`DEFAULT_RENDEZVOUS_TIMEOUT`].
pub const RENDEZVOUS_TIMEOUT_VAR: &str = "ZEROFLOW_RENDEZVOUS_TIMEOUT";

/// The variable that turns on the step watchdog ([`super::Watchdog`]), in seconds.
pub const STEP_TIMEOUT_VAR: &str = "ZEROFLOW_STEP_TIMEOUT";

/// The variable that overrides `MASTER_PORT` for zeroflow's rendezvous: under torchrun, whose
/// agent holds `MASTER_PORT` itself.
pub const MASTER_PORT_VAR: &str = "ZEROFLOW_MASTER_PORT";

/// Where the ranks meet: rank 0 listens on this port, the others connect to this address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Master {
    pub addr: String,
    pub port: u16,
}

/// This process's rank in a job of `world_size` processes, `local_rank` of `local_world_size` on
/// its host (its GPU is `local_rank`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub rank: usize,
    pub local_rank: usize,
    pub world_size: usize,
    pub local_world_size: usize,
    /// Set when `world_size > 1`.
    pub master: Option<Master>,
    pub rendezvous_timeout: Duration,
    /// How long the training loop may go without progress (`ZEROFLOW_STEP_TIMEOUT`); no limit
    /// when unset.
    pub step_timeout: Option<Duration>,
}

/// A variable missing, malformed or contradicting another.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnvError {
    pub var: &'static str,
    pub reason: String,
}

impl fmt::Display for EnvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "environment variable {}: {}", self.var, self.reason)
    }
}

impl std::error::Error for EnvError {}

/// The names of one launcher's variables.
struct Names {
    rank: &'static str,
    local_rank: &'static str,
    world_size: &'static str,
    local_world_size: &'static str,
}

const TORCHRUN: Names = Names {
    rank: "RANK",
    local_rank: "LOCAL_RANK",
    world_size: "WORLD_SIZE",
    local_world_size: "LOCAL_WORLD_SIZE",
};

const SLURM: Names = Names {
    rank: "SLURM_PROCID",
    local_rank: "SLURM_LOCALID",
    world_size: "SLURM_NTASKS",
    local_world_size: "SLURM_NTASKS_PER_NODE",
};

impl DistEnv {
    /// A job of one process.
    pub fn single() -> DistEnv {
        DistEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master: None,
            rendezvous_timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
            step_timeout: None,
        }
    }

    /// Reads the variables through `lookup`: the binary passes the process environment (so that
    /// the library reads none itself), a test its own map. The torchrun names win over Slurm's;
    /// Slurm's count only when `SLURM_PROCID` is set (an `srun` task, not an allocation's shell).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<DistEnv, EnvError> {
        let lookup = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let rendezvous_timeout =
            seconds(&lookup, RENDEZVOUS_TIMEOUT_VAR)?.unwrap_or(DEFAULT_RENDEZVOUS_TIMEOUT);
        let step_timeout = seconds(&lookup, STEP_TIMEOUT_VAR)?;
        let names = if lookup(TORCHRUN.rank).is_some() || lookup(TORCHRUN.world_size).is_some() {
            &TORCHRUN
        } else if lookup(SLURM.rank).is_some() {
            &SLURM
        } else {
            return Ok(DistEnv { rendezvous_timeout, step_timeout, ..DistEnv::single() });
        };
        let number = |var: &'static str| -> Result<Option<usize>, EnvError> {
            let parse = |text: String| {
                let reason = format!("{text:?} is not a whole number");
                leading_count(&text).ok_or(EnvError { var, reason })
            };
            lookup(var).map(parse).transpose()
        };
        let (rank, world_size) =
            rank_and_world(names, number(names.rank)?, number(names.world_size)?)?;
        let local_rank = match number(names.local_rank)? {
            Some(local_rank) => local_rank,
            None if world_size == 1 => 0,
            None => {
                let reason = format!(
                    "not set in a job of {world_size} processes: each process needs the number \
                     of its GPU on its host"
                );
                return Err(EnvError { var: names.local_rank, reason });
            }
        };
        // Unknown: assume one host, which at worst gives each rank fewer CPU threads.
        let local_world_size = number(names.local_world_size)?.unwrap_or(world_size);
        if local_rank >= local_world_size {
            let reason = format!(
                "{local_rank} is not below the {local_world_size} processes on this host ({} = \
                 {local_world_size})",
                names.local_world_size
            );
            return Err(EnvError { var: names.local_rank, reason });
        }
        let master = if world_size > 1 { Some(master(&lookup)?) } else { None };
        Ok(DistEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master,
            rendezvous_timeout,
            step_timeout,
        })
    }

    /// This rank's share of the host's `cores` for the CPU optimizer: the cores divided evenly
    /// between the processes on the host, at least one.
    pub fn cpu_threads(&self, cores: usize) -> usize {
        (cores / self.local_world_size.max(1)).max(1)
    }
}

/// The rank and world size, both given and consistent.
fn rank_and_world(
    names: &Names,
    rank: Option<usize>,
    world_size: Option<usize>,
) -> Result<(usize, usize), EnvError> {
    let (rank, world_size) = match (rank, world_size) {
        (Some(rank), Some(world_size)) => (rank, world_size),
        (None, _) => {
            let reason = format!(
                "not set, but {} is: each process needs its rank (0 to {} - 1); start the \
                 processes with `zeroflow launch`, torchrun or srun",
                names.world_size, names.world_size
            );
            return Err(EnvError { var: names.rank, reason });
        }
        (Some(_), None) => {
            let reason = format!(
                "not set, but {} is: each process needs the number of processes",
                names.rank
            );
            return Err(EnvError { var: names.world_size, reason });
        }
    };
    if world_size == 0 {
        return Err(EnvError { var: names.world_size, reason: "must be at least 1".into() });
    }
    if rank >= world_size {
        let reason = format!(
            "{rank} is not a rank of a job of {world_size} ({} = {world_size}); ranks go from 0 \
             to {}",
            names.world_size,
            world_size - 1
        );
        return Err(EnvError { var: names.rank, reason });
    }
    Ok((rank, world_size))
}

fn master(lookup: &impl Fn(&str) -> Option<String>) -> Result<Master, EnvError> {
    let addr = lookup("MASTER_ADDR").ok_or_else(|| EnvError {
        var: "MASTER_ADDR",
        reason: "not set in a job of several processes: set it to the address of the host of \
                 rank 0 (under Slurm: `export MASTER_ADDR=$(scontrol show hostnames \
                 \"$SLURM_JOB_NODELIST\" | head -n 1)`)"
            .into(),
    })?;
    let var = if lookup(MASTER_PORT_VAR).is_some() { MASTER_PORT_VAR } else { "MASTER_PORT" };
    let text = lookup(var).ok_or_else(|| EnvError {
        var: "MASTER_PORT",
        reason: "not set in a job of several processes: set it to a free TCP port on the host \
                 of rank 0 (e.g. 29500)"
            .into(),
    })?;
    let port = text.trim().parse::<u16>().ok().filter(|&port| port > 0).ok_or_else(|| {
        EnvError { var, reason: format!("{text:?} is not a TCP port (1 to 65535)") }
    })?;
    Ok(Master { addr: addr.trim().to_owned(), port })
}

/// A duration in seconds from `var`, if set.
fn seconds(
    lookup: &impl Fn(&str) -> Option<String>,
    var: &'static str,
) -> Result<Option<Duration>, EnvError> {
    let Some(text) = lookup(var) else { return Ok(None) };
    let secs = text.trim().parse::<f64>().ok().filter(|secs| secs.is_finite() && *secs > 0.0);
    let reason = format!("{text:?} is not a positive number of seconds");
    secs.map(Duration::try_from_secs_f64)
        .and_then(Result::ok)
        .map(Some)
        .ok_or(EnvError { var, reason })
}

/// The whole number at the start of `text`: `"4"` and Slurm's `"4(x2)"` are 4.
fn leading_count(text: &str) -> Option<usize> {
    let text = text.trim();
    let digits = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let rest = &text[digits..];
    if !(rest.is_empty() || rest.starts_with("(x")) {
        return None;
    }
    text[..digits].parse().ok()
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::{DistEnv, EnvError, Master};

    fn read(vars: &[(&str, &str)]) -> Result<DistEnv, EnvError> {
        let map: HashMap<String, String> =
            vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_lookup(|name| map.get(name).cloned())
    }

    fn error_var(vars: &[(&str, &str)]) -> (&'static str, String) {
        let error = read(vars).expect_err("must be refused");
        (error.var, error.to_string())
    }

    const TORCHRUN_RANK_1: &[(&str, &str)] = &[
        ("RANK", "1"),
        ("LOCAL_RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn no_variables_mean_a_job_of_one() {
        assert_eq!(read(&[]).unwrap(), DistEnv::single());
        // An allocation's shell has SLURM_NTASKS but no SLURM_PROCID: still one process.
        assert_eq!(read(&[("SLURM_NTASKS", "4")]).unwrap(), DistEnv::single());
    }

    #[test]
    fn torchrun_variables_give_rank_gpu_and_master() {
        let env = read(TORCHRUN_RANK_1).unwrap();
        assert_eq!((env.rank, env.local_rank, env.world_size, env.local_world_size), (1, 1, 2, 2));
        assert_eq!(env.master, Some(Master { addr: "127.0.0.1".into(), port: 29500 }));
        assert_eq!(env.rendezvous_timeout, Duration::from_secs(120));
    }

    #[test]
    fn slurm_variables_are_the_fallback_and_torchrun_names_win() {
        let slurm = [
            ("SLURM_PROCID", "5"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "node-a"),
            ("MASTER_PORT", "29501"),
        ];
        let env = read(&slurm).unwrap();
        assert_eq!((env.rank, env.local_rank, env.world_size, env.local_world_size), (5, 1, 8, 4));
        let both: Vec<_> = slurm.iter().chain(TORCHRUN_RANK_1).copied().collect();
        assert_eq!(read(&both).unwrap().rank, 1);
    }

    #[test]
    fn world_size_without_rank_is_refused() {
        let (var, message) = error_var(&[("WORLD_SIZE", "2")]);
        assert_eq!(var, "RANK");
        assert!(message.contains("not set, but WORLD_SIZE is"), "{message}");
    }

    #[test]
    fn rank_without_world_size_is_refused() {
        assert_eq!(error_var(&[("RANK", "0")]).0, "WORLD_SIZE");
    }

    #[test]
    fn a_rank_at_or_above_the_world_size_is_refused() {
        let (var, message) = error_var(&[("RANK", "2"), ("WORLD_SIZE", "2")]);
        assert_eq!(var, "RANK");
        assert!(message.contains("2 is not a rank of a job of 2"), "{message}");
    }

    #[test]
    fn malformed_numbers_and_ports_are_refused() {
        assert_eq!(error_var(&[("RANK", "one"), ("WORLD_SIZE", "2")]).0, "RANK");
        assert_eq!(error_var(&[("RANK", "0"), ("WORLD_SIZE", "0")]).0, "WORLD_SIZE");
        let port = |p| {
            error_var(&[
                ("RANK", "0"),
                ("LOCAL_RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", p),
            ])
        };
        assert_eq!(port("70000").0, "MASTER_PORT");
        assert_eq!(port("0").0, "MASTER_PORT");
    }

    #[test]
    fn several_processes_need_local_rank_and_master() {
        let without = |name: &str| -> Vec<(&str, &str)> {
            TORCHRUN_RANK_1.iter().filter(|(k, _)| *k != name).copied().collect()
        };
        assert_eq!(error_var(&without("LOCAL_RANK")).0, "LOCAL_RANK");
        assert_eq!(error_var(&without("MASTER_ADDR")).0, "MASTER_ADDR");
        assert_eq!(error_var(&without("MASTER_PORT")).0, "MASTER_PORT");
        // One process needs neither.
        let env = read(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!((env.local_rank, env.master), (0, None));
    }

    #[test]
    fn zeroflow_master_port_wins_over_master_port() {
        let mut vars = TORCHRUN_RANK_1.to_vec();
        vars.push(("ZEROFLOW_MASTER_PORT", "29600"));
        assert_eq!(read(&vars).unwrap().master.unwrap().port, 29600);
        vars.pop();
        vars.push(("ZEROFLOW_MASTER_PORT", "x"));
        assert_eq!(error_var(&vars).0, "ZEROFLOW_MASTER_PORT");
    }

    #[test]
    fn a_local_rank_beyond_the_host_is_refused() {
        let mut vars = TORCHRUN_RANK_1.to_vec();
        vars.retain(|(k, _)| *k != "LOCAL_RANK");
        vars.push(("LOCAL_RANK", "2"));
        assert_eq!(error_var(&vars).0, "LOCAL_RANK");
    }

    #[test]
    fn the_rendezvous_timeout_comes_from_its_variable() {
        let env = read(&[("ZEROFLOW_RENDEZVOUS_TIMEOUT", "2.5")]).unwrap();
        assert_eq!(env.rendezvous_timeout, Duration::from_millis(2500));
        assert_eq!(env.step_timeout, None);
        let env = read(&[("ZEROFLOW_STEP_TIMEOUT", "600")]).unwrap();
        assert_eq!(env.step_timeout, Some(Duration::from_secs(600)));
        assert_eq!(error_var(&[("ZEROFLOW_STEP_TIMEOUT", "soon")]).0, super::STEP_TIMEOUT_VAR);
        assert_eq!(
            error_var(&[("ZEROFLOW_RENDEZVOUS_TIMEOUT", "-1")]).0,
            super::RENDEZVOUS_TIMEOUT_VAR
        );
    }

    #[test]
    fn host_cores_are_shared_between_the_local_ranks() {
        let env = read(TORCHRUN_RANK_1).unwrap();
        assert_eq!(env.cpu_threads(32), 16);
        assert_eq!(env.cpu_threads(1), 1);
        assert_eq!(DistEnv::single().cpu_threads(16), 16);
    }
}
