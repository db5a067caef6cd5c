//! The memory each optimizer mode needs for a model, from the engine's own account of its
//! buffers ([`EngineOptions::planned_buffers`], which the whole plan of [`crate::plan`] also
//! counts): what `zeroflow models` tabulates for the named sizes.

use zeroflow_core::DType;
use zeroflow_engine::{
    BufferKind, EngineOptions, LossScaler, MemoryKind, Offload, OffloadUpdate, Placement, Stage,
};
use zeroflow_optim::AdamWConfig;

use crate::{ModelSpec, TrainError};

/// One optimizer mode of `zeroflow bench step`, as the engine's options.
#[derive(Clone, Debug)]
pub struct ModeMemory {
    pub mode: &'static str,
    options: EngineOptions,
}

/// The three modes of `zeroflow bench step` (ZeRO-2, one micro-step per step, bf16), with
/// ZenFlow's `topk_ratio`.
pub fn modes(topk_ratio: f64) -> [ModeMemory; 3] {
    let options = |placement| EngineOptions {
        stage: Stage::Zero2,
        grad_accum: 1,
        clip: Some(1.0),
        reduce_bucket: 500_000_000,
        adamw: AdamWConfig::default(),
        scaler: LossScaler::None,
        placement,
    };
    let offload = |update| {
        let mut offload = Offload::exact(zeroflow_device::HostMemory::Pinned, 1);
        offload.update = update;
        Placement::Offload(offload)
    };
    let zenflow = OffloadUpdate::ZenFlow(crate::plan::zenflow_options(topk_ratio));
    [
        ModeMemory { mode: "gpu", options: options(Placement::Device) },
        ModeMemory { mode: "offload", options: options(offload(OffloadUpdate::Exact)) },
        ModeMemory { mode: "zenflow", options: options(offload(zenflow)) },
    ]
}

/// What `zeroflow models` counts, as it says.
pub const ASSUMPTIONS: &str = "Memory per rank of the engine's buffers for the whole run only \
    (activations, which grow with --micro-batch × sequence length, the CUDA context and the \
    process come on top: `zeroflow plan` counts everything). Per parameter: bf16 weights and \
    gradients 2 + 2 B on every GPU; gpu: fp32 master weights + Adam moments 12 B and an fp32 \
    gradient accumulator 4 B on the GPU; offload: the 12 B in pinned host memory, plus 96 MiB \
    of staging; zenflow: the 12 B and bounded staging in host memory, two fp32 windows (4 B \
    each: the one filling and the one its overlapped CPU step streams from) and the set-aside \
    weights (2 B) on the GPU, and the selected columns' state (about topk_ratio × 20 B) on the \
    GPU. Everything but the weights and gradients is divided \
    by the world size (ZeRO-2). MiB/GiB = 2^20/2^30 bytes.";

/// The engine's run buffers of rank 0 for `model` in `mode` over `world` ranks: (GPU bytes,
/// host bytes).
pub fn per_rank(
    mode: &ModeMemory,
    model: &ModelSpec,
    world: u32,
) -> Result<(f64, f64), TrainError> {
    let layout = model.flat_layout(world as usize)?;
    let buffers = mode.options.planned_buffers(&layout, 0, DType::Bf16, None);
    let total = |memory: MemoryKind| -> f64 {
        let run = buffers.iter().filter(|b| b.memory == memory && b.kind != BufferKind::SetUp);
        run.map(|b| b.bytes).sum::<u64>() as f64
    };
    Ok((total(MemoryKind::Device), total(MemoryKind::Host)))
}

#[cfg(test)]
mod tests {
    use zeroflow_gpt::GptConfig;

    use super::*;

    /// Per parameter of gpt2-124m on one rank: 20 B on the GPU without offload (weights,
    /// gradients, master and moments, the accumulator), 4 B on the GPU and 12 B (and the
    /// staging) on the host with it, and ZenFlow in between on the GPU and 12 B (and bounded
    /// buffers) on the host.
    #[test]
    fn bytes_per_parameter_follow_the_engines_buffers() {
        let model = ModelSpec::Gpt2(GptConfig::named("gpt2-124m").unwrap());
        let padded = model.flat_layout(1).unwrap().padded_len() as f64;
        let [gpu, offload, zenflow] = modes(0.05).map(|m| per_rank(&m, &model, 1).unwrap());
        assert_eq!(gpu, (20.0 * padded, 0.0));
        let staging = (6 * zeroflow_engine::DEFAULT_STREAM_CHUNK * 2) as f64;
        assert_eq!(offload, (4.0 * padded, 12.0 * padded + staging));
        assert!(zenflow.0 > 4.0 * padded && zenflow.0 < 20.0 * padded, "{zenflow:?}");
        // ZenFlow's host side: the 12 B and bounded staging (its window stays on the GPU), and
        // the selection's: the importance's copy, and at a selection the compact state on its way
        // to the host optimizer (16 B per selected element: 0.8 B per parameter at 5 %).
        let zenflow_staging = (zeroflow_engine::DEFAULT_STREAM_CHUNK * (4 * 4 + 2 * 2)) as f64;
        let selection = zenflow.1 - 12.0 * padded - zenflow_staging;
        assert!(selection > 0.0 && selection < (0.05 * 16.0 + 0.1) * padded, "{zenflow:?}");
    }
}
