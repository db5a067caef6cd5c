//! The `scheduler` section: DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, with the
//! parameter names and defaults of `runtime/lr_schedules.py`:
//!
//! - WarmupLR: `warmup_min_lr` 0, `warmup_max_lr` the optimizer's lr, `warmup_num_steps` 1000,
//!   `warmup_type` "log".
//! - WarmupDecayLR: the same but `warmup_max_lr` 0.001, plus `total_num_steps` (required).
//! - WarmupCosineLR: `warmup_min_ratio` 0, `warmup_num_steps` 1000, `cos_min_ratio` 0.0001,
//!   `warmup_type` "log", `total_num_steps` (required); it scales the optimizer's lr.
//!
//! DeepSpeed raises `warmup_num_steps` to at least 2 and falls back to "log" for an unknown
//! `warmup_type`; both are reproduced here, with a warning.

use serde_json::Map;

use super::diagnostics::{AutoSource, DEEPSPEED_DEFAULT, Diagnostics};
use super::error::ConfigError;
use super::known_keys::{self, IgnoredKey};
use super::overrides::Overrides;
use super::reader::{FRACTION, NON_NEGATIVE, POSITIVE_INT, Section, Setting, quote};

/// A learning-rate schedule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scheduler {
    /// Warm up from `min_lr` to `max_lr`, then stay at `max_lr`.
    WarmupLr(Warmup),
    /// Warm up, then decay linearly to 0 at `total_num_steps`.
    WarmupDecayLr { warmup: Warmup, total_num_steps: u64 },
    /// Warm up the lr ratio, then follow a cosine down to `cos_min_ratio`.
    WarmupCosineLr(CosineSchedule),
}

impl Scheduler {
    /// DeepSpeed's name for the schedule.
    pub const fn type_name(&self) -> &'static str {
        match self {
            Scheduler::WarmupLr(_) => "WarmupLR",
            Scheduler::WarmupDecayLr { .. } => "WarmupDecayLR",
            Scheduler::WarmupCosineLr(_) => "WarmupCosineLR",
        }
    }
}

/// The warm-up of WarmupLR and WarmupDecayLR.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Warmup {
    pub min_lr: f64,
    pub max_lr: f64,
    /// At least 2, as DeepSpeed makes it.
    pub num_steps: u64,
    pub curve: WarmupCurve,
}

/// How the warm-up rises from its start to its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmupCurve {
    /// `log(step + 1) / log(warmup_num_steps)`.
    Log,
    /// `step / warmup_num_steps`.
    Linear,
}

impl WarmupCurve {
    pub const fn name(self) -> &'static str {
        match self {
            WarmupCurve::Log => "log",
            WarmupCurve::Linear => "linear",
        }
    }
}

/// WarmupCosineLR: ratios of the optimizer's lr.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineSchedule {
    pub warmup_min_ratio: f64,
    /// At least 2, as DeepSpeed makes it.
    pub warmup_num_steps: u64,
    pub cos_min_ratio: f64,
    pub warmup_curve: WarmupCurve,
    pub total_num_steps: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// WarmupLR
    Constant,
    /// WarmupDecayLR
    LinearDecay,
    /// WarmupCosineLR
    CosineDecay,
}

const KINDS: [(&str, Kind); 3] = [
    ("WarmupLR", Kind::Constant),
    ("WarmupDecayLR", Kind::LinearDecay),
    ("WarmupCosineLR", Kind::CosineDecay),
];

/// Reads the `scheduler` section, if any; `optimizer_lr` is the resolved optimizer lr.
pub(crate) fn read_scheduler(
    root: &mut Section<'_>,
    optimizer_lr: f64,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<Option<Scheduler>, ConfigError> {
    let Some(mut section) = root.section("scheduler")? else { return Ok(None) };
    let kind = read_kind(&mut section)?;
    let no_params = Map::new();
    let mut params = match section.section("params")? {
        Some(params) => params,
        None => Section::new(section.path_of("params"), &no_params),
    };
    let mut reader = ParamsReader { params: &mut params, overrides, diagnostics };
    let (scheduler, ignored): (Scheduler, &[IgnoredKey]) = match kind {
        Kind::Constant => (
            Scheduler::WarmupLr(reader.warmup(optimizer_lr, MaxLrDefault::OptimizerLr)?),
            known_keys::WARMUP_LR_PARAMS,
        ),
        Kind::LinearDecay => {
            let warmup = reader.warmup(optimizer_lr, MaxLrDefault::Fixed(0.001))?;
            let total_num_steps = reader.total_num_steps("WarmupDecayLR", warmup.num_steps)?;
            (
                Scheduler::WarmupDecayLr { warmup, total_num_steps },
                known_keys::WARMUP_DECAY_LR_PARAMS,
            )
        }
        Kind::CosineDecay => {
            (Scheduler::WarmupCosineLr(reader.cosine()?), known_keys::WARMUP_COSINE_LR_PARAMS)
        }
    };
    params.finish(ignored, diagnostics);
    section.finish(&[], diagnostics);
    Ok(Some(scheduler))
}

fn read_kind(section: &mut Section<'_>) -> Result<Kind, ConfigError> {
    const EXPECTED: &str = "\"WarmupLR\", \"WarmupDecayLR\" or \"WarmupCosineLR\"";
    let path = section.path_of("type");
    let Some(name) = section.string("type")? else {
        return Err(ConfigError::missing(path, format!("no scheduler type; expected {EXPECTED}")));
    };
    if let Some(&(_, kind)) = KINDS.iter().find(|(known, _)| *known == name) {
        return Ok(kind);
    }
    let why = match KINDS.iter().find(|(known, _)| known.eq_ignore_ascii_case(name)) {
        Some((known, _)) => {
            format!("scheduler names are case-sensitive in DeepSpeed: write \"{known}\"")
        }
        None => "zeroflow implements these three DeepSpeed schedules only".to_owned(),
    };
    Err(ConfigError::unsupported(
        path,
        format!("expected {EXPECTED}, found {} ({why})", quote(name)),
    ))
}

/// Where WarmupLR and WarmupDecayLR take `warmup_max_lr` from when it is absent.
#[derive(Clone, Copy, Debug)]
enum MaxLrDefault {
    /// WarmupLR: the optimizer's lr (DeepSpeed since PR #7360).
    OptimizerLr,
    /// WarmupDecayLR: a fixed value.
    Fixed(f64),
}

struct ParamsReader<'r, 'a> {
    params: &'r mut Section<'a>,
    overrides: &'r Overrides,
    diagnostics: &'r mut Diagnostics,
}

impl ParamsReader<'_, '_> {
    fn warmup(
        &mut self,
        optimizer_lr: f64,
        max_lr_default: MaxLrDefault,
    ) -> Result<Warmup, ConfigError> {
        let min_lr_path = self.params.path_of("warmup_min_lr");
        let min_lr = self.params.number("warmup_min_lr", NON_NEGATIVE)?.or_default(
            &min_lr_path,
            0.0,
            self.diagnostics,
        );
        let max_lr_path = self.params.path_of("warmup_max_lr");
        let max_lr = match self.params.number("warmup_max_lr", NON_NEGATIVE)? {
            Setting::Given(max_lr) => max_lr,
            Setting::Auto => {
                let source = AutoSource::Derived("the optimizer's lr, as Hugging Face fills it");
                self.diagnostics.auto(max_lr_path, optimizer_lr, source);
                optimizer_lr
            }
            Setting::Absent => match max_lr_default {
                MaxLrDefault::OptimizerLr => optimizer_lr,
                MaxLrDefault::Fixed(max_lr) => max_lr,
            },
        };
        Ok(Warmup {
            min_lr,
            max_lr,
            num_steps: self.warmup_num_steps()?,
            curve: self.warmup_curve()?,
        })
    }

    fn cosine(&mut self) -> Result<CosineSchedule, ConfigError> {
        let min_ratio_path = self.params.path_of("warmup_min_ratio");
        let warmup_min_ratio = self.params.number("warmup_min_ratio", FRACTION)?.or_default(
            &min_ratio_path,
            0.0,
            self.diagnostics,
        );
        let cos_ratio_path = self.params.path_of("cos_min_ratio");
        let cos_min_ratio = self.params.number("cos_min_ratio", FRACTION)?.or_default(
            &cos_ratio_path,
            0.0001,
            self.diagnostics,
        );
        let warmup_num_steps = self.warmup_num_steps()?;
        Ok(CosineSchedule {
            warmup_min_ratio,
            warmup_num_steps,
            cos_min_ratio,
            warmup_curve: self.warmup_curve()?,
            total_num_steps: self.total_num_steps("WarmupCosineLR", warmup_num_steps)?,
        })
    }

    fn warmup_num_steps(&mut self) -> Result<u64, ConfigError> {
        let path = self.params.path_of("warmup_num_steps");
        let replacement = self.overrides.warmup_num_steps.map(|steps| steps.get());
        let steps = self.params.integer("warmup_num_steps", POSITIVE_INT)?.or_override(
            &path,
            1000,
            replacement,
            self.diagnostics,
        );
        if steps < 2 {
            let message = format!("{steps} is raised to 2, as DeepSpeed does");
            self.diagnostics.adjusted(path, message);
        }
        Ok(steps.max(2))
    }

    fn warmup_curve(&mut self) -> Result<WarmupCurve, ConfigError> {
        let path = self.params.path_of("warmup_type");
        let curve = match self.params.string("warmup_type")? {
            None => WarmupCurve::Log,
            Some("log") => WarmupCurve::Log,
            Some("linear") => WarmupCurve::Linear,
            Some("auto") => {
                self.diagnostics.auto(path, "log", AutoSource::Default(DEEPSPEED_DEFAULT));
                WarmupCurve::Log
            }
            Some(other) => {
                let message = format!(
                    "unknown warmup type {}; DeepSpeed falls back to \"log\", and so does \
                     zeroflow (expected \"log\" or \"linear\")",
                    quote(other)
                );
                self.diagnostics.adjusted(path, message);
                WarmupCurve::Log
            }
        };
        Ok(curve)
    }

    /// `total_num_steps`, which DeepSpeed requires for the decaying schedules.
    fn total_num_steps(
        &mut self,
        schedule: &str,
        warmup_num_steps: u64,
    ) -> Result<u64, ConfigError> {
        let path = self.params.path_of("total_num_steps");
        let total = match self.params.integer("total_num_steps", POSITIVE_INT)? {
            Setting::Given(total) => total,
            Setting::Auto => match self.overrides.total_num_steps {
                Some(total) => {
                    self.diagnostics.auto(&path, total.get(), AutoSource::Override);
                    total.get()
                }
                None => {
                    return Err(ConfigError::missing(
                        path,
                        "\"auto\" stands for the number of training steps, which only the trainer \
                         knows; write a positive integer to check this file on its own",
                    ));
                }
            },
            Setting::Absent => {
                return Err(ConfigError::missing(
                    path,
                    format!(
                        "{schedule} needs the number of training steps; expected a positive integer"
                    ),
                ));
            }
        };
        if total < warmup_num_steps {
            let message = format!(
                "{total} is less than warmup_num_steps ({warmup_num_steps}), so the rate drops to \
                 its floor as soon as the warm-up ends (DeepSpeed warns about this too)"
            );
            self.diagnostics.adjusted(path, message);
        }
        Ok(total)
    }
}
