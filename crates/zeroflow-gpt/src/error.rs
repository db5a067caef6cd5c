//! Errors of the model (data errors are `zeroflow_data::DataError`).

use thiserror::Error;
use zeroflow_device::DeviceError;
use zeroflow_nn::NnError;

#[derive(Debug, Error)]
pub enum GptError {
    #[error(
        "unknown model size `{0}` (known: tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt-1.3b, or a JSON object)"
    )]
    UnknownSize(String),
    #[error("model config JSON: {0}")]
    ConfigJson(String),
    #[error("invalid model config: {0}")]
    InvalidConfig(String),
    /// The flat layout handed to the model lacks a parameter or holds it with another shape.
    #[error("parameter `{name}`: {reason}")]
    Layout { name: String, reason: String },
    /// A buffer has the wrong length for the layout or the batch.
    #[error("{what}: expected {expected} elements, found {found}")]
    Length { what: &'static str, expected: usize, found: usize },
    /// A batch does not fit the model (sequence longer than the context, and such).
    #[error("batch: {0}")]
    Batch(String),
    /// A kernel of the host path failed (a token id out of range, for example).
    #[error("kernel `{kernel}` failed: {reason}")]
    Kernel { kernel: &'static str, reason: String },
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// Reading a Hugging Face directory (the error names the file and the tensor).
    #[error(transparent)]
    Hf(#[from] zeroflow_hf::HfError),
}

/// The executors' errors as the model's own: the same kinds, so that a caller matching on
/// [`GptError::Length`] or [`GptError::Kernel`] sees them whichever layer found them.
impl From<NnError> for GptError {
    fn from(error: NnError) -> Self {
        match error {
            NnError::Length { what, expected, found } => GptError::Length { what, expected, found },
            NnError::Batch(reason) => GptError::Batch(reason),
            NnError::Kernel { kernel, reason } => GptError::Kernel { kernel, reason },
            NnError::Device(error) => GptError::Device(error),
        }
    }
}
