//! The run-time settings' flags of `train` and `bench` ([`GpuFlags`], [`HostFlags`]) and their
//! `ZEROFLOW_*` variables ([`env`](mod@env)): the two layers above the config's `zeroflow`
//! section. The settings themselves, their layering ([`resolve`]) and what a run records of them
//! are [`zeroflow_train::settings`]'s.

pub mod env;

use std::num::NonZeroUsize;

use zeroflow_core::config::DeviceShare;
use zeroflow_device::cuda::{CudaDeviceOptions, HostWaits};
use zeroflow_optim::Stores;

use zeroflow_engine::{AccumulateOn, ShareState, ZenFlowAside};
use zeroflow_train::dist::affinity::BindMode;
pub use zeroflow_train::settings::{
    Attention, Requested, activation_checkpointing, attention, names, parse_budget_mib,
    parse_chunk_mib, parse_device_share, resolve,
};

/// The settings of the model on its device (`train`, `bench step`, `bench gpt`).
#[derive(Clone, Copy, Debug, Default, clap::Args)]
#[command(next_help_heading = "The model on the GPU")]
pub struct GpuFlags {
    /// The model's attention on the GPU: auto (flash where the head size has kernels), gemm or
    /// flash; changes the numbers. Over ZEROFLOW_ATTENTION and zeroflow.attention (and a
    /// resumed GPU run's checkpoint).
    #[arg(long, value_name = "auto|gemm|flash", value_parser = flag(&names::ATTENTION))]
    pub attention: Option<Attention>,
    /// Keep only each layer's input for backward and recompute the rest of the layer there:
    /// far less activation memory for about one more forward of the layers (the same numbers).
    /// `--activation-checkpointing` alone is `=on`. Over ZEROFLOW_ACTIVATION_CHECKPOINTING and
    /// zeroflow.activation_checkpointing (and a resumed GPU run's checkpoint).
    #[arg(
        long,
        value_name = "on|off",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "on",
        value_parser = flag(&names::SWITCH)
    )]
    pub activation_checkpointing: Option<bool>,
    /// How host threads wait for the GPU: auto (the driver's choice), block or spin. Over
    /// ZEROFLOW_CUDA_WAIT and zeroflow.cuda_wait.
    #[arg(long, value_name = "auto|block|spin", value_parser = flag(&HostWaits::NAMES))]
    pub cuda_wait: Option<HostWaits>,
}

/// The settings of the CPU optimizer and the offload stream (`train`, `bench step`).
#[derive(Clone, Copy, Debug, Default, clap::Args)]
#[command(next_help_heading = "The optimizer and its offload (each default measured)")]
pub struct HostFlags {
    /// Bind each rank's CPU optimizer to the CPUs near its GPU: auto (with several ranks on a
    /// host), on or off. Over ZEROFLOW_CPU_BIND and zeroflow.cpu_bind.
    #[arg(long, value_name = "auto|on|off", value_parser = flag(&names::CPU_BIND))]
    pub cpu_bind: Option<BindMode>,
    /// The offload stream's chunk in MiB of the parameter dtype. Over ZEROFLOW_STREAM_CHUNK_MIB
    /// and zeroflow.offload.stream_chunk_mib.
    #[arg(long, value_name = "MIB", value_parser = parse_chunk_mib)]
    pub stream_chunk_mib: Option<f64>,
    /// How the CPU AdamW writes the weights' bf16 copy: normal or non-temporal. Over
    /// ZEROFLOW_COPY_STORES and zeroflow.offload.copy_stores.
    #[arg(long, value_name = "normal|non-temporal", value_parser = flag(&names::STORES))]
    pub copy_stores: Option<Stores>,
    /// When the streaming step gathers the ranks' weights: pieces or after-step. Over
    /// ZEROFLOW_STREAM_GATHER and zeroflow.offload.gather.
    #[arg(long, value_name = "pieces|after-step", value_parser = flag(&names::GATHER))]
    pub gather: Option<bool>,
    /// Threads of the CPU optimizer. Over ZEROFLOW_CPU_THREADS and zeroflow.offload.cpu_threads.
    #[arg(long, value_name = "N")]
    pub cpu_threads: Option<NonZeroUsize>,
    /// MiB of host memory for the exact offload step's speculation (0: off, the default): the CPU
    /// steps the optimizer's pieces as the backward hands them over, before the gradient norm is
    /// known, and puts them back and steps them again where the clip fires (the weights are the
    /// same either way). Each element stepped so holds 12–16 bytes of it (its backup, and its
    /// updated weights until their upload). Faster where the clip does not fire (on an H100
    /// 1.03–1.09×: llama-8b at its default device share 1.09× with 16384), a little slower over
    /// the first steps where it fires on every one. Over ZEROFLOW_SPECULATION_BUDGET_MIB and
    /// zeroflow.offload.speculation_budget_mib.
    #[arg(long, value_name = "MIB", value_parser = parse_budget_mib)]
    pub speculation_budget_mib: Option<f64>,
    /// Where ZeRO-2 sums an accumulation window: auto (the device where it has room), device or
    /// host. Over ZEROFLOW_ACCUMULATE_ON and zeroflow.offload.accumulate_on.
    #[arg(long, value_name = "auto|device|host", value_parser = flag(&names::ACCUMULATE_ON))]
    pub accumulate_on: Option<AccumulateOn>,
    /// MiB of pinned (page-locked) host memory each rank may hold (default: no limit). Past it,
    /// or where the driver cannot pin, host buffers are pageable: training goes on, their copies
    /// slower, with a warning. Over ZEROFLOW_PINNED_BUDGET_MIB and
    /// zeroflow.offload.pinned_budget_mib.
    #[arg(long, value_name = "MIB", value_parser = parse_budget_mib)]
    pub pinned_budget_mib: Option<f64>,
    /// The exact offload step (one GPU; one micro-step per step, or the window summed on the GPU)
    /// leaves its CPU work to the next forward, which starts on the weights stepped first while
    /// the CPU steps the rest: on (the default) or off; the same numbers either way. Over
    /// ZEROFLOW_OVERLAP_FORWARD and zeroflow.offload.overlap_forward.
    #[arg(long, value_name = "on|off", value_parser = flag(&names::SWITCH))]
    pub overlap_forward: Option<bool>,
    /// The share of the optimizer's partition (a fraction below 1, from its end) whose fp32
    /// master weights and moments are held in GPU memory instead of host memory (16 bytes per
    /// parameter there, 12 fewer on the host) and stepped there, so that the CPU and the host's
    /// memory step only the rest: 0 to 0.99, or
    /// `fit`: the largest the memory plan finds room for, leaving a tenth of the GPU free beside
    /// what other processes hold there (0 where the share cannot act). Default: `fit` on one
    /// GPU, 0 with several ranks. The exact offload step, with one micro-step per step (each
    /// rank its own partition's) or the window summed on one GPU; the same numbers.
    /// Over ZEROFLOW_DEVICE_SHARE and zeroflow.offload.device_share.
    #[arg(long, value_name = "FRACTION|fit", value_parser = parse_device_share)]
    pub device_share: Option<DeviceShare>,
    /// Where the device share keeps its fp32 state: device (16 bytes per element of the share
    /// on the GPU) or host (page-locked host memory, 12 bytes per element as the CPU's own,
    /// copied up a piece at a time on a stream of its own, stepped on the GPU and copied back
    /// while the CPU steps the rest: a few pieces' buffers on the GPU, the host's memory
    /// bandwidth drawn by the GPU's copies beside the CPU's); the same numbers. Default: device.
    /// Over ZEROFLOW_DEVICE_SHARE_STATE and zeroflow.offload.device_share_state.
    #[arg(long, value_name = "device|host", value_parser = flag(&names::SHARE_STATE))]
    pub device_share_state: Option<ShareState>,
    /// Where ZenFlow sets its window aside for the CPU step: device (with overlap_step a second
    /// f32 window and the CPU's weights on the GPU, 6 bytes per parameter) or host (copied into
    /// host memory at the window's end and the CPU's weights kept there until applied: 6 bytes
    /// per parameter more of host memory, for a GPU without room for the overlap); the same
    /// numbers. Default: the device, or host where only that fits the machine (the memory plan
    /// says which). Over ZEROFLOW_ZENFLOW_ASIDE and zeroflow.offload.zenflow_aside.
    #[arg(long, value_name = "device|host", value_parser = flag(&names::ZENFLOW_ASIDE))]
    pub zenflow_aside: Option<ZenFlowAside>,
}

/// What the flags ask for.
pub fn from_flags(gpu: GpuFlags, host: HostFlags) -> Requested {
    Requested {
        attention: gpu.attention,
        activation_checkpointing: gpu.activation_checkpointing,
        cuda_wait: gpu.cuda_wait,
        cpu_bind: host.cpu_bind,
        stream_chunk_mib: host.stream_chunk_mib,
        copy_stores: host.copy_stores,
        gather_in_pieces: host.gather,
        cpu_threads: host.cpu_threads.map(NonZeroUsize::get),
        speculation_budget_mib: host.speculation_budget_mib,
        accumulate_on: host.accumulate_on,
        pinned_budget_mib: host.pinned_budget_mib,
        overlap_forward: host.overlap_forward,
        device_share: host.device_share,
        device_share_state: host.device_share_state,
        zenflow_aside: host.zenflow_aside,
        // `train --pack` alone: not a setting of the device's flags.
        pack: None,
    }
}

/// A flag's parser for one of `choices` (case and spaces ignored, as in the variables).
pub(crate) fn flag<T: Copy + Send + Sync + 'static>(
    choices: &'static [(&'static str, T)],
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |value| match zeroflow_core::env::choice(Some(value), choices) {
        Ok(Some(choice)) => Ok(choice),
        _ => Err(format!("not {}", names::alternatives(choices))),
    }
}

/// How the GPU is opened: the host waits asked for, and the kernel cache
/// `ZEROFLOW_KERNEL_CACHE` names (else the user's cache folder).
pub fn cuda_device_options(requested: &Requested) -> CudaDeviceOptions {
    zeroflow_train::settings::cuda_device_options(requested, env::kernel_cache())
}

#[cfg(test)]
mod tests;
