//! DeepSpeed's JSON config, read with DeepSpeed's defaults and rules, resolved and validated.
//!
//! ```no_run
//! use zeroflow_core::config::{self, Context};
//!
//! let resolved = config::resolve_file("ds_config.json".as_ref(), &Context::default())?;
//! for warning in &resolved.warnings {
//!     eprintln!("warning: {warning}");
//! }
//! println!("{}", resolved.config.to_resolved_json());
//! # Ok::<(), config::ConfigError>(())
//! ```
//!
//! Resolution follows DeepSpeed (`runtime/config.py` and the section modules it uses): defaults
//! are DeepSpeed's; `train_batch_size = micro batch × accumulation steps × world size` fixes any
//! batch size left out; `"auto"` values are filled as Hugging Face's integration fills them (see
//! [`Overrides`]). A wrong type, an impossible value or a contradiction is a [`ConfigError`] that
//! names the JSON path. Keys that have no effect are never errors: each one draws a [`Warning`].
//!
//! Where DeepSpeed is laxer than zeroflow needs, this module is stricter, and says so in its
//! messages: stage 3 and NVMe offload are not implemented; bucket sizes must be positive; only
//! Adam/AdamW and the three warm-up schedules exist. `null` reads as an absent key.

mod batch;
mod diagnostics;
mod error;
mod extensions;
mod known_keys;
mod optimizer;
mod overrides;
mod precision;
mod reader;
mod resolved_json;
mod scheduler;
mod zenflow;
mod zero;

use std::{num::NonZeroU32, path::Path};

use serde_json::Value;

pub use batch::{BatchSizes, derive_batch_sizes};
pub use diagnostics::{AutoSource, AutoValue, Warning, WarningKind};
pub use error::{ConfigError, ROOT};
pub use extensions::{
    AccumulateOn, Attention, CopyStores, CpuBind, CudaWait, DelayedUpdate, DeviceShare,
    DeviceShareState, Gather, OffloadTuning, ZenFlowAside, ZeroflowExtensions,
};
pub use optimizer::{AdamConfig, WeightDecayMode};
pub use overrides::Overrides;
pub use precision::{DynamicLossScale, LossScaling, MixedPrecision, Precision};
pub use scheduler::{CosineSchedule, Scheduler, Warmup, WarmupCurve};
pub use zenflow::{Selection, UpdateInterval, ZenFlowConfig};
pub use zero::{CpuOffload, ZeroConfig, ZeroStage};

use batch::{ACCUMULATION, BatchSettings, MICRO, TRAIN, resolve_batch_sizes};
use diagnostics::{DEEPSPEED_DEFAULT, Diagnostics};
use reader::{NON_NEGATIVE, NumberRule, POSITIVE_INT, Section, Setting, check_number};

/// A fully resolved config: every value DeepSpeed would use, defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    /// The data-parallel world size the batch sizes were derived for.
    pub world_size: NonZeroU32,
    pub batch: BatchSizes,
    /// The largest global gradient norm; 0 disables clipping.
    pub gradient_clipping: f64,
    pub precision: MixedPrecision,
    /// zeroflow always needs an optimizer: without an `optimizer` section this is
    /// [`AdamConfig::DEEPSPEED_DEFAULT`].
    pub optimizer: AdamConfig,
    /// `None`: the learning rate stays the optimizer's `lr`.
    pub scheduler: Option<Scheduler>,
    pub zero: ZeroConfig,
    /// Print progress every this many steps; `None` (DeepSpeed's default) never.
    pub steps_per_print: Option<u64>,
    pub wall_clock_breakdown: bool,
    pub zeroflow: ZeroflowExtensions,
}

/// What the caller knows that the file does not say.
#[derive(Clone, Debug, PartialEq)]
pub struct Context {
    /// Data-parallel ranks; the batch rule multiplies by it.
    pub world_size: NonZeroU32,
    pub overrides: Overrides,
}

impl Default for Context {
    /// One rank, no overrides.
    fn default() -> Self {
        Context { world_size: NonZeroU32::MIN, overrides: Overrides::default() }
    }
}

/// A resolved config with what the caller should tell the user about it.
#[derive(Clone, Debug, PartialEq)]
pub struct Resolved {
    pub config: Config,
    /// One per key that has no effect and one per value used differently from how it is
    /// written, section by section.
    pub warnings: Vec<Warning>,
    /// Every `"auto"` of the file and what it became.
    pub auto_values: Vec<AutoValue>,
}

/// Reads, resolves and validates the config file at `path`.
pub fn resolve_file(path: &Path, context: &Context) -> Result<Resolved, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|error| ConfigError::Unreadable { file: path.to_owned(), error })?;
    resolve_str(&text, context)
}

/// Resolves and validates a config given as JSON text.
pub fn resolve_str(text: &str, context: &Context) -> Result<Resolved, ConfigError> {
    let entries = reader::parse_document(text)?;
    let mut root = Section::new(String::new(), &entries);
    let mut diagnostics = Diagnostics::default();
    let config = read_config(&mut root, context, &mut diagnostics)?;
    root.finish(known_keys::TOP_LEVEL, &mut diagnostics);
    Ok(Resolved { config, warnings: diagnostics.warnings, auto_values: diagnostics.auto_values })
}

fn read_config(
    root: &mut Section<'_>,
    context: &Context,
    diagnostics: &mut Diagnostics,
) -> Result<Config, ConfigError> {
    let overrides = &context.overrides;
    let batch_settings = BatchSettings {
        train: root.integer(TRAIN, POSITIVE_INT)?,
        micro: root.integer(MICRO, POSITIVE_INT)?,
        accumulation: root.integer(ACCUMULATION, POSITIVE_INT)?,
    };
    let gradient_clipping = read_gradient_clipping(root, overrides, diagnostics)?;
    let precision = precision::read_precision(root, overrides, diagnostics)?;
    let optimizer = optimizer::read_optimizer(root, overrides, diagnostics)?;
    let scheduler = scheduler::read_scheduler(root, optimizer.lr, overrides, diagnostics)?;
    let zero = zero::read_zero(root, overrides, diagnostics)?;
    let steps_per_print = read_steps_per_print(root, diagnostics)?;
    let wall_clock_breakdown =
        root.bool("wall_clock_breakdown")?.or_default("wall_clock_breakdown", false, diagnostics);
    let zeroflow = extensions::read_extensions(root, diagnostics)?;
    let batch = resolve_batch_sizes(batch_settings, context.world_size, overrides, diagnostics)?;
    Ok(Config {
        world_size: context.world_size,
        batch,
        gradient_clipping,
        precision,
        optimizer,
        scheduler,
        zero,
        steps_per_print,
        wall_clock_breakdown,
        zeroflow,
    })
}

/// DeepSpeed's default is 1.0 since PR #8068 (`GRADIENT_CLIPPING_DEFAULT` in
/// `runtime/constants.py`); Hugging Face fills `"auto"` from `max_grad_norm`, also 1.0 by default.
fn read_gradient_clipping(
    root: &mut Section<'_>,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<f64, ConfigError> {
    const CLIPPING: NumberRule =
        NumberRule { expected: "a non-negative number (0 disables clipping)", ..NON_NEGATIVE };
    const KEY: &str = "gradient_clipping";
    let replacement =
        overrides.gradient_clipping.map(|value| check_number(KEY, value, CLIPPING)).transpose()?;
    Ok(root.number(KEY, CLIPPING)?.or_override(KEY, 1.0, replacement, diagnostics))
}

/// DeepSpeed's default is `None` (never print) since PR #6602.
fn read_steps_per_print(
    root: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<Option<u64>, ConfigError> {
    const KEY: &str = "steps_per_print";
    Ok(match root.integer(KEY, POSITIVE_INT)? {
        Setting::Given(steps) => Some(steps),
        Setting::Absent => None,
        Setting::Auto => {
            diagnostics.auto(KEY, Value::Null, AutoSource::Default(DEEPSPEED_DEFAULT));
            None
        }
    })
}
