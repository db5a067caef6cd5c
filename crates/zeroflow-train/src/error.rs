//! What a run fails with ([`TrainError`]): a mistake in what it was given ([`TrainError::Input`],
//! which the binary reports as such), or a failure of the machine, a library or another rank.

use zeroflow_device::DeviceError;
use zeroflow_engine::EngineError;
use zeroflow_engine::checkpoint::CheckpointError;

use crate::checkpoints::CheckpointsError;
use crate::dist::{DistError, Lost};

/// Why a run, its set-up or a benchmark of steps failed.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// What the user gave (a flag, a file, the config, a checkpoint, the data) is wrong; the
    /// message says what and what to do.
    #[error("{0}")]
    Input(String),
    /// `what` failed because of `source` (e.g. `rank 1: cannot open GPU 1`).
    #[error("{what}")]
    Context {
        what: String,
        #[source]
        source: Box<TrainError>,
    },
    /// A file-system call failed; `what` says which, with the path.
    #[error("cannot {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The family's model failed (GPT-2's `GptError`, …).
    #[error(transparent)]
    Model(Box<dyn std::error::Error + Send + Sync>),
    /// A config (`bench step`'s own) does not resolve.
    #[error(transparent)]
    Config(#[from] zeroflow_core::config::ConfigError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Checkpoints(#[from] CheckpointsError),
    #[error(transparent)]
    Dist(#[from] DistError),
    /// Another rank was lost during a barrier of the side channel.
    #[error(transparent)]
    Lost(#[from] Lost),
    /// The run's observer failed (e.g. it could not start catching signals).
    #[error(transparent)]
    Observer(Box<dyn std::error::Error + Send + Sync>),
    /// The mean training loss over the ranks is not finite.
    #[error("the training loss is {loss} at step {step}; try a smaller --lr")]
    NonFiniteLoss { loss: f64, step: u64 },
    /// The default run directory `wanted` and the `tried` names after it all exist.
    #[error(
        "{} and {tried} names after it are taken; choose a directory with --out",
        wanted.display()
    )]
    RunDirsTaken { wanted: std::path::PathBuf, tried: u32 },
    /// A benchmarked step did not update the weights (skipped, or accumulated only).
    #[error("step {step} did not update the weights: {report}")]
    NotStepped { step: u32, report: String },
}

impl TrainError {
    /// A model's error.
    pub fn model(error: impl std::error::Error + Send + Sync + 'static) -> TrainError {
        TrainError::Model(Box::new(error))
    }

    /// This error as the cause of `what`.
    pub fn context(self, what: impl Into<String>) -> TrainError {
        TrainError::Context { what: what.into(), source: Box::new(self) }
    }

    /// Whether the input was wrong (here or in the cause of a [`TrainError::Context`]), as
    /// opposed to a failure of the machine or of zeroflow.
    pub fn is_input(&self) -> bool {
        match self {
            TrainError::Input(_) => true,
            TrainError::Context { source, .. } => source.is_input(),
            _ => false,
        }
    }

    /// A checkpoint refused for want of disk space, before anything was written (here or in the
    /// cause of a [`TrainError::Context`]; alike on every rank of a job).
    pub fn is_no_space(&self) -> bool {
        match self {
            TrainError::Checkpoints(error) => error.is_no_space(),
            TrainError::Checkpoint(CheckpointError::NoSpace { .. }) => true,
            TrainError::Context { source, .. } => source.is_no_space(),
            _ => false,
        }
    }
}

/// A [`TrainError::Input`] with `message`.
pub(crate) fn input(message: impl Into<String>) -> TrainError {
    TrainError::Input(message.into())
}

/// The [`TrainError::Io`] of `what` (a verb and its path).
pub(crate) fn io(what: String) -> impl FnOnce(std::io::Error) -> TrainError {
    move |source| TrainError::Io { what, source }
}

/// A result whose error is a [`TrainError`] unless said otherwise.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;
