//! Several processes training together, one per GPU: where this process stands in the job
//! ([`DistEnv`], from the launcher's environment), how the processes meet ([`rendezvous`]: rank 0
//! hands out the NCCL id), and the side channel that stays open beside NCCL ([`Group`]: barriers,
//! and the watch that ends every rank when one is lost, since NCCL would wait for it forever), and
//! where each rank's CPU optimizer runs ([`affinity`]: on the CPUs near its GPU).

pub mod affinity;
pub mod env;
pub mod group;
pub mod rendezvous;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;
pub mod watchdog;

use std::sync::Arc;

pub use env::DistEnv;
pub use group::{Group, Heartbeat, Lost, OnLost};
pub use rendezvous::RendezvousError;
pub use watchdog::Watchdog;

/// Why a process could not join its job, or start its watchdog.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The ranks did not meet.
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    /// Rank `rank` met the others but could not start the side channel's threads and sockets.
    #[error("rank {rank}: cannot start the side channel to the other ranks: {source}")]
    SideChannel { rank: usize, source: std::io::Error },
    /// The step watchdog's thread could not start.
    #[error("rank {rank}: cannot start the step watchdog: {source}")]
    Watchdog { rank: usize, source: std::io::Error },
}

/// The exit status of a rank that ends because another rank was lost. `zeroflow launch` names
/// the rank that failed first rather than the ones that followed it with this status.
pub const LOST_RANK_EXIT: i32 = 3;

/// The exit status of a rank whose training loop made no progress for `ZEROFLOW_STEP_TIMEOUT`.
pub const STALLED_EXIT: i32 = 4;

/// Meets the other ranks of `env`'s job: rank 0 calls `payload` (the NCCL id's bytes) and every
/// rank returns them, with the side channel started. When a rank is lost, this process prints
/// which and exits at once with [`LOST_RANK_EXIT`], whatever its main thread is doing (it may be
/// waiting in a collective that will never finish).
pub fn join(
    env: &DistEnv,
    payload: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<(Vec<u8>, Group), DistError> {
    join_with(env, payload, exit_on_lost(env.rank))
}

/// [`join`] with another reaction to a lost rank (tests: ranks as threads of one process).
pub fn join_with(
    env: &DistEnv,
    payload: impl FnOnce() -> Result<Vec<u8>, String>,
    on_lost: OnLost,
) -> Result<(Vec<u8>, Group), DistError> {
    let master =
        env.master.clone().unwrap_or_else(|| env::Master { addr: "127.0.0.1".into(), port: 0 });
    let spec = rendezvous::Spec {
        rank: env.rank,
        world_size: env.world_size,
        master,
        timeout: env.rendezvous_timeout,
    };
    if env.world_size > 1 {
        tracing::info!(
            "rank {} of {}: meeting the others at {}:{} (timeout {} s)",
            env.rank,
            env.world_size,
            spec.master.addr,
            spec.master.port,
            spec.timeout.as_secs_f64()
        );
    }
    let joined = rendezvous::join(&spec, payload)?;
    let group = Group::start(env.rank, env.world_size, joined.links, Heartbeat::default(), on_lost)
        .map_err(|source| DistError::SideChannel { rank: env.rank, source })?;
    Ok((joined.payload, group))
}

/// The production reaction to a lost rank: say so on stderr and end the process without
/// unwinding (`_exit`): the main thread may be inside NCCL, and ending the process is what frees
/// its GPU from a collective that cannot finish.
pub fn exit_on_lost(me: usize) -> OnLost {
    Arc::new(move |lost: &Lost| {
        eprintln!(
            "error: rank {me}: lost {lost}; ending this rank, since the job cannot continue \
             without it"
        );
        signal_hook::low_level::exit(LOST_RANK_EXIT)
    })
}

/// The watchdog of `ZEROFLOW_STEP_TIMEOUT`, if set: when the training loop makes no progress for
/// that long (a collective waiting for a rank that is stuck), this process says so and ends with
/// [`STALLED_EXIT`].
pub fn step_watchdog(env: &DistEnv) -> Result<Option<Watchdog>, DistError> {
    let Some(timeout) = env.step_timeout else { return Ok(None) };
    let me = env.rank;
    let on_stall: watchdog::OnStall = Arc::new(move |idle: std::time::Duration| {
        eprintln!(
            "error: rank {me}: no progress for {:.0} s (ZEROFLOW_STEP_TIMEOUT): a collective is \
             probably waiting for a rank that is stuck; ending this rank",
            idle.as_secs_f64()
        );
        signal_hook::low_level::exit(STALLED_EXIT)
    });
    let watchdog = Watchdog::start(timeout, on_stall)
        .map_err(|source| DistError::Watchdog { rank: me, source })?;
    Ok(Some(watchdog))
}
