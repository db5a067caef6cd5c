//! What a run leaves in its directory besides checkpoints: `metrics.jsonl` (a line per step and
//! per evaluation), the same scalars in a TensorBoard event file
//! (`events.out.tfevents.<secs>.<host>.zeroflow`, a new one per process: [`EventWriter`]),
//! `summary.json`, and `loss.svg` where the caller draws one ([`Recorder`]).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::error::{Result, io};
use crate::tensorboard::EventWriter;

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
    /// The speculative exact offload step's counts so far (this rank's), where it speculates.
    pub speculation: Option<zeroflow_engine::SpeculationStats>,
    /// The epochs of the training data read by the end of the step (1.5: one and a half passes),
    /// where it has epochs (files; not the synthetic corpus).
    pub epoch: Option<f64>,
}

/// Where the run writes, and the losses it keeps for the plot. In a job of several ranks only
/// rank 0 writes; the others' recorder ([`Recorder::discard`]) keeps the losses and writes nothing.
#[derive(Debug)]
pub struct Recorder {
    dir: PathBuf,
    /// `None` on the ranks that do not write.
    metrics: Option<BufWriter<File>>,
    /// The TensorBoard events, where `metrics` is written.
    events: Option<EventWriter>,
    pub train: Vec<(u64, f64)>,
    pub eval: Vec<(u64, f64)>,
}

impl Recorder {
    /// Creates `dir` (and its parents) and `metrics.jsonl` in it.
    pub fn create(dir: &Path) -> Result<Recorder> {
        std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
        let path = dir.join("metrics.jsonl");
        let file = File::create(&path).map_err(io(format!("create {}", path.display())))?;
        Ok(Recorder {
            dir: dir.to_owned(),
            metrics: Some(BufWriter::new(file)),
            events: Some(events(dir)?),
            train: Vec::new(),
            eval: Vec::new(),
        })
    }

    /// A recorder that writes nothing (ranks other than 0).
    pub fn discard(dir: &Path) -> Recorder {
        let (train, eval) = (Vec::new(), Vec::new());
        Recorder { dir: dir.to_owned(), metrics: None, events: None, train, eval }
    }

    /// Continues the `metrics.jsonl` of `dir` after the checkpoint at `step`: drops the lines of
    /// later steps (and an evaluation at `step` that only the run's end or an interruption made,
    /// off the `eval_every` schedule), so the file reads as if the run had not stopped.
    pub fn resume(dir: &Path, step: u64, eval_every: u64) -> Result<Recorder> {
        let path = dir.join("metrics.jsonl");
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(io(format!("read {}", path.display()))(e)),
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
        std::fs::rename(&temp, &path).map_err(io(format!("replace {}", path.display())))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(io(format!("open {}", path.display())))?;
        let (metrics, events) = (Some(BufWriter::new(file)), Some(events(dir)?));
        Ok(Recorder { dir: dir.to_owned(), metrics, events, train, eval })
    }

    pub fn step(&mut self, record: &StepRecord) -> Result<()> {
        self.train.push((record.step, record.loss));
        if let Some(events) = &mut self.events {
            let mut scalars = vec![
                ("train/loss", record.loss),
                ("train/lr", record.lr),
                ("train/loss_scale", f64::from(record.loss_scale)),
                ("train/tokens_per_s", record.tokens_per_s),
            ];
            scalars.extend(record.grad_norm.map(|norm| ("train/grad_norm", norm)));
            scalars.extend(record.epoch.map(|epoch| ("train/epoch", epoch)));
            events.scalars(record.step, &scalars).map_err(io("write the event file".to_owned()))?;
        }
        let mut line = json!({
            "step": record.step,
            "loss": record.loss,
            "lr": record.lr,
            "grad_norm": record.grad_norm,
            "loss_scale": record.loss_scale,
            "tokens_per_s": record.tokens_per_s,
        });
        if let Some(epoch) = record.epoch {
            line["epoch"] = json!(epoch);
        }
        if let Some(stats) = record.speculation {
            line["speculated_steps"] = json!(stats.speculated_steps);
            line["redone_steps"] = json!(stats.redone_steps);
            line["paused_steps"] = json!(stats.paused_steps);
        }
        self.write(&line)
    }

    pub fn eval(&mut self, step: u64, eval_loss: f64) -> Result<()> {
        self.eval.push((step, eval_loss));
        if let Some(events) = &mut self.events {
            let scalars = [("eval/loss", eval_loss)];
            events.scalars(step, &scalars).map_err(io("write the event file".to_owned()))?;
        }
        self.write(&json!({ "step": step, "eval_loss": eval_loss }))
    }

    fn write(&mut self, line: &Value) -> Result<()> {
        let Some(metrics) = &mut self.metrics else { return Ok(()) };
        // Flushed line by line, so that a reader (or a crash) sees every finished step.
        writeln!(metrics, "{line}")
            .and_then(|()| metrics.flush())
            .map_err(io("write metrics.jsonl".to_owned()))
    }

    /// Flushes the metrics and writes the plot (`loss_svg` of the losses, where it draws one)
    /// and the summary.
    pub fn finish(
        self,
        loss_svg: impl FnOnce(&[(u64, f64)], &[(u64, f64)]) -> Option<String>,
        summary: &Value,
    ) -> Result<()> {
        let Some(mut metrics) = self.metrics else { return Ok(()) };
        metrics.flush().map_err(io("write metrics.jsonl".to_owned()))?;
        if let Some(svg) = loss_svg(&self.train, &self.eval) {
            write_file(&self.dir.join("loss.svg"), svg.as_bytes())?;
        }
        let text = serde_json::to_string_pretty(summary).expect("JSON values serialise");
        write_file(&self.dir.join("summary.json"), format!("{text}\n").as_bytes())
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(io(format!("write {}", path.display())))
}

/// A new TensorBoard event file in `dir`.
fn events(dir: &Path) -> Result<EventWriter> {
    EventWriter::create(dir).map_err(io(format!("create an event file in {}", dir.display())))
}
