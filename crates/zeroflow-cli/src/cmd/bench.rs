//! `zeroflow bench`: measurements of this machine.
//!
//! `zeroflow bench cpu-adam` times the CPU AdamW step over one partition-sized buffer set and
//! compares it with the host's streaming bandwidth measured with the same access pattern, threads
//! and chunking (the roofline): the optimizer is memory-bound, so the fraction of the roofline it
//! reaches is what tuning can still win.

use clap::{Args, Subcommand, ValueEnum};
use zeroflow_optim::{
    CpuAdam, GradDtype, OptimizerStateDtype, SimdLevel, Stores, Timings, Workload, measure,
};

use crate::InputError;

#[derive(Debug, Subcommand)]
pub enum Bench {
    /// CPU AdamW throughput against the memory roofline of the same access pattern.
    CpuAdam(CpuAdamArgs),
    /// Copy bandwidth between host memory (pinned and pageable) and the GPU.
    Copy(super::bench_copy::Args),
    /// Optimizer steps of the GPT model through the ZeRO engine (gpu, offload, offload-delayed,
    /// zenflow): tokens/s, model TFLOP/s, forward / backward / optimizer breakdown, PCIe traffic
    /// and memory; on several GPUs under `zeroflow launch`.
    #[command(alias = "train")]
    Step(super::bench_train::Args),
    /// bf16 GEMM throughput through cuBLASLt (TFLOP/s).
    Gemm(super::bench_gemm::Args),
    /// Forward + backward of the GPT model on one GPU (s/step, tokens/s, memory).
    Gpt(super::bench_gpt::Args),
}

#[derive(Debug, Args)]
pub struct CpuAdamArgs {
    /// Number of parameters in the partition (a count such as 500000000 or 5e8).
    #[arg(long, default_value = "5e8", value_parser = parse_count)]
    params: usize,
    /// Worker threads [default: the available cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Timed passes of each kind; the median is reported.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed passes of each kind before timing.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// SIMD level of the AdamW kernel (the roofline always uses the widest available).
    #[arg(long, value_enum, default_value_t = SimdArg::Auto)]
    simd: SimdArg,
    /// Element type of the gradients read by the step.
    #[arg(long, value_enum, default_value_t = GradArg::F32)]
    grad: GradArg,
    /// Element type of the Adam moments (`zeroflow.optimizer_state_dtype`): bf16 moves 8 bytes
    /// fewer per parameter; the master weights stay fp32.
    #[arg(long, value_enum, default_value_t = StateDtypeArg::Fp32)]
    state_dtype: StateDtypeArg,
    /// Also write the bf16 copy of the updated weights in the same pass (+2 bytes per parameter).
    #[arg(long)]
    bf16_copy: bool,
    /// How the bf16 copy is written: ordinary or streaming (non-temporal) stores [default: the
    /// optimizer's, non-temporal].
    #[arg(long, value_enum)]
    copy_stores: Option<StoresArg>,
    /// Chunks each pass is cut into per thread [default: the optimizer's].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    tasks_per_thread: Option<u32>,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// Do not compare the buffers' size with MemAvailable first (for hosts whose memory grows as
    /// it is used, where MemAvailable reads low at start).
    #[arg(long)]
    skip_memory_check: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SimdArg {
    Auto,
    Avx512,
    Avx2,
    Scalar,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StoresArg {
    Normal,
    NonTemporal,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StateDtypeArg {
    Fp32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum GradArg {
    F32,
    Bf16,
}

pub fn run(bench: Bench) -> anyhow::Result<()> {
    match bench {
        Bench::CpuAdam(args) => cpu_adam(args),
        Bench::Copy(args) => super::bench_copy::run(args),
        Bench::Step(args) => super::bench_train::run(args),
        Bench::Gemm(args) => super::bench_gemm::run(args),
        Bench::Gpt(args) => super::bench_gpt::run(args),
    }
}

fn cpu_adam(args: CpuAdamArgs) -> anyhow::Result<()> {
    let level = match args.simd {
        SimdArg::Auto => SimdLevel::detect(),
        SimdArg::Avx512 => SimdLevel::Avx512,
        SimdArg::Avx2 => SimdLevel::Avx2,
        SimdArg::Scalar => SimdLevel::Scalar,
    };
    let grad = match args.grad {
        GradArg::F32 => GradDtype::F32,
        GradArg::Bf16 => GradDtype::Bf16,
    };
    let moments = match args.state_dtype {
        StateDtypeArg::Fp32 => OptimizerStateDtype::Fp32,
        StateDtypeArg::Bf16 => OptimizerStateDtype::Bf16,
    };
    let threads = match args.threads {
        Some(0) => return Err(InputError::from_display("--threads must be at least 1")),
        Some(threads) => threads,
        None => std::thread::available_parallelism().map_or(1, |n| n.get()),
    };
    if args.params == 0 {
        return Err(InputError::from_display("--params must be at least 1"));
    }
    if !args.skip_memory_check {
        let bytes = Workload::bytes_allocated_per_param(grad, moments, args.bf16_copy);
        check_memory(args.params, bytes)?;
    }
    let mut adam = CpuAdam::new(threads, level).map_err(InputError::from_display)?;
    if let Some(tasks) = args.tasks_per_thread {
        adam = adam.with_tasks_per_thread(tasks as usize);
    }
    if let Some(copy_stores) = args.copy_stores {
        adam = adam.with_copy_stores(match copy_stores {
            StoresArg::Normal => Stores::Normal,
            StoresArg::NonTemporal => Stores::NonTemporal,
        });
    }

    let mut workload = Workload::new(&adam, args.params, grad, moments, args.bf16_copy, 0x5EED);
    let timings = measure(&adam, &mut workload, args.warmup, args.iters)?;
    report(&args, &adam, grad, moments, &timings);
    Ok(())
}

/// Refuses sizes that do not fit in the memory the kernel says is available.
fn check_memory(params: usize, bytes_per_param: usize) -> anyhow::Result<()> {
    let Some(available) = zeroflow_train::limits::available_host_memory() else {
        return Ok(()); // Not Linux, or no MemAvailable: nothing to check against.
    };
    let needed = params as u128 * bytes_per_param as u128;
    if needed <= u128::from(available) {
        return Ok(());
    }
    let fit = available / bytes_per_param as u64;
    Err(InputError::from_display(format!(
        "{params} parameters need {:.1} GiB ({bytes_per_param} bytes each) but only {:.1} GiB is \
         available (MemAvailable in /proc/meminfo); at most {fit} parameters ({fit:.2e}) fit: pass \
         a smaller --params, or --skip-memory-check where memory grows on demand",
        needed as f64 / GIB,
        available as f64 / GIB,
    )))
}

const GIB: f64 = (1u64 << 30) as f64;

fn report(
    args: &CpuAdamArgs,
    adam: &CpuAdam,
    grad: GradDtype,
    moments: OptimizerStateDtype,
    timings: &Timings,
) {
    let params = args.params as f64;
    let bytes_per_param = Workload::bytes_moved_per_param(grad, moments, args.bf16_copy);
    let gparams = |seconds: f64| params / seconds / 1e9;
    let (roofline_variant, roofline_s) = timings.best_roofline();
    let variants: serde_json::Map<String, serde_json::Value> = timings
        .roofline
        .iter()
        .map(|(variant, s)| (variant.name(), serde_json::json!(gparams(*s))))
        .collect();
    let gparams_per_s = gparams(timings.adamw);
    let roofline_gparams_per_s = gparams(roofline_s);
    let gb_per_s = gparams_per_s * bytes_per_param as f64;
    let roofline_gb_per_s = roofline_gparams_per_s * bytes_per_param as f64;
    let roofline_fraction = gparams_per_s / roofline_gparams_per_s;
    if args.json {
        let json = serde_json::json!({
            "bench": "cpu-adam",
            "params": args.params,
            "threads": adam.threads(),
            "simd": adam.simd_level().name(),
            "roofline_simd": SimdLevel::detect().name(),
            "grad_dtype": grad.name(),
            "state_dtype": moments.name(),
            "bf16_copy": args.bf16_copy,
            "copy_stores": adam.copy_stores().name(),
            "tasks_per_thread": adam.tasks_per_thread(),
            "bytes_per_param": bytes_per_param,
            "iters": args.iters,
            "median_s": timings.adamw,
            "gparams_per_s": gparams_per_s,
            "gb_per_s": gb_per_s,
            "roofline_gparams_per_s": roofline_gparams_per_s,
            "roofline_gb_per_s": roofline_gb_per_s,
            "roofline_variant": roofline_variant.name(),
            "roofline_variants_gparams_per_s": variants,
            "roofline_fraction": roofline_fraction,
        });
        println!("{json}");
        return;
    }
    println!(
        "cpu-adam: {} params ({:.2e}), {} threads × {} chunks, {} kernel, {} gradients, {} \
         moments{}, median of {} passes",
        args.params,
        params,
        adam.threads(),
        adam.tasks_per_thread(),
        adam.simd_level(),
        grad.name(),
        moments.name(),
        if args.bf16_copy {
            format!(" + bf16 copy ({} stores)", adam.copy_stores().name())
        } else {
            String::new()
        },
        args.iters,
    );
    println!(
        "  adamw      {gparams_per_s:6.3} Gparam/s  {gb_per_s:7.1} GB/s  {:8.4} s/pass  \
         ({bytes_per_param} B/param)",
        timings.adamw
    );
    let variants: Vec<String> = variants
        .iter()
        .map(|(name, rate)| format!("{name} {:.3}", rate.as_f64().unwrap_or(0.0)))
        .collect();
    println!(
        "  roofline   {roofline_gparams_per_s:6.3} Gparam/s  {roofline_gb_per_s:7.1} GB/s  \
         {roofline_s:8.4} s/pass  (best: {}; all in Gparam/s: {})",
        roofline_variant.name(),
        variants.join(", "),
    );
    println!("  fraction   {:6.1} % of the roofline", roofline_fraction * 100.0);
}

/// Parses a count written as an integer (`500000000`) or in scientific notation (`5e8`).
fn parse_count(text: &str) -> Result<usize, String> {
    if let Ok(count) = text.parse::<usize>() {
        return Ok(count);
    }
    let value: f64 = text.parse().map_err(|_| format!("{text:?} is not a count such as 5e8"))?;
    if value.fract() != 0.0 || !(0.0..=usize::MAX as f64).contains(&value) {
        return Err(format!("{text:?} is not a whole non-negative count"));
    }
    Ok(value as usize)
}

#[cfg(test)]
mod tests {
    use super::parse_count;

    #[test]
    fn counts_parse_as_integers_or_scientific_notation() {
        assert_eq!(parse_count("500000000"), Ok(500_000_000));
        assert_eq!(parse_count("5e8"), Ok(500_000_000));
        assert_eq!(parse_count("1.5e3"), Ok(1500));
        assert!(parse_count("1.5").is_err());
        assert!(parse_count("-3").is_err());
        assert!(parse_count("lots").is_err());
    }
}
