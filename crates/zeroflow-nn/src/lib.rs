//! Model-neutral layers of zeroflow, which every model family builds on.
//!
//! - [`plan`]: the plan IR, a model as a list of kernel launches ([`Launch`], [`Step`]) over flat
//!   buffers, for one (batch, seq); a family builds its [`Plan`].
//! - [`checkpoint`]: activation checkpointing for any family: layers' internals in one shared
//!   region, recomputed in backward from each layer's kept input.
//! - [`kernels`]: the shared layers' forward and backward as pure functions over slices, generic
//!   over [`Float`] (f32 on the device, f64 in tests): matmul, attention (with `n_kv_head`
//!   key/value heads), softmax cross-entropy, the embedding, the residual sum; a family adds its
//!   own as a [`LayerKernel`].
//! - The executors: [`host::HostRunner`] on host vectors (the f64 oracle), [`cpu::CpuRunner`] on
//!   the `CpuDevice`, [`cuda::CudaRunner`] on a GPU (bf16, cuBLASLt, the liveness schedule, gemm
//!   or flash attention).
//! - [`init`]: the normal draws of the families' initial weights, in blocks that seek each
//!   parameter's stream.
//! - [`infer`]: inference over any family: the key/value cache, the [`infer::Decoder`] a family's
//!   cached forward implements, sampling and [`infer::generate`], the loss over a stream's windows.

pub mod checkpoint;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod float;
pub mod host;
pub mod infer;
pub mod init;
pub mod kernels;
pub mod plan;

pub use checkpoint::{Checkpointing, LayerActs, LayerAllocator, layer_acts};
pub use cpu::CpuRunner;
pub use cuda::CudaRunner;
pub use error::NnError;
pub use float::Float;
pub use host::HostRunner;
pub use kernels::{ArgSlices, AttentionShape, Fusable, Kernel, LayerKernel, WeightLayout};
pub use plan::{
    Access, Arg, AttentionKind, Buf, GradGroup, GradsReady, Launch, Plan, PlanOptions, Step,
};
