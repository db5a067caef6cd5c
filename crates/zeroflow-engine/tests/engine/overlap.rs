//! The exact streaming step left to the next forward (`StreamOptions::overlap_forward`): the
//! forward opens the weights parameter by parameter while the CPU steps them, and the run is the
//! inline step's, bit for bit — weights, step reports, optimizer state and checkpoints — under
//! chaos (randomly delayed streams, so every read of a weight must wait for its own upload).
//! With gradient accumulation summed on the device the step streams from the sum, which the
//! opening clears before the next window's first backward adds into it.

use std::time::Duration;

use zeroflow_core::Float;
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::{CpuDevice, Device};
use zeroflow_engine::synthetic::{forward_backward, forward_backward_opening, initial, layout};
use zeroflow_engine::{AccumulateOn, Engine, EngineError, LossScaler, Stage};

use crate::checkpoint::{load, straight_and_saved};
use crate::harness::{Bf16, Setup, options, train, train_from};

/// One rank (where the forward opens the step), with clipping that fires and none, stages 0–2,
/// and chunks that cut every parameter; two ranks: ZeRO-0, where every rank holds every weight
/// and the forward opens the step, and ZeRO-2, where the option leaves the step inline.
fn setups() -> Vec<Setup> {
    let mut setups = Vec::new();
    for (stage, clip, stream_chunk) in [
        (Stage::Zero2, Some(0.8), 7),
        (Stage::Zero1, None, 3),
        (Stage::Zero0, Some(0.8), 1),
        (Stage::Zero2, None, zeroflow_engine::DEFAULT_STREAM_CHUNK),
    ] {
        setups.push(Setup { steps: 8, clip, stream_chunk, ..Setup::new(stage, 1, 1, true) });
    }
    // Two ranks: ZeRO-0 (each rank steps every weight) opens the step; ZeRO-2 leaves it inline.
    setups.push(Setup { steps: 6, stream_chunk: 7, ..Setup::new(Stage::Zero0, 2, 1, true) });
    setups.push(Setup { steps: 6, stream_chunk: 7, ..Setup::new(Stage::Zero2, 2, 1, true) });
    // Accumulation summed on the device (ZeRO-2, one rank): the window's first forward opens
    // the step; accumulated on the host, it stays inline.
    for (accum, clip, stream_chunk, accumulate_on) in [
        (2, Some(0.8), 7, AccumulateOn::Device),
        (3, None, 3, AccumulateOn::Device),
        (4, Some(0.8), zeroflow_engine::DEFAULT_STREAM_CHUNK, AccumulateOn::Device),
        (2, Some(0.8), 7, AccumulateOn::Host),
    ] {
        let summed = Setup::new(Stage::Zero2, 1, accum, true);
        setups.push(Setup { steps: 6, clip, stream_chunk, accumulate_on, ..summed });
    }
    setups
}

/// The window summed on the device, its step left to the next forward.
fn summed(accum: u32) -> Setup {
    Setup {
        stream_chunk: 7,
        overlap_forward: true,
        accumulate_on: AccumulateOn::Device,
        ..Setup::new(Stage::Zero2, 1, accum, true)
    }
}

fn check_bit_identical<P: Float>() {
    for setup in setups() {
        let inline = train::<P>(&setup, LossScaler::None, None);
        for chaos in [None, Some(1), Some(2), Some(3), Some(4)] {
            let overlapped = Setup { overlap_forward: true, chaos, ..setup.clone() };
            let out = train::<P>(&overlapped, LossScaler::None, None);
            assert_eq!(out.weights, inline.weights, "{overlapped:?}: weights");
            assert_eq!(out.reports, inline.reports, "{overlapped:?}: step reports");
            assert_eq!(out.snapshots, inline.snapshots, "{overlapped:?}: optimizer state");
            assert_eq!(out.device_weights, inline.device_weights, "{overlapped:?}: saved weights");
        }
    }
}

#[test]
fn the_forward_opening_the_step_gives_the_inline_f32_run() {
    check_bit_identical::<f32>();
}

#[test]
fn the_forward_opening_the_step_gives_the_inline_bf16_run() {
    check_bit_identical::<Bf16>();
}

/// A checkpoint taken while a step is left to the forward holds that step (the snapshot runs
/// it), and resuming from it continues exactly as the run without a stop.
#[test]
fn a_checkpoint_between_overlapped_steps_resumes_bit_exactly() {
    let one = Setup {
        stream_chunk: 7,
        overlap_forward: true,
        chaos: Some(5),
        ..Setup::new(Stage::Zero2, 1, 1, true)
    };
    for setup in [one, Setup { chaos: Some(6), ..summed(3) }] {
        let setup = Setup { steps: 4, ..setup };
        let (straight, _dir, path) = straight_and_saved(&setup);
        let second = train_from(&setup, LossScaler::None, None, Some(&load(&path, 1)));
        assert_eq!(second.weights, straight.weights, "{setup:?}: weights");
        assert_eq!(second.snapshots, straight.snapshots, "{setup:?}: state and counters");
        assert_eq!(second.reports[0], straight.reports[0][4..], "{setup:?}: step reports");
    }
}

/// The step is really left to the forward: after `step` the device still holds the weights
/// before it, `complete_step` brings them, and they are the inline step's. A model that reads
/// the weights without opening them is told so.
#[test]
fn the_step_waits_for_the_forward_and_a_model_that_does_not_open_is_refused() {
    let one =
        Setup { stream_chunk: 7, overlap_forward: true, ..Setup::new(Stage::Zero2, 1, 1, true) };
    check_waits_and_refuses(&one);
    check_waits_and_refuses(&summed(2));
}

/// [`the_step_waits_for_the_forward_and_a_model_that_does_not_open_is_refused`] for `setup`: one
/// window of `setup.accum` micro-steps.
fn check_waits_and_refuses(setup: &Setup) {
    let layout = layout(1);
    let init = initial::<f32>(&layout);
    let device = CpuDevice::new().unwrap();
    let new_engine = || {
        let group = std::slice::from_ref(&device);
        let comm = CpuComm::group(group, Duration::from_secs(30)).pop().unwrap();
        let options = options(setup, LossScaler::None);
        Engine::new(device.clone(), comm, layout.clone(), options, &init).unwrap()
    };
    let mut engine = new_engine();
    let run = |engine: &mut Engine<_, _, f32>, k| {
        engine.backward(|io, ready| forward_backward_opening(&device, &layout, io, ready, 0, k))
    };
    let window = |engine: &mut Engine<_, _, f32>| {
        for k in 0..setup.accum {
            run(engine, u64::from(k)).unwrap();
            engine.step().unwrap();
        }
    };
    window(&mut engine);
    let held = device.download(engine.params()).unwrap();
    assert_eq!(held, init, "{setup:?}: the step waits for the forward");
    engine.complete_step().unwrap();
    let stepped = device.download(engine.params()).unwrap();
    assert_ne!(stepped, init);
    let inline = train::<f32>(&Setup { steps: 1, ..setup.clone() }, LossScaler::None, None);
    assert_eq!(stepped, inline.weights[0], "{setup:?}: the inline step's weights");

    let mut engine = new_engine();
    window(&mut engine);
    let refused = engine
        .backward(|io, ready| forward_backward(&device, &layout, io, ready, 0, 1))
        .unwrap_err();
    let EngineError::Misuse(message) = refused else { panic!("{refused:?}") };
    assert!(message.contains("ModelIo::open"), "{message}");
}
