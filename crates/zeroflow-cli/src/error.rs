//! The error that means "the input was wrong": the binary prints it and exits with code 2.

use std::fmt;

/// A problem with what the user gave us (a config, a flag, a file), as opposed to a failure of the
/// machine or of zeroflow itself. `main` prints it without a backtrace and exits with code 2.
#[derive(Debug)]
pub struct InputError(pub String);

impl fmt::Display for InputError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InputError {}

impl InputError {
    /// Wraps any displayable error as an input error, keeping its message.
    pub fn from_display(err: impl fmt::Display) -> anyhow::Error {
        anyhow::Error::new(InputError(err.to_string()))
    }
}

/// A failure that ends the program with a given exit status, e.g. `zeroflow launch` passing on
/// the status of the rank that failed. `main` prints the message and exits with `code`.
#[derive(Debug)]
pub struct Exit {
    pub code: u8,
    pub message: String,
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Exit {}

/// What to lower when `err` is an out-of-memory failure: a host or device allocation that failed
/// (`DeviceError::OutOfMemory` anywhere in its chain) or a CUDA out-of-memory status in its
/// message; `None` for any other error.
pub fn out_of_memory_hint(err: &anyhow::Error) -> Option<&'static str> {
    let typed = err.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<zeroflow_device::DeviceError>(),
            Some(zeroflow_device::DeviceError::OutOfMemory { .. })
        )
    });
    let text = format!("{err:#}");
    // DeviceError::OutOfMemory's text, where a layer between kept only the message (as the CUDA
    // model's set-up did on the H200: "out of device memory allocating 2076018999298 bytes").
    let said = text.contains("OUT_OF_MEMORY")
        || text.contains("out of memory")
        || text.contains(" memory allocating ");
    (typed || said).then_some(
        "out of memory: lower --micro-batch (activations grow with it and with --seq), or \
         offload the optimizer (zero_optimization.offload_optimizer, see zeroflow models for \
         the memory of each mode), or use a smaller --model",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_errors_say_which_flag_to_lower_and_others_do_not() {
        let device = zeroflow_device::DeviceError::OutOfMemory { memory: "host", bytes: 1 << 40 };
        let wrapped = anyhow::Error::new(device).context("building the model");
        assert!(out_of_memory_hint(&wrapped).is_some_and(|hint| hint.contains("--micro-batch")));
        let cuda = anyhow::anyhow!("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY");
        assert!(out_of_memory_hint(&cuda).is_some());
        // Regression: the CUDA model's allocation failure on the H200 reached main as text.
        let as_text = anyhow::anyhow!("out of device memory allocating 2076018999298 bytes");
        assert!(out_of_memory_hint(&as_text).is_some());
        assert_eq!(out_of_memory_hint(&anyhow::anyhow!("no such file")), None);
    }
}
