//! What can go wrong in the engine, by whose mistake it is: the configuration's, the
//! checkpoint's, the model's, the caller's or the engine's own.

use std::ops::Range;

use thiserror::Error;
use zeroflow_device::DeviceError;
use zeroflow_optim::OptimError;

/// What can go wrong in the engine.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Optim(#[from] OptimError),
    /// The options ask for something the engine cannot run (say what to change in the config).
    #[error("{0}")]
    Config(&'static str),
    /// A checkpoint does not fit this engine or contradicts itself.
    #[error("rank {rank}: cannot resume from this checkpoint: {reason}")]
    Restore { rank: usize, reason: &'static str },
    /// A checkpoint's file could not be read while restoring from it.
    #[error(transparent)]
    Checkpoint(Box<crate::checkpoint::CheckpointError>),
    /// The checkpoint's optimizer state does not cover a parameter of this rank's partition.
    #[error("rank {rank}: the checkpoint's optimizer state does not cover parameter `{param}`")]
    IncompleteOptimizerState { rank: usize, param: String },
    /// The model's forward or backward failed (for callers whose closures return
    /// `EngineError`; [`crate::Engine::backward`] passes any caller error type through as it is).
    #[error("the model failed")]
    Model(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error(
        "parameter `{param}` got no gradient in this backward (every parameter must be reported once)"
    )]
    MissingGradient { param: String },
    #[error("parameter `{param}` was reported twice in one backward")]
    DuplicateGradient { param: String },
    #[error("the reported range {range:?} covers only part of parameter `{param}`")]
    PartialGradient { param: String, range: Range<usize> },
    /// The caller broke the engine's calling rules (`backward` twice without `step`, inputs of
    /// another size than the layout's): a bug in the caller.
    #[error("{0}")]
    Misuse(&'static str),
    /// The CPU optimizer's worker thread could not be started.
    #[error("could not start the delayed optimizer thread: {0}")]
    Thread(#[source] std::io::Error),
    /// The CPU optimizer's worker panicked, or a state that cannot happen did: a bug in the engine.
    #[error("internal error in the engine (a bug): {0}")]
    Internal(&'static str),
}

impl EngineError {
    /// The model's own error, for closures that return `EngineError`.
    pub fn model(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        EngineError::Model(Box::new(error))
    }
}
