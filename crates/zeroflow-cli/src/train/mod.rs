//! `zeroflow train` in the binary: the flags made into the library's options, a run of
//! [`zeroflow_train::run`] shown on the terminal ([`Shown`]: the progress bar or lines, the loss
//! plot, SIGINT and SIGTERM caught), and the line the run ends with.

#[cfg(test)]
mod multi_rank_tests;
mod output;
mod plot;
mod signals;

use std::path::Path;

use zeroflow_train::dist::DistEnv;
use zeroflow_train::metrics::StepRecord;
use zeroflow_train::observer::{Activity, ObserverError, StopHandle, TrainObserver};
use zeroflow_train::open::CudaOpen;
use zeroflow_train::run::Outcome;
use zeroflow_train::{DeviceKind, Setup, TrainError};

use crate::error::Exit;
use crate::settings;
use output::Progress;
use signals::Stop;

/// Where the model runs (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceFlag {
    Cpu,
    /// An NVIDIA GPU (also spelled `gpu`).
    #[value(alias = "gpu")]
    Cuda,
}

impl From<DeviceFlag> for DeviceKind {
    fn from(flag: DeviceFlag) -> DeviceKind {
        match flag {
            DeviceFlag::Cpu => DeviceKind::Cpu,
            DeviceFlag::Cuda => DeviceKind::Cuda,
        }
    }
}

/// Trains as `setup` says, showing it on rank 0, and prints the final evaluation loss (next to
/// the entropy floor where it is known). SIGINT or SIGTERM ends the run after the current step
/// with a checkpoint and the summary, and an [`Exit`] error of status 130 or 143
/// ([`signals`]).
pub fn run(setup: Setup) -> anyhow::Result<()> {
    let device = settings::cuda_device_options(&setup.settings);
    let activation_checkpointing =
        settings::activation_checkpointing(setup.device, &setup.settings);
    let cuda = CudaOpen { device, attention: setup.attention, activation_checkpointing };
    let mut shown = Shown::new(&setup)?;
    let stop = shown.stop_handle.clone();
    let outcome = zeroflow_train::run::run(setup, cuda, &mut shown, &stop);
    shown.end(outcome)
}

/// [`run`] with the model `family` opened by `open` (tests: ranks as threads).
#[cfg(test)]
fn run_on<F: zeroflow_train::Family, M: zeroflow_train::Model>(
    setup: Setup,
    family: &F,
    open: impl zeroflow_train::open::OpenFn<F, M>,
) -> anyhow::Result<()> {
    let mut shown = Shown::new(&setup)?;
    let stop = shown.stop_handle.clone();
    let outcome = zeroflow_train::run::run_on(setup, family, open, &mut shown, &stop);
    shown.end(outcome)
}

/// A run as the user watches it: rank 0's progress, and the signals that stop it.
struct Shown {
    /// Silent until the run starts building its model (after its header line): then rank 0's.
    progress: Progress,
    /// What rank 0's progress shows once the run starts: steps, those taken, `--log-every`, and
    /// the interval of its lines.
    pending: Option<(u64, u64, u64, std::time::Duration)>,
    leader: bool,
    stop_handle: StopHandle,
    /// Catches SIGINT and SIGTERM once the model is ready.
    stop: Option<Stop>,
    /// The command that continues the run, up to `--resume` ([`resume_command`]).
    resume_with: String,
}

/// The command that continues a run on `device` of the job `dist`, up to its `--resume latest
/// --out` (what a resume does not take from the checkpoint: the launcher and the device).
fn resume_command(device: DeviceKind, dist: &DistEnv) -> String {
    let device = match device {
        DeviceKind::Cuda => " --device cuda",
        DeviceKind::Cpu => "",
    };
    match dist.world_size {
        1 => format!("zeroflow train{device}"),
        n if n == dist.local_world_size => {
            format!("zeroflow launch --nproc-per-node {n} -- train{device}")
        }
        _ => format!("the run's launch command with train{device}"),
    }
}

impl Shown {
    fn new(setup: &Setup) -> anyhow::Result<Shown> {
        let leader = setup.dist.rank == 0;
        let interval = output::progress_interval()?;
        let pending =
            leader.then_some((setup.steps, setup.start_step(), setup.log_every, interval));
        let (progress, stop_handle) = (Progress::Silent, StopHandle::default());
        let resume_with = resume_command(setup.device, &setup.dist);
        Ok(Shown { progress, pending, leader, stop_handle, stop: None, resume_with })
    }

    /// Prints the line the run ends with; a stopped run is an [`Exit`] error.
    fn end(self, outcome: Result<Outcome, TrainError>) -> anyhow::Result<()> {
        let outcome = outcome?;
        let (done, steps, saved) = (outcome.done, outcome.steps, outcome.saved.as_deref());
        let (last_eval, floor) = (outcome.last_eval, outcome.floor);
        if !outcome.interrupted {
            if self.leader {
                println!("{}", output::final_line(last_eval, floor));
            }
            return Ok(());
        }
        let (code, signal) = self.stop.as_ref().map_or(signals::ELSEWHERE, Stop::exit);
        let exported = outcome.exported.as_deref();
        if self.leader {
            let kept = (saved, exported);
            println!("{}", output::interrupted_line(done, steps, kept, last_eval, floor));
        }
        let message = match exported {
            // The step's own checkpoint was refused: a resume would go back to an older one.
            Some(to) => format!(
                "stopped by {signal}; the weights of step {done} are in {} (no checkpoint of it \
                 could be saved)",
                to.display()
            ),
            None => format!(
                "stopped by {signal}; continue with: {} --resume latest --out {}",
                self.resume_with,
                outcome.out.display()
            ),
        };
        Err(Exit { code, message }.into())
    }
}

impl TrainObserver for Shown {
    fn doing(&mut self, activity: Activity) {
        if let Some((steps, done, log_every, interval)) = self.pending.take() {
            self.progress = Progress::new(steps, done, log_every, interval);
        }
        self.progress.doing(|| match activity {
            Activity::Building { parameters } => {
                format!("building the model ({parameters} parameters)")
            }
            Activity::Step { step, steps } => format!("step {step}/{steps} running"),
            Activity::Evaluating { after, batch, batches } => {
                format!("evaluating after step {after}: batch {batch}/{batches}")
            }
            Activity::Saving { step } => format!("saving the checkpoint of step {step}"),
            Activity::Exporting { step } => format!("exporting the weights of step {step}"),
            Activity::Sampling { step } => {
                format!("writing a sample by the weights of step {step} (on the CPU)")
            }
        });
    }

    fn on_model_ready(&mut self, device: &str, seconds: f64) -> Result<(), ObserverError> {
        self.progress.println(&format!("model ready on {device} in {seconds:.1} s"));
        // Caught from here on: before, there is nothing to save, and a signal must end a rank
        // that waits at the rendezvous or in NCCL's initialisation (the launcher stopping a
        // failed job).
        self.stop = Some(Stop::on_signals(&self.stop_handle)?);
        Ok(())
    }

    fn on_step(&mut self, record: &StepRecord) {
        self.progress.step(record);
    }

    fn on_eval(&mut self, step: u64, loss: f64, floor: Option<f64>) {
        self.progress.println(&output::eval_line(step, loss, floor));
    }

    fn on_checkpoint(&mut self, step: u64, dir: &Path, seconds: f64) {
        self.progress.println(&format!("step {step}: saved {} in {seconds:.1} s", dir.display()));
    }

    fn on_steps_done(&mut self) {
        self.progress.finish();
    }

    fn loss_svg(
        &mut self,
        train: &[(u64, f64)],
        eval: &[(u64, f64)],
        floor: Option<f64>,
    ) -> Option<String> {
        Some(plot::loss_svg(train, eval, floor))
    }
}

#[cfg(test)]
mod resume_command_tests {
    use std::time::Duration;

    use super::*;

    fn job(world_size: usize, local_world_size: usize) -> DistEnv {
        DistEnv {
            rank: 0,
            local_rank: 0,
            world_size,
            local_world_size,
            master: None,
            rendezvous_timeout: Duration::from_secs(1),
            step_timeout: None,
        }
    }

    /// The command a stopped run names gives what the checkpoint does not record: a GPU run's
    /// device (resumed without it, `--resume` asks for it) and the launcher of several ranks.
    #[test]
    fn the_resume_command_names_the_device_and_the_launcher() {
        assert_eq!(resume_command(DeviceKind::Cpu, &job(1, 1)), "zeroflow train");
        assert_eq!(resume_command(DeviceKind::Cuda, &job(1, 1)), "zeroflow train --device cuda");
        assert_eq!(
            resume_command(DeviceKind::Cuda, &job(4, 4)),
            "zeroflow launch --nproc-per-node 4 -- train --device cuda"
        );
        assert_eq!(
            resume_command(DeviceKind::Cuda, &job(16, 8)),
            "the run's launch command with train --device cuda"
        );
    }
}
