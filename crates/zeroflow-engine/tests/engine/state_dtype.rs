//! bf16 Adam moments (`zeroflow.optimizer_state_dtype: "bf16"`) on every host path: training
//! stays close to fp32 moments, is deterministic, and checkpoints keep the moments in their dtype
//! and restore them exactly (or convert them, across dtypes, as documented).

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::bf16;
use zeroflow_core::config::{Selection, UpdateInterval};
use zeroflow_engine::checkpoint;
use zeroflow_engine::synthetic::initial;
use zeroflow_engine::{LossScaler, Stage, ZenFlowOptions};

use crate::checkpoint::{load, open, save};
use crate::harness::{Setup, layout, train, train_from};

const BF16: OptimizerStateDtype = OptimizerStateDtype::Bf16;

/// A ZenFlow that selects, updates and overlaps often enough for a few steps.
pub(crate) fn zenflow() -> ZenFlowOptions {
    ZenFlowOptions {
        topk_ratio: 0.25,
        selection: Selection::Step { interval: 4 },
        update_interval: UpdateInterval::Every(2),
        auto_ratio: 0.99,
        overlap_step: true,
        full_warm_up_rounds: 0,
    }
}

/// Every host path: the streaming exact step (with speculation), the accumulating step, the
/// streaming delayed update, and ZenFlow's CPU step.
fn host_paths() -> Vec<(&'static str, Setup)> {
    let streaming = Setup { speculation_budget: 4 << 30, ..Setup::new(Stage::Zero1, 2, 1, true) };
    vec![
        ("streaming exact", streaming),
        ("accumulating", Setup::new(Stage::Zero2, 2, 2, true)),
        ("streaming delayed", Setup { delayed: Some(2), ..Setup::new(Stage::Zero2, 2, 1, true) }),
        ("zenflow", Setup { zenflow: Some(zenflow()), ..Setup::new(Stage::Zero2, 2, 1, true) }),
    ]
}

/// ‖a − b‖ / ‖b − start‖ over the parameters: how far `a` ends from `b`, relative to how far
/// training moved `b`.
fn relative_to_progress(setup: &Setup, a: &[f32], b: &[f32]) -> f64 {
    let layout = layout(setup.world);
    let start = initial::<f32>(&layout);
    let (mut diff, mut moved) = (0.0f64, 0.0f64);
    for i in layout.params().iter().flat_map(|p| p.flat_range()) {
        diff += (f64::from(a[i]) - f64::from(b[i])).powi(2);
        moved += (f64::from(b[i]) - f64::from(start[i])).powi(2);
    }
    (diff / moved).sqrt()
}

/// 20 steps with bf16 moments end within 1% of the distance the fp32-moment run travelled from
/// the initial weights (measured: about 0.2%; and not on it: the dtype took effect). The saved
/// moments are bf16 values, except ZenFlow's selected columns, whose moments the device keeps in
/// fp32 (a checkpoint rounds them to bf16 once).
#[test]
fn bf16_moments_train_close_to_fp32_moments_on_every_host_path() {
    for (name, setup) in host_paths() {
        let fp32 = train::<f32>(&setup, LossScaler::None, None);
        let bf16_setup = Setup { moments: BF16, ..setup.clone() };
        let bf16 = train::<f32>(&bf16_setup, LossScaler::None, None);
        let diff = relative_to_progress(&setup, &bf16.weights[0], &fp32.weights[0]);
        assert!(diff < 1e-2, "{name}: bf16 moments end {diff:e} of the way from fp32 moments");
        assert_ne!(bf16.weights, fp32.weights, "{name}: bf16 moments changed nothing");
        for snapshot in &bf16.snapshots {
            assert_eq!(snapshot.part.moments, BF16, "{name}");
            if setup.zenflow.is_some() {
                continue;
            }
            let is_bf16 = |x: &f32| bf16::from_f32(*x).to_f32() == *x;
            assert!(snapshot.part.exp_avg.iter().all(is_bf16), "{name}: exp_avg");
            assert!(snapshot.part.exp_avg_sq.iter().all(is_bf16), "{name}: exp_avg_sq");
        }
    }
}

/// Two runs with bf16 moments give bit-identical weights, optimizer state and reports: the
/// stochastic rounding's draws are a function of the step and the element.
#[test]
fn bf16_moment_runs_are_deterministic() {
    for (name, setup) in host_paths() {
        let setup = Setup { moments: BF16, steps: 8, ..setup };
        let a = train::<f32>(&setup, LossScaler::None, None);
        let b = train::<f32>(&setup, LossScaler::None, None);
        assert_eq!(a.weights, b.weights, "{name}");
        assert_eq!(a.snapshots, b.snapshots, "{name}");
        assert_eq!(a.reports, b.reports, "{name}");
    }
}

/// 2N steps straight and N + save + load + N with bf16 moments are bit-identical; the checkpoint
/// stores the moments as BF16 tensors and names the dtype in `state.json`.
#[test]
fn a_bf16_moment_checkpoint_resumes_bit_exactly() {
    for (name, setup) in [
        ("streaming", Setup { steps: 5, ..Setup::new(Stage::Zero1, 2, 1, true) }),
        (
            "accumulating, delayed",
            Setup { steps: 5, delayed: Some(2), ..Setup::new(Stage::Zero2, 2, 2, true) },
        ),
    ] {
        let setup = Setup { moments: BF16, ..setup };
        let straight =
            train_from::<f32>(&Setup { steps: 10, ..setup.clone() }, LossScaler::None, None, None);
        let first = train_from::<f32>(&setup, LossScaler::None, None, None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("step-5");
        save(&path, &setup, &first);
        let loaded = checkpoint::load::<f32>(&path).unwrap();
        assert_eq!(loaded.meta.optimizer_state_dtype, "bf16", "{name}");
        let bytes = std::fs::read(path.join("optim/rank-0.safetensors")).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(file.tensor("exp_avg").unwrap().dtype(), safetensors::Dtype::BF16);
        assert_eq!(file.tensor("exp_avg_sq").unwrap().dtype(), safetensors::Dtype::BF16);
        assert_eq!(file.tensor("master").unwrap().dtype(), safetensors::Dtype::F32);
        for resume in [load(&path, setup.world), open(&path, setup.world)] {
            let from = if resume.files.is_some() { "files" } else { "memory" };
            let second = train_from(&setup, LossScaler::None, None, Some(&resume));
            assert_eq!(second.weights, straight.weights, "{name} from {from}: weights");
            assert_eq!(second.snapshots, straight.snapshots, "{name} from {from}: state");
        }
    }
}

/// Across dtypes a checkpoint converts: bf16 moments restore into an fp32 run exactly, fp32
/// moments into a bf16 run rounded to the nearest bf16. A checkpoint without the dtype (written
/// before it was recorded) reads as fp32.
#[test]
fn checkpoints_convert_moments_across_dtypes_and_old_ones_read_as_fp32() {
    let fp32_setup = Setup { steps: 3, ..Setup::new(Stage::Zero2, 1, 1, true) };
    let bf16_setup = Setup { moments: BF16, ..fp32_setup.clone() };
    let dir = tempfile::tempdir().unwrap();
    for (from, to) in [(&bf16_setup, &fp32_setup), (&fp32_setup, &bf16_setup)] {
        let saved = train_from::<f32>(from, LossScaler::None, None, None);
        let path = dir.path().join(format!("{}-to-{}", from.moments, to.moments));
        save(&path, from, &saved);
        let target = Setup { steps: 0, ..to.clone() };
        let restored = train_from(&target, LossScaler::None, None, Some(&load(&path, 1)));
        let (was, now) = (&saved.snapshots[0].part, &restored.snapshots[0].part);
        assert_eq!(now.moments, to.moments);
        assert_eq!(now.master, was.master);
        let rounded =
            |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect() };
        let (exp_avg, exp_avg_sq) = match to.moments {
            OptimizerStateDtype::Fp32 => (was.exp_avg.clone(), was.exp_avg_sq.clone()),
            OptimizerStateDtype::Bf16 => (rounded(&was.exp_avg), rounded(&was.exp_avg_sq)),
        };
        assert_eq!(now.exp_avg, exp_avg, "{} to {}", from.moments, to.moments);
        assert_eq!(now.exp_avg_sq, exp_avg_sq, "{} to {}", from.moments, to.moments);
    }
    // An fp32 checkpoint whose state.json lacks the key, as older ones do.
    let path = dir.path().join("fp32-to-bf16");
    let state = std::fs::read_to_string(path.join("state.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&state).unwrap();
    json.as_object_mut().unwrap().remove("optimizer_state_dtype").expect("it was recorded");
    std::fs::write(path.join("state.json"), json.to_string()).unwrap();
    let old = checkpoint::load::<f32>(&path).unwrap();
    assert_eq!(old.meta.optimizer_state_dtype, "fp32");
    assert_eq!(old.parts[0].moments, OptimizerStateDtype::Fp32);
    // A bf16 checkpoint whose state.json says fp32 is damaged.
    let path = dir.path().join("bf16-to-fp32");
    let state = std::fs::read_to_string(path.join("state.json")).unwrap();
    let state = state.replace("\"bf16\"", "\"fp32\"");
    std::fs::write(path.join("state.json"), state).unwrap();
    let err = checkpoint::load::<f32>(&path).unwrap_err();
    assert!(matches!(err, checkpoint::CheckpointError::Corrupt { .. }), "{err}");
}
