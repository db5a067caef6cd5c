//! Integration tests of `zeroflow_core::config`, compiled as one test binary.
//!
//! Fixtures under `tests/configs/` are DeepSpeed configs of the kinds people publish; each test
//! asserts the values DeepSpeed would use for them.

mod autos;
mod batch_rule;
mod errors;
mod fuzz;
mod realistic;
mod round_trip;
mod warnings;
mod zeroflow_section;

use std::{num::NonZeroU32, path::PathBuf};

use zeroflow_core::config::{self, ConfigError, Context, Overrides, Resolved};

/// Every fixture under `tests/configs/`.
const FIXTURES: &[&str] = &[
    "bert_squad_fp16_zero2.json",
    "bf16_zero2_cpu_offload.json",
    "fp16_static_loss_scale.json",
    "fp16_zero1_megatron.json",
    "hf_ds_config_zero2.json",
    "legacy_cpu_offload.json",
    "legacy_zero_flag_bfloat16.json",
    "stage3_keys_at_stage2.json",
    "warmup_decay_fp16.json",
    "zenflow_finetune.json",
    "zenflow_step_strategy.json",
];

fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/configs").join(name)
}

fn context(world_size: u32, overrides: Overrides) -> Context {
    let world_size = NonZeroU32::new(world_size).expect("test world sizes are positive");
    Context { world_size, overrides }
}

/// Resolves a fixture with no overrides.
fn fixture(name: &str, world_size: u32) -> Resolved {
    fixture_with(name, world_size, Overrides::default())
}

fn fixture_with(name: &str, world_size: u32, overrides: Overrides) -> Resolved {
    let path = fixture_path(name);
    config::resolve_file(&path, &context(world_size, overrides))
        .unwrap_or_else(|error| panic!("{name} should resolve: {error}"))
}

/// Resolves JSON text on one rank.
fn resolve(text: &str) -> Result<Resolved, ConfigError> {
    config::resolve_str(text, &Context::default())
}

/// The error for JSON text on one rank.
fn error_of(text: &str) -> ConfigError {
    match resolve(text) {
        Ok(resolved) => panic!("expected an error for {text}, got {:?}", resolved.config),
        Err(error) => error,
    }
}

/// The paths of the warnings for JSON text on one rank.
fn warning_paths(text: &str) -> Vec<String> {
    let resolved = resolve(text).unwrap_or_else(|error| panic!("{text} should resolve: {error}"));
    resolved.warnings.into_iter().map(|warning| warning.path).collect()
}
