//! `zeroflow config` run as a user runs it: a file in, resolved JSON out, and for a bad file exit
//! code 2 with `error: <json.path>: …` on stderr, never a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod support;

/// A malformed config and the JSON path its error must name (for syntax errors, the position).
struct Malformed {
    name: &'static str,
    json: &'static str,
    path: &'static str,
}

const fn case(name: &'static str, json: &'static str, path: &'static str) -> Malformed {
    Malformed { name, json, path }
}

const MALFORMED: &[Malformed] = &[
    // zeroflow's run-time settings
    case(
        "attention",
        r#"{"train_batch_size": 8, "zeroflow": {"attention": "fast"}}"#,
        "zeroflow.attention",
    ),
    case(
        "activation_checkpointing",
        r#"{"train_batch_size": 8, "zeroflow": {"activation_checkpointing": "on"}}"#,
        "zeroflow.activation_checkpointing",
    ),
    case(
        "cuda_wait",
        r#"{"train_batch_size": 8, "zeroflow": {"cuda_wait": "yield"}}"#,
        "zeroflow.cuda_wait",
    ),
    case(
        "cpu_bind",
        r#"{"train_batch_size": 8, "zeroflow": {"cpu_bind": "of"}}"#,
        "zeroflow.cpu_bind",
    ),
    case(
        "stream_chunk",
        r#"{"train_batch_size": 8, "zeroflow": {"offload": {"stream_chunk_mib": 0}}}"#,
        "zeroflow.offload.stream_chunk_mib",
    ),
    case(
        "copy_stores",
        r#"{"train_batch_size": 8, "zeroflow": {"offload": {"copy_stores": "nt"}}}"#,
        "zeroflow.offload.copy_stores",
    ),
    case(
        "gather",
        r#"{"train_batch_size": 8, "zeroflow": {"offload": {"gather": "end"}}}"#,
        "zeroflow.offload.gather",
    ),
    case(
        "cpu_threads",
        r#"{"train_batch_size": 8, "zeroflow": {"offload": {"cpu_threads": -1}}}"#,
        "zeroflow.offload.cpu_threads",
    ),
    // ZeRO
    case(
        "stage3",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 3}}"#,
        "zero_optimization.stage",
    ),
    case(
        "stage4",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 4}}"#,
        "zero_optimization.stage",
    ),
    case(
        "stage_string",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": "two"}}"#,
        "zero_optimization.stage",
    ),
    case(
        "negative_reduce_bucket",
        r#"{"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": -5}}"#,
        "zero_optimization.reduce_bucket_size",
    ),
    case(
        "fractional_allgather_bucket",
        r#"{"train_batch_size": 8, "zero_optimization": {"allgather_bucket_size": 1.5}}"#,
        "zero_optimization.allgather_bucket_size",
    ),
    case(
        "string_reduce_bucket",
        r#"{"train_batch_size": 8, "zero_optimization": {"reduce_bucket_size": "big"}}"#,
        "zero_optimization.reduce_bucket_size",
    ),
    case(
        "overlap_comm_number",
        r#"{"train_batch_size": 8, "zero_optimization": {"overlap_comm": 1}}"#,
        "zero_optimization.overlap_comm",
    ),
    case(
        "zero_as_list",
        r#"{"train_batch_size": 8, "zero_optimization": [2]}"#,
        "zero_optimization",
    ),
    case(
        "offload_nvme",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}"#,
        "zero_optimization.offload_optimizer.device",
    ),
    case(
        "offload_gpu",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}"#,
        "zero_optimization.offload_optimizer.device",
    ),
    case(
        "pin_memory_string",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}}"#,
        "zero_optimization.offload_optimizer.pin_memory",
    ),
    case(
        "partial_offload",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}"#,
        "zero_optimization.offload_optimizer.ratio",
    ),
    case(
        "offload_at_stage0",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}"#,
        "zero_optimization.offload_optimizer",
    ),
    case(
        "cpu_offload_and_offload_optimizer",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": true, "offload_optimizer": {"device": "cpu"}}}"#,
        "zero_optimization.cpu_offload",
    ),
    // ZenFlow
    case(
        "zenflow_without_offload",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}}}"#,
        "zero_optimization.zenflow",
    ),
    case(
        "zenflow_topk_above_one",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"topk_ratio": 1.5}}}"#,
        "zero_optimization.zenflow.topk_ratio",
    ),
    case(
        "zenflow_bad_strategy",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"select_strategy": "random"}}}"#,
        "zero_optimization.zenflow.select_strategy",
    ),
    case(
        "zenflow_select_below_update",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"select_strategy": "step", "select_interval": 2, "update_interval": 4}}}"#,
        "zero_optimization.zenflow.select_interval",
    ),
    case(
        "zenflow_auto_strategy_fixed_interval",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"select_strategy": "auto", "select_interval": 4}}}"#,
        "zero_optimization.zenflow.select_interval",
    ),
    case(
        "zenflow_step_strategy_auto_interval",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"select_strategy": "step"}}}"#,
        "zero_optimization.zenflow.select_interval",
    ),
    case(
        "zenflow_offload_without_overlap",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"offload": true}}}"#,
        "zero_optimization.zenflow.offload",
    ),
    case(
        "zenflow_update_interval_zero",
        r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": {"update_interval": 0}}}"#,
        "zero_optimization.zenflow.update_interval",
    ),
    // Precision
    case(
        "bf16_and_fp16",
        r#"{"train_batch_size": 8, "bf16": {"enabled": true}, "fp16": {"enabled": true}}"#,
        "fp16.enabled",
    ),
    case(
        "bf16_enabled_string",
        r#"{"train_batch_size": 8, "bf16": {"enabled": "true"}}"#,
        "bf16.enabled",
    ),
    case("bf16_as_bool", r#"{"train_batch_size": 8, "bf16": true}"#, "bf16"),
    case(
        "negative_loss_scale",
        r#"{"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale": -1}}"#,
        "fp16.loss_scale",
    ),
    case(
        "huge_scale_power",
        r#"{"train_batch_size": 8, "fp16": {"enabled": true, "initial_scale_power": 200}}"#,
        "fp16.initial_scale_power",
    ),
    case(
        "zero_loss_scale_window",
        r#"{"train_batch_size": 8, "fp16": {"enabled": true, "loss_scale_window": 0}}"#,
        "fp16.loss_scale_window",
    ),
    // Optimizer
    case(
        "negative_lr",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": -0.001}}}"#,
        "optimizer.params.lr",
    ),
    case(
        "beta_of_one",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}"#,
        "optimizer.params.betas[1]",
    ),
    case(
        "negative_beta",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [-0.1, 0.999]}}}"#,
        "optimizer.params.betas[0]",
    ),
    case(
        "one_beta",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}"#,
        "optimizer.params.betas",
    ),
    case(
        "betas_string",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"betas": "0.9,0.999"}}}"#,
        "optimizer.params.betas",
    ),
    case(
        "negative_eps",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"eps": -1e-8}}}"#,
        "optimizer.params.eps",
    ),
    case(
        "negative_weight_decay",
        r#"{"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}}"#,
        "optimizer.params.weight_decay",
    ),
    case("lamb", r#"{"train_batch_size": 8, "optimizer": {"type": "Lamb"}}"#, "optimizer.type"),
    case(
        "optimizer_without_type",
        r#"{"train_batch_size": 8, "optimizer": {"params": {"lr": 0.001}}}"#,
        "optimizer.type",
    ),
    case(
        "max_grad_norm",
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}"#,
        "optimizer.params.max_grad_norm",
    ),
    case(
        "amsgrad",
        r#"{"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"amsgrad": true}}}"#,
        "optimizer.params.amsgrad",
    ),
    // Scheduler
    case(
        "one_cycle",
        r#"{"train_batch_size": 8, "scheduler": {"type": "OneCycle"}}"#,
        "scheduler.type",
    ),
    case(
        "scheduler_wrong_case",
        r#"{"train_batch_size": 8, "scheduler": {"type": "warmuplr"}}"#,
        "scheduler.type",
    ),
    case(
        "decay_without_total",
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}"#,
        "scheduler.params.total_num_steps",
    ),
    case(
        "zero_warmup_steps",
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 0}}}"#,
        "scheduler.params.warmup_num_steps",
    ),
    case(
        "cos_min_ratio_above_one",
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "cos_min_ratio": 2}}}"#,
        "scheduler.params.cos_min_ratio",
    ),
    case(
        "negative_warmup_max_lr",
        r#"{"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": -1}}}"#,
        "scheduler.params.warmup_max_lr",
    ),
    // Batch sizes
    case(
        "contradictory_batch",
        r#"{"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}"#,
        "train_batch_size",
    ),
    case(
        "indivisible_batch",
        r#"{"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}"#,
        "train_batch_size",
    ),
    case("no_batch_size", r#"{"gradient_accumulation_steps": 4}"#, "train_batch_size"),
    case("zero_train_batch", r#"{"train_batch_size": 0}"#, "train_batch_size"),
    case("negative_train_batch", r#"{"train_batch_size": -8}"#, "train_batch_size"),
    case(
        "fractional_accumulation",
        r#"{"train_batch_size": 8, "gradient_accumulation_steps": 2.5}"#,
        "gradient_accumulation_steps",
    ),
    case(
        "micro_batch_bool",
        r#"{"train_micro_batch_size_per_gpu": true}"#,
        "train_micro_batch_size_per_gpu",
    ),
    // Other top-level keys
    case(
        "negative_clipping",
        r#"{"train_batch_size": 8, "gradient_clipping": -1}"#,
        "gradient_clipping",
    ),
    case(
        "clipping_string",
        r#"{"train_batch_size": 8, "gradient_clipping": "1.0"}"#,
        "gradient_clipping",
    ),
    case(
        "zero_steps_per_print",
        r#"{"train_batch_size": 8, "steps_per_print": 0}"#,
        "steps_per_print",
    ),
    case(
        "wall_clock_number",
        r#"{"train_batch_size": 8, "wall_clock_breakdown": 1}"#,
        "wall_clock_breakdown",
    ),
    case(
        "delayed_update_negative_warmup",
        r#"{"train_batch_size": 8, "zeroflow": {"delayed_update": {"warmup_steps": -1}}}"#,
        "zeroflow.delayed_update.warmup_steps",
    ),
    case(
        "delayed_update_enabled_string",
        r#"{"train_batch_size": 8, "zeroflow": {"delayed_update": {"enabled": "yes"}}}"#,
        "zeroflow.delayed_update.enabled",
    ),
    // Not a config at all
    case("missing_comma", "{\n  \"train_batch_size\": 8\n  \"fp16\": {}\n}", "line 3, column 3"),
    case("trailing_comma", "{\"train_batch_size\": 8,}", "line 1, column"),
    case("number_out_of_range", "{\"train_batch_size\": 1e999}", "line 1, column"),
    case(
        "duplicate_key",
        "{\"zero_optimization\": {\"stage\": 1, \"stage\": 2}}",
        "line 1, column",
    ),
    case("top_level_array", "[{\"train_batch_size\": 8}]", "(top level)"),
    case("top_level_string", "\"ds_config.json\"", "(top level)"),
    case("empty_file", "", "(top level)"),
    case("whitespace_only", " \n\t\n", "(top level)"),
];

/// A fresh directory for this test's files.
fn scratch_dir(test: &str) -> PathBuf {
    support::scratch_in("config_command", test)
}

fn zeroflow_config(file: &Path, extra_args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .arg("config")
        .arg(file)
        .args(extra_args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .expect("the zeroflow binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What is wrong with the outcome of one malformed config, if anything.
fn check_rejected(case: &Malformed, output: &Output) -> Option<String> {
    let stderr = text(&output.stderr);
    let expected_start = format!("error: {}", case.path);
    let lowercase = stderr.to_lowercase();
    if output.status.code() != Some(2) {
        Some(format!("exit status {:?}", output.status.code()))
    } else if !stderr.starts_with(&expected_start) {
        Some(format!("stderr does not start with {expected_start:?}"))
    } else if lowercase.contains("panicked") || lowercase.contains("backtrace") {
        Some("stderr shows a panic".to_owned())
    } else if !output.stdout.is_empty() {
        Some("something was printed on stdout".to_owned())
    } else {
        None
    }
    .map(|problem| format!("{}: {problem}; stderr: {stderr}", case.name))
}

#[test]
fn every_malformed_config_exits_2_and_names_its_json_path() {
    assert!(MALFORMED.len() >= 30, "the brief asks for at least 30 malformed configs");
    let dir = scratch_dir("malformed");
    let failures: Vec<String> = MALFORMED
        .iter()
        .filter_map(|case| {
            let file = dir.join(format!("{}.json", case.name));
            std::fs::write(&file, case.json).expect("the scratch file is writable");
            check_rejected(case, &zeroflow_config(&file, &[]))
        })
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        MALFORMED.len(),
        failures.join("\n")
    );
}

#[test]
fn the_world_size_takes_part_in_the_batch_rule() {
    let dir = scratch_dir("world_size");
    let file = dir.join("ds_config.json");
    std::fs::write(&file, r#"{"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}"#)
        .expect("the scratch file is writable");
    assert!(zeroflow_config(&file, &[]).status.success(), "8 = 8 × 1 × 1");
    let two_ranks = zeroflow_config(&file, &["--world-size", "2"]);
    assert_eq!(two_ranks.status.code(), Some(2));
    assert!(
        text(&two_ranks.stderr).contains("× world size (2) = 16"),
        "{}",
        text(&two_ranks.stderr)
    );
}

#[test]
fn a_valid_config_prints_resolved_json_and_warns_once_per_unknown_key() {
    let dir = scratch_dir("valid");
    let file = dir.join("ds_config.json");
    let config = r#"{
        "train_batch_size": 64,
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": true},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 1e9},
        "tensorboard": {"enabled": true},
        "gradient_cliping": 1.0,
        "seed": 42
    }"#;
    std::fs::write(&file, config).expect("the scratch file is writable");
    let output = zeroflow_config(&file, &["--world-size", "4"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let resolved: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    assert_eq!(resolved["gradient_accumulation_steps"], 4, "64 / (4 × 4)");
    assert_eq!(resolved["zero_optimization"]["offload_optimizer"]["pin_memory"], true);
    assert_eq!(resolved["zero_optimization"]["reduce_bucket_size"], 500_000_000);
    let warnings: Vec<String> = text(&output.stderr).lines().map(str::to_owned).collect();
    assert_eq!(
        warnings,
        [
            "warning: ignored key zero_optimization.sub_group_size (a ZeRO stage 3 setting; \
             zeroflow implements stages 0 to 2)",
            "warning: ignored key tensorboard (DeepSpeed monitoring or profiling; zeroflow does \
             not use it)",
            "warning: unknown key gradient_cliping (ignored; did you mean \
             \"gradient_clipping\"?)",
            "warning: unknown key seed (ignored; not a DeepSpeed or zeroflow setting)",
        ]
    );
}

/// The `zeroflow` section's settings come out resolved: as given, or `null` for the default.
#[test]
fn the_run_time_settings_are_printed_with_the_resolved_config() {
    let dir = scratch_dir("settings");
    let file = dir.join("ds.json");
    let json = r#"{"train_batch_size": 8, "zeroflow": {"attention": "flash", "cpu_bind": "off",
        "activation_checkpointing": true, "offload": {"stream_chunk_mib": 8, "gather": "pieces"}}}"#;
    std::fs::write(&file, json).unwrap();
    let output = zeroflow_config(&file, &[]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let resolved: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let zeroflow = &resolved["zeroflow"];
    assert_eq!(zeroflow["attention"], "flash");
    assert_eq!(zeroflow["cpu_bind"], "off");
    assert_eq!(zeroflow["activation_checkpointing"], true);
    assert_eq!(zeroflow["cuda_wait"], serde_json::Value::Null);
    assert_eq!(zeroflow["offload"]["stream_chunk_mib"], 8.0);
    assert_eq!(zeroflow["offload"]["gather"], "pieces");
    assert_eq!(zeroflow["offload"]["copy_stores"], serde_json::Value::Null);
    assert_eq!(zeroflow["offload"]["cpu_threads"], serde_json::Value::Null);
}

#[test]
fn auto_values_are_reported_as_notes() {
    let dir = scratch_dir("auto");
    let file = dir.join("ds_config.json");
    std::fs::write(&file, r#"{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}"#)
        .expect("the scratch file is writable");
    let output = zeroflow_config(&file, &["--world-size", "2"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let resolved: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    assert_eq!(resolved["train_batch_size"], 12);
    assert!(
        text(&output.stderr).starts_with("note: train_batch_size: \"auto\" became 12"),
        "{}",
        text(&output.stderr)
    );
}

#[test]
fn a_missing_file_exits_2_and_names_the_file() {
    let dir = scratch_dir("missing");
    let file = dir.join("no_such_config.json");
    let output = zeroflow_config(&file, &[]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = text(&output.stderr);
    assert!(
        stderr.starts_with("error: ") && stderr.contains("no_such_config.json: cannot read"),
        "{stderr}"
    );
}

#[test]
fn a_world_size_of_zero_is_refused_by_the_argument_parser() {
    let dir = scratch_dir("world_zero");
    let file = dir.join("ds_config.json");
    std::fs::write(&file, r#"{"train_batch_size": 8}"#).expect("the scratch file is writable");
    let output = zeroflow_config(&file, &["--world-size", "0"]);
    assert_eq!(output.status.code(), Some(2));
    assert!(text(&output.stderr).contains("--world-size"), "{}", text(&output.stderr));
}
