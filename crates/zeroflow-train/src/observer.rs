//! How a run talks to whoever started it, which prints nothing itself: what it is doing and what
//! happened ([`TrainObserver`]: a progress bar, log lines), and the request to stop
//! ([`StopHandle`], which the binary's signal handlers set).

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::metrics::StepRecord;

/// What a run is doing now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    /// Building the model of `parameters` parameters on its device.
    Building { parameters: usize },
    /// Optimizer step `step` of `steps`.
    Step { step: u64, steps: u64 },
    /// Evaluating batch `batch` (from 1) of `batches` after step `after`.
    Evaluating { after: u64, batch: usize, batches: usize },
    /// Saving the checkpoint of step `step`.
    Saving { step: u64 },
    /// Writing the weights of step `step` as a Hugging Face directory (`--export`).
    Exporting { step: u64 },
    /// Writing a sample by the weights of step `step` (`--sample-every`, on the CPU).
    Sampling { step: u64 },
}

/// An error of an observer, which ends the run.
pub type ObserverError = Box<dyn std::error::Error + Send + Sync>;

/// What a run tells its caller as it goes; every method does nothing unless implemented. Only
/// rank 0's observer is meant to show anything: every rank's is called alike.
pub trait TrainObserver {
    /// The run is now doing `activity` (until the next call).
    fn doing(&mut self, _activity: Activity) {}

    /// The model is on its device (`device` describes it), `seconds` after the run started.
    /// From here a stop request ends the run with a checkpoint (before, there is nothing to
    /// save): the place to start catching signals.
    fn on_model_ready(&mut self, _device: &str, _seconds: f64) -> Result<(), ObserverError> {
        Ok(())
    }

    /// Optimizer step `record.step` is done.
    fn on_step(&mut self, _record: &StepRecord) {}

    /// The evaluation after step `step` gave `loss` (the data's entropy floor is `floor`, where
    /// known).
    fn on_eval(&mut self, _step: u64, _loss: f64, _floor: Option<f64>) {}

    /// The checkpoint of step `step` is saved in `dir`, which took `seconds`.
    fn on_checkpoint(&mut self, _step: u64, _dir: &Path, _seconds: f64) {}

    /// The steps are over (done or stopped): a progress display can close.
    fn on_steps_done(&mut self) {}

    /// `loss.svg` of the training and evaluation losses by step, if the observer draws one.
    fn loss_svg(
        &mut self,
        _train: &[(u64, f64)],
        _eval: &[(u64, f64)],
        _floor: Option<f64>,
    ) -> Option<String> {
        None
    }
}

/// An observer that shows nothing (ranks other than 0, tests).
#[derive(Clone, Copy, Debug, Default)]
pub struct Unobserved;

impl TrainObserver for Unobserved {}

/// The request to stop a run after its current step (an evaluation is abandoned), shared between
/// the run and what asks for it; also the step the run is in, for whoever says so.
#[derive(Clone, Debug, Default)]
pub struct StopHandle {
    requested: Arc<AtomicBool>,
    step: Arc<AtomicU64>,
}

impl StopHandle {
    /// The flag that asks for the stop (signal handlers set it).
    pub fn flag(&self) -> &Arc<AtomicBool> {
        &self.requested
    }

    /// Asks the run to stop.
    pub fn request(&self) {
        self.requested.store(true, Ordering::Relaxed);
    }

    /// Whether the run was asked to stop.
    pub fn requested(&self) -> bool {
        self.requested.load(Ordering::Relaxed)
    }

    /// The step the run is in (0 before the first).
    pub fn step(&self) -> u64 {
        self.step.load(Ordering::Relaxed)
    }

    pub(crate) fn at_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }
}
