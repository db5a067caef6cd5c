//! Published kinds of DeepSpeed configs resolve to the values DeepSpeed would use.

use std::num::NonZeroU64;

use zeroflow_core::config::{
    AdamConfig, BatchSizes, CosineSchedule, CpuOffload, DynamicLossScale, LossScaling,
    MixedPrecision, Overrides, Precision, Scheduler, Selection, UpdateInterval, Warmup,
    WarmupCurve, WarningKind, WeightDecayMode, ZeroStage,
};

use super::{fixture, fixture_with};

const DEEPSPEED_DYNAMIC_LOSS_SCALE: DynamicLossScale = DynamicLossScale {
    initial_scale_power: 16,
    loss_scale_window: 1000,
    hysteresis: 2,
    consecutive_hysteresis: false,
    min_loss_scale: 1,
};

#[test]
fn bf16_zero2_with_cpu_offload_and_cosine_schedule() {
    let config = fixture("bf16_zero2_cpu_offload.json", 4).config;
    assert_eq!(
        config.batch,
        BatchSizes {
            train_batch_size: 64,
            micro_batch_size_per_gpu: 4,
            gradient_accumulation_steps: 4,
        }
    );
    assert_eq!(config.precision, MixedPrecision::Bf16 { check_grad_overflow: true });
    assert_eq!(
        config.optimizer,
        AdamConfig {
            mode: WeightDecayMode::Decoupled,
            lr: 3e-4,
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
            bias_correction: true,
        }
    );
    assert_eq!(
        config.scheduler,
        Some(Scheduler::WarmupCosineLr(CosineSchedule {
            warmup_min_ratio: 0.0,
            warmup_num_steps: 500,
            cos_min_ratio: 0.1,
            warmup_curve: WarmupCurve::Log,
            total_num_steps: 10_000,
        }))
    );
    let zero = config.zero;
    assert_eq!(zero.stage, ZeroStage::Gradients);
    assert_eq!(zero.offload_optimizer, Some(CpuOffload { pin_memory: true }));
    assert!(zero.overlap_comm && zero.contiguous_gradients && zero.reduce_scatter);
    assert_eq!((zero.reduce_bucket_size, zero.allgather_bucket_size), (500_000_000, 500_000_000));
    assert_eq!(config.steps_per_print, Some(10));
}

#[test]
fn megatron_fp16_zero1_uses_dynamic_loss_scaling_and_stage_1_defaults() {
    let resolved = fixture("fp16_zero1_megatron.json", 2);
    let config = resolved.config;
    assert_eq!(config.batch.micro_batch_size_per_gpu, 4, "8 / (1 accumulation step × 2 ranks)");
    assert_eq!(
        config.precision,
        MixedPrecision::Fp16(LossScaling::Dynamic(DEEPSPEED_DYNAMIC_LOSS_SCALE))
    );
    assert_eq!(config.zero.stage, ZeroStage::OptimizerStates);
    assert!(
        !config.zero.overlap_comm,
        "DeepSpeed turns overlap_comm on by default only at stage 3"
    );
    assert!(config.zero.contiguous_gradients);
    assert_eq!(config.zero.offload_optimizer, None);
    assert_eq!(config.optimizer, AdamConfig::DEEPSPEED_DEFAULT, "no optimizer section");
    assert_eq!(config.scheduler, None);
    assert_eq!(config.gradient_clipping, 1.0);
    assert!(resolved.warnings.is_empty(), "{:?}", resolved.warnings);
}

#[test]
fn hugging_face_zero2_autos_without_overrides_take_documented_defaults() {
    let resolved = fixture("hf_ds_config_zero2.json", 2);
    let config = resolved.config;
    assert_eq!(
        config.batch,
        BatchSizes {
            train_batch_size: 2,
            micro_batch_size_per_gpu: 1,
            gradient_accumulation_steps: 1,
        }
    );
    assert_eq!(config.precision, MixedPrecision::Fp32, "both enabled flags are auto → false");
    assert_eq!(config.gradient_clipping, 1.0);
    assert_eq!(config.optimizer, AdamConfig::DEEPSPEED_DEFAULT);
    assert_eq!(
        config.scheduler,
        Some(Scheduler::WarmupLr(Warmup {
            min_lr: 0.0,
            max_lr: 1e-3,
            num_steps: 1000,
            curve: WarmupCurve::Log,
        }))
    );
    assert_eq!(config.zero.offload_optimizer, Some(CpuOffload { pin_memory: true }));
    assert_eq!(
        (config.zero.reduce_bucket_size, config.zero.allgather_bucket_size),
        (200_000_000, 200_000_000)
    );
    assert!(config.zero.overlap_comm);
    assert_eq!(config.steps_per_print, Some(2000));
    let mut auto_paths: Vec<_> = resolved.auto_values.iter().map(|a| a.path.as_str()).collect();
    auto_paths.sort_unstable();
    assert_eq!(
        auto_paths,
        [
            "bf16.enabled",
            "fp16.enabled",
            "gradient_accumulation_steps",
            "gradient_clipping",
            "optimizer.params.betas",
            "optimizer.params.eps",
            "optimizer.params.lr",
            "optimizer.params.weight_decay",
            "scheduler.params.warmup_max_lr",
            "scheduler.params.warmup_min_lr",
            "scheduler.params.warmup_num_steps",
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
        ],
        "every \"auto\" of the file is reported once"
    );
}

#[test]
fn hugging_face_zero2_autos_take_the_trainers_overrides() {
    let overrides = Overrides {
        micro_batch_size_per_gpu: NonZeroU64::new(8),
        gradient_accumulation_steps: NonZeroU64::new(4),
        gradient_clipping: Some(0.5),
        precision: Some(Precision::Bf16),
        lr: Some(5e-5),
        betas: Some((0.9, 0.98)),
        eps: Some(1e-6),
        weight_decay: Some(0.01),
        warmup_num_steps: NonZeroU64::new(100),
        ..Overrides::default()
    };
    let config = fixture_with("hf_ds_config_zero2.json", 2, overrides).config;
    assert_eq!(config.batch.train_batch_size, 64, "8 × 4 × 2");
    assert_eq!(config.precision, MixedPrecision::Bf16 { check_grad_overflow: true });
    assert_eq!(config.gradient_clipping, 0.5);
    assert_eq!(
        (
            config.optimizer.lr,
            config.optimizer.betas,
            config.optimizer.eps,
            config.optimizer.weight_decay
        ),
        (5e-5, (0.9, 0.98), 1e-6, 0.01)
    );
    let Some(Scheduler::WarmupLr(warmup)) = config.scheduler else {
        panic!("expected WarmupLR, got {:?}", config.scheduler)
    };
    assert_eq!((warmup.max_lr, warmup.num_steps), (5e-5, 100), "warmup_max_lr follows the lr");
}

#[test]
fn legacy_cpu_offload_true_offloads_to_the_cpu_with_pinned_memory() {
    let resolved = fixture("legacy_cpu_offload.json", 1);
    let zero = resolved.config.zero;
    assert_eq!(zero.offload_optimizer, Some(CpuOffload { pin_memory: true }));
    assert_eq!(zero.stage, ZeroStage::Gradients);
    assert_eq!(zero.reduce_bucket_size, 7_000_000);
    assert!(zero.contiguous_gradients);
    let kinds: Vec<_> = resolved.warnings.iter().map(|w| (w.path.as_str(), &w.kind)).collect();
    assert!(
        matches!(
            kinds[..],
            [
                ("zero_optimization.cpu_offload", WarningKind::Deprecated { .. }),
                ("activation_checkpointing", WarningKind::IgnoredKey { .. }),
            ]
        ),
        "{kinds:?}"
    );
}

#[test]
fn deepspeed_examples_zenflow_config_uses_zenflow_defaults() {
    let resolved = fixture("zenflow_finetune.json", 2);
    let config = resolved.config;
    assert_eq!(config.batch.micro_batch_size_per_gpu, 16);
    let zenflow = config.zero.zenflow.expect("the config has a zenflow section");
    assert_eq!(zenflow.topk_ratio, 0.1);
    assert_eq!(
        zenflow.selection,
        Selection::Auto,
        "select_strategy and select_interval default to auto"
    );
    assert_eq!(zenflow.update_interval, UpdateInterval::Every(4));
    assert!(zenflow.overlap_step && !zenflow.offload);
    assert_eq!(
        (zenflow.auto_ratio, zenflow.full_warm_up_rounds, zenflow.pt_reserved_cores_perc),
        (0.99, 0, 0.5)
    );
    assert_eq!(config.optimizer.weight_decay, 0.01);
    let paths: Vec<_> = resolved.warnings.iter().map(|w| w.path.as_str()).collect();
    assert_eq!(paths, ["zero_allow_untested_optimizer"]);
}

#[test]
fn zenflow_with_a_step_strategy_keeps_both_intervals() {
    let zenflow = fixture("zenflow_step_strategy.json", 1).config.zero.zenflow.expect("zenflow");
    assert_eq!(zenflow.selection, Selection::Step { interval: 8 });
    assert_eq!(zenflow.update_interval, UpdateInterval::Every(4));
    assert_eq!((zenflow.topk_ratio, zenflow.full_warm_up_rounds), (0.05, 2));
    assert!(zenflow.offload);
}

#[test]
fn warmup_decay_lr_defaults_its_peak_to_0_001_not_to_the_optimizer_lr() {
    let config = fixture("warmup_decay_fp16.json", 4).config;
    assert_eq!(config.batch.train_batch_size, 128, "16 × 2 × 4");
    assert_eq!(
        config.scheduler,
        Some(Scheduler::WarmupDecayLr {
            warmup: Warmup {
                min_lr: 0.0,
                max_lr: 0.001,
                num_steps: 1000,
                curve: WarmupCurve::Linear
            },
            total_num_steps: 20_000,
        })
    );
    assert_eq!(config.optimizer.mode, WeightDecayMode::L2, "Adam with adam_w_mode false");
    let MixedPrecision::Fp16(LossScaling::Dynamic(dynamic)) = config.precision else {
        panic!("expected dynamic fp16, got {:?}", config.precision)
    };
    assert_eq!(dynamic.initial_scale(), 4096.0);
    assert_eq!(config.zero.reduce_bucket_size, 200_000_000);
}

#[test]
fn stage_3_settings_at_stage_2_are_ignored_one_warning_each() {
    let resolved = fixture("stage3_keys_at_stage2.json", 1);
    let config = resolved.config;
    assert_eq!(config.zero.stage, ZeroStage::Gradients);
    assert_eq!(config.zero.reduce_bucket_size, 500_000_000, "auto without a hidden size");
    assert_eq!(config.batch.train_batch_size, 16);
    let ignored: Vec<_> = resolved
        .warnings
        .iter()
        .filter(|w| matches!(w.kind, WarningKind::IgnoredKey { .. }))
        .map(|w| w.path.as_str())
        .collect();
    assert_eq!(
        ignored,
        [
            "zero_optimization.offload_param",
            "zero_optimization.sub_group_size",
            "zero_optimization.stage3_prefetch_bucket_size",
            "zero_optimization.stage3_param_persistence_threshold",
            "zero_optimization.stage3_max_live_parameters",
            "zero_optimization.stage3_max_reuse_distance",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save",
            "communication_data_type",
            "tensorboard",
            "flops_profiler",
            "comms_logger",
        ]
    );
    assert_eq!(ignored.len(), resolved.warnings.len(), "nothing is reported as unknown");
}

#[test]
fn an_auto_reduce_bucket_is_the_square_of_the_hidden_size() {
    let overrides = Overrides { hidden_size: NonZeroU64::new(768), ..Overrides::default() };
    let config = fixture_with("stage3_keys_at_stage2.json", 1, overrides).config;
    assert_eq!(config.zero.reduce_bucket_size, 768 * 768);
}

#[test]
fn bert_squad_adam_runs_as_adamw_without_bias_correction() {
    let config = fixture("bert_squad_fp16_zero2.json", 8).config;
    assert_eq!(config.batch.gradient_accumulation_steps, 1, "24 / (3 × 8)");
    assert_eq!(config.optimizer.mode, WeightDecayMode::Decoupled, "adam_w_mode defaults to true");
    assert!(!config.optimizer.bias_correction);
    assert_eq!(config.optimizer.lr, 3e-5);
    assert_eq!(
        config.precision,
        MixedPrecision::Fp16(LossScaling::Dynamic(DEEPSPEED_DYNAMIC_LOSS_SCALE))
    );
}

#[test]
fn a_positive_loss_scale_is_static_and_torch_adamw_decays_by_default() {
    let config = fixture("fp16_static_loss_scale.json", 2).config;
    assert_eq!(config.precision, MixedPrecision::Fp16(LossScaling::Static(128.0)));
    assert_eq!(config.batch.micro_batch_size_per_gpu, 4, "32 / (4 × 2)");
    assert_eq!(config.optimizer.mode, WeightDecayMode::Decoupled, "lower-case type accepted");
    assert_eq!(config.optimizer.weight_decay, 0.01, "torch.optim.AdamW's default weight decay");
    let Some(Scheduler::WarmupLr(warmup)) = config.scheduler else {
        panic!("expected WarmupLR, got {:?}", config.scheduler)
    };
    assert_eq!(warmup.max_lr, 6e-4, "WarmupLR peaks at the optimizer's lr by default");
}

#[test]
fn legacy_zero_flag_is_stage_1_and_legacy_bfloat16_enables_bf16() {
    let resolved = fixture("legacy_zero_flag_bfloat16.json", 1);
    let config = resolved.config;
    assert_eq!(config.zero.stage, ZeroStage::OptimizerStates);
    assert_eq!(config.zero.allgather_bucket_size, 100_000_000);
    assert_eq!(config.precision.precision(), Precision::Bf16);
    assert!(matches!(resolved.warnings[..], [ref only] if only.path == "zero_optimization"
        && matches!(only.kind, WarningKind::Deprecated { .. })));
}
