//! The offload stream's tuning (`EngineOptions::stream_chunk`, `copy_stores` and
//! `gather_in_pieces`) changes how the gradients and weights travel between host and device and
//! between ranks, never the results: small, uneven chunks, ordinary stores of the weight copy and
//! a gather after the step instead of piece by piece give the default run's weights bit for bit,
//! with and without chaos (randomly delayed streams, so every chunk's hand-off must be ordered by
//! its own wait).

use zeroflow_core::Float;
use zeroflow_engine::{DEFAULT_STREAM_CHUNK, LossScaler, Stage};
use zeroflow_optim::Stores;

use crate::harness::{Bf16, Setup, train};

/// The offload setups whose host traffic the tuning shapes: the streaming step (one micro-step
/// per step) on one and two ranks, the streaming delayed update, and the accumulating step
/// (buckets of 23 elements copied in staging pieces).
fn offload_setups() -> [Setup; 4] {
    [
        Setup { steps: 8, ..Setup::new(Stage::Zero2, 2, 1, true) },
        Setup { steps: 8, ..Setup::new(Stage::Zero1, 1, 1, true) },
        Setup { steps: 8, delayed: Some(2), ..Setup::new(Stage::Zero2, 2, 1, true) },
        Setup { steps: 6, ..Setup::new(Stage::Zero1, 2, 3, true) },
    ]
}

/// Trains every setup with the default tuning and with each of `tunings` (calm and under chaos)
/// and checks that the final weights and the step reports are identical.
fn check_tunings_are_bit_identical<P: Float>(tunings: &[(usize, Option<Stores>, bool)]) {
    for setup in offload_setups() {
        let default = train::<P>(&setup, LossScaler::None, None);
        for &(stream_chunk, copy_stores, gather_in_pieces) in tunings {
            for chaos in [None, Some(7)] {
                let tuned =
                    Setup { stream_chunk, copy_stores, gather_in_pieces, chaos, ..setup.clone() };
                let out = train::<P>(&tuned, LossScaler::None, None);
                assert_eq!(out.weights, default.weights, "{tuned:?}: weights differ");
                assert_eq!(out.reports, default.reports, "{tuned:?}: step reports differ");
            }
        }
    }
}

/// 7 elements cut a partition of the synthetic model (about 60 elements per rank) into many
/// chunks, the last one shorter, gathered in pieces of an eighth of the partition; 1 element is
/// the smallest chunk there is.
const TUNINGS: [(usize, Option<Stores>, bool); 6] = [
    (7, Some(Stores::Normal), true),
    (7, Some(Stores::NonTemporal), true),
    (1, Some(Stores::Normal), true),
    (DEFAULT_STREAM_CHUNK, Some(Stores::Normal), true),
    (7, Some(Stores::NonTemporal), false),
    (DEFAULT_STREAM_CHUNK, Some(Stores::NonTemporal), false),
];

/// bf16: the CPU AdamW writes the weights' bf16 copy itself, with the stores asked for.
#[test]
fn a_small_stream_chunk_and_normal_copy_stores_give_the_default_bf16_weights() {
    check_tunings_are_bit_identical::<Bf16>(&TUNINGS);
}

/// f32: the streaming step reads f32 gradients and converts the weights after the step.
#[test]
fn a_small_stream_chunk_gives_the_default_f32_weights() {
    check_tunings_are_bit_identical::<f32>(&[TUNINGS[0], TUNINGS[1], TUNINGS[4]]);
}

#[test]
fn a_stream_chunk_of_zero_is_refused() {
    use zeroflow_device::CpuDevice;
    use zeroflow_device::cpu::CpuComm;
    use zeroflow_engine::synthetic::{initial, layout};
    use zeroflow_engine::{Engine, EngineError};

    let device = CpuDevice::new().unwrap();
    let layout = layout(1);
    let init = initial::<f32>(&layout);
    let setup = Setup { stream_chunk: 0, ..Setup::new(Stage::Zero2, 1, 1, true) };
    let options = crate::harness::options(&setup, LossScaler::None);
    let comm =
        CpuComm::group(std::slice::from_ref(&device), std::time::Duration::from_secs(5)).remove(0);
    let result = Engine::<CpuDevice, CpuComm, f32>::new(device, comm, layout, options, &init);
    assert!(matches!(result, Err(EngineError::Config(_))), "a chunk of 0 elements was accepted");
}
