//! What a run's settings were once every layer had spoken, as `summary.json` and every
//! checkpoint's `state.json` record them (`"settings"`), and the warning a resume gives when it
//! would change one that changes the numbers.

use std::path::Path;

use serde::Serialize;
use serde_json::Value;
use zeroflow_core::DType;
use zeroflow_device::cuda::HostWaits;
use zeroflow_engine::{EngineOptions, OffloadUpdate};
use zeroflow_nn::AttentionKind;
use zeroflow_optim::Stores;

use super::{MIB, Requested, mib_of, names};
use crate::DeviceKind;
use crate::dist::affinity::{self, BindMode, Binding};

/// The settings a run used. Only `attention`, `pack` and `optimizer_state_dtype` change the
/// numbers; the rest change the speed (the offload stream's results are bit-identical whatever
/// its tuning).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Effective {
    /// `gemm` or `flash`.
    pub attention: &'static str,
    /// Whether the model recomputes each layer's activations in backward (the same numbers).
    pub activation_checkpointing: bool,
    /// Whether rows are packed (several documents each, no attention across them; `--pack`).
    /// Changes the numbers.
    pub pack: bool,
    /// `auto`, `block` or `spin`; `None` on the CPU device.
    pub cuda_wait: Option<&'static str>,
    /// `auto`, `on` or `off`; `None` on the CPU device (which never binds).
    pub cpu_bind: Option<&'static str>,
    /// The CPUs the rank's threads were bound to (a CPU list), if any.
    pub cpu_binding: Option<String>,
    /// The Adam moments' element type, `fp32` or `bf16` (the config's
    /// `zeroflow.optimizer_state_dtype`; always `fp32` without offload). A resume across dtypes
    /// is warned about by the engine, which converts the moments.
    pub optimizer_state_dtype: &'static str,
    /// `None` without CPU optimizer offload.
    pub offload: Option<EffectiveOffload>,
}

/// The offload stream's settings as the engine runs them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EffectiveOffload {
    pub stream_chunk_mib: f64,
    pub stream_chunk_elements: usize,
    /// `normal`, `non-temporal`, or `per-path` (normal where the step streams).
    pub copy_stores: &'static str,
    /// `pieces` or `after-step`.
    pub gather: &'static str,
    pub cpu_threads: usize,
    /// The exact step's speculation budget in MiB of host memory; 0 where it does not speculate
    /// (asked for none, or the delayed update or ZenFlow).
    pub speculation_budget_mib: f64,
    /// Where ZeRO-2 with accumulation sums a window: `auto` (the device where its free memory
    /// has room), `device` or `host`.
    pub accumulate_on: &'static str,
    /// The pinned host memory budget of the rank's device in MiB; `None` (`null`): no limit.
    pub pinned_budget_mib: Option<f64>,
    /// The exact streaming step's CPU work left to the next forward (where one rank holds every
    /// weight: one micro-step per step or the window summed on the device; otherwise the option
    /// changes nothing).
    pub overlap_forward: bool,
    /// The share of the partition whose optimizer state is held and stepped on the device.
    pub device_share: f64,
    /// Where the device share keeps its state: `device` or `host`.
    pub device_share_state: &'static str,
    /// Where ZenFlow sets its window aside for the CPU step: `device` or `host` (`null` without
    /// ZenFlow).
    pub zenflow_aside: Option<&'static str>,
}

/// The settings that change the numbers (the keys of [`Effective`] a resume compares).
pub const NUMERICS: [&str; 2] = ["attention", "pack"];

/// What a checkpoint written before `key` was recorded ran with: no packing.
fn before_recorded(key: &str) -> Option<Value> {
    (key == "pack").then_some(Value::Bool(false))
}

impl Effective {
    /// The settings of a run on `device` whose model runs `attention`, whose engine has
    /// `options` (parameters of `dtype`), and whose threads are bound as `binding` says.
    pub fn new(
        device: DeviceKind,
        attention: AttentionKind,
        requested: &Requested,
        options: &EngineOptions,
        dtype: DType,
        binding: Option<&Binding>,
    ) -> Effective {
        let on_gpu = device == DeviceKind::Cuda;
        let offload = options.offload().map(|offload| EffectiveOffload {
            stream_chunk_mib: mib_of(offload.stream.chunk, dtype),
            stream_chunk_elements: offload.stream.chunk,
            copy_stores: offload.stream.copy_stores.map_or("per-path", Stores::name),
            gather: names::name_of(&names::GATHER, &offload.stream.gather_in_pieces),
            cpu_threads: offload.cpu_threads,
            speculation_budget_mib: match offload.update {
                OffloadUpdate::Exact => offload.stream.speculation_budget as f64 / MIB,
                OffloadUpdate::Delayed { .. } | OffloadUpdate::ZenFlow(_) => 0.0,
            },
            accumulate_on: names::name_of(&names::ACCUMULATE_ON, &offload.stream.accumulate_on),
            pinned_budget_mib: super::pinned_budget(requested).map(|bytes| bytes as f64 / MIB),
            overlap_forward: offload.stream.overlap_forward,
            device_share: offload.stream.device_share,
            device_share_state: names::name_of(
                &names::SHARE_STATE,
                &offload.stream.device_share_state,
            ),
            zenflow_aside: matches!(offload.update, OffloadUpdate::ZenFlow(_))
                .then(|| names::name_of(&names::ZENFLOW_ASIDE, &offload.stream.zenflow_aside)),
        });
        Effective {
            attention: attention.name(),
            activation_checkpointing: super::activation_checkpointing(device, requested),
            pack: requested.pack.unwrap_or(false),
            cuda_wait: on_gpu.then(|| requested.cuda_wait.unwrap_or(HostWaits::Auto).name()),
            cpu_bind: on_gpu.then(|| {
                names::name_of(&names::CPU_BIND, &requested.cpu_bind.unwrap_or(BindMode::Auto))
            }),
            cpu_binding: binding.map(|binding| affinity::format_cpulist(&binding.cpus)),
            optimizer_state_dtype: options
                .offload()
                .map_or("fp32", |offload| offload.moments.name()),
            offload,
        }
    }

    /// As JSON, for `summary.json` and `state.json`.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).expect("plain data serialises")
    }
}

/// The numerics-affecting settings whose value in `saved` (a checkpoint's `settings`; `null` for
/// one written before they were recorded) differs from `now`'s: (key, saved, now).
pub fn changed_numerics(saved: &Value, now: &Value) -> Vec<(&'static str, String, String)> {
    let shown = |value: Option<&Value>| match value {
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
        None => "not recorded".to_owned(),
    };
    NUMERICS
        .iter()
        .filter_map(|&key| {
            let before = saved.get(key).cloned().or_else(|| before_recorded(key));
            let after = now.get(key).cloned().or_else(|| before_recorded(key));
            (saved.is_object() && before != after)
                .then(|| (key, shown(before.as_ref()), shown(after.as_ref())))
        })
        .collect()
}

/// Warns, once for each, about the settings that change the numbers and that this resumed run
/// sets differently from the checkpoint at `dir` (not an error: the run continues with the new).
pub fn warn_on_resume(saved: &Value, now: &Effective, dir: &Path) {
    for (key, before, after) in changed_numerics(saved, &now.to_json()) {
        // As the flag spells it: `--attention=gemm`, `--pack=off`.
        let flag = match before.as_str() {
            "true" => "on",
            "false" => "off",
            value => value,
        };
        tracing::warn!(
            "--resume {}: the checkpoint was trained with {key} {before}, this run uses {key} \
             {after}; the numbers will differ from an uninterrupted run (--{}={flag} keeps \
             them)",
            dir.display(),
            key.replace('_', "-")
        );
    }
}
