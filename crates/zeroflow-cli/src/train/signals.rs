//! SIGINT and SIGTERM during a run. The first says at once (on stderr) what will happen and asks
//! the run to stop: it finishes the step it is in (an evaluation is abandoned), saves a checkpoint
//! and exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), so that `train &&
//! export` does not go on. Another signal a second or more later exits at once, saving nothing: a
//! checkpoint it cuts short is a hidden `.step-*.partial-*` directory, which the next start in the
//! run directory removes. Signals within [`GRACE`] of the first are the same request: a wrapper
//! that signals the run and then its process group (`timeout` does, on its own expiry and when it
//! is signalled) delivers two at once, and the second must not cost the run its checkpoint.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use signal_hook::SigId;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::{Handle, Signals};
use zeroflow_train::observer::StopHandle;

/// The exit status and the cause of a run that a signal stopped on another rank only.
pub const ELSEWHERE: (u8, &str) = (130, "a signal to another rank");

/// How long after the first signal others are taken as part of the same request.
pub const GRACE: Duration = Duration::from_secs(1);

/// What the signals asked of the run, while it is alive; dropping it stops acting on them (they
/// are then ignored, not handled by default: signal-hook cannot restore the default action; the
/// program ends soon after).
pub struct Stop {
    /// 128 + the number of the first signal the signal thread read (0: none yet).
    first: Arc<AtomicUsize>,
    /// 128 + the number of the latest signal, set in the handler itself: the run may end before
    /// the signal thread has read the first.
    latest: Arc<AtomicUsize>,
    registered: Vec<SigId>,
    notices: Handle,
}

impl Stop {
    /// Catches SIGINT and SIGTERM from now on, asking `handle`'s run to stop.
    pub fn on_signals(handle: &StopHandle) -> anyhow::Result<Stop> {
        let requested = Arc::clone(handle.flag());
        let (first, latest) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let mut registered = Vec::new();
        for (signal, exit) in [(SIGINT, 130), (SIGTERM, 143)] {
            use signal_hook::flag;
            registered.push(flag::register_usize(signal, latest.clone(), exit)?);
            registered.push(flag::register(signal, requested.clone())?);
        }
        let signals = Signals::new([SIGINT, SIGTERM]).context("cannot handle signals")?;
        let notices = signals.handle();
        let (at, seen) = (handle.clone(), first.clone());
        std::thread::Builder::new()
            .name("zeroflow-signals".into())
            .spawn(move || answer(signals, &at, &seen))
            .context("cannot start the signal thread")?;
        Ok(Stop { first, latest, registered, notices })
    }

    /// The exit status of the stopped run, and the signal's name.
    pub fn exit(&self) -> (u8, &'static str) {
        let first = self.first.load(Ordering::Relaxed);
        match if first == 0 { self.latest.load(Ordering::Relaxed) } else { first } {
            130 => (130, "SIGINT"),
            143 => (143, "SIGTERM"),
            _ => ELSEWHERE,
        }
    }
}

/// The signal thread: the first signal's notice, then an exit without saving at the first signal
/// that comes [`GRACE`] or more after it. Ends when the [`Stop`] is dropped. The notice is
/// written by a thread of its own: a write to a full pipe (a pager not read) must not keep the
/// second signal from ending the run.
fn answer(mut signals: Signals, at: &StopHandle, first: &AtomicUsize) {
    let mut since: Option<Instant> = None;
    for signal in signals.forever() {
        let status: usize = if signal == SIGINT { 130 } else { 143 };
        match since {
            None => {
                since = Some(Instant::now());
                first.store(status, Ordering::Relaxed);
                let said = notice(signal, at.step());
                let printed = said.clone();
                let writer = std::thread::Builder::new().name("zeroflow-notice".into());
                if writer.spawn(move || crate::log::line(&printed)).is_err() {
                    crate::log::line(&said);
                }
            }
            Some(t) if t.elapsed() >= GRACE => signal_hook::low_level::exit(status as i32),
            Some(_) => {}
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
         checkpoint and exiting with status {status}; another Ctrl-C or SIGTERM a second or more \
         from now exits at once, without saving"
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
