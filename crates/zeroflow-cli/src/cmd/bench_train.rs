//! `zeroflow bench step`: optimizer steps of the GPT model through the ZeRO engine, timed, in the
//! configurations DeepSpeed is measured in (`bench/peers/ds_train.py`): ZeRO-2 with the optimizer
//! on the device, with CPU optimizer offload, and with offload and the one-step delayed update.

use std::time::Instant;

use anyhow::Context as _;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use zeroflow_core::Float;
use zeroflow_core::config::{self, Context};
use zeroflow_device::Device as _;
use zeroflow_engine::{Engine, EngineOptions, StepReport};
use zeroflow_gpt::{GptConfig, flat_layout, init_params};

use crate::InputError;
use crate::train::DeviceKind;
use crate::train::backend::{self, Model, Opened};
use crate::train::run::forward_backward;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// ZeRO-2, AdamW on the device.
    Gpu,
    /// ZeRO-2 with CPU optimizer offload (pinned memory).
    Offload,
    /// Offload with the one-step delayed update (the CPU step overlaps the next forward/backward).
    #[value(name = "offload-delayed", alias = "dpu")]
    OffloadDelayed,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = Mode::Offload)]
    mode: Mode,
    /// A named size (tiny, gpt2-124m, …, gpt-1.3b) or a custom shape.
    #[arg(long, default_value = "tiny")]
    model: String,
    #[arg(long, value_enum, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    /// Micro-batches per optimizer step (gradient accumulation).
    #[arg(long, default_value_t = 1)]
    accum: u64,
    /// Timed optimizer steps (the median and the mean are reported).
    #[arg(long, default_value_t = 12)]
    steps: u32,
    /// Untimed steps first (with the delayed update, more than its exact warm-up steps).
    #[arg(long, default_value_t = 4)]
    warmup: u32,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// The DeepSpeed config of a mode, as `bench/peers/ds_train.py` writes it.
fn ds_config(mode: Mode, micro_batch: usize, accum: u64, bf16: bool, warmup: u32) -> String {
    let offload = match mode {
        Mode::Gpu => String::new(),
        Mode::Offload | Mode::OffloadDelayed => {
            r#", "offload_optimizer": { "device": "cpu", "pin_memory": true }"#.to_owned()
        }
    };
    let delayed = match mode {
        Mode::OffloadDelayed => format!(
            r#", "zeroflow": {{ "delayed_update": {{ "enabled": true, "warmup_steps": {} }} }}"#,
            warmup.saturating_sub(1)
        ),
        Mode::Gpu | Mode::Offload => String::new(),
    };
    format!(
        r#"{{
  "train_micro_batch_size_per_gpu": {micro_batch},
  "gradient_accumulation_steps": {accum},
  "gradient_clipping": 1.0,
  "bf16": {{ "enabled": {bf16} }},
  "optimizer": {{ "type": "AdamW", "params": {{ "lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0 }} }},
  "zero_optimization": {{ "stage": 2, "overlap_comm": true, "contiguous_gradients": true,
                          "reduce_bucket_size": 5e8{offload} }}{delayed}
}}"#
    )
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model: GptConfig =
        args.model.parse().map_err(|e| InputError::from_display(format!("--model: {e}")))?;
    if args.micro_batch == 0 || args.steps == 0 || args.accum == 0 {
        return Err(InputError::from_display(
            "--micro-batch, --accum and --steps must be at least 1",
        ));
    }
    match args.device {
        DeviceKind::Cpu => bench(&args, &model, backend::open_cpu),
        DeviceKind::Cuda => bench(&args, &model, backend::open_cuda),
    }
}

fn bench<M: Model>(args: &Args, model: &GptConfig, open: backend::Open<M>) -> anyhow::Result<()> {
    let bf16 = args.device == DeviceKind::Cuda;
    let text = ds_config(args.mode, args.micro_batch, args.accum, bf16, args.warmup);
    let resolved = config::resolve_str(&text, &Context::default()).context("the bench config")?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let options = EngineOptions::from_config(&resolved.config, threads);
    let layout = flat_layout(model, 1)?;
    let mut weights = vec![0.0f32; layout.padded_len()];
    init_params(model, &layout, 0, &mut weights)?;
    let initial: Vec<M::P> = weights.iter().map(|&w| M::P::from_f32(w)).collect();
    drop(weights);
    // One process: the benchmark measures one GPU.
    let single = crate::dist::DistEnv::single();
    let Opened { device, comm, model: mut gpt, .. } =
        open(model, args.micro_batch, &layout, &single)?;
    let description = device.describe();
    let mut engine = Engine::with_weights(device, comm, layout, options, initial)?;
    let tokens_per_micro = args.micro_batch * model.context;
    let tokens = tokens_per_micro * args.accum as usize;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let vocab = model.vocab_size as u32;
    let batch: Vec<u32> = (0..tokens_per_micro + 1).map(|_| rng.random_range(0..vocab)).collect();
    let (inputs, targets) = (&batch[..tokens_per_micro], &batch[1..]);
    let mut times = Vec::new();
    let mut compute_times = Vec::new();
    let mut losses = Vec::new();
    for step in 0..args.warmup + args.steps {
        let start = Instant::now();
        for _ in 0..args.accum {
            gpt.set_batch(inputs, targets)?;
            forward_backward(&mut engine, &mut gpt)?;
            if !engine.is_gradient_accumulation_boundary() {
                engine.step()?;
            }
        }
        // The split point of the breakdown: the GPU has finished forward and backward (and the
        // reductions and copies they started).
        engine.device().synchronize()?;
        let compute = start.elapsed().as_secs_f64();
        let report = engine.step()?;
        engine.device().synchronize()?;
        let seconds = start.elapsed().as_secs_f64();
        // Read after the clock stops: the loss copy is not part of a training step's cost.
        losses.push(gpt.loss()?);
        if !matches!(report, StepReport::Stepped { .. }) {
            anyhow::bail!("step {step} did not update the weights: {report:?}");
        }
        if step >= args.warmup {
            times.push(seconds);
            compute_times.push(compute);
        }
    }
    let device_memory = M::memory_in_use(engine.device());
    engine.flush()?;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let compute_mean = compute_times.iter().sum::<f64>() / compute_times.len() as f64;
    let rss = peak_rss_bytes();
    let params = model.num_params();
    let out = json!({
        "system": "zeroflow",
        "mode": match args.mode {
            Mode::Gpu => "gpu",
            Mode::Offload => "offload",
            Mode::OffloadDelayed => "offload-delayed",
        },
        "device": description,
        "model": args.model,
        "parameters": params,
        "micro_batch": args.micro_batch,
        "accum": args.accum,
        "seq": model.context,
        "s_per_step_median": median,
        "s_per_step_mean": mean,
        "tokens_per_s": tokens as f64 / mean,
        "forward_backward_s_mean": compute_mean,
        "exposed_optimizer_s_mean": mean - compute_mean,
        "peak_rss_bytes": rss,
        "device_memory_in_use_bytes": device_memory,
        "peak_rss_bytes_per_param": rss.map(|r| r as f64 / params as f64),
        "times": times,
        "losses": losses,
    });
    if args.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "{} {} on {description}: {median:.4} s/step median, {mean:.4} s mean, {:.0} tokens/s; \
             forward+backward {compute_mean:.4} s, exposed optimizer {:.4} s; loss {:.3} → {:.3}; \
             peak RSS {}; device memory in use {}",
            args.model,
            out["mode"].as_str().unwrap_or_default(),
            tokens as f64 / mean,
            mean - compute_mean,
            losses.first().copied().unwrap_or(f32::NAN),
            losses.last().copied().unwrap_or(f32::NAN),
            rss.map_or("unknown".into(), |r| format!(
                "{:.2} GiB ({:.1} B/param)",
                r as f64 / f64::from(1u32 << 30),
                r as f64 / params as f64
            )),
            device_memory.map_or("unknown".into(), |b| format!(
                "{:.2} GiB",
                b as f64 / f64::from(1u32 << 30)
            )),
        );
    }
    Ok(())
}

/// The process's peak resident set (VmHWM), where Linux reports it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
