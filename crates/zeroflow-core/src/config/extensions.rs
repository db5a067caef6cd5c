//! The top-level `zeroflow` section: settings of zeroflow's own that DeepSpeed does not have.
//! DeepSpeed ignores top-level keys it does not know, so a config with this section still runs
//! under DeepSpeed, without these features.
//!
//! ```json
//! "zeroflow": {
//!   "delayed_update": { "enabled": true, "warmup_steps": 10 },
//!   "attention": "auto",
//!   "activation_checkpointing": false,
//!   "pack": false,
//!   "cuda_wait": "auto",
//!   "cpu_bind": "auto",
//!   "optimizer_state_dtype": "fp32",
//!   "offload": { "stream_chunk_mib": 16, "copy_stores": "auto", "gather": "pieces", "cpu_threads": "auto",
//!                "speculation_budget_mib": 0, "accumulate_on": "auto", "pinned_budget_mib": "auto",
//!                "overlap_forward": true, "device_share": 0, "zenflow_aside": "auto" }
//! }
//! ```
//!
//! `optimizer_state_dtype` (`"fp32"`, the default, or `"bf16"`) is the element type of the CPU
//! optimizer's Adam moments in host memory; it changes the numbers, and is read from the config
//! only. Every other key but `delayed_update` is the config layer of a run-time setting that a flag of the
//! same name and a `ZEROFLOW_*` variable override (docs/DESIGN.md, "The configuration surface").
//! `"auto"` or an absent key leaves the setting to those layers or zeroflow's default; the
//! resolved config writes it as `null`.

use std::num::NonZeroU64;

use serde_json::{Value, json};

use crate::adamw::OptimizerStateDtype;

use super::diagnostics::Diagnostics;
use super::error::ConfigError;
use super::reader::{NON_NEGATIVE_INT, POSITIVE_INT, Section, Setting};

/// zeroflow's own settings.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ZeroflowExtensions {
    pub delayed_update: DelayedUpdate,
    /// `zeroflow.attention`; `None` (`"auto"`): flash where the model's head size has kernels.
    /// Changes the numbers.
    pub attention: Option<Attention>,
    /// `zeroflow.activation_checkpointing` (a boolean); `None` (`"auto"`, absent): off. Keeps
    /// only each layer's input for backward and recomputes the rest of the layer there.
    pub activation_checkpointing: Option<bool>,
    /// `zeroflow.pack` (a boolean); `None` (`"auto"`, absent): off. Sequence packing: several
    /// documents per row with no attention across them. Changes the numbers.
    pub pack: Option<bool>,
    /// `zeroflow.cuda_wait`; `None` (`"auto"`): the driver's choice.
    pub cuda_wait: Option<CudaWait>,
    /// `zeroflow.cpu_bind`; `None` (`"auto"`): bind where a host runs several ranks.
    pub cpu_bind: Option<CpuBind>,
    /// `zeroflow.optimizer_state_dtype`: the host Adam moments' element type (default fp32;
    /// `"auto"` is the default). Changes the numbers.
    pub optimizer_state_dtype: OptimizerStateDtype,
    pub offload: OffloadTuning,
}

/// The ZeRO-Offload paper's delayed parameter update: after a warm-up, the host optimizer step of
/// step t runs while the device computes step t + 1 with the weights of step t − 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DelayedUpdate {
    /// Off by default: it changes the optimization (one step of staleness).
    pub enabled: bool,
    /// Optimizer steps run without delay first, while the weights still change fast. Default 10
    /// (zeroflow's choice; DeepSpeed has no such setting).
    pub warmup_steps: u64,
}

impl Default for DelayedUpdate {
    fn default() -> Self {
        DelayedUpdate { enabled: false, warmup_steps: 10 }
    }
}

/// How attention keeps what its backward needs (`zeroflow.attention`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    /// cuBLASLt products; the attention weights are kept for backward.
    Gemm,
    /// FlashAttention-2 kernels; the log-sum-exp of each query row is kept instead.
    Flash,
}

/// How a host thread waits for the GPU (`zeroflow.cuda_wait`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaWait {
    /// It sleeps, leaving its core to the CPU optimizer.
    Block,
    /// It spins.
    Spin,
}

/// Whether a rank's CPU optimizer is bound to the CPUs near its GPU (`zeroflow.cpu_bind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBind {
    /// Bind, even a rank alone on its host.
    On,
    /// Never bind.
    Off,
}

/// How the CPU AdamW writes the weights' bf16 copy (`zeroflow.offload.copy_stores`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyStores {
    Normal,
    NonTemporal,
}

/// When the streaming step gathers the updated partitions (`zeroflow.offload.gather`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gather {
    /// Piece by piece while it steps.
    Pieces,
    /// After the step.
    AfterStep,
}

/// Where ZeRO-2 with gradient accumulation sums a window's gradients
/// (`zeroflow.offload.accumulate_on`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccumulateOn {
    /// In an f32 accumulator of the partition in device memory.
    Device,
    /// On the host, each micro-step's gradients copied out and added there.
    Host,
}

/// Where ZenFlow keeps the window its CPU step reads (`zeroflow.offload.zenflow_aside`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZenFlowAside {
    /// On the device (with `overlap_step` a second window and the CPU's weights there too),
    /// streamed through the host in chunks: 12 bytes per parameter of host memory with fp32
    /// moments.
    Device,
    /// Copied into host memory at the window's end, the CPU's weights kept there until applied:
    /// on the device the one window alone, in host memory 6 bytes per parameter more (for a GPU
    /// without room for ZenFlow's `overlap_step` on it).
    Host,
}

/// Where the optimizer's device share keeps its state (`zeroflow.offload.device_share_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceShareState {
    /// In device memory: 16 bytes per element of the share there.
    Device,
    /// In page-locked host memory, staged through the device a piece at a time while the CPU
    /// steps the rest.
    Host,
}

/// How much of the optimizer's partition is held and stepped on the device instead of the host
/// (`zeroflow.offload.device_share`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DeviceShare {
    /// This fraction of it, at least 0 and below 1.
    Fraction(f64),
    /// As much as the memory plan finds room for on the GPU (`"fit"`): the largest share, in
    /// hundredths, that leaves a tenth of the GPU's memory free; 0 where the share cannot act.
    Fit,
}

impl DeviceShare {
    /// `"fit"` or the fraction, as a flag, variable or the config spells it.
    pub fn parse(text: &str) -> Option<DeviceShare> {
        let text = text.trim();
        if text == "fit" {
            return Some(DeviceShare::Fit);
        }
        DeviceShare::fraction(text.parse().ok()?)
    }

    /// `share` as a fraction of the partition, where it is one: at least 0 and below 1.
    pub fn fraction(share: f64) -> Option<DeviceShare> {
        (0.0..1.0).contains(&share).then_some(DeviceShare::Fraction(share))
    }

    /// As the resolved config writes it.
    pub fn to_json(self) -> Value {
        match self {
            DeviceShare::Fraction(share) => json!(share),
            DeviceShare::Fit => json!("fit"),
        }
    }
}

/// The CPU-offload stream's tuning (`zeroflow.offload`): `None` keeps the engine's default. None
/// of it changes the numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OffloadTuning {
    /// The chunk the gradients go to the host and the weights come back in, in MiB of the
    /// parameter dtype (a positive number).
    pub stream_chunk_mib: Option<f64>,
    pub copy_stores: Option<CopyStores>,
    pub gather: Option<Gather>,
    /// Threads of the CPU optimizer.
    pub cpu_threads: Option<NonZeroU64>,
    /// The exact step's speculation budget: MiB of host memory for the backups of the pieces
    /// stepped during backward (a non-negative number; 0 turns speculation off).
    pub speculation_budget_mib: Option<f64>,
    pub accumulate_on: Option<AccumulateOn>,
    /// MiB of page-locked host memory a rank's device may hold (a non-negative number; 0 pins
    /// nothing); past it, host buffers asked for as pinned are pageable, with a warning.
    /// `None` (`"auto"`): no limit (only what the driver refuses to pin falls back).
    pub pinned_budget_mib: Option<f64>,
    /// The exact streaming step's CPU work left to the next forward, which opens the weights as
    /// the CPU steps them (`None`: zeroflow's default, on).
    pub overlap_forward: Option<bool>,
    /// The share of the optimizer's partition (a fraction, at least 0 and below 1, or `"fit"`)
    /// held in device memory instead of host memory and stepped there, from the partition's end
    /// (`None`: zeroflow's default, 0).
    pub device_share: Option<DeviceShare>,
    /// Where the device share keeps its state (`None`: zeroflow's default, the device).
    pub device_share_state: Option<DeviceShareState>,
    /// Where ZenFlow sets its window aside for the CPU step (`None`: zeroflow's default, the
    /// device, or host memory where only that fits the machine).
    pub zenflow_aside: Option<ZenFlowAside>,
}

const ATTENTIONS: &[(&str, Option<Attention>)] =
    &[("auto", None), ("gemm", Some(Attention::Gemm)), ("flash", Some(Attention::Flash))];
const CUDA_WAITS: &[(&str, Option<CudaWait>)] =
    &[("auto", None), ("block", Some(CudaWait::Block)), ("spin", Some(CudaWait::Spin))];
const CPU_BINDS: &[(&str, Option<CpuBind>)] =
    &[("auto", None), ("on", Some(CpuBind::On)), ("off", Some(CpuBind::Off))];
const COPY_STORES: &[(&str, Option<CopyStores>)] = &[
    ("auto", None),
    ("normal", Some(CopyStores::Normal)),
    ("non-temporal", Some(CopyStores::NonTemporal)),
];
const GATHERS: &[(&str, Option<Gather>)] =
    &[("auto", None), ("pieces", Some(Gather::Pieces)), ("after-step", Some(Gather::AfterStep))];
const OPTIMIZER_STATE_DTYPES: &[(&str, OptimizerStateDtype)] =
    &[("fp32", OptimizerStateDtype::Fp32), ("bf16", OptimizerStateDtype::Bf16)];
const ACCUMULATE_ONS: &[(&str, Option<AccumulateOn>)] =
    &[("auto", None), ("device", Some(AccumulateOn::Device)), ("host", Some(AccumulateOn::Host))];
const DEVICE_SHARE_STATES: &[(&str, Option<DeviceShareState>)] = &[
    ("auto", None),
    ("device", Some(DeviceShareState::Device)),
    ("host", Some(DeviceShareState::Host)),
];

const ZENFLOW_ASIDES: &[(&str, Option<ZenFlowAside>)] =
    &[("auto", None), ("device", Some(ZenFlowAside::Device)), ("host", Some(ZenFlowAside::Host))];

/// The name `choices` gives `value` (`None`: JSON `null`, the default).
fn name_of<T: Copy + PartialEq>(choices: &[(&'static str, Option<T>)], value: Option<T>) -> Value {
    match value {
        None => Value::Null,
        Some(_) => json!(choices.iter().find(|(_, c)| *c == value).map(|(name, _)| *name)),
    }
}

impl ZeroflowExtensions {
    /// The section as the resolved config writes it (`null` for a setting left to the default).
    pub fn to_json(&self) -> Value {
        let delayed_update = self.delayed_update;
        let offload = self.offload;
        json!({
            "delayed_update": {
                "enabled": delayed_update.enabled,
                "warmup_steps": delayed_update.warmup_steps,
            },
            "attention": name_of(ATTENTIONS, self.attention),
            "activation_checkpointing": self.activation_checkpointing,
            "pack": self.pack,
            "cuda_wait": name_of(CUDA_WAITS, self.cuda_wait),
            "cpu_bind": name_of(CPU_BINDS, self.cpu_bind),
            "optimizer_state_dtype": self.optimizer_state_dtype.name(),
            "offload": {
                "stream_chunk_mib": offload.stream_chunk_mib,
                "copy_stores": name_of(COPY_STORES, offload.copy_stores),
                "gather": name_of(GATHERS, offload.gather),
                "cpu_threads": offload.cpu_threads,
                "speculation_budget_mib": offload.speculation_budget_mib,
                "accumulate_on": name_of(ACCUMULATE_ONS, offload.accumulate_on),
                "pinned_budget_mib": offload.pinned_budget_mib,
                "overlap_forward": offload.overlap_forward,
                "device_share": offload.device_share.map(DeviceShare::to_json),
                "device_share_state": name_of(DEVICE_SHARE_STATES, offload.device_share_state),
                "zenflow_aside": name_of(ZENFLOW_ASIDES, offload.zenflow_aside),
            },
        })
    }
}

/// Reads the `zeroflow` section, if any.
pub(crate) fn read_extensions(
    root: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<ZeroflowExtensions, ConfigError> {
    let Some(mut section) = root.section("zeroflow")? else {
        return Ok(ZeroflowExtensions::default());
    };
    let delayed_update = match section.section("delayed_update")? {
        Some(delayed) => read_delayed_update(delayed, diagnostics)?,
        None => DelayedUpdate::default(),
    };
    let attention =
        named(&mut section, "attention", ATTENTIONS, "\"auto\", \"gemm\" or \"flash\"")?;
    let activation_checkpointing = section.bool("activation_checkpointing")?.given();
    let pack = section.bool("pack")?.given();
    let cuda_wait =
        named(&mut section, "cuda_wait", CUDA_WAITS, "\"auto\", \"block\" or \"spin\"")?;
    let cpu_bind = named(&mut section, "cpu_bind", CPU_BINDS, "\"auto\", \"on\" or \"off\"")?;
    let optimizer_state_dtype = match section.choice(
        "optimizer_state_dtype",
        OPTIMIZER_STATE_DTYPES,
        "\"fp32\" or \"bf16\" (fp16 moments are not offered: squared gradients underflow \
         its range)",
    )? {
        Setting::Given(dtype) => dtype,
        Setting::Absent | Setting::Auto => OptimizerStateDtype::default(),
    };
    let offload = match section.section("offload")? {
        Some(offload) => read_offload(offload, diagnostics)?,
        None => OffloadTuning::default(),
    };
    section.finish(&[], diagnostics);
    Ok(ZeroflowExtensions {
        delayed_update,
        attention,
        activation_checkpointing,
        pack,
        cuda_wait,
        cpu_bind,
        optimizer_state_dtype,
        offload,
    })
}

fn read_delayed_update(
    mut delayed: Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<DelayedUpdate, ConfigError> {
    let defaults = DelayedUpdate::default();
    let enabled_path = delayed.path_of("enabled");
    let warmup_path = delayed.path_of("warmup_steps");
    let enabled = delayed.bool("enabled")?.or_default(&enabled_path, defaults.enabled, diagnostics);
    let warmup_steps = delayed.integer("warmup_steps", NON_NEGATIVE_INT)?.or_default(
        &warmup_path,
        defaults.warmup_steps,
        diagnostics,
    );
    delayed.finish(&[], diagnostics);
    Ok(DelayedUpdate { enabled, warmup_steps })
}

fn read_offload(
    mut offload: Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<OffloadTuning, ConfigError> {
    let stream_chunk_mib = mib(&mut offload, "stream_chunk_mib", |mib| mib > 0.0, "a positive")?;
    let speculation_budget_mib =
        mib(&mut offload, "speculation_budget_mib", |mib| mib >= 0.0, "a non-negative")?;
    let pinned_budget_mib =
        mib(&mut offload, "pinned_budget_mib", |mib| mib >= 0.0, "a non-negative")?;
    let copy_stores = named(
        &mut offload,
        "copy_stores",
        COPY_STORES,
        "\"auto\", \"normal\" or \"non-temporal\"",
    )?;
    let gather = named(&mut offload, "gather", GATHERS, "\"auto\", \"pieces\" or \"after-step\"")?;
    let cpu_threads = match offload.integer("cpu_threads", POSITIVE_INT)? {
        Setting::Given(threads) => NonZeroU64::new(threads),
        Setting::Absent | Setting::Auto => None,
    };
    let accumulate_on =
        named(&mut offload, "accumulate_on", ACCUMULATE_ONS, "\"auto\", \"device\" or \"host\"")?;
    let overlap_forward = offload.bool("overlap_forward")?.given();
    let device_share = share(&mut offload, "device_share")?;
    let device_share_state = named(
        &mut offload,
        "device_share_state",
        DEVICE_SHARE_STATES,
        "\"auto\", \"device\" or \"host\"",
    )?;
    let zenflow_aside =
        named(&mut offload, "zenflow_aside", ZENFLOW_ASIDES, "\"auto\", \"device\" or \"host\"")?;
    offload.finish(&[], diagnostics);
    Ok(OffloadTuning {
        stream_chunk_mib,
        copy_stores,
        gather,
        cpu_threads,
        speculation_budget_mib,
        accumulate_on,
        pinned_budget_mib,
        overlap_forward,
        device_share,
        device_share_state,
        zenflow_aside,
    })
}

/// A key whose value is a fraction at least 0 and below 1, `"fit"`, or `"auto"` (`None`).
fn share(section: &mut Section<'_>, key: &'static str) -> Result<Option<DeviceShare>, ConfigError> {
    let Some(value) = section.value(key) else {
        return Ok(None);
    };
    let share = match value {
        Value::String(text) if text == "auto" => return Ok(None),
        Value::String(text) if text == "fit" => Some(DeviceShare::Fit),
        Value::Number(number) => number.as_f64().and_then(DeviceShare::fraction),
        _ => None,
    };
    share.map(Some).ok_or_else(|| {
        ConfigError::bad_value(
            section.path_of(key),
            "a fraction at least 0 and below 1, \"fit\" or \"auto\"".to_owned(),
            super::reader::describe(value),
        )
    })
}

/// A key whose value is a finite number of MiB that `accepts`, or `"auto"` (`None`); `what`
/// qualifies the expected number in the error ("a positive").
fn mib(
    section: &mut Section<'_>,
    key: &'static str,
    accepts: fn(f64) -> bool,
    what: &str,
) -> Result<Option<f64>, ConfigError> {
    match section.value(key) {
        None => Ok(None),
        Some(Value::String(text)) if text == "auto" => Ok(None),
        Some(Value::Number(number))
            if number.as_f64().is_some_and(|mib| mib.is_finite() && accepts(mib)) =>
        {
            Ok(number.as_f64())
        }
        Some(other) => Err(ConfigError::bad_value(
            section.path_of(key),
            format!("{what} number of MiB or \"auto\""),
            super::reader::describe(other),
        )),
    }
}

/// A key whose value is one of `choices` by name (`"auto"` among them, read as `None`).
fn named<T: Copy>(
    section: &mut Section<'_>,
    key: &'static str,
    choices: &[(&str, Option<T>)],
    expected: &str,
) -> Result<Option<T>, ConfigError> {
    match section.choice(key, choices, expected)? {
        Setting::Given(choice) => Ok(choice),
        Setting::Absent | Setting::Auto => Ok(None),
    }
}
