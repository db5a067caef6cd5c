//! The checkpoints of a run directory (DESIGN.md §7): `<out>/checkpoints/step-NNNNNNNN/`, written
//! atomically by one process ([`save`]) or by every rank of a job together ([`save_ranks`]), the
//! newest `keep` kept; and the hidden directories a write cut short leaves.

use std::path::{Path, PathBuf};

use zeroflow_engine::checkpoint::{
    self, CheckpointError, Elements, Meta, NamedTensor, PartView, Stored,
};

use crate::dist::{Group, Lost, rendezvous};

/// The folder of a run directory that holds its checkpoints.
pub const FOLDER: &str = "checkpoints";

/// What the disk under `out` holds against checkpoints of `bytes` each, the newest `keep` kept
/// (a save writes the next one before it deletes the oldest, so a long run needs room for
/// `keep + 1`), beside the final weights (`export`: the directory and their bytes) where they go
/// to the same file system: a warning to say now, at the start, where the saves would be refused;
/// `None` where there is room or the free space cannot be asked.
pub fn disk_warning(
    out: &Path,
    bytes: u64,
    keep: u64,
    export: Option<(&Path, u64)>,
) -> Option<String> {
    let free = checkpoint::free_bytes(out)?;
    let export = export.map(|(dir, weights)| {
        let kept = if checkpoint::same_file_system(out, dir) { weights } else { 0 };
        (dir, kept)
    });
    disk_warning_for(out, bytes, keep, export, free)
}

/// [`disk_warning`] of a disk with `free` bytes free, where the export (if any) must keep the
/// bytes it names free there (0: it goes to another file system).
fn disk_warning_for(
    out: &Path,
    bytes: u64,
    keep: u64,
    export: Option<(&Path, u64)>,
    free: u64,
) -> Option<String> {
    let (out, size, room) =
        (out.display(), checkpoint::disk_size(bytes), checkpoint::disk_size(free));
    let kept = export.map_or(0, |(_, weights)| weights);
    // What the saves may take: the final weights' room is kept free for them.
    let besides = match export {
        Some((dir, weights)) if weights > 0 => format!(
            ", of which {} stay free for the final weights --export writes to {}",
            checkpoint::disk_size(weights),
            dir.display()
        ),
        _ => String::new(),
    };
    let usable = free.saturating_sub(kept);
    if usable < bytes {
        let then = match export {
            Some((dir, _)) => format!("--export {} gets the final weights", dir.display()),
            None => "but the save at its end (or at a signal) refused ends it with an error: \
                     free some space, pass --out on a larger disk, or pass --export DIR to get \
                     the final weights as a Hugging Face directory"
                .to_owned(),
        };
        return Some(format!(
            "a checkpoint of this run takes {size} and {out} has {room} free{besides}: every save \
             will be refused and the run goes on without them; {then}"
        ));
    }
    let fits = usable / bytes.max(1);
    (fits < keep + 1).then(|| {
        format!(
            "a checkpoint of this run takes {size} and {out} has {room} free{besides}, room \
             for {fits}; keeping {keep} (--keep) needs {} at once, so later saves will be \
             refused (the run goes on without them): free some space, lower --keep or pass \
             --out on a larger disk",
            keep + 1
        )
    })
}

/// Why checkpoints could not be listed, saved or cleaned up.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointsError {
    /// A file-system call failed; `what` says which, with the path.
    #[error("cannot {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// Writing the checkpoint's files failed, or its directory exists already.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Rank 0 does not see the part rank `rank` wrote: the ranks do not share `--out`.
    #[error(
        "{} is missing although rank {rank} wrote it: --out must be a directory that every host \
         shares",
        path.display()
    )]
    PartMissing { path: PathBuf, rank: usize },
    /// Other ranks failed a phase of [`save_ranks`] (`ranks` names them; their logs say why).
    #[error("{ranks} could not {phase} the checkpoint {} (its log says why)", dir.display())]
    Ranks { ranks: String, phase: &'static str, dir: PathBuf },
    /// Rank 0 found too little free space for the checkpoint (its log says how much): nothing
    /// was written.
    #[error(
        "{}: not enough disk space for this checkpoint, as rank 0 found (nothing was written)",
        dir.display()
    )]
    NoSpaceAtRankZero { dir: PathBuf },
    /// The checkpoint would fit, but would leave too little free space for the final weights
    /// that `--export` writes to the same file system at the end of the run: nothing was written.
    #[error(
        "{}: not saved, to keep room for the final weights: the checkpoint takes {} and {} are \
         free there, of which the {} of weights that --export writes to {} at the end must stay \
         free (nothing was written; the run's earlier checkpoints are kept)",
        dir.display(),
        checkpoint::disk_size(*needed),
        checkpoint::disk_size(*free),
        checkpoint::disk_size(*weights),
        export.display()
    )]
    KeepsRoomForExport { dir: PathBuf, needed: u64, weights: u64, free: u64, export: PathBuf },
    /// A rank was lost during a barrier of [`save_ranks`].
    #[error(transparent)]
    Lost(#[from] Lost),
}

impl CheckpointsError {
    /// The checkpoint was refused for want of disk space before anything was written (every
    /// rank of a job says so alike).
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            CheckpointsError::Checkpoint(CheckpointError::NoSpace { .. })
                | CheckpointsError::NoSpaceAtRankZero { .. }
                | CheckpointsError::KeepsRoomForExport { .. }
        )
    }
}

/// The [`CheckpointsError::Io`] of `what` (a verb and its path).
fn io(what: String) -> impl FnOnce(std::io::Error) -> CheckpointsError {
    move |source| CheckpointsError::Io { what, source }
}

/// The directory of the checkpoint at `step` in the run directory `out`.
pub fn step_dir(out: &Path, step: u64) -> PathBuf {
    out.join(FOLDER).join(format!("step-{step:08}"))
}

/// The checkpoints of the run directory `out`, oldest first: the visible `step-N` directories.
/// A hidden `.step-N.partial-PID` directory (a crash during a write) is never one.
pub fn list(out: &Path) -> Result<Vec<(u64, PathBuf)>, CheckpointsError> {
    let folder = out.join(FOLDER);
    if !folder.is_dir() {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(&folder).map_err(io(format!("read {}", folder.display())))?;
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
pub fn remove_unfinished(out: &Path) -> Result<Vec<PathBuf>, CheckpointsError> {
    let folder = out.join(FOLDER);
    if !folder.is_dir() {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(&folder).map_err(io(format!("read {}", folder.display())))?;
    let mut removed = Vec::new();
    for entry in entries.filter_map(|entry| entry.ok()) {
        let name = entry.file_name();
        let unfinished = name
            .to_str()
            .and_then(|name| name.strip_prefix(".step-"))
            .is_some_and(|rest| rest.contains(".partial-"));
        if unfinished && entry.path().is_dir() {
            std::fs::remove_dir_all(entry.path()).map_err(io(format!(
                "remove the unfinished checkpoint {}",
                entry.path().display()
            )))?;
            removed.push(entry.path());
        }
    }
    Ok(removed)
}

/// Where a save must leave room: the directory `--export` writes the run's final weights to at
/// its end, whose free space a checkpoint on the same file system would take.
#[derive(Clone, Copy, Debug)]
pub struct ExportRoom<'a> {
    pub dir: &'a Path,
}

impl ExportRoom<'_> {
    /// Refuses a checkpoint of `needed` bytes at `dir` where it would leave less free than the
    /// final weights take (the checkpoint's own model file's bytes: the export writes the same
    /// weights in the same type), if the export is on the same file system.
    fn check<P: Stored>(
        &self,
        dir: &Path,
        needed: u64,
        meta: &Meta,
        tensors: &[NamedTensor],
    ) -> Result<(), CheckpointsError> {
        if !checkpoint::same_file_system(dir, self.dir) {
            return Ok(());
        }
        let weights = checkpoint::model_bytes::<P>(meta, tensors);
        match checkpoint::free_bytes(dir) {
            Some(free) if free < needed + weights => Err(CheckpointsError::KeepsRoomForExport {
                dir: dir.to_path_buf(),
                needed,
                weights,
                free,
                export: self.dir.to_path_buf(),
            }),
            _ => Ok(()),
        }
    }
}

/// Saves the checkpoint of `step` and then deletes all but the newest `keep`; refused where it
/// would leave `export` (if any) too little room.
#[allow(clippy::too_many_arguments, reason = "one checkpoint's pieces")]
pub fn save<P: Stored>(
    out: &Path,
    step: u64,
    keep: u64,
    meta: &Meta,
    weights: &Elements<'_, P>,
    tensors: &[NamedTensor],
    parts: &[PartView<'_>],
    export: Option<ExportRoom<'_>>,
) -> Result<PathBuf, CheckpointsError> {
    let dir = step_dir(out, step);
    std::fs::create_dir_all(out.join(FOLDER))
        .map_err(io(format!("create {}", out.join(FOLDER).display())))?;
    if let Some(export) = export {
        let parts_bytes = parts.iter().map(PartView::bytes).sum::<u64>();
        let needed = checkpoint::model_bytes::<P>(meta, tensors) + parts_bytes;
        export.check::<P>(&dir, needed, meta, tensors)?;
    }
    checkpoint::save_views(&dir, meta, weights, tensors, parts)?;
    delete_older(out, keep)?;
    Ok(dir)
}

/// Deletes all but the newest `keep` checkpoints of `out`.
fn delete_older(out: &Path, keep: u64) -> Result<(), CheckpointsError> {
    let all = list(out)?;
    let old = all.len().saturating_sub(keep as usize);
    for (_, older) in &all[..old] {
        std::fs::remove_dir_all(older)
            .map_err(io(format!("delete the old checkpoint {}", older.display())))?;
    }
    Ok(())
}

/// What one rank of several contributes to a checkpoint.
#[derive(Clone, Copy, Debug)]
pub struct Share<'a, P: Clone> {
    pub rank: usize,
    /// Rank 0's: the flat weights, with `state.json` (stored as `state.json` says).
    pub weights: Option<&'a Elements<'a, P>>,
    /// This rank's optimizer part (with its ZenFlow state, if the run has one), where the
    /// checkpoint has one per rank (and rank 0's otherwise).
    pub part: Option<&'a PartView<'a>>,
}

/// Saves the checkpoint of `step` from several processes, then deletes all but the newest
/// `keep`; every rank calls it at the same step. The directory appears whole or not at all, as
/// with [`save`]: rank 0 makes the hidden `.step-N.partial-ranks`, every rank writes its share into
/// it (fsynced), and once all have, rank 0 renames it. Each phase ends with a barrier over
/// `group` that also tells every rank whether another failed, so all return the same outcome.
/// `--out` must be on a file system every host sees. Refused (by every rank) where rank 0 finds
/// too little free space, or too little beside `export`'s room.
#[allow(clippy::too_many_arguments, reason = "one checkpoint's pieces")]
pub fn save_ranks<P: Stored>(
    out: &Path,
    step: u64,
    keep: u64,
    meta: &Meta,
    tensors: &[NamedTensor],
    share: Share<'_, P>,
    export: Option<ExportRoom<'_>>,
    group: &mut Group,
) -> Result<PathBuf, CheckpointsError> {
    let dir = step_dir(out, step);
    let temp = out.join(FOLDER).join(format!(".step-{step:08}.partial-ranks"));
    debug_assert_eq!(share.rank, group.rank(), "a rank writes its own share");
    let leader = group.rank() == 0;
    // Rank 0 checks the disk for every rank: the parts are the partitions of a flat buffer padded
    // to a multiple of the ranks, all of one length, so its own part's bytes times their number.
    // Every rank learns whether it refused, so that all go on (or stop) alike.
    let space = match (leader, share.weights, share.part) {
        (true, Some(_), Some(part)) => {
            let parts = meta.world_size as u64 * part.bytes();
            let needed = checkpoint::model_bytes::<P>(meta, tensors) + parts;
            match checkpoint::space_for(&dir, needed) {
                Ok(()) => {
                    export.map_or(Ok(()), |room| room.check::<P>(&dir, needed, meta, tensors))
                }
                Err(refused) => Err(refused.into()),
            }
        }
        _ => Ok(()),
    };
    if !group.exchange(space.is_err())?.is_empty() {
        return Err(match space {
            Err(refused) => refused,
            Ok(()) => CheckpointsError::NoSpaceAtRankZero { dir },
        });
    }
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
fn prepare(dir: &Path, temp: &Path) -> Result<(), CheckpointsError> {
    if dir.exists() {
        return Err(CheckpointError::AlreadyExists(dir.to_path_buf()).into());
    }
    if temp.exists() {
        std::fs::remove_dir_all(temp)
            .map_err(io(format!("remove the unfinished {}", temp.display())))?;
    }
    std::fs::create_dir_all(temp.join("optim")).map_err(io(format!("create {}", temp.display())))
}

fn write_share<P: Stored>(
    temp: &Path,
    meta: &Meta,
    tensors: &[NamedTensor],
    share: &Share<'_, P>,
) -> Result<(), CheckpointsError> {
    if let Some(weights) = share.weights {
        checkpoint::write_state(&temp.join("state.json"), meta)?;
        checkpoint::write_model(&temp.join("model.safetensors"), meta, weights, tensors)?;
    }
    if let Some(part) = share.part {
        checkpoint::write_part(temp, share.rank, part)?;
    }
    Ok(())
}

/// Rank 0: checks that every part is there, makes the directory durable and gives it its name.
fn commit(
    temp: &Path,
    dir: &Path,
    parts: usize,
    out: &Path,
    keep: u64,
) -> Result<(), CheckpointsError> {
    for rank in 0..parts {
        let path = temp.join(format!("optim/rank-{rank}.safetensors"));
        if !path.is_file() {
            return Err(CheckpointsError::PartMissing { path, rank });
        }
    }
    for synced in [temp.join("optim"), temp.to_path_buf()] {
        sync_dir(&synced)?;
    }
    std::fs::rename(temp, dir).map_err(io(format!(
        "rename {} to {}",
        temp.display(),
        dir.display()
    )))?;
    sync_dir(&out.join(FOLDER))?;
    delete_older(out, keep)
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointsError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(format!("sync {}", dir.display())))
}

/// A barrier after a phase of [`save_ranks`]: this rank's error, or an error naming the ranks
/// that failed (their logs say why).
fn agree(
    group: &mut Group,
    outcome: Result<(), CheckpointsError>,
    phase: &'static str,
    dir: &Path,
) -> Result<(), CheckpointsError> {
    let failed = group.exchange(outcome.is_err())?;
    outcome?;
    if failed.is_empty() {
        return Ok(());
    }
    Err(CheckpointsError::Ranks {
        ranks: rendezvous::rank_list(&failed),
        phase,
        dir: dir.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::thread;

    use zeroflow_engine::checkpoint::{self, Meta, NamedTensor, ParamEntry};
    use zeroflow_engine::{LossScaler, OptimizerPart};

    use super::{Share, disk_warning, disk_warning_for, save_ranks};
    use crate::dist::testing::local_groups;

    /// The start-of-run warning: where not even one checkpoint fits (every save refused: the
    /// last one ends the run, unless `--export` gets the weights), where `--keep` needs more room
    /// than there is, none where there is room; and the free space of a real directory can be
    /// asked (no warning for a 1-byte checkpoint there).
    #[test]
    fn the_disk_is_checked_against_the_checkpoints_a_run_keeps() {
        let out = Path::new("runs/big");
        let gb = 1_000_000_000;
        let none_fit = disk_warning_for(out, 128 * gb, 3, None, 60 * gb).unwrap();
        let said = ["128.0 GB", "60.0 GB free", "every save will be refused", "--out", "error"];
        for said in [&said[..], &["pass --export DIR"]].concat() {
            assert!(none_fit.contains(said), "{said:?} not in: {none_fit}");
        }
        // To another file system (nothing to keep free beside the checkpoints).
        let exporting = Some((Path::new("runs/hf"), 0));
        let exported = disk_warning_for(out, 128 * gb, 3, exporting, 60 * gb).unwrap();
        for said in ["every save will be refused", "--export runs/hf gets the final weights"] {
            assert!(exported.contains(said), "{said:?} not in: {exported}");
        }
        assert!(!exported.contains("error") && !exported.contains("stay free"), "{exported}");
        // To the same one: a checkpoint fits, but not beside the 16 GB the weights keep free.
        let exporting = Some((Path::new("runs/hf"), 16 * gb));
        let kept = disk_warning_for(out, 128 * gb, 3, exporting, 140 * gb).unwrap();
        let said = ["140.0 GB free", "16.0 GB stay free", "every save will be refused", "gets"];
        for said in said {
            assert!(kept.contains(said), "{said:?} not in: {kept}");
        }
        assert_eq!(disk_warning_for(out, 10 * gb, 1, exporting, 40 * gb), None);
        let one_fits = disk_warning_for(out, 10 * gb, 1, exporting, 35 * gb).unwrap();
        for said in ["16.0 GB stay free", "room for 1", "needs 2 at once"] {
            assert!(one_fits.contains(said), "{said:?} not in: {one_fits}");
        }
        let two_fit = disk_warning_for(out, 10 * gb, 3, None, 25 * gb).unwrap();
        for said in ["room for 2", "needs 4 at once", "--keep"] {
            assert!(two_fit.contains(said), "{said:?} not in: {two_fit}");
        }
        assert_eq!(disk_warning_for(out, 10 * gb, 3, None, 40 * gb), None);
        let unmade = std::env::temp_dir().join("zeroflow-disk-warning-test/not/yet/made");
        assert_eq!(disk_warning(&unmade, 1, 1, None), None);
    }

    /// A save refused to keep room for the export says what it keeps and for what, and counts
    /// as refused for want of space (the run goes on).
    #[test]
    fn a_save_refused_for_the_exports_room_says_so() {
        let gb = 1_000_000_000;
        let refused = super::CheckpointsError::KeepsRoomForExport {
            dir: PathBuf::from("runs/a/checkpoints/step-00000100"),
            needed: 112 * gb,
            weights: 16 * gb,
            free: 120 * gb,
            export: PathBuf::from("runs/a/hf"),
        };
        assert!(refused.is_no_space());
        let said = refused.to_string();
        for part in ["step-00000100: not saved", "112.0 GB", "120.0 GB", "16.0 GB", "runs/a/hf"] {
            assert!(said.contains(part), "{part:?} not in: {said}");
        }
    }

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
            optimizer_state_dtype: "fp32".into(),
            params: vec![ParamEntry { name: "w".into(), shape: vec![4], offset: 0 }],
            extra: serde_json::Value::Null,
        };
        let tensors = vec![NamedTensor { name: "w".into(), shape: vec![4], flat: 0..4 }];
        let part = |flat: std::ops::Range<usize>| OptimizerPart {
            master: flat.clone().map(|i| i as f32).collect(),
            exp_avg: vec![0.5; flat.len()],
            exp_avg_sq: vec![0.25; flat.len()],
            moments: zeroflow_core::adamw::OptimizerStateDtype::Fp32,
            flat,
        };
        (meta, tensors, vec![0.0, 1.0, 2.0, 3.0], [part(0..2), part(2..4)])
    }

    /// Every rank saves step 5 into its `outs[rank]`; the ranks' results in order.
    fn save_from_ranks(outs: [PathBuf; 2]) -> Vec<Result<PathBuf, super::CheckpointsError>> {
        let groups = local_groups(2);
        let handles: Vec<_> = groups
            .into_iter()
            .zip(outs)
            .enumerate()
            .map(|(rank, (mut group, out))| {
                thread::spawn(move || {
                    let (meta, tensors, weights, parts) = fixture();
                    let weights = checkpoint::Elements::lent(&weights);
                    let weights = (rank == 0).then_some(&weights);
                    let part = parts[rank].view(None);
                    let share = Share { rank, weights, part: Some(&part) };
                    let saved = save_ranks(&out, 5, 2, &meta, &tensors, share, None, &mut group);
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
