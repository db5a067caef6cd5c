//! `zeroflow stress`: the repeated-run race protocol, with counts and the environment.

use anyhow::bail;
use serde_json::json;
use zeroflow_device::CudaDevice;
use zeroflow_device::cuda::load::GemmLoad;
use zeroflow_engine::stress::{StressOptions, StressReport, run_cpu, run_cuda};

use crate::InputError;

/// Run the offload + gradient-accumulation race check N times and report counts.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Optimizer steps to run (each of 4 micro-steps, every host read checked).
    #[arg(long, default_value_t = 1000)]
    iters: u64,
    /// Where to run: `cpu` (in-process ranks with asynchronous streams) or `cuda`.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Random delays before every device operation, seeded (CPU only).
    #[arg(long)]
    chaos: Option<u64>,
    /// Ranks: in-process CPU ranks [default 2], or GPUs 0..N [default: every visible GPU].
    #[arg(long)]
    world: Option<usize>,
    /// Keep the GPU busy with large GEMMs on another stream throughout (CUDA only).
    #[arg(long)]
    gpu_load: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let (cuda, world) = device_and_world(&args)?;
    let started = std::time::Instant::now();
    let opts = StressOptions::new(args.iters, world, args.chaos);
    let (report, load_gemms) = if cuda {
        let env = crate::settings::env::from_process()?;
        let device_options = crate::settings::cuda_device_options(&env);
        let load = if args.gpu_load {
            let device = CudaDevice::with_options(0, device_options.clone())?;
            Some(GemmLoad::start(&device, 8192)?)
        } else {
            None
        };
        let report = run_cuda(&opts, &device_options)?;
        (report, load.map(GemmLoad::finish).transpose()?)
    } else {
        (run_cpu(&opts), None)
    };
    let wall_s = started.elapsed().as_secs_f64();
    let device = if cuda {
        format!(
            "cuda, {} GPU rank(s), GEMM load {}",
            world,
            load_gemms.map_or("off".to_string(), |n| format!("on ({n} bf16 8192³ GEMMs ran)"))
        )
    } else {
        format!(
            "cpu, {} in-process ranks, chaos {}",
            world,
            args.chaos.map_or("off".to_string(), |s| format!("seed {s}"))
        )
    };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let ran =
        Ran { command, world, device, load_gemms, wall_s, environment: super::env::collect() };
    if args.json {
        print_json(&args, &ran, &report)?
    } else {
        print_text(&args, &ran, &report)
    }
    if report.failed > 0 || report.iterations < args.iters {
        bail!("stress failed: {} of {} iterations failed", report.failed, args.iters);
    }
    Ok(())
}

/// Whether the run is on GPUs, and its ranks; an input error for a device other than `cpu`
/// and `cuda`, or flags that device does not take.
fn device_and_world(args: &Args) -> anyhow::Result<(bool, usize)> {
    let cuda = match args.device.as_str() {
        "cpu" => false,
        "cuda" => true,
        other => {
            return Err(InputError::from_display(format!(
                "--device: expected cpu or cuda, found {other:?}"
            )));
        }
    };
    if args.gpu_load && !cuda {
        return Err(InputError::from_display("--gpu-load needs --device cuda"));
    }
    if args.chaos.is_some() && cuda {
        return Err(InputError::from_display(
            "--chaos delays the CPU device's streams; on a GPU use --gpu-load instead",
        ));
    }
    let world = match args.world {
        Some(0) => return Err(InputError::from_display("--world must be at least 1")),
        Some(world) => world,
        None if cuda => zeroflow_device::cuda::info::list_gpus()?.len().max(1),
        None => 2,
    };
    Ok((cuda, world))
}

/// What the protocol checks, as the report says it.
const PROTOCOL: &str = "ZeRO-2 + CPU offload + gradient accumulation 4 on the synthetic model; \
                        after every backward each rank's host gradient accumulator is read \
                        through the engine's API and checked non-zero and equal to an \
                        independent sum; after every step the fp32 master weights are checked \
                        against plain AdamW";

/// How a stress run ran: the command, its ranks, the device as the report says it, the GEMMs of
/// `--gpu-load`, the wall time and the environment.
struct Ran {
    command: String,
    world: usize,
    device: String,
    load_gemms: Option<u64>,
    wall_s: f64,
    environment: serde_json::Value,
}

fn print_json(args: &Args, ran: &Ran, report: &StressReport) -> anyhow::Result<()> {
    let out = json!({
        "command": ran.command,
        "protocol": PROTOCOL,
        "device": ran.device,
        "gpu_load_gemms": ran.load_gemms,
        "world": ran.world,
        "chaos_seed": args.chaos,
        "iterations_requested": args.iters,
        "iterations": report.iterations,
        "passed": report.passed,
        "failed": report.failed,
        "first_failure": report.first_failure,
        "wall_s": ran.wall_s,
        "environment": ran.environment,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn print_text(args: &Args, ran: &Ran, report: &StressReport) {
    println!("command     {}", ran.command);
    println!("protocol    {PROTOCOL}");
    println!("device      {}", ran.device);
    println!("environment");
    for line in super::env::text_lines(&ran.environment) {
        println!("  {line}");
    }
    println!("iterations  {} of {} ({:.1} s)", report.iterations, args.iters, ran.wall_s);
    println!("passed      {}", report.passed);
    println!("failed      {}", report.failed);
    if let Some(failure) = &report.first_failure {
        println!("first failure: {failure}");
    }
    println!("stress: {} passed, {} failed", report.passed, report.failed);
}
