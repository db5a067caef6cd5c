//! `zeroflow launch` and the ranks' side channel from the outside, with the hidden `dist-check`
//! subcommand standing in for training ranks (no GPU needed): output prefixed per rank, the
//! failed rank named with its status, the others stopped, and, without the launcher, ranks that
//! end on their own when another rank dies.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn zeroflow() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_zeroflow"));
    // The tests set the job's variables themselves; none may leak in from the environment.
    for var in ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"] {
        command.env_remove(var);
    }
    command.env_remove("MASTER_PORT").env_remove("SLURM_PROCID").env_remove("NCCL_NVLS_ENABLE");
    command
}

/// Runs `zeroflow launch <launch> -- dist-check <check>`; returns the output and the wall time.
fn launch(launch: &[&str], check: &[&str]) -> (Output, Duration) {
    let start = Instant::now();
    let output = zeroflow()
        .arg("launch")
        .args(launch)
        .arg("--")
        .arg("dist-check")
        .args(check)
        .output()
        .expect("runs");
    (output, start.elapsed())
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn every_rank_gets_its_environment_and_its_lines_are_prefixed() {
    let (out, _) = launch(&["--nproc-per-node", "3"], &["--join"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..3 {
        let line = format!("[rank {rank}] rank {rank} of 3 (local {rank} of 3), master 127.0.0.1:");
        assert!(stdout.contains(&line), "{stdout}");
        assert!(stdout.contains(&format!("[rank {rank}] rank {rank}: joined")), "{stdout}");
        assert!(stderr.contains(&format!("[rank {rank}] rank {rank}: stderr works")), "{stderr}");
    }
    assert_eq!(stdout.matches("NCCL_NVLS_ENABLE=0").count(), 3, "{stdout}");
    // Every line of the children is prefixed.
    assert!(stdout.lines().all(|l| l.starts_with("[rank ")), "{stdout}");
}

#[test]
fn a_failed_rank_is_named_with_its_status_and_the_others_are_stopped() {
    let (out, elapsed) = launch(
        &["--nproc-per-node", "3", "--grace", "5"],
        &["--fail-rank", "1", "--fail-code", "7", "--fail-after-ms", "200", "--work-ms", "60000"],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    assert!(stderr.contains("error: rank 1 exited with status 7"), "{stderr}");
    // The others were working for a minute: SIGTERM ended them.
    assert!(stderr.contains("rank 0 was killed by signal 15 (SIGTERM)"), "{stderr}");
    assert!(stderr.contains("rank 2 was killed by signal 15 (SIGTERM)"), "{stderr}");
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}

#[test]
fn a_rank_killed_by_a_signal_is_named_with_the_signal() {
    let (out, elapsed) = launch(
        &["--nproc-per-node", "2"],
        &["--fail-rank", "0", "--fail-by-kill", "--work-ms", "60000"],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
    assert!(stderr.contains("error: rank 0 was killed by signal 9 (SIGKILL)"), "{stderr}");
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}

#[test]
fn ranks_that_ignore_sigterm_are_killed_after_the_grace_period() {
    let (out, elapsed) = launch(
        &["--nproc-per-node", "2", "--grace", "1"],
        &["--fail-rank", "1", "--fail-after-ms", "500", "--work-ms", "60000", "--ignore-sigterm"],
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rank 0 was killed by signal 9 (SIGKILL)"), "{stderr}");
    assert!(elapsed >= Duration::from_millis(1500), "{elapsed:?}");
    assert!(elapsed < Duration::from_secs(20), "{elapsed:?}");
}

#[test]
fn sigint_to_the_launcher_reaches_every_rank_once() {
    let child = zeroflow()
        .args(["launch", "--nproc-per-node", "2", "--", "dist-check", "--work-ms", "60000"])
        .arg("--catch-signals")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("runs");
    std::thread::sleep(Duration::from_millis(1500));
    let pid = rustix::process::Pid::from_child(&child);
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let start = Instant::now();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        assert!(stdout.contains(&format!("[rank {rank}] rank {rank}: stopping on a signal")));
        assert!(stdout.contains(&format!("[rank {rank}] rank {rank}: done")), "{stdout}");
    }
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn without_a_launcher_the_ranks_end_when_one_dies() {
    // Three ranks started by hand (as by torchrun or srun); rank 1 dies by SIGKILL after the
    // rendezvous while the others "wait in a collective" for a minute.
    let port = std::net::TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port();
    let start = Instant::now();
    let children: Vec<_> = (0..3)
        .map(|rank| {
            zeroflow()
                .args(["dist-check", "--join", "--fail-rank", "1", "--fail-by-kill"])
                .args(["--fail-after-ms", "300", "--work-ms", "60000"])
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "3")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("runs")
        })
        .collect();
    let outputs: Vec<Output> =
        children.into_iter().map(|c| c.wait_with_output().unwrap()).collect();
    assert!(start.elapsed() < Duration::from_secs(30), "{:?}", start.elapsed());
    assert_eq!(outputs[1].status.code(), None, "rank 1 was killed");
    for rank in [0, 2] {
        let stderr = text(&outputs[rank].stderr);
        assert_eq!(outputs[rank].status.code(), Some(3), "rank {rank}: {stderr}");
        assert!(stderr.contains(&format!("error: rank {rank}: lost rank 1 is gone")), "{stderr}");
    }
}

#[test]
fn a_rank_without_its_rank_variable_is_refused() {
    let out = zeroflow().arg("dist-check").env("WORLD_SIZE", "2").output().unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("environment variable RANK: not set, but WORLD_SIZE is"), "{stderr}");
}

#[test]
fn a_rank_that_finds_nobody_names_rank_0_and_gives_up() {
    let port = std::net::TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port();
    let out = zeroflow()
        .args(["dist-check", "--join"])
        .envs([("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")])
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ZEROFLOW_RENDEZVOUS_TIMEOUT", "0.5")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("rank 0 at 127.0.0.1:"), "{stderr}");
    assert!(stderr.contains("did not answer within 0.5 s"), "{stderr}");
}

#[test]
fn several_ranks_on_the_cpu_are_refused_by_every_rank_with_the_input_status() {
    let out = zeroflow()
        .args(["launch", "--nproc-per-node", "2", "--", "train", "--steps", "1"])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    // Both ranks refuse at once; either may be the first the launcher sees.
    let named = (0..2).any(|r| stderr.contains(&format!("error: rank {r} exited with status 2")));
    assert!(named, "{stderr}");
    assert!(stderr.contains("--device cpu trains in one process"), "{stderr}");
}

#[test]
fn training_several_ranks_needs_an_out_directory_they_share() {
    // Refused while checking the flags, before any GPU is touched.
    let out = zeroflow()
        .args(["train", "--device", "cuda", "--steps", "1"])
        .envs([("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")])
        .envs([("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")])
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--out is needed with 2 ranks"), "{stderr}");
}

/// Whether process `pid` has ended (gone, or a zombie nobody reaped yet).
fn ended(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

#[test]
fn the_ranks_stop_when_the_launcher_is_killed() {
    use std::io::BufRead;
    let mut launcher = zeroflow()
        .args(["launch", "--nproc-per-node", "2", "--", "dist-check", "--work-ms", "60000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("runs");
    let mut pids = Vec::new();
    let mut lines = std::io::BufReader::new(launcher.stdout.take().unwrap()).lines();
    while pids.len() < 2 {
        let line = lines.next().expect("the ranks print their pids").unwrap();
        if let Some(pid) = line.split(": pid ").nth(1) {
            pids.push(pid.trim().parse::<u32>().unwrap());
        }
    }
    // SIGKILL: the launcher cannot pass anything on.
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let start = Instant::now();
    while !pids.iter().all(|&pid| ended(pid)) {
        assert!(start.elapsed() < Duration::from_secs(10), "ranks {pids:?} outlive the launcher");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn several_hosts_need_host_0s_address_and_a_port() {
    let refused = |args: &[&str]| {
        let out = zeroflow()
            .arg("launch")
            .args(args)
            .args(["--nproc-per-node", "1", "--", "dist-check"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        text(&out.stderr)
    };
    let loopback = refused(&["--nnodes", "2", "--master-port", "29500"]);
    assert!(loopback.contains("--master-addr 127.0.0.1 is this host only"), "{loopback}");
    let no_port = refused(&["--nnodes", "2", "--master-addr", "10.0.0.1"]);
    assert!(no_port.contains("--master-port is needed"), "{no_port}");
    let node = refused(&["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"]);
    assert!(node.contains("--node-rank 2 is not a host of --nnodes 2"), "{node}");
}

#[test]
fn a_rank_without_progress_for_the_step_timeout_ends_itself() {
    let start = Instant::now();
    let out = zeroflow()
        .args(["dist-check", "--work-ms", "30000"])
        .env("ZEROFLOW_STEP_TIMEOUT", "0.5")
        .output()
        .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.contains("error: rank 0: no progress for"), "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
}
