//! Device errors that no token reports (a kernel that failed on its stream, a copy whose token
//! was dropped) are parked by the device; the engine collects them once per step, so a step
//! fails where its work failed (DESIGN.md §3 rule 4), not at some later synchronize.

use zeroflow_device::cpu::{CpuComm, KernelArgs};
use zeroflow_device::{CpuDevice, Device, DeviceError, StreamKind};
use zeroflow_engine::synthetic::{forward_backward, initial, layout};
use zeroflow_engine::{Engine, EngineError, LossScaler, Stage, StepReport};

use crate::harness::{Setup, options};

/// One micro-step of the synthetic model at micro-step `k`, with a kernel that fails queued on
/// the compute stream before the model when `fail` is set.
fn micro_step(
    engine: &mut Engine<CpuDevice, CpuComm, f32>,
    device: &CpuDevice,
    k: u64,
    fail: bool,
) -> Result<StepReport, EngineError> {
    let layout = engine.layout().clone();
    engine.backward(|io, ready| {
        if fail {
            let compute = device.stream(StreamKind::Compute);
            device.launch(compute, "injected", KernelArgs::new(), |_| Err("on purpose".into()))?;
        }
        forward_backward(device, &layout, io, ready, 0, k)
    })?;
    engine.step()
}

#[test]
fn an_error_parked_during_a_step_is_returned_by_that_step() {
    for offload in [false, true] {
        let device = CpuDevice::new().unwrap();
        let layout = layout(1);
        let setup = Setup::new(Stage::Zero2, 1, 1, offload);
        let comm = CpuComm::group(std::slice::from_ref(&device), std::time::Duration::from_secs(5))
            .remove(0);
        let options = options(&setup, LossScaler::None);
        let init = initial::<f32>(&layout);
        let mut engine = Engine::new(device.clone(), comm, layout, options, &init).unwrap();
        let first = micro_step(&mut engine, &device, 0, false);
        assert!(matches!(first, Ok(StepReport::Stepped { .. })), "offload {offload}: {first:?}");
        let failed = micro_step(&mut engine, &device, 1, true);
        assert!(
            matches!(
                &failed,
                Err(EngineError::Device(DeviceError::Kernel { kernel: "injected", .. }))
            ),
            "offload {offload}: the step whose backward failed returned {failed:?}"
        );
        // Collected once: the next step has nothing parked.
        let next = micro_step(&mut engine, &device, 2, false);
        assert!(matches!(next, Ok(StepReport::Stepped { .. })), "offload {offload}: {next:?}");
    }
}
