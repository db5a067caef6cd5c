//! The batch sizes and DeepSpeed's rule that ties them together:
//!
//! ```text
//! train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world size
//! ```
//!
//! As in DeepSpeed's `_set_batch_related_parameters` and `_batch_assertion`: all three given must
//! agree; any two given fix the third; `train_batch_size` alone means one accumulation step and a
//! micro batch of `train_batch_size / world size`; the micro batch alone means one accumulation
//! step; anything less is an error. Where DeepSpeed floor-divides and then fails its assertion,
//! this module checks divisibility first and says which product does not divide.

use std::num::NonZeroU32;

use super::diagnostics::{AutoSource, Diagnostics};
use super::error::ConfigError;
use super::overrides::Overrides;
use super::reader::Setting;

pub(crate) const TRAIN: &str = "train_batch_size";
pub(crate) const MICRO: &str = "train_micro_batch_size_per_gpu";
pub(crate) const ACCUMULATION: &str = "gradient_accumulation_steps";

/// The three batch sizes, consistent with one another for the world size they were derived for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchSizes {
    /// Samples per optimizer step over all ranks (`train_batch_size`).
    pub train_batch_size: u64,
    /// Samples per forward/backward on one rank (`train_micro_batch_size_per_gpu`).
    pub micro_batch_size_per_gpu: u64,
    /// Micro-steps per optimizer step (`gradient_accumulation_steps`).
    pub gradient_accumulation_steps: u64,
}

/// Applies DeepSpeed's rule to the batch sizes a config gives (`None` where absent).
///
/// Every given value must be positive. The error names the key that cannot be made consistent.
pub fn derive_batch_sizes(
    train: Option<u64>,
    micro: Option<u64>,
    accumulation: Option<u64>,
    world_size: NonZeroU32,
) -> Result<BatchSizes, ConfigError> {
    for (key, value) in [(TRAIN, train), (MICRO, micro), (ACCUMULATION, accumulation)] {
        if value == Some(0) {
            return Err(ConfigError::bad_value(key, "a positive integer", "0"));
        }
    }
    let world = u64::from(world_size.get());
    let sizes = |train, micro, accumulation| BatchSizes {
        train_batch_size: train,
        micro_batch_size_per_gpu: micro,
        gradient_accumulation_steps: accumulation,
    };
    match (train, micro, accumulation) {
        (Some(train), Some(micro), Some(accumulation)) => {
            check_product(train, micro, accumulation, world)?;
            Ok(sizes(train, micro, accumulation))
        }
        (Some(train), Some(micro), None) => {
            let accumulation = divide(train, micro, world, MICRO, ACCUMULATION)?;
            Ok(sizes(train, micro, accumulation))
        }
        (Some(train), None, Some(accumulation)) => {
            let micro = divide(train, accumulation, world, ACCUMULATION, MICRO)?;
            Ok(sizes(train, micro, accumulation))
        }
        (None, Some(micro), accumulation) => {
            let accumulation = accumulation.unwrap_or(1);
            let train = product(micro, accumulation, world).ok_or_else(|| {
                ConfigError::conflict(
                    MICRO,
                    format!(
                        "{micro} × {ACCUMULATION} ({accumulation}) × world size ({world}) is \
                         more than 2^64"
                    ),
                )
            })?;
            Ok(sizes(train, micro, accumulation))
        }
        (Some(train), None, None) => match train.is_multiple_of(world) {
            true => Ok(sizes(train, train / world, 1)),
            false => Err(ConfigError::conflict(
                TRAIN,
                format!(
                    "{train} is not a multiple of the world size ({world}), so {MICRO} cannot be \
                     derived ({ACCUMULATION} is 1 when not given)"
                ),
            )),
        },
        (None, None, _) => Err(ConfigError::missing(
            TRAIN,
            format!("neither {TRAIN} nor {MICRO} is given; DeepSpeed needs at least one of them"),
        )),
    }
}

fn product(micro: u64, accumulation: u64, world: u64) -> Option<u64> {
    micro.checked_mul(accumulation)?.checked_mul(world)
}

fn check_product(train: u64, micro: u64, accumulation: u64, world: u64) -> Result<(), ConfigError> {
    let expected = product(micro, accumulation, world);
    if expected == Some(train) {
        return Ok(());
    }
    let expected = expected.map_or_else(|| "more than 2^64".to_owned(), |value| value.to_string());
    Err(ConfigError::conflict(
        TRAIN,
        format!(
            "{train} is not {MICRO} ({micro}) × {ACCUMULATION} ({accumulation}) × world size \
             ({world}) = {expected}"
        ),
    ))
}

/// `train / (given × world)`, which must be a whole positive number.
fn divide(
    train: u64,
    given: u64,
    world: u64,
    given_key: &str,
    derived_key: &str,
) -> Result<u64, ConfigError> {
    let divisor = given.checked_mul(world).filter(|divisor| train.is_multiple_of(*divisor));
    divisor.map(|divisor| train / divisor).ok_or_else(|| {
        ConfigError::conflict(
            TRAIN,
            format!(
                "{train} is not a multiple of {given_key} ({given}) × world size ({world}), so \
                 {derived_key} cannot be derived"
            ),
        )
    })
}

/// What the config says about the three batch sizes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BatchSettings {
    pub train: Setting<u64>,
    pub micro: Setting<u64>,
    pub accumulation: Setting<u64>,
}

/// The micro batch an `"auto"` gets when nothing else fixes it.
const DEFAULT_MICRO_BATCH: u64 = 1;

/// Fills the `"auto"` batch sizes and applies the rule.
///
/// An `"auto"` is derived from the other two when two are given. Otherwise the caller's overrides
/// fill the `"auto"` micro batch and accumulation steps; then, if neither `train_batch_size` nor
/// the micro batch is known yet, an `"auto"` micro batch becomes 1; the rule derives the rest.
pub(crate) fn resolve_batch_sizes(
    settings: BatchSettings,
    world_size: NonZeroU32,
    overrides: &Overrides,
    diagnostics: &mut Diagnostics,
) -> Result<BatchSizes, ConfigError> {
    let train = settings.train.given();
    let mut micro = settings.micro.given();
    let mut accumulation = settings.accumulation.given();
    let given_count = [train, micro, accumulation].iter().flatten().count();
    if given_count < 2 {
        if settings.micro.is_auto() {
            micro = overrides.micro_batch_size_per_gpu.map(|value| value.get());
            record_override(MICRO, micro, diagnostics);
        }
        if settings.accumulation.is_auto() {
            accumulation = overrides.gradient_accumulation_steps.map(|value| value.get());
            record_override(ACCUMULATION, accumulation, diagnostics);
        }
    }
    if train.is_none() && micro.is_none() && settings.micro.is_auto() {
        micro = Some(DEFAULT_MICRO_BATCH);
        let source = AutoSource::Default("zeroflow's default when nothing else fixes it");
        diagnostics.auto(MICRO, DEFAULT_MICRO_BATCH, source);
    }
    let sizes = derive_batch_sizes(train, micro, accumulation, world_size)?;
    let derived = [
        (
            TRAIN,
            settings.train,
            train,
            sizes.train_batch_size,
            "micro batch × accumulation × world",
        ),
        (
            MICRO,
            settings.micro,
            micro,
            sizes.micro_batch_size_per_gpu,
            "train batch ÷ (accumulation × world)",
        ),
        (
            ACCUMULATION,
            settings.accumulation,
            accumulation,
            sizes.gradient_accumulation_steps,
            "train batch ÷ (micro batch × world)",
        ),
    ];
    for (key, setting, known, value, formula) in derived {
        if setting.is_auto() && known.is_none() {
            diagnostics.auto(key, value, AutoSource::Derived(formula));
        }
    }
    Ok(sizes)
}

fn record_override(key: &str, value: Option<u64>, diagnostics: &mut Diagnostics) {
    if let Some(value) = value {
        diagnostics.auto(key, value, AutoSource::Override);
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;

    use super::*;

    fn world(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).expect("test world sizes are positive")
    }

    #[test]
    fn the_mismatch_message_shows_the_whole_product() {
        let error = derive_batch_sizes(Some(32), Some(3), Some(2), world(4)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "train_batch_size: 32 is not train_micro_batch_size_per_gpu (3) × \
             gradient_accumulation_steps (2) × world size (4) = 24"
        );
    }

    #[test]
    fn train_batch_alone_means_one_accumulation_step() {
        let sizes = derive_batch_sizes(Some(32), None, None, world(4)).unwrap();
        assert_eq!((sizes.micro_batch_size_per_gpu, sizes.gradient_accumulation_steps), (8, 1));
        assert!(derive_batch_sizes(Some(30), None, None, world(4)).is_err());
    }

    #[test]
    fn micro_batch_alone_means_one_accumulation_step() {
        let sizes = derive_batch_sizes(None, Some(4), None, world(2)).unwrap();
        assert_eq!((sizes.train_batch_size, sizes.gradient_accumulation_steps), (8, 1));
    }

    #[test]
    fn accumulation_alone_is_not_enough() {
        let error = derive_batch_sizes(None, None, Some(4), world(1)).unwrap_err();
        assert_eq!(error.path(), Some(TRAIN));
    }

    #[test]
    fn a_train_batch_smaller_than_one_micro_step_is_rejected() {
        // DeepSpeed would derive 0 accumulation steps and then fail its assertion.
        assert!(derive_batch_sizes(Some(4), Some(4), None, world(2)).is_err());
    }

    #[test]
    fn all_auto_takes_overrides_and_derives_the_train_batch() {
        let settings = BatchSettings {
            train: Setting::Auto,
            micro: Setting::Auto,
            accumulation: Setting::Auto,
        };
        let overrides = Overrides {
            micro_batch_size_per_gpu: NonZeroU64::new(4),
            gradient_accumulation_steps: NonZeroU64::new(2),
            ..Overrides::default()
        };
        let mut diagnostics = Diagnostics::default();
        let sizes = resolve_batch_sizes(settings, world(2), &overrides, &mut diagnostics).unwrap();
        assert_eq!(sizes.train_batch_size, 16);
        let sources: Vec<_> = diagnostics.auto_values.iter().map(|a| a.source).collect();
        assert!(matches!(
            sources[..],
            [AutoSource::Override, AutoSource::Override, AutoSource::Derived(_)]
        ));
    }

    #[test]
    fn an_auto_that_two_given_values_fix_is_derived_even_with_an_override() {
        let settings = BatchSettings {
            train: Setting::Given(64),
            micro: Setting::Auto,
            accumulation: Setting::Given(4),
        };
        let overrides =
            Overrides { micro_batch_size_per_gpu: NonZeroU64::new(3), ..Overrides::default() };
        let mut diagnostics = Diagnostics::default();
        let sizes = resolve_batch_sizes(settings, world(2), &overrides, &mut diagnostics).unwrap();
        assert_eq!(sizes.micro_batch_size_per_gpu, 8);
    }

    #[test]
    fn all_auto_without_overrides_is_one_sample_per_rank() {
        let settings = BatchSettings {
            train: Setting::Auto,
            micro: Setting::Auto,
            accumulation: Setting::Auto,
        };
        let mut diagnostics = Diagnostics::default();
        let sizes =
            resolve_batch_sizes(settings, world(8), &Overrides::default(), &mut diagnostics)
                .unwrap();
        assert_eq!(
            sizes,
            BatchSizes {
                train_batch_size: 8,
                micro_batch_size_per_gpu: 1,
                gradient_accumulation_steps: 1
            }
        );
    }
}
