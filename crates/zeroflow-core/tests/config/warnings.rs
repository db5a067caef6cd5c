//! Keys that have no effect: one warning each, with the full JSON path; an error only where
//! DeepSpeed itself refuses unknown keys (`zero_optimization` and its sections, `bf16`, `fp16`).

use zeroflow_core::config::{ConfigError, Warning, WarningKind};

use super::{resolve, warning_paths};

fn warnings_of(text: &str) -> Vec<Warning> {
    resolve(text).unwrap_or_else(|error| panic!("{text} should resolve: {error}")).warnings
}

#[test]
fn each_unknown_key_gives_one_warning_with_its_full_path() {
    let text = r#"{
        "train_batch_size": 8,
        "mystery": 1,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "flavor": "x", "params": {"lr": 1e-3, "gamma": 2}},
        "scheduler": {"type": "WarmupLR", "params": {"shape": "log"}},
        "zeroflow": {"warp": true, "delayed_update": {"enabled": false, "later": 1}}
    }"#;
    assert_eq!(
        warning_paths(text),
        [
            "optimizer.params.gamma",
            "optimizer.flavor",
            "scheduler.params.shape",
            "zeroflow.delayed_update.later",
            "zeroflow.warp",
            "mystery",
        ]
    );
}

#[test]
fn unknown_and_ignored_keys_are_told_apart() {
    let warnings = warnings_of(
        r#"{"train_batch_size": 8, "wandb": {"enabled": true}, "wand": {},
            "zero_optimization": {"stage": 2, "sub_group_size": 1e9}}"#,
    );
    let lines: Vec<_> = warnings.iter().map(ToString::to_string).collect();
    assert_eq!(
        lines,
        [
            "ignored key zero_optimization.sub_group_size (a ZeRO stage 3 setting; zeroflow \
             implements stages 0 to 2)",
            "ignored key wandb (DeepSpeed monitoring or profiling; zeroflow does not use it)",
            "unknown key wand (ignored; did you mean \"wandb\"?)",
        ]
    );
}

#[test]
fn a_misspelled_key_suggests_the_known_one_of_its_section() {
    let warnings = warnings_of(r#"{"train_batch_size": 8, "gradient_cliping": 1.0}"#);
    assert_eq!(warnings.len(), 1);
    assert_eq!(warnings[0].kind, WarningKind::UnknownKey { suggestion: Some("gradient_clipping") });
    assert_eq!(
        warnings[0].to_string(),
        "unknown key gradient_cliping (ignored; did you mean \"gradient_clipping\"?)"
    );
}

/// Regression (issue 24): DeepSpeed's `zero_optimization`, its offload and ZenFlow sections,
/// `bf16` and `fp16` are pydantic models that forbid extra keys, so a misspelling there fails
/// DeepSpeed; zeroflow refused nothing and warned. Each is an error naming the path, with the
/// known key spelled alike; a real DeepSpeed key zeroflow ignores there still only warns.
#[test]
fn unknown_keys_in_strictly_validated_sections_are_errors_as_in_deepspeed() {
    let cases = [
        (
            r#""zero_optimization": {"stage": 2, "reduce_bucket_sise": 1}"#,
            "zero_optimization.reduce_bucket_sise",
            Some("reduce_bucket_size"),
        ),
        (r#""zero_optimization": {"stage": 2, "turbo": true}"#, "zero_optimization.turbo", None),
        (
            r#""zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": true}}"#,
            "zero_optimization.offload_optimizer.pin_memroy",
            Some("pin_memory"),
        ),
        (
            r#""zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"magic": 3}}"#,
            "zero_optimization.zenflow.magic",
            None,
        ),
        (r#""bf16": {"enabled": false, "bar": 2}"#, "bf16.bar", None),
        (r#""fp16": {"enabled": false, "foo": 1}"#, "fp16.foo", None),
    ];
    for (section, path, suggestion) in cases {
        let text = format!(r#"{{"train_batch_size": 8, {section}}}"#);
        match super::resolve(&text) {
            Err(ConfigError::UnknownKey { path: got, suggestion: hint }) => {
                assert_eq!((got.as_str(), hint), (path, suggestion), "{text}");
            }
            other => panic!("{text}: expected an unknown-key error, got {other:?}"),
        }
    }
    let ignored =
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "sub_group_size": 1e9}}"#;
    assert_eq!(warning_paths(ignored), ["zero_optimization.sub_group_size"]);
}

#[test]
fn an_ignored_section_is_one_warning_however_many_keys_it_holds() {
    let text = r#"{"train_batch_size": 8,
                   "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true,
                                                "number_checkpoints": 4}}"#;
    assert_eq!(warning_paths(text), ["activation_checkpointing"]);
}

#[test]
fn the_zeroflow_section_is_accepted_without_warnings() {
    let text = r#"{"train_batch_size": 8,
                   "zeroflow": {"delayed_update": {"enabled": true, "warmup_steps": 20}}}"#;
    let resolved = resolve(text).expect("valid");
    assert!(resolved.warnings.is_empty(), "{:?}", resolved.warnings);
    let delayed = resolved.config.zeroflow.delayed_update;
    assert!(delayed.enabled);
    assert_eq!(delayed.warmup_steps, 20);
}

#[test]
fn a_scheduler_parameter_of_another_schedule_is_ignored_with_the_reason() {
    let warnings = warnings_of(
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR",
            "params": {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_max_lr": 0.01}}}"#,
    );
    assert_eq!(warnings.len(), 1);
    assert_eq!(warnings[0].path, "scheduler.params.warmup_max_lr");
    assert!(matches!(warnings[0].kind, WarningKind::IgnoredKey { .. }));
}

#[test]
fn offload_forces_contiguous_gradients_and_says_so() {
    let resolved = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "contiguous_gradients": false,
            "offload_optimizer": {"device": "cpu"}}}"#,
    )
    .expect("valid");
    assert!(resolved.config.zero.contiguous_gradients);
    assert_eq!(resolved.warnings.len(), 1);
    assert_eq!(resolved.warnings[0].path, "zero_optimization.contiguous_gradients");
    assert!(matches!(resolved.warnings[0].kind, WarningKind::Adjusted { .. }));
}

#[test]
fn adjustments_deepspeed_makes_are_reported() {
    let resolved = resolve(
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupLR",
            "params": {"warmup_num_steps": 1, "warmup_type": "cosine"}}}"#,
    )
    .expect("DeepSpeed accepts both and adjusts them");
    let paths: Vec<_> = resolved.warnings.iter().map(|w| w.path.as_str()).collect();
    assert_eq!(paths, ["scheduler.params.warmup_num_steps", "scheduler.params.warmup_type"]);
    let Some(zeroflow_core::config::Scheduler::WarmupLr(warmup)) = resolved.config.scheduler else {
        panic!("expected WarmupLR")
    };
    assert_eq!(warmup.num_steps, 2);
    assert_eq!(warmup.curve, zeroflow_core::config::WarmupCurve::Log);
}

#[test]
fn the_legacy_bfloat16_key_is_ignored_when_bf16_is_present_as_in_deepspeed() {
    let resolved = resolve(
        r#"{"train_batch_size": 8, "bf16": {"enabled": false}, "bfloat16": {"enabled": true}}"#,
    )
    .expect("valid");
    assert_eq!(resolved.config.precision, zeroflow_core::config::MixedPrecision::Fp32);
    let paths: Vec<_> = resolved.warnings.iter().map(|w| w.path.as_str()).collect();
    assert_eq!(paths, ["bfloat16"]);
}
