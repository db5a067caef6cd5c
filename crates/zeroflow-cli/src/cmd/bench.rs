//! `zeroflow bench`: measurements of this machine (`bench cpu-adam`'s is
//! [`zeroflow_train::bench_cpu_adam`]).

use clap::{Args, Subcommand, ValueEnum};
use zeroflow_optim::{GradDtype, OptimizerStateDtype, SimdLevel, Stores};
use zeroflow_train::bench_cpu_adam::CpuAdamOptions;

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
    /// Also time the step saving the state it overwrites (the speculative step's backup, +12
    /// bytes per parameter of memory): in the step's own pass, and as a copy before the step.
    #[arg(long)]
    saving: bool,
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
    let options = CpuAdamOptions {
        params: args.params,
        threads: match args.threads {
            Some(threads) => threads,
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
        },
        simd: match args.simd {
            SimdArg::Auto => SimdLevel::detect(),
            SimdArg::Avx512 => SimdLevel::Avx512,
            SimdArg::Avx2 => SimdLevel::Avx2,
            SimdArg::Scalar => SimdLevel::Scalar,
        },
        grad: match args.grad {
            GradArg::F32 => GradDtype::F32,
            GradArg::Bf16 => GradDtype::Bf16,
        },
        moments: match args.state_dtype {
            StateDtypeArg::Fp32 => OptimizerStateDtype::Fp32,
            StateDtypeArg::Bf16 => OptimizerStateDtype::Bf16,
        },
        bf16_copy: args.bf16_copy,
        copy_stores: args.copy_stores.map(|stores| match stores {
            StoresArg::Normal => Stores::Normal,
            StoresArg::NonTemporal => Stores::NonTemporal,
        }),
        tasks_per_thread: args.tasks_per_thread.map(|tasks| tasks as usize),
        warmup: args.warmup,
        iters: args.iters,
        check_memory: !args.skip_memory_check,
        saving: args.saving,
    };
    let report = zeroflow_train::bench_cpu_adam::run(&options)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{report}");
    }
    Ok(())
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
