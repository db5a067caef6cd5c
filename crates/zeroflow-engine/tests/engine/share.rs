//! The optimizer's device share (`StreamOptions::device_share`): the partition's last elements are
//! stepped by the device's AdamW, from state in device memory or staged from host memory a piece
//! at a time (`device_share_state`), while the CPU streams the rest, from one micro-step's
//! gradients or from a window summed on the device. The runs are the all-CPU step's, bit for bit
//! (the CPU device's AdamW is the host's), with the step before the next forward and overlapped
//! with it, under chaos (the share's work on its streams and the CPU's chunks delayed at random
//! against each other); with the state on the device only the CPU's part crosses the host link;
//! a checkpoint holds the share's state and resumes with any share and either place; where the
//! share cannot act, the engine says so before training.

use std::time::Duration;

use zeroflow_core::Float;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_device::CpuDevice;
use zeroflow_device::cpu::CpuComm;
use zeroflow_engine::synthetic::{initial, layout};
use zeroflow_engine::{AccumulateOn, Engine, EngineError, LossScaler, ShareState, Stage};

use crate::checkpoint::{load, straight_and_saved};
use crate::harness::{Bf16, Setup, options, train, train_from};
use crate::state_dtype::zenflow;

/// One rank (stages 0–2, clipping that fires and none, chunks that cut every parameter; ZeRO-2
/// with windows of 2–4 micro-steps summed on the device), ZeRO-0 on two ranks (each holds every
/// weight), and ZeRO-1/2 on two and three ranks (each shares its partition; gathered in pieces
/// and after the step), each with a share.
fn setups() -> Vec<Setup> {
    let mut setups = Vec::new();
    for (stage, clip, stream_chunk, device_share) in [
        (Stage::Zero2, Some(0.8), 7, 0.3),
        (Stage::Zero1, None, 3, 0.77),
        (Stage::Zero0, Some(0.8), 1, 0.5),
        (Stage::Zero2, None, zeroflow_engine::DEFAULT_STREAM_CHUNK, 0.5),
    ] {
        let one = Setup::new(stage, 1, 1, true);
        setups.push(Setup { steps: 8, clip, stream_chunk, device_share, ..one });
    }
    for (accum, clip, stream_chunk, device_share) in [
        (2, Some(0.8), 7, 0.3),
        (3, None, 3, 0.6),
        (4, Some(0.8), zeroflow_engine::DEFAULT_STREAM_CHUNK, 0.5),
    ] {
        let summed = Setup::new(Stage::Zero2, 1, accum, true);
        let accumulate_on = AccumulateOn::Device;
        setups.push(Setup { steps: 6, clip, stream_chunk, device_share, accumulate_on, ..summed });
    }
    let two = Setup::new(Stage::Zero0, 2, 1, true);
    setups.push(Setup { steps: 6, stream_chunk: 7, device_share: 0.4, ..two });
    // Several ranks, each sharing its own partition: the share's weights reach the others in
    // the gather's pieces, or with the whole partition after the step.
    for (stage, world, clip, stream_chunk, device_share, gather_in_pieces) in [
        (Stage::Zero2, 2, Some(0.8), 7, 0.4, true),
        (Stage::Zero1, 3, None, 3, 0.6, false),
        (Stage::Zero2, 3, Some(0.8), zeroflow_engine::DEFAULT_STREAM_CHUNK, 0.55, true),
    ] {
        let ranks = Setup::new(stage, world, 1, true);
        setups.push(Setup {
            steps: 6,
            clip,
            stream_chunk,
            device_share,
            gather_in_pieces,
            ..ranks
        });
    }
    setups
}

fn check_bit_identical<P: Float>() {
    for setup in setups() {
        let all_cpu =
            train::<P>(&Setup { device_share: 0.0, ..setup.clone() }, LossScaler::None, None);
        let (device, host) = (ShareState::Device, ShareState::Host);
        for (overlap_forward, chaos, share_state) in [
            (false, None, device),
            (true, None, device),
            (false, Some(1), device),
            (true, Some(2), device),
            (true, None, host),
            (false, Some(4), host),
            (true, Some(5), host),
        ] {
            let shared = Setup { overlap_forward, chaos, share_state, ..setup.clone() };
            let out = train::<P>(&shared, LossScaler::None, None);
            assert_eq!(out.weights, all_cpu.weights, "{shared:?}: weights");
            assert_eq!(out.reports, all_cpu.reports, "{shared:?}: step reports");
            assert_eq!(out.snapshots, all_cpu.snapshots, "{shared:?}: optimizer state");
            assert_eq!(out.device_weights, all_cpu.device_weights, "{shared:?}: saved weights");
            if share_state == host {
                // Its state crosses the host link each step: more bytes, not fewer.
                continue;
            }
            // Only the CPU's part goes to the host and back (the share is rounded down to whole
            // packs of 8 of the model's ~130 elements).
            let (copied, all) = (out.traffic[0].copied, all_cpu.traffic[0].copied);
            let kept = 1.0 - setup.device_share + 0.1;
            for (name, with, without) in [
                ("gradients out", copied.device_to_host, all.device_to_host),
                ("weights in", copied.host_to_device, all.host_to_device),
            ] {
                let fraction = with as f64 / without as f64;
                assert!(
                    fraction <= kept,
                    "{shared:?}: {name} {with} B against {without} B without a share"
                );
            }
        }
    }
}

#[test]
fn the_device_share_gives_the_all_cpu_f32_run() {
    check_bit_identical::<f32>();
}

#[test]
fn the_device_share_gives_the_all_cpu_bf16_run() {
    check_bit_identical::<Bf16>();
}

/// A checkpoint of a run with a share holds the share's state (from the device, or from host
/// memory), and resumes exactly with the same share, with none, and with another, its state in
/// either place: one micro-step per step, and two summed on the device.
#[test]
fn a_checkpoint_with_a_device_share_resumes_bit_exactly_with_any_share() {
    let (device, host) = (ShareState::Device, ShareState::Host);
    for (accum, share_state) in [(1, device), (2, device), (1, host), (2, host)] {
        let setup = Setup {
            steps: 4,
            stream_chunk: 7,
            device_share: 0.5,
            share_state,
            chaos: Some(3),
            accumulate_on: AccumulateOn::Device,
            ..Setup::new(Stage::Zero2, 1, accum, true)
        };
        let (straight, _dir, path) = straight_and_saved(&setup);
        let other = match share_state {
            ShareState::Device => host,
            ShareState::Host => device,
        };
        for (device_share, share_state) in [(0.5, share_state), (0.0, share_state), (0.2, other)] {
            let overlap_forward = device_share == 0.2;
            let resumed = Setup { device_share, share_state, overlap_forward, ..setup.clone() };
            let second = train_from(&resumed, LossScaler::None, None, Some(&load(&path, 1)));
            assert_eq!(second.weights, straight.weights, "{resumed:?}: weights");
            assert_eq!(second.snapshots, straight.snapshots, "{resumed:?}: state and counters");
            assert_eq!(second.reports[0], straight.reports[0][4..], "{resumed:?}: step reports");
        }
    }
}

/// Where the share cannot act — a window summed on the host, the delayed update, ZenFlow,
/// 16-bit moments — or is not a fraction below 1, the engine refuses to start, saying what to
/// change.
#[test]
fn a_device_share_where_it_cannot_act_is_refused() {
    let one = || Setup { device_share: 0.5, ..Setup::new(Stage::Zero2, 1, 1, true) };
    let cases = [
        (Setup { accum: 2, accumulate_on: AccumulateOn::Host, ..one() }, "summed on the device"),
        (Setup { delayed: Some(1), ..one() }, "exact offload step"),
        (Setup { zenflow: Some(zenflow()), ..one() }, "exact offload step"),
        (Setup { moments: OptimizerStateDtype::Bf16, ..one() }, "fp32 moments"),
        (Setup { device_share: 1.0, ..one() }, "below 1"),
        (Setup { device_share: -0.1, ..one() }, "below 1"),
    ];
    let layout = layout(1);
    let init = initial::<f32>(&layout);
    for (setup, says) in cases {
        let device = CpuDevice::new().unwrap();
        let comm = CpuComm::group(std::slice::from_ref(&device), Duration::from_secs(5)).remove(0);
        let options = options(&setup, LossScaler::None);
        let refused = Engine::<_, _, f32>::new(device, comm, layout.clone(), options, &init);
        match refused {
            Err(EngineError::Config(message)) => {
                assert!(message.contains(says), "{setup:?}: {message}");
            }
            other => panic!("{setup:?}: {other:?}"),
        }
    }
}
