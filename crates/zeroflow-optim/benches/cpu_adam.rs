//! Threading strategies and per-call overhead of the CPU AdamW step.
//!
//! `cargo bench -p zeroflow-optim --bench cpu_adam -- [LEN ...]` prints, for each length (default
//! 1e4, 1e5, 1e6, 1e8), the median seconds per step of:
//! - `pool/N`: the executor's persistent rayon pool with N chunks per thread (more chunks let
//!   work stealing even out slow threads);
//! - `scoped`: `std::thread::scope`, spawning one thread per chunk for every step.
//!
//! Environment: `THREADS` (default: available cores), `ITERS` (default 20), `TASKS` (chunks per
//! thread to compare, default `1,4`), `SCOPED=0` to skip the scoped threads.

use std::time::Instant;

use zeroflow_optim::{
    AdamState, AdamWConfig, AdamWStep, CHUNK_ALIGN, CpuAdam, Grads, Output, SimdLevel,
};

fn main() {
    let lengths: Vec<usize> = std::env::args()
        .skip(1)
        .filter(|arg| !arg.starts_with('-')) // cargo bench passes --bench
        .map(|arg| arg.parse::<f64>().expect("lengths are numbers such as 1e8") as usize)
        .collect();
    let lengths =
        if lengths.is_empty() { vec![10_000, 100_000, 1_000_000, 100_000_000] } else { lengths };
    let threads = env_or("THREADS", std::thread::available_parallelism().map_or(1, |n| n.get()));
    let iters = env_or("ITERS", 20);
    let level = SimdLevel::detect();
    println!("{threads} threads, {level}, median of {iters} steps (f32 gradients)");
    let tasks: Vec<usize> = std::env::var("TASKS")
        .unwrap_or_else(|_| "1,4".into())
        .split(',')
        .map(|t| t.trim().parse().expect("TASKS is a comma-separated list of counts"))
        .collect();
    let scoped = std::env::var("SCOPED").map_or(true, |v| v != "0");
    let pools: Vec<CpuAdam> = tasks
        .iter()
        .map(|&t| CpuAdam::new(threads, level).unwrap().with_tasks_per_thread(t))
        .collect();
    let single = CpuAdam::new(1, level).unwrap();
    let step = AdamWStep::new(&AdamWConfig::default(), 10, 1.0).unwrap();
    for len in lengths {
        let mut data = Data::new(&pools[0], len);
        let rate = |s: f64| len as f64 / s / 1e9;
        let mut line = format!("{len:>11}");
        for (pool, t) in pools.iter().zip(&tasks) {
            let s = median_of(iters, || data.step(pool, &step));
            line += &format!("  pool/{t} {s:.3e} s ({:.3} Gparam/s)", rate(s));
        }
        if scoped {
            let s = median_of(iters, || data.step_scoped(&single, threads, &step));
            line += &format!("  scoped {s:.3e} s ({:.3})", rate(s));
        }
        println!("{line}");
    }
}

struct Data {
    params: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    grads: Vec<f32>,
}

impl Data {
    fn new(adam: &CpuAdam, len: usize) -> Self {
        let fill = |value: f32| {
            let mut data = vec![0.0f32; len];
            adam.for_each_chunk_mut(&mut data, |offset, chunk| {
                for (i, x) in chunk.iter_mut().enumerate() {
                    *x = value * (1.0 + ((offset + i) % 7) as f32 * 0.1);
                }
            });
            data
        };
        Data { params: fill(1.0), exp_avg: fill(0.01), exp_avg_sq: fill(1e-4), grads: fill(0.1) }
    }

    fn step(&mut self, adam: &CpuAdam, step: &AdamWStep) {
        let state = AdamState {
            params: &mut self.params,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
        };
        adam.step(step, state, Grads::F32(&self.grads), Output::MasterOnly).unwrap();
    }

    /// The same step with freshly spawned scoped threads, one contiguous aligned chunk each.
    fn step_scoped(&mut self, single: &CpuAdam, threads: usize, step: &AdamWStep) {
        let len = self.params.len();
        let chunk = len.div_ceil(threads).next_multiple_of(CHUNK_ALIGN).max(CHUNK_ALIGN);
        std::thread::scope(|scope| {
            let parts = self
                .params
                .chunks_mut(chunk)
                .zip(self.exp_avg.chunks_mut(chunk))
                .zip(self.exp_avg_sq.chunks_mut(chunk))
                .zip(self.grads.chunks(chunk));
            for (((params, exp_avg), exp_avg_sq), grads) in parts {
                scope.spawn(move || {
                    let state = AdamState { params, exp_avg, exp_avg_sq };
                    single.step(step, state, Grads::F32(grads), Output::MasterOnly).unwrap();
                });
            }
        });
    }
}

fn median_of(iters: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up
    let mut samples: Vec<f64> = (0..iters)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
