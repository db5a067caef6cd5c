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
