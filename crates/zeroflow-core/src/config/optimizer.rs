//! The `optimizer` section: Adam and AdamW, the only optimizers zeroflow implements.
//!
//! As in DeepSpeed's engine (`_configure_basic_optimizer`): the type is matched without regard to
//! case; `adam_w_mode` defaults to true, so `"Adam"` means AdamW unless `adam_w_mode` is false,
//! and `"AdamW"` means AdamW whatever `adam_w_mode` says. Parameter defaults are those of
//! DeepSpeed's FusedAdam and DeepSpeedCPUAdam: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay
//! 0, bias correction on; with `torch_adam` and AdamW, torch's `AdamW` default weight decay 0.01.

use serde_json::Value;

use super::diagnostics::{AutoSource, DEEPSPEED_DEFAULT, Diagnostics};
use super::error::ConfigError;
use super::known_keys;
use super::overrides::Overrides;
use super::reader::{
    NON_NEGATIVE, NumberRule, Section, Setting, check_number, describe, describe_type, quote,
};

/// How weight decay enters the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightDecayMode {
    /// AdamW: the weight shrinks by `lr × weight_decay` apart from the moments.
    Decoupled,
    /// Classic Adam: `weight_decay × weight` is added to the gradient (an L2 penalty).
    L2,
}

/// Adam/AdamW hyper-parameters, with DeepSpeed's names.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamConfig {
    /// Decoupled for AdamW, L2 for classic Adam.
    pub mode: WeightDecayMode,
    pub lr: f64,
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    pub bias_correction: bool,
}

impl AdamConfig {
    /// What DeepSpeed's default Adam does: AdamW with FusedAdam's defaults. Used when the config
    /// has no `optimizer` section, since zeroflow always needs one.
    pub const DEEPSPEED_DEFAULT: AdamConfig = AdamConfig {
        mode: WeightDecayMode::Decoupled,
        lr: 1e-3,
        betas: (0.9, 0.999),
        eps: 1e-8,
        weight_decay: 0.0,
        bias_correction: true,
    };

    /// DeepSpeed's name for this optimizer: `"AdamW"` or `"Adam"`.
    pub const fn type_name(&self) -> &'static str {
        match self.mode {
            WeightDecayMode::Decoupled => "AdamW",
            WeightDecayMode::L2 => "Adam",
        }
    }
}

const BETA: NumberRule =
    NumberRule { expected: "a number in [0, 1)", accepts: |x| (0.0..1.0).contains(&x) };

/// Reads the `optimizer` section; without one, [`AdamConfig::DEEPSPEED_DEFAULT`].
pub(crate) fn read_optimizer(
    root: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<AdamConfig, ConfigError> {
    let Some(mut section) = root.section("optimizer")? else {
        return Ok(AdamConfig::DEEPSPEED_DEFAULT);
    };
    let named_adamw = read_type(&mut section)?;
    let config = match section.section("params")? {
        Some(mut params) => {
            let config = read_params(&mut params, named_adamw, overrides, diagnostics)?;
            params.finish(known_keys::OPTIMIZER_PARAMS, diagnostics);
            config
        }
        // Without params, adam_w_mode keeps its default (true): AdamW for either name.
        None => AdamConfig::DEEPSPEED_DEFAULT,
    };
    section.finish(known_keys::OPTIMIZER, diagnostics);
    Ok(config)
}

/// Whether the type names AdamW (true) or Adam (false).
fn read_type(section: &mut Section<'_>) -> Result<bool, ConfigError> {
    const EXPECTED: &str = "\"Adam\" or \"AdamW\" (in any letter case)";
    let path = section.path_of("type");
    let Some(name) = section.string("type")? else {
        return Err(ConfigError::missing(path, format!("no optimizer type; expected {EXPECTED}")));
    };
    match name.to_ascii_lowercase().as_str() {
        "adam" => Ok(false),
        "adamw" => Ok(true),
        _ => Err(ConfigError::unsupported(
            path,
            format!(
                "expected {EXPECTED}, found {} (zeroflow implements Adam and AdamW only)",
                quote(name)
            ),
        )),
    }
}

fn read_params(
    params: &mut Section<'_>,
    named_adamw: bool,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<AdamConfig, ConfigError> {
    reject_unsupported_params(params)?;
    let adam_w_mode_path = params.path_of("adam_w_mode");
    let adam_w_mode = params.bool("adam_w_mode")?.or_default(&adam_w_mode_path, true, diagnostics);
    if named_adamw && !adam_w_mode {
        let message = "false has no effect with type AdamW (DeepSpeed runs AdamW too); use type \
                       Adam for classic Adam";
        diagnostics.adjusted(adam_w_mode_path, message);
    }
    let decoupled = named_adamw || adam_w_mode;
    let torch_path = params.path_of("torch_adam");
    let torch_adam = params.bool("torch_adam")?.or_default(&torch_path, false, diagnostics);
    let default_weight_decay = if torch_adam && decoupled { 0.01 } else { 0.0 };
    let defaults = AdamConfig::DEEPSPEED_DEFAULT;
    let bias_path = params.path_of("bias_correction");
    Ok(AdamConfig {
        mode: if decoupled { WeightDecayMode::Decoupled } else { WeightDecayMode::L2 },
        lr: read_number(params, "lr", defaults.lr, overrides.lr, diagnostics)?,
        betas: read_betas(params, overrides, diagnostics)?,
        eps: read_number(params, "eps", defaults.eps, overrides.eps, diagnostics)?,
        weight_decay: read_number(
            params,
            "weight_decay",
            default_weight_decay,
            overrides.weight_decay,
            diagnostics,
        )?,
        bias_correction: params.bool("bias_correction")?.or_default(&bias_path, true, diagnostics),
    })
}

/// Parameters DeepSpeed itself refuses for Adam.
fn reject_unsupported_params(params: &mut Section<'_>) -> Result<(), ConfigError> {
    if params.value("max_grad_norm").is_some() {
        return Err(ConfigError::unsupported(
            params.path_of("max_grad_norm"),
            "not an optimizer parameter (DeepSpeed rejects it too); set the top-level \
             gradient_clipping instead",
        ));
    }
    if params.bool("amsgrad")?.given() == Some(true) {
        return Err(ConfigError::unsupported(
            params.path_of("amsgrad"),
            "expected false, found true (AMSGrad is not supported; DeepSpeed's FusedAdam rejects \
             it too)",
        ));
    }
    Ok(())
}

/// A non-negative number; `"auto"` takes the override, else the default.
fn read_number(
    params: &mut Section<'_>,
    key: &'static str,
    default: f64,
    replacement: Option<f64>,
    diagnostics: &mut Diagnostics,
) -> Result<f64, ConfigError> {
    let path = params.path_of(key);
    let replacement =
        replacement.map(|value| check_number(&path, value, NON_NEGATIVE)).transpose()?;
    Ok(params.number(key, NON_NEGATIVE)?.or_override(&path, default, replacement, diagnostics))
}

/// `betas`: a list of two numbers in [0, 1).
fn read_betas(
    params: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<(f64, f64), ConfigError> {
    let path = params.path_of("betas");
    let default = AdamConfig::DEEPSPEED_DEFAULT.betas;
    let setting = match params.value("betas") {
        None => Setting::Absent,
        Some(Value::String(text)) if text == "auto" => Setting::Auto,
        Some(Value::Array(items)) if items.len() == 2 => {
            Setting::Given((beta(&path, 0, &items[0])?, beta(&path, 1, &items[1])?))
        }
        Some(other) => return Err(params.wrong_type("betas", "a list of two numbers", other)),
    };
    match (setting, overrides.betas) {
        (Setting::Given(betas), _) => Ok(betas),
        (Setting::Absent, _) => Ok(default),
        (Setting::Auto, Some((beta1, beta2))) => {
            let betas = (check_beta(&path, 0, beta1)?, check_beta(&path, 1, beta2)?);
            diagnostics.auto(&path, vec![betas.0, betas.1], AutoSource::Override);
            Ok(betas)
        }
        (Setting::Auto, None) => {
            diagnostics.auto(
                &path,
                vec![default.0, default.1],
                AutoSource::Default(DEEPSPEED_DEFAULT),
            );
            Ok(default)
        }
    }
}

fn beta(path: &str, index: usize, value: &Value) -> Result<f64, ConfigError> {
    let path = format!("{path}[{index}]");
    match value.as_f64() {
        Some(x) if (BETA.accepts)(x) => Ok(x),
        Some(_) => Err(ConfigError::bad_value(path, BETA.expected, describe(value))),
        None => Err(ConfigError::WrongType {
            path,
            expected: BETA.expected,
            found: describe_type(value),
        }),
    }
}

fn check_beta(path: &str, index: usize, value: f64) -> Result<f64, ConfigError> {
    check_number(&format!("{path}[{index}]"), value, BETA)
}
