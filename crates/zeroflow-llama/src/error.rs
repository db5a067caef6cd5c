//! What can be wrong with a Llama-family `config.json`.

/// An error reading a `config.json` of the Llama family. Every variant names the JSON field.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LlamaConfigError {
    #[error("config.json is not a JSON object")]
    NotAnObject,
    #[error(
        "architectures: {found}; zeroflow's Llama family reads LlamaForCausalLM, \
         Qwen2ForCausalLM, Qwen3ForCausalLM and MistralForCausalLM"
    )]
    Architecture { found: String },
    #[error("{field}: missing; config.json must give it")]
    Missing { field: String },
    #[error("{field}: {found} is not {expected}")]
    Type { field: String, expected: &'static str, found: String },
    #[error("{field}: {reason}")]
    Invalid { field: String, reason: String },
    #[error("{field}: {found}; zeroflow implements {implemented}")]
    Unsupported { field: String, found: String, implemented: &'static str },
    #[error(
        "{field}: a sliding window of {window} tokens is shorter than the training sequence of \
         {seq_len}; zeroflow's attention sees the whole sequence, so train with sequences of at \
         most {window} tokens"
    )]
    SlidingWindow { field: String, window: usize, seq_len: usize },
}

/// An error of the Llama model: its configuration, its parameters in a flat layout, a batch, a
/// kernel, the device, or a Hugging Face directory.
#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    #[error("config.json: {0}")]
    Config(#[from] LlamaConfigError),
    /// A Hugging Face directory's `config.json` is not one zeroflow reads.
    #[error("{path}: {error}")]
    ConfigFile { path: std::path::PathBuf, error: LlamaConfigError },
    /// A Hugging Face directory has no `config.json`.
    #[error("{dir}: no config.json; a Hugging Face model directory needs one")]
    NoConfig { dir: std::path::PathBuf },
    /// The flat layout handed to the model lacks a parameter or holds it with another shape.
    #[error("parameter `{name}`: {reason}")]
    Layout { name: String, reason: String },
    /// A buffer has the wrong length for the layout or the batch.
    #[error("{what}: expected {expected} elements, found {found}")]
    Length { what: &'static str, expected: usize, found: usize },
    /// A batch or a shape does not fit the model.
    #[error("batch: {0}")]
    Batch(String),
    /// A kernel failed (a token id out of range, for example).
    #[error("kernel `{kernel}` failed: {reason}")]
    Kernel { kernel: &'static str, reason: String },
    #[error(transparent)]
    Device(#[from] zeroflow_device::DeviceError),
    /// Reading or writing a Hugging Face directory (the error names the file and the tensor).
    #[error(transparent)]
    Hf(#[from] zeroflow_hf::HfError),
}

/// The executors' errors as the model's own, so that a caller matching on
/// [`LlamaError::Length`] or [`LlamaError::Kernel`] sees them whichever layer found them.
impl From<zeroflow_nn::NnError> for LlamaError {
    fn from(error: zeroflow_nn::NnError) -> Self {
        use zeroflow_nn::NnError;
        match error {
            NnError::Length { what, expected, found } => {
                LlamaError::Length { what, expected, found }
            }
            NnError::Batch(reason) => LlamaError::Batch(reason),
            NnError::Kernel { kernel, reason } => LlamaError::Kernel { kernel, reason },
            NnError::Device(error) => LlamaError::Device(error),
        }
    }
}
