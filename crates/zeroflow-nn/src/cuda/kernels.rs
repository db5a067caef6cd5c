//! The shared CUDA kernels of `kernels/*.cu` (the residual sum, column sums, the embedding and
//! the loss): their sources, loaded once per executor, and the launch geometry that the
//! executor and the families' kernels share.

use zeroflow_device::CudaDevice;
use zeroflow_device::DeviceError;
use zeroflow_device::cuda::CudaFunction;

/// The shared header every module of the executor is compiled with (after the device prelude);
/// a family's modules start with it too.
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// Each module's name and source (the shared header first).
pub const SOURCES: [(&str, &str); 3] = [
    (
        "nn_pointwise",
        concat!(
            include_str!("../../kernels/common.cuh"),
            include_str!("../../kernels/pointwise.cu")
        ),
    ),
    (
        "nn_encoder",
        concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/encoder.cu")),
    ),
    (
        "nn_loss",
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

/// Every shared kernel, looked up once.
#[derive(Debug)]
pub struct NnKernels {
    pub residual_forward: CudaFunction,
    pub residual_backward: CudaFunction,
    pub column_sum_partial: CudaFunction,
    pub column_sum_finish: CudaFunction,
    pub encoder_forward: CudaFunction,
    pub encoder_forward_packed: CudaFunction,
    pub encoder_backward_wte: CudaFunction,
    pub encoder_backward_wpe: CudaFunction,
    pub softmax_xent_forward: CudaFunction,
    pub mean_loss: CudaFunction,
    pub softmax_xent_backward: CudaFunction,
}

impl NnKernels {
    /// Compiles (or takes from the kernel cache) and loads the shared modules.
    pub fn load(device: &CudaDevice) -> Result<Self, DeviceError> {
        debug_assert!(SOURCES.iter().all(|(_, source)| source.starts_with(COMMON)));
        let [pointwise, encoder, loss] =
            SOURCES.map(|(name, source)| device.load_module(name, source));
        let (pointwise, encoder, loss) = (pointwise?, encoder?, loss?);
        Ok(NnKernels {
            residual_forward: pointwise.function("residual_forward")?,
            residual_backward: pointwise.function("residual_backward")?,
            column_sum_partial: pointwise.function("column_sum_partial")?,
            column_sum_finish: pointwise.function("column_sum_finish")?,
            encoder_forward: encoder.function("encoder_forward")?,
            encoder_forward_packed: encoder.function("encoder_forward_packed")?,
            encoder_backward_wte: encoder.function("encoder_backward_wte")?,
            encoder_backward_wpe: encoder.function("encoder_backward_wpe")?,
            softmax_xent_forward: loss.function("softmax_xent_forward")?,
            mean_loss: loss.function("mean_loss")?,
            softmax_xent_backward: loss.function("softmax_xent_backward")?,
        })
    }
}
