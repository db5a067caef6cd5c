//! `zeroflow dist-check` (hidden): a stand-in for a rank of a job, for the tests of `zeroflow
//! launch` and of the side channel. It prints where it stands (stdout and stderr), optionally
//! meets the other ranks exactly as `train` does, then works (sleeps) or fails as told, without
//! needing a GPU.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use signal_hook::consts::{SIGINT, SIGTERM};

use crate::error::Exit;
use zeroflow_train::dist::{self, DistEnv};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Meet the other ranks (rendezvous and side channel, as `train --device cuda` does) first.
    #[arg(long)]
    pub join: bool,
    /// The rank that fails.
    #[arg(long, value_name = "R")]
    pub fail_rank: Option<usize>,
    /// Milliseconds after start-up (and the rendezvous) before it fails.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub fail_after_ms: u64,
    /// The failing rank's exit status.
    #[arg(long, value_name = "CODE", default_value_t = 1)]
    pub fail_code: u8,
    /// The failing rank kills itself with SIGKILL instead of exiting.
    #[arg(long)]
    pub fail_by_kill: bool,
    /// Milliseconds the other ranks work (as if in a collective) before ending normally.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub work_ms: u64,
    /// While working, SIGINT or SIGTERM ends the work early and normally (as `train` does) and
    /// is reported; without it they end the process.
    #[arg(long)]
    pub catch_signals: bool,
    /// Keep working after SIGTERM (a rank that does not stop when asked).
    #[arg(long)]
    pub ignore_sigterm: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let env = DistEnv::from_lookup(|name| std::env::var(name).ok())
        .map_err(crate::InputError::from_display)?;
    let me = env.rank;
    let signal = Arc::new(AtomicBool::new(false));
    if args.catch_signals || args.ignore_sigterm {
        let caught = if args.ignore_sigterm { vec![SIGTERM] } else { vec![SIGINT, SIGTERM] };
        for s in caught {
            signal_hook::flag::register(s, Arc::clone(&signal)).context("signals")?;
        }
    }
    let master = env.master.as_ref().map_or("none".into(), |m| format!("{}:{}", m.addr, m.port));
    let nvls = std::env::var(zeroflow_device::cuda::nccl::NVLS_ENV).unwrap_or_default();
    println!(
        "rank {me} of {} (local {} of {}), master {master}, NCCL_NVLS_ENABLE={nvls}",
        env.world_size, env.local_rank, env.local_world_size
    );
    eprintln!("rank {me}: stderr works");
    println!("rank {me}: pid {}", std::process::id());
    let group = if args.join {
        let (payload, mut group) = dist::join(&env, || Ok(b"dist-check".to_vec()))?;
        anyhow::ensure!(payload == b"dist-check", "rank {me} received another payload");
        group.exchange(false)?;
        println!("rank {me}: joined");
        Some(group)
    } else {
        None
    };
    if args.fail_rank == Some(me) {
        std::thread::sleep(Duration::from_millis(args.fail_after_ms));
        if args.fail_by_kill {
            let pid = rustix::process::getpid();
            rustix::process::kill_process(pid, rustix::process::Signal::KILL)?;
        }
        return Err(anyhow::Error::new(Exit {
            code: args.fail_code,
            message: format!("rank {me} fails as told"),
        }));
    }
    // The work below never ticks: with ZEROFLOW_STEP_TIMEOUT shorter than it, the watchdog fires.
    let _watchdog = dist::step_watchdog(&env)?;
    let end = Instant::now() + Duration::from_millis(args.work_ms);
    while Instant::now() < end {
        if signal.load(Ordering::SeqCst) && !args.ignore_sigterm {
            println!("rank {me}: stopping on a signal");
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    if let Some(group) = group {
        group.finish()?;
    }
    println!("rank {me}: done");
    Ok(())
}
