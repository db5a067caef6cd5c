//! The run-time settings (docs/DESIGN.md, "The configuration surface"): the model's attention
//! and activation checkpointing, how host threads wait for the GPU, the CPU optimizer's binding and threads, and the offload
//! stream's tuning. Each comes from four layers, the first that says something winning: a flag
//! of `train` or `bench`, a `ZEROFLOW_*` variable (both read by the binary), the config's
//! `zeroflow` section ([`from_config`]), zeroflow's default. [`resolve`] is that rule; the
//! libraries below get the result as options. What a run used is written into its
//! `summary.json` and every checkpoint's `state.json` ([`Effective`]).

pub mod env;
mod record;

use std::path::PathBuf;

use zeroflow_core::config::{self, DeviceShare, ZeroflowExtensions};
use zeroflow_core::{DType, Element};
use zeroflow_device::cuda::{CudaDeviceOptions, HostWaits};
use zeroflow_engine::{AccumulateOn, EngineOptions, OffloadUpdate, ShareState, ZenFlowAside};
use zeroflow_nn::AttentionKind;
use zeroflow_optim::Stores;

use crate::dist::affinity::BindMode;
use crate::error::{Result, input};
use crate::{DeviceKind, ModelSpec};

pub use record::{Effective, EffectiveOffload, NUMERICS, changed_numerics, warn_on_resume};

/// The attention asked for: `auto` picks flash where the model's head size has kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    Auto,
    Gemm,
    Flash,
}

impl Attention {
    /// The attention it names (`None`: the model's best).
    pub fn kind(self) -> Option<AttentionKind> {
        match self {
            Attention::Auto => None,
            Attention::Gemm => Some(AttentionKind::Gemm),
            Attention::Flash => Some(AttentionKind::Flash),
        }
    }
}

/// The names each setting is spelled with, in flags, variables and the config alike.
pub mod names {
    use super::{AccumulateOn, Attention, BindMode, ShareState, Stores, ZenFlowAside};

    pub const ATTENTION: [(&str, Attention); 3] =
        [("auto", Attention::Auto), ("gemm", Attention::Gemm), ("flash", Attention::Flash)];
    pub const CPU_BIND: [(&str, BindMode); 3] =
        [("auto", BindMode::Auto), ("on", BindMode::On), ("off", BindMode::Off)];
    pub const STORES: [(&str, Stores); 2] =
        [("normal", Stores::Normal), ("non-temporal", Stores::NonTemporal)];
    /// Activation checkpointing (and any other switch).
    pub const SWITCH: [(&str, bool); 2] = [("on", true), ("off", false)];
    /// Whether the streaming step gathers in pieces.
    pub const GATHER: [(&str, bool); 2] = [("pieces", true), ("after-step", false)];
    /// Where ZeRO-2 sums an accumulation window's gradients.
    pub const ACCUMULATE_ON: [(&str, AccumulateOn); 3] = [
        ("auto", AccumulateOn::Auto),
        ("device", AccumulateOn::Device),
        ("host", AccumulateOn::Host),
    ];

    /// Where the optimizer's device share keeps its state.
    pub const SHARE_STATE: [(&str, ShareState); 2] =
        [("device", ShareState::Device), ("host", ShareState::Host)];

    /// Where ZenFlow sets its window aside for the CPU step.
    pub const ZENFLOW_ASIDE: [(&str, ZenFlowAside); 2] =
        [("device", ZenFlowAside::Device), ("host", ZenFlowAside::Host)];

    /// "a, b or c".
    pub fn alternatives<T>(choices: &[(&str, T)]) -> String {
        let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
        match names.split_last() {
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    /// The name of `value` in `choices`.
    pub fn name_of<T: PartialEq>(choices: &[(&'static str, T)], value: &T) -> &'static str {
        choices.iter().find(|(_, choice)| choice == value).map_or("?", |(name, _)| name)
    }
}

/// One layer's requests; `None` leaves a setting to the layers below.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Requested {
    pub attention: Option<Attention>,
    pub activation_checkpointing: Option<bool>,
    pub cuda_wait: Option<HostWaits>,
    pub cpu_bind: Option<BindMode>,
    /// MiB of the parameter dtype, positive.
    pub stream_chunk_mib: Option<f64>,
    pub copy_stores: Option<Stores>,
    pub gather_in_pieces: Option<bool>,
    pub cpu_threads: Option<usize>,
    /// MiB of host memory for the exact step's speculation, non-negative (0: off).
    pub speculation_budget_mib: Option<f64>,
    pub accumulate_on: Option<AccumulateOn>,
    /// MiB of pinned host memory a rank's device may hold, non-negative (`None`: no limit).
    pub pinned_budget_mib: Option<f64>,
    /// The exact streaming step's CPU work left to the next forward (`None`: on).
    pub overlap_forward: Option<bool>,
    /// The share of the optimizer's partition stepped on the device: a fraction at least 0 and
    /// below 1, or as much as the memory plan finds room for (`fit`, which the caller resolves
    /// to a fraction before the engine is built: [`crate::plan::resolve_fit`]; `None`: `fit` on
    /// one rank, 0 on several).
    pub device_share: Option<DeviceShare>,
    /// Where the device share keeps its fp32 state (`None`: the device).
    pub device_share_state: Option<ShareState>,
    /// Where ZenFlow sets its window aside for the CPU step (`None`: the device, or host memory
    /// where only that fits: [`crate::plan::resolve_zenflow_aside`]).
    pub zenflow_aside: Option<ZenFlowAside>,
    /// Sequence packing: several documents per row, no attention across their boundaries,
    /// positions restarting at each (`--pack`, `zeroflow.pack`). Off by default.
    pub pack: Option<bool>,
}

impl Requested {
    /// `self`'s requests, and `lower`'s where `self` has none.
    pub fn over(self, lower: Requested) -> Requested {
        Requested {
            attention: self.attention.or(lower.attention),
            activation_checkpointing: self
                .activation_checkpointing
                .or(lower.activation_checkpointing),
            cuda_wait: self.cuda_wait.or(lower.cuda_wait),
            cpu_bind: self.cpu_bind.or(lower.cpu_bind),
            stream_chunk_mib: self.stream_chunk_mib.or(lower.stream_chunk_mib),
            copy_stores: self.copy_stores.or(lower.copy_stores),
            gather_in_pieces: self.gather_in_pieces.or(lower.gather_in_pieces),
            cpu_threads: self.cpu_threads.or(lower.cpu_threads),
            speculation_budget_mib: self.speculation_budget_mib.or(lower.speculation_budget_mib),
            accumulate_on: self.accumulate_on.or(lower.accumulate_on),
            pinned_budget_mib: self.pinned_budget_mib.or(lower.pinned_budget_mib),
            overlap_forward: self.overlap_forward.or(lower.overlap_forward),
            device_share: self.device_share.or(lower.device_share),
            device_share_state: self.device_share_state.or(lower.device_share_state),
            zenflow_aside: self.zenflow_aside.or(lower.zenflow_aside),
            pack: self.pack.or(lower.pack),
        }
    }

    /// Whether any of the offload stream's settings is asked for.
    pub fn tunes_offload(&self) -> bool {
        let Requested {
            stream_chunk_mib,
            copy_stores,
            gather_in_pieces,
            cpu_threads,
            speculation_budget_mib,
            accumulate_on,
            overlap_forward,
            device_share,
            device_share_state,
            zenflow_aside,
            ..
        } = self;
        stream_chunk_mib.is_some()
            || copy_stores.is_some()
            || gather_in_pieces.is_some()
            || cpu_threads.is_some()
            || speculation_budget_mib.is_some()
            || accumulate_on.is_some()
            || overlap_forward.is_some()
            || device_share.is_some()
            || device_share_state.is_some()
            || zenflow_aside.is_some()
    }
}

/// The settings a run uses: each from the flags, else the environment, else the config; what
/// none of them asks for stays `None` (zeroflow's default).
pub fn resolve(flags: Requested, env: Requested, config: Requested) -> Requested {
    flags.over(env).over(config)
}

/// What a resumed checkpoint's recorded settings (`saved`, its `state.json`'s `settings`) ask for,
/// below every other layer: the ones that change the numbers ([`record::NUMERICS`]), so that the
/// run continues as it was trained unless a flag, variable or the config says otherwise, and the
/// activation checkpointing that let its model fit the GPU. The attention and the checkpointing
/// only where a GPU run goes on on the GPU (`on_gpu`; the CPU model has gemm alone and keeps
/// every activation); a checkpoint from before the settings were recorded asks for nothing.
pub fn from_checkpoint(saved: &serde_json::Value, on_gpu: bool) -> Requested {
    let attention = saved.get("attention").and_then(serde_json::Value::as_str);
    let attention = zeroflow_core::env::choice(attention, &names::ATTENTION).ok().flatten();
    Requested {
        attention: attention.filter(|_| on_gpu),
        activation_checkpointing: saved
            .get("activation_checkpointing")
            .and_then(serde_json::Value::as_bool)
            .filter(|_| on_gpu),
        pack: saved.get("pack").and_then(serde_json::Value::as_bool),
        ..Requested::default()
    }
}

/// Whether a checkpoint's recorded settings (`saved`) say its run packed its rows, as
/// [`from_checkpoint`] reads them (a checkpoint from before packing was recorded did not).
pub fn packed_in(saved: &serde_json::Value) -> bool {
    from_checkpoint(saved, false).pack == Some(true)
}

/// What the config's `zeroflow` section asks for.
pub fn from_config(zeroflow: &ZeroflowExtensions) -> Requested {
    let offload = zeroflow.offload;
    Requested {
        attention: zeroflow.attention.map(|attention| match attention {
            config::Attention::Gemm => Attention::Gemm,
            config::Attention::Flash => Attention::Flash,
        }),
        activation_checkpointing: zeroflow.activation_checkpointing,
        cuda_wait: zeroflow.cuda_wait.map(|wait| match wait {
            config::CudaWait::Block => HostWaits::Block,
            config::CudaWait::Spin => HostWaits::Spin,
        }),
        cpu_bind: zeroflow.cpu_bind.map(|bind| match bind {
            config::CpuBind::On => BindMode::On,
            config::CpuBind::Off => BindMode::Off,
        }),
        stream_chunk_mib: offload.stream_chunk_mib,
        copy_stores: offload.copy_stores.map(|stores| match stores {
            config::CopyStores::Normal => Stores::Normal,
            config::CopyStores::NonTemporal => Stores::NonTemporal,
        }),
        gather_in_pieces: offload.gather.map(|gather| gather == config::Gather::Pieces),
        cpu_threads: offload.cpu_threads.and_then(|n| usize::try_from(n.get()).ok()),
        speculation_budget_mib: offload.speculation_budget_mib,
        accumulate_on: offload.accumulate_on.map(|on| match on {
            config::AccumulateOn::Device => AccumulateOn::Device,
            config::AccumulateOn::Host => AccumulateOn::Host,
        }),
        pinned_budget_mib: offload.pinned_budget_mib,
        overlap_forward: offload.overlap_forward,
        device_share: offload.device_share,
        device_share_state: offload.device_share_state.map(|state| match state {
            config::DeviceShareState::Device => ShareState::Device,
            config::DeviceShareState::Host => ShareState::Host,
        }),
        zenflow_aside: offload.zenflow_aside.map(|aside| match aside {
            config::ZenFlowAside::Device => ZenFlowAside::Device,
            config::ZenFlowAside::Host => ZenFlowAside::Host,
        }),
        pack: zeroflow.pack,
    }
}

/// A chunk of MiB: a positive number, fractions allowed.
pub fn parse_chunk_mib(value: &str) -> Result<f64, String> {
    let mib = value.trim().parse::<f64>().ok().filter(|mib| mib.is_finite() && *mib > 0.0);
    mib.ok_or_else(|| "is not a positive number of MiB".to_owned())
}

/// A budget of MiB: a non-negative number, fractions allowed (0: none).
pub fn parse_budget_mib(value: &str) -> Result<f64, String> {
    let mib = value.trim().parse::<f64>().ok().filter(|mib| mib.is_finite() && *mib >= 0.0);
    mib.ok_or_else(|| "is not a non-negative number of MiB".to_owned())
}

/// The pinned host memory budget asked for, in bytes (`None`: no limit, zeroflow's default).
/// The device counts its page-locked buffers against it; past it they are pageable, with one
/// warning ([`zeroflow_device::PinnedBudget`]).
pub fn pinned_budget(requested: &Requested) -> Option<usize> {
    requested.pinned_budget_mib.map(budget_bytes)
}

/// A device share: a fraction at least 0 and below 1, or `fit`.
pub fn parse_device_share(value: &str) -> Result<DeviceShare, String> {
    DeviceShare::parse(value)
        .ok_or_else(|| "is neither a fraction at least 0 and below 1 nor fit".to_owned())
}

/// A thread count: a positive whole number.
pub fn parse_threads(value: &str) -> Result<usize, String> {
    match value.trim().parse::<usize>() {
        Ok(threads) if threads > 0 => Ok(threads),
        _ => Err("is not a positive whole number".to_owned()),
    }
}

/// How the GPU is opened: the host waits asked for, and `kernel_cache` (else the user's cache
/// folder) for the compiled kernels.
pub fn cuda_device_options(
    requested: &Requested,
    kernel_cache: Option<PathBuf>,
) -> CudaDeviceOptions {
    let defaults = CudaDeviceOptions::default();
    CudaDeviceOptions {
        host_waits: requested.cuda_wait.unwrap_or(HostWaits::Auto),
        kernel_cache: kernel_cache.or(defaults.kernel_cache),
    }
}

/// The attention the model `model` runs on `device`: the CPU model has only the gemm form
/// (asking it for flash is an input error); on the GPU, what was asked, else the model's best.
pub fn attention(
    device: DeviceKind,
    model: &ModelSpec,
    requested: &Requested,
) -> Result<AttentionKind> {
    let asked = requested.attention.and_then(Attention::kind);
    match device {
        DeviceKind::Cpu if asked == Some(AttentionKind::Flash) => Err(input(
            "attention flash: the CPU model computes attention in the gemm form only; ask for \
             gemm or auto (--attention, ZEROFLOW_ATTENTION, zeroflow.attention)",
        )),
        DeviceKind::Cpu => Ok(AttentionKind::Gemm),
        DeviceKind::Cuda => Ok(model.cuda_attention(asked)),
    }
}

/// Whether the model of a run on `device` recomputes its layers' activations in backward: as
/// asked (off by default) on the GPU; never on the CPU device, whose model keeps every
/// activation (asking it for checkpointing is warned about, not refused: the numbers are the
/// same either way).
pub fn activation_checkpointing(device: DeviceKind, requested: &Requested) -> bool {
    let asked = requested.activation_checkpointing.unwrap_or(false);
    if asked && device == DeviceKind::Cpu {
        // Asked by the plan and by the model's set-up alike: said once.
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            tracing::warn!(
                "activation checkpointing applies to the CUDA model; the CPU model keeps every \
                 activation (--activation-checkpointing, ZEROFLOW_ACTIVATION_CHECKPOINTING, \
                 zeroflow.activation_checkpointing change nothing here)"
            );
        });
    }
    asked && device == DeviceKind::Cuda
}

/// Whether the exact streaming step's CPU work is left to the next forward where nothing asks:
/// the trainer's models open the weights as their forward reads them, so it is on (the engine's
/// own default is off, for callers whose models do not).
pub const DEFAULT_OVERLAP_FORWARD: bool = true;

/// Applies the offload stream's settings asked for to `options` for rank `rank`'s parameters of
/// type `P`, saying once what it chose; an input error for a chunk smaller than one element.
pub fn apply_offload<P: Element>(
    requested: &Requested,
    options: &mut EngineOptions,
    rank: usize,
) -> Result<()> {
    tune_offload::<P>(requested, options)?;
    if !requested.tunes_offload() {
        return Ok(());
    }
    let dtype = P::DTYPE;
    let Some(offload) = options.offload() else {
        tracing::warn!(
            "rank {rank}: the stream chunk, copy stores, gather, CPU threads, speculation budget, \
             accumulation place, forward overlap, device share and ZenFlow's window place tune \
             the CPU optimizer offload, which this config does not use: they change nothing"
        );
        return Ok(());
    };
    let stream = offload.stream;
    if stream.speculation_budget > 0 && offload.update != OffloadUpdate::Exact {
        tracing::warn!(
            "rank {rank}: a speculation budget applies to the exact offload step; the delayed \
             update and ZenFlow do not speculate"
        );
    }
    if requested.zenflow_aside.is_some() && !matches!(offload.update, OffloadUpdate::ZenFlow(_)) {
        tracing::warn!(
            "rank {rank}: where ZenFlow sets its window aside (zenflow_aside) applies to ZenFlow, \
             which this config does not use: it changes nothing"
        );
    }
    tracing::info!(
        "rank {rank}: offload tuned: chunks of {} elements ({} MiB of {dtype}), {} stores of \
         the weight copy, the CPU optimizer on {} threads, the ranks' weights gathered {}, \
         a speculation budget of {} MiB, accumulation windows summed on {}, the exact step's \
         CPU work {}, {} of the partition's optimizer state stepped on the device (its state in \
         {} memory), ZenFlow's window set aside on the {}",
        stream.chunk,
        mib_of(stream.chunk, dtype),
        stream.copy_stores.map_or("per-path (normal where the step streams)", Stores::name),
        offload.cpu_threads,
        if stream.gather_in_pieces { "in pieces while stepping" } else { "after the step" },
        stream.speculation_budget as f64 / MIB,
        match stream.accumulate_on {
            AccumulateOn::Auto => "the device where it has room, else the host",
            AccumulateOn::Device => "the device",
            AccumulateOn::Host => "the host",
        },
        match stream.overlap_forward {
            true =>
                "overlapped with the next forward (one GPU; one micro-step per step or the sum on the device)",
            false => "done before the next forward",
        },
        stream.device_share,
        names::name_of(&names::SHARE_STATE, &stream.device_share_state),
        names::name_of(&names::ZENFLOW_ASIDE, &stream.zenflow_aside),
    );
    Ok(())
}

/// [`apply_offload`] without a word: the memory plan's copy of the options (the run says what
/// it chose once, with its CPU threads resolved).
pub fn tune_offload<P: Element>(requested: &Requested, options: &mut EngineOptions) -> Result<()> {
    if let Some(offload) = options.offload_mut() {
        let overlap = requested.overlap_forward.unwrap_or(DEFAULT_OVERLAP_FORWARD);
        offload.stream.overlap_forward = overlap;
    }
    let Some(offload) = options.offload_mut().filter(|_| requested.tunes_offload()) else {
        return Ok(());
    };
    let chunk = requested.stream_chunk_mib.map(|mib| chunk_elements(mib, P::DTYPE)).transpose();
    let stream = &mut offload.stream;
    stream.chunk = chunk.map_err(input)?.unwrap_or(stream.chunk);
    stream.copy_stores = requested.copy_stores.or(stream.copy_stores);
    stream.gather_in_pieces = requested.gather_in_pieces.unwrap_or(stream.gather_in_pieces);
    stream.speculation_budget =
        requested.speculation_budget_mib.map_or(stream.speculation_budget, budget_bytes);
    stream.accumulate_on = requested.accumulate_on.unwrap_or(stream.accumulate_on);
    // `fit` is 0 until the memory plan has chosen (the caller then asks again with a fraction).
    stream.device_share = match requested.device_share {
        Some(DeviceShare::Fraction(share)) => share,
        Some(DeviceShare::Fit) => 0.0,
        None => stream.device_share,
    };
    stream.device_share_state = requested.device_share_state.unwrap_or(stream.device_share_state);
    stream.zenflow_aside = requested.zenflow_aside.unwrap_or(stream.zenflow_aside);
    offload.cpu_threads = requested.cpu_threads.unwrap_or(offload.cpu_threads);
    Ok(())
}

const MIB: f64 = (1 << 20) as f64;

/// Whole elements of `dtype` in `mib` MiB (rounded down), or why that is none.
pub fn chunk_elements(mib: f64, dtype: DType) -> Result<usize, String> {
    // `as` saturates for the absurdly large.
    let elements = (mib * MIB / dtype.size() as f64) as usize;
    if elements == 0 {
        return Err(format!(
            "a stream chunk of {mib} MiB is less than one {dtype} element ({} bytes)",
            dtype.size()
        ));
    }
    Ok(elements)
}

/// Whole bytes in `mib` MiB (rounded down; `as` saturates for the absurdly large).
pub fn budget_bytes(mib: f64) -> usize {
    (mib * MIB) as usize
}

/// `elements` of `dtype` in MiB.
pub fn mib_of(elements: usize, dtype: DType) -> f64 {
    elements as f64 * dtype.size() as f64 / MIB
}

#[cfg(test)]
mod tests;
