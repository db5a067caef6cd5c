//! `zeroflow launch`: start one zeroflow process per GPU of this host, like torchrun.
//!
//! Each child is this executable with the arguments after `--` and the environment of its rank:
//! `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, and
//! `NCCL_NVLS_ENABLE=0` unless it is set. Their output lines come out prefixed `[rank R] `.
//! SIGINT and SIGTERM are passed on to the children (which run in their own process group, so a
//! Ctrl-C at the terminal reaches them once, through here); a child gets SIGTERM from the kernel
//! if the launcher dies ([`follow_launcher`]). When a child fails, the others get
//! SIGTERM, then SIGKILL after the grace period, and the launcher exits with the failed child's
//! status, naming its rank.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::num::NonZeroUsize;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rustix::process::{Pid, Signal, kill_process};
use signal_hook::consts::{SIGINT, SIGTERM};

use zeroflow_device::cuda::nccl::NVLS_ENV;

use crate::InputError;
use crate::error::Exit;
use zeroflow_train::dist::LOST_RANK_EXIT;

/// How often the launcher looks at its children and at the signals it got.
const POLL: Duration = Duration::from_millis(20);

/// The variable that tells a child the launcher's process id (see [`follow_launcher`]).
const LAUNCHER_PID_VAR: &str = "ZEROFLOW_LAUNCHER_PID";

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Processes to start on this host, one per GPU (rank r of this host uses GPU r). Also
    /// spelled --nproc_per_node, as torchrun spells it.
    #[arg(long, value_name = "N", alias = "nproc_per_node")]
    pub nproc_per_node: NonZeroUsize,
    /// Hosts in the job (run `zeroflow launch` once on each).
    #[arg(long, value_name = "N", default_value_t = NonZeroUsize::MIN)]
    pub nnodes: NonZeroUsize,
    /// This host's number, 0 to --nnodes - 1 (host 0 runs rank 0).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub node_rank: usize,
    /// Address of host 0, where rank 0 listens (needed with --nnodes above 1).
    #[arg(long, value_name = "HOST", default_value = "127.0.0.1")]
    pub master_addr: String,
    /// TCP port where rank 0 listens. Default: a free port (one host only).
    #[arg(long, value_name = "PORT")]
    pub master_port: Option<u16>,
    /// Seconds the other ranks get to stop after SIGTERM when one fails, before SIGKILL.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub grace: f64,
    /// The zeroflow subcommand each rank runs, with its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "ARGS")]
    pub command: Vec<OsString>,
}

/// One child process.
struct Rank {
    rank: usize,
    child: Child,
    status: Option<ExitStatus>,
    /// The threads copying its stdout and stderr.
    copiers: Vec<JoinHandle<()>>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let grace = Duration::try_from_secs_f64(args.grace)
        .map_err(|_| InputError::from_display(format!("--grace {}: not a duration", args.grace)))?;
    let job = Job::from_args(&args)?;
    let exe = std::env::current_exe().context("cannot find the zeroflow executable")?;
    let signals = [SIGINT, SIGTERM].map(|signal| {
        let flag = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal, Arc::clone(&flag)).map(|_| (signal, flag))
    });
    let signals = signals.into_iter().collect::<Result<Vec<_>, _>>().context("signals")?;
    let first = args.node_rank * job.nproc;
    tracing::info!(
        "launching ranks {first}..{} of {} on this host; rank 0 at {}:{}",
        first + job.nproc,
        job.world,
        job.master_addr,
        job.port
    );
    let mut ranks = Vec::with_capacity(job.nproc);
    for local in 0..job.nproc {
        match job.spawn(&exe, &args.command, first + local, local) {
            Ok(rank) => ranks.push(rank),
            Err(e) => {
                stop(&mut ranks, grace);
                return Err(e).with_context(|| format!("cannot start rank {}", first + local));
            }
        }
    }
    let failure = supervise(&mut ranks, &signals, grace);
    for rank in &mut ranks {
        for copier in rank.copiers.drain(..) {
            let _ = copier.join();
        }
    }
    match failure {
        None => Ok(()),
        Some(failed) => Err(anyhow::Error::new(failed_error(&failed, &ranks))),
    }
}

/// The job as this host sees it.
struct Job {
    nproc: usize,
    world: usize,
    master_addr: String,
    port: u16,
}

impl Job {
    fn from_args(args: &Args) -> anyhow::Result<Job> {
        let (nproc, nnodes) = (args.nproc_per_node.get(), args.nnodes.get());
        if args.node_rank >= nnodes {
            return Err(InputError::from_display(format!(
                "--node-rank {} is not a host of --nnodes {nnodes} (0 to {})",
                args.node_rank,
                nnodes - 1
            )));
        }
        let loopback =
            args.master_addr.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
                || args.master_addr == "localhost";
        if nnodes > 1 && loopback {
            return Err(InputError::from_display(format!(
                "--master-addr {} is this host only: with --nnodes {nnodes}, give host 0's \
                 address, reachable from every host",
                args.master_addr
            )));
        }
        let port = match (args.master_port, nnodes) {
            (Some(port), _) => port,
            (None, 1) => free_port()?,
            (None, _) => {
                return Err(InputError::from_display(
                    "--master-port is needed with --nnodes above 1: the same free port on every \
                     host",
                ));
            }
        };
        Ok(Job { nproc, world: nproc * nnodes, master_addr: args.master_addr.clone(), port })
    }

    /// Starts `exe command` as `rank` (`local` on this host), its output copied with its prefix.
    fn spawn(
        &self,
        exe: &std::path::Path,
        command: &[OsString],
        rank: usize,
        local: usize,
    ) -> std::io::Result<Rank> {
        let mut child = Command::new(exe);
        child
            .args(command)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", self.world.to_string())
            .env("LOCAL_WORLD_SIZE", self.nproc.to_string())
            .env("MASTER_ADDR", &self.master_addr)
            .env("MASTER_PORT", self.port.to_string())
            .env(LAUNCHER_PID_VAR, std::process::id().to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: a Ctrl-C at the terminal reaches it once, from here.
            .process_group(0);
        if std::env::var_os(NVLS_ENV).is_none() {
            child.env(NVLS_ENV, "0");
        }
        let mut child = child.spawn()?;
        let copiers = vec![
            copy_lines(rank, child.stdout.take().expect("piped"), false),
            copy_lines(rank, child.stderr.take().expect("piped"), true),
        ];
        Ok(Rank { rank, child, status: None, copiers })
    }
}

/// Waits for every child, passing signals on; after the first failure, stops the others.
/// Returns the failure that ended the job, if any.
fn supervise(
    ranks: &mut [Rank],
    signals: &[(i32, Arc<AtomicBool>)],
    grace: Duration,
) -> Option<(usize, ExitStatus)> {
    let mut failure: Option<(usize, ExitStatus)> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        for (signal, flag) in signals {
            if flag.swap(false, Ordering::SeqCst) {
                let signal = if *signal == SIGINT { Signal::INT } else { Signal::TERM };
                signal_running(ranks, signal);
            }
        }
        let mut failed_now = Vec::new();
        for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Ok(Some(status)) = rank.child.try_wait() {
                rank.status = Some(status);
                if !status.success() {
                    failed_now.push((rank.rank, status));
                }
            }
        }
        // A rank that ended because another was lost is a consequence, not the cause.
        failed_now.sort_by_key(|(rank, status)| (status.code() == Some(LOST_RANK_EXIT), *rank));
        if failure.is_none()
            && let Some(&first) = failed_now.first()
        {
            failure = Some(first);
            tracing::error!("{}; stopping the other ranks", describe(first.0, &first.1));
            signal_running(ranks, Signal::TERM);
            kill_at = Some(Instant::now() + grace);
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            return failure;
        }
        if kill_at.is_some_and(|at| Instant::now() >= at) {
            tracing::error!("ranks still running {} s after SIGTERM: SIGKILL", grace.as_secs_f64());
            signal_running(ranks, Signal::KILL);
            kill_at = None;
        }
        std::thread::sleep(POLL);
    }
}

/// In a child of `zeroflow launch`: asks the kernel for SIGTERM when the launcher dies, so that
/// killing the launcher (even with SIGKILL, which it cannot pass on) stops the job rather than
/// leaving ranks that hold their GPUs. The children run in their own process group, so nothing
/// else would reach them.
pub fn follow_launcher() {
    let Some(launcher) = std::env::var(LAUNCHER_PID_VAR).ok().and_then(|v| v.parse::<i32>().ok())
    else {
        return;
    };
    if let Err(e) = rustix::process::set_parent_process_death_signal(Some(Signal::TERM)) {
        tracing::warn!("cannot ask to be stopped with the launcher: {e}");
        return;
    }
    // The launcher may have died before the request: then the parent is another process.
    if rustix::process::getppid().map(Pid::as_raw_pid) != Some(launcher) {
        eprintln!("error: the zeroflow launcher (process {launcher}) is gone; stopping");
        std::process::exit(1);
    }
}

/// Stops the children that are running: SIGTERM, then SIGKILL after `grace`.
fn stop(ranks: &mut [Rank], grace: Duration) {
    signal_running(ranks, Signal::TERM);
    let deadline = Instant::now() + grace;
    loop {
        for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
            rank.status = rank.child.try_wait().ok().flatten();
        }
        if ranks.iter().all(|r| r.status.is_some()) {
            return;
        }
        if Instant::now() >= deadline {
            signal_running(ranks, Signal::KILL);
            for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
                rank.status = rank.child.wait().ok();
            }
            return;
        }
        std::thread::sleep(POLL);
    }
}

/// Sends `signal` to every child not yet reaped (so its pid is still its own).
fn signal_running(ranks: &[Rank], signal: Signal) {
    for rank in ranks.iter().filter(|r| r.status.is_none()) {
        if let Err(e) = kill_process(Pid::from_child(&rank.child), signal) {
            tracing::warn!("cannot signal rank {}: {e}", rank.rank);
        }
    }
}

/// Copies a child's output to ours line by line, each prefixed with its rank.
fn copy_lines(rank: usize, from: impl Read + Send + 'static, stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        let prefix = format!("[rank {rank}] ");
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if !line.ends_with(b"\n") {
                line.push(b'\n');
            }
            // One write per line, under the stream's lock: lines of ranks never interleave.
            let mut out = Vec::with_capacity(prefix.len() + line.len());
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            let written = if stderr {
                std::io::stderr().lock().write_all(&out)
            } else {
                std::io::stdout().lock().write_all(&out).and_then(|()| std::io::stdout().flush())
            };
            if written.is_err() {
                return;
            }
        }
    })
}

/// "rank 1 exited with status 7" or "rank 1 was killed by signal 9 (SIGKILL)".
fn describe(rank: usize, status: &ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("rank {rank} exited with status {code}"),
        (None, Some(signal)) => {
            format!("rank {rank} was killed by signal {signal} ({})", signal_name(signal))
        }
        (None, None) => format!("rank {rank} ended ({status})"),
    }
}

fn failed_error(failed: &(usize, ExitStatus), ranks: &[Rank]) -> Exit {
    let (rank, status) = failed;
    let others: Vec<String> = ranks
        .iter()
        .filter(|r| r.rank != *rank)
        .map(|r| describe(r.rank, r.status.as_ref().expect("all reaped")))
        .collect();
    let mut message = describe(*rank, status);
    if !others.is_empty() {
        message.push_str(&format!("; then {}", others.join(", ")));
    }
    // The shell's convention: a signal's death is 128 + the signal.
    let code = status.code().or_else(|| status.signal().map(|s| 128 + s)).unwrap_or(1);
    Exit { code: u8::try_from(code).ok().filter(|&c| c != 0).unwrap_or(1), message }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        11 => "SIGSEGV",
        13 => "SIGPIPE",
        15 => "SIGTERM",
        _ => "a signal",
    }
}

/// A TCP port that was free a moment ago (the OS's pick).
fn free_port() -> anyhow::Result<u16> {
    let listener = std::net::TcpListener::bind("0.0.0.0:0").context("cannot find a free port")?;
    Ok(listener.local_addr()?.port())
}
