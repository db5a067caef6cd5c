//! `"auto"` values: derived where the config fixes them, else the caller's override, else a
//! documented default; each one is reported with what it became.

use std::num::NonZeroU64;

use serde_json::json;
use zeroflow_core::config::{self, AutoSource, Overrides, Precision};

use super::{context, resolve};

#[test]
fn an_auto_train_batch_is_derived_and_reported() {
    let text = r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                   "gradient_accumulation_steps": 2}"#;
    let resolved = config::resolve_str(text, &context(3, Overrides::default())).expect("valid");
    assert_eq!(resolved.config.batch.train_batch_size, 24);
    let [auto] = &resolved.auto_values[..] else {
        panic!("one auto value, got {:?}", resolved.auto_values)
    };
    assert_eq!((auto.path.as_str(), &auto.value), ("train_batch_size", &json!(24)));
    assert!(matches!(auto.source, AutoSource::Derived(_)));
}

#[test]
fn an_override_never_replaces_a_value_written_in_the_file() {
    let text = r#"{"train_batch_size": 8, "gradient_clipping": 0.3,
                   "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "fp16": {"enabled": false}}"#;
    let overrides = Overrides {
        lr: Some(1e-5),
        gradient_clipping: Some(2.0),
        precision: Some(Precision::Fp16),
        micro_batch_size_per_gpu: NonZeroU64::new(2),
        ..Overrides::default()
    };
    let resolved = config::resolve_str(text, &context(1, overrides)).expect("valid");
    assert_eq!(resolved.config.optimizer.lr, 0.01);
    assert_eq!(resolved.config.gradient_clipping, 0.3);
    assert_eq!(resolved.config.precision.precision(), Precision::Fp32);
    assert_eq!(resolved.config.batch.micro_batch_size_per_gpu, 8);
    assert!(resolved.auto_values.is_empty());
}

#[test]
fn auto_inside_a_deepspeed_section_means_deepspeeds_default() {
    // DeepSpeed's config models drop "auto" entries, which leaves their defaults.
    let resolved = resolve(
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "overlap_comm": "auto",
            "allgather_bucket_size": "auto"}}"#,
    )
    .expect("valid");
    assert!(!resolved.config.zero.overlap_comm);
    assert_eq!(resolved.config.zero.allgather_bucket_size, 500_000_000);
    assert!(resolved.auto_values.iter().all(|auto| matches!(auto.source, AutoSource::Default(_))));
    assert_eq!(resolved.auto_values.len(), 2);
}

#[test]
fn an_auto_total_num_steps_takes_the_override() {
    let text = r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR",
                   "params": {"total_num_steps": "auto", "warmup_num_steps": "auto"}}}"#;
    let overrides = Overrides {
        total_num_steps: NonZeroU64::new(5000),
        warmup_num_steps: NonZeroU64::new(50),
        ..Overrides::default()
    };
    let resolved = config::resolve_str(text, &context(1, overrides)).expect("valid");
    let Some(config::Scheduler::WarmupDecayLr { warmup, total_num_steps }) =
        resolved.config.scheduler
    else {
        panic!("expected WarmupDecayLR")
    };
    assert_eq!((warmup.num_steps, total_num_steps), (50, 5000));
}

#[test]
fn auto_values_display_what_they_became_and_why() {
    let resolved = resolve(r#"{"train_micro_batch_size_per_gpu": 2, "gradient_clipping": "auto"}"#)
        .expect("valid");
    let lines: Vec<_> = resolved.auto_values.iter().map(ToString::to_string).collect();
    assert_eq!(lines, ["gradient_clipping: \"auto\" became 1.0 (DeepSpeed's default)"]);
}

#[test]
fn an_auto_without_a_derivation_or_override_is_reported_as_a_default() {
    let resolved = resolve(r#"{"train_batch_size": 8, "steps_per_print": "auto"}"#).expect("valid");
    assert_eq!(resolved.config.steps_per_print, None, "DeepSpeed's default: never print");
    let [auto] = &resolved.auto_values[..] else {
        panic!("one auto value, got {:?}", resolved.auto_values)
    };
    assert_eq!(auto.path, "steps_per_print");
    assert!(matches!(auto.source, AutoSource::Default(_)));
}
