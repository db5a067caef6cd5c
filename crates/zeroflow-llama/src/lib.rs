//! The Llama family of zeroflow: Llama 2/3.x (`LlamaForCausalLM`), Qwen2/2.5
//! (`Qwen2ForCausalLM`), Qwen3 (`Qwen3ForCausalLM`) and Mistral (`MistralForCausalLM`), a thin
//! family over zeroflow-nn's layers.
//!
//! - [`LlamaConfig`]: `config.json` in ([`LlamaConfig::from_hf_config`], refusing what zeroflow
//!   does not implement, naming the field) and out ([`LlamaConfig::to_hf_config`]).
//! - [`named_shape`]: `llama-1b`, `llama-3b`, `llama-8b`.
//! - [`hf_params`]: every parameter's Hugging Face name, `[out, in]` shape and axes (ZenFlow's
//!   column axis among them), and [`param_count`]; [`ParamRanges`] finds them in a flat layout
//!   ([`flat_layout`]), [`init_params`] initialises them as `transformers` does.
//! - [`kernels`]: the family's own layers (RMSNorm, rotary embeddings, SwiGLU, the token
//!   embedding) as pure functions generic over [`zeroflow_nn::Float`], and [`LlamaKernel`].
//! - [`plan`]: the model as zeroflow-nn's plan ([`LlamaPlan`]); [`HostLlama`] runs it on host
//!   vectors (the f64 oracle), [`CpuLlama`] on the `CpuDevice`, [`CudaLlama`] on an NVIDIA GPU
//!   (bf16, with the family's kernels in CUDA: [`cuda::kernels`]); [`LlamaDecoder`] is the
//!   forward with a key/value cache (zeroflow-nn's `infer::Decoder`), for generation.
//! - [`hf`]: Hugging Face directories in ([`HfLlama`], into the flat buffer by name) and out
//!   ([`save_hf_dir`]).
//!
//! This crate does not depend on the engine, the trainer or GPT-2.

pub mod acts;
pub mod config;
pub mod cpu;
pub mod cuda;
pub mod decode;
pub mod error;
pub mod hf;
pub mod host;
pub mod init;
mod json;
pub mod kernels;
pub mod params;
pub mod plan;
pub mod ranges;
pub mod rope;
pub mod shapes;

pub use acts::ActLayout;
pub use config::{Architecture, AttentionBias, LlamaConfig};
pub use cpu::{CpuLlama, init_params_on_device};
pub use cuda::decode::{CudaLlamaDecoder, CudaLlamaStep};
pub use cuda::{CudaLlama, CudaLlamaOptions};
pub use decode::LlamaDecoder;
pub use error::{LlamaConfigError, LlamaError};
pub use hf::{HfLlama, save_hf_dir};
pub use host::{HostLlama, eval_stream};
pub use init::{init_params, init_params_as};
pub use kernels::LlamaKernel;
pub use params::{HfParam, ParamKind, hf_params, param_count};
pub use plan::{LlamaPlan, Plan, PlanOptions};
pub use ranges::{LayerParams, ParamRanges, flat_layout, param_specs};
pub use rope::{Llama3RopeScaling, RopeFreqs};
pub use shapes::{NAMED_SHAPES, named_shape};
pub use zeroflow_nn::{AttentionKind, Float};
