use serde_json::json;
use zeroflow_core::config::{Context, resolve_str};

use super::record::changed_numerics;
use super::*;

fn requested_attention(attention: Attention) -> Requested {
    Requested { attention: Some(attention), ..Requested::default() }
}

/// Every setting comes from the flags, else the environment, else the config; a layer that says
/// nothing about a setting passes it on, whatever it says about the others.
#[test]
fn a_flag_beats_the_environment_which_beats_the_config() {
    let config = Requested {
        attention: Some(Attention::Gemm),
        activation_checkpointing: Some(true),
        cuda_wait: Some(HostWaits::Spin),
        cpu_bind: Some(BindMode::Off),
        stream_chunk_mib: Some(8.0),
        copy_stores: Some(Stores::Normal),
        gather_in_pieces: Some(false),
        cpu_threads: Some(3),
        speculation_budget_mib: Some(64.0),
        accumulate_on: Some(AccumulateOn::Host),
        pinned_budget_mib: Some(4096.0),
        overlap_forward: Some(false),
        device_share: Some(DeviceShare::Fraction(0.5)),
        device_share_state: Some(ShareState::Host),
        zenflow_aside: Some(ZenFlowAside::Host),
        pack: Some(true),
    };
    let env = Requested {
        attention: Some(Attention::Flash),
        activation_checkpointing: Some(false),
        cuda_wait: Some(HostWaits::Block),
        stream_chunk_mib: Some(4.0),
        speculation_budget_mib: Some(16.0),
        accumulate_on: Some(AccumulateOn::Device),
        pinned_budget_mib: Some(1024.0),
        device_share: Some(DeviceShare::Fraction(0.25)),
        device_share_state: Some(ShareState::Device),
        zenflow_aside: Some(ZenFlowAside::Device),
        ..Requested::default()
    };
    let flags = Requested {
        attention: Some(Attention::Auto),
        stream_chunk_mib: Some(2.0),
        cpu_threads: Some(7),
        speculation_budget_mib: Some(0.0),
        device_share: Some(DeviceShare::Fraction(0.0)),
        ..Requested::default()
    };
    let resolved = resolve(flags, env, config);
    assert_eq!(
        resolved,
        Requested {
            attention: Some(Attention::Auto),
            activation_checkpointing: Some(false),
            cuda_wait: Some(HostWaits::Block),
            cpu_bind: Some(BindMode::Off),
            stream_chunk_mib: Some(2.0),
            copy_stores: Some(Stores::Normal),
            gather_in_pieces: Some(false),
            cpu_threads: Some(7),
            speculation_budget_mib: Some(0.0),
            accumulate_on: Some(AccumulateOn::Device),
            pinned_budget_mib: Some(1024.0),
            overlap_forward: Some(false),
            device_share: Some(DeviceShare::Fraction(0.0)),
            device_share_state: Some(ShareState::Device),
            zenflow_aside: Some(ZenFlowAside::Device),
            pack: Some(true),
        }
    );
    assert_eq!(resolve(Requested::default(), env, config).attention, Some(Attention::Flash));
    let below_flags = resolve(Requested::default(), env, config);
    assert_eq!(below_flags.speculation_budget_mib, Some(16.0));
    assert_eq!(below_flags.device_share, Some(DeviceShare::Fraction(0.25)));
    let config_only = resolve(Requested::default(), Requested::default(), config);
    assert_eq!(config_only.accumulate_on, Some(AccumulateOn::Host));
    assert_eq!(resolve(Requested::default(), Requested::default(), config), config);
    let nothing = Requested::default();
    assert_eq!(resolve(nothing, nothing, nothing), nothing);
}

#[test]
fn the_config_section_becomes_the_config_layer() {
    let text = r#"{"train_batch_size": 8, "zeroflow": {"attention": "flash", "cuda_wait": "spin",
        "activation_checkpointing": true, "pack": true, "cpu_bind": "on", "offload": {"stream_chunk_mib": 0.5, "copy_stores": "non-temporal",
        "gather": "after-step", "cpu_threads": 5, "speculation_budget_mib": 256,
        "accumulate_on": "host", "pinned_budget_mib": 512, "overlap_forward": false,
        "device_share": 0.375, "device_share_state": "host", "zenflow_aside": "host"}}}"#;
    let config = resolve_str(text, &Context::default()).unwrap().config;
    assert_eq!(
        from_config(&config.zeroflow),
        Requested {
            attention: Some(Attention::Flash),
            activation_checkpointing: Some(true),
            cuda_wait: Some(HostWaits::Spin),
            cpu_bind: Some(BindMode::On),
            stream_chunk_mib: Some(0.5),
            copy_stores: Some(Stores::NonTemporal),
            gather_in_pieces: Some(false),
            cpu_threads: Some(5),
            speculation_budget_mib: Some(256.0),
            accumulate_on: Some(AccumulateOn::Host),
            pinned_budget_mib: Some(512.0),
            overlap_forward: Some(false),
            device_share: Some(DeviceShare::Fraction(0.375)),
            device_share_state: Some(ShareState::Host),
            zenflow_aside: Some(ZenFlowAside::Host),
            pack: Some(true),
        }
    );
    let plain = resolve_str(r#"{"train_batch_size": 8}"#, &Context::default()).unwrap().config;
    assert_eq!(from_config(&plain.zeroflow), Requested::default());
}

/// The engine options and recorded settings of a config `text` (stage 2, offloaded) tuned by
/// `requested`, for f32 parameters on the CPU device.
fn tuned(text: &str, requested: &Requested) -> (EngineOptions, Effective) {
    let config = resolve_str(text, &Context::default()).unwrap().config;
    let mut options = EngineOptions::from_config(&config, 2).unwrap();
    apply_offload::<f32>(requested, &mut options, 0).unwrap();
    let (device, dtype) = (DeviceKind::Cpu, DType::F32);
    let effective = Effective::new(device, AttentionKind::Gemm, requested, &options, dtype, None);
    (options, effective)
}

const OFFLOADED: &str = r#"{"train_batch_size": 8, "gradient_accumulation_steps": 4,
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}"#;

/// The budget in MiB becomes bytes of the engine's stream options, the accumulation place its
/// choice; both are what the run records. Unasked, the engine's defaults (off, auto) stay.
#[test]
fn the_speculation_budget_and_accumulation_place_reach_the_engine_and_the_record() {
    let asked = Requested {
        speculation_budget_mib: Some(1.5),
        accumulate_on: Some(AccumulateOn::Host),
        ..Requested::default()
    };
    let (options, effective) = tuned(&format!("{OFFLOADED}}}"), &asked);
    let stream = options.offload().unwrap().stream;
    assert_eq!(stream.speculation_budget, 3 << 19);
    assert_eq!(stream.accumulate_on, AccumulateOn::Host);
    let offload = effective.offload.unwrap();
    assert_eq!((offload.speculation_budget_mib, offload.accumulate_on), (1.5, "host"));

    let (options, effective) = tuned(&format!("{OFFLOADED}}}"), &Requested::default());
    let stream = options.offload().unwrap().stream;
    assert_eq!(
        stream.speculation_budget,
        zeroflow_engine::StreamOptions::default().speculation_budget
    );
    assert_eq!(stream.accumulate_on, AccumulateOn::Auto);
    let offload = effective.offload.unwrap();
    assert_eq!((offload.speculation_budget_mib, offload.accumulate_on), (0.0, "auto"));
}

/// The config's `optimizer_state_dtype` reaches the engine's offload options and the record;
/// unasked it is fp32.
#[test]
fn the_optimizer_state_dtype_reaches_the_engine_and_the_record() {
    use zeroflow_core::adamw::OptimizerStateDtype;
    let bf16 = format!(r#"{OFFLOADED}, "zeroflow": {{"optimizer_state_dtype": "bf16"}}}}"#);
    let (options, effective) = tuned(&bf16, &Requested::default());
    assert_eq!(options.offload().unwrap().moments, OptimizerStateDtype::Bf16);
    assert_eq!(effective.optimizer_state_dtype, "bf16");
    assert_eq!(effective.to_json()["optimizer_state_dtype"], "bf16");
    let (options, effective) = tuned(&format!("{OFFLOADED}}}"), &Requested::default());
    assert_eq!(options.offload().unwrap().moments, OptimizerStateDtype::Fp32);
    assert_eq!(effective.optimizer_state_dtype, "fp32");
}

/// Where ZenFlow sets its window aside reaches the engine and the record (the device unasked);
/// a run without ZenFlow records none.
#[test]
fn the_zenflow_aside_reaches_the_engine_and_the_record() {
    let zenflow = r#"{"train_batch_size": 8, "zero_optimization": {"stage": 2,
        "offload_optimizer": {"device": "cpu"},
        "zenflow": {"topk_ratio": 0.05, "update_interval": 4, "overlap_step": true}}}"#;
    let host = Requested { zenflow_aside: Some(ZenFlowAside::Host), ..Requested::default() };
    for (asked, aside, name) in
        [(host, ZenFlowAside::Host, "host"), (Requested::default(), ZenFlowAside::Device, "device")]
    {
        let (options, effective) = tuned(zenflow, &asked);
        assert_eq!(options.offload().unwrap().stream.zenflow_aside, aside);
        assert_eq!(effective.offload.unwrap().zenflow_aside, Some(name));
    }
    let (_, effective) = tuned(&format!("{OFFLOADED}}}"), &host);
    assert_eq!(effective.offload.unwrap().zenflow_aside, None);
}

/// The delayed update does not speculate: its record says 0 whatever the budget asked.
#[test]
fn the_delayed_update_records_no_speculation_budget() {
    let asked = Requested { speculation_budget_mib: Some(8.0), ..Requested::default() };
    let delayed =
        format!(r#"{OFFLOADED}, "zeroflow": {{"delayed_update": {{"enabled": true}}}}}}"#);
    let (options, effective) = tuned(&delayed, &asked);
    assert_eq!(options.offload().unwrap().stream.speculation_budget, 8 << 20);
    assert_eq!(effective.offload.unwrap().speculation_budget_mib, 0.0);
}

/// MiB of the parameter dtype become whole elements: bf16 and f16 have 2 bytes, f32 4; less
/// than one element is refused.
#[test]
fn a_chunk_in_mib_becomes_elements_of_the_parameter_dtype() {
    assert_eq!(chunk_elements(32.0, DType::Bf16), Ok(1 << 24));
    assert_eq!(chunk_elements(4.0, DType::F16), Ok(1 << 21));
    assert_eq!(chunk_elements(4.0, DType::F32), Ok(1 << 20));
    assert_eq!(chunk_elements(0.5, DType::Bf16), Ok(1 << 18));
    // 104.86 bytes: 52 whole bf16 elements.
    assert_eq!(chunk_elements(1e-4, DType::Bf16), Ok(52));
    let reason = chunk_elements(1e-7, DType::F32).unwrap_err();
    assert!(reason.contains("less than one F32 element"), "{reason}");
    assert_eq!(mib_of(1 << 24, DType::Bf16), 32.0);
}

/// Activation checkpointing is the CUDA model's: as asked on the GPU (off unless asked), never
/// on the CPU device.
#[test]
fn activation_checkpointing_applies_to_the_cuda_model_only() {
    let asked = |on| Requested { activation_checkpointing: on, ..Requested::default() };
    let on = |device, requested: Requested| super::activation_checkpointing(device, &requested);
    assert!(on(DeviceKind::Cuda, asked(Some(true))));
    assert!(!on(DeviceKind::Cuda, asked(Some(false))));
    assert!(!on(DeviceKind::Cuda, asked(None)));
    assert!(!on(DeviceKind::Cpu, asked(Some(true))));
}

/// The CPU model has one attention; flash asked of it is refused, auto and gemm are gemm.
#[test]
fn the_cpu_model_runs_gemm_attention_and_refuses_flash() {
    let model = ModelSpec::Gpt2(zeroflow_gpt::GptConfig::named("gpt2-124m").unwrap());
    let on = |device, attention| super::attention(device, &model, &requested_attention(attention));
    assert_eq!(on(DeviceKind::Cpu, Attention::Auto).unwrap(), AttentionKind::Gemm);
    assert_eq!(on(DeviceKind::Cpu, Attention::Gemm).unwrap(), AttentionKind::Gemm);
    let error = on(DeviceKind::Cpu, Attention::Flash).unwrap_err().to_string();
    assert!(error.contains("attention flash") && error.contains("gemm"), "{error}");
    // On the GPU, auto is flash where the head size (64 here) has kernels.
    assert_eq!(on(DeviceKind::Cuda, Attention::Auto).unwrap(), AttentionKind::Flash);
    assert_eq!(on(DeviceKind::Cuda, Attention::Gemm).unwrap(), AttentionKind::Gemm);
}

#[test]
fn only_a_changed_attention_or_packing_counts_as_changing_the_numbers() {
    let saved = json!({"attention": "flash", "cuda_wait": "block", "offload": null});
    let same = json!({"attention": "flash", "cuda_wait": "spin", "offload": {"cpu_threads": 4}});
    assert!(changed_numerics(&saved, &same).is_empty());
    let gemm = json!({"attention": "gemm"});
    assert_eq!(
        changed_numerics(&saved, &gemm),
        [("attention", "flash".to_owned(), "gemm".to_owned())]
    );
    // A checkpoint written before the settings were recorded says nothing to compare.
    assert!(changed_numerics(&serde_json::Value::Null, &gemm).is_empty());
    // One written before packing was recorded ran unpacked.
    let unpacked = json!({"attention": "flash", "pack": false});
    assert!(changed_numerics(&saved, &unpacked).is_empty());
    let packed = json!({"attention": "flash", "pack": true});
    assert_eq!(
        changed_numerics(&saved, &packed),
        [("pack", "false".to_owned(), "true".to_owned())]
    );
}

#[test]
fn alternatives_read_as_a_list() {
    assert_eq!(names::alternatives(&names::ATTENTION), "auto, gemm or flash");
    assert_eq!(names::alternatives(&names::GATHER), "pieces or after-step");
    assert_eq!(names::alternatives(&names::ACCUMULATE_ON), "auto, device or host");
}

/// The pinned budget in MiB becomes the bytes the device is given and what the run records;
/// unasked, no limit (recorded as none), and 0 is a budget of nothing, not "unset".
#[test]
fn the_pinned_budget_reaches_the_device_setting_and_the_record() {
    let asked = Requested { pinned_budget_mib: Some(1.5), ..Requested::default() };
    assert_eq!(pinned_budget(&asked), Some(3 << 19));
    let (_, effective) = tuned(&format!("{OFFLOADED}}}"), &asked);
    assert_eq!(effective.offload.unwrap().pinned_budget_mib, Some(1.5));
    let zero = Requested { pinned_budget_mib: Some(0.0), ..Requested::default() };
    assert_eq!(pinned_budget(&zero), Some(0));
    assert_eq!(pinned_budget(&Requested::default()), None);
    let (_, effective) = tuned(&format!("{OFFLOADED}}}"), &Requested::default());
    let offload = effective.offload.unwrap();
    assert_eq!(offload.pinned_budget_mib, None);
    assert_eq!(
        serde_json::to_value(&offload).unwrap()["pinned_budget_mib"],
        serde_json::Value::Null
    );
}

/// A resume's checkpoint layer asks for the recorded packing, and for the recorded attention and
/// activation checkpointing only where a GPU run goes on on the GPU; every other layer is above
/// it; a checkpoint from before the settings were recorded (`null`) asks for nothing.
#[test]
fn a_checkpoint_layer_asks_for_its_packing_and_a_gpu_runs_attention() {
    let saved = json!({"attention": "flash", "pack": true, "activation_checkpointing": true});
    let on_gpu = from_checkpoint(&saved, true);
    assert_eq!((on_gpu.attention, on_gpu.pack), (Some(Attention::Flash), Some(true)));
    assert_eq!(on_gpu.activation_checkpointing, Some(true), "what let the model fit the GPU");
    let elsewhere = from_checkpoint(&saved, false);
    assert_eq!((elsewhere.attention, elsewhere.pack), (None, Some(true)));
    assert_eq!(elsewhere.activation_checkpointing, None);
    let flag = Requested { pack: Some(false), ..Requested::default() };
    assert_eq!(
        resolve(flag, Requested::default(), Requested::default()).over(on_gpu).pack,
        Some(false)
    );
    let before = from_checkpoint(&serde_json::Value::Null, true);
    assert_eq!((before.attention, before.pack), (None, None));
}
