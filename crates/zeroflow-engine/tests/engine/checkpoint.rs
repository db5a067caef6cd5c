//! Checkpoints: exact resume, resume at another world size, atomic writes, and damaged or foreign
//! checkpoints as typed errors that change nothing.

use std::path::Path;

use zeroflow_engine::checkpoint::{self, CheckpointError, Meta, NamedTensor, ParamEntry};
use zeroflow_engine::synthetic::layout;
use zeroflow_engine::{LossScaler, Stage};

use crate::harness::{Outcome, Resume, Setup, train_from};

pub(crate) fn tensors(world: usize) -> Vec<NamedTensor> {
    layout(world)
        .params()
        .iter()
        .map(|p| NamedTensor { name: p.name.clone(), shape: p.shape.clone(), flat: p.flat_range() })
        .collect()
}

/// Saves rank 0's weights and every rank's optimizer part as a checkpoint in `dir`.
pub(crate) fn save(dir: &Path, setup: &Setup, out: &Outcome<f32>) {
    let snapshot = &out.snapshots[0];
    let layout = layout(setup.world);
    let meta = Meta {
        format: checkpoint::FORMAT.into(),
        version: checkpoint::VERSION,
        optimizer_steps: snapshot.optimizer_steps,
        micro_steps: snapshot.micro_steps,
        world_size: setup.world,
        scaler: snapshot.scaler.clone(),
        upload_pending: snapshot.upload_pending,
        weights_dtype: "F32".into(),
        optimizer_state_dtype: snapshot.part.moments.name().into(),
        params: layout
            .params()
            .iter()
            .map(|p| ParamEntry { name: p.name.clone(), shape: p.shape.clone(), offset: p.offset })
            .collect(),
        extra: serde_json::json!({"note": "test"}),
    };
    let parts: Vec<_> = out.snapshots.iter().map(|s| s.part.clone()).collect();
    let zenflow: Vec<_> = out.snapshots.iter().filter_map(|s| s.zenflow.clone()).collect();
    let (weights, tensors) = (&out.device_weights[0], tensors(setup.world));
    checkpoint::save_with_zenflow(dir, &meta, weights, &tensors, &parts, &zenflow).unwrap();
}

/// `setup` trained for twice its steps straight (the run a resume must equal), and for its steps
/// and saved into a checkpoint, with the directory that holds it (removed when dropped) and its
/// path.
pub(crate) fn straight_and_saved(
    setup: &Setup,
) -> (Outcome<f32>, tempfile::TempDir, std::path::PathBuf) {
    let twice = Setup { steps: 2 * setup.steps, ..setup.clone() };
    let straight = train_from::<f32>(&twice, LossScaler::None, None, None);
    let first = train_from::<f32>(setup, LossScaler::None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(format!("step-{}", setup.steps));
    save(&path, setup, &first);
    (straight, dir, path)
}

/// Loads the checkpoint in `dir` as a resume point for a run of `world` ranks.
pub(crate) fn load(dir: &Path, world: usize) -> Resume<f32> {
    let loaded = checkpoint::load::<f32>(dir).unwrap();
    let padded = layout(world).padded_len();
    Resume {
        weights: checkpoint::flat_weights(&loaded, &tensors(world), padded, dir).unwrap(),
        parts: loaded.parts,
        optimizer_steps: loaded.meta.optimizer_steps,
        micro_steps: loaded.meta.micro_steps,
        upload_pending: loaded.meta.upload_pending,
        scaler: loaded.meta.scaler,
        zenflow: loaded.zenflow,
        files: None,
    }
}

/// [`load`], with each rank reading its optimizer state from the checkpoint's files.
pub(crate) fn open(dir: &Path, world: usize) -> Resume<f32> {
    Resume { files: Some(dir.to_path_buf()), ..load(dir, world) }
}

/// 2N steps straight and N + save + load + N give bit-identical weights, optimizer state and
/// gradient norms, for offload (with the delayed update) and for the device optimizer, with the
/// optimizer state restored from memory and read from the files a piece at a time.
#[test]
fn resuming_from_a_checkpoint_is_bit_exact() {
    for (setup, name) in [
        (Setup { steps: 6, delayed: Some(2), ..Setup::new(Stage::Zero2, 2, 2, true) }, "offload"),
        // One micro-step per step: the streaming step, with and without the delayed update.
        (
            Setup { steps: 6, delayed: Some(2), ..Setup::new(Stage::Zero2, 2, 1, true) },
            "streaming offload, delayed",
        ),
        (Setup { steps: 6, ..Setup::new(Stage::Zero1, 2, 1, true) }, "streaming offload"),
        (Setup { steps: 6, ..Setup::new(Stage::Zero1, 2, 1, false) }, "device"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let straight =
            train_from::<f32>(&Setup { steps: 12, ..setup.clone() }, LossScaler::None, None, None);
        let first = train_from::<f32>(&setup, LossScaler::None, None, None);
        let path = dir.path().join("step-6");
        save(&path, &setup, &first);
        for (resume, from) in
            [(load(&path, setup.world), "memory"), (open(&path, setup.world), "files")]
        {
            let second = train_from(&setup, LossScaler::None, None, Some(&resume));
            assert_eq!(second.weights, straight.weights, "{name} from {from}: weights");
            let what = "optimizer state and counters";
            assert_eq!(second.snapshots, straight.snapshots, "{name} from {from}: {what}");
            assert_eq!(second.reports[0], straight.reports[0][6..], "{name} from {from}: reports");
        }
    }
}

/// A checkpoint saved by 2 ranks restores at 1 and 4 ranks with exactly the same optimizer state
/// for every parameter element, from memory and read from its files.
#[test]
fn a_checkpoint_saved_at_one_world_size_restores_at_another() {
    let setup = Setup { steps: 3, ..Setup::new(Stage::Zero2, 2, 1, true) };
    let out = train_from::<f32>(&setup, LossScaler::None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt");
    save(&path, &setup, &out);
    for (world, resume) in
        [1, 4].into_iter().flat_map(|w| [(w, load(&path, w)), (w, open(&path, w))])
    {
        let target = Setup { steps: 0, world, ..setup.clone() };
        let restored = train_from(&target, LossScaler::None, None, Some(&resume));
        for p in layout(world).params() {
            for i in p.flat_range() {
                let saved = out.snapshots.iter().find(|s| s.part.flat.contains(&i)).unwrap();
                let now = restored.snapshots.iter().find(|s| s.part.flat.contains(&i)).unwrap();
                let (a, b) = (i - saved.part.flat.start, i - now.part.flat.start);
                assert_eq!(saved.part.master[a], now.part.master[b], "world {world} element {i}");
                assert_eq!(saved.part.exp_avg_sq[a], now.part.exp_avg_sq[b]);
            }
        }
        for p in layout(world).params() {
            for w in &restored.weights {
                let saved = &out.device_weights[0][p.flat_range()];
                assert_eq!(w[p.flat_range()], *saved, "world {world}");
            }
        }
    }
}

/// Saving over an existing directory is refused and leaves it untouched; a partial directory left
/// by a crash (kill -9 during a write) is not a checkpoint, and the previous one still loads.
#[test]
fn writes_are_atomic_and_never_overwrite() {
    let setup = Setup { steps: 1, ..Setup::new(Stage::Zero2, 1, 1, true) };
    let out = train_from::<f32>(&setup, LossScaler::None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("step-1");
    save(&path, &setup, &out);
    let before = std::fs::read(path.join("model.safetensors")).unwrap();
    let meta = checkpoint::load::<f32>(&path).unwrap().meta;
    let again = checkpoint::save(&path, &meta, &out.weights[0], &tensors(1), &[]);
    assert!(matches!(again, Err(CheckpointError::AlreadyExists(_))));
    assert_eq!(std::fs::read(path.join("model.safetensors")).unwrap(), before);
    // A crash during the next write leaves only a hidden partial directory beside it.
    let partial = dir.path().join(".step-2.partial-12345");
    std::fs::create_dir_all(partial.join("optim")).unwrap();
    std::fs::write(partial.join("model.safetensors"), &before[..before.len() / 2]).unwrap();
    assert!(matches!(checkpoint::load::<f32>(&partial), Err(CheckpointError::Foreign { .. })));
    checkpoint::load::<f32>(&path).unwrap();
}

/// Truncated files, flipped bytes, a wrong dtype and a foreign directory are typed errors naming
/// the file, never a panic.
#[test]
fn damaged_or_foreign_checkpoints_are_typed_errors() {
    let setup = Setup { steps: 1, ..Setup::new(Stage::Zero1, 2, 1, true) };
    let out = train_from::<f32>(&setup, LossScaler::None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good");
    save(&good, &setup, &out);
    let damaged = |name: &str, file: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        let copy = dir.path().join(name);
        copy_dir(&good, &copy);
        let mut bytes = std::fs::read(copy.join(file)).unwrap();
        edit(&mut bytes);
        std::fs::write(copy.join(file), bytes).unwrap();
        let err = checkpoint::load::<f32>(&copy).unwrap_err();
        assert!(err.to_string().contains(name), "{name}: the error names the checkpoint: {err}");
        err
    };
    let err = damaged("truncated-model", "model.safetensors", &|b| b.truncate(b.len() - 7));
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    let err = damaged("truncated-optim", "optim/rank-1.safetensors", &|b| b.truncate(40));
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    let err = damaged("flipped-header", "model.safetensors", &|b| b[12] ^= 0x55);
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    let err = damaged("bad-state", "state.json", &|b| b.truncate(b.len() / 2));
    assert!(matches!(err, CheckpointError::Corrupt { .. }), "{err}");
    let err = damaged("foreign-format", "state.json", &|b| {
        *b = String::from_utf8(b.clone())
            .unwrap()
            .replace("zeroflow-checkpoint", "other")
            .into_bytes()
    });
    assert!(matches!(err, CheckpointError::Foreign { .. }), "{err}");
    assert!(matches!(
        checkpoint::load::<zeroflow_core::bf16>(&good),
        Err(CheckpointError::Mismatch { .. })
    ));
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(matches!(checkpoint::load::<f32>(&empty), Err(CheckpointError::Foreign { .. })));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to.join("optim")).unwrap();
    for file in
        ["state.json", "model.safetensors", "optim/rank-0.safetensors", "optim/rank-1.safetensors"]
    {
        if from.join(file).exists() {
            std::fs::copy(from.join(file), to.join(file)).unwrap();
        }
    }
}

/// Step counters no run can have (more optimizer steps than micro-steps, or no micro-step left to
/// count) are refused before anything is restored: the next step would overflow the count its
/// bias correction uses.
#[test]
fn a_checkpoint_with_impossible_step_counters_is_refused() {
    use zeroflow_device::CpuDevice;
    use zeroflow_device::cpu::CpuComm;
    use zeroflow_engine::synthetic::initial;
    use zeroflow_engine::{Engine, EngineError, Restore};

    let setup = Setup { steps: 2, ..Setup::new(Stage::Zero2, 1, 1, true) };
    let out = train_from::<f32>(&setup, LossScaler::None, None, None);
    let snapshot = &out.snapshots[0];
    let device = CpuDevice::new().unwrap();
    let layout = layout(1);
    let init = initial::<f32>(&layout);
    let options = crate::harness::options(&setup, LossScaler::None);
    let comm =
        CpuComm::group(std::slice::from_ref(&device), std::time::Duration::from_secs(5)).remove(0);
    let mut engine = Engine::<CpuDevice, CpuComm, f32>::new(device, comm, layout, options, &init)
        .expect("an engine");
    let parts = std::slice::from_ref(&snapshot.part);
    let restore = |optimizer_steps, micro_steps| Restore {
        parts: parts.into(),
        optimizer_steps,
        micro_steps,
        upload_pending: false,
        scaler: &snapshot.scaler,
        zenflow: &[],
    };
    let weights = &out.device_weights[0];
    for (optimizer_steps, micro_steps) in [(3, 2), (u64::MAX, u64::MAX), (1, u64::MAX)] {
        let refused = engine.restore(Some(weights), restore(optimizer_steps, micro_steps));
        assert!(
            matches!(&refused, Err(EngineError::Restore { reason, .. }) if reason.contains("step counters")),
            "{optimizer_steps} optimizer steps after {micro_steps} micro-steps: {refused:?}"
        );
    }
    engine.restore(Some(weights), restore(2, 2)).expect("the saved counters restore");
    assert_eq!(engine.optimizer_steps(), 2);
}
