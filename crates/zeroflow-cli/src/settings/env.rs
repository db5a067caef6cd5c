//! The `ZEROFLOW_*` variables of the run-time settings, read once per process
//! ([`from_process`]; what each means and accepts: [`zeroflow_train::settings::env`]), a bad value
//! an [`InputError`] naming the variable and what it accepts.

use std::sync::OnceLock;

use zeroflow_core::env;
use zeroflow_train::settings::env::{KERNEL_CACHE_VAR, from_lookup};

use super::Requested;
use crate::InputError;

/// What this process's environment asks for, read the first time it is asked.
pub fn from_process() -> anyhow::Result<Requested> {
    static READ: OnceLock<Result<Requested, String>> = OnceLock::new();
    READ.get_or_init(|| from_lookup(env::var)).clone().map_err(InputError::from_display)
}

/// The folder `ZEROFLOW_KERNEL_CACHE` names, if it is set and not blank.
pub fn kernel_cache() -> Option<std::path::PathBuf> {
    env::var(KERNEL_CACHE_VAR).filter(|dir| !dir.trim().is_empty()).map(Into::into)
}
