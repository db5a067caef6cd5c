//! How the engine runs ([`EngineOptions`]), and the options a resolved DeepSpeed config asks for.
//!
//! The options say in their types which update path the engine takes (DESIGN.md §5): the
//! optimizer on the device, or offloaded to the CPU with the exact step, the delayed update or
//! ZenFlow; combinations no path runs (a delayed update without offload, ZenFlow with the
//! delayed update) cannot be written down.

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::config::{Config, LossScaling, MixedPrecision, ZeroStage};
use zeroflow_device::HostMemory;
use zeroflow_optim::{AdamWConfig, Stores, WeightDecayMode};

use crate::{
    DEFAULT_SPECULATION_BUDGET, DEFAULT_STREAM_CHUNK, DynamicScaler, EngineError, LossScaler,
    ZenFlowOptions,
};

/// Which ZeRO stage partitions what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Plain data parallelism: gradients are all-reduced, every rank holds all optimizer state.
    Zero0,
    /// Optimizer state partitioned; gradients reduced once per optimizer step.
    Zero1,
    /// Optimizer state and gradients partitioned; gradients reduced every micro-step.
    Zero2,
}

/// How the engine runs.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub stage: Stage,
    /// Micro-steps per optimizer step (at least 1; ZenFlow: exactly 1).
    pub grad_accum: u64,
    /// Clip the global gradient norm to this value.
    pub clip: Option<f64>,
    /// Elements per reduction bucket.
    pub reduce_bucket: usize,
    pub adamw: AdamWConfig,
    pub scaler: LossScaler,
    /// Where the fp32 optimizer state lives and how it is stepped.
    pub placement: Placement,
}

/// Where the fp32 optimizer state lives.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// In device memory, stepped by the device's AdamW.
    Device,
    /// In host memory, stepped on the CPU (ZeRO-Offload).
    Offload(Offload),
}

/// CPU optimizer offload.
#[derive(Clone, Debug, PartialEq)]
pub struct Offload {
    /// Pinned or pageable host memory for the optimizer state and the staging buffers.
    pub memory: HostMemory,
    /// Threads of the CPU optimizer.
    pub cpu_threads: usize,
    /// How the CPU step relates to the device's next forward and backward.
    pub update: OffloadUpdate,
    /// The tuning of the stream of gradients out and weights back.
    pub stream: StreamOptions,
    /// The element type of the host Adam moments (`zeroflow.optimizer_state_dtype`; the master
    /// weights are fp32 either way). Every offload path keeps its host moments in it; ZenFlow's
    /// selected columns keep fp32 moments on the device. Changes the numbers: bf16 moments are
    /// rounded stochastically (zeroflow-optim's `rounding`).
    pub moments: OptimizerStateDtype,
}

/// How the offloaded optimizer step is taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OffloadUpdate {
    /// Every step's weights are on the device before the next forward.
    Exact,
    /// The ZeRO-Offload paper's delayed parameter update: after `warmup` exact steps, the CPU
    /// step of step t runs while step t + 1 computes with the weights of t − 1.
    Delayed { warmup: u64 },
    /// ZenFlow's split update (see [`ZenFlowOptions`]; its `overlap_step` is its delayed update).
    ZenFlow(ZenFlowOptions),
}

/// The offload stream's tuning. Any values give bit-identical results (a device share: on the
/// CPU device, whose AdamW is the host's; a GPU's does the same operations, fused multiply-adds
/// included).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StreamOptions {
    /// The most elements of the model's dtype that one host staging buffer holds, and so the
    /// chunk of the streaming step (gradients out, weights back) and the largest piece a
    /// bucket's gradients are copied to the host in (default [`DEFAULT_STREAM_CHUNK`]). Host
    /// staging is 4 such buffers, and the streaming step's outgoing weights 2 more. It trades
    /// per-copy overhead against the chance that a chunk is still in the CPU's caches when it is
    /// next read. At least 1 ([`crate::Engine::new`] refuses 0).
    pub chunk: usize,
    /// How the CPU AdamW writes the copy of the updated weights in the model's dtype that goes
    /// back to the device, where that copy is bf16: [`Stores::Normal`] leaves it in the caches,
    /// where the device's read finds it, [`Stores::NonTemporal`] sends it straight to memory
    /// without reading the lines first. `None` (the default) picks per path: normal where the
    /// step streams (each chunk is uploaded as soon as it is written), non-temporal where the
    /// whole partition's copy is written before its upload.
    pub copy_stores: Option<Stores>,
    /// With several ranks, the streaming step: gather each uploaded piece of the partition while
    /// the CPU steps the next (the default: gpt-1.3b on two H200s, 0.366 s per step against
    /// 0.384 s, BENCHMARKS.md), or all of it after the step.
    pub gather_in_pieces: bool,
    /// The exact update's speculative step (DESIGN.md §5): the most bytes of host memory the
    /// backups of pieces stepped during backward, before the norm is known, may take (12 bytes
    /// per element, 12 + the dtype's size on the streaming path, which also holds their weights
    /// until the upload). Pieces beyond it are stepped at the step, as without speculation; 0
    /// turns speculation off. Default [`DEFAULT_SPECULATION_BUDGET`]. The delayed update and
    /// ZenFlow do not speculate.
    pub speculation_budget: usize,
    /// Where ZeRO-2 with gradient accumulation sums a window's reduced gradients: on the host,
    /// each micro-step's copied out and added there, or on the device, in an f32 accumulator of
    /// the partition (4 bytes per element of device memory), copied out once per window. The sum
    /// is the same, bit for bit (the same f32 additions in the same order). Stages 0 and 1 reduce
    /// once per window and need neither.
    pub accumulate_on: AccumulateOn,
    /// Where ZenFlow's CPU step reads its window from (default [`DEFAULT_ZENFLOW_ASIDE`]). The
    /// CPU step reads the same window either way, bit for bit.
    pub zenflow_aside: ZenFlowAside,
    /// The exact streaming step (one micro-step per step, or a window summed on the device; one
    /// rank holding every weight) leaves its CPU work to the next forward, which opens the
    /// weights piece by piece: each of its kernels waits only for the upload of the weights it
    /// reads, so the forward runs while the CPU steps the rest (DESIGN.md §5). ZenFlow's window
    /// set aside in host memory (one rank) applies its CPU step's weights the same way: in pieces
    /// the forward opens as it reaches them. The caller's model must then call
    /// [`crate::ModelIo::open`] before reading weights (see there); off by default, since the
    /// engine cannot tell whether it does. The results are the same, bit for bit.
    pub overlap_forward: bool,
    /// The share of the partition, from its end, whose fp32 master weights and moments are
    /// stepped by the device's AdamW while the CPU streams the rest: the host's CPU then moves
    /// the bytes of only that rest each step (DESIGN.md §5). Where the share's state lives is
    /// [`StreamOptions::device_share_state`]: in device memory (16 bytes per element of device
    /// memory: the state and an f32 copy of its gradients; the host optimizer holds only the
    /// elements before the share), or in host memory, staged through the device a piece at a
    /// time. Whatever reads the state (a checkpoint, `master_weights`) reads the share's part
    /// where it lives. 0 (the default) steps everything on the CPU. It acts on the exact
    /// streaming step with fp32 moments — with one micro-step per step on every rank's
    /// partition, with a window summed on the device where one rank holds every weight (a
    /// speculation then steps the host's elements only); elsewhere a share above 0 is refused.
    /// The arithmetic is the CPU's, operation for operation (bit-identical on the CPU device).
    pub device_share: f64,
    /// Where a device share keeps its fp32 state (default [`ShareState::Device`]).
    pub device_share_state: ShareState,
}

/// Where the optimizer's device share keeps its fp32 master weights and moments
/// ([`StreamOptions::device_share`]). The arithmetic is the same either way, bit for bit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShareState {
    /// In device memory, for good: 16 bytes per element of device memory.
    #[default]
    Device,
    /// In page-locked host memory (12 bytes per element, as the host optimizer's own), copied
    /// up a piece at a time on a stream of the share's own, stepped there and copied back on
    /// another while the CPU steps the rest (DESIGN.md §5): the device holds a few pieces'
    /// buffers only. The GPU's copies draw on the host's memory bandwidth beside the CPU's, and
    /// each element the device steps spares the host the CPU path's 8 bytes of gradient and
    /// weight copies.
    Host,
}

/// Where ZenFlow's CPU step reads its window from ([`StreamOptions`], DESIGN.md §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZenFlowAside {
    /// The window stays on the device and is streamed through bounded host staging (host: 12
    /// bytes per parameter); with `overlap_step` a second fp32 device window (4 bytes per
    /// parameter of device memory) holds the window the worker steps.
    Device,
    /// The window is copied into a pinned host accumulator at its end and the CPU steps the
    /// whole partition from there into a whole-partition upload buffer, applied at once (inline)
    /// or at the next window's end (`overlap_step`, after the worker is joined and before the
    /// next copy into the same accumulator): host 18 bytes per parameter with fp32 moments and
    /// bf16 weights (14 with bf16 moments), on the device the one window alone, as inline (for
    /// a GPU without room for the second window and weights).
    Host,
}

/// [`StreamOptions::zenflow_aside`]'s default.
pub const DEFAULT_ZENFLOW_ASIDE: ZenFlowAside = ZenFlowAside::Device;

/// Where the accumulating offload path sums the micro-steps' gradients ([`StreamOptions`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AccumulateOn {
    /// On the device where its free memory at set-up is at least twice the accumulator's
    /// size, else on the host (the CPU device: on the host).
    #[default]
    Auto,
    Device,
    Host,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            chunk: DEFAULT_STREAM_CHUNK,
            copy_stores: None,
            gather_in_pieces: true,
            speculation_budget: DEFAULT_SPECULATION_BUDGET,
            accumulate_on: AccumulateOn::Auto,
            zenflow_aside: DEFAULT_ZENFLOW_ASIDE,
            overlap_forward: false,
            device_share: 0.0,
            device_share_state: ShareState::Device,
        }
    }
}

impl Offload {
    /// Offload with the exact step, `cpu_threads` threads and the default stream tuning.
    pub fn exact(memory: HostMemory, cpu_threads: usize) -> Self {
        Offload {
            memory,
            cpu_threads,
            update: OffloadUpdate::Exact,
            stream: StreamOptions::default(),
            moments: OptimizerStateDtype::Fp32,
        }
    }
}

impl EngineOptions {
    /// The offload settings, if the optimizer is offloaded.
    pub fn offload(&self) -> Option<&Offload> {
        match &self.placement {
            Placement::Offload(offload) => Some(offload),
            Placement::Device => None,
        }
    }

    /// The offload settings to change, if the optimizer is offloaded.
    pub fn offload_mut(&mut self) -> Option<&mut Offload> {
        match &mut self.placement {
            Placement::Offload(offload) => Some(offload),
            Placement::Device => None,
        }
    }

    /// ZenFlow's settings, if the engine runs ZenFlow.
    pub fn zenflow(&self) -> Option<&ZenFlowOptions> {
        match self.offload().map(|o| &o.update) {
            Some(OffloadUpdate::ZenFlow(zenflow)) => Some(zenflow),
            _ => None,
        }
    }

    /// What the types do not rule out: counts of zero, and what ZenFlow needs from the rest.
    pub(crate) fn check(&self) -> Result<(), EngineError> {
        if self.grad_accum == 0 {
            return Err(EngineError::Config("gradient accumulation steps must be at least 1"));
        }
        if self.offload().is_some_and(|o| o.stream.chunk == 0) {
            return Err(EngineError::Config(
                "the offload stream's chunk must be at least 1 element",
            ));
        }
        if self.offload().is_some_and(|o| !(0.0..1.0).contains(&o.stream.device_share)) {
            return Err(EngineError::Config(
                "the optimizer's device share must be at least 0 and below 1 (a fraction of the \
                 partition)",
            ));
        }
        if self.zenflow().is_none() {
            return Ok(());
        }
        if self.grad_accum != 1 {
            return Err(EngineError::Config(
                "ZenFlow needs gradient_accumulation_steps 1: every step is one ZenFlow iteration, \
                 and update_interval is its accumulation window (DeepSpeed sets \
                 gradient_accumulation_steps to update_interval instead)",
            ));
        }
        if matches!(self.scaler, LossScaler::Dynamic(_)) {
            return Err(EngineError::Config(
                "ZenFlow does not support dynamic loss scaling (a window's gradient sum would mix \
                 scales); use bf16, fp32 or a static loss scale",
            ));
        }
        Ok(())
    }
}

impl EngineOptions {
    /// The options a resolved config asks for; `cpu_threads` is this rank's share of the host's
    /// cores for the CPU optimizer. The offload stream's tuning, which a DeepSpeed config does not
    /// have, takes its defaults ([`StreamOptions::default`]).
    ///
    /// Non-finite gradients always skip the step, also in bf16 with `check_grad_overflow: false`
    /// (DeepSpeed would apply the NaNs to the weights).
    ///
    /// The delayed update needs optimizer offload and excludes ZenFlow: a config asking for
    /// either is refused here. ZenFlow's other settings are passed on as they are;
    /// [`crate::Engine::new`] refuses what it cannot run (gradient accumulation, a dynamic loss
    /// scale) with an error that says what to change. DeepSpeed makes `update_interval` its
    /// accumulation boundary and steps the selected columns every micro-step; here one engine
    /// step (with `gradient_accumulation_steps: 1`) is one ZenFlow iteration. With
    /// `overlap_step`, the CPU step runs on the cores `pt_reserved_cores_perc` does not reserve
    /// for the training thread (at least one); ZenFlow's own `offload` (the selected columns'
    /// moments in host memory) is not supported: they stay on the device (`topk_ratio` × 8 bytes
    /// per parameter), with a warning.
    pub fn from_config(config: &Config, cpu_threads: usize) -> Result<Self, EngineError> {
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
        Ok(EngineOptions {
            stage,
            grad_accum: config.batch.gradient_accumulation_steps,
            clip: (config.gradient_clipping > 0.0).then_some(config.gradient_clipping),
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
            placement: placement(config, cpu_threads)?,
        })
    }
}

/// Where a config puts the optimizer state, and how an offloaded one steps.
fn placement(config: &Config, cpu_threads: usize) -> Result<Placement, EngineError> {
    let delayed = &config.zeroflow.delayed_update;
    let moments = config.zeroflow.optimizer_state_dtype;
    let Some(offload) = config.zero.offload_optimizer else {
        if delayed.enabled {
            return Err(EngineError::Config("the delayed update needs CPU optimizer offload"));
        }
        if moments != OptimizerStateDtype::Fp32 {
            return Err(EngineError::Config(
                "zeroflow.optimizer_state_dtype: 16-bit moments are for the CPU optimizer \
                 (zero_optimization.offload_optimizer); the device's AdamW keeps fp32 moments",
            ));
        }
        // (The config's own checks refuse ZenFlow without offload.)
        return Ok(Placement::Device);
    };
    let update = match (config.zero.zenflow, delayed.enabled) {
        (Some(_), true) => {
            return Err(EngineError::Config(
                "ZenFlow and the delayed update exclude each other; ZenFlow's overlap_step is its \
                 delayed update",
            ));
        }
        (Some(z), false) => OffloadUpdate::ZenFlow(ZenFlowOptions {
            topk_ratio: z.topk_ratio,
            selection: z.selection,
            update_interval: z.update_interval,
            auto_ratio: z.auto_ratio,
            overlap_step: z.overlap_step,
            full_warm_up_rounds: z.full_warm_up_rounds,
        }),
        (None, true) => OffloadUpdate::Delayed { warmup: delayed.warmup_steps },
        (None, false) => OffloadUpdate::Exact,
    };
    let memory = if offload.pin_memory { HostMemory::Pinned } else { HostMemory::Pageable };
    Ok(Placement::Offload(Offload {
        memory,
        cpu_threads,
        update,
        stream: StreamOptions::default(),
        moments,
    }))
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
        let options = EngineOptions::from_config(&resolved.config, 1).expect("valid options");
        let stream = options.offload().expect("offload").stream;
        assert_eq!(stream.chunk, 1 << 23);
        assert_eq!(stream.copy_stores, None);
        assert!(stream.gather_in_pieces);
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
        let options = EngineOptions::from_config(&resolved.config, 1).expect("valid options");
        let want = ZenFlowOptions {
            topk_ratio: 0.25,
            selection: Selection::Step { interval: 8 },
            update_interval: UpdateInterval::Every(4),
            auto_ratio: 0.99,
            overlap_step: true,
            full_warm_up_rounds: 3,
        };
        assert_eq!(options.zenflow(), Some(&want));
        assert_eq!(want.intervals().expect("supported settings"), (8, 4));
        // overlap_step: DeepSpeed's default pt_reserved_cores_perc 0.5 leaves half the cores to
        // the CPU step, and always one.
        let threads = |config| {
            let options = EngineOptions::from_config(config, 16).expect("valid options");
            options.offload().expect("offload").cpu_threads
        };
        assert_eq!(threads(&resolved.config), 8);
        assert_eq!(options.offload().expect("offload").cpu_threads, 1);
        let quarter = text.replace(
            r#""full_warm_up_rounds": 3"#,
            r#""full_warm_up_rounds": 3, "pt_reserved_cores_perc": 0.25"#,
        );
        let quarter = resolve_str(&quarter, &Context::default()).expect("a valid config");
        assert_eq!(threads(&quarter.config), 12);
        // Without the section (an unknown key in zero_optimization is an error, as in DeepSpeed).
        let without = r#"{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}"#;
        let without = resolve_str(without, &Context::default()).expect("a valid config");
        let without = EngineOptions::from_config(&without.config, 1).expect("valid options");
        assert_eq!(without.zenflow(), None);
    }

    /// The delayed update needs offload and excludes ZenFlow: options that say otherwise cannot
    /// be written, so a config asking for them is refused when it becomes options.
    #[test]
    fn a_config_with_a_delayed_update_the_engine_cannot_run_is_refused() {
        let delayed = r#", "zeroflow": {"delayed_update": {"enabled": true, "warmup_steps": 2}}"#;
        let refused = |zero: &str| {
            let text =
                format!(r#"{{"train_batch_size": 4, "zero_optimization": {zero}{delayed}}}"#);
            let resolved = resolve_str(&text, &Context::default()).expect("a valid config");
            match EngineOptions::from_config(&resolved.config, 1) {
                Err(EngineError::Config(reason)) => reason,
                other => panic!("{zero}: {other:?}"),
            }
        };
        assert!(refused(r#"{"stage": 2}"#).contains("needs CPU optimizer offload"));
        let zenflow = r#"{"stage": 2, "offload_optimizer": {"device": "cpu"},
                          "zenflow": {"topk_ratio": 0.1}}"#;
        assert!(refused(zenflow).contains("exclude each other"));
        let offload = r#"{"stage": 2, "offload_optimizer": {"device": "cpu"}}"#;
        let text = format!(r#"{{"train_batch_size": 4, "zero_optimization": {offload}{delayed}}}"#);
        let resolved = resolve_str(&text, &Context::default()).expect("a valid config");
        let options = EngineOptions::from_config(&resolved.config, 1).expect("offload delays");
        let update = options.offload().expect("offload").update;
        assert_eq!(update, OffloadUpdate::Delayed { warmup: 2 });
    }

    /// bf16 moments are for the CPU optimizer: with offload they reach its options, without it
    /// (the device's fp32 AdamW) the config is refused saying why.
    #[test]
    fn bf16_moments_reach_the_offload_options_and_are_refused_without_offload() {
        let options = |zero: &str| {
            let text = format!(
                r#"{{"train_batch_size": 4, "zero_optimization": {zero},
                     "zeroflow": {{"optimizer_state_dtype": "bf16"}}}}"#
            );
            let resolved = resolve_str(&text, &Context::default()).expect("a valid config");
            EngineOptions::from_config(&resolved.config, 1)
        };
        let offload = options(r#"{"stage": 2, "offload_optimizer": {"device": "cpu"}}"#).unwrap();
        assert_eq!(offload.offload().unwrap().moments, OptimizerStateDtype::Bf16);
        match options(r#"{"stage": 2}"#) {
            Err(EngineError::Config(reason)) => {
                assert!(reason.contains("optimizer_state_dtype") && reason.contains("offload"))
            }
            other => panic!("bf16 moments without offload: {other:?}"),
        }
    }
}
