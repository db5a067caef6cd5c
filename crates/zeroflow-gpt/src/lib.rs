//! The GPT-2 family model of zeroflow, built on zeroflow-nn's layers (its data is
//! `zeroflow-data`'s).
//!
//! - [`GptConfig`]: shapes (named sizes and custom JSON); [`params`]: Hugging Face names and
//!   shapes in a fixed order for the flat layout, initialisation, gradient groups.
//! - [`kernels`]: GPT-2's own layers (LayerNorm, GELU) as pure functions over slices, generic
//!   over [`Float`] (f32 on the device, f64 in tests), and [`GptKernel`], their launches.
//! - [`plan`]: the model as zeroflow-nn's plan of kernel launches over flat buffers, for one
//!   (batch, seq).
//! - [`CpuGpt`] runs the plan on the [`zeroflow_device::CpuDevice`]'s compute stream;
//!   [`HostGpt`] runs it on host vectors (the f64 oracle); [`CudaGpt`] on a GPU.
//! - [`HfGpt`]: Hugging Face GPT-2 directories in (`config.json` and the weights by name).
//! - [`GptDecoder`]: the forward with a key/value cache (zeroflow-nn's `infer::Decoder`), for
//!   generation.

pub mod config;
pub mod cpu;
pub mod cuda;
pub mod decode;
pub mod error;
pub mod hf;
pub mod host;
pub mod kernels;
pub mod params;
pub mod plan;

pub use config::{GptConfig, NAMED_SIZES};
pub use cpu::{CpuGpt, init_params_on_device};
pub use cuda::CudaGpt;
pub use cuda::decode::{CudaGptDecoder, CudaGptStep};
pub use decode::GptDecoder;
pub use error::GptError;
pub use hf::HfGpt;
pub use host::{HostGpt, eval_stream};
pub use kernels::GptKernel;
pub use params::{
    GradGroup, GradsReady, HfTensor, ParamRanges, hf_tensors, init_params, init_params_as,
    param_specs,
};
pub use plan::{ActLayout, GptPlan, Plan, PlanOptions};
pub use zeroflow_nn::{AttentionKind, Float};

use zeroflow_core::layout::{Alignment, FlatLayout};

/// The flat layout of `config`'s parameters for `world_size` ranks with the default alignment.
pub fn flat_layout(config: &GptConfig, world_size: usize) -> Result<FlatLayout, GptError> {
    FlatLayout::new(&param_specs(config), world_size, Alignment::default())
        .map_err(|e| GptError::Layout { name: "(layout)".into(), reason: e.to_string() })
}
