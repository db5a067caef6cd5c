//! SIGINT and SIGTERM during a run. The first says at once (on stderr) what will happen and asks
//! the run to stop: it finishes the step it is in (an evaluation is abandoned), saves a checkpoint
//! and exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), so that `train &&
//! export` does not go on. A second signal exits at once, saving nothing: a checkpoint it cuts
//! short is a hidden `.step-*.partial-*` directory, which the next start in the run directory
//! removes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context as _;
use signal_hook::SigId;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};
use zeroflow_train::observer::StopHandle;

/// The exit status and the cause of a run that a signal stopped on another rank only.
pub const ELSEWHERE: (u8, &str) = (130, "a signal to another rank");

/// What the signals asked of the run, while it is alive; dropping it restores the default
/// handling of the signals.
pub struct Stop {
    /// 128 + the number of the first signal (0: none yet).
    status: Arc<AtomicUsize>,
    registered: Vec<SigId>,
    notices: Handle,
}

impl Stop {
    /// Catches SIGINT and SIGTERM from now on, asking `handle`'s run to stop.
    pub fn on_signals(handle: &StopHandle) -> anyhow::Result<Stop> {
        let requested = Arc::clone(handle.flag());
        let status = Arc::new(AtomicUsize::new(0));
        let mut registered = Vec::new();
        for (signal, exit) in [(SIGINT, 130), (SIGTERM, 143)] {
            use signal_hook::flag;
            // Registered first, so that it sees the flag as the previous signal left it.
            registered.push(flag::register_conditional_shutdown(signal, exit, requested.clone())?);
            registered.push(flag::register_usize(signal, status.clone(), exit as usize)?);
            registered.push(flag::register(signal, requested.clone())?);
        }
        let mut signals = Signals::new([SIGINT, SIGTERM]).context("cannot handle signals")?;
        let notices = signals.handle();
        let at = handle.clone();
        std::thread::Builder::new()
            .name("zeroflow-signals".into())
            .spawn(move || {
                if let Some(signal) = signals.forever().next() {
                    crate::log::line(&notice(signal, at.step()));
                }
            })
            .context("cannot start the signal thread")?;
        Ok(Stop { status, registered, notices })
    }

    /// The exit status of the stopped run, and the signal's name.
    pub fn exit(&self) -> (u8, &'static str) {
        match self.status.load(Ordering::Relaxed) {
            130 => (130, "SIGINT"),
            143 => (143, "SIGTERM"),
            _ => ELSEWHERE,
        }
    }
}

impl Drop for Stop {
    fn drop(&mut self) {
        self.notices.close();
        for id in self.registered.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// What the first signal prints at once.
fn notice(signal: i32, step: u64) -> String {
    let (name, status) = if signal == SIGINT { ("SIGINT", 130) } else { ("SIGTERM", 143) };
    let during = if step == 0 { String::new() } else { format!(" during step {step}") };
    format!(
        "{name}{during}: stopping once the step ends (an evaluation is abandoned), then saving a \
         checkpoint and exiting with status {status}; a second Ctrl-C or SIGTERM exits at once, \
         without saving"
    )
}

#[cfg(test)]
mod tests {
    use super::notice;

    #[test]
    fn the_notice_names_the_signal_the_step_and_the_exit_status() {
        let said = notice(signal_hook::consts::SIGTERM, 37);
        assert!(said.starts_with("SIGTERM during step 37: stopping"), "{said}");
        assert!(said.contains("status 143") && said.contains("without saving"), "{said}");
        let said = notice(signal_hook::consts::SIGINT, 0);
        assert!(said.starts_with("SIGINT: stopping") && said.contains("status 130"), "{said}");
    }
}
