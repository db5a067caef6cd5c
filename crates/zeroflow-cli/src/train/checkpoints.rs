//! The checkpoints of a run (DESIGN.md §7): `<out>/checkpoints/step-NNNNNNNN/`, written atomically
//! by [`checkpoint::save`], the newest `--keep` kept; and finding the one `--resume` names.
//!
//! `state.json`'s `extra` is [`Extra`]: with the engine's counters in the checkpoint's own fields,
//! it is everything a run needs to continue exactly.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use zeroflow_data::DataPosition;
use zeroflow_engine::checkpoint::{self, CheckpointError, Loaded, Meta, NamedTensor};
use zeroflow_engine::{OptimizerPart, ZenFlowSnapshot};

use super::data_files::DataFile;
use super::input;
use zeroflow_train::ModelSpec;
use zeroflow_train::dist::Group;

/// The folder of a run directory that holds its checkpoints.
pub const FOLDER: &str = "checkpoints";

/// What `zeroflow train` adds to a checkpoint's `state.json` (`extra`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Extra {
    /// The model's family and shape (what `zeroflow export` reads); a bare GPT-2 shape in
    /// checkpoints from before the family was recorded.
    #[serde(deserialize_with = "ModelSpec::deserialize_tagged_or_bare")]
    pub model: ModelSpec,
    /// The resolved DeepSpeed config of the run.
    pub config: serde_json::Value,
    /// `--data` resolved to an absolute path ([`super::data_files::resolve`]; as given, in checkpoints
    /// from before that), or `synthetic`.
    pub data: String,
    /// The data files and their fingerprints, to notice a file that changed (none for the
    /// synthetic corpus, and in checkpoints from before fingerprints).
    #[serde(default)]
    pub data_files: Vec<DataFile>,
    /// Where the training stream's next step starts (the evaluation set is fixed by the seed).
    pub data_position: DataPosition,
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

/// The directory of the checkpoint at `step` in the run directory `out`.
pub fn step_dir(out: &Path, step: u64) -> PathBuf {
    out.join(FOLDER).join(format!("step-{step:08}"))
}

/// The checkpoints of the run directory `out`, oldest first: the visible `step-N` directories.
/// A hidden `.step-N.partial-PID` directory (a crash during a write) is never one.
pub fn list(out: &Path) -> anyhow::Result<Vec<(u64, PathBuf)>> {
    let folder = out.join(FOLDER);
    if !folder.is_dir() {
        return Ok(Vec::new());
    }
    let entries =
        std::fs::read_dir(&folder).with_context(|| format!("cannot read {}", folder.display()))?;
    let mut found: Vec<(u64, PathBuf)> = entries
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.path().is_dir())
        .filter_map(|entry| {
            let name = entry.file_name();
            let step = name.to_str()?.strip_prefix("step-")?.parse().ok()?;
            Some((step, entry.path()))
        })
        .collect();
    found.sort();
    Ok(found)
}

/// Removes the hidden `.step-N.partial-*` directories under `out`'s checkpoints, which only a
/// write cut short leaves (a second signal, a crash, SIGKILL): none is ever a checkpoint. Returns
/// what it removed.
pub fn remove_unfinished(out: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let folder = out.join(FOLDER);
    if !folder.is_dir() {
        return Ok(Vec::new());
    }
    let entries =
        std::fs::read_dir(&folder).with_context(|| format!("cannot read {}", folder.display()))?;
    let mut removed = Vec::new();
    for entry in entries.filter_map(|entry| entry.ok()) {
        let name = entry.file_name();
        let unfinished = name
            .to_str()
            .and_then(|name| name.strip_prefix(".step-"))
            .is_some_and(|rest| rest.contains(".partial-"));
        if unfinished && entry.path().is_dir() {
            std::fs::remove_dir_all(entry.path()).with_context(|| {
                format!("cannot remove the unfinished checkpoint {}", entry.path().display())
            })?;
            removed.push(entry.path());
        }
    }
    Ok(removed)
}

/// Saves the checkpoint of `step` and then deletes all but the newest `keep`.
#[allow(clippy::too_many_arguments, reason = "one checkpoint's pieces")]
pub fn save(
    out: &Path,
    step: u64,
    keep: u64,
    meta: &Meta,
    weights: &[f32],
    tensors: &[NamedTensor],
    parts: &[OptimizerPart],
    zenflow: &[ZenFlowSnapshot],
) -> anyhow::Result<PathBuf> {
    let dir = step_dir(out, step);
    std::fs::create_dir_all(out.join(FOLDER))
        .with_context(|| format!("cannot create {}", out.join(FOLDER).display()))?;
    checkpoint::save_with_zenflow(&dir, meta, weights, tensors, parts, zenflow)?;
    let all = list(out)?;
    let old = all.len().saturating_sub(keep as usize);
    for (_, older) in &all[..old] {
        std::fs::remove_dir_all(older)
            .with_context(|| format!("cannot delete the old checkpoint {}", older.display()))?;
    }
    Ok(dir)
}

/// What one rank of several contributes to a checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct Share<'a> {
    pub rank: usize,
    /// Rank 0's: the flat weights, with `state.json`.
    pub weights: Option<&'a [f32]>,
    /// This rank's optimizer part, where the checkpoint has one per rank (and rank 0's otherwise).
    pub part: Option<&'a OptimizerPart>,
    /// This rank's ZenFlow state, written with its part (runs with ZenFlow only).
    pub zenflow: Option<&'a ZenFlowSnapshot>,
}

/// Saves the checkpoint of `step` from several processes, then deletes all but the newest
/// `keep`; every rank calls it at the same step. The directory appears whole or not at all, as
/// with [`save`]: rank 0 makes the hidden `.step-N.partial-ranks`, every rank writes its share into
/// it (fsynced), and once all have, rank 0 renames it. Each phase ends with a barrier over
/// `group` that also tells every rank whether another failed, so all return the same outcome.
/// `--out` must be on a file system every host sees.
pub fn save_ranks(
    out: &Path,
    step: u64,
    keep: u64,
    meta: &Meta,
    tensors: &[NamedTensor],
    share: Share<'_>,
    group: &mut Group,
) -> anyhow::Result<PathBuf> {
    let dir = step_dir(out, step);
    let temp = out.join(FOLDER).join(format!(".step-{step:08}.partial-ranks"));
    debug_assert_eq!(share.rank, group.rank(), "a rank writes its own share");
    let leader = group.rank() == 0;
    let prepared = if leader { prepare(&dir, &temp) } else { Ok(()) };
    agree(group, prepared, "prepare", &dir)?;
    let written = write_share(&temp, meta, tensors, &share);
    if let Err(error) = agree(group, written, "write its share of", &dir) {
        if leader {
            let _ = std::fs::remove_dir_all(&temp);
        }
        return Err(error);
    }
    let committed = if leader { commit(&temp, &dir, meta.world_size, out, keep) } else { Ok(()) };
    agree(group, committed, "complete", &dir)?;
    Ok(dir)
}

/// Rank 0: an empty hidden directory to write into, where no checkpoint of the step exists.
fn prepare(dir: &Path, temp: &Path) -> anyhow::Result<()> {
    if dir.exists() {
        return Err(CheckpointError::AlreadyExists(dir.to_path_buf()).into());
    }
    if temp.exists() {
        std::fs::remove_dir_all(temp)
            .with_context(|| format!("cannot remove the unfinished {}", temp.display()))?;
    }
    std::fs::create_dir_all(temp.join("optim"))
        .with_context(|| format!("cannot create {}", temp.display()))
}

fn write_share(
    temp: &Path,
    meta: &Meta,
    tensors: &[NamedTensor],
    share: &Share<'_>,
) -> anyhow::Result<()> {
    if let Some(weights) = share.weights {
        checkpoint::write_state(&temp.join("state.json"), meta)?;
        checkpoint::write_model(&temp.join("model.safetensors"), weights, tensors)?;
    }
    if let Some(part) = share.part {
        checkpoint::write_part_with_zenflow(temp, share.rank, part, share.zenflow)?;
    }
    Ok(())
}

/// Rank 0: checks that every part is there, makes the directory durable and gives it its name.
fn commit(temp: &Path, dir: &Path, parts: usize, out: &Path, keep: u64) -> anyhow::Result<()> {
    for rank in 0..parts {
        let path = temp.join(format!("optim/rank-{rank}.safetensors"));
        if !path.is_file() {
            anyhow::bail!(
                "{} is missing although rank {rank} wrote it: --out must be a directory that \
                 every host shares",
                path.display()
            );
        }
    }
    for synced in [temp.join("optim"), temp.to_path_buf()] {
        sync_dir(&synced)?;
    }
    std::fs::rename(temp, dir)
        .with_context(|| format!("cannot rename {} to {}", temp.display(), dir.display()))?;
    sync_dir(&out.join(FOLDER))?;
    let all = list(out)?;
    let old = all.len().saturating_sub(keep as usize);
    for (_, older) in &all[..old] {
        std::fs::remove_dir_all(older)
            .with_context(|| format!("cannot delete the old checkpoint {}", older.display()))?;
    }
    Ok(())
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", dir.display()))
}

/// A barrier after a phase of [`save_ranks`]: this rank's error, or an error naming the ranks
/// that failed (their logs say why).
fn agree(
    group: &mut Group,
    outcome: anyhow::Result<()>,
    phase: &str,
    dir: &Path,
) -> anyhow::Result<()> {
    let failed = group.exchange(outcome.is_err())?;
    outcome?;
    if failed.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "{} could not {phase} the checkpoint {} (its log says why)",
        zeroflow_train::dist::rendezvous::rank_list(&failed),
        dir.display()
    )
}

/// A checkpoint to continue from, checked.
#[derive(Debug)]
pub struct ResumePoint {
    pub dir: PathBuf,
    /// The run directory the checkpoint belongs to (`<run>/checkpoints/step-…`).
    pub run_dir: PathBuf,
    pub loaded: Loaded<f32>,
    pub extra: Extra,
    /// Newer checkpoints of the run that are damaged (`--resume latest` passed over them).
    pub damaged: Vec<PathBuf>,
}

/// The checkpoint `--resume` names: a directory, or `latest` under `--out`. Reads it fully; any
/// problem is an input error that names the file and says what to do. Nothing is changed.
pub fn find(arg: &str, out: Option<&Path>) -> anyhow::Result<ResumePoint> {
    let (dir, loaded, damaged) = if arg == "latest" {
        latest(out)?
    } else {
        let dir = PathBuf::from(arg);
        let loaded = checkpoint::load::<f32>(&dir).map_err(|e| resume_error(&e))?;
        (dir, loaded, Vec::new())
    };
    let extra: Extra = serde_json::from_value(loaded.meta.extra.clone()).map_err(|e| {
        input(format!(
            "{}: extra in state.json is not what zeroflow train writes ({e}); resume from a \
             checkpoint that zeroflow train saved",
            dir.join("state.json").display()
        ))
    })?;
    let run_dir = dir
        .parent()
        .filter(|parent| parent.file_name().is_some_and(|name| name == FOLDER))
        .and_then(Path::parent)
        .ok_or_else(|| {
            input(format!(
                "--resume {}: not inside a run's {FOLDER}/ directory, so there is no run to \
                 continue; pass a <run>/{FOLDER}/step-NNNNNNNN directory",
                dir.display()
            ))
        })?
        .to_path_buf();
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

/// The newest checkpoint under `out` that loads. A damaged newer one (which an atomic write
/// cannot leave, so the disk or a person changed it) is passed over with a warning and later set
/// aside, never deleted; a foreign or mismatched one is an error.
fn latest(out: Option<&Path>) -> anyhow::Result<(PathBuf, Loaded<f32>, Vec<PathBuf>)> {
    let out = out.ok_or_else(|| {
        input("--resume latest needs --out: the run directory whose newest checkpoint to continue")
    })?;
    let mut damaged = Vec::new();
    for (_, dir) in list(out)?.into_iter().rev() {
        match checkpoint::load::<f32>(&dir) {
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
pub fn set_aside(damaged: &[PathBuf]) -> anyhow::Result<()> {
    for dir in damaged {
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("step");
        let aside = dir.with_file_name(format!(".{name}.damaged"));
        std::fs::rename(dir, &aside).with_context(|| {
            format!("cannot move the damaged {} to {}", dir.display(), aside.display())
        })?;
        tracing::warn!("moved the damaged {} to {}", dir.display(), aside.display());
    }
    Ok(())
}

/// A checkpoint that cannot be resumed from, as an input error with what to do.
pub fn resume_error(e: &CheckpointError) -> anyhow::Error {
    let hint = match e {
        CheckpointError::Corrupt { .. } => "",
        CheckpointError::Mismatch { .. } => {
            "; resume with the model and precision it was saved with, or start a new run"
        }
        _ => "; pass a checkpoint directory (<run>/checkpoints/step-NNNNNNNN) or `latest`",
    };
    input(format!("--resume: {e}{hint}"))
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::thread;

    use zeroflow_engine::checkpoint::{self, Meta, NamedTensor, ParamEntry};
    use zeroflow_engine::{LossScaler, OptimizerPart};

    use super::{Share, save_ranks};
    use zeroflow_train::dist::testing::local_groups;

    /// A model of one 4-element tensor, its flat weights split between two ranks' parts.
    fn fixture() -> (Meta, Vec<NamedTensor>, Vec<f32>, [OptimizerPart; 2]) {
        let meta = Meta {
            format: checkpoint::FORMAT.into(),
            version: checkpoint::VERSION,
            optimizer_steps: 3,
            micro_steps: 3,
            world_size: 2,
            scaler: LossScaler::None,
            upload_pending: false,
            weights_dtype: "F32".into(),
            params: vec![ParamEntry { name: "w".into(), shape: vec![4], offset: 0 }],
            extra: serde_json::Value::Null,
        };
        let tensors = vec![NamedTensor { name: "w".into(), shape: vec![4], flat: 0..4 }];
        let part = |flat: std::ops::Range<usize>| OptimizerPart {
            master: flat.clone().map(|i| i as f32).collect(),
            exp_avg: vec![0.5; flat.len()],
            exp_avg_sq: vec![0.25; flat.len()],
            flat,
        };
        (meta, tensors, vec![0.0, 1.0, 2.0, 3.0], [part(0..2), part(2..4)])
    }

    /// Every rank saves step 5 into its `outs[rank]`; the ranks' results in order.
    fn save_from_ranks(outs: [PathBuf; 2]) -> Vec<anyhow::Result<PathBuf>> {
        let groups = local_groups(2);
        let handles: Vec<_> = groups
            .into_iter()
            .zip(outs)
            .enumerate()
            .map(|(rank, (mut group, out))| {
                thread::spawn(move || {
                    let (meta, tensors, weights, parts) = fixture();
                    let weights = (rank == 0).then_some(weights.as_slice());
                    let share = Share { rank, weights, part: Some(&parts[rank]), zenflow: None };
                    let saved = save_ranks(&out, 5, 2, &meta, &tensors, share, &mut group);
                    group.finish().unwrap();
                    saved
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("zeroflow-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn ranks_save_one_checkpoint_with_a_part_each() {
        let out = temp_dir("save-ranks");
        let results = save_from_ranks([out.clone(), out.clone()]);
        let dirs: Vec<PathBuf> = results.into_iter().map(Result::unwrap).collect();
        assert_eq!(dirs[0], dirs[1]);
        assert_eq!(dirs[0], out.join("checkpoints/step-00000005"));
        let loaded = checkpoint::load::<f32>(&dirs[0]).unwrap();
        let (meta, _, weights, parts) = fixture();
        assert_eq!(loaded.meta, meta);
        assert_eq!(loaded.parts, parts);
        assert_eq!(loaded.tensors["w"], (vec![4], weights));
        // Nothing is left of the directory it was written in.
        let entries: Vec<_> = std::fs::read_dir(out.join("checkpoints")).unwrap().collect();
        assert_eq!(entries.len(), 1);
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn a_rank_that_cannot_write_fails_every_rank_and_leaves_no_checkpoint() {
        // Rank 1 sees another directory (as on a host that does not share --out): its part cannot
        // go where rank 0 prepared the checkpoint.
        let (out, elsewhere) = (temp_dir("save-ranks-0"), temp_dir("save-ranks-1"));
        let results = save_from_ranks([out.clone(), elsewhere.clone()]);
        let rank_0 = results[0].as_ref().unwrap_err().to_string();
        assert!(rank_0.contains("rank 1 could not write its share of the checkpoint"), "{rank_0}");
        assert!(results[1].is_err());
        assert!(super::list(&out).unwrap().is_empty());
        let leftovers: Vec<_> = std::fs::read_dir(out.join("checkpoints")).unwrap().collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        for dir in [out, elsewhere] {
            let _ = std::fs::remove_dir_all(Path::new(&dir));
        }
    }
}
