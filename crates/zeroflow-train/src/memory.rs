//! The memory each optimizer mode needs per parameter, from the engine's buffers (DESIGN.md §4,
//! §7): what `zeroflow models` tabulates for the named sizes.

/// Bytes per parameter of one optimizer mode, on the GPU and in host memory, split into what
/// every rank holds whole (bf16 weights) and what ZeRO-2 partitions over the ranks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BytesPerParam {
    pub mode: &'static str,
    /// On every GPU whole: bf16 weights (2 B).
    pub gpu_whole: f64,
    /// On each GPU, its partition's share: bf16 gradients (2 B), plus fp32 master weights and
    /// Adam moments (12 B) without offload, or ZenFlow's fp32 window and the aside window its
    /// overlapped CPU step streams from (4 B each) and the selected columns' state.
    pub gpu_partitioned: f64,
    /// In host memory, its partition's share: fp32 master weights and moments (12 B) when
    /// offloaded (ZenFlow's window stays on the GPU; its CPU step streams it through bounded
    /// staging).
    pub host_partitioned: f64,
}

/// The three modes of `zeroflow bench step`, from the engine's buffers (DESIGN.md §4, §7).
pub fn modes(topk_ratio: f64) -> [BytesPerParam; 3] {
    const WEIGHTS: f64 = 2.0; // bf16
    const GRADS: f64 = 2.0; // bf16
    const OPTIMIZER: f64 = 12.0; // fp32 master + exp_avg + exp_avg_sq
    const WINDOW: f64 = 4.0; // ZenFlow's fp32 gradient window
    [
        BytesPerParam {
            mode: "gpu",
            gpu_whole: WEIGHTS,
            gpu_partitioned: GRADS + OPTIMIZER,
            host_partitioned: 0.0,
        },
        BytesPerParam {
            mode: "offload",
            gpu_whole: WEIGHTS,
            gpu_partitioned: GRADS,
            host_partitioned: OPTIMIZER,
        },
        BytesPerParam {
            mode: "zenflow",
            gpu_whole: WEIGHTS,
            // The selected columns' master, moments and compact gradient on the device.
            // The window, and the aside window the overlapped CPU step streams from.
            gpu_partitioned: GRADS + 2.0 * WINDOW + topk_ratio * (OPTIMIZER + 4.0),
            host_partitioned: OPTIMIZER,
        },
    ]
}

/// What the figures count, as `zeroflow models` says.
pub const ASSUMPTIONS: &str = "Memory per rank for the parameters, gradients and optimizer state \
    only (activations, which grow with --micro-batch × sequence length, the CUDA context and \
    bounded staging buffers come on top). Per parameter: bf16 weights 2 B on every GPU; bf16 \
    gradients 2 B; fp32 master weights + Adam moments 12 B (gpu: on the GPU; offload and zenflow: \
    in pinned host memory); zenflow adds two fp32 gradient windows of 4 B each on the GPU (the one \
    filling and the one its overlapped CPU step streams from), and keeps the selected columns' state (topk_ratio × 16 B) on the GPU. Everything \
    but the weights is divided by the world size (ZeRO-2). MiB/GiB = 2^20/2^30 bytes.";

/// What a rank holds of [`ASSUMPTIONS`]' state for a model of `params` parameters in `mode` over
/// `world` ranks: (GPU bytes, host bytes).
pub fn per_rank(mode: &BytesPerParam, params: usize, world: u32) -> (f64, f64) {
    let (params, world) = (params as f64, f64::from(world));
    let gpu = params * (mode.gpu_whole + mode.gpu_partitioned / world);
    (gpu, params * mode.host_partitioned / world)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The modes' bytes per parameter are the engine's buffers: 16 B on the GPU without offload,
    /// 4 B on the GPU and 12 B on the host with it, and ZenFlow in between on the GPU with the
    /// same 12 B on the host.
    #[test]
    fn bytes_per_parameter_follow_the_engines_buffers() {
        let [gpu, offload, zenflow] = modes(0.1);
        assert_eq!((gpu.gpu_whole + gpu.gpu_partitioned, gpu.host_partitioned), (16.0, 0.0));
        assert_eq!(
            (offload.gpu_whole + offload.gpu_partitioned, offload.host_partitioned),
            (4.0, 12.0)
        );
        let zenflow_gpu = zenflow.gpu_whole + zenflow.gpu_partitioned;
        assert!(zenflow_gpu > 4.0 && zenflow_gpu < 16.0, "{zenflow_gpu}");
        assert_eq!(zenflow.host_partitioned, 12.0);
    }
}
