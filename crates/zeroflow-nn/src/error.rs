//! Errors of the executors and the shared layers.

use thiserror::Error;
use zeroflow_device::DeviceError;

#[derive(Debug, Error)]
pub enum NnError {
    /// A buffer has the wrong length for the layout or the batch.
    #[error("{what}: expected {expected} elements, found {found}")]
    Length { what: &'static str, expected: usize, found: usize },
    /// A batch or a shape does not fit the kernels.
    #[error("batch: {0}")]
    Batch(String),
    /// A kernel failed (a token id out of range, for example), or a plan cannot be run.
    #[error("kernel `{kernel}` failed: {reason}")]
    Kernel { kernel: &'static str, reason: String },
    #[error(transparent)]
    Device(#[from] DeviceError),
}
