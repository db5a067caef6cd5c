//! The `zero_optimization` section, with its optimizer offload and ZenFlow.
//!
//! Defaults from DeepSpeed's `runtime/zero/config.py` and `runtime/zero/offload_config.py`: stage
//! 0, `contiguous_gradients` true, `overlap_comm` false below stage 3, `reduce_scatter` true,
//! `reduce_bucket_size` and `allgather_bucket_size` 5e8, `allgather_partitions` true,
//! `offload_optimizer.device` "none", `offload_optimizer.pin_memory` true. As in DeepSpeed's
//! stage 1/2 optimizer, offload forces contiguous gradients on; the legacy `cpu_offload: true`
//! means offload to the CPU; the legacy `"zero_optimization": true` means stage 1.

use serde_json::Value;

use super::diagnostics::{AutoSource, DEEPSPEED_DEFAULT, Diagnostics, WarningKind};
use super::error::ConfigError;
use super::known_keys;
use super::overrides::Overrides;
use super::reader::{FRACTION, IntRule, POSITIVE_INT, Section, Setting, quote};
use super::zenflow::{ZenFlowConfig, read_zenflow};

/// Which state ZeRO partitions across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ZeroStage {
    /// Stage 0: plain data parallelism.
    Disabled,
    /// Stage 1: optimizer states.
    OptimizerStates,
    /// Stage 2: optimizer states and gradients.
    Gradients,
}

impl ZeroStage {
    /// DeepSpeed's stage number.
    pub const fn number(self) -> u64 {
        match self {
            ZeroStage::Disabled => 0,
            ZeroStage::OptimizerStates => 1,
            ZeroStage::Gradients => 2,
        }
    }
}

/// Optimizer state and step on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuOffload {
    /// Use page-locked host memory for the offloaded state and the transfers.
    pub pin_memory: bool,
}

/// ZeRO settings, with DeepSpeed's names.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZeroConfig {
    pub stage: ZeroStage,
    /// Always true with offload.
    pub contiguous_gradients: bool,
    pub overlap_comm: bool,
    pub reduce_scatter: bool,
    /// Elements per gradient reduction bucket.
    pub reduce_bucket_size: u64,
    pub allgather_partitions: bool,
    /// Elements per parameter all-gather bucket.
    pub allgather_bucket_size: u64,
    /// `Some` when `offload_optimizer.device` is "cpu" (or the legacy `cpu_offload` is true).
    pub offload_optimizer: Option<CpuOffload>,
    /// `Some` when the config has a `zenflow` section; it implies `offload_optimizer`.
    pub zenflow: Option<ZenFlowConfig>,
}

const DEFAULT_BUCKET_SIZE: u64 = 500_000_000;

impl ZeroConfig {
    /// DeepSpeed's settings when the config has no `zero_optimization` section.
    pub const DEEPSPEED_DEFAULT: ZeroConfig = ZeroConfig {
        stage: ZeroStage::Disabled,
        contiguous_gradients: true,
        overlap_comm: false,
        reduce_scatter: true,
        reduce_bucket_size: DEFAULT_BUCKET_SIZE,
        allgather_partitions: true,
        allgather_bucket_size: DEFAULT_BUCKET_SIZE,
        offload_optimizer: None,
        zenflow: None,
    };
}

/// Reads `zero_optimization`: an object, or DeepSpeed's legacy boolean.
pub(crate) fn read_zero(
    root: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<ZeroConfig, ConfigError> {
    match root.value("zero_optimization") {
        None => Ok(ZeroConfig::DEEPSPEED_DEFAULT),
        Some(Value::Bool(enabled)) => read_legacy_flag(root, *enabled, diagnostics),
        Some(_) => {
            let Some(mut section) = root.section("zero_optimization")? else {
                return Ok(ZeroConfig::DEEPSPEED_DEFAULT);
            };
            let config = read_section(&mut section, overrides, diagnostics)?;
            section.finish_strict(known_keys::ZERO_OPTIMIZATION, diagnostics)?;
            Ok(config)
        }
    }
}

/// `"zero_optimization": true` is stage 1 with `allgather_size` as the all-gather bucket.
fn read_legacy_flag(
    root: &mut Section<'_>,
    enabled: bool,
    diagnostics: &mut Diagnostics,
) -> Result<ZeroConfig, ConfigError> {
    let instead = "write \"zero_optimization\": {\"stage\": 1} (DeepSpeed reads true as stage 1 \
                   and false as stage 0)";
    diagnostics.warn("zero_optimization", WarningKind::Deprecated { instead });
    let bucket_path = root.path_of("allgather_size");
    let allgather_bucket_size = root.integer("allgather_size", POSITIVE_INT)?.or_default(
        &bucket_path,
        DEFAULT_BUCKET_SIZE,
        diagnostics,
    );
    let stage = if enabled { ZeroStage::OptimizerStates } else { ZeroStage::Disabled };
    Ok(ZeroConfig { stage, allgather_bucket_size, ..ZeroConfig::DEEPSPEED_DEFAULT })
}

fn read_section(
    section: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<ZeroConfig, ConfigError> {
    let path = |key: &str| format!("zero_optimization.{key}");
    let stage = read_stage(section, diagnostics)?;
    let contiguous = section.bool("contiguous_gradients")?;
    let mut flag = |key: &'static str, default: bool| -> Result<bool, ConfigError> {
        Ok(section.bool(key)?.or_default(&path(key), default, diagnostics))
    };
    let overlap_comm = flag("overlap_comm", false)?;
    let reduce_scatter = flag("reduce_scatter", true)?;
    let allgather_partitions = flag("allgather_partitions", true)?;
    let reduce_bucket_size = read_reduce_bucket_size(section, overrides, diagnostics)?;
    let allgather_bucket_size = section.integer("allgather_bucket_size", POSITIVE_INT)?.or_default(
        &path("allgather_bucket_size"),
        DEFAULT_BUCKET_SIZE,
        diagnostics,
    );
    let offload = read_offload(section, diagnostics)?;
    let zenflow = read_zenflow(section, diagnostics)?;
    let offload_optimizer = offload.as_ref().map(|(offload, _)| *offload);
    if let Some((_, offload_path)) = &offload {
        check_offload_stage(stage, offload_path)?;
    }
    if let Some(zenflow) = &zenflow {
        check_zenflow(zenflow, offload_optimizer.is_some(), overlap_comm)?;
    }
    let contiguous_gradients = force_contiguous(
        contiguous,
        offload_optimizer.is_some(),
        &path("contiguous_gradients"),
        diagnostics,
    );
    Ok(ZeroConfig {
        stage,
        contiguous_gradients,
        overlap_comm,
        reduce_scatter,
        reduce_bucket_size,
        allgather_partitions,
        allgather_bucket_size,
        offload_optimizer,
        zenflow,
    })
}

fn read_stage(
    section: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<ZeroStage, ConfigError> {
    const STAGE: IntRule = IntRule { expected: "0, 1 or 2", min: 0, max: u64::MAX };
    let path = section.path_of("stage");
    match section.integer("stage", STAGE)?.or_default(&path, 0, diagnostics) {
        0 => Ok(ZeroStage::Disabled),
        1 => Ok(ZeroStage::OptimizerStates),
        2 => Ok(ZeroStage::Gradients),
        3 => Err(ConfigError::unsupported(
            path,
            "expected 0, 1 or 2, found 3 (stage 3 is not supported)",
        )),
        other => Err(ConfigError::bad_value(path, "0, 1 or 2", other.to_string())),
    }
}

/// An `"auto"` bucket becomes the square of the caller's hidden size, as in Hugging Face.
fn read_reduce_bucket_size(
    section: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<u64, ConfigError> {
    let path = section.path_of("reduce_bucket_size");
    Ok(match (section.integer("reduce_bucket_size", POSITIVE_INT)?, overrides.hidden_size) {
        (Setting::Given(size), _) => size,
        (Setting::Absent, _) => DEFAULT_BUCKET_SIZE,
        (Setting::Auto, Some(hidden)) => {
            let size = hidden.get().saturating_mul(hidden.get());
            let source =
                AutoSource::Derived("the square of the caller's hidden size, as in Hugging Face");
            diagnostics.auto(path, size, source);
            size
        }
        (Setting::Auto, None) => {
            diagnostics.auto(path, DEFAULT_BUCKET_SIZE, AutoSource::Default(DEEPSPEED_DEFAULT));
            DEFAULT_BUCKET_SIZE
        }
    })
}

/// The offload settings and the JSON path they were read from, `None` for no offload. Accepts
/// `offload_optimizer` or the deprecated `cpu_offload`, not both (DeepSpeed refuses both too).
fn read_offload(
    section: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<Option<(CpuOffload, String)>, ConfigError> {
    let legacy_path = section.path_of("cpu_offload");
    let legacy = section.bool("cpu_offload")?;
    let offload_section = section.section("offload_optimizer")?;
    if legacy != Setting::Absent {
        if offload_section.is_some() {
            return Err(ConfigError::conflict(
                legacy_path,
                "cannot be combined with zero_optimization.offload_optimizer, which replaces it \
                 (DeepSpeed refuses both together too); keep offload_optimizer",
            ));
        }
        let instead = "write \"offload_optimizer\": {\"device\": \"cpu\"} (read as that when true)";
        diagnostics.warn(&legacy_path, WarningKind::Deprecated { instead });
        let enabled = legacy.or_default(&legacy_path, false, diagnostics);
        return Ok(enabled.then_some((CpuOffload { pin_memory: true }, legacy_path)));
    }
    let Some(mut offload) = offload_section else { return Ok(None) };
    let result = read_offload_section(&mut offload, diagnostics)?;
    offload.finish_strict(known_keys::OFFLOAD_OPTIMIZER, diagnostics)?;
    Ok(result.map(|cpu| (cpu, "zero_optimization.offload_optimizer".to_owned())))
}

fn read_offload_section(
    offload: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<Option<CpuOffload>, ConfigError> {
    const EXPECTED: &str = "\"none\" or \"cpu\"";
    let device_path = offload.path_of("device");
    let to_cpu = match offload.string("device")? {
        None | Some("none") => false,
        Some("cpu") => true,
        Some("auto") => {
            diagnostics.auto(&device_path, "none", AutoSource::Default(DEEPSPEED_DEFAULT));
            false
        }
        Some("nvme") => {
            let message = format!(
                "expected {EXPECTED}, found \"nvme\" (NVMe offload is not supported by zeroflow)"
            );
            return Err(ConfigError::unsupported(device_path, message));
        }
        Some(other) => return Err(ConfigError::bad_value(device_path, EXPECTED, quote(other))),
    };
    let pin_path = offload.path_of("pin_memory");
    let pin_memory = offload.bool("pin_memory")?.or_default(&pin_path, true, diagnostics);
    let ratio_path = offload.path_of("ratio");
    let ratio = offload.number("ratio", FRACTION)?.or_default(&ratio_path, 1.0, diagnostics);
    if ratio < 1.0 {
        return Err(ConfigError::unsupported(
            ratio_path,
            format!(
                "expected 1, found {ratio} (partial offload is a ZeRO stage 3 feature; DeepSpeed \
                 rejects it at stages 1 and 2 too)"
            ),
        ));
    }
    Ok(to_cpu.then_some(CpuOffload { pin_memory }))
}

fn check_offload_stage(stage: ZeroStage, offload_path: &str) -> Result<(), ConfigError> {
    if stage == ZeroStage::Disabled {
        return Err(ConfigError::conflict(
            offload_path,
            "optimizer offload needs ZeRO stage 1 or 2, but zero_optimization.stage is 0",
        ));
    }
    Ok(())
}

/// ZenFlow's requirements on the rest of `zero_optimization`, as DeepSpeed's ZenFlow optimizer
/// asserts them.
fn check_zenflow(
    zenflow: &ZenFlowConfig,
    offload: bool,
    overlap_comm: bool,
) -> Result<(), ConfigError> {
    if !offload {
        return Err(ConfigError::conflict(
            "zero_optimization.zenflow",
            "ZenFlow needs CPU optimizer offload; set zero_optimization.offload_optimizer.device \
             to \"cpu\" (DeepSpeed: \"Zenflow must be used with cpu offload\")",
        ));
    }
    if zenflow.offload && !overlap_comm {
        return Err(ConfigError::conflict(
            "zero_optimization.zenflow.offload",
            "true needs zero_optimization.overlap_comm to be true (DeepSpeed asserts this too)",
        ));
    }
    Ok(())
}

/// DeepSpeed's stage 1/2 optimizer uses `contiguous_gradients or cpu_offload`.
fn force_contiguous(
    setting: Setting<bool>,
    offload: bool,
    path: &str,
    diagnostics: &mut Diagnostics,
) -> bool {
    let contiguous = setting.or_default(path, true, diagnostics);
    if offload && !contiguous {
        let message = "false is overridden to true because optimizer offload needs contiguous \
                       gradients (DeepSpeed does the same)";
        diagnostics.adjusted(path, message);
    }
    contiguous || offload
}
