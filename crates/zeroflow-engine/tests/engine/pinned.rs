//! The pinned host memory budget: a device with no room for pinned memory gives the engine
//! pageable buffers instead, warns once, and the training is bit for bit the same (the copies
//! through pageable memory are as ordered as through pinned memory); only the buffers the device
//! copies from or into ask for pinned memory, never the CPU optimizer's state.

use zeroflow_core::Float;
use zeroflow_core::config::{Selection, UpdateInterval};
use zeroflow_engine::{AccumulateOn, LossScaler, Stage, ZenFlowOptions};

use crate::harness::{Bf16, Outcome, Setup, layout, train};

/// Each offload path that allocates pinned buffers: the streaming step (one and two ranks, and
/// its delayed update), the accumulating step (host sum, and ZeRO-2's window on the device),
/// and ZenFlow with its overlapped step (the window copied straight into the accumulator).
fn offload_setups() -> Vec<Setup> {
    let zenflow = ZenFlowOptions {
        topk_ratio: 0.25,
        selection: Selection::Step { interval: 2 },
        update_interval: UpdateInterval::Every(2),
        auto_ratio: 0.99,
        overlap_step: true,
        full_warm_up_rounds: 0,
    };
    vec![
        Setup { steps: 6, ..Setup::new(Stage::Zero2, 1, 1, true) },
        Setup { steps: 6, ..Setup::new(Stage::Zero2, 2, 1, true) },
        Setup { steps: 6, delayed: Some(2), ..Setup::new(Stage::Zero1, 2, 1, true) },
        Setup { steps: 4, ..Setup::new(Stage::Zero1, 2, 3, true) },
        Setup {
            steps: 4,
            accumulate_on: AccumulateOn::Device,
            ..Setup::new(Stage::Zero2, 2, 2, true)
        },
        Setup { steps: 6, zenflow: Some(zenflow), ..Setup::new(Stage::Zero2, 2, 1, true) },
    ]
}

fn check_same_training<P: Float>(out: &Outcome<P>, pinned: &Outcome<P>, what: &str) {
    assert_eq!(out.weights, pinned.weights, "{what}: weights differ from the pinned run's");
    assert_eq!(out.reports, pinned.reports, "{what}: step reports differ from the pinned run's");
}

/// A budget of zero (a machine that cannot pin): every rank trains on with pageable buffers,
/// exactly as far as the run with pinned memory, and its device warned once, about every byte
/// the pinned run pinned. Calm and under chaos (randomly delayed streams).
fn check_zero_budget_trains_the_same<P: Float>() {
    for setup in offload_setups() {
        for chaos in [None, Some(11)] {
            let setup = Setup { chaos, ..setup.clone() };
            let pinned = train::<P>(&setup, LossScaler::None, None);
            let refused = Setup { pinned_budget: Some(0), ..setup.clone() };
            let out = train::<P>(&refused, LossScaler::None, None);
            check_same_training(&out, &pinned, &format!("{refused:?}"));
            for (with, without) in pinned.traffic.iter().zip(&out.traffic) {
                let (with, without) = (with.pinned, without.pinned);
                assert!(with.held > 0 && with.fell_back == 0, "{setup:?}: {with:?}");
                assert_eq!(with.warnings, 0, "{setup:?}: nothing fell back, nothing to warn");
                assert_eq!(without.held, 0, "{refused:?}: {without:?}");
                assert_eq!(without.fell_back, with.held, "{refused:?}: {without:?}");
                assert_eq!(without.warnings, 1, "{refused:?}: one warning per device");
            }
        }
    }
}

#[test]
fn with_no_pinned_memory_bf16_training_goes_on_bit_for_bit_and_warns_once() {
    check_zero_budget_trains_the_same::<Bf16>();
}

#[test]
fn with_no_pinned_memory_f32_training_goes_on_bit_for_bit_and_warns_once() {
    check_zero_budget_trains_the_same::<f32>();
}

/// A budget of half what the run pins: some buffers pinned, the rest pageable, every byte asked
/// for accounted for one way or the other, and the same training.
#[test]
fn a_budget_cut_pins_what_fits_and_the_rest_trains_the_same() {
    for setup in offload_setups() {
        let pinned = train::<Bf16>(&setup, LossScaler::None, None);
        let asked = pinned.traffic[0].pinned.held;
        let cut = Setup { pinned_budget: Some(asked / 2), ..setup.clone() };
        let out = train::<Bf16>(&cut, LossScaler::None, None);
        check_same_training(&out, &pinned, &format!("{cut:?}"));
        let usage = out.traffic[0].pinned;
        assert!(usage.held > 0 && usage.held <= asked / 2, "{cut:?}: {usage:?}");
        assert_eq!(usage.held + usage.fell_back, asked, "{cut:?}: {usage:?}");
        assert_eq!(usage.warnings, 1);
    }
}

/// The streaming step pins its staging (four chunks) and outgoing buffers (two) and the
/// one-element norm, nothing else: the fp32 master weights and moments (12 bytes per element)
/// are pageable, as only the CPU touches them.
#[test]
fn the_streaming_step_pins_only_its_staging_and_outgoing_buffers() {
    let setup = Setup { steps: 1, ..Setup::new(Stage::Zero2, 2, 1, true) };
    let out = train::<Bf16>(&setup, LossScaler::None, None);
    for (rank, traffic) in out.traffic.iter().enumerate() {
        let partition = layout(2).partition_range(rank).len();
        let (staging, outgoing, norm) = (4 * partition * 2, 2 * partition * 2, 4);
        assert_eq!(traffic.pinned.held, staging + outgoing + norm, "rank {rank}");
    }
}

/// With gradient accumulation summed on the device, the exact step streams the f32 sum through
/// the same buffers: four f32 staging buffers and two outgoing ones (bf16 here), no host
/// accumulator and no whole-partition upload buffer.
#[test]
fn the_summed_step_pins_only_its_staging_and_outgoing_buffers() {
    let setup = Setup {
        steps: 2,
        accumulate_on: AccumulateOn::Device,
        ..Setup::new(Stage::Zero2, 2, 3, true)
    };
    let out = train::<Bf16>(&setup, LossScaler::None, None);
    for (rank, traffic) in out.traffic.iter().enumerate() {
        let partition = layout(2).partition_range(rank).len();
        let (staging, outgoing, norm) = (4 * partition * 4, 2 * partition * 2, 4);
        assert_eq!(traffic.pinned.held, staging + outgoing + norm, "rank {rank}");
        assert!(!traffic.host_accumulator, "rank {rank}: a host accumulator");
    }
}
