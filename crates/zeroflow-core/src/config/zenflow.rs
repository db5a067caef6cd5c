//! The `zero_optimization.zenflow` section.
//!
//! Keys and defaults from DeepSpeed's `runtime/zenflow/zenflow_config.py`: `topk_ratio` 0.1,
//! `select_strategy` "auto", `select_interval` "auto", `update_interval` "auto", `overlap_step`
//! false, `offload` false, `auto_ratio` 0.99, `full_warm_up_rounds` 0, `pt_reserved_cores_perc`
//! 0.5. The checks DeepSpeed makes later, when the engine starts (`runtime/zenflow/engine.py`,
//! `zenflow_stage_1_and_2.py`), are made here: the auto strategy takes only an "auto"
//! `select_interval` and the other strategies only a number; with the step strategy a fixed
//! `select_interval` is at least a fixed `update_interval`. The checks that involve other sections
//! (CPU offload required, `offload` needs `overlap_comm`) are in `zero.rs`.

use super::diagnostics::Diagnostics;
use super::error::ConfigError;
use super::known_keys;
use super::reader::{FRACTION, IntRule, NON_NEGATIVE_INT, Section, Setting};

/// ZenFlow's settings.
///
/// Note for the engine: DeepSpeed makes `update_interval` the gradient accumulation boundary when
/// ZenFlow is on (`engine._config.gradient_accumulation_steps = update_interval`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZenFlowConfig {
    /// The fraction of each weight's columns that is updated on the device every step.
    pub topk_ratio: f64,
    /// When the important columns are selected again.
    pub selection: Selection,
    /// How often the other columns are updated on the host.
    pub update_interval: UpdateInterval,
    /// Run the host update concurrently with the next steps.
    pub overlap_step: bool,
    /// Keep the selected columns' optimizer state in host memory too.
    pub offload: bool,
    /// The threshold of the automatic update interval.
    pub auto_ratio: f64,
    /// Steps at the start that update everything.
    pub full_warm_up_rounds: u64,
    /// The fraction of host cores left to the framework's own threads.
    pub pt_reserved_cores_perc: f64,
}

/// `select_strategy` with its `select_interval`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// `"auto"` and `"auto"`: DeepSpeed reselects once per epoch.
    Auto,
    /// Reselect every `interval` steps.
    Step { interval: u64 },
    /// Reselect every `interval` epochs.
    Epoch { interval: u64 },
}

/// `update_interval`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateInterval {
    /// Update when the accumulated gradients call for it (DeepSpeed's `"auto"`).
    Auto,
    /// Update every this many steps.
    Every(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    Auto,
    Step,
    Epoch,
}

const AUTO_OR_STEPS: IntRule =
    IntRule { expected: "\"auto\" or a positive integer", min: 1, max: u64::MAX };

const STRATEGIES: [(&str, Strategy); 3] =
    [("auto", Strategy::Auto), ("step", Strategy::Step), ("epoch", Strategy::Epoch)];

/// Reads `zenflow` under `zero_optimization`, if present.
pub(crate) fn read_zenflow(
    zero: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<Option<ZenFlowConfig>, ConfigError> {
    let Some(mut section) = zero.section("zenflow")? else { return Ok(None) };
    let path = |key: &str| format!("zero_optimization.zenflow.{key}");
    let topk_ratio =
        section.number("topk_ratio", FRACTION)?.or_default(&path("topk_ratio"), 0.1, diagnostics);
    let selection = read_selection(&mut section)?;
    let update_interval = match section.integer("update_interval", AUTO_OR_STEPS)? {
        Setting::Given(steps) => UpdateInterval::Every(steps),
        Setting::Absent | Setting::Auto => UpdateInterval::Auto,
    };
    check_intervals(selection, update_interval)?;
    let config =
        ZenFlowConfig {
            topk_ratio,
            selection,
            update_interval,
            overlap_step: section.bool("overlap_step")?.or_default(
                &path("overlap_step"),
                false,
                diagnostics,
            ),
            offload: section.bool("offload")?.or_default(&path("offload"), false, diagnostics),
            auto_ratio: section.number("auto_ratio", FRACTION)?.or_default(
                &path("auto_ratio"),
                0.99,
                diagnostics,
            ),
            full_warm_up_rounds: section
                .integer("full_warm_up_rounds", NON_NEGATIVE_INT)?
                .or_default(&path("full_warm_up_rounds"), 0, diagnostics),
            pt_reserved_cores_perc: section.number("pt_reserved_cores_perc", FRACTION)?.or_default(
                &path("pt_reserved_cores_perc"),
                0.5,
                diagnostics,
            ),
        };
    section.finish_strict(known_keys::ZENFLOW, diagnostics)?;
    Ok(Some(config))
}

fn read_selection(section: &mut Section<'_>) -> Result<Selection, ConfigError> {
    let expected = "\"auto\", \"step\" or \"epoch\"";
    let strategy = match section.choice("select_strategy", &STRATEGIES, expected)? {
        Setting::Given(strategy) => strategy,
        Setting::Absent | Setting::Auto => Strategy::Auto,
    };
    let interval_path = section.path_of("select_interval");
    let interval = section.integer("select_interval", AUTO_OR_STEPS)?.given();
    match (strategy, interval) {
        (Strategy::Auto, None) => Ok(Selection::Auto),
        (Strategy::Step, Some(interval)) => Ok(Selection::Step { interval }),
        (Strategy::Epoch, Some(interval)) => Ok(Selection::Epoch { interval }),
        (Strategy::Auto, Some(interval)) => Err(ConfigError::conflict(
            interval_path,
            format!(
                "{interval} cannot be used with select_strategy \"auto\", which reselects once per \
                 epoch (DeepSpeed rejects this too); write \"auto\", or choose the \"step\" or \
                 \"epoch\" strategy"
            ),
        )),
        (Strategy::Step | Strategy::Epoch, None) => Err(ConfigError::conflict(
            interval_path,
            "select_strategy \"step\" and \"epoch\" need a number of steps or epochs here; \"auto\" \
             goes only with select_strategy \"auto\"",
        )),
    }
}

/// DeepSpeed's "Select interval must be greater or equal to update interval", checked where both
/// are counted in steps. An epoch interval is checked by the trainer, which knows the epoch length.
fn check_intervals(selection: Selection, update: UpdateInterval) -> Result<(), ConfigError> {
    match (selection, update) {
        (Selection::Step { interval }, UpdateInterval::Every(update)) if interval < update => {
            Err(ConfigError::conflict(
                "zero_optimization.zenflow.select_interval",
                format!(
                    "{interval} is less than update_interval ({update}); DeepSpeed requires \
                     select_interval ≥ update_interval"
                ),
            ))
        }
        _ => Ok(()),
    }
}
