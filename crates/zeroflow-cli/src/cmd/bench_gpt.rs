//! `zeroflow bench gpt`: forward + backward of the GPT model on one GPU (bf16, no optimizer),
//! the figure to hold against PyTorch's 50,289 tokens/s for gpt-1.3b at micro-batch 8 × 1024 on
//! an H200 (DEVICE.md).

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::{is_absent, short_reason};
use zeroflow_device::{CudaDevice, Device};
use zeroflow_gpt::cuda::{CudaGptOptions, device_memory_in_use};
use zeroflow_gpt::{CudaGpt, GptConfig, flat_layout, init_params};

use crate::settings::{self, Requested};
use crate::train::DeviceKind;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model size: a named size (gpt-1.3b, gpt2-124m, …) or a JSON object.
    #[arg(long, default_value = "gpt-1.3b")]
    model: String,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    micro_batch: u32,
    /// Tokens per sequence [default: the model's context].
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
    /// Run GELU as its own kernels instead of in the fc matmul's cuBLASLt epilogues.
    #[arg(long)]
    no_gelu_fusion: bool,
    #[command(flatten)]
    gpu_settings: settings::GpuFlags,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let config: GptConfig = args.model.parse().context("--model")?;
    let (batch, seq) = (args.micro_batch as usize, args.seq.map_or(config.context, |s| s as usize));
    let flags = settings::from_flags(args.gpu_settings, settings::HostFlags::default());
    let requested = settings::resolve(flags, settings::env::from_process()?, Requested::default());
    let attention = settings::attention(DeviceKind::Cuda, &config, &requested)?;
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
    let layout = flat_layout(&config, 1)?;
    let mut host = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 1, &mut host)?;
    let host: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
    let params = device.upload(&host)?;
    drop(host);
    let grads = device.alloc::<bf16>(layout.padded_len())?;
    let blas = Arc::new(Blas::new(&device)?);
    let options = CudaGptOptions {
        fuse_gelu: !args.no_gelu_fusion,
        attention,
        activation_checkpointing: settings::activation_checkpointing(DeviceKind::Cuda, &requested),
    };
    let mut model = CudaGpt::with_options(&device, blas, &config, &layout, batch, seq, options)
        .with_context(|| format!("setting up {} at micro-batch {batch} × {seq}", args.model))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let mut draw = || -> Vec<u32> {
        (0..batch * seq).map(|_| rng.random_range(0..config.vocab_size as u32)).collect()
    };
    let (inputs, targets) = (draw(), draw());
    model.set_batch(&inputs, &targets)?;
    let mut step = || -> anyhow::Result<f64> {
        let started = Instant::now();
        model.forward(&params)?;
        model.backward(&params, &grads, 1.0, |_| {})?;
        device.synchronize()?;
        Ok(started.elapsed().as_secs_f64())
    };
    for _ in 0..args.warmup {
        step()?;
    }
    let mut times = (0..args.iters).map(|_| step()).collect::<anyhow::Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens_per_s = (batch * seq) as f64 / median;
    let gib = |bytes: usize| bytes as f64 / f64::from(1u32 << 30);
    let memory = model.activation_memory();
    let in_use = device_memory_in_use(&device)?;
    println!(
        "{} forward+backward{}, micro-batch {batch} × {seq}, bf16 on {}: {median:.4} s/step \
         (median of {}; best {:.4}), {tokens_per_s:.0} tokens/s",
        args.model,
        if options.activation_checkpointing { " with activation checkpointing" } else { "" },
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
        gib(2 * layout.padded_len() * size_of::<bf16>()),
        gib(in_use),
        model.loss()?
    );
    if args.profile {
        let times = model.profile(&params, &grads)?;
        let total: f64 = times.iter().map(|(_, t)| t.as_secs_f64()).sum();
        println!("profile (one step, a wait after each operation: {total:.4} s in all):");
        for (name, time) in &times {
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
        options.activation_checkpointing,
        gib(memory.total()),
        gib(in_use)
    );
    Ok(())
}
