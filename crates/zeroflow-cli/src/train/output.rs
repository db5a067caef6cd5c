//! What a run shows and leaves behind: the progress bar (or progress lines without a terminal),
//! `metrics.jsonl`, `loss.svg` and `summary.json`.

use std::fs::File;
use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

/// One optimizer step as recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRecord {
    pub step: u64,
    /// Mean training loss over the step's micro-batches.
    pub loss: f64,
    pub lr: f64,
    /// `None` when the step was skipped (non-finite gradients).
    pub grad_norm: Option<f64>,
    pub loss_scale: f32,
    /// Training tokens per second of training time so far (evaluation excluded).
    pub tokens_per_s: f64,
}

/// Where the run writes, and the losses it keeps for the plot. In a job of several ranks only
/// rank 0 writes; the others' recorder ([`Recorder::discard`]) keeps the losses and writes nothing.
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    /// `None` on the ranks that do not write.
    metrics: Option<BufWriter<File>>,
    pub train: Vec<(u64, f64)>,
    pub eval: Vec<(u64, f64)>,
}

impl Recorder {
    /// Creates `dir` (and its parents) and `metrics.jsonl` in it.
    pub fn create(dir: &Path) -> anyhow::Result<Recorder> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join("metrics.jsonl");
        let file =
            File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Recorder {
            dir: dir.to_owned(),
            metrics: Some(BufWriter::new(file)),
            train: Vec::new(),
            eval: Vec::new(),
        })
    }

    /// A recorder that writes nothing (ranks other than 0).
    pub fn discard(dir: &Path) -> Recorder {
        Recorder { dir: dir.to_owned(), metrics: None, train: Vec::new(), eval: Vec::new() }
    }

    /// Continues the `metrics.jsonl` of `dir` after the checkpoint at `step`: drops the lines of
    /// later steps (and an evaluation at `step` that only the run's end or an interruption made,
    /// off the `eval_every` schedule), so the file reads as if the run had not stopped.
    pub fn resume(dir: &Path, step: u64, eval_every: u64) -> anyhow::Result<Recorder> {
        let path = dir.join("metrics.jsonl");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let eval_on_schedule = eval_every > 0 && step.is_multiple_of(eval_every);
        let (mut train, mut eval, mut kept) = (Vec::new(), Vec::new(), String::new());
        for line in text.lines() {
            let Ok(value) = serde_json::from_str::<Value>(line) else { continue };
            let Some(at) = value.get("step").and_then(Value::as_u64) else { continue };
            let loss = value.get("loss").and_then(Value::as_f64);
            let eval_loss = value.get("eval_loss").and_then(Value::as_f64);
            let keep = at < step || (at == step && (loss.is_some() || eval_on_schedule));
            if !keep {
                continue;
            }
            match (loss, eval_loss) {
                (Some(loss), _) => train.push((at, loss)),
                (None, Some(loss)) => eval.push((at, loss)),
                (None, None) => {}
            }
            kept.push_str(line);
            kept.push('\n');
        }
        let temp = dir.join(".metrics.jsonl.resume");
        write_file(&temp, kept.as_bytes())?;
        std::fs::rename(&temp, &path)
            .with_context(|| format!("cannot replace {}", path.display()))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Recorder { dir: dir.to_owned(), metrics: Some(BufWriter::new(file)), train, eval })
    }

    pub fn step(&mut self, record: &StepRecord) -> anyhow::Result<()> {
        self.train.push((record.step, record.loss));
        self.write(&json!({
            "step": record.step,
            "loss": record.loss,
            "lr": record.lr,
            "grad_norm": record.grad_norm,
            "loss_scale": record.loss_scale,
            "tokens_per_s": record.tokens_per_s,
        }))
    }

    pub fn eval(&mut self, step: u64, eval_loss: f64) -> anyhow::Result<()> {
        self.eval.push((step, eval_loss));
        self.write(&json!({ "step": step, "eval_loss": eval_loss }))
    }

    fn write(&mut self, line: &Value) -> anyhow::Result<()> {
        let Some(metrics) = &mut self.metrics else { return Ok(()) };
        // Flushed line by line, so that a reader (or a crash) sees every finished step.
        writeln!(metrics, "{line}")
            .and_then(|()| metrics.flush())
            .context("cannot write metrics.jsonl")
    }

    /// Flushes the metrics and writes the plot and the summary.
    pub fn finish(self, floor: Option<f64>, summary: &Value) -> anyhow::Result<()> {
        let Some(mut metrics) = self.metrics else { return Ok(()) };
        metrics.flush().context("cannot write metrics.jsonl")?;
        let svg = super::plot::loss_svg(&self.train, &self.eval, floor);
        write_file(&self.dir.join("loss.svg"), svg.as_bytes())?;
        let text = serde_json::to_string_pretty(summary).expect("JSON values serialise");
        write_file(&self.dir.join("summary.json"), format!("{text}\n").as_bytes())
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

/// What the user watches: a progress bar on a terminal, else a line every `log_every` steps;
/// nothing on the ranks other than 0.
#[derive(Debug)]
pub enum Progress {
    Bar(ProgressBar),
    Lines { steps: u64, log_every: u64 },
    Silent,
}

impl Progress {
    pub fn new(steps: u64, log_every: u64) -> Progress {
        if !std::io::stderr().is_terminal() {
            return Progress::Lines { steps, log_every };
        }
        let bar = ProgressBar::new(steps);
        let style =
            ProgressStyle::with_template("{bar:20.cyan/blue} step {pos}/{len} {msg} ETA {eta}")
                .expect("the template is valid")
                .progress_chars("=> ");
        bar.set_style(style);
        bar.enable_steady_tick(Duration::from_millis(200));
        Progress::Bar(bar)
    }

    pub fn step(&self, record: &StepRecord) {
        let text = format!(
            "loss {:.4} lr {:.1e} {:.0} tok/s",
            record.loss, record.lr, record.tokens_per_s
        );
        match self {
            Progress::Bar(bar) => {
                bar.set_position(record.step);
                bar.set_message(text);
            }
            Progress::Lines { steps, log_every } => {
                if record.step.is_multiple_of(*log_every) || record.step == *steps {
                    tracing::info!("step {}/{steps} {text}", record.step);
                }
            }
            Progress::Silent => {}
        }
    }

    /// Shows a message above the bar (or as a log line).
    pub fn println(&self, message: &str) {
        match self {
            Progress::Bar(bar) => bar.println(message),
            Progress::Lines { .. } => tracing::info!("{message}"),
            Progress::Silent => {}
        }
    }

    pub fn finish(&self) {
        if let Progress::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}
