//! Engine options from a resolved DeepSpeed config.

use zeroflow_core::config::{Config, LossScaling, MixedPrecision, ZeroStage};
use zeroflow_device::HostMemory;
use zeroflow_optim::{AdamWConfig, WeightDecayMode};

use crate::{
    DEFAULT_STREAM_CHUNK, DynamicScaler, EngineOptions, LossScaler, Stage, ZenFlowOptions,
};

impl EngineOptions {
    /// The options a resolved config asks for; `cpu_threads` is this rank's share of the host's
    /// cores for the CPU optimizer. The offload stream's tuning, which a DeepSpeed config does not
    /// have, takes its defaults: [`DEFAULT_STREAM_CHUNK`] and the stores the engine picks per path.
    ///
    /// Non-finite gradients always skip the step, also in bf16 with `check_grad_overflow: false`
    /// (DeepSpeed would apply the NaNs to the weights).
    ///
    /// ZenFlow's settings are passed on as they are; [`crate::Engine::new`] refuses what it cannot
    /// run (gradient accumulation, the delayed update, a dynamic loss scale) with an error that
    /// says what to change. DeepSpeed makes `update_interval` its accumulation boundary and steps
    /// the selected columns every micro-step; here one engine step (with
    /// `gradient_accumulation_steps: 1`) is one ZenFlow iteration. With `overlap_step`, the CPU
    /// step runs on the cores `pt_reserved_cores_perc` does not reserve for the training thread
    /// (at least one); ZenFlow's own `offload` (the selected columns' moments in host memory) is
    /// not supported: they stay on the device (`topk_ratio` × 8 bytes per parameter), with a
    /// warning.
    pub fn from_config(config: &Config, cpu_threads: usize) -> Self {
        let cpu_threads = match &config.zero.zenflow {
            Some(z) if z.overlap_step => {
                let reserved = (cpu_threads as f64 * z.pt_reserved_cores_perc).round() as usize;
                cpu_threads.saturating_sub(reserved).max(1)
            }
            _ => cpu_threads,
        };
        if config.zero.zenflow.is_some_and(|z| z.offload) {
            tracing::warn!(
                "zero_optimization.zenflow.offload: the selected columns' moments stay in GPU \
                 memory (topk_ratio × 8 bytes per parameter); host-resident ZenFlow moments are \
                 not supported"
            );
        }
        let stage = match config.zero.stage {
            ZeroStage::Disabled => Stage::Zero0,
            ZeroStage::OptimizerStates => Stage::Zero1,
            ZeroStage::Gradients => Stage::Zero2,
        };
        let scaler = match config.precision {
            MixedPrecision::Fp32 | MixedPrecision::Bf16 { .. } => LossScaler::None,
            MixedPrecision::Fp16(LossScaling::Static(scale)) => LossScaler::Static(scale as f32),
            MixedPrecision::Fp16(LossScaling::Dynamic(d)) => {
                LossScaler::Dynamic(DynamicScaler::new(
                    d.initial_scale_power,
                    d.loss_scale_window,
                    d.min_loss_scale as f32,
                    d.hysteresis.try_into().unwrap_or(u32::MAX),
                    d.consecutive_hysteresis,
                ))
            }
        };
        let opt = &config.optimizer;
        let mode = match opt.mode {
            zeroflow_core::config::WeightDecayMode::Decoupled => WeightDecayMode::Decoupled,
            zeroflow_core::config::WeightDecayMode::L2 => WeightDecayMode::L2,
        };
        EngineOptions {
            stage,
            grad_accum: config.batch.gradient_accumulation_steps,
            clip: (config.gradient_clipping > 0.0).then_some(config.gradient_clipping),
            offload: config
                .zero
                .offload_optimizer
                .map(|o| if o.pin_memory { HostMemory::Pinned } else { HostMemory::Pageable }),
            reduce_bucket: usize::try_from(config.zero.reduce_bucket_size).unwrap_or(usize::MAX),
            adamw: AdamWConfig {
                lr: opt.lr,
                betas: opt.betas,
                eps: opt.eps,
                weight_decay: opt.weight_decay,
                mode,
                bias_correction: opt.bias_correction,
            },
            scaler,
            cpu_threads,
            delayed_update: config
                .zeroflow
                .delayed_update
                .enabled
                .then_some(config.zeroflow.delayed_update.warmup_steps),
            zenflow: config.zero.zenflow.map(|z| ZenFlowOptions {
                topk_ratio: z.topk_ratio,
                selection: z.selection,
                update_interval: z.update_interval,
                auto_ratio: z.auto_ratio,
                overlap_step: z.overlap_step,
                full_warm_up_rounds: z.full_warm_up_rounds,
            }),
            stream_chunk: DEFAULT_STREAM_CHUNK,
            copy_stores: None,
            gather_in_pieces: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_core::config::{Context, Selection, UpdateInterval, resolve_str};

    use super::*;

    /// A DeepSpeed config has no offload stream tuning: the engine streams in chunks of 2^23
    /// elements and picks the stores of the weight copy itself.
    #[test]
    fn the_offload_stream_tuning_takes_its_defaults() {
        let text = r#"{
            "train_batch_size": 4,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        }"#;
        let resolved = resolve_str(text, &Context::default()).expect("a valid config");
        let options = EngineOptions::from_config(&resolved.config, 1);
        assert_eq!(options.stream_chunk, 1 << 23);
        assert_eq!(options.copy_stores, None);
        assert!(options.gather_in_pieces);
    }

    /// A DeepSpeed config's `zero_optimization.zenflow` reaches the engine as it is written.
    #[test]
    fn the_zenflow_section_becomes_the_engine_options() {
        let text = r#"{
            "train_batch_size": 4,
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "zenflow": {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 8,
                            "update_interval": 4, "overlap_step": true, "full_warm_up_rounds": 3}
            }
        }"#;
        let resolved = resolve_str(text, &Context::default()).expect("a valid config");
        let options = EngineOptions::from_config(&resolved.config, 1);
        let want = ZenFlowOptions {
            topk_ratio: 0.25,
            selection: Selection::Step { interval: 8 },
            update_interval: UpdateInterval::Every(4),
            auto_ratio: 0.99,
            overlap_step: true,
            full_warm_up_rounds: 3,
        };
        assert_eq!(options.zenflow, Some(want));
        assert_eq!(want.intervals().expect("supported settings"), (8, 4));
        // overlap_step: DeepSpeed's default pt_reserved_cores_perc 0.5 leaves half the cores to
        // the CPU step, and always one.
        assert_eq!(EngineOptions::from_config(&resolved.config, 16).cpu_threads, 8);
        assert_eq!(options.cpu_threads, 1);
        let quarter = text.replace(
            r#""full_warm_up_rounds": 3"#,
            r#""full_warm_up_rounds": 3, "pt_reserved_cores_perc": 0.25"#,
        );
        let quarter = resolve_str(&quarter, &Context::default()).expect("a valid config");
        assert_eq!(EngineOptions::from_config(&quarter.config, 16).cpu_threads, 12);
        // Without the section (an unknown key in zero_optimization is an error, as in DeepSpeed).
        let without = r#"{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}"#;
        let without = resolve_str(without, &Context::default()).expect("a valid config");
        assert_eq!(EngineOptions::from_config(&without.config, 1).zenflow, None);
    }
}
