//! The memory plan's tests: its lines against the engine's buffers by hand, what checkpointing
//! changes, and the knobs a plan too large for the machine names.

use zeroflow_core::config::{Context, resolve_str};
use zeroflow_nn::AttentionKind;

use super::*;

pub(super) const GIB: u64 = 1 << 30;

/// A machine of `gpu` bytes of GPU memory and `host_total` of host memory, `host_available` of it
/// available.
pub(super) fn machine(gpu: u64, host_total: u64, host_available: u64) -> MachineMemory {
    MachineMemory {
        gpu_total: Some(gpu),
        gpu_elsewhere: None,
        host_total: Some(host_total),
        host_available: Some(host_available),
        given: false,
        host_ranks: 1,
    }
}

/// The engine's options of `bench step --mode mode` (its DeepSpeed config).
fn bench_options(mode: &str) -> EngineOptions {
    let offload = r#", "offload_optimizer": { "device": "cpu", "pin_memory": true }"#;
    let zenflow = r#", "zenflow": { "topk_ratio": 0.05, "update_interval": 4,
                      "full_warm_up_rounds": 0, "overlap_step": true }"#;
    let zero = match mode {
        "gpu" => String::new(),
        "offload" => offload.to_owned(),
        _ => format!("{offload}{zenflow}"),
    };
    let text = format!(
        r#"{{ "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {{ "enabled": true }},
              "zero_optimization": {{ "stage": 2, "reduce_bucket_size": 5e8{zero} }} }}"#
    );
    let resolved = resolve_str(&text, &Context::default()).expect("a config");
    EngineOptions::from_config(&resolved.config, 1).expect("options")
}

pub(super) fn inputs(model: &str, mode: &str, (micro_batch, seq): (usize, usize)) -> PlanInputs {
    PlanInputs {
        model: ModelSpec::parse(model).expect("a named model"),
        device: DeviceKind::Cuda,
        options: bench_options(mode),
        world_size: 1,
        rank: 0,
        micro_batch,
        seq,
        model_options: PlanOptions {
            attention: AttentionKind::Flash,
            activation_checkpointing: false,
            packed: false,
        },
        caller: Caller::Bench,
        gpu_memory: Some(140 * GIB),
    }
}

fn bytes(plan: &MemoryPlan, memory: MemoryKind, kind: &str) -> u64 {
    sum(&plan.lines, |l| l.memory == memory && l.kind == kind)
}

/// gpt2-124m with offload: 12 B per padded parameter of master weights and moments in host
/// memory, six 16 MiB staging buffers of bf16, and on the GPU the bf16 weights and gradients.
#[test]
fn offload_lines_are_the_engines_buffers_by_hand() {
    let plan = MemoryPlan::new(inputs("gpt2-124m", "offload", (8, 1024))).unwrap();
    let padded = plan.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    assert!(padded >= 124_439_808);
    let host = MemoryKind::Host;
    assert_eq!(bytes(&plan, host, "master weights and moments"), 12 * padded);
    assert_eq!(bytes(&plan, host, "staging and upload buffers"), 6 * (8 << 20) * 2);
    assert_eq!(bytes(&plan, MemoryKind::Device, "weights"), 2 * padded);
    assert_eq!(bytes(&plan, MemoryKind::Device, "gradients"), 2 * padded);
    // The host peak: the process, the batches, and the engine's run buffers (larger than
    // its set-up peak and the f32 weights before it).
    let run = CUDA_HOST_BASELINE_BYTES + 8 * 1024 * 8 * 2;
    assert_eq!(plan.host_total, run + 12 * padded + 6 * (8 << 20) * 2);
}

/// With a device share the host optimizer holds only the partition before it, and where that
/// is less than the initial weights (2 B per parameter on the GPU, drawn straight into bf16), the
/// host peak is the engine's set-up: those weights beside the share's two upload buffers (more
/// than before the engine, without the CUDA driver yet); at share 0 it is the run's, as before.
#[test]
fn a_device_share_moves_the_host_peak_to_the_initial_weights() {
    let with = |share: f64| {
        let mut inputs = inputs("gpt-1.3b", "offload", (8, 1024));
        inputs.options.offload_mut().expect("offload").stream.device_share = share;
        MemoryPlan::new(inputs).unwrap()
    };
    let (none, most) = (with(0.0), with(0.99));
    let padded = none.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    let host = MemoryKind::Host;
    let state = |plan: &MemoryPlan| bytes(plan, host, "master weights and moments");
    assert_eq!(state(&none), 12 * padded);
    let share = zeroflow_engine::device_share_len(padded as usize, 0.99) as u64;
    assert_eq!(state(&most), 12 * (padded - share));
    let run = CUDA_HOST_BASELINE_BYTES + 8 * 1024 * 8 * 2;
    let staging = 6 * (8 << 20) * 2;
    assert_eq!(none.host_total, run + 12 * padded + staging);
    let set_up = 2 * padded + zeroflow_engine::SHARE_UPLOAD_BYTES as u64;
    assert_eq!(most.host_total, run + set_up, "{most:?}");
    let before = run - (CUDA_HOST_BASELINE_BYTES - HOST_BASELINE_BYTES) + 2 * padded;
    assert!(before < most.host_total && 12 * (padded - share) < set_up);
}

/// Checkpointing lowers the GPU total by what the activation plan says, and nothing else.
#[test]
fn checkpointing_changes_only_the_activations() {
    let plain = MemoryPlan::new(inputs("gpt-1.3b", "gpu", (8, 1024))).unwrap();
    let knob = Knob::Checkpointing.apply(&plain.inputs).unwrap();
    let checkpointed = MemoryPlan::new(knob).unwrap();
    assert!(checkpointed.gpu_total < plain.gpu_total - 10 * GIB, "{checkpointed:?}");
    assert_eq!(checkpointed.host_total, plain.host_total);
}

/// Against a machine of 24 GiB of GPU memory, gpt-1.3b with the optimizer on the GPU
/// (about 26 GiB of engine state alone) is refused before anything is allocated, with how
/// much it needs and only knobs whose own plan fits: offload among them.
#[test]
fn a_plan_too_large_names_the_knobs_that_fit() {
    let machine = machine(24 * GIB, 512 * GIB, 500 * GIB);
    let plan = MemoryPlan::new(inputs("gpt-1.3b", "gpu", (8, 1024))).unwrap();
    assert!(!plan.fit(&machine).gpu);
    let error = plan.check(&machine).expect_err("does not fit").to_string();
    assert!(error.contains("GPU: needs"), "{error}");
    assert!(error.contains("of 24.00 GiB"), "{error}");
    assert!(error.contains("--mode offload"), "{error}");
    assert!(error.contains("--no-plan-check"), "{error}");
    let knobs = plan.knobs_that_fit(&machine);
    assert!(!knobs.is_empty());
    for (flag, knob_plan) in &knobs {
        assert!(knob_plan.fit(&machine).fits(), "{flag}");
        assert!(error.contains(flag.as_str()), "{flag} in {error}");
    }
    // The optimizer is on the GPU already: that knob is not offered.
    assert!(!error.contains("--mode gpu"), "{error}");
}

/// Memory other processes hold on the GPU counts against the plan: gpt-1.3b's `gpu` mode fits
/// an 80 GiB GPU alone, not beside 50 GiB of theirs, and the refusal, the start's line and the
/// table say so, naming only knobs whose plans fit beside them (offload among them).
#[test]
fn memory_other_processes_hold_on_the_gpu_counts_against_the_plan() {
    let plan = MemoryPlan::new(inputs("gpt-1.3b", "gpu", (8, 1024))).unwrap();
    let alone = machine(80 * GIB, 512 * GIB, 500 * GIB);
    assert!(plan.check(&alone).is_ok());
    assert!(!plan.summary(&alone).contains("other processes"), "{}", plan.summary(&alone));
    let shared = MachineMemory { gpu_elsewhere: Some(50 * GIB), ..alone };
    assert!(!plan.fit(&shared).gpu);
    let error = plan.check(&shared).expect_err("does not fit beside them").to_string();
    assert!(error.contains("of 80.00 GiB (50.00 GiB held by other processes)"), "{error}");
    assert!(error.contains("--mode offload"), "{error}");
    for (flag, knob_plan) in &plan.knobs_that_fit(&shared) {
        assert!(knob_plan.gpu_total + 50 * GIB <= 80 * GIB, "{flag}");
    }
    let summary = plan.summary(&shared);
    assert!(summary.contains("(50.00 GiB held by other processes)"), "{summary}");
    assert!(summary.ends_with("does not fit"), "{summary}");
    assert!(plan.table(&shared).contains("held on the GPU by other processes"));
    // Under a gibibyte (the context estimate's own error) is not said, and changes little.
    let little = MachineMemory { gpu_elsewhere: Some(GIB / 2), ..alone };
    assert!(!plan.summary(&little).contains("other processes"));
}

/// llama-8b's offload with gradient accumulation summed on the host needs its accumulator
/// and upload buffer in host memory (about 18 B per parameter): on a host of 128 GiB it does
/// not fit, and the window summed on the GPU (no host accumulator, the sum streamed through
/// the step) is named, its plan about 6 B per parameter lighter on the host.
#[test]
fn a_host_short_of_the_accumulator_names_the_gpu_sum() {
    let mut on_host = inputs("llama-8b", "offload", (2, 2048));
    on_host.options.grad_accum = 4;
    on_host.options.offload_mut().unwrap().stream.accumulate_on = AccumulateOn::Host;
    on_host.model_options.activation_checkpointing = true;
    let plan = MemoryPlan::new(on_host).unwrap();
    let machine = machine(140 * GIB, 128 * GIB, 125 * GIB);
    let error = plan.check(&machine).expect_err("does not fit").to_string();
    assert!(error.contains("--accumulate-on device"), "{error}");
    let knobs = plan.knobs_that_fit(&machine);
    let (_, summed) = knobs.iter().find(|(flag, _)| flag == "--accumulate-on device").unwrap();
    let padded = plan.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    // Its f32 staging (four chunks of 8 Mi elements) is 0.1 GiB more than the host path's.
    assert!(plan.host_total - summed.host_total >= 6 * padded - GIB / 4, "{summed:?}");
    assert!(summed.gpu_total >= plan.gpu_total + 4 * padded, "the f32 sum on the GPU");
}

/// Host memory too small for offload's 12 B per parameter: the optimizer on the GPU fits
/// a large GPU, and is named.
#[test]
fn a_host_too_small_for_offload_names_the_gpu_optimizer() {
    let machine = machine(140 * GIB, 16 * GIB, 12 * GIB);
    let plan = MemoryPlan::new(inputs("gpt-1.3b", "offload", (8, 1024))).unwrap();
    let error = plan.check(&machine).expect_err("does not fit").to_string();
    assert!(error.contains("Host: needs"), "{error}");
    assert!(error.contains("--mode gpu"), "{error}");
    assert!(!error.contains("GPU: needs"), "{error}");
}

/// A host that holds the offloaded optimizer with 16-bit moments but not with fp32 ones: the
/// error names the moments' dtype as a knob that fits, and the bf16 plan holds 4 fewer bytes
/// per element of host state.
#[test]
fn a_host_short_of_fp32_moments_names_16_bit_moments() {
    let fp32 = MemoryPlan::new(inputs("gpt-1.3b", "offload", (8, 1024))).unwrap();
    let mut bf16_inputs = inputs("gpt-1.3b", "offload", (8, 1024));
    bf16_inputs.options.offload_mut().unwrap().moments = OptimizerStateDtype::Bf16;
    let bf16 = MemoryPlan::new(bf16_inputs).unwrap();
    let state = |plan: &MemoryPlan| bytes(plan, MemoryKind::Host, "master weights and moments");
    assert_eq!(state(&fp32) - state(&bf16), state(&fp32) / 3, "12 -> 8 bytes per element");
    let between = (fp32.host_total + bf16.host_total) / 2;
    let machine = machine(140 * GIB, between + GIB, between);
    let error = fp32.check(&machine).expect_err("does not fit").to_string();
    assert!(error.contains("optimizer_state_dtype"), "{error}");
    assert_eq!(bf16.check(&machine).map_err(|e| e.to_string()), Ok(()));
}

/// ZenFlow's device buffers (the unselected columns' gradient sums, two of f32, and the weights
/// of the step before) put llama-8b at 4 × 2048 with checkpointing past an 80 GiB GPU, where the
/// exact offload fits, and so does ZenFlow with its step not overlapped: the refusal names them
/// (measured on an H100: ZenFlow refused with "use a smaller model" while the exact offload of
/// the same run trained). The delayed update, whose weights of the step before are on the GPU
/// too, names the exact offload the same way, in the config's words.
#[test]
fn zenflow_too_large_for_the_gpu_names_the_exact_offload() {
    let mut zenflow = inputs("llama-8b", "zenflow", (4, 2048));
    zenflow.model_options.activation_checkpointing = true;
    let plan = MemoryPlan::new(zenflow).unwrap();
    let h100 = machine(80 * GIB, 128 * GIB, 125 * GIB);
    assert!(!plan.fit(&h100).gpu, "{}", super::gib(plan.gpu_total));
    let error = plan.check(&h100).expect_err("does not fit").to_string();
    assert!(error.contains("Fits with: --mode offload (GPU"), "{error}");
    let knobs = plan.knobs_that_fit(&h100);
    let (_, exact) = knobs.iter().find(|(flag, _)| flag == "--mode offload").expect("named");
    assert_eq!(exact.inputs.options.offload().unwrap().update, OffloadUpdate::Exact);
    assert!(exact.fit(&h100).fits() && exact.gpu_total < plan.gpu_total);
    // As a run of it takes it on one GPU: with the device share `fit` chooses there (more of the
    // GPU, less of the host than at share 0).
    let at_zero = Knob::ExactOffload { zenflow: true }.apply(&plan.inputs).unwrap();
    let on_h100 = PlanInputs { gpu_memory: h100.gpu_total, ..at_zero.clone() };
    let fit = fit_device_share(&on_h100, 0).unwrap().share;
    assert!(fit > 0.0);
    assert_eq!(exact.inputs.options.offload().unwrap().stream.device_share, fit);
    let at_zero = MemoryPlan::new(at_zero).unwrap();
    assert!(exact.gpu_total > at_zero.gpu_total && exact.host_total < at_zero.host_total);
    // `bench step`'s words for ZenFlow not overlapped.
    assert!(error.contains("--mode zenflow-inline (GPU"), "{error}");

    // `train`'s words; and ZenFlow with its step not overlapped holds one f32 sum of the
    // unselected columns instead of two and no weights of the step before: it fits too.
    let mut train = plan.inputs.clone();
    train.caller = Caller::Train { resumed: false, samples: false };
    let plan = MemoryPlan::new(train).unwrap();
    let error = plan.check(&h100).expect_err("does not fit").to_string();
    assert!(error.contains("the exact offload (no zero_optimization.zenflow) (GPU"), "{error}");
    let inline = "ZenFlow's step not overlapped (zero_optimization.zenflow.overlap_step: false)";
    let knobs = plan.knobs_that_fit(&h100);
    let (_, inline_plan) = knobs.iter().find(|(flag, _)| flag == inline).expect("named");
    let padded = plan.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    assert!(plan.gpu_total - inline_plan.gpu_total >= 4 * padded + 2 * padded, "{inline_plan:?}");
    assert!(!inline_plan.inputs.options.zenflow().unwrap().overlap_step);

    let mut delayed = inputs("llama-8b", "offload", (4, 2048));
    delayed.model_options.activation_checkpointing = true;
    delayed.caller = Caller::Train { resumed: false, samples: false };
    delayed.options.offload_mut().unwrap().update = OffloadUpdate::Delayed { warmup: 2 };
    let plan = MemoryPlan::new(delayed).unwrap();
    let exact = Knob::ExactOffload { zenflow: false }.apply(&plan.inputs).unwrap();
    let exact = MemoryPlan::new(exact).unwrap();
    assert!(exact.gpu_total < plan.gpu_total, "the weights of the step before");
    let between = machine((exact.gpu_total + plan.gpu_total) / 2, 128 * GIB, 125 * GIB);
    let error = plan.check(&between).expect_err("does not fit").to_string();
    assert!(
        error.contains("the exact offload (zeroflow.delayed_update.enabled: false)"),
        "{error}"
    );
    // Where the update is exact already, the knob changes nothing and is not named.
    assert!(Knob::ExactOffload { zenflow: false }.apply(&exact.inputs).is_none());
}

/// ZenFlow's window set aside in host memory keeps `overlap_step` with the GPU of ZenFlow not
/// overlapped (the one f32 window, no aside weights) and 6 bytes per parameter more of host
/// memory (the window's copy, the CPU's bf16 weights): for llama-8b on an 80 GiB GPU beside a
/// 125 GiB host it is named where the moments are 16-bit (14 B per parameter) and not with fp32
/// moments (18).
#[test]
fn zenflow_aside_in_host_memory_keeps_the_overlap_on_an_h100_with_16_bit_moments() {
    let h100 = machine(80 * GIB, 128 * GIB, 125 * GIB);
    for moments in [OptimizerStateDtype::Fp32, OptimizerStateDtype::Bf16] {
        let mut zenflow = inputs("llama-8b", "zenflow", (4, 2048));
        zenflow.model_options.activation_checkpointing = true;
        zenflow.options.offload_mut().unwrap().moments = moments;
        let plan = MemoryPlan::new(zenflow).unwrap();
        assert!(!plan.fit(&h100).gpu, "{moments:?}: {}", super::gib(plan.gpu_total));
        let aside = MemoryPlan::new(Knob::ZenFlowAsideHost.apply(&plan.inputs).unwrap()).unwrap();
        let inline = MemoryPlan::new(Knob::ZenFlowInline.apply(&plan.inputs).unwrap()).unwrap();
        assert!(aside.inputs.options.zenflow().unwrap().overlap_step);
        assert_eq!(aside.gpu_total, inline.gpu_total, "{moments:?}: the one window on the GPU");
        let n = plan.inputs.model.flat_layout(1).unwrap().padded_len() as f64;
        let more = (aside.host_total - inline.host_total) as f64;
        // Less the streamed path's bounded staging.
        assert!((more / n - 6.0).abs() < 0.05, "{moments:?}: {more} bytes more");
        let knobs = plan.knobs_that_fit(&h100);
        let named = knobs.iter().any(|(flag, _)| flag == "--zenflow-aside host");
        assert_eq!(named, moments == OptimizerStateDtype::Bf16, "{moments:?}: {knobs:?}");
        // With fp32 moments the refusal names it beside 16-bit moments, after the knobs that fit
        // alone; no pair holds one of those.
        if moments == OptimizerStateDtype::Fp32 {
            let error = plan.check(&h100).expect_err("does not fit").to_string();
            let pair = "or with two together where neither alone does: --zenflow-aside host and \
                        16-bit Adam moments";
            assert!(error.contains("Fits with: --mode offload (GPU"), "{error}");
            assert!(error.contains(pair), "{error}");
            let (_, pairs) = plan.ways_to_fit(&h100);
            assert_eq!(pairs.len(), 1, "{pairs:?}");
        }
        // Set aside already, or not overlapped: the knob changes nothing.
        assert!(Knob::ZenFlowAsideHost.apply(&aside.inputs).is_none());
        assert!(Knob::ZenFlowAsideHost.apply(&inline.inputs).is_none());
    }
}

/// Unasked, ZenFlow's window goes to host memory where only that fits: llama-8b with 16-bit
/// moments on an 80 GiB GPU and a 125 GiB host; not with fp32 moments (the host has no room),
/// not on a GPU with room for it (the H200's), not where the device is asked for.
#[test]
fn unasked_zenflow_sets_its_window_aside_in_host_memory_where_only_that_fits() {
    let h100 = machine(80 * GIB, 128 * GIB, 125 * GIB);
    let h200 = machine(139 * GIB, 128 * GIB, 125 * GIB);
    let zenflow = |moments| {
        let mut inputs = inputs("llama-8b", "zenflow", (4, 2048));
        inputs.model_options.activation_checkpointing = true;
        inputs.options.offload_mut().unwrap().moments = moments;
        inputs
    };
    let asked = |aside| Requested { zenflow_aside: aside, ..Requested::default() };
    for (moments, on, ask, want) in [
        (OptimizerStateDtype::Bf16, &h100, None, ZenFlowAside::Host),
        (OptimizerStateDtype::Fp32, &h100, None, ZenFlowAside::Device),
        (OptimizerStateDtype::Bf16, &h200, None, ZenFlowAside::Device),
        (OptimizerStateDtype::Bf16, &h100, Some(ZenFlowAside::Device), ZenFlowAside::Device),
    ] {
        let (mut requested, mut inputs) = (asked(ask), zenflow(moments));
        resolve_zenflow_aside(&mut requested, &mut inputs, on).unwrap();
        let got = inputs.options.offload().unwrap().stream.zenflow_aside;
        assert_eq!(got, want, "{moments:?} on {on:?}, asked {ask:?}");
        assert_eq!(requested.zenflow_aside, ask.or((want == ZenFlowAside::Host).then_some(want)));
        if want == ZenFlowAside::Host {
            assert!(MemoryPlan::new(inputs).unwrap().fit(on).fits());
        }
    }
}

/// Where no knob alone brings a run under but two together do, the refusal names the pairs
/// instead of "use a smaller model": llama-8b's ZenFlow at micro-batch 8 without checkpointing
/// (207.6 GiB) on an 80 GiB GPU, which checkpointing with the exact offload brings to 49.7 GiB.
#[test]
fn where_no_knob_alone_fits_two_together_are_named() {
    let mut zenflow = inputs("llama-8b", "zenflow", (8, 2048));
    zenflow.caller = Caller::Train { resumed: false, samples: false };
    let plan = MemoryPlan::new(zenflow).unwrap();
    let h100 = machine(80 * GIB, 128 * GIB, 125 * GIB);
    assert!(plan.knobs_that_fit(&h100).is_empty());
    let error = plan.check(&h100).expect_err("does not fit").to_string();
    let pair = "two together do: --activation-checkpointing and the exact offload (no \
                zero_optimization.zenflow) (GPU";
    assert!(error.contains(pair), "{error}");
    assert!(!error.contains("smaller model"), "{error}");
    let (_, pairs) = plan.ways_to_fit(&h100);
    for (flags, pair_plan) in &pairs {
        assert!(pair_plan.fit(&h100).fits(), "{flags}");
        let options = &pair_plan.inputs.options;
        assert!(
            pair_plan.inputs.model_options.activation_checkpointing
                || pair_plan.inputs.micro_batch < 8,
            "{flags}"
        );
        assert!(options.zenflow().is_none() || !options.zenflow().unwrap().overlap_step, "{flags}");
    }
    let json = plan.to_json(&h100);
    assert_eq!(json["knob_pairs_that_fit"].as_array().unwrap().len(), pairs.len());
    // A plan that fits, or that one knob brings under, names no pairs.
    assert!(
        plan.to_json(&machine(400 * GIB, 512 * GIB, 500 * GIB))["knob_pairs_that_fit"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// The ranks of one host share its memory: llama-8b offloaded on two GPUs of one host holds
/// half the optimizer per rank, which alone fits 64 GiB of host, but not twice over; the check,
/// the start's line and the table say so. A GPU too small for the weights and gradients is not
/// sent to more GPUs, which ZeRO-1/2 would fill the same.
#[test]
fn the_ranks_of_one_host_share_its_memory() {
    let mut two = inputs("llama-8b", "offload", (1, 2048));
    (two.world_size, two.model_options.activation_checkpointing) = (2, true);
    let plan = MemoryPlan::new(two).unwrap();
    let alone = machine(140 * GIB, 64 * GIB, 64 * GIB);
    assert!(plan.host_total < 64 * GIB && plan.host_total * 2 > 64 * GIB, "{}", plan.host_total);
    assert!(plan.check(&alone).is_ok());
    let shared = MachineMemory { host_ranks: 2, ..alone };
    assert!(!plan.fit(&shared).host);
    let error = plan.check(&shared).expect_err("two ranks do not fit").to_string();
    let both = format!(" × 2 ranks on this host = {}", super::gib(plan.host_total * 2));
    let needs = format!("Host: needs {}{both}", super::gib(plan.host_total));
    assert!(error.contains(&needs), "{needs:?} not in: {error}");
    assert!(plan.summary(&shared).contains(&both), "{}", plan.summary(&shared));
    assert!(plan.table(&shared).contains("total of the 2 ranks on this host"));
    assert_eq!(plan.to_json(&shared)["machine_host_ranks"], 2);
    let small_gpu = machine(24 * GIB, 512 * GIB, 500 * GIB);
    let error = plan.check(&small_gpu).expect_err("the weights alone are 15 GiB").to_string();
    assert!(
        error.contains("more GPUs do not lower it") && !error.contains("more hosts"),
        "{error}"
    );
}

/// A plan that fits says so and checks out.
#[test]
fn a_plan_that_fits_passes_the_check() {
    let machine = machine(140 * GIB, 512 * GIB, 500 * GIB);
    let plan = MemoryPlan::new(inputs("gpt2-124m", "zenflow", (8, 1024))).unwrap();
    assert_eq!(plan.check(&machine).map_err(|e| e.to_string()), Ok(()));
    assert!(plan.summary(&machine).ends_with("fits"), "{}", plan.summary(&machine));
    let json = plan.to_json(&machine);
    assert_eq!(json["gpu_total_bytes"], plan.gpu_total);
    assert_eq!(json["host_total_bytes"], plan.host_total);
}

/// A resumed run reads the checkpoint's optimizer state through the reader's buffers into an
/// offloaded optimizer's own state (bf16 moments through two pieces): its plan is the run's plus
/// those, so that llama-8b's exact offload resumes on the H200's host (124 GiB available) as it
/// trains there. With the optimizer on the GPU the restore reads the whole partition first (12 B
/// per parameter).
#[test]
fn a_resume_plans_the_run_plus_the_restores_pieces() {
    let with = |model: &str, mode: &str, resumed: bool| {
        let shape = if model == "gpt-1.3b" { (8, 1024) } else { (4, 2048) };
        let mut inputs = inputs(model, mode, shape);
        inputs.model_options.activation_checkpointing = true;
        inputs.caller = Caller::Train { resumed, samples: false };
        MemoryPlan::new(inputs).unwrap()
    };
    let (fresh, resumed) = (with("llama-8b", "offload", false), with("llama-8b", "offload", true));
    let padded = fresh.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    let reading = zeroflow_hf::direct::READ_BUFFERS_BYTES as u64;
    assert_eq!(resumed.host_total - fresh.host_total, reading, "{resumed:?}");
    assert!(padded >= 8_000_000_000);
    let h200 = machine(140 * GIB, 125 * GIB, 124 * GIB);
    assert!(resumed.fit(&h200).fits(), "{}", resumed.summary(&h200));
    let line = "the checkpoint's optimizer state (read into the engine's)";
    assert_eq!(bytes(&resumed, MemoryKind::Host, line), reading);
    let mut bf16_moments = resumed.inputs.clone();
    bf16_moments.options.offload_mut().unwrap().moments = OptimizerStateDtype::Bf16;
    let resumed = MemoryPlan::new(bf16_moments).unwrap();
    let pieces = 2 * 4 * zeroflow_engine::RESTORE_PIECE as u64;
    assert_eq!(bytes(&resumed, MemoryKind::Host, line), pieces + reading);
    let resumed = with("gpt-1.3b", "gpu", true);
    let padded = resumed.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    assert_eq!(bytes(&resumed, MemoryKind::Host, line), 12 * padded + reading);
}

/// Samples during training (`--sample-every`) hold the weights in f32 on rank 0's host while
/// one is written: 4 B per parameter on top of the run (llama-8b: 29.9 GiB), counted so that a run
/// whose host has no room for them is refused before it starts, not killed at its first sample.
#[test]
fn samples_during_training_count_the_weights_in_f32_on_rank_0() {
    let with = |samples: bool, (rank, world_size): (usize, usize)| {
        let mut inputs = inputs("llama-8b", "offload", (4, 2048));
        inputs.model_options.activation_checkpointing = true;
        (inputs.caller, inputs.rank) = (Caller::Train { resumed: false, samples }, rank);
        inputs.world_size = world_size;
        MemoryPlan::new(inputs).unwrap()
    };
    let (plain, sampled) = (with(false, (0, 1)), with(true, (0, 1)));
    let padded = plain.inputs.model.flat_layout(1).unwrap().padded_len() as u64;
    let line = "a sample's weights in f32 (transient, --sample-every)";
    assert_eq!(bytes(&sampled, MemoryKind::Host, line), 4 * padded);
    assert_eq!(sampled.host_total - plain.host_total, 4 * padded);
    let second = with(true, (1, 2));
    assert_eq!(bytes(&second, MemoryKind::Host, line), 0, "rank 1 writes no samples");
    // At share 0: 90.9 GiB without samples, 120.8 with them.
    let host = machine(140 * GIB, 128 * GIB, 110 * GIB);
    assert!(plain.fit(&host).fits() && !sampled.fit(&host).fits());
}

/// A checkpoint's files, as the disk warning counts them: the weights in the run's type (bf16 on
/// a GPU, f32 on the CPU device) and the optimizer state, 4 B of ZenFlow's window more.
#[test]
fn a_checkpoint_takes_the_runs_weights_and_the_optimizer_state() {
    for (mode, state) in [("gpu", 12), ("offload", 12), ("zenflow", 16)] {
        let mut inputs = inputs("gpt2-124m", mode, (8, 1024));
        let padded = inputs.model.flat_layout(1).unwrap().padded_len() as u64;
        let on_gpu = MemoryPlan::new(inputs.clone()).unwrap().checkpoint_disk_bytes;
        assert_eq!(on_gpu, (2 + state) * padded, "{mode} on a GPU");
        inputs.device = DeviceKind::Cpu;
        let on_cpu = MemoryPlan::new(inputs).unwrap().checkpoint_disk_bytes;
        assert_eq!(on_cpu, (4 + state) * padded, "{mode} on the CPU device");
    }
}
