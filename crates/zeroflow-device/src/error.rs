//! Errors of the device layer.

use std::ops::Range;

use thiserror::Error;
use zeroflow_core::DType;

/// What can go wrong on a device. Every variant says what happened and, where there is one, what to
/// do about it.
#[derive(Clone, Debug, Error, PartialEq)]
pub enum DeviceError {
    /// An operation would touch memory that another stream may still be using, because no event
    /// orders the two. On a GPU this is a silent wrong value; the CPU device refuses the operation.
    #[error("{0}")]
    Race(Box<Race>),
    /// A stream or the host waited on an event that was never recorded.
    #[error("event waited on before it was recorded (record it on the producing stream first)")]
    EventNotRecorded,
    /// A range does not fit the buffer it names.
    #[error("{what}: range {range:?} does not fit a buffer of {len} elements")]
    OutOfBounds { what: &'static str, range: Range<usize>, len: usize },
    /// A buffer holds another element type than the operation needs (a type-erased operand, such
    /// as a matmul operand, checked at run time).
    #[error("{what} is a {found} buffer but {expected} is needed")]
    DTypeMismatch { what: &'static str, expected: DType, found: DType },
    /// Two ranges that must have equal lengths do not.
    #[error("{what}: lengths differ ({left} vs {right})")]
    LengthMismatch { what: &'static str, left: usize, right: usize },
    /// Within one kernel, a written range overlaps another argument.
    #[error("kernel `{kernel}`: argument {arg} is written and overlaps argument {other}")]
    AliasedArguments { kernel: &'static str, arg: usize, other: usize },
    /// Memory could not be allocated.
    #[error("out of {memory} memory allocating {bytes} bytes")]
    OutOfMemory { memory: &'static str, bytes: usize },
    /// A collective failed or the ranks disagreed about it.
    #[error("collective `{op}` on rank {rank}: {reason}")]
    Collective { op: &'static str, rank: usize, reason: String },
    /// A kernel failed while running.
    #[error("kernel `{kernel}` failed: {reason}")]
    Kernel { kernel: &'static str, reason: String },
    /// A library the device needs could not be loaded or used.
    #[error("{library}: {reason}")]
    Library { library: &'static str, reason: String },
    /// A kernel module did not compile (NVRTC's log says why).
    #[error("kernel module `{module}` did not compile for {arch}:\n{log}")]
    Compile { module: String, arch: String, log: String },
    /// A worker thread of the device is gone (it panicked or was shut down).
    #[error("stream `{stream}` stopped: {reason}")]
    StreamStopped { stream: &'static str, reason: String },
}

pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// The two operations of a race (see [`DeviceError::Race`]).
#[derive(Clone, Debug, Error, PartialEq)]
#[error(
    "race on buffer #{buffer} ({dtype}, elements {range:?}): `{op}` on stream `{stream}` {access} \
     what `{other_op}` on stream `{other_stream}` {other_access}, and no event orders the two \
     (record an event on `{other_stream}` after `{other_op}` and wait on it on `{stream}`)"
)]
pub struct Race {
    pub buffer: u64,
    pub dtype: DType,
    pub range: Range<usize>,
    pub op: &'static str,
    pub stream: &'static str,
    pub access: &'static str,
    pub other_op: &'static str,
    pub other_stream: &'static str,
    pub other_access: &'static str,
}
