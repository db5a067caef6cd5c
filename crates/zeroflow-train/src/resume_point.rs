//! The checkpoints of a run (DESIGN.md §7): what the trainer adds to `state.json`, and finding the
//! one `--resume` names. Listing, saving (by one process or every rank) and cleaning up are in
//! [`crate::checkpoints`].
//!
//! `state.json`'s `extra` is [`Extra`]: with the engine's counters in the checkpoint's own fields,
//! it is everything a run needs to continue exactly.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use zeroflow_data::DataPosition;
use zeroflow_engine::checkpoint::{self, CheckpointError, Opened};

use crate::ModelSpec;
use crate::checkpoints::{FOLDER, list};
use crate::data_files::DataFile;
use crate::error::{Result, TrainError, input, io};

/// What the trainer adds to a checkpoint's `state.json` (`extra`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Extra {
    /// The model's family and shape (what `zeroflow export` reads); a bare GPT-2 shape in
    /// checkpoints from before the family was recorded.
    #[serde(deserialize_with = "ModelSpec::deserialize_tagged_or_bare")]
    pub model: ModelSpec,
    /// The resolved DeepSpeed config of the run.
    pub config: serde_json::Value,
    /// `--data` resolved to an absolute path ([`crate::data_files::resolve`]; as given, in checkpoints
    /// from before that), or `synthetic`.
    pub data: String,
    /// The data files and their fingerprints, to notice a file that changed (none for the
    /// synthetic corpus, and in checkpoints from before fingerprints).
    #[serde(default)]
    pub data_files: Vec<DataFile>,
    /// Where the training stream's next step starts (the evaluation set is fixed by the seed).
    pub data_position: DataPosition,
    /// `--eval-data` and `--eval-tokens` (absent in checkpoints from before them): a resumed run
    /// holds out the same evaluation set, so its training stream reads the same tokens.
    #[serde(default)]
    pub eval_data: Option<String>,
    #[serde(default)]
    pub eval_tokens: Option<u64>,
    /// Whether the run held out documents of data tokenized at start-up, spread over it, for
    /// evaluation (without `--eval-data`; absent in checkpoints from before, whose runs held out
    /// the tail of the last shard): a resumed run holds out the same, so its training stream
    /// reads the same tokens.
    #[serde(default)]
    pub documents_held_out: Option<bool>,
    /// `--chat-template` (an absolute path) and `--chat-template-kwargs` of data tokenized at
    /// start-up (absent where none were given, and in checkpoints from before them): a resumed run
    /// tokenizes with the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<zeroflow_data::TemplateVariables>,
    /// Tokens per training sequence (`--seq`; absent in checkpoints from before it was kept): a
    /// resumed run reads its data in rows of the same length.
    #[serde(default)]
    pub seq: Option<u64>,
    pub seed: u64,
    /// Optimizer steps the trainer has taken (skipped ones included).
    pub step: u64,
    pub lr_schedule: LrPosition,
    /// Training time so far (evaluation excluded), for tokens per second across a resume.
    pub train_s: f64,
    /// Wall-clock time of the run so far, every process that trained it up to this checkpoint
    /// (set-up, evaluations and checkpoints included); absent in checkpoints from before it.
    #[serde(default)]
    pub wall_s: Option<f64>,
    pub run: RunInfo,
    /// The run-time settings in effect ([`crate::settings::Effective`]); `null` in checkpoints
    /// written before they were recorded.
    #[serde(default)]
    pub settings: serde_json::Value,
    /// Whether the run's weight decay leaves the 1-D parameters out
    /// ([`zeroflow_core::layout::ParamView::takes_weight_decay`]), as every checkpoint since the
    /// rule does; `false` in checkpoints from before it, whose runs decayed every parameter.
    #[serde(default)]
    pub decay_skips_1d: bool,
    /// Whether the training rows were read in a shuffled order (`--shuffle`; absent in
    /// checkpoints from before it, whose runs read them in order).
    #[serde(default)]
    pub shuffle: Option<bool>,
    /// The flags that steer the run without changing its numbers, as its start gave them (empty
    /// in checkpoints from before they were kept): a resume's defaults.
    #[serde(default)]
    pub steering: Steering,
}

/// What a run was asked to do besides training, which a resume without the flags continues:
/// `--eval-every`, `--save-every` (`None`: not given, so paced), `--keep`, `--log-every`,
/// `--export` (an absolute path) and `--sample-every` with `--sample-prompt`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Steering {
    pub eval_every: Option<u64>,
    pub save_every: Option<u64>,
    pub keep: Option<u64>,
    pub log_every: Option<u64>,
    pub export: Option<PathBuf>,
    pub sample: Option<crate::sample::SampleOptions>,
}

/// Where the learning-rate schedule is.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LrPosition {
    /// Optimizer steps taken: the next step's learning rate is the schedule's at this iteration.
    pub iteration: u64,
    /// That learning rate, under the schedule of the run that saved the checkpoint.
    pub next_lr: f64,
}

/// What the run was, for the reader of the checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub zeroflow_version: String,
    pub config_file: Option<String>,
    pub data_description: String,
    /// The Hugging Face directory the run's initial weights came from, if any.
    pub init_from: Option<String>,
    /// `--steps` of the run that saved the checkpoint.
    pub steps: u64,
    pub eval_every: u64,
}

/// A checkpoint to continue from, checked.
#[derive(Debug)]
pub struct ResumePoint {
    pub dir: PathBuf,
    /// The run directory the checkpoint belongs to (`<run>/checkpoints/step-…`).
    pub run_dir: PathBuf,
    /// The checkpoint, opened: its files are read when the run is built.
    pub loaded: Opened,
    pub extra: Extra,
    /// Newer checkpoints of the run that are damaged (`--resume latest` passed over them).
    pub damaged: Vec<PathBuf>,
}

/// The checkpoint `--resume` names: a directory, or `latest` under `--out`. Opens it
/// (`checkpoint::open`: `state.json` and every file's header checked against the file; the data
/// is read later, a piece at a time); any problem is an input error that names the file and says
/// what to do. Nothing is changed.
pub fn find(arg: &str, out: Option<&Path>) -> Result<ResumePoint> {
    let (dir, loaded, damaged) = if arg == "latest" {
        latest(out)?
    } else {
        let dir = PathBuf::from(arg);
        let loaded = checkpoint::open(&dir).map_err(|e| resume_error(&e))?;
        (dir, loaded, Vec::new())
    };
    let extra = extra_of(&dir, &loaded)?;
    let run_dir = run_dir_of(&dir).ok_or_else(|| {
        input(format!(
            "--resume {}: not inside a run's {FOLDER}/ directory, so there is no run to \
                 continue; pass a <run>/{FOLDER}/step-NNNNNNNN directory",
            dir.display()
        ))
    })?;
    let newer: Vec<String> = list(&run_dir)?
        .into_iter()
        .filter(|(step, path)| *step > extra.step && !damaged.contains(path))
        .map(|(_, path)| path.display().to_string())
        .collect();
    if !newer.is_empty() {
        return Err(input(format!(
            "--resume {}: the run has newer checkpoints ({}), which continuing from here would \
             overwrite; resume from `latest`, or move them away first",
            dir.display(),
            newer.join(", ")
        )));
    }
    Ok(ResumePoint { dir, run_dir, loaded, extra, damaged })
}

/// The trainer's record in the checkpoint `dir` (opened as `loaded`): an input error where it is
/// not what `zeroflow train` writes.
pub(crate) fn extra_of(dir: &Path, loaded: &Opened) -> Result<Extra> {
    serde_json::from_value(loaded.meta.extra.clone()).map_err(|e| {
        input(format!(
            "{}: extra in state.json is not what zeroflow train writes ({e}); resume from a \
             checkpoint that zeroflow train saved",
            dir.join("state.json").display()
        ))
    })
}

/// The run directory of the checkpoint `dir`, where it lies in one's `checkpoints/`.
pub(crate) fn run_dir_of(dir: &Path) -> Option<PathBuf> {
    let parent = dir.parent().filter(|parent| parent.file_name().is_some_and(|n| n == FOLDER));
    parent.and_then(Path::parent).map(Path::to_path_buf)
}

/// The newest checkpoint under `out` that loads. A damaged newer one (which an atomic write
/// cannot leave, so the disk or a person changed it) is passed over with a warning and later set
/// aside, never deleted; a foreign or mismatched one is an error.
fn latest(out: Option<&Path>) -> Result<(PathBuf, Opened, Vec<PathBuf>)> {
    let out = out.ok_or_else(|| {
        input("--resume latest needs --out: the run directory whose newest checkpoint to continue")
    })?;
    let mut damaged = Vec::new();
    for (_, dir) in list(out)?.into_iter().rev() {
        match checkpoint::open(&dir) {
            Ok(loaded) => return Ok((dir, loaded, damaged)),
            Err(e @ (CheckpointError::Corrupt { .. } | CheckpointError::Io { .. })) => {
                tracing::warn!("{e}; trying the checkpoint before it");
                damaged.push(dir);
            }
            Err(e) => return Err(resume_error(&e)),
        }
    }
    let what = if damaged.is_empty() { "no checkpoints" } else { "no undamaged checkpoints" };
    Err(input(format!(
        "--resume latest: {what} in {}; start the run without --resume (and a new --out)",
        out.join(FOLDER).display()
    )))
}

/// Moves the damaged checkpoints that `--resume latest` passed over out of the way of the steps
/// the run is about to save: `step-N` becomes the hidden `.step-N.damaged`.
pub fn set_aside(damaged: &[PathBuf]) -> Result<()> {
    for dir in damaged {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("step");
        let aside = dir.with_file_name(format!(".{name}.damaged"));
        std::fs::rename(dir, &aside).map_err(io(format!(
            "move the damaged {} to {}",
            dir.display(),
            aside.display()
        )))?;
        tracing::warn!("moved the damaged {} to {}", dir.display(), aside.display());
    }
    Ok(())
}

/// A checkpoint that cannot be resumed from, as an input error with what to do.
pub fn resume_error(e: &CheckpointError) -> TrainError {
    let hint = match e {
        CheckpointError::Corrupt { .. } => "",
        CheckpointError::Mismatch { .. } => {
            "; resume with the model and precision it was saved with, or start a new run"
        }
        _ => "; pass a checkpoint directory (<run>/checkpoints/step-NNNNNNNN) or `latest`",
    };
    input(format!("--resume: {e}{hint}"))
}
