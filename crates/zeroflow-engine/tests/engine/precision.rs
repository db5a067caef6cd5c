//! Mixed precision: bf16 within bf16 bounds, fp16 loss scaling skipping exactly the overflowing
//! step, bf16 non-finite gradients skipped and reported.

use zeroflow_core::f16;
use zeroflow_engine::{DynamicScaler, LossScaler, Stage, StepReport};

use crate::harness::{Bf16, Setup, layout, max_rel_diff, reference, to_f32, train};

#[test]
fn bf16_weights_follow_plain_adamw_within_bf16_bounds() {
    for (stage, world, accum, offload) in
        [(Stage::Zero2, 2, 4, true), (Stage::Zero1, 4, 1, false), (Stage::Zero0, 2, 2, true)]
    {
        let setup = Setup::new(stage, world, accum, offload);
        let out = train::<Bf16>(&setup, LossScaler::None, None);
        let (want, _) = reference::<Bf16>(&setup);
        let got = to_f32(&out.weights[0]);
        let diff = max_rel_diff(&layout(1), &got[..want.len()], &want);
        assert!(diff <= 2e-2, "{setup:?}: max relative difference {diff:e}");
    }
}

#[test]
fn an_fp16_overflow_skips_exactly_that_step_and_halves_the_scale() {
    let setup = Setup { steps: 6, ..Setup::new(Stage::Zero2, 2, 2, true) };
    // Micro-step 5 (the second of optimizer step 2, counting from 0) overflows on rank 1 only.
    let scaler = LossScaler::Dynamic(DynamicScaler::new(10, 1000, 1.0, 1, false));
    let out = train::<f16>(&setup, scaler, Some((1, 5)));
    for reports in &out.reports {
        assert_eq!(reports.len(), 6);
        for (i, report) in reports.iter().enumerate() {
            match (i, report) {
                (2, StepReport::Skipped { loss_scale }) => assert_eq!(*loss_scale, 512.0),
                (2, other) => panic!("step 2 should be skipped on every rank, got {other:?}"),
                (0 | 1, StepReport::Stepped { loss_scale, .. }) => assert_eq!(*loss_scale, 1024.0),
                (_, StepReport::Stepped { loss_scale, .. }) => assert_eq!(*loss_scale, 512.0),
                (_, other) => panic!("step {i} should step, got {other:?}"),
            }
        }
    }
    assert_eq!(out.weights[0], out.weights[1]);
}

#[test]
fn bf16_non_finite_gradients_skip_the_step_and_are_reported() {
    let setup = Setup { steps: 3, ..Setup::new(Stage::Zero1, 2, 1, false) };
    let out = train::<Bf16>(&setup, LossScaler::None, Some((0, 1)));
    for reports in &out.reports {
        assert!(matches!(reports[0], StepReport::Stepped { .. }));
        assert_eq!(reports[1], StepReport::Skipped { loss_scale: 1.0 });
        assert!(matches!(reports[2], StepReport::Stepped { .. }));
    }
}
