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
mod courier;
mod device_adamw;
mod engine;
mod error;
mod host;
mod host_moments;
mod memory;
mod offloader;
mod options;
mod reduction;
mod scaler;
mod speculation;
pub mod stress;
pub mod synthetic;
mod zenflow;

pub use device_adamw::{DeviceAdamState, DeviceAdamW};
pub use engine::state::RESTORE_PIECE;
pub use engine::{
    CheckpointState, Engine, ModelIo, Opener, OptimizerPart, Restore, SavedParts, Snapshot,
    StepReport,
};
pub use engine::{SHARE_UPLOAD_BYTES, SHARE_UPLOAD_PIECE_BYTES};
pub use error::EngineError;
pub use host::{DEFAULT_STREAM_CHUNK, StepTimes};
pub use memory::{BufferKind, MemoryKind, PlannedBuffer, device_share_len};
pub use options::{
    AccumulateOn, DEFAULT_ZENFLOW_ASIDE, EngineOptions, Offload, OffloadUpdate, Placement,
    ShareState, Stage, StreamOptions, ZenFlowAside,
};
pub use scaler::{DynamicScaler, LossScaler};
pub use speculation::{DEFAULT_SPECULATION_BUDGET, SpeculationStats};
pub use zenflow::{ZenFlowOptions, ZenFlowSnapshot};
