//! `bench step` with several ranks, on the CPU: one thread per rank, each with its own device, the
//! ranks' communicators in one process, and the real rendezvous and side channel over localhost.
//! What `bench step --device cuda` does under `zeroflow launch`, minus NCCL.

use std::sync::Arc;
use std::thread;
use std::time::Duration;

use zeroflow_device::CpuDevice;
use zeroflow_device::cpu::CpuComm;
use zeroflow_gpt::{CpuGpt, GptConfig};

use super::{BenchOptions, DeviceKind, Mode, PlanMode, bench, check_job};
use crate::Opened;
use crate::dist::env::Master;
use crate::dist::testing::free_port;
use crate::dist::{self, DistEnv};

/// One layer of width 16, a vocabulary of 64, context 16.
const MINI: GptConfig =
    GptConfig { n_layer: 1, n_head: 2, d_model: 16, vocab_size: 64, context: 16 };

/// `bench step --model MINI --steps 3 --warmup 1 --micro-batch micro_batch` (the default mode,
/// offload, on the CPU).
fn args(micro_batch: usize) -> BenchOptions {
    BenchOptions {
        mode: Mode::Offload,
        model_name: "mini".to_owned(),
        device: DeviceKind::Cpu,
        micro_batch,
        seq: None,
        accum: 1,
        steps: 3,
        warmup: 1,
        state_dtype: Default::default(),
        gradient_clipping: 1.0,
        reduce_bucket_size: 500_000_000,
        settings: Default::default(),
        kernel_cache: None,
        plan: PlanMode::Check,
    }
}

fn rank(rank: usize, world: usize, port: u16) -> DistEnv {
    DistEnv {
        rank,
        local_rank: rank,
        world_size: world,
        local_world_size: world,
        master: Some(Master { addr: "127.0.0.1".into(), port }),
        rendezvous_timeout: Duration::from_secs(20),
        step_timeout: None,
    }
}

/// Runs `bench step` with `flags` on `world` ranks in this process; each rank's report.
fn bench_ranks(world: usize, micro_batch: usize) -> Vec<Option<serde_json::Value>> {
    let port = free_port();
    let devices: Vec<CpuDevice> = (0..world).map(|_| CpuDevice::new().unwrap()).collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(60));
    let handles: Vec<_> = devices
        .into_iter()
        .zip(comms)
        .enumerate()
        .map(|(r, (device, comm))| {
            let args = args(micro_batch);
            thread::spawn(move || {
                // Ranks are threads here: a lost rank fails the others' next barrier.
                let on_lost: dist::OnLost = Arc::new(|lost: &dist::Lost| eprintln!("lost {lost}"));
                bench::<GptConfig, CpuGpt>(
                    &args,
                    &MINI,
                    &rank(r, world, port),
                    move |model, batch, seq, layout, d| {
                        let gpt = CpuGpt::new(&device, model, layout, batch, seq)?;
                        let (_, group) = dist::join_with(d, || Ok(Vec::new()), on_lost)?;
                        Ok(Opened { device, comm, model: gpt, group })
                    },
                )
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
}

fn numbers(value: &serde_json::Value) -> Vec<f64> {
    value.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect()
}

#[test]
fn only_rank_0_reports_and_counts_every_ranks_tokens() {
    let reports = bench_ranks(2, 4);
    assert!(reports[1].is_none(), "rank 1 must not report");
    let report = reports[0].as_ref().expect("rank 0 reports");
    assert_eq!(report["world_size"], 2);
    // 2 ranks × 4 sequences × 16 tokens.
    assert_eq!(report["tokens_per_step"], 128);
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let slowest = ranks.iter().map(|r| r["s_per_step_mean"].as_f64().unwrap()).fold(0.0, f64::max);
    let tokens_per_s = report["tokens_per_s"].as_f64().unwrap();
    assert!((tokens_per_s - 128.0 / slowest).abs() <= 1e-9 * tokens_per_s, "{report}");
    assert_eq!(report["s_per_step_mean"], ranks[0]["s_per_step_mean"]);
    assert_eq!(numbers(&report["times"]).len(), 3);
    assert_eq!(numbers(&report["losses"]).len(), 4);
}

#[test]
fn two_ranks_step_as_one_rank_with_their_global_batch() {
    // Each rank's 4 sequences are its half of the one rank's 8: the losses (the ranks' mean) and
    // so the updates must agree.
    let one = bench_ranks(1, 8).remove(0).unwrap();
    let two = bench_ranks(2, 4).remove(0).unwrap();
    assert_eq!(one["tokens_per_step"], two["tokens_per_step"]);
    let (one, two) = (numbers(&one["losses"]), numbers(&two["losses"]));
    assert_eq!(one.len(), two.len());
    // The weights change from step to step: a later loss that agrees needs the same updates.
    assert_ne!(one[0], one[3]);
    for (a, b) in one.iter().zip(&two) {
        assert!((a - b).abs() <= 1e-4 * a.abs(), "{one:?} vs {two:?}");
    }
}

#[test]
fn several_ranks_need_the_gpu() {
    let error = check_job(DeviceKind::Cpu, &rank(1, 2, 29500)).unwrap_err();
    assert!(format!("{error}").contains("--device cuda"), "{error}");
    check_job(DeviceKind::Cuda, &rank(1, 2, 29500)).unwrap();
    check_job(DeviceKind::Cpu, &DistEnv::single()).unwrap();
}
