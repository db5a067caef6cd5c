//! What a run shows: the progress bar (or progress lines without a terminal), and the lines an
//! evaluation and the run's end print.

use std::io::IsTerminal;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use zeroflow_train::metrics::StepRecord;

/// The line an evaluation prints, with the entropy floor where it is known.
pub fn eval_line(step: u64, eval_loss: f64, floor: Option<f64>) -> String {
    match floor {
        Some(floor) => format!(
            "step {step}: eval loss {eval_loss:.4} ({:+.1}% over the floor {floor:.4})",
            100.0 * (eval_loss / floor - 1.0)
        ),
        None => format!("step {step}: eval loss {eval_loss:.4}"),
    }
}

/// The line a run ends with, e.g. `final eval loss 1.12 nats/token; entropy floor 1.09 (+2.6%)`.
pub fn final_line(last_eval: Option<(u64, f64)>, floor: Option<f64>) -> String {
    let Some((_, eval_loss)) = last_eval else { return "no evaluation was made".to_owned() };
    match floor {
        Some(floor) => format!(
            "final eval loss {eval_loss:.3} nats/token; entropy floor {floor:.3} ({:+.1}%)",
            100.0 * (eval_loss / floor - 1.0)
        ),
        None => format!("final eval loss {eval_loss:.3} nats/token"),
    }
}

/// The line an interrupted run ends with: the step it stopped at, its newest checkpoint (and the
/// directory `--export` wrote where that step's checkpoint was refused), and the latest
/// evaluation with its step.
pub fn interrupted_line(
    done: u64,
    steps: u64,
    (saved, exported): (Option<&Path>, Option<&Path>),
    last_eval: Option<(u64, f64)>,
    floor: Option<f64>,
) -> String {
    let saved = match (saved, exported) {
        (Some(dir), None) => format!("checkpoint {}", dir.display()),
        (Some(dir), Some(to)) => format!(
            "newest checkpoint {}; its own refused for want of disk space, the weights of step \
             {done} exported to {}",
            dir.display(),
            to.display()
        ),
        (None, Some(to)) => format!(
            "no checkpoint, refused for want of disk space; the weights of step {done} exported \
             to {}",
            to.display()
        ),
        (None, None) => "no checkpoint: no step was taken".to_owned(),
    };
    let eval = match last_eval {
        Some((step, loss)) => match floor {
            Some(floor) => format!(
                "eval loss {loss:.3} nats/token at step {step} (entropy floor {floor:.3}, {:+.1}%)",
                100.0 * (loss / floor - 1.0)
            ),
            None => format!("eval loss {loss:.3} nats/token at step {step}"),
        },
        None => "no evaluation yet".to_owned(),
    };
    format!("interrupted at step {done} of {steps} ({saved}); {eval}")
}

/// How often, without a terminal, a line says what the run is doing when nothing else was printed
/// (`ZEROFLOW_PROGRESS_SECS`, seconds, fractions allowed; default 30).
pub fn progress_interval() -> anyhow::Result<Duration> {
    let Some(text) = zeroflow_core::env::var("ZEROFLOW_PROGRESS_SECS") else {
        return Ok(Duration::from_secs(30));
    };
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|secs| secs.is_finite() && *secs > 0.0)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            crate::InputError::from_display(format!(
                "ZEROFLOW_PROGRESS_SECS={text}: not a positive number of seconds"
            ))
        })
}

/// What the user watches: a progress bar on a terminal, else lines (every `log_every` steps, and
/// by time: see [`Lines`]); nothing on the ranks other than 0.
#[derive(Debug)]
pub enum Progress {
    Bar(crate::log::Shown),
    Lines(Lines),
    Silent,
}

impl Progress {
    /// Starts showing the progress of a run of `steps` steps, `done` of them already taken.
    pub fn new(steps: u64, done: u64, log_every: u64, interval: Duration) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::Lines(Lines::start(steps, log_every, interval));
        }
        let bar = ProgressBar::new(steps);
        let style = ProgressStyle::with_template(
            "{spinner} {bar:20.cyan/blue} step {pos}/{len} {msg} [{elapsed}, ETA {eta}]",
        )
        .expect("the template is valid")
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_position(done);
        bar.reset_eta();
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress::Bar(crate::log::Shown::new(bar))
    }

    /// Says what the run is doing now (building the model, a step, an evaluation, a checkpoint):
    /// the bar's message, or, without a terminal, what a line says when it runs long. The text
    /// is made only where it is shown (not on the ranks that print nothing).
    pub fn doing(&self, activity: impl FnOnce() -> String) {
        match self {
            Progress::Bar(shown) => shown.bar().set_message(activity()),
            Progress::Lines(lines) => lines.doing(activity()),
            Progress::Silent => {}
        }
    }

    pub fn step(&self, record: &StepRecord) {
        let mut text = format!(
            "loss {:.4} lr {:.1e} {:.0} tok/s",
            record.loss, record.lr, record.tokens_per_s
        );
        if let Some(epoch) = record.epoch {
            text.push_str(&format!(" epoch {epoch:.2}"));
        }
        match self {
            Progress::Bar(shown) => {
                shown.bar().set_position(record.step);
                shown.bar().set_message(text);
            }
            Progress::Lines(lines) => lines.step(record.step, &text),
            Progress::Silent => {}
        }
    }

    /// Shows a message above the bar (or as a log line).
    pub fn println(&self, message: &str) {
        match self {
            Progress::Bar(shown) => shown.bar().println(message),
            Progress::Lines(lines) => lines.println(message),
            Progress::Silent => {}
        }
    }

    pub fn finish(&self) {
        match self {
            Progress::Bar(shown) => shown.bar().finish_and_clear(),
            // Nothing runs any more: the watcher names nothing from here on.
            Progress::Lines(lines) => lines.lock().activity = None,
            Progress::Silent => {}
        }
    }
}

/// Progress as log lines, for a run without a terminal: a line every `log_every` steps, or after a
/// step that ends `interval` or more after the last line; and, from a thread, a line saying what
/// runs whenever `interval` (at least [`MIN_REPEAT`]) passes without any (a long step, evaluation,
/// checkpoint or model build), so that a slow run is never silent for long.
pub struct Lines {
    steps: u64,
    log_every: u64,
    interval: Duration,
    shared: Arc<LinesShared>,
    watcher: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lines")
            .field("steps", &self.steps)
            .field("interval", &self.interval)
            .finish()
    }
}

/// How often the watcher of [`Lines`] may speak, whatever the interval.
pub const MIN_REPEAT: Duration = Duration::from_millis(10);

/// Where [`Lines`] write a line: the log, or (in tests) a list.
pub type Say = Arc<dyn Fn(&str) + Send + Sync>;

struct LinesShared {
    state: Mutex<LinesState>,
    wake: Condvar,
    say: Say,
}

struct LinesState {
    /// What runs, and since when.
    activity: Option<(String, Instant)>,
    last_line: Instant,
    done: bool,
}

impl Lines {
    fn start(steps: u64, log_every: u64, interval: Duration) -> Lines {
        Lines::start_with(steps, log_every, interval, Arc::new(|line| tracing::info!("{line}")))
    }

    fn start_with(steps: u64, log_every: u64, interval: Duration, say: Say) -> Lines {
        let state = LinesState { activity: None, last_line: Instant::now(), done: false };
        let shared = Arc::new(LinesShared { state: Mutex::new(state), wake: Condvar::new(), say });
        let watched = Arc::clone(&shared);
        let watcher = std::thread::Builder::new()
            .name("zeroflow-progress".into())
            .spawn(move || watch(&watched, interval.max(MIN_REPEAT)))
            .ok();
        Lines { steps, log_every, interval, shared, watcher }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LinesState> {
        self.shared.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn doing(&self, activity: String) {
        self.lock().activity = Some((activity, Instant::now()));
    }

    fn step(&self, step: u64, text: &str) {
        let mut state = self.lock();
        let due = step.is_multiple_of(self.log_every)
            || step == self.steps
            || state.last_line.elapsed() >= self.interval;
        if due {
            (self.shared.say)(&format!("step {step}/{} {text}", self.steps));
            state.last_line = Instant::now();
        }
    }

    fn println(&self, message: &str) {
        let mut state = self.lock();
        (self.shared.say)(message);
        state.last_line = Instant::now();
    }
}

impl Drop for Lines {
    fn drop(&mut self) {
        self.lock().done = true;
        self.shared.wake.notify_all();
        if let Some(watcher) = self.watcher.take() {
            let _ = watcher.join();
        }
    }
}

/// The thread of [`Lines`]: once `interval` has passed since the last line, says what runs.
fn watch(shared: &LinesShared, interval: Duration) {
    let lock = || shared.state.lock().unwrap_or_else(|e| e.into_inner());
    let mut state = lock();
    while !state.done {
        let (due, now) = (state.last_line + interval, Instant::now());
        if now < due {
            state = shared.wake.wait_timeout(state, due - now).unwrap_or_else(|e| e.into_inner()).0;
            continue;
        }
        let Some((activity, since)) = &state.activity else {
            // Nothing to name yet: look again in an interval.
            state = shared.wake.wait_timeout(state, interval).unwrap_or_else(|e| e.into_inner()).0;
            continue;
        };
        let line = format!("{activity} (for {:.0} s)", since.elapsed().as_secs_f64());
        state.last_line = now;
        // Said without the lock: the training thread is not held up by a slow log.
        drop(state);
        (shared.say)(&line);
        state = lock();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use super::{Lines, Progress, Say};

    /// Lines that collect what they say.
    fn collecting(log_every: u64, interval: Duration) -> (Lines, Arc<Mutex<Vec<String>>>) {
        let said = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&said);
        let say: Say = Arc::new(move |line: &str| sink.lock().unwrap().push(line.to_owned()));
        (Lines::start_with(10, log_every, interval, say), said)
    }

    /// An activity that outlasts the interval is named, with how long it has run, without the
    /// training thread printing anything.
    #[test]
    fn a_long_activity_is_named_once_the_interval_passes_without_a_line() {
        let (lines, said) = collecting(1000, Duration::from_millis(20));
        lines.doing("evaluating after step 3: batch 2/16".into());
        let waited = Instant::now();
        while said.lock().unwrap().is_empty() && waited.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(5));
        }
        drop(lines);
        let said = said.lock().unwrap();
        assert!(!said.is_empty(), "no line in a minute");
        assert!(said[0].starts_with("evaluating after step 3: batch 2/16 (for "), "{said:?}");
    }

    /// An interrupted run's line names its checkpoint, or, where that step's checkpoint was
    /// refused, the directory `--export` wrote (and the older checkpoint, if any).
    #[test]
    fn an_interrupted_line_names_the_checkpoint_or_the_export() {
        use std::path::Path;
        let (ckpt, hf) = (Path::new("run/checkpoints/step-00000005"), Path::new("hf"));
        let line = |saved, exported| {
            super::interrupted_line(7, 10, (saved, exported), Some((5, 2.0)), None)
        };
        assert!(line(Some(ckpt), None).contains("(checkpoint run/checkpoints/step-00000005)"));
        let both = line(Some(ckpt), Some(hf));
        for said in ["newest checkpoint run/checkpoints/step-00000005", "step 7 exported to hf"] {
            assert!(both.contains(said), "{said:?} not in {both}");
        }
        let exported = line(None, Some(hf));
        assert!(exported.contains("no checkpoint, refused for want of disk space"), "{exported}");
        assert!(exported.contains("the weights of step 7 exported to hf"), "{exported}");
        assert!(line(None, None).contains("no checkpoint: no step was taken"));
    }

    /// Once the run's progress is finished, an activity left set (the export's, say) is not
    /// named any more, however long the process goes on.
    #[test]
    fn a_finished_progress_names_no_activity() {
        let (lines, said) = collecting(1000, Duration::from_millis(10));
        let progress = Progress::Lines(lines);
        progress.doing(|| "exporting the weights of step 5".into());
        progress.finish();
        std::thread::sleep(Duration::from_millis(200));
        drop(progress);
        assert_eq!(*said.lock().unwrap(), Vec::<String>::new());
    }

    /// Step lines come every `log_every` steps and at the last; with an interval that has passed,
    /// after every step.
    #[test]
    fn step_lines_come_by_steps_and_by_time() {
        let (lines, said) = collecting(4, Duration::from_secs(3600));
        for step in 1..=10 {
            lines.step(step, "loss 1");
        }
        drop(lines);
        assert_eq!(
            *said.lock().unwrap(),
            ["step 4/10 loss 1", "step 8/10 loss 1", "step 10/10 loss 1"]
        );
        let (lines, said) = collecting(1000, Duration::from_nanos(1));
        for step in 1..=3 {
            std::thread::sleep(Duration::from_millis(1));
            lines.step(step, "loss 1");
        }
        drop(lines);
        let steps: Vec<String> =
            said.lock().unwrap().iter().filter(|l| l.contains("loss")).cloned().collect();
        assert_eq!(steps, ["step 1/10 loss 1", "step 2/10 loss 1", "step 3/10 loss 1"]);
    }
}
