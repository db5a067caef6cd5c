//! Invalid configs are typed errors whose message is `<json.path>: <what was wrong and what is
//! allowed>`. (The command-line tests run a much longer list through the binary.)

use zeroflow_core::config::{self, ConfigError, ROOT};

use super::{context, error_of};

#[test]
fn stage_3_is_rejected_with_the_allowed_stages() {
    let error = error_of(r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3}}"#);
    assert!(matches!(error, ConfigError::Unsupported { .. }), "{error:?}");
    assert_eq!(
        error.to_string(),
        "zero_optimization.stage: expected 0, 1 or 2, found 3 (stage 3 is not supported)"
    );
}

#[test]
fn a_negative_bucket_size_names_the_path_and_what_is_allowed() {
    let error =
        error_of(r#"{"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": -5}}"#);
    assert_eq!(
        error.to_string(),
        "zero_optimization.reduce_bucket_size: expected a positive integer, found -5"
    );
}

#[test]
fn contradictory_batch_sizes_show_the_product() {
    let text = r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3,
                   "gradient_accumulation_steps": 2}"#;
    let four_ranks = context(4, Default::default());
    let error = config::resolve_str(text, &four_ranks).expect_err("32 ≠ 3 × 2 × 4");
    assert_eq!(
        error.to_string(),
        "train_batch_size: 32 is not train_micro_batch_size_per_gpu (3) × \
         gradient_accumulation_steps (2) × world size (4) = 24"
    );
}

#[test]
fn wrong_types_name_the_expected_type_and_what_was_found() {
    let error = error_of(r#"{"train_batch_size": 8, "bf16": {"enabled": "yes"}}"#);
    assert!(matches!(error, ConfigError::WrongType { .. }), "{error:?}");
    assert_eq!(
        error.to_string(),
        "bf16.enabled: expected a boolean (true or false), found the string \"yes\""
    );
    let error = error_of(r#"{"train_batch_size": [8]}"#);
    assert_eq!(
        error.to_string(),
        "train_batch_size: expected a positive integer, found a list of 1 value"
    );
}

#[test]
fn nvme_offload_is_a_clear_unsupported_error() {
    let error = error_of(
        r#"{"train_batch_size": 8,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}"#,
    );
    assert!(matches!(error, ConfigError::Unsupported { .. }), "{error:?}");
    assert_eq!(error.path(), Some("zero_optimization.offload_optimizer.device"));
    assert!(error.to_string().contains("NVMe offload is not supported"), "{error}");
}

#[test]
fn zenflow_without_cpu_offload_is_a_conflict() {
    let error =
        error_of(r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "zenflow": {}}}"#);
    assert!(matches!(error, ConfigError::Conflict { .. }), "{error:?}");
    assert_eq!(error.path(), Some("zero_optimization.zenflow"));
}

#[test]
fn bf16_and_fp16_together_are_a_conflict() {
    let error = error_of(
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "fp16": {"enabled": true}}"#,
    );
    assert!(matches!(error, ConfigError::Conflict { .. }), "{error:?}");
    assert_eq!(error.path(), Some("fp16.enabled"));
}

#[test]
fn the_legacy_bfloat16_key_conflicts_with_fp16_under_its_own_name() {
    let error = error_of(
        r#"{"train_batch_size": 8, "bfloat16": {"enabled": true}, "fp16": {"enabled": true}}"#,
    );
    assert!(error.to_string().contains("bfloat16.enabled is true too"), "{error}");
}

#[test]
fn non_json_reports_line_and_column() {
    let error = error_of("{\n  \"train_batch_size\": 8\n  \"fp16\": {}\n}");
    let ConfigError::Syntax { line, column, .. } = error else {
        panic!("expected a syntax error, got {error:?}")
    };
    assert_eq!((line, column), (3, 3));
}

#[test]
fn a_top_level_array_and_an_empty_file_are_errors_about_the_top_level() {
    for text in ["[1, 2]", "", "  \n\t", "\"ds_config\"", "null"] {
        let error = error_of(text);
        assert_eq!(error.path(), Some(ROOT), "{text:?} gave {error}");
    }
}

#[test]
fn a_missing_file_is_unreadable_and_names_the_file() {
    let missing = std::path::Path::new("/nonexistent/ds_config.json");
    let error = config::resolve_file(missing, &Default::default()).expect_err("no such file");
    assert!(matches!(error, ConfigError::Unreadable { .. }), "{error:?}");
    assert!(error.to_string().starts_with("/nonexistent/ds_config.json: cannot read"), "{error}");
}

#[test]
fn an_auto_total_num_steps_needs_the_trainer() {
    let error = error_of(
        r#"{"train_batch_size": 8,
            "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}"#,
    );
    assert!(matches!(error, ConfigError::Missing { .. }), "{error:?}");
    assert_eq!(error.path(), Some("scheduler.params.total_num_steps"));
}

#[test]
fn overrides_are_validated_like_the_file() {
    let overrides = zeroflow_core::config::Overrides { lr: Some(-1.0), ..Default::default() };
    let text =
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}"#;
    let error = config::resolve_str(text, &context(1, overrides)).expect_err("negative lr");
    assert_eq!(error.path(), Some("optimizer.params.lr"));
    assert!(error.to_string().contains("given by the caller"), "{error}");
}

#[test]
fn every_error_but_io_and_syntax_has_a_path_at_the_start_of_its_message() {
    let texts = [
        r#"{"train_batch_size": 8, "gradient_clipping": -1}"#,
        r#"{"train_batch_size": 8, "optimizer": {"type": "Lamb"}}"#,
        r#"{"train_batch_size": 8, "scheduler": {"type": "OneCycle"}}"#,
        r#"{"gradient_accumulation_steps": 4}"#,
    ];
    for text in texts {
        let error = error_of(text);
        let path = error.path().expect("a JSON path");
        assert!(error.to_string().starts_with(&format!("{path}: ")), "{error}");
    }
}
