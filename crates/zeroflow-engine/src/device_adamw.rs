//! AdamW over a partition held in device memory (the path without offload).

use std::ops::Range;
use std::sync::Arc;

use zeroflow_core::Float;
use zeroflow_device::cpu::{CpuBuffer, CpuStream, KernelArgs};
use zeroflow_device::{CpuDevice, Device, DeviceError, Kernels};
use zeroflow_optim::{AdamState, AdamWStep, CpuAdam, Grads, Output};

/// The fp32 optimizer state of one partition on the device.
#[derive(Debug)]
pub struct DeviceAdamState<D: Device> {
    pub master: D::Buffer<f32>,
    pub exp_avg: D::Buffer<f32>,
    pub exp_avg_sq: D::Buffer<f32>,
}

/// A device that can run AdamW over state in its own memory.
pub trait DeviceAdamW: Kernels {
    /// One AdamW step over `state[range]` with the f32 gradients `grads[range]` (multiplied by
    /// the step's gradient scale), writing the updated weights as `P` into
    /// `out[out_offset..out_offset + range.len()]`.
    #[allow(clippy::too_many_arguments, reason = "one buffer per operand, like the kernel")]
    fn adamw<P: Float>(
        &self,
        stream: &Self::Stream,
        step: &AdamWStep,
        state: &DeviceAdamState<Self>,
        range: Range<usize>,
        grads: &Self::Buffer<f32>,
        out: &Self::Buffer<P>,
        out_offset: usize,
    ) -> Result<(), DeviceError>
    where
        Self: Sized;
}

/// The CPU device runs zeroflow's CPU AdamW (one thread per kernel: the device's streams are the
/// parallelism) as a kernel on the stream.
impl DeviceAdamW for CpuDevice {
    fn adamw<P: Float>(
        &self,
        stream: &CpuStream,
        step: &AdamWStep,
        state: &DeviceAdamState<Self>,
        range: Range<usize>,
        grads: &CpuBuffer<f32>,
        out: &CpuBuffer<P>,
        out_offset: usize,
    ) -> Result<(), DeviceError> {
        let out_range = out_offset..out_offset + range.len();
        let args = KernelArgs::new()
            .in_out(&state.master, range.clone())
            .in_out(&state.exp_avg, range.clone())
            .in_out(&state.exp_avg_sq, range.clone())
            .input(grads, range)
            .output(out, out_range);
        let step = *step;
        let adam = cpu_adam();
        self.launch(stream, "adamw", args, move |ctx| {
            let master = ctx.output::<f32>(0);
            let state = AdamState {
                params: &mut *master,
                exp_avg: ctx.output::<f32>(1),
                exp_avg_sq: ctx.output::<f32>(2),
            };
            let grads = Grads::F32(ctx.input::<f32>(3));
            adam.step(&step, state, grads, Output::MasterOnly).map_err(|e| e.to_string())?;
            ctx.output::<P>(4).iter_mut().zip(master).for_each(|(o, m)| *o = P::from_f32(*m));
            Ok(())
        })
    }
}

/// One single-threaded executor shared by every CPU-device AdamW kernel.
fn cpu_adam() -> Arc<CpuAdam> {
    static ADAM: std::sync::OnceLock<Arc<CpuAdam>> = std::sync::OnceLock::new();
    ADAM.get_or_init(|| {
        Arc::new(
            CpuAdam::new(1, zeroflow_optim::SimdLevel::detect())
                .expect("one thread at the detected SIMD level is always available"),
        )
    })
    .clone()
}
