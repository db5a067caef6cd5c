//! The run-time settings of the `zeroflow` section (attention, activation checkpointing, host
//! waits, CPU binding, the offload stream's tuning): each is read by name, `"auto"` leaves it to the default, and a bad
//! value is an error naming its JSON path.

use std::num::NonZeroU64;

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::config::{
    AccumulateOn, Attention, ConfigError, CopyStores, CpuBind, CudaWait, DeviceShare,
    DeviceShareState, Gather, OffloadTuning, ZenFlowAside,
};

use super::{error_of, resolve};

fn with_zeroflow(section: &str) -> String {
    format!(r#"{{"train_batch_size": 8, "zeroflow": {section}}}"#)
}

#[test]
fn every_setting_is_read_by_name() {
    let text = with_zeroflow(
        r#"{"attention": "flash", "cuda_wait": "block", "cpu_bind": "off",
            "activation_checkpointing": true,
            "offload": {"stream_chunk_mib": 0.5, "copy_stores": "non-temporal",
                        "gather": "after-step", "cpu_threads": 12,
                        "speculation_budget_mib": 1.5, "accumulate_on": "host",
                        "pinned_budget_mib": 2048, "overlap_forward": false,
                        "device_share": 0.25, "device_share_state": "host",
                        "zenflow_aside": "host"}}"#,
    );
    let resolved = resolve(&text).expect("valid");
    assert!(resolved.warnings.is_empty(), "{:?}", resolved.warnings);
    let zeroflow = resolved.config.zeroflow;
    assert_eq!(zeroflow.attention, Some(Attention::Flash));
    assert_eq!(zeroflow.activation_checkpointing, Some(true));
    assert_eq!(zeroflow.cuda_wait, Some(CudaWait::Block));
    assert_eq!(zeroflow.cpu_bind, Some(CpuBind::Off));
    assert_eq!(
        zeroflow.offload,
        OffloadTuning {
            stream_chunk_mib: Some(0.5),
            copy_stores: Some(CopyStores::NonTemporal),
            gather: Some(Gather::AfterStep),
            cpu_threads: NonZeroU64::new(12),
            speculation_budget_mib: Some(1.5),
            accumulate_on: Some(AccumulateOn::Host),
            pinned_budget_mib: Some(2048.0),
            overlap_forward: Some(false),
            device_share: Some(DeviceShare::Fraction(0.25)),
            device_share_state: Some(DeviceShareState::Host),
            zenflow_aside: Some(ZenFlowAside::Host),
        }
    );
}

#[test]
fn auto_and_absent_settings_are_left_to_the_default_and_resolve_to_null() {
    let text = with_zeroflow(
        r#"{"attention": "auto", "cuda_wait": "auto", "cpu_bind": "auto",
            "activation_checkpointing": "auto",
            "offload": {"stream_chunk_mib": "auto", "copy_stores": "auto", "gather": "auto",
                        "cpu_threads": "auto", "speculation_budget_mib": "auto",
                        "accumulate_on": "auto", "pinned_budget_mib": "auto",
                        "overlap_forward": "auto", "device_share": "auto",
                        "device_share_state": "auto", "zenflow_aside": "auto"}}"#,
    );
    let resolved = resolve(&text).expect("valid");
    let absent = resolve(r#"{"train_batch_size": 8}"#).expect("valid");
    assert_eq!(resolved.config.zeroflow, absent.config.zeroflow);
    assert!(resolved.auto_values.is_empty(), "{:?}", resolved.auto_values);
    let json = resolved.config.to_json();
    let pointers = [
        "/zeroflow/attention",
        "/zeroflow/activation_checkpointing",
        "/zeroflow/cuda_wait",
        "/zeroflow/offload/gather",
        "/zeroflow/offload/speculation_budget_mib",
        "/zeroflow/offload/accumulate_on",
        "/zeroflow/offload/pinned_budget_mib",
        "/zeroflow/offload/overlap_forward",
        "/zeroflow/offload/device_share",
        "/zeroflow/offload/device_share_state",
        "/zeroflow/offload/zenflow_aside",
    ];
    for pointer in pointers {
        assert_eq!(json.pointer(pointer), Some(&serde_json::Value::Null), "{pointer}");
    }
}

#[test]
fn set_settings_round_trip_through_the_resolved_json() {
    let text = with_zeroflow(
        r#"{"attention": "gemm", "cuda_wait": "spin", "cpu_bind": "on",
            "activation_checkpointing": false,
            "offload": {"stream_chunk_mib": 32, "copy_stores": "normal", "gather": "pieces",
                        "cpu_threads": 3, "speculation_budget_mib": 0,
                        "accumulate_on": "device", "pinned_budget_mib": 0,
                        "device_share": 0, "device_share_state": "device",
                        "zenflow_aside": "device"}}"#,
    );
    let first = resolve(&text).expect("valid");
    let json = first.config.to_json();
    assert_eq!(json["zeroflow"]["attention"], "gemm");
    assert_eq!(json["zeroflow"]["activation_checkpointing"], false);
    assert_eq!(json["zeroflow"]["offload"]["copy_stores"], "normal");
    // 0 is a budget (speculation off), not "auto".
    assert_eq!(json["zeroflow"]["offload"]["speculation_budget_mib"], 0.0);
    assert_eq!(json["zeroflow"]["offload"]["accumulate_on"], "device");
    // 0 is a budget (pin nothing), not "auto".
    assert_eq!(json["zeroflow"]["offload"]["pinned_budget_mib"], 0.0);
    // 0 is a share (nothing on the device), not "auto".
    assert_eq!(json["zeroflow"]["offload"]["device_share"], 0.0);
    assert_eq!(json["zeroflow"]["offload"]["device_share_state"], "device");
    assert_eq!(json["zeroflow"]["offload"]["zenflow_aside"], "device");
    let again = resolve(&first.config.to_resolved_json()).expect("the resolved JSON is valid");
    assert_eq!(again.config, first.config);
    assert!(again.warnings.is_empty(), "{:?}", again.warnings);
}

/// `"fit"` (the share the memory plan finds room for) is a setting of its own, kept through the
/// resolved JSON; `"auto"` leaves the share to the layers above and the default.
#[test]
fn a_device_share_of_fit_round_trips_and_auto_is_the_default() {
    let fit = resolve(&with_zeroflow(r#"{"offload": {"device_share": "fit"}}"#)).expect("valid");
    assert_eq!(fit.config.zeroflow.offload.device_share, Some(DeviceShare::Fit));
    assert_eq!(fit.config.to_json()["zeroflow"]["offload"]["device_share"], "fit");
    let again = resolve(&fit.config.to_resolved_json()).expect("the resolved JSON is valid");
    assert_eq!(again.config, fit.config);
    let auto = resolve(&with_zeroflow(r#"{"offload": {"device_share": "auto"}}"#)).expect("valid");
    assert_eq!(auto.config.zeroflow.offload.device_share, None);
}

#[test]
fn a_bad_value_of_each_setting_is_an_error_naming_its_json_path() {
    const SPECULATION: &str = "zeroflow.offload.speculation_budget_mib";
    let cases = [
        (r#"{"attention": "flashy"}"#, "zeroflow.attention", "\"flashy\""),
        (r#"{"attention": 1}"#, "zeroflow.attention", "the number 1"),
        (r#"{"cuda_wait": "sleep"}"#, "zeroflow.cuda_wait", "\"sleep\""),
        (r#"{"cpu_bind": "yes"}"#, "zeroflow.cpu_bind", "\"yes\""),
        (r#"{"cpu_bind": true}"#, "zeroflow.cpu_bind", "true"),
        (r#"{"activation_checkpointing": "on"}"#, "zeroflow.activation_checkpointing", "\"on\""),
        (r#"{"offload": {"stream_chunk_mib": 0}}"#, "zeroflow.offload.stream_chunk_mib", "0"),
        (r#"{"offload": {"stream_chunk_mib": -4}}"#, "zeroflow.offload.stream_chunk_mib", "-4"),
        (r#"{"offload": {"stream_chunk_mib": "big"}}"#, "zeroflow.offload.stream_chunk_mib", "big"),
        (r#"{"offload": {"copy_stores": "nt"}}"#, "zeroflow.offload.copy_stores", "\"nt\""),
        (r#"{"offload": {"gather": "later"}}"#, "zeroflow.offload.gather", "\"later\""),
        (r#"{"offload": {"cpu_threads": 0}}"#, "zeroflow.offload.cpu_threads", "0"),
        (r#"{"offload": {"cpu_threads": 1.5}}"#, "zeroflow.offload.cpu_threads", "1.5"),
        (r#"{"offload": {"speculation_budget_mib": -1}}"#, SPECULATION, "-1"),
        (r#"{"offload": {"speculation_budget_mib": "4GiB"}}"#, SPECULATION, "4GiB"),
        (r#"{"offload": {"speculation_budget_mib": true}}"#, SPECULATION, "true"),
        (r#"{"offload": {"accumulate_on": "gpu"}}"#, "zeroflow.offload.accumulate_on", "\"gpu\""),
        (r#"{"offload": {"accumulate_on": 1}}"#, "zeroflow.offload.accumulate_on", "the number 1"),
        (r#"{"offload": {"device_share": 1}}"#, "zeroflow.offload.device_share", "1"),
        (r#"{"offload": {"device_share": -0.5}}"#, "zeroflow.offload.device_share", "-0.5"),
        (r#"{"offload": {"device_share": "half"}}"#, "zeroflow.offload.device_share", "half"),
        (r#"{"offload": {"zenflow_aside": "cpu"}}"#, "zeroflow.offload.zenflow_aside", "\"cpu\""),
        (r#"{"offload": 4}"#, "zeroflow.offload", "the number 4"),
        (r#"{"optimizer_state_dtype": "fp16"}"#, "zeroflow.optimizer_state_dtype", "\"fp16\""),
        (r#"{"optimizer_state_dtype": 16}"#, "zeroflow.optimizer_state_dtype", "the number 16"),
    ];
    for (section, path, found) in cases {
        let error = error_of(&with_zeroflow(section));
        assert_eq!(error.path(), Some(path), "{section}: {error}");
        let message = error.to_string();
        assert!(message.starts_with(&format!("{path}: expected ")), "{message}");
        assert!(message.contains(found), "{section}: {message}");
        assert!(
            matches!(error, ConfigError::BadValue { .. } | ConfigError::WrongType { .. }),
            "{error:?}"
        );
    }
}

#[test]
fn the_names_are_exact_as_elsewhere_in_the_config() {
    let error = error_of(&with_zeroflow(r#"{"attention": "Flash"}"#));
    assert_eq!(error.path(), Some("zeroflow.attention"));
}

/// `optimizer_state_dtype` is fp32 unless the config asks for bf16 (`"auto"` is the default),
/// and the resolved config writes the dtype it resolved to.
#[test]
fn optimizer_state_dtype_defaults_to_fp32_and_reads_bf16() {
    let dtype_of = |text: &str| resolve(text).expect("valid").config.zeroflow.optimizer_state_dtype;
    assert_eq!(dtype_of(r#"{"train_batch_size": 8}"#), OptimizerStateDtype::Fp32);
    let auto = with_zeroflow(r#"{"optimizer_state_dtype": "auto"}"#);
    assert_eq!(dtype_of(&auto), OptimizerStateDtype::Fp32);
    let bf16 = resolve(&with_zeroflow(r#"{"optimizer_state_dtype": "bf16"}"#)).expect("valid");
    assert_eq!(bf16.config.zeroflow.optimizer_state_dtype, OptimizerStateDtype::Bf16);
    assert_eq!(bf16.config.to_json()["zeroflow"]["optimizer_state_dtype"], "bf16");
    let again = resolve(&bf16.config.to_resolved_json()).expect("the resolved JSON is valid");
    assert_eq!(again.config, bf16.config);
}

/// fp16 moments are refused with the reason, not silently read as something else.
#[test]
fn fp16_moments_are_refused_saying_why() {
    let error = error_of(&with_zeroflow(r#"{"optimizer_state_dtype": "fp16"}"#));
    let message = error.to_string();
    assert!(message.contains("\"bf16\"") && message.contains("underflow"), "{message}");
}
