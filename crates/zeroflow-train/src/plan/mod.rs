//! The memory plan of a run before anything is allocated (`zeroflow plan`, the first lines of
//! `train` and `bench step`; DESIGN.md §4, "The memory plan"): the bytes of each kind on the GPU
//! and in host memory, from the model's padded flat layout, the engine's options (its buffers as
//! [`EngineOptions::planned_buffers`] says), the world size, the micro-batch and the model's
//! activation plan, plus named estimates for what no buffer of ours holds (the CUDA context, the
//! process itself); the totals against the machine, and when they do not fit, the knobs that
//! bring them under, each found by planning again with it.

use serde_json::json;
use zeroflow_core::DType;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::layout::FlatLayout;
use zeroflow_engine::checkpoint::{self, WRITE_BUFFERS_BYTES, WRITE_CHUNK_BYTES};
use zeroflow_engine::{
    AccumulateOn, BufferKind, EngineOptions, MemoryKind, Offload, OffloadUpdate, Placement, Stage,
    ZenFlowAside,
};
use zeroflow_hf::direct::READ_BUFFERS_BYTES;
use zeroflow_nn::PlanOptions;

use crate::error::{Result, input};
use crate::settings::Requested;
use crate::{DeviceKind, Family, ModelSpec, with_family};

mod fit;

pub use fit::{FitShare, fit_device_share, resolve_fit};

/// The CUDA context of one process on one GPU: the driver's own allocations, the loaded kernel
/// modules (NVRTC's and cuBLASLt's), the streams and events. Calibrated on the H200 from
/// BENCHMARKS.md's `bench gpt --model gpt-1.3b --micro-batch 8` (2026-12-01, no NCCL): 21.37 GiB
/// in use (cuMemGetInfo's total − free) less the 20.85 GiB of planned weights, gradients,
/// activations and cuBLASLt workspace. To check again as `bench step`'s
/// `device_memory_in_use_bytes` − `planned_gpu_bytes` on a small model.
pub const CUDA_CONTEXT_BYTES: u64 = 532 << 20;

/// NCCL's buffers of a rank's communicator (every CUDA run has one, a group of one included).
/// Calibrated on the H200 from BENCHMARKS.md's `bench step --model gpt-1.3b --mode offload`
/// (one rank): 22.0 GiB in use, 0.64 GiB more than `bench gpt`'s context and the same buffers.
/// Not yet measured with several ranks (NCCL's buffers grow with the peers).
pub const NCCL_BUFFER_BYTES: u64 = 655 << 20;

/// The process without its buffers on the CPU device: the binary, its libraries, the threads'
/// stacks. An estimate, to be calibrated as `bench step --device cpu`'s `peak_rss_bytes` less the
/// plan's buffers for the tiny model.
pub const HOST_BASELINE_BYTES: u64 = 64 << 20;

/// The process without its buffers with a GPU: [`HOST_BASELINE_BYTES`] and what the CUDA
/// driver, NCCL, cuBLASLt and NVRTC map and allocate in host memory. Calibrated on the H200 from
/// BENCHMARKS.md's gpt-1.3b `bench step` peak RSS (8.6, 12.8 and 23.4 B/param in `gpu`,
/// `offload` and `zenflow`): 0.74, 0.91 and 0.78 GiB above the planned host buffers; 0.8 GiB.
/// To check again as `bench step`'s `peak_rss_bytes` − `planned_host_bytes`.
pub const CUDA_HOST_BASELINE_BYTES: u64 = 819 << 20;

/// What a run does with its memory plan before anything is allocated.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PlanMode {
    /// Refuse to start where it does not fit the machine (an input error naming the knobs).
    #[default]
    Check,
    /// Start anyway (`--no-plan-check`).
    NoCheck,
    /// `bench step --plan-only`: the plan instead of the measurement, `{"plan": …}`.
    Only,
}

/// Who holds the initial weights besides the engine, which differs between the callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// `bench step`: fresh weights in the model's dtype, which the engine takes.
    Bench,
    /// `train`: the weights in the model's dtype (fresh or read), which the engine takes, and
    /// when `resumed` the checkpoint's optimizer state, read into the engine's; with `samples`
    /// (`--sample-every`), the weights in f32 on the host while a sample is written.
    Train { resumed: bool, samples: bool },
}

/// What a plan is of: a rank of a run or of a `bench step`.
#[derive(Clone, Debug)]
pub struct PlanInputs {
    pub model: ModelSpec,
    pub device: DeviceKind,
    pub options: EngineOptions,
    pub world_size: usize,
    pub rank: usize,
    pub micro_batch: usize,
    pub seq: usize,
    /// The GPU model's attention and activation checkpointing.
    pub model_options: PlanOptions,
    pub caller: Caller,
    /// The GPU's memory, where known: the engine sums a window of gradients on the device where
    /// its free memory allows (`AccumulateOn::Auto`).
    pub gpu_memory: Option<u64>,
}

impl PlanInputs {
    /// The dtype of the weights: bf16 on a GPU, f32 on the CPU device.
    pub fn dtype(&self) -> DType {
        match self.device {
            DeviceKind::Cuda => DType::Bf16,
            DeviceKind::Cpu => DType::F32,
        }
    }
}

/// One line of the plan: bytes of one kind on the GPU or in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanLine {
    pub memory: MemoryKind,
    pub kind: &'static str,
    pub bytes: u64,
    /// Whose peak it is part of ([`MemoryPlan::host_total`]).
    pub phase: Phase,
}

/// When a line's bytes are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// For the whole run.
    Run,
    /// The engine's own buffers for the whole run.
    Engine,
    /// While the engine is built (its initial weights, the master weights being filled): one
    /// peak, not added to the engine's run buffers.
    EngineSetUp,
    /// Before the engine is built (the initial weights, drawn or read).
    BeforeEngine,
}

/// The bytes a rank needs, by kind, and their totals.
#[derive(Clone, Debug)]
pub struct MemoryPlan {
    pub inputs: PlanInputs,
    pub lines: Vec<PlanLine>,
    /// Bytes of GPU memory at the peak (everything is allocated up front; 0 on the CPU device).
    pub gpu_total: u64,
    /// Bytes of host memory at the peak (the peak RSS): the lines held for the whole run, plus
    /// the larger of the engine's run buffers and its set-up peak; or what comes before the
    /// engine with the lines held for the whole run but the CUDA driver's and libraries' (the
    /// device is opened after the initial weights are made), where that is more.
    pub host_total: u64,
    /// Bytes of disk a checkpoint of the run takes (the weights in the run's type, every rank's
    /// part of the optimizer state).
    pub checkpoint_disk_bytes: u64,
    /// Bytes of disk the weights alone take in the run's type (what `--export` writes).
    pub weights_disk_bytes: u64,
}

impl MemoryPlan {
    /// The plan of `inputs`, computed without a GPU.
    pub fn new(inputs: PlanInputs) -> Result<MemoryPlan> {
        let lines = with_family!(&inputs.model, family => plan_lines(&inputs, family))?;
        let layout = with_family!(&inputs.model, family => family.flat_layout(inputs.world_size))?;
        let checkpoint_disk_bytes = checkpoint_disk_bytes(&inputs, layout.padded_len() as u64);
        let parameters = with_family!(&inputs.model, family => family.num_params()) as u64;
        let weights_disk_bytes = parameters * inputs.dtype().size() as u64;
        let gpu_total = sum(&lines, |l| l.memory == MemoryKind::Device);
        let host = |phase: Phase| sum(&lines, |l| l.memory == MemoryKind::Host && l.phase == phase);
        let engine = host(Phase::Run) + host(Phase::Engine).max(host(Phase::EngineSetUp));
        // The device is opened after the initial weights are made (or read): on the H200
        // (BENCHMARKS.md, 2026-12-04), where the engine held less than those weights (then f32
        // and converted; a device share of 0.99), the peak RSS was them and the process alone.
        let late = match inputs.device {
            DeviceKind::Cuda => CUDA_HOST_BASELINE_BYTES - HOST_BASELINE_BYTES,
            DeviceKind::Cpu => 0,
        };
        let before = host(Phase::Run) - late + host(Phase::BeforeEngine);
        let host_total = engine.max(before);
        Ok(MemoryPlan {
            inputs,
            lines,
            gpu_total,
            host_total,
            checkpoint_disk_bytes,
            weights_disk_bytes,
        })
    }
}

/// What saving a checkpoint holds beside the engine: a piece of each tensor at a time
/// ([`WRITE_CHUNK_BYTES`]: the piece fetched or lent, its bytes converted, and the device's
/// staging buffer), the file's write buffers ([`WRITE_BUFFERS_BYTES`]), and with ZenFlow the
/// device's state of the piece's selected columns (fp32, at most four bytes per element of the
/// piece: two pieces' bytes where the piece is bf16, with its own staging buffer), downloaded
/// for the piece to merge with the host's. The optimizer
/// state and the weights are lent or fetched in pieces, never copied whole.
fn checkpoint_bytes(inputs: &PlanInputs) -> u64 {
    let staging = zeroflow_device::DOWNLOAD_CHUNK_BYTES as u64;
    let pieces = 2 * WRITE_CHUNK_BYTES as u64 + staging + WRITE_BUFFERS_BYTES as u64;
    let selected = match inputs.options.zenflow() {
        Some(_) => 2 * WRITE_CHUNK_BYTES as u64 + staging,
        None => 0,
    };
    pieces + selected
}

/// The files of a checkpoint of `padded` parameters: the weights in the run's type, and every
/// rank's part of the optimizer state (fp32 master weights, the moments in their dtype, and
/// ZenFlow's window of fp32 gradient sums).
fn checkpoint_disk_bytes(inputs: &PlanInputs, padded: u64) -> u64 {
    let moments = inputs.options.offload().map_or(OptimizerStateDtype::Fp32, |o| o.moments);
    let moments = 2 * moments.bytes() as u64;
    let window = if inputs.options.zenflow().is_some() { 4 } else { 0 };
    padded * (inputs.dtype().size() as u64 + 4 + moments + window)
}

fn sum(lines: &[PlanLine], keep: impl Fn(&PlanLine) -> bool) -> u64 {
    lines.iter().filter(|l| keep(l)).map(|l| l.bytes).sum()
}

fn plan_lines(inputs: &PlanInputs, family: &impl Family) -> Result<Vec<PlanLine>> {
    let layout = family.flat_layout(inputs.world_size)?;
    let mut lines = run_lines(inputs, family, &layout)?;
    lines.extend(start_and_save_lines(inputs, &layout)?);
    lines.extend(engine_lines(inputs, &layout, &lines));
    Ok(merge(lines))
}

/// A line of the whole run.
fn run_line(memory: MemoryKind, kind: &'static str, bytes: u64) -> PlanLine {
    PlanLine { memory, kind, bytes, phase: Phase::Run }
}

/// What the run holds besides the engine: on a GPU the context, the libraries' workspaces and
/// the activations; on the CPU the f32 activations; the data loader's batches.
fn run_lines(
    inputs: &PlanInputs,
    family: &impl Family,
    layout: &FlatLayout,
) -> Result<Vec<PlanLine>> {
    use MemoryKind::{Device, Host};
    let mut lines = Vec::new();
    if inputs.device == DeviceKind::Cuda {
        lines.push(run_line(Device, "CUDA context (estimate)", CUDA_CONTEXT_BYTES));
        let workspace = zeroflow_device::cuda::blas::WORKSPACE_BYTES as u64;
        lines.push(run_line(Device, "cuBLASLt workspace", workspace));
        lines.push(run_line(Device, "NCCL buffers (estimate)", NCCL_BUFFER_BYTES));
        let (batch, seq) = (inputs.micro_batch, inputs.seq);
        let acts = family.cuda_planned_activations(layout, (batch, seq), inputs.model_options)?;
        let checkpointed = if inputs.model_options.activation_checkpointing {
            "activations (checkpointed)"
        } else {
            "activations"
        };
        lines.push(run_line(Device, checkpointed, acts.activations as u64 + acts.stats as u64));
        lines.push(run_line(Device, "activation gradients", acts.activation_grads as u64));
        lines.push(run_line(Device, "activation scratch", acts.scratch as u64));
        lines.push(run_line(
            Host,
            "process, CUDA driver and libraries (estimate)",
            CUDA_HOST_BASELINE_BYTES,
        ));
    } else {
        // The CPU model's f32 activations and their gradients.
        let acts = family.cpu_activations(inputs.micro_batch, inputs.seq) as u64;
        lines.push(run_line(Host, "activations and their gradients (f32)", acts * 8));
        lines.push(run_line(Host, "process (estimate)", HOST_BASELINE_BYTES));
    }
    // Inputs and targets (u32), the batch being read and the one in use.
    let tokens = (inputs.micro_batch * inputs.seq) as u64;
    lines.push(run_line(Host, "data loader batches", tokens * 8 * 2));
    Ok(lines)
}

/// The host's transient lines: the initial weights, a resumed run's optimizer state read from
/// its checkpoint, saving a checkpoint, and a sample's weights.
fn start_and_save_lines(inputs: &PlanInputs, layout: &FlatLayout) -> Result<Vec<PlanLine>> {
    let padded = layout.padded_len() as u64;
    let host = |kind, bytes, phase| PlanLine { memory: MemoryKind::Host, kind, bytes, phase };
    let resumed = matches!(inputs.caller, Caller::Train { resumed: true, .. });
    // The initial weights in the model's dtype (fresh, read by --init-from, or the checkpoint's,
    // through the reader's buffers), drawn or read straight into their buffer, which the engine
    // takes.
    let reading = if resumed { READ_BUFFERS_BYTES as u64 } else { 0 };
    let weights = padded * inputs.dtype().size() as u64 + reading;
    let mut lines = vec![host("initial weights (transient)", weights, Phase::BeforeEngine)];
    if resumed {
        // The checkpoint's fp32 master and moments, read from its files through the reader's
        // buffers: an array at a time into an offloaded optimizer's own state (bf16 moments
        // through two f32 pieces; a device share's part through its two upload buffers), whole
        // where the optimizer is on the device (uploaded from there). Its weights are the
        // initial ones the engine is built with.
        let partition = layout.partition_range(inputs.rank).len() as u64;
        let piece = zeroflow_engine::RESTORE_PIECE.min(partition as usize) as u64;
        let reading = READ_BUFFERS_BYTES as u64;
        let state = match inputs.options.offload().map(|o| (o.moments, o.stream.device_share)) {
            Some((OptimizerStateDtype::Bf16, _)) => 2 * 4 * piece + reading,
            Some((OptimizerStateDtype::Fp32, share)) if share > 0.0 => {
                reading + zeroflow_engine::SHARE_UPLOAD_BYTES as u64
            }
            Some((OptimizerStateDtype::Fp32, _)) => reading,
            None => partition * 12 + reading,
        };
        let kind = "the checkpoint's optimizer state (read into the engine's)";
        lines.push(host(kind, state, Phase::Engine));
    }
    if let Caller::Train { .. } = inputs.caller {
        let kind = "saving a checkpoint (transient)";
        lines.push(host(kind, checkpoint_bytes(inputs), Phase::Engine));
    }
    // A sample during training (rank 0's): the weights downloaded into f32 for the family's CPU
    // decoder (`Trainer::host_weights`), its cache and logits beside them small.
    if let (Caller::Train { samples: true, .. }, 0) = (inputs.caller, inputs.rank) {
        let single = inputs.model.flat_layout(1)?.padded_len() as u64;
        let kind = "a sample's weights in f32 (transient, --sample-every)";
        lines.push(host(kind, 4 * single.max(padded), Phase::Engine));
    }
    Ok(lines)
}

/// The engine's buffers ([`EngineOptions::planned_buffers`]), with the device's free memory when
/// the engine is built (its `AccumulateOn::Auto` choice): after `lines`' device memory (the
/// context and the model), the flat weights and gradients. On the CPU device, device memory is
/// host memory.
fn engine_lines(inputs: &PlanInputs, layout: &FlatLayout, lines: &[PlanLine]) -> Vec<PlanLine> {
    use MemoryKind::{Device, Host};
    let cuda = inputs.device == DeviceKind::Cuda;
    let on_device = if cuda { Device } else { Host };
    let (padded, dtype) = (layout.padded_len() as u64, inputs.dtype());
    let free = inputs.gpu_memory.filter(|_| cuda).map(|total| {
        let taken = sum(lines, |l| l.memory == Device) + 2 * padded * dtype.size() as u64;
        total.saturating_sub(taken)
    });
    let buffers = inputs.options.planned_buffers(layout, inputs.rank, dtype, free);
    buffers
        .into_iter()
        .map(|buffer| {
            let memory = if buffer.memory == Device { on_device } else { Host };
            let phase = match (buffer.kind, memory) {
                (BufferKind::SetUp, _) => Phase::EngineSetUp,
                (_, Host) => Phase::Engine,
                (_, Device) => Phase::Run,
            };
            PlanLine { memory, kind: buffer.kind.name(), bytes: buffer.bytes, phase }
        })
        .collect()
}

/// The lines with the same place, kind and phase as one.
fn merge(lines: Vec<PlanLine>) -> Vec<PlanLine> {
    let mut out: Vec<PlanLine> = Vec::new();
    for line in lines {
        let same =
            |l: &&mut PlanLine| (l.memory, l.kind, l.phase) == (line.memory, line.kind, line.phase);
        match out.iter_mut().find(same) {
            Some(existing) => existing.bytes += line.bytes,
            None => out.push(line),
        }
    }
    out
}

/// What the machine has, as far as it says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineMemory {
    /// The GPU's memory (`cuDeviceTotalMem`; `None` on the CPU device or where unknown).
    pub gpu_total: Option<u64>,
    /// What other processes hold of it when read ([`MachineMemory::this_machine`]; `None` on
    /// the CPU device or where unknown): the plan must fit beside it.
    pub gpu_elsewhere: Option<u64>,
    /// `MemTotal` and `MemAvailable` of /proc/meminfo.
    pub host_total: Option<u64>,
    pub host_available: Option<u64>,
    /// Whether the figures are another machine's, given to plan for it ([`GivenMemory`]), not
    /// read from this one.
    pub given: bool,
    /// The job's ranks on this host (`LOCAL_WORLD_SIZE`; 0 counts as 1): they share its host
    /// memory, each with a plan like this rank's.
    pub host_ranks: usize,
}

/// Memory to plan for instead of this machine's (`zeroflow plan --gpu-memory`, `--host-memory`):
/// a GPU of that size with nothing else on it, a host with that much available.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GivenMemory {
    pub gpu: Option<u64>,
    pub host: Option<u64>,
}

impl MachineMemory {
    /// This machine's, for `device` (the GPU of `gpu` among those visible), read now: a run reads
    /// it once, before it allocates (a later reading would count the run's own GPU memory as
    /// other processes').
    pub fn this_machine(device: DeviceKind, gpu: usize, host_ranks: usize) -> MachineMemory {
        let gpu_total = match device {
            DeviceKind::Cpu => None,
            DeviceKind::Cuda => zeroflow_device::cuda::info::list_gpus()
                .ok()
                .and_then(|gpus| gpus.get(gpu).map(|g| g.memory_bytes as u64)),
        };
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| {
            let line = meminfo.lines().find(|line| line.starts_with(name))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()?.checked_mul(1024)
        };
        MachineMemory {
            gpu_total,
            gpu_elsewhere: gpu_total.and_then(|_| MachineMemory::gpu_held_elsewhere(gpu)),
            host_total: field("MemTotal:"),
            host_available: field("MemAvailable:"),
            given: false,
            host_ranks,
        }
    }

    /// [`MachineMemory::this_machine`] where `given` says nothing, its figures where it does:
    /// the GPU's without asking this machine's (which may have none).
    pub fn this_or_given(
        device: DeviceKind,
        gpu: usize,
        host_ranks: usize,
        given: GivenMemory,
    ) -> MachineMemory {
        if given == GivenMemory::default() {
            return MachineMemory::this_machine(device, gpu, host_ranks);
        }
        let this = match given.gpu {
            Some(_) => MachineMemory::this_machine(DeviceKind::Cpu, gpu, host_ranks),
            None => MachineMemory::this_machine(device, gpu, host_ranks),
        };
        let gpu_total = given.gpu.filter(|_| device == DeviceKind::Cuda).or(this.gpu_total);
        MachineMemory {
            gpu_total,
            gpu_elsewhere: if given.gpu.is_some() { Some(0) } else { this.gpu_elsewhere },
            host_total: given.host.or(this.host_total),
            host_available: given.host.or(this.host_available),
            given: true,
            host_ranks,
        }
    }

    /// The ranks that share the host's memory (at least 1).
    pub fn host_ranks(&self) -> u64 {
        self.host_ranks.max(1) as u64
    }

    /// ` × N ranks on this host = T` where several ranks share it, else empty: how a rank's
    /// host total `bytes` becomes the host's.
    fn said_host_ranks(&self, bytes: u64) -> String {
        match self.host_ranks() {
            1 => String::new(),
            ranks => format!(" × {ranks} ranks on this host = {}", gib(bytes * ranks)),
        }
    }

    /// How the plan's messages name the machine.
    fn name(&self) -> &'static str {
        if self.given { "the machine given" } else { "this machine" }
    }

    /// The memory other processes hold on GPU `gpu` now (`None`, with a warning, where the
    /// driver cannot say): its total less its free memory, read from a context of this process
    /// opened for the reading, less that context's estimate ([`CUDA_CONTEXT_BYTES`], which the
    /// plan counts as this run's).
    fn gpu_held_elsewhere(gpu: usize) -> Option<u64> {
        match zeroflow_device::cuda::info::memory_now(gpu) {
            Ok((free, total)) => {
                Some((total as u64).saturating_sub(free as u64).saturating_sub(CUDA_CONTEXT_BYTES))
            }
            Err(error) => {
                tracing::warn!(
                    "GPU {gpu}'s free memory is unknown ({error}): the plan assumes nothing else \
                     holds any of it"
                );
                None
            }
        }
    }

    /// ` (X held by other processes)` where they hold a gibibyte or more of the GPU, else empty.
    fn said_elsewhere(&self) -> String {
        match self.gpu_elsewhere.filter(|&bytes| bytes >= fit::SAID_ELSEWHERE) {
            Some(bytes) => format!(" ({} held by other processes)", gib(bytes)),
            None => String::new(),
        }
    }
}

/// Whether a plan fits a machine, GPU and host apart (`true` where the machine does not say).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fit {
    pub gpu: bool,
    pub host: bool,
}

impl Fit {
    pub fn fits(self) -> bool {
        self.gpu && self.host
    }
}

/// GiB, as the plan prints them.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

impl MemoryPlan {
    /// Against `machine`: the GPU total within the GPU's memory, the host total within the
    /// memory available (the process's own is part of the plan: [`CUDA_HOST_BASELINE_BYTES`]).
    pub fn fit(&self, machine: &MachineMemory) -> Fit {
        let elsewhere = machine.gpu_elsewhere.unwrap_or(0);
        Fit {
            gpu: machine.gpu_total.is_none_or(|total| self.gpu_total + elsewhere <= total),
            host: machine
                .host_available
                .is_none_or(|available| self.host_total * machine.host_ranks() <= available),
        }
    }

    /// One line: the totals against the machine's, as `train` and `bench step` start with.
    pub fn summary(&self, machine: &MachineMemory) -> String {
        let of = |total: Option<u64>| total.map_or(String::new(), |t| format!(" of {}", gib(t)));
        let fit = self.fit(machine);
        format!(
            "memory plan: GPU {}{}{}, host {}{}{} available; {}",
            gib(self.gpu_total),
            of(machine.gpu_total),
            machine.said_elsewhere(),
            gib(self.host_total),
            machine.said_host_ranks(self.host_total),
            of(machine.host_available),
            if fit.fits() { "fits" } else { "does not fit" }
        )
    }

    /// The table `zeroflow plan` prints: each kind's GPU and host bytes, the totals, the
    /// machine's, and whether it fits (with the knobs that would make it fit where it does not).
    pub fn table(&self, machine: &MachineMemory) -> String {
        let mut out = format!("{:<60} {:>12} {:>12}\n", "kind", "GPU", "host");
        for line in &self.lines {
            let (gpu, host) = match line.memory {
                MemoryKind::Device => (gib(line.bytes), String::new()),
                MemoryKind::Host => (String::new(), gib(line.bytes)),
            };
            let kind = match line.phase {
                Phase::EngineSetUp | Phase::BeforeEngine => format!("{} [set-up peak]", line.kind),
                Phase::Run | Phase::Engine => line.kind.to_owned(),
            };
            out += &format!("{kind:<60} {gpu:>12} {host:>12}\n");
        }
        out += &format!(
            "{:<60} {:>12} {:>12}\n",
            "total (peak)",
            gib(self.gpu_total),
            gib(self.host_total)
        );
        if machine.host_ranks() > 1 {
            let ranks = machine.host_ranks();
            let all = format!("total of the {ranks} ranks on this host");
            out += &format!("{all:<60} {:>12} {:>12}\n", "", gib(self.host_total * ranks));
        }
        let machine_gpu = machine.gpu_total.map_or("-".into(), gib);
        let available = machine.host_available.map_or("-".into(), gib);
        out += &format!(
            "{:<60} {machine_gpu:>12} {available:>12}\n",
            if machine.given {
                "machine given (GPU total, host available)"
            } else {
                "machine (GPU total, host available)"
            }
        );
        if let Some(elsewhere) = machine.gpu_elsewhere.filter(|&b| b >= fit::SAID_ELSEWHERE) {
            out +=
                &format!("{:<60} {:>12}\n", "held on the GPU by other processes", gib(elsewhere));
        }
        match self.check(machine) {
            Ok(()) => out += "fits\n",
            Err(error) => out += &format!("does not fit: {error}\n"),
        }
        out += &format!(
            "disk: a checkpoint {}; the weights alone (--export) {}\n",
            checkpoint::disk_size(self.checkpoint_disk_bytes),
            checkpoint::disk_size(self.weights_disk_bytes)
        );
        out
    }

    /// The plan as `zeroflow plan --json` prints it.
    pub fn to_json(&self, machine: &MachineMemory) -> serde_json::Value {
        let lines: Vec<_> = self
            .lines
            .iter()
            .map(|l| {
                json!({
                    "memory": match l.memory { MemoryKind::Device => "gpu", MemoryKind::Host => "host" },
                    "kind": l.kind,
                    "bytes": l.bytes,
                    "phase": format!("{:?}", l.phase),
                })
            })
            .collect();
        let fit = self.fit(machine);
        let inputs = &self.inputs;
        let (knobs, pairs) = self.ways_to_fit(machine);
        json!({
            "model": inputs.model.shape_json(),
            "parameters": inputs.model.num_params(),
            "device": format!("{:?}", inputs.device).to_lowercase(),
            "world_size": inputs.world_size,
            "micro_batch": inputs.micro_batch,
            "seq": inputs.seq,
            "attention": format!("{:?}", inputs.model_options.attention).to_lowercase(),
            "activation_checkpointing": inputs.model_options.activation_checkpointing,
            "device_share": inputs.options.offload().map(|offload| offload.stream.device_share),
            "lines": lines,
            "gpu_total_bytes": self.gpu_total,
            "host_total_bytes": self.host_total,
            "checkpoint_disk_bytes": self.checkpoint_disk_bytes,
            "weights_disk_bytes": self.weights_disk_bytes,
            "machine_gpu_bytes": machine.gpu_total,
            "machine_gpu_held_elsewhere_bytes": machine.gpu_elsewhere,
            "machine_host_total_bytes": machine.host_total,
            "machine_host_available_bytes": machine.host_available,
            "machine_given": machine.given,
            "machine_host_ranks": machine.host_ranks(),
            "fits": fit.fits(),
            "fits_gpu": fit.gpu,
            "fits_host": fit.host,
            "knobs_that_fit": knobs.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
            "knob_pairs_that_fit": pairs.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>(),
        })
    }
}

/// A change to the run that lowers its memory, as the caller spells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Knob {
    Checkpointing,
    MicroBatch(usize),
    Offload,
    ZenFlow,
    /// The exact offload in place of ZenFlow (`zenflow`) or the delayed update, whose device
    /// buffers (the gradient sums, the weights of the step before) it does without.
    ExactOffload {
        zenflow: bool,
    },
    /// ZenFlow's CPU step not overlapped with the next steps (`overlap_step: false`, `bench
    /// step --mode zenflow-inline`): one f32 sum of the unselected columns on the GPU instead of
    /// two, and no weights of the step before.
    ZenFlowInline,
    /// ZenFlow's window set aside in host memory (`zeroflow.offload.zenflow_aside: "host"`):
    /// `overlap_step` with the one window on the GPU, as inline, and 6 bytes per parameter more
    /// of host memory (the window's copy and the CPU's weights until applied).
    ZenFlowAsideHost,
    OptimizerOnGpu,
    /// ZeRO-2's window summed on the GPU (the exact offload step then streams it: no host
    /// accumulator).
    SumOnGpu,
    Bf16Moments,
    /// The device share `fit` chooses, in hundredths: smaller than asked where the GPU is short,
    /// larger where the host is (the share's optimizer state is held on the GPU instead).
    DeviceShare(u32),
}

impl Knob {
    fn flag(self, caller: Caller) -> String {
        let bench = caller == Caller::Bench;
        match (self, bench) {
            (Knob::Checkpointing, _) => "--activation-checkpointing".into(),
            (Knob::MicroBatch(n), _) => format!("--micro-batch {n}"),
            (Knob::Offload, true) => "--mode offload".into(),
            (Knob::Offload, false) => {
                "offload (zero_optimization.offload_optimizer.device: \"cpu\")".into()
            }
            (Knob::ZenFlow, true) => "--mode zenflow".into(),
            (Knob::ZenFlow, false) => "ZenFlow (zero_optimization.zenflow)".into(),
            (Knob::ExactOffload { .. }, true) => "--mode offload".into(),
            (Knob::ExactOffload { zenflow: true }, false) => {
                "the exact offload (no zero_optimization.zenflow)".into()
            }
            (Knob::ExactOffload { zenflow: false }, false) => {
                "the exact offload (zeroflow.delayed_update.enabled: false)".into()
            }
            (Knob::ZenFlowInline, true) => "--mode zenflow-inline".into(),
            (Knob::ZenFlowInline, false) => {
                "ZenFlow's step not overlapped (zero_optimization.zenflow.overlap_step: false)"
                    .into()
            }
            (Knob::ZenFlowAsideHost, true) => "--zenflow-aside host".into(),
            (Knob::ZenFlowAsideHost, false) => concat!(
                "ZenFlow's window set aside in host memory ",
                "(zeroflow.offload.zenflow_aside: \"host\")"
            )
            .into(),
            (Knob::OptimizerOnGpu, true) => "--mode gpu".into(),
            (Knob::OptimizerOnGpu, false) => {
                "the optimizer on the GPU (no zero_optimization.offload_optimizer)".into()
            }
            (Knob::SumOnGpu, _) => "--accumulate-on device".into(),
            (Knob::Bf16Moments, _) => {
                "16-bit Adam moments (\"zeroflow\": {\"optimizer_state_dtype\": \"bf16\"})".into()
            }
            (Knob::DeviceShare(hundredths), _) => {
                format!("--device-share {} (or fit)", f64::from(hundredths) / 100.0)
            }
        }
    }

    /// `inputs` with this knob turned, or `None` where it changes nothing.
    fn apply(self, inputs: &PlanInputs) -> Option<PlanInputs> {
        let mut out = inputs.clone();
        let offload = |update| {
            let mut offload = Offload::exact(zeroflow_device::HostMemory::Pinned, 1);
            offload.update = update;
            Placement::Offload(offload)
        };
        match self {
            Knob::Checkpointing if !inputs.model_options.activation_checkpointing => {
                out.model_options.activation_checkpointing = true;
            }
            Knob::MicroBatch(n) if n < inputs.micro_batch => out.micro_batch = n,
            Knob::Offload if inputs.options.offload().is_none() => {
                out.options.placement = offload(OffloadUpdate::Exact);
            }
            Knob::ZenFlow
                if inputs.options.zenflow().is_none() && inputs.options.grad_accum == 1 =>
            {
                out.options.placement = offload(OffloadUpdate::ZenFlow(zenflow_options(0.05)));
            }
            Knob::ExactOffload { .. }
                if inputs.options.offload().is_some_and(|o| o.update != OffloadUpdate::Exact) =>
            {
                out.options.offload_mut()?.update = OffloadUpdate::Exact;
            }
            Knob::ZenFlowInline if inputs.options.zenflow().is_some_and(|z| z.overlap_step) => {
                if let OffloadUpdate::ZenFlow(zenflow) = &mut out.options.offload_mut()?.update {
                    zenflow.overlap_step = false;
                }
            }
            Knob::ZenFlowAsideHost
                if inputs.options.zenflow().is_some_and(|z| z.overlap_step)
                    && inputs
                        .options
                        .offload()
                        .is_some_and(|o| o.stream.zenflow_aside == ZenFlowAside::Device) =>
            {
                out.options.offload_mut()?.stream.zenflow_aside = ZenFlowAside::Host;
            }
            Knob::OptimizerOnGpu if inputs.options.offload().is_some() => {
                out.options.placement = Placement::Device;
            }
            Knob::SumOnGpu
                if inputs.options.stage == Stage::Zero2
                    && inputs.options.grad_accum > 1
                    && inputs.options.offload().is_some_and(|o| {
                        o.stream.accumulate_on != AccumulateOn::Device
                            && o.update == OffloadUpdate::Exact
                    }) =>
            {
                out.options.offload_mut()?.stream.accumulate_on = AccumulateOn::Device;
            }
            Knob::Bf16Moments
                if inputs
                    .options
                    .offload()
                    .is_some_and(|o| o.moments != OptimizerStateDtype::Bf16) =>
            {
                out.options.offload_mut()?.moments = OptimizerStateDtype::Bf16;
            }
            Knob::DeviceShare(hundredths)
                if inputs
                    .options
                    .offload()
                    .is_some_and(|o| o.stream.device_share != f64::from(hundredths) / 100.0) =>
            {
                out.options.offload_mut()?.stream.device_share = f64::from(hundredths) / 100.0;
            }
            _ => return None,
        }
        Some(out)
    }
}

/// Where ZenFlow sets its window aside when nothing asks (`zenflow_aside` unset): on the device,
/// unless the device's plan does not fit `machine`'s GPU and the plan with the window in host
/// memory fits the whole machine — then host memory (`requested` and `inputs` say so, and the
/// log). The overlapped step keeps its speed where only the host has room for its window (an 80
/// GB GPU at llama-8b); the numbers are the same either way.
pub fn resolve_zenflow_aside(
    requested: &mut Requested,
    inputs: &mut PlanInputs,
    machine: &MachineMemory,
) -> Result<()> {
    if requested.zenflow_aside.is_some() || machine.gpu_total.is_none() {
        return Ok(());
    }
    let Some(on_host) = Knob::ZenFlowAsideHost.apply(inputs) else { return Ok(()) };
    let on_device = MemoryPlan::new(inputs.clone())?;
    if on_device.fit(machine).gpu {
        return Ok(());
    }
    let Some(plan) = plan_that_fits(on_host, machine) else { return Ok(()) };
    if inputs.rank == 0 {
        tracing::info!(
            "ZenFlow's window set aside in host memory (zenflow_aside \"auto\"; \"device\" \
             keeps it on the GPU): on the GPU the plan needs {}, more than the GPU has; with the \
             window in host memory it needs {} of GPU and {} of host memory",
            gib(on_device.gpu_total),
            gib(plan.gpu_total),
            gib(plan.host_total)
        );
    }
    requested.zenflow_aside = Some(ZenFlowAside::Host);
    *inputs = plan.inputs;
    Ok(())
}

/// ZenFlow as `bench step --mode zenflow` runs it (DeepSpeed's benchmark settings) with
/// `topk_ratio`.
pub(crate) fn zenflow_options(topk_ratio: f64) -> zeroflow_engine::ZenFlowOptions {
    zeroflow_engine::ZenFlowOptions {
        topk_ratio,
        selection: zeroflow_core::config::Selection::Step { interval: 1 },
        update_interval: zeroflow_core::config::UpdateInterval::Every(4),
        auto_ratio: 0.99,
        overlap_step: true,
        full_warm_up_rounds: 0,
    }
}

/// A knob (or two) as the caller spells it, and the plan with it turned.
type NamedPlan = (String, MemoryPlan);

/// The pairs of knobs a refusal names (`zeroflow plan --json` lists every one).
const MAX_PAIRS_SAID: usize = 4;

/// The knobs that change one setting each (not the micro-batch), checkpointing first.
fn setting_knobs(inputs: &PlanInputs) -> [Knob; 9] {
    [
        Knob::Checkpointing,
        Knob::Offload,
        Knob::ZenFlow,
        Knob::ExactOffload { zenflow: inputs.options.zenflow().is_some() },
        Knob::ZenFlowInline,
        Knob::ZenFlowAsideHost,
        Knob::OptimizerOnGpu,
        Knob::SumOnGpu,
        Knob::Bf16Moments,
    ]
}

/// The largest of `inputs`' micro-batch halved (and halved again, down to 1) whose plan fits
/// `machine`.
fn largest_batch_that_fits(inputs: &PlanInputs, machine: &MachineMemory) -> Option<Knob> {
    std::iter::successors(Some(inputs.micro_batch / 2), |batch| Some(batch / 2))
        .take_while(|&batch| batch >= 1)
        .map(Knob::MicroBatch)
        .find(|knob| knob.apply(inputs).and_then(|i| plan_that_fits(i, machine)).is_some())
}

/// `inputs` with `knobs` turned, as a run of them takes them on `machine`: where a knob turns the
/// exact offload on for one rank, with the device share `fit` then chooses (that run's default,
/// [`resolve_fit`]; the window summed on the GPU where it chooses one with accumulation).
fn turn(knobs: &[Knob], inputs: &PlanInputs, machine: &MachineMemory) -> Option<PlanInputs> {
    let mut out = inputs.clone();
    for knob in knobs {
        out = knob.apply(&out)?;
    }
    let exact = knobs.iter().any(|knob| matches!(knob, Knob::Offload | Knob::ExactOffload { .. }));
    if !exact || out.world_size > 1 {
        return Some(out);
    }
    // Chosen for `machine`'s GPU, the one the plan is checked against.
    let on_machine = PlanInputs { gpu_memory: machine.gpu_total, ..out.clone() };
    let share = fit_device_share(&on_machine, machine.gpu_elsewhere.unwrap_or(0)).ok()?.share;
    fit::hold_share(&mut out, share);
    Some(out)
}

/// The plan of `inputs`, where it fits `machine`.
fn plan_that_fits(inputs: PlanInputs, machine: &MachineMemory) -> Option<MemoryPlan> {
    MemoryPlan::new(inputs).ok().filter(|plan| plan.fit(machine).fits())
}

impl MemoryPlan {
    /// [`MemoryPlan::ways_to_fit`]'s single knobs (the tests' view).
    #[cfg(test)]
    fn knobs_that_fit(&self, machine: &MachineMemory) -> Vec<NamedPlan> {
        self.ways_to_fit(machine).0
    }

    /// The knobs that, each on its own, bring the plan within `machine`, with the plan's totals
    /// then: checkpointing, the largest smaller micro-batch that fits, offload, ZenFlow, the exact
    /// offload, ZenFlow's step not overlapped, ZenFlow's window aside in host memory, the
    /// optimizer on the GPU, the accumulation window summed on the GPU, 16-bit moments, the
    /// device share that fits.
    fn fitting_knobs(&self, machine: &MachineMemory) -> Vec<(Knob, MemoryPlan)> {
        let inputs = &self.inputs;
        let [checkpointing, rest @ ..] = setting_knobs(inputs);
        let mut knobs = vec![checkpointing];
        knobs.extend(largest_batch_that_fits(inputs, machine));
        knobs.extend(rest);
        // A share the GPU has no room for, or too small a one for the host: the one that fits.
        if let Ok(fit) = fit_device_share(inputs, machine.gpu_elsewhere.unwrap_or(0)) {
            knobs.push(Knob::DeviceShare((fit.share * 100.0).round() as u32));
        }
        knobs
            .into_iter()
            .filter_map(|knob| {
                Some((knob, plan_that_fits(turn(&[knob], inputs, machine)?, machine)?))
            })
            .collect()
    }

    /// The knobs that bring the plan within `machine` alone, and where it does not fit, the
    /// pairs that do where neither of the two does alone.
    fn ways_to_fit(&self, machine: &MachineMemory) -> (Vec<NamedPlan>, Vec<NamedPlan>) {
        let alone = self.fitting_knobs(machine);
        let pairs = match self.fit(machine).fits() {
            true => Vec::new(),
            false => self.knob_pairs_that_fit(machine, &alone),
        };
        let caller = self.inputs.caller;
        let named = alone.into_iter().map(|(knob, plan)| (knob.flag(caller), plan));
        (named.collect(), pairs)
    }

    /// Two knobs turned together that bring the plan within `machine` where neither does alone,
    /// with the plan's totals then — each pair of the settings (checkpointing, offload, ZenFlow,
    /// the exact offload, ZenFlow's step not overlapped, ZenFlow's window aside in host memory,
    /// the optimizer on the GPU, the sum on the GPU, 16-bit moments), and each setting with the
    /// largest smaller micro-batch that then fits (where no smaller micro-batch fits alone).
    /// `alone`: the knobs that fit alone ([`MemoryPlan::fitting_knobs`]).
    fn knob_pairs_that_fit(
        &self,
        machine: &MachineMemory,
        alone: &[(Knob, MemoryPlan)],
    ) -> Vec<NamedPlan> {
        let (inputs, caller) = (&self.inputs, self.inputs.caller);
        let fits_alone = |knob: &Knob| alone.iter().any(|(fits, _)| fits == knob);
        let settings: Vec<Knob> =
            setting_knobs(inputs).into_iter().filter(|knob| !fits_alone(knob)).collect();
        let batch_alone = alone.iter().any(|(knob, _)| matches!(knob, Knob::MicroBatch(_)));
        let mut pairs = Vec::new();
        for (i, first) in settings.iter().enumerate() {
            let Some(turned) = first.apply(inputs) else { continue };
            let batch = largest_batch_that_fits(&turned, machine).filter(|_| !batch_alone);
            let seconds = settings[i + 1..].iter().copied().chain(batch);
            for second in seconds {
                if let Some(plan) = turn(&[*first, second], inputs, machine)
                    .and_then(|both| plan_that_fits(both, machine))
                {
                    pairs.push((
                        format!("{} and {}", first.flag(caller), second.flag(caller)),
                        plan,
                    ));
                }
            }
        }
        pairs
    }

    /// [`MemoryPlan::check`] as a run does before it allocates: not where it runs on a GPU the
    /// machine does not show (the run's own check of the GPU says so, in its words).
    pub fn check_before_start(&self, machine: &MachineMemory) -> Result<()> {
        if self.inputs.device == DeviceKind::Cuda && machine.gpu_total.is_none() {
            return Ok(());
        }
        self.check(machine)
    }

    /// An input error (exit 2) unless the plan fits `machine`: by how much it does not, and the
    /// knobs that bring it under.
    pub fn check(&self, machine: &MachineMemory) -> Result<()> {
        let fit = self.fit(machine);
        if fit.fits() {
            return Ok(());
        }
        let mut message = String::new();
        if let (false, Some(total)) = (fit.gpu, machine.gpu_total) {
            let beside = machine.said_elsewhere();
            message += &format!("GPU: needs {} of {}{beside}. ", gib(self.gpu_total), gib(total));
        }
        if let (false, Some(available)) = (fit.host, machine.host_available) {
            let ranks = machine.said_host_ranks(self.host_total);
            message += &format!(
                "Host: needs {}{ranks} of {} available. ",
                gib(self.host_total),
                gib(available)
            );
        }
        let (knobs, pairs) = self.ways_to_fit(machine);
        let said = |(flags, plan): &NamedPlan| {
            format!("{flags} (GPU {}, host {})", gib(plan.gpu_total), gib(plan.host_total))
        };
        let knobs: Vec<String> = knobs.iter().map(said).collect();
        let shown: Vec<String> = pairs.iter().take(MAX_PAIRS_SAID).map(said).collect();
        let more = match pairs.len() > MAX_PAIRS_SAID {
            true => format!(
                " (and {} more pairs: `zeroflow plan --json` lists them)",
                pairs.len() - MAX_PAIRS_SAID
            ),
            false => String::new(),
        };
        if !knobs.is_empty() {
            message += &format!("Fits with: {}", knobs.join("; "));
            if !shown.is_empty() {
                let pairs = shown.join("; ");
                message +=
                    &format!("; or with two together where neither alone does: {pairs}{more}");
            }
        } else if !shown.is_empty() {
            let pairs = shown.join("; ");
            message += &format!("No single knob brings it under; two together do: {pairs}{more}");
        } else {
            message += "No single knob (activation checkpointing, a smaller micro-batch, offload, \
                        ZenFlow, the exact offload, ZenFlow's step not overlapped, ZenFlow's \
                        window aside in host memory, the optimizer on the GPU, the accumulation \
                        window summed on the GPU, 16-bit moments, the device share that fits) \
                        brings it under: use a smaller model";
            message += if !fit.gpu {
                " (ZeRO stages 1 and 2 hold every weight and gradient on each GPU: more GPUs do \
                 not lower it)"
            } else {
                ", or ranks on more hosts (each rank holds its part of the optimizer, and the \
                 ranks of one host share its memory)"
            };
        }
        message += ". (--no-plan-check tries anyway.)";
        Err(input(format!("the memory plan does not fit {}: {message}", machine.name())))
    }
}

#[cfg(test)]
mod tests;
