//! `zeroflow bench gpt`: forward + backward of a model (GPT-2 or the Llama family) on one GPU
//! (bf16, no optimizer), the figure to hold against PyTorch's 50,289 tokens/s for gpt-1.3b at
//! micro-batch 8 × 1024 on an H200 (DEVICE.md).

use anyhow::Context;
use zeroflow_device::cuda::{is_absent, short_reason};
use zeroflow_device::{CudaDevice, Device};
use zeroflow_train::bench_gpt::{self, GptBenchOptions, PlanOptions};

use crate::settings::{self, Requested};
use zeroflow_train::{DeviceKind, ModelSpec};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A named shape (gpt-1.3b, gpt2-124m, llama-1b, …), a JSON object or a config.json file.
    #[arg(long, default_value = "gpt-1.3b")]
    model: String,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    micro_batch: u32,
    /// Tokens per sequence [default: GPT-2's context, the Llama family's 2048].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    seq: Option<u32>,
    /// Timed steps after the warm-up; the median is reported.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Untimed steps first (the first picks the cuBLASLt algorithms).
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// Which GPU (its ordinal).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Also run one step waiting after each operation and print the time of each kind.
    #[arg(long)]
    profile: bool,
    /// GPT-2: run GELU as its own kernels instead of in the fc matmul's cuBLASLt epilogues.
    #[arg(long)]
    no_gelu_fusion: bool,
    #[command(flatten)]
    gpu_settings: settings::GpuFlags,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = ModelSpec::parse(&args.model).map_err(anyhow::Error::msg).context("--model")?;
    let (batch, seq) =
        (args.micro_batch as usize, args.seq.map_or(model.default_seq(), |s| s as usize));
    let flags = settings::from_flags(args.gpu_settings, settings::HostFlags::default());
    let requested = settings::resolve(flags, settings::env::from_process()?, Requested::default());
    let attention = settings::attention(DeviceKind::Cuda, &model, &requested)?;
    let options = settings::cuda_device_options(&requested);
    let device = CudaDevice::with_options(args.gpu, options).map_err(|error| {
        if is_absent(&error) {
            anyhow::anyhow!(
                "no CUDA GPU found ({}); `zeroflow bench gpt` runs the model on a GPU and needs one",
                short_reason(&error)
            )
        } else {
            anyhow::Error::new(error).context(format!("opening GPU {}", args.gpu))
        }
    })?;
    let activation_checkpointing = settings::activation_checkpointing(DeviceKind::Cuda, &requested);
    let options = PlanOptions { attention, activation_checkpointing, ..PlanOptions::default() };
    let (iters, warmup, profile, fuse_gelu) =
        (args.iters, args.warmup, args.profile, !args.no_gelu_fusion);
    let bench = GptBenchOptions { batch, seq, iters, warmup, options, fuse_gelu, profile };
    let measured = bench_gpt::measure(&device, &model, &args.model, &bench)?;
    let times = &measured.times;
    let median = times[times.len() / 2];
    let tokens_per_s = (batch * seq) as f64 / median;
    let gib = |bytes: usize| bytes as f64 / f64::from(1u32 << 30);
    let (memory, in_use) = (measured.memory, measured.in_use);
    println!(
        "{} forward+backward{}, micro-batch {batch} × {seq}, bf16 on {}: {median:.4} s/step \
         (median of {}; best {:.4}), {tokens_per_s:.0} tokens/s",
        args.model,
        if bench.options.activation_checkpointing { " with activation checkpointing" } else { "" },
        device.describe(),
        times.len(),
        times[0]
    );
    println!(
        "activation memory {:.2} GiB (activations {:.2}, their gradients {:.2}, scratch {:.2}); \
         parameters + gradients {:.2} GiB; GPU memory in use {:.2} GiB; loss {:.4}",
        gib(memory.total()),
        gib(memory.activations),
        gib(memory.activation_grads),
        gib(memory.scratch + memory.stats),
        gib(measured.params_and_grads),
        gib(in_use),
        measured.loss
    );
    if let Some(times) = &measured.profile {
        let total: f64 = times.iter().map(|(_, t)| t.as_secs_f64()).sum();
        println!("profile (one step, a wait after each operation: {total:.4} s in all):");
        for (name, time) in times {
            let seconds = time.as_secs_f64();
            println!("  {name:<32} {:>9.3} ms {:>5.1}%", seconds * 1e3, 100.0 * seconds / total);
        }
    }
    // For the result table of scripts/gpu-run.sh.
    println!(
        "RESULT gpt_fwd_bwd model={} micro_batch={batch} seq={seq} checkpointing={} \
         s_per_step={median:.4} tokens_per_s={tokens_per_s:.0} activation_gib={:.2} \
         device_used_gib={:.2}",
        args.model,
        bench.options.activation_checkpointing,
        gib(memory.total()),
        gib(in_use)
    );
    Ok(())
}
