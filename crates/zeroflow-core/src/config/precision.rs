//! Mixed precision: the `bf16` (legacy `bfloat16`) and `fp16` sections.
//!
//! Defaults from DeepSpeed's `runtime/precision_config.py`: both disabled; bf16
//! `check_grad_overflow` true; fp16 `loss_scale` 0 (dynamic), `initial_scale_power` 16,
//! `loss_scale_window` 1000, `hysteresis` 2, `consecutive_hysteresis` false, `min_loss_scale` 1.

use crate::DType;

use super::diagnostics::Diagnostics;
use super::error::ConfigError;
use super::known_keys;
use super::overrides::Overrides;
use super::reader::{IntRule, NON_NEGATIVE_INT, NumberRule, POSITIVE_INT, Section};

/// The element type training runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

impl Precision {
    /// The element type of weights and gradients on the device.
    pub const fn dtype(self) -> DType {
        match self {
            Precision::Fp32 => DType::F32,
            Precision::Bf16 => DType::Bf16,
            Precision::Fp16 => DType::F16,
        }
    }
}

/// The precision settings in effect.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MixedPrecision {
    /// Neither `bf16.enabled` nor `fp16.enabled`.
    Fp32,
    /// `bf16.enabled`. With `check_grad_overflow`, a step whose gradients are not finite is
    /// skipped, as DeepSpeed does.
    Bf16 { check_grad_overflow: bool },
    /// `fp16.enabled`, with its loss scaling.
    Fp16(LossScaling),
}

impl MixedPrecision {
    pub const fn precision(&self) -> Precision {
        match self {
            MixedPrecision::Fp32 => Precision::Fp32,
            MixedPrecision::Bf16 { .. } => Precision::Bf16,
            MixedPrecision::Fp16(_) => Precision::Fp16,
        }
    }
}

/// How fp16 training scales the loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LossScaling {
    /// `loss_scale` > 0: this fixed scale.
    Static(f64),
    /// `loss_scale` = 0: a scale that halves on overflow and grows when stable.
    Dynamic(DynamicLossScale),
}

/// DeepSpeed's dynamic loss scaler settings, with its names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DynamicLossScale {
    /// The scale starts at `2^initial_scale_power`.
    pub initial_scale_power: u32,
    /// Overflow-free steps before the scale doubles.
    pub loss_scale_window: u64,
    /// Overflows tolerated before the scale halves (DeepSpeed's "delayed shift").
    pub hysteresis: u64,
    /// Refill the hysteresis after every step without overflow.
    pub consecutive_hysteresis: bool,
    /// The scale never goes below this.
    pub min_loss_scale: u64,
}

impl DynamicLossScale {
    pub fn initial_scale(&self) -> f64 {
        2f64.powi(self.initial_scale_power as i32)
    }
}

const LOSS_SCALE: NumberRule = NumberRule {
    expected: "a non-negative number (0 selects dynamic loss scaling)",
    accepts: |x| x >= 0.0,
};

/// 2^127 is the largest power of two an f32 loss scale can hold.
const SCALE_POWER: IntRule = IntRule { expected: "an integer from 0 to 127", min: 0, max: 127 };

/// Reads `bf16` (or `bfloat16`) and `fp16`; both enabled is an error, as in DeepSpeed.
pub(crate) fn read_precision(
    root: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<MixedPrecision, ConfigError> {
    let bf16_key =
        if root.contains("bf16") || !root.contains("bfloat16") { "bf16" } else { "bfloat16" };
    let bf16 = read_bf16(root, bf16_key, overrides, diagnostics)?;
    let fp16 = read_fp16(root, overrides, diagnostics)?;
    match (bf16, fp16) {
        (Some(_), Some(_)) => Err(ConfigError::conflict(
            "fp16.enabled",
            format!(
                "fp16 and bf16 cannot both be enabled ({bf16_key}.enabled is true too; DeepSpeed \
                 rejects this as well); enable one of them"
            ),
        )),
        (Some(check_grad_overflow), None) => Ok(MixedPrecision::Bf16 { check_grad_overflow }),
        (None, Some(loss_scaling)) => Ok(MixedPrecision::Fp16(loss_scaling)),
        (None, None) => Ok(MixedPrecision::Fp32),
    }
}

/// `Some(check_grad_overflow)` when bf16 is enabled.
fn read_bf16(
    root: &mut Section<'_>,
    key: &'static str,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<Option<bool>, ConfigError> {
    let Some(mut section) = root.section(key)? else { return Ok(None) };
    let wanted = overrides.precision.map(|precision| precision == Precision::Bf16);
    let enabled = section.bool("enabled")?.or_override(
        &section.path_of("enabled"),
        false,
        wanted,
        diagnostics,
    );
    let check_path = section.path_of("check_grad_overflow");
    let check_grad_overflow =
        section.bool("check_grad_overflow")?.or_default(&check_path, true, diagnostics);
    section.finish_strict(known_keys::BF16, diagnostics)?;
    Ok(enabled.then_some(check_grad_overflow))
}

/// `Some(loss scaling)` when fp16 is enabled. As in DeepSpeed, the window, hysteresis and minimum
/// scale must be positive only when dynamic scaling is in use.
fn read_fp16(
    root: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<Option<LossScaling>, ConfigError> {
    let Some(mut section) = root.section("fp16")? else { return Ok(None) };
    let path = |key: &str| format!("fp16.{key}");
    let wanted = overrides.precision.map(|precision| precision == Precision::Fp16);
    let enabled =
        section.bool("enabled")?.or_override(&path("enabled"), false, wanted, diagnostics);
    let loss_scale =
        section.number("loss_scale", LOSS_SCALE)?.or_default(&path("loss_scale"), 0.0, diagnostics);
    let dynamic = enabled && loss_scale == 0.0;
    let count = if dynamic { POSITIVE_INT } else { NON_NEGATIVE_INT };
    let power = section.integer("initial_scale_power", SCALE_POWER)?;
    let window = section.integer("loss_scale_window", count)?;
    let hysteresis = section.integer("hysteresis", count)?;
    let consecutive = section.bool("consecutive_hysteresis")?;
    let min_loss_scale = section.integer("min_loss_scale", count)?;
    section.finish_strict(known_keys::FP16, diagnostics)?;
    if !enabled {
        return Ok(None);
    }
    if !dynamic {
        return Ok(Some(LossScaling::Static(loss_scale)));
    }
    let initial_scale_power = power.or_default(&path("initial_scale_power"), 16, diagnostics);
    Ok(Some(LossScaling::Dynamic(DynamicLossScale {
        // At most 127 by `SCALE_POWER`.
        initial_scale_power: initial_scale_power as u32,
        loss_scale_window: window.or_default(&path("loss_scale_window"), 1000, diagnostics),
        hysteresis: hysteresis.or_default(&path("hysteresis"), 2, diagnostics),
        consecutive_hysteresis: consecutive.or_default(
            &path("consecutive_hysteresis"),
            false,
            diagnostics,
        ),
        min_loss_scale: min_loss_scale.or_default(&path("min_loss_scale"), 1, diagnostics),
    })))
}
