//! `zeroflow bench step`: optimizer steps of a model (GPT-2 or the Llama family) through the ZeRO engine, timed
//! ([`zeroflow_train::bench_step`]), in the configurations DeepSpeed is measured in
//! (`bench/peers/ds_train.py`): ZeRO-2 with the optimizer on the device, with CPU optimizer
//! offload, and with offload and the one-step delayed update.
//!
//! With several ranks (`zeroflow launch --nproc-per-node 2 -- bench step --device cuda …`, or
//! torchrun and srun as for `train`), each rank steps the model on its GPU over its slice of one
//! global batch, the host's cores split between the ranks; rank 0 alone prints the report: the
//! job's tokens/s (every rank's tokens), its own step times, breakdown and memory, and each rank's
//! means.

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::config::ZeroConfig;
use zeroflow_train::ModelSpec;
use zeroflow_train::bench_step::{self, BenchOptions, Mode, PlanMode};
use zeroflow_train::dist::DistEnv;

use crate::InputError;
use crate::settings::{self, Requested};
use crate::train::DeviceFlag;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeFlag {
    /// ZeRO-2, AdamW on the device.
    Gpu,
    /// ZeRO-2 with CPU optimizer offload (pinned memory).
    Offload,
    /// Offload with the one-step delayed update (the CPU step overlaps the next forward/backward).
    #[value(name = "offload-delayed", alias = "dpu")]
    OffloadDelayed,
    /// Offload with ZenFlow as DeepSpeed's benchmark runs it: the top 5 % of each weight's columns
    /// on the device every step, the rest on the CPU every 4 steps, overlapped.
    Zenflow,
    /// ZenFlow with its CPU step not overlapped (`overlap_step: false`): one f32 sum of the
    /// unselected columns on the GPU instead of two, no weights of the step before.
    #[value(name = "zenflow-inline")]
    ZenflowInline,
}

/// `--state-dtype`'s values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum StateDtypeFlag {
    Fp32,
    Bf16,
}

#[derive(Debug, clap::Args)]
pub struct Args {
    #[arg(long, value_enum, default_value_t = ModeFlag::Offload)]
    mode: ModeFlag,
    /// A named shape (tiny, gpt2-124m, …, gpt-1.3b, llama-1b, llama-3b, llama-8b), a JSON
    /// object or a config.json file.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Tokens per sequence [default: GPT-2's context, the Llama family's 2048].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    seq: Option<u32>,
    #[arg(long, value_enum, default_value_t = DeviceFlag::Cpu)]
    device: DeviceFlag,
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
    /// Element type of the CPU optimizer's Adam moments (a config's
    /// `zeroflow.optimizer_state_dtype`): bf16 keeps 8 bytes of optimizer state per parameter
    /// instead of 12; with the offloaded modes only.
    #[arg(long, value_enum, default_value_t = StateDtypeFlag::Fp32)]
    state_dtype: StateDtypeFlag,
    /// The config's `gradient_clipping`: the global norm's clip (0: none). From random weights
    /// the norm stays above 1 for the first steps, so every benchmarked step is clipped; a
    /// fine-tune of a trained model is clipped on few.
    #[arg(long, default_value_t = 1.0, value_parser = parse_clip)]
    gradient_clipping: f64,
    /// The config's `zero_optimization.reduce_bucket_size`: the gradients reduced (and, with
    /// offload, copied to the host) together, in elements (the default is DeepSpeed's).
    #[arg(long, default_value_t = ZeroConfig::DEEPSPEED_DEFAULT.reduce_bucket_size,
          value_parser = clap::value_parser!(u64).range(1..))]
    reduce_bucket_size: u64,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
    /// Print the memory plan of this configuration (`zeroflow plan`'s table) and stop.
    #[arg(long)]
    plan_only: bool,
    /// Start even where the memory plan does not fit this machine.
    #[arg(long)]
    no_plan_check: bool,
    #[command(flatten)]
    gpu: settings::GpuFlags,
    #[command(flatten)]
    host: settings::HostFlags,
}

impl From<ModeFlag> for Mode {
    fn from(flag: ModeFlag) -> Mode {
        match flag {
            ModeFlag::Gpu => Mode::Gpu,
            ModeFlag::Offload => Mode::Offload,
            ModeFlag::OffloadDelayed => Mode::OffloadDelayed,
            ModeFlag::Zenflow => Mode::Zenflow,
            ModeFlag::ZenflowInline => Mode::ZenflowInline,
        }
    }
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let model = ModelSpec::parse(&args.model)
        .map_err(|e| InputError::from_display(format!("--model: {e}")))?;
    if args.state_dtype == StateDtypeFlag::Bf16 && args.mode == ModeFlag::Gpu {
        return Err(InputError::from_display(
            "--state-dtype bf16 is for the CPU optimizer of the offloaded modes (offload, \
             offload-delayed, zenflow); the GPU's AdamW (--mode gpu) keeps fp32 moments",
        ));
    }
    if args.micro_batch == 0 || args.steps == 0 || args.accum == 0 {
        return Err(InputError::from_display(
            "--micro-batch, --accum and --steps must be at least 1",
        ));
    }
    let dist =
        DistEnv::from_lookup(|name| std::env::var(name).ok()).map_err(InputError::from_display)?;
    bench_step::check_job(args.device.into(), &dist)?;
    // The flags over the environment (the bench config has no `zeroflow` section).
    let flags = settings::from_flags(args.gpu, args.host);
    let requested = settings::resolve(flags, settings::env::from_process()?, Requested::default());
    let options = BenchOptions {
        mode: args.mode.into(),
        model_name: args.model.clone(),
        device: args.device.into(),
        micro_batch: args.micro_batch,
        seq: args.seq.map(|seq| seq as usize),
        accum: args.accum,
        steps: args.steps,
        warmup: args.warmup,
        gradient_clipping: args.gradient_clipping,
        reduce_bucket_size: args.reduce_bucket_size,
        state_dtype: match args.state_dtype {
            StateDtypeFlag::Fp32 => OptimizerStateDtype::Fp32,
            StateDtypeFlag::Bf16 => OptimizerStateDtype::Bf16,
        },
        settings: requested,
        kernel_cache: settings::env::kernel_cache(),
        plan: match (args.plan_only, args.no_plan_check) {
            (true, _) => PlanMode::Only,
            (false, true) => PlanMode::NoCheck,
            (false, false) => PlanMode::Check,
        },
    };
    // Only rank 0 reports, for the whole job.
    if let Some(report) = bench_step::run(&options, model, &dist)? {
        print_report(&args, &report)?;
    }
    Ok(())
}

fn print_report(args: &Args, out: &serde_json::Value) -> anyhow::Result<()> {
    if let (Some(table), false) = (out["table"].as_str(), args.json) {
        print!("{table}");
        return Ok(());
    }
    if args.json {
        let out = out.get("plan").unwrap_or(out);
        println!("{}", serde_json::to_string_pretty(out)?);
        return Ok(());
    }
    println!("{}", bench_step::summary(&args.model, out));
    Ok(())
}

/// A clip threshold: finite and not negative.
fn parse_clip(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(clip) if clip.is_finite() && clip >= 0.0 => Ok(clip),
        _ => Err(format!("{text:?} is not a clip threshold (a number, 0 or more; 0: none)")),
    }
}
