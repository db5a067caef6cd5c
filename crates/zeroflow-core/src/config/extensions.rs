//! The top-level `zeroflow` section: settings of zeroflow's own that DeepSpeed does not have.
//! DeepSpeed ignores top-level keys it does not know, so a config with this section still runs
//! under DeepSpeed, without these features.
//!
//! ```json
//! "zeroflow": { "delayed_update": { "enabled": true, "warmup_steps": 10 } }
//! ```

use super::diagnostics::Diagnostics;
use super::error::ConfigError;
use super::reader::{NON_NEGATIVE_INT, Section};

/// zeroflow's own settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ZeroflowExtensions {
    pub delayed_update: DelayedUpdate,
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

/// Reads the `zeroflow` section, if any.
pub(crate) fn read_extensions(
    root: &mut Section<'_>,
    diagnostics: &mut Diagnostics,
) -> Result<ZeroflowExtensions, ConfigError> {
    let Some(mut section) = root.section("zeroflow")? else {
        return Ok(ZeroflowExtensions::default());
    };
    let delayed_update = match section.section("delayed_update")? {
        Some(mut delayed) => {
            let defaults = DelayedUpdate::default();
            let enabled_path = delayed.path_of("enabled");
            let warmup_path = delayed.path_of("warmup_steps");
            let enabled =
                delayed.bool("enabled")?.or_default(&enabled_path, defaults.enabled, diagnostics);
            let warmup_steps = delayed.integer("warmup_steps", NON_NEGATIVE_INT)?.or_default(
                &warmup_path,
                defaults.warmup_steps,
                diagnostics,
            );
            delayed.finish(&[], diagnostics);
            DelayedUpdate { enabled, warmup_steps }
        }
        None => DelayedUpdate::default(),
    };
    section.finish(&[], diagnostics);
    Ok(ZeroflowExtensions { delayed_update })
}
