//! The Llama family of zeroflow: Llama 2/3.x (`LlamaForCausalLM`), Qwen2/2.5
//! (`Qwen2ForCausalLM`), Qwen3 (`Qwen3ForCausalLM`) and Mistral (`MistralForCausalLM`).
//!
//! - [`LlamaConfig`]: `config.json` in ([`LlamaConfig::from_hf_config`], refusing what zeroflow
//!   does not implement, naming the field) and out ([`LlamaConfig::to_hf_config`]).
//! - [`named_shape`]: `llama-1b`, `llama-3b`, `llama-8b`.
//! - [`hf_params`]: every parameter's Hugging Face name, `[out, in]` shape and axes (ZenFlow's
//!   column axis among them), and [`param_count`].
//!
//! The model itself (its plan over the shared layers) comes later; this crate does not depend on
//! the engine or on GPT-2.

pub mod config;
pub mod error;
mod json;
pub mod kernels;
pub mod params;
pub mod rope;
pub mod shapes;

pub use config::{Architecture, AttentionBias, LlamaConfig};
pub use error::LlamaConfigError;
pub use kernels::LlamaKernel;
pub use params::{HfParam, ParamKind, hf_params, param_count};
pub use rope::{Llama3RopeScaling, RopeFreqs};
pub use shapes::{NAMED_SHAPES, named_shape};
