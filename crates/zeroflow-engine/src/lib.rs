//! The ZeRO engine: data-parallel training with partitioned optimizer state (stages 0, 1 and 2),
//! mixed precision with loss scaling, gradient clipping, gradient accumulation and CPU optimizer
//! offload, and ZenFlow's importance-aware split update, on any [`zeroflow_device::Device`]
//! (DESIGN.md §4–6).
//!
//! The training loop drives it like DeepSpeed's engine:
//!
//! ```text
//! for batch in data {
//!     engine.backward(|io, grads_ready| model.forward_backward(io, batch, grads_ready))?;
//!     engine.step()?;   // an optimizer step at the accumulation boundary, else just counts
//! }
//! ```

mod buckets;
pub mod checkpoint;
mod device_adamw;
mod engine;
mod host;
mod options;
mod reduction;
mod scaler;
pub mod stress;
pub mod synthetic;
mod zenflow;

use std::ops::Range;

use thiserror::Error;
use zeroflow_device::{DeviceError, HostMemory};
use zeroflow_optim::{AdamWConfig, OptimError, Stores};

pub use device_adamw::{DeviceAdamState, DeviceAdamW};
pub use engine::{Engine, ModelIo, OptimizerPart, Restore, Snapshot, StepReport};
pub use host::{DEFAULT_STREAM_CHUNK, StepTimes};
pub use scaler::{DynamicScaler, LossScaler};
pub use zenflow::{ZenFlowOptions, ZenFlowSnapshot};

/// Which ZeRO stage partitions what.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// Plain data parallelism: gradients are all-reduced, every rank holds all optimizer state.
    Zero0,
    /// Optimizer state partitioned; gradients reduced once per optimizer step.
    Zero1,
    /// Optimizer state and gradients partitioned; gradients reduced every micro-step.
    Zero2,
}

/// How the engine runs.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    pub stage: Stage,
    /// Micro-steps per optimizer step.
    pub grad_accum: u64,
    /// Clip the global gradient norm to this value.
    pub clip: Option<f64>,
    /// Keep the fp32 optimizer state in host memory and step it on the CPU.
    pub offload: Option<HostMemory>,
    /// Elements per reduction bucket.
    pub reduce_bucket: usize,
    pub adamw: AdamWConfig,
    pub scaler: LossScaler,
    /// Threads of the CPU optimizer (offload).
    pub cpu_threads: usize,
    /// The ZeRO-Offload paper's delayed parameter update (offload only): after this many exact
    /// steps, the CPU step of step t runs while step t + 1 computes with the weights of t − 1.
    pub delayed_update: Option<u64>,
    /// ZenFlow's split update (offload only; see [`ZenFlowOptions`]).
    pub zenflow: Option<ZenFlowOptions>,
    /// Offload: the most elements of the model's dtype that one host staging buffer holds, and so
    /// the chunk of the streaming step (gradients out, weights back) and the largest piece a
    /// bucket's gradients are copied to the host in (default [`DEFAULT_STREAM_CHUNK`]). Host
    /// staging is 4 such buffers, and the streaming step's outgoing weights 2 more. Any value
    /// gives bit-identical results; it trades per-copy overhead against the chance that a chunk
    /// is still in the CPU's caches when it is next read. At least 1 ([`Engine::new`] refuses 0).
    pub stream_chunk: usize,
    /// Offload: how the CPU AdamW writes the copy of the updated weights in the model's dtype
    /// that goes back to the device, where that copy is bf16: [`Stores::Normal`] leaves it in the
    /// caches, where the device's read finds it, [`Stores::NonTemporal`] sends it straight to
    /// memory without reading the lines first. `None` (the default) picks per path: normal where
    /// the step streams (each chunk is uploaded as soon as it is written), non-temporal where the
    /// whole partition's copy is written before its upload. Results are bit-identical either way.
    pub copy_stores: Option<Stores>,
    /// Offload with several ranks, the streaming step: gather each uploaded piece of the
    /// partition while the CPU steps the next (the default: gpt-1.3b on two H200s, 0.366 s per
    /// step against 0.384 s, BENCHMARKS.md), or all of it after the step. Results are
    /// bit-identical either way.
    pub gather_in_pieces: bool,
}

/// What can go wrong in the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Optim(#[from] OptimError),
    #[error(
        "parameter `{param}` got no gradient in this backward (every parameter must be reported once)"
    )]
    MissingGradient { param: String },
    #[error("parameter `{param}` was reported twice in one backward")]
    DuplicateGradient { param: String },
    #[error("the reported range {range:?} covers only part of parameter `{param}`")]
    PartialGradient { param: String, range: Range<usize> },
    #[error("the checkpoint's optimizer state does not cover parameter `{param}`")]
    IncompleteOptimizerState { param: String },
    #[error("{0}")]
    Usage(&'static str),
}
