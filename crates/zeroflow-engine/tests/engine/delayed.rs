//! The delayed parameter update: after the warm-up, step t's CPU step overlaps window t + 1,
//! which computes with the weights of step t − 1.

use zeroflow_engine::{LossScaler, Stage};

use crate::harness::{Setup, layout, max_rel_diff, norms, reference, train};

/// With the delayed update the engine equals plain AdamW whose gradients are one step stale after
/// the warm-up (DESIGN.md §5), for every stage, with and without chaos.
#[test]
fn the_delayed_update_equals_adamw_with_one_step_stale_gradients() {
    for (stage, world, accum, chaos) in [
        (Stage::Zero2, 2, 2, None),
        (Stage::Zero1, 4, 1, Some(3)),
        (Stage::Zero0, 2, 3, Some(4)),
        (Stage::Zero2, 1, 4, Some(5)),
        // One micro-step per step: the streaming delayed step.
        (Stage::Zero2, 2, 1, Some(6)),
        (Stage::Zero0, 1, 1, None),
    ] {
        let setup =
            Setup { steps: 12, delayed: Some(3), chaos, ..Setup::new(stage, world, accum, true) };
        let out = train::<f32>(&setup, LossScaler::None, None);
        let (want, want_norms) = reference::<f32>(&setup);
        let diff = max_rel_diff(&layout(1), &out.weights[0][..want.len()], &want);
        assert!(diff <= 1e-6, "{setup:?}: max relative difference {diff:e}");
        for (step, (got, want)) in norms(&out.reports[0]).iter().zip(&want_norms).enumerate() {
            assert!((got - want).abs() <= 1e-5 * want, "{setup:?} step {step}: {got} vs {want}");
        }
    }
}

/// The staleness is real: the delayed run differs from the exact one, and a warm-up as long as
/// the run makes them identical.
#[test]
fn the_delayed_update_changes_the_weights_only_after_the_warm_up() {
    let exact = Setup { steps: 8, ..Setup::new(Stage::Zero2, 2, 2, true) };
    let base = train::<f32>(&exact, LossScaler::None, None).weights;
    let long_warm_up =
        train::<f32>(&Setup { delayed: Some(8), ..exact.clone() }, LossScaler::None, None);
    assert_eq!(long_warm_up.weights, base);
    let delayed = train::<f32>(&Setup { delayed: Some(2), ..exact }, LossScaler::None, None);
    assert_ne!(delayed.weights, base);
}
