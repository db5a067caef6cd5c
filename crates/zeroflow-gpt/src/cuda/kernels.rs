//! The model's own CUDA kernels (`kernels/*.cu`): their sources, loaded once per model, and the
//! launch geometry shared by the backend.

use zeroflow_device::CudaDevice;
use zeroflow_device::DeviceError;
use zeroflow_device::cuda::CudaFunction;

/// The shared header every module of the model is compiled with (after the device prelude).
const COMMON: &str = include_str!("../../kernels/common.cuh");

/// Each module's name and source (the shared header first).
pub const SOURCES: [(&str, &str); 4] = [
    (
        "gpt_pointwise",
        concat!(
            include_str!("../../kernels/common.cuh"),
            include_str!("../../kernels/pointwise.cu")
        ),
    ),
    (
        "gpt_layernorm",
        concat!(
            include_str!("../../kernels/common.cuh"),
            include_str!("../../kernels/layernorm.cu")
        ),
    ),
    (
        "gpt_encoder",
        concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/encoder.cu")),
    ),
    (
        "gpt_loss",
        concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/loss.cu")),
    ),
];

/// Threads per block of the element-wise kernels.
pub const THREADS: u32 = 256;
/// Rows per warp-per-row block (256 threads).
pub const ROWS_PER_BLOCK: u32 = THREADS / 32;
/// Rows each block of a column sum adds up (the first of its two steps).
pub const ROWS_PER_CHUNK: usize = 256;

/// Blocks for a grid-stride loop over `work` items (at most 65536 blocks; 0 for no work).
pub fn blocks_for(work: usize) -> u32 {
    work.div_ceil(THREADS as usize).min(1 << 16) as u32
}

/// Chunks of rows of a column sum over `rows` rows.
pub fn chunks_for(rows: usize) -> usize {
    rows.div_ceil(ROWS_PER_CHUNK)
}

/// Every kernel of the model, looked up once.
#[derive(Debug)]
pub struct GptKernels {
    pub residual_forward: CudaFunction,
    pub residual_backward: CudaFunction,
    pub gelu_forward: CudaFunction,
    pub gelu_backward: CudaFunction,
    pub column_sum_partial: CudaFunction,
    pub column_sum_finish: CudaFunction,
    pub layernorm_forward: CudaFunction,
    pub layernorm_backward_input: CudaFunction,
    pub layernorm_param_grads_partial: CudaFunction,
    pub encoder_forward: CudaFunction,
    pub encoder_backward_wte: CudaFunction,
    pub encoder_backward_wpe: CudaFunction,
    pub softmax_xent_forward: CudaFunction,
    pub mean_loss: CudaFunction,
    pub softmax_xent_backward: CudaFunction,
}

impl GptKernels {
    /// Compiles (or takes from the kernel cache) and loads the model's modules.
    pub fn load(device: &CudaDevice) -> Result<Self, DeviceError> {
        debug_assert!(SOURCES.iter().all(|(_, source)| source.starts_with(COMMON)));
        let [pointwise, layernorm, encoder, loss] =
            SOURCES.map(|(name, source)| device.load_module(name, source));
        let (pointwise, layernorm, encoder, loss) = (pointwise?, layernorm?, encoder?, loss?);
        Ok(GptKernels {
            residual_forward: pointwise.function("residual_forward")?,
            residual_backward: pointwise.function("residual_backward")?,
            gelu_forward: pointwise.function("gelu_forward")?,
            gelu_backward: pointwise.function("gelu_backward")?,
            column_sum_partial: pointwise.function("column_sum_partial")?,
            column_sum_finish: pointwise.function("column_sum_finish")?,
            layernorm_forward: layernorm.function("layernorm_forward")?,
            layernorm_backward_input: layernorm.function("layernorm_backward_input")?,
            layernorm_param_grads_partial: layernorm.function("layernorm_param_grads_partial")?,
            encoder_forward: encoder.function("encoder_forward")?,
            encoder_backward_wte: encoder.function("encoder_backward_wte")?,
            encoder_backward_wpe: encoder.function("encoder_backward_wpe")?,
            softmax_xent_forward: loss.function("softmax_xent_forward")?,
            mean_loss: loss.function("mean_loss")?,
            softmax_xent_backward: loss.function("softmax_xent_backward")?,
        })
    }
}
