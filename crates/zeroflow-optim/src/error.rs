//! Errors of the CPU optimizer.

use crate::SimdLevel;

/// What can go wrong when configuring or running the CPU optimizer.
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A SIMD level was forced that this CPU (or this build's target) does not support.
    #[error(
        "SIMD level {requested} is not supported by this CPU (the best it supports is {detected}); \
         choose that or a lower one"
    )]
    SimdUnavailable { requested: SimdLevel, detected: SimdLevel },

    /// A hyper-parameter is outside the range in which AdamW is defined.
    #[error("invalid AdamW hyper-parameter {name} = {value}: {expected}")]
    InvalidHyperParameter { name: &'static str, value: f64, expected: &'static str },

    /// The step number given to [`crate::AdamWStep::new`] was zero (steps count from 1).
    #[error("AdamW steps count from 1; step 0 has no bias correction")]
    StepZero,

    /// Two slices that must have the same length do not.
    #[error("{what} has {actual} elements, expected {expected}")]
    LengthMismatch { what: &'static str, actual: usize, expected: usize },

    /// The range to update does not lie inside the partition.
    #[error("range {start}..{end} is not inside the partition of {len} elements")]
    RangeOutOfBounds { start: usize, end: usize, len: usize },

    /// The number of threads was zero.
    #[error("the CPU optimizer needs at least one thread")]
    ZeroThreads,

    /// The operating system refused to start the optimizer's threads.
    #[error("could not start the CPU optimizer's {threads} threads: {source}")]
    ThreadPool { threads: usize, source: rayon::ThreadPoolBuildError },
}
