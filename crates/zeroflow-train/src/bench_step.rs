//! `bench step`'s measurement: optimizer steps of a model through the ZeRO engine, timed, in the
//! configurations DeepSpeed is measured in (`bench/peers/ds_train.py`): ZeRO-2 with the optimizer
//! on the device, with CPU optimizer offload, and with offload and the one-step delayed update.
//!
//! With several ranks each rank steps the model on its GPU over its slice of one global batch,
//! the host's cores split between the ranks; rank 0 alone gets the report ([`run`]): the job's
//! tokens/s (every rank's tokens), its own step times, breakdown and memory, and each rank's
//! means.

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::config::{self, Context};
use zeroflow_device::{CopiedBytes, Device as _, StreamKind};
use zeroflow_engine::{Engine, EngineOptions, SpeculationStats, StepReport, StepTimes};

use crate::dist::affinity::{self, BindMode};
use crate::dist::{DistEnv, Group};
use crate::error::{Result, TrainError, input};
use crate::machine::CpuSteal;
use crate::open::{self, CudaOpen, OpenFn};
pub use crate::plan::PlanMode;
use crate::plan::{Caller, MachineMemory, MemoryPlan, PlanInputs};
use crate::settings::{self, Effective, Requested};
use crate::trainer::{ModelEngine, forward_backward};
use crate::{DeviceKind, Family, Model, ModelSpec, Opened, with_family};

/// Where the optimizer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// ZeRO-2, AdamW on the device.
    Gpu,
    /// ZeRO-2 with CPU optimizer offload (pinned memory).
    Offload,
    /// Offload with the one-step delayed update (the CPU step overlaps the next forward/backward).
    OffloadDelayed,
    /// Offload with ZenFlow as DeepSpeed's benchmark runs it: the top 5 % of each weight's columns
    /// on the device every step, the rest on the CPU every 4 steps, overlapped.
    Zenflow,
    /// ZenFlow with its CPU step not overlapped (`overlap_step: false`): one f32 sum of the
    /// unselected columns on the device instead of two, no weights of the step before.
    ZenflowInline,
}

impl Mode {
    /// The mode as `bench step --mode` and the report spell it.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Gpu => "gpu",
            Mode::Offload => "offload",
            Mode::OffloadDelayed => "offload-delayed",
            Mode::Zenflow => "zenflow",
            Mode::ZenflowInline => "zenflow-inline",
        }
    }
}

/// What `bench step` measures.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub mode: Mode,
    /// The model as `--model` named it, for the report.
    pub model_name: String,
    pub device: DeviceKind,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sequence (`None`: the family's default, [`Family::default_seq`]).
    pub seq: Option<usize>,
    /// Micro-batches per optimizer step.
    pub accum: u64,
    /// Timed optimizer steps.
    pub steps: u32,
    /// Untimed steps first.
    pub warmup: u32,
    /// The element type of the CPU optimizer's Adam moments (`zeroflow.optimizer_state_dtype`;
    /// bf16 with offload only, as in a config).
    pub state_dtype: OptimizerStateDtype,
    /// The config's `gradient_clipping` (0: none).
    pub gradient_clipping: f64,
    /// The config's `zero_optimization.reduce_bucket_size`, in elements.
    pub reduce_bucket_size: u64,
    /// The run-time settings asked for (the flags over the environment).
    pub settings: Requested,
    /// Where compiled CUDA kernels are cached (`None`: the user's cache folder).
    pub kernel_cache: Option<PathBuf>,
    /// What to do with the memory plan before anything is allocated.
    pub plan: PlanMode,
}

/// Benchmarks this rank's share of the job on `model` and returns the report on rank 0 (`None`
/// on the others).
pub fn run(
    options: &BenchOptions,
    model: ModelSpec,
    dist: &DistEnv,
) -> Result<Option<serde_json::Value>> {
    check_job(options.device, dist)?;
    with_family!(&model, family => match options.device {
        DeviceKind::Cpu => bench(options, family, dist, open::open_cpu),
        DeviceKind::Cuda => {
            if options.plan != PlanMode::Only {
                open::check_cuda_gpu(dist.local_rank)?;
            }
            let requested = &options.settings;
            let attention = settings::attention(options.device, &model, requested)?;
            let cache = options.kernel_cache.clone();
            let device = settings::cuda_device_options(requested, cache);
            let activation_checkpointing =
                settings::activation_checkpointing(options.device, requested);
            let open = CudaOpen { device, attention, activation_checkpointing };
            bench(options, family, dist, open.opener())
        }
    })
}

/// The DeepSpeed config of a mode, as `bench/peers/ds_train.py` writes it, with zeroflow's own
/// section where the mode or the moments' dtype needs one.
fn ds_config(args: &BenchOptions, bf16: bool) -> String {
    let (mode, micro_batch, accum, warmup) = (args.mode, args.micro_batch, args.accum, args.warmup);
    let (clip, bucket) = (args.gradient_clipping, args.reduce_bucket_size);
    let offload = match mode {
        Mode::Gpu => String::new(),
        Mode::Offload | Mode::OffloadDelayed => {
            r#", "offload_optimizer": { "device": "cpu", "pin_memory": true }"#.to_owned()
        }
        Mode::Zenflow | Mode::ZenflowInline => format!(
            r#", "offload_optimizer": {{ "device": "cpu", "pin_memory": true }},
                "zenflow": {{ "topk_ratio": 0.05, "update_interval": 4,
                             "full_warm_up_rounds": 0, "overlap_step": {} }}"#,
            mode == Mode::Zenflow
        ),
    };
    let mut zeroflow = Vec::new();
    if mode == Mode::OffloadDelayed {
        let warmup_steps = warmup.saturating_sub(1);
        zeroflow.push(format!(
            r#""delayed_update": {{ "enabled": true, "warmup_steps": {warmup_steps} }}"#
        ));
    }
    if args.state_dtype != OptimizerStateDtype::Fp32 {
        zeroflow.push(format!(r#""optimizer_state_dtype": "{}""#, args.state_dtype.name()));
    }
    let zeroflow = match zeroflow.is_empty() {
        true => String::new(),
        false => format!(r#", "zeroflow": {{ {} }}"#, zeroflow.join(", ")),
    };
    format!(
        r#"{{
  "train_micro_batch_size_per_gpu": {micro_batch},
  "gradient_accumulation_steps": {accum},
  "gradient_clipping": {clip:?},
  "bf16": {{ "enabled": {bf16} }},
  "optimizer": {{ "type": "AdamW", "params": {{ "lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0 }} }},
  "zero_optimization": {{ "stage": 2, "overlap_comm": true, "contiguous_gradients": true,
                          "reduce_bucket_size": {bucket}{offload} }}{zeroflow}
}}"#
    )
}

/// Several ranks (under `zeroflow launch`, torchrun or srun) need `--device cuda`: one GPU each,
/// as for `train`.
pub fn check_job(device: DeviceKind, dist: &DistEnv) -> Result<()> {
    if dist.world_size > 1 && device == DeviceKind::Cpu {
        return Err(input(format!(
            "this process is rank {} of {}, but --device cpu runs in one process: bench several \
             ranks with --device cuda (one GPU each)",
            dist.rank, dist.world_size
        )));
    }
    Ok(())
}

/// What one rank measured over the timed steps.
struct Measured {
    /// Seconds per timed optimizer step.
    times: Vec<f64>,
    /// The forward-and-backward part of each timed step.
    compute_times: Vec<f64>,
    /// Forward alone, on the same batch after the timed steps (see [`time_forward`]).
    forward_times: Vec<f64>,
    /// Every step's loss (warm-up included), the mean over the ranks.
    losses: Vec<f32>,
    device_memory: Option<usize>,
    /// Over the timed steps: the training thread's time on or waiting for the CPU optimizer, and
    /// the bytes copied host → device and device → host.
    cpu_wait: f64,
    /// The part of `cpu_wait` within the steps' forward and backward: the step the last one
    /// left to its next forward (`overlap_forward`), finished there.
    cpu_wait_in_compute: f64,
    copied: CopiedBytes,
    /// Over the timed steps: where the training thread's optimizer steps went.
    step_times: StepTimes,
    /// Over all steps, warm-up included: the exact offload step's speculation.
    speculation: SpeculationStats,
    /// Each timed step's CPU time the hypervisor took from the host ([`crate::machine::cpu_steal`],
    /// summed over its CPUs; `None` where the kernel does not say), and the last reading.
    steal: Vec<Option<f64>>,
    last_steal: Option<CpuSteal>,
}

impl Measured {
    fn mean(&self) -> f64 {
        mean(&self.times)
    }

    fn compute_mean(&self) -> f64 {
        mean(&self.compute_times)
    }

    fn forward_mean(&self) -> f64 {
        mean(&self.forward_times)
    }
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// Model FLOPs per trained token: 6 N for the weights' matmuls forward and backward (the tied
/// output projection included), plus 12 L d T for attention's two batched matmuls over T
/// positions (PaLM's accounting; the causal mask is not discounted). The same formula as
/// scripts/bench-report.py's for the peers, with T the benchmarked sequence length `seq`.
fn flops_per_token(model: &impl Family, seq: usize) -> f64 {
    let (layers, width) = (model.n_layer() as f64, model.hidden_size() as f64);
    6.0 * model.num_params() as f64 + 12.0 * layers * width * seq as f64
}

/// `--seq`, or the family's default; at most the model's context.
fn bench_seq(args: &BenchOptions, model: &impl Family) -> Result<usize> {
    let seq = args.seq.unwrap_or_else(|| model.default_seq());
    if seq == 0 || seq > model.context() {
        return Err(input(format!(
            "--seq {seq}: give 1 to the model's context of {} tokens",
            model.context()
        )));
    }
    model.check_seq(seq)?;
    Ok(seq)
}

/// Benchmarks this rank's share of the job and returns the report on rank 0 (`None` on the
/// others). Every rank runs the same steps on its own slice of one global batch; the engine's
/// collectives keep the ranks in step.
fn bench<F: Family, M: Model>(
    args: &BenchOptions,
    model: &F,
    dist: &DistEnv,
    open: impl OpenFn<F, M>,
) -> Result<Option<serde_json::Value>> {
    // First, before anything starts a thread (rayon's pool in `init_params`, the optimizer's):
    // they inherit the binding.
    let mut requested = args.settings;
    let seq = bench_seq(args, model)?;
    let bind = requested.cpu_bind.unwrap_or(BindMode::Auto);
    let binding =
        if args.device == DeviceKind::Cuda { affinity::bind_for_gpu(dist, bind) } else { None };
    let bf16 = args.device == DeviceKind::Cuda;
    let text = ds_config(args, bf16);
    let world = u32::try_from(dist.world_size).ok().and_then(NonZeroU32::new);
    let world = world.ok_or_else(|| input(format!("a job of {} ranks", dist.world_size)))?;
    let context = Context { world_size: world, ..Context::default() };
    let resolved = config::resolve_str(&text, &context).map_err(bench_config)?;
    // The ranks of one host share its cores: those near its GPU where bound.
    let threads = affinity::optimizer_threads(binding.as_ref(), dist);
    let mut options =
        EngineOptions::from_config(&resolved.config, threads).map_err(bench_config)?;
    settings::apply_offload::<M::P>(&requested, &mut options, dist.rank)?;
    let attention = settings::attention(args.device, &model.spec(), &requested)?;
    let dtype = <M::P as zeroflow_core::Element>::DTYPE;
    // What the CPU optimizer runs on (ZenFlow's overlapped step leaves some to the training
    // thread: pt_reserved_cores_perc).
    let threads = options.offload().map_or(threads, |offload| offload.cpu_threads);
    let activation_checkpointing = requested.activation_checkpointing.unwrap_or(false);
    let model_options = zeroflow_nn::PlanOptions {
        attention,
        activation_checkpointing,
        ..zeroflow_nn::PlanOptions::default()
    };
    let (plan, machine) =
        plan_bench(args, model, (&mut options, &mut requested), dist, (seq, model_options))?;
    let effective =
        Effective::new(args.device, attention, &requested, &options, dtype, binding.as_ref());
    if args.plan == PlanMode::Only {
        let out = json!({ "plan": plan.to_json(&machine), "table": plan.table(&machine) });
        return Ok((dist.rank == 0).then_some(out));
    }
    let layout = model.flat_layout(dist.world_size)?;
    // Drawn straight into the model's type: no f32 copy at a large model's host peak.
    let mut initial = vec![M::P::default(); layout.padded_len()];
    model.init(&layout, 0, &mut initial)?;
    let Opened { device, comm, model: mut gpt, mut group } =
        open(model, args.micro_batch, seq, &layout, dist)?;
    let description = device.describe();
    device.pinned_budget().set_limit(settings::pinned_budget(&requested));
    let mut engine = Engine::with_weights(device, comm, layout, options, initial)?;
    let batch = rank_batch(model, args.micro_batch * seq, dist);
    let measured = measure(args, &mut engine, &mut gpt, &batch, &mut group)?;
    let ranks = gather_ranks(&measured, &mut group)?;
    // The last barrier: from here a rank's process ending is the job ending, not a lost rank.
    group.finish()?;
    if dist.rank != 0 {
        return Ok(None);
    }
    let job = Job { world: dist.world_size, threads, description, settings: effective.to_json() };
    let mut out = report(args, (model, seq), &job, &measured, &ranks);
    out["planned_gpu_bytes"] = json!(plan.gpu_total);
    out["planned_host_bytes"] = json!(plan.host_total);
    Ok(Some(out))
}

/// This rank's memory plan and the machine's memory, the plan said in one line on rank 0, and
/// (unless `--no-plan-check`) an input error where it does not fit the machine, before anything
/// is allocated; `--device-share fit` resolved into `options` and `requested` first.
fn plan_bench<F: Family>(
    args: &BenchOptions,
    model: &F,
    (options, requested): (&mut EngineOptions, &mut Requested),
    dist: &DistEnv,
    (seq, model_options): (usize, zeroflow_nn::PlanOptions),
) -> Result<(MemoryPlan, MachineMemory)> {
    let machine = MachineMemory::this_machine(args.device, dist.local_rank, dist.local_world_size);
    let mut inputs = PlanInputs {
        model: model.spec(),
        device: args.device,
        options: options.clone(),
        world_size: dist.world_size,
        rank: dist.rank,
        micro_batch: args.micro_batch,
        seq,
        model_options,
        caller: Caller::Bench,
        gpu_memory: machine.gpu_total,
    };
    crate::plan::resolve_fit(requested, &mut inputs, || machine.gpu_elsewhere)?;
    crate::plan::resolve_zenflow_aside(requested, &mut inputs, &machine)?;
    options.clone_from(&inputs.options);
    let plan = MemoryPlan::new(inputs)?;
    if args.plan == PlanMode::Only {
        return Ok((plan, machine));
    }
    if dist.rank == 0 {
        tracing::info!("{}", plan.summary(&machine));
    }
    if args.plan == PlanMode::Check {
        plan.check_before_start(&machine)?;
    }
    Ok((plan, machine))
}

/// This rank's inputs and targets: its slice of one global batch of `world × tokens` random
/// tokens (the same tokens whatever the number of ranks, so that one rank with the global batch
/// sees what the ranks see together).
fn rank_batch(model: &impl Family, tokens: usize, dist: &DistEnv) -> (Vec<u32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let vocab = model.vocab_size() as u32;
    let global: Vec<u32> =
        (0..tokens * dist.world_size + 1).map(|_| rng.random_range(0..vocab)).collect();
    let mine = &global[dist.rank * tokens..(dist.rank + 1) * tokens + 1];
    (mine[..tokens].to_vec(), mine[1..].to_vec())
}

/// The warm-up and timed steps on this rank.
fn measure<M: Model>(
    args: &BenchOptions,
    engine: &mut ModelEngine<M>,
    gpt: &mut M,
    (inputs, targets): &(Vec<u32>, Vec<u32>),
    group: &mut Group,
) -> Result<Measured> {
    let mut measured = Measured {
        times: Vec::new(),
        compute_times: Vec::new(),
        forward_times: Vec::new(),
        losses: Vec::new(),
        device_memory: None,
        cpu_wait: 0.0,
        cpu_wait_in_compute: 0.0,
        copied: CopiedBytes::default(),
        step_times: StepTimes::default(),
        speculation: SpeculationStats::default(),
        steal: Vec::new(),
        last_steal: None,
    };
    let (mut waited, mut copied) = (engine.cpu_wait(), engine.device().copied_bytes());
    let mut step_times = engine.step_times();
    // A step ends when the compute stream has finished it: work the step left on the copy and
    // collective streams (ZenFlow's window copy, the last weight uploads) overlaps the next step
    // as in training, and is charged to whichever step waits for it; the timed steps together
    // end with every stream idle, so their times add up to the wall time.
    let mut compute_done = engine.device().new_event()?;
    let mut finish_compute = |engine: &ModelEngine<M>| -> Result<()> {
        let device = engine.device();
        device.record(&mut compute_done, device.stream(StreamKind::Compute))?;
        device.sync_event(&compute_done)?;
        Ok(())
    };
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            engine.device().synchronize()?;
            (waited, copied) = (engine.cpu_wait(), engine.device().copied_bytes());
            step_times = engine.step_times();
        }
        let last = step + 1 == args.warmup + args.steps;
        let steal_before = crate::machine::cpu_steal();
        let start = Instant::now();
        let waited_before = engine.cpu_wait();
        for _ in 0..args.accum {
            gpt.set_batch(inputs, targets, None).map_err(TrainError::model)?;
            forward_backward(engine, gpt, 1.0)?;
            if !engine.is_gradient_accumulation_boundary() {
                engine.step()?;
            }
        }
        // The split point of the breakdown: the GPU has finished forward and backward.
        finish_compute(engine)?;
        let compute = start.elapsed().as_secs_f64();
        let waited_in_compute = (engine.cpu_wait() - waited_before).as_secs_f64();
        // Read before the optimizer step, as `zeroflow train` does: a step may leave a bulk copy
        // on the copy engine (ZenFlow's window) that a later small copy would queue behind.
        let loss = gpt.loss().map_err(TrainError::model)?;
        let report = engine.step()?;
        let stepped = start.elapsed().as_secs_f64();
        if last {
            engine.device().synchronize()?;
        } else {
            finish_compute(engine)?;
        }
        let seconds = start.elapsed().as_secs_f64();
        let steal_after = crate::machine::cpu_steal();
        let stolen =
            steal_before.zip(steal_after).map(|(before, after)| after.since(&before).as_secs_f64());
        tracing::debug!(step, compute, stepped, seconds, ?stolen, "bench step (s from its start)");
        // The ranks' mean, after the clock stops (a barrier of the side channel).
        let loss = group.mean(f64::from(loss))?;
        measured.losses.push(loss as f32);
        if !matches!(report, StepReport::Stepped { .. }) {
            return Err(TrainError::NotStepped { step, report: format!("{report:?}") });
        }
        if step >= args.warmup {
            measured.times.push(seconds);
            measured.compute_times.push(compute);
            measured.cpu_wait_in_compute += waited_in_compute;
            measured.steal.push(stolen);
            measured.last_steal = steal_after;
        }
    }
    measured.cpu_wait = (engine.cpu_wait() - waited).as_secs_f64();
    measured.copied = engine.device().copied_bytes().since(copied);
    measured.step_times = engine.step_times().since(&step_times);
    measured.device_memory = M::memory_in_use(engine.device());
    measured.speculation = engine.speculation_stats().unwrap_or_default();
    engine.flush()?;
    measured.forward_times = time_forward(args.steps as usize, engine, gpt, inputs, targets)?;
    Ok(measured)
}

/// Forward alone, `passes` times on the same batch with the trained weights, each from an idle
/// device to its loss on the host: the forward part of the breakdown (a training step's forward
/// queues the same kernels; backward is the rest of forward + backward).
fn time_forward<M: Model>(
    passes: usize,
    engine: &ModelEngine<M>,
    gpt: &mut M,
    inputs: &[u32],
    targets: &[u32],
) -> Result<Vec<f64>> {
    let mut times = Vec::with_capacity(passes);
    for _ in 0..passes.max(1) {
        gpt.set_batch(inputs, targets, None).map_err(TrainError::model)?;
        engine.device().synchronize()?;
        let start = Instant::now();
        gpt.forward(engine.params()).map_err(TrainError::model)?;
        gpt.loss().map_err(TrainError::model)?;
        times.push(start.elapsed().as_secs_f64());
    }
    Ok(times)
}

/// One rank's means and memory, as rank 0 reports them.
struct RankFigures {
    s_per_step_mean: f64,
    forward_backward_s_mean: f64,
    forward_s_mean: f64,
    peak_rss_bytes: Option<u64>,
    device_memory_in_use_bytes: Option<u64>,
}

/// Every rank's figures, in rank order (a barrier of the side channel per figure).
fn gather_ranks(measured: &Measured, group: &mut Group) -> Result<Vec<RankFigures>> {
    // `u64::MAX` stands for "unknown".
    let known = |value: Option<u64>| value.unwrap_or(u64::MAX);
    let unknown = |value: u64| (value != u64::MAX).then_some(value);
    let means = group.gather(measured.mean().to_bits())?;
    let computes = group.gather(measured.compute_mean().to_bits())?;
    let forwards = group.gather(measured.forward_mean().to_bits())?;
    let rss = group.gather(known(peak_rss_bytes()))?;
    let memory = group.gather(known(measured.device_memory.map(|b| b as u64)))?;
    Ok((0..means.len())
        .map(|rank| RankFigures {
            s_per_step_mean: f64::from_bits(means[rank]),
            forward_backward_s_mean: f64::from_bits(computes[rank]),
            forward_s_mean: f64::from_bits(forwards[rank]),
            peak_rss_bytes: unknown(rss[rank]),
            device_memory_in_use_bytes: unknown(memory[rank]),
        })
        .collect())
}

/// The job as the report describes it.
struct Job {
    world: usize,
    /// CPU threads of each rank's optimizer.
    threads: usize,
    /// Rank 0's device.
    description: String,
    /// Rank 0's run-time settings ([`Effective`]).
    settings: serde_json::Value,
}

/// Rank 0's report: the job's throughput (every rank's tokens over the slowest rank's mean step),
/// rank 0's step times, breakdown and memory, and each rank's means.
fn report(
    args: &BenchOptions,
    (model, seq): (&impl Family, usize),
    job: &Job,
    measured: &Measured,
    ranks: &[RankFigures],
) -> serde_json::Value {
    let mut sorted = measured.times.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let (mean, compute_mean) = (measured.mean(), measured.compute_mean());
    let forward_mean = measured.forward_mean();
    let slowest = ranks.iter().map(|r| r.s_per_step_mean).fold(mean, f64::max);
    let tokens = args.micro_batch * seq * args.accum as usize * job.world;
    let rss = ranks[0].peak_rss_bytes;
    let params = model.num_params();
    let flops = flops_per_token(model, seq);
    let per_step = |time: std::time::Duration| time.as_secs_f64() / measured.times.len() as f64;
    let mut out = json!({
        "system": "zeroflow",
        "mode": args.mode.name(),
        "device": job.description,
        "world_size": job.world,
        "cpu_threads_per_rank": job.threads,
        "model": args.model_name,
        "parameters": params,
        "micro_batch": args.micro_batch,
        "accum": args.accum,
        "seq": seq,
        "tokens_per_step": tokens,
        "s_per_step_median": median,
        "s_per_step_mean": mean,
        "tokens_per_s": tokens as f64 / slowest,
        "tokens_per_s_per_gpu": tokens as f64 / slowest / job.world as f64,
        "flops_per_token": flops,
        "model_tflops": tokens as f64 / slowest * flops / 1e12,
        "forward_s_mean": forward_mean,
        "backward_s_mean": compute_mean - forward_mean,
        "forward_backward_s_mean": compute_mean,
        "exposed_optimizer_s_mean": mean - compute_mean,
        // The training thread on or waiting for the CPU optimizer, per step and as a fraction
        // of the step time (the GPU gets no new work meanwhile), and PCIe traffic per step.
        "cpu_wait_s_mean": measured.cpu_wait / measured.times.len() as f64,
        "cpu_wait_fraction": measured.cpu_wait / measured.times.iter().sum::<f64>(),
        "h2d_bytes_per_step": measured.copied.host_to_device as f64 / measured.times.len() as f64,
        "d2h_bytes_per_step": measured.copied.device_to_host as f64 / measured.times.len() as f64,
        // Rank 0's optimizer step by the host clock: waiting for the gradient norm, and the
        // streamed CPU step's waits for gradient chunks and for uploads, and its AdamW.
        "norm_wait_s_mean": per_step(measured.step_times.norm_wait),
        "chunk_wait_s_mean": per_step(measured.step_times.chunk_wait),
        "upload_wait_s_mean": per_step(measured.step_times.upload_wait),
        "cpu_adam_s_mean": per_step(measured.step_times.adam),
        "peak_rss_bytes": rss,
        "device_memory_in_use_bytes": measured.device_memory,
        "peak_rss_bytes_per_param": rss.map(|r| r as f64 / params as f64),
        "ranks": ranks.iter().enumerate().map(|(rank, r)| json!({
            "rank": rank,
            "s_per_step_mean": r.s_per_step_mean,
            "forward_backward_s_mean": r.forward_backward_s_mean,
            "forward_s_mean": r.forward_s_mean,
            "exposed_optimizer_s_mean": r.s_per_step_mean - r.forward_backward_s_mean,
            "peak_rss_bytes": r.peak_rss_bytes,
            "device_memory_in_use_bytes": r.device_memory_in_use_bytes,
        })).collect::<Vec<_>>(),
        "times": measured.times,
        "losses": measured.losses,
    });
    out["settings"] = job.settings.clone();
    // The CPU, its cores and memory, and the CPU AdamW's SIMD level: what the offloaded step's
    // rows depend on besides the GPU.
    out["host"] = crate::machine::host().into();
    // What the hypervisor took from the host's CPUs in each timed step (CPU seconds, all CPUs),
    // and over the steps as a fraction of the host's CPU time: a CPU optimizer on every core
    // slows by more than its share (each piece waits for its slowest thread), so a row with
    // steal measured the host's neighbours as much as zeroflow.
    // (Counted in the kernel's ticks, 10 ms at most hosts: coarse for steps of milliseconds.)
    out["host_steal_s_per_step"] = json!(measured.steal);
    let stolen: Option<f64> = measured.steal.iter().copied().sum();
    let wall = measured.times.iter().sum::<f64>();
    out["host_steal_fraction"] =
        json!(stolen.zip(measured.last_steal).map(|(taken, last)| last.share(taken, wall)));
    out["gradient_clipping"] = json!(args.gradient_clipping);
    out["reduce_bucket_size"] = json!(args.reduce_bucket_size);
    // Of the CPU wait, the part within forward and backward (and so within `backward_s_mean`,
    // the forward being timed alone): the last step's CPU work left to this step's forward
    // (`overlap_forward`), done while the GPU runs it; the rest came after the backward.
    out["cpu_wait_in_forward_backward_s_mean"] =
        json!(measured.cpu_wait_in_compute / measured.times.len() as f64);
    // Rank 0's speculative exact step, warm-up included: steps it stepped pieces of during
    // backward, those it redid (clipping, a changed learning rate) or undid (overflow), and
    // those it sat out after the clip fired.
    out["speculated_steps"] = json!(measured.speculation.speculated_steps);
    out["redone_steps"] = json!(measured.speculation.redone_steps);
    out["paused_steps"] = json!(measured.speculation.paused_steps);
    // The elements stepped under the backward, over all those steps: the share of the
    // partition the speculation hid is this over speculated steps × the partition.
    out["speculated_elements"] = json!(measured.speculation.speculated_elements);
    // What the courier did in those backwards: waited for pieces' copies, stepped pieces; and
    // the steps whose pieces stopped being stepped because the GPU was past the backward.
    out["speculation_copy_wait_s"] = json!(measured.speculation.copy_wait.as_secs_f64());
    out["speculation_stepping_s"] = json!(measured.speculation.stepping.as_secs_f64());
    out["stopped_at_backward_end"] = json!(measured.speculation.stopped_at_backward_end);
    out
}

/// The line `bench step` prints of a report of [`run`] for `model` (its name as given).
pub fn summary(model: &str, out: &serde_json::Value) -> String {
    let number = |key: &str| out[key].as_f64().unwrap_or(f64::NAN);
    let gib = |bytes: f64| bytes / f64::from(1u32 << 30);
    let losses = out["losses"].as_array().map_or(&[][..], Vec::as_slice);
    let loss = |value: Option<&serde_json::Value>| {
        value.and_then(serde_json::Value::as_f64).unwrap_or(f64::NAN)
    };
    let tflops = number("model_tflops");
    let tflops = if tflops < 10.0 { format!("{tflops:.3}") } else { format!("{tflops:.0}") };
    let rss = out["peak_rss_bytes"].as_f64().map_or("unknown".into(), |r| {
        format!("{:.2} GiB ({:.1} B/param)", gib(r), number("peak_rss_bytes_per_param"))
    });
    // Steal worth saying, of the host's CPU time in the timed steps.
    let steal = out["host_steal_fraction"].as_f64().filter(|&f| f > CpuSteal::WORTH_SAYING);
    let steal = steal.map_or(String::new(), |f| {
        format!("; the hypervisor took {:.1} % of the host's CPU time (steal)", 100.0 * f)
    });
    let memory = out["device_memory_in_use_bytes"]
        .as_f64()
        .map_or("unknown".into(), |b| format!("{:.2} GiB", gib(b)));
    format!(
        "{model} {} on {} × {}: {:.0} tokens/s ({:.0} per rank), {tflops} model TFLOP/s; rank 0: \
         {:.4} s/step median, {:.4} s mean, forward {:.4} s + backward {:.4} s, exposed optimizer \
         {:.4} s, CPU wait {:.1} % of the step (norm wait {:.4} s, CPU AdamW {:.4} s, waits for \
         gradient chunks {:.4} s and uploads {:.4} s), PCIe {:.2} GB in / {:.2} GB out per step, \
         peak RSS {rss}, device memory in use {memory}; loss {:.3} → {:.3}{steal}",
        out["mode"].as_str().unwrap_or_default(),
        out["world_size"],
        out["device"].as_str().unwrap_or_default(),
        number("tokens_per_s"),
        number("tokens_per_s_per_gpu"),
        number("s_per_step_median"),
        number("s_per_step_mean"),
        number("forward_s_mean"),
        number("backward_s_mean"),
        number("exposed_optimizer_s_mean"),
        100.0 * number("cpu_wait_fraction"),
        number("norm_wait_s_mean"),
        number("cpu_adam_s_mean"),
        number("chunk_wait_s_mean"),
        number("upload_wait_s_mean"),
        number("h2d_bytes_per_step") / 1e9,
        number("d2h_bytes_per_step") / 1e9,
        loss(losses.first()),
        loss(losses.last()),
    )
}

/// The bench config's error (resolving it, or the engine's options of it).
fn bench_config(error: impl Into<TrainError>) -> TrainError {
    error.into().context("the bench config")
}

/// The process's peak resident set (VmHWM), where Linux reports it.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod multi_rank_tests;

#[cfg(test)]
mod tests {
    use zeroflow_gpt::GptConfig;

    use super::*;

    #[test]
    fn model_flops_count_the_weights_and_attention() {
        // gpt2-124m: 124,439,808 parameters, 12 layers of width 768, context 1024.
        let model = GptConfig::named("gpt2-124m").unwrap();
        let want = 6.0 * 124_439_808.0 + 12.0 * 12.0 * 768.0 * 1024.0;
        assert_eq!(flops_per_token(&model, 1024), want);
    }
}
