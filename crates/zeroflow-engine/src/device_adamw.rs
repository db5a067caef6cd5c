//! AdamW over a partition held in device memory (the path without offload).

use std::ops::Range;
use std::sync::Arc;

use zeroflow_core::Float;
use zeroflow_device::cpu::{CpuBuffer, CpuStream, KernelArgs};
use zeroflow_device::cuda::kernels::AdamWBuffers;
use zeroflow_device::cuda::{CudaBuffer, CudaStream};
use zeroflow_device::{CpuDevice, CudaDevice, Device, DeviceError, Kernels};
use zeroflow_optim::{AdamState, AdamWStep, CpuAdam, Grads, NoDecay, Output};

/// The fp32 optimizer state of one partition on the device, and its elements that take no
/// weight decay.
#[derive(Debug)]
pub struct DeviceAdamState<D: Device> {
    pub master: D::Buffer<f32>,
    pub exp_avg: D::Buffer<f32>,
    pub exp_avg_sq: D::Buffer<f32>,
    pub no_decay: NoDecay,
}

impl<D: Device> DeviceAdamState<D> {
    /// The master weights and both moments, in that order.
    pub fn arrays(&self) -> [&D::Buffer<f32>; 3] {
        [&self.master, &self.exp_avg, &self.exp_avg_sq]
    }
}

impl<D: DeviceAdamW> DeviceAdamState<D> {
    /// [`DeviceAdamW::adamw`] over `range` of this state, run by run of its `no_decay`: those
    /// elements with the step without weight decay, as the CPU's [`zeroflow_optim::CpuAdam`]
    /// steps them.
    #[allow(clippy::too_many_arguments, reason = "one buffer per operand, like the kernel")]
    pub fn step<P: Float>(
        &self,
        device: &D,
        stream: &D::Stream,
        step: &AdamWStep,
        range: Range<usize>,
        grads: &D::Buffer<f32>,
        out: &D::Buffer<P>,
        out_offset: usize,
    ) -> Result<(), DeviceError> {
        self.step_shifted(device, stream, step, 0, range, grads, out, out_offset)
    }

    /// [`DeviceAdamState::step`] of a piece of a larger state staged here, whose `no_decay`
    /// ranges count from the larger state's start: this state's first element is its `shift`-th.
    #[allow(clippy::too_many_arguments, reason = "one buffer per operand, like the kernel")]
    pub fn step_shifted<P: Float>(
        &self,
        device: &D,
        stream: &D::Stream,
        step: &AdamWStep,
        shift: usize,
        range: Range<usize>,
        grads: &D::Buffer<f32>,
        out: &D::Buffer<P>,
        out_offset: usize,
    ) -> Result<(), DeviceError> {
        let shifted = shift + range.start..shift + range.end;
        for (run, step) in self.no_decay.steps(step, shifted) {
            let run = run.start - shift..run.end - shift;
            let at = out_offset + (run.start - range.start);
            device.adamw(stream, &step, self, run, grads, out, at)?;
        }
        Ok(())
    }
}

/// A device that can run AdamW over state in its own memory.
pub trait DeviceAdamW: Kernels + Clone {
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

    /// The device memory free now, in bytes, where the device can tell (for the choice of
    /// [`crate::AccumulateOn::Auto`]); `None` for the CPU device, whose memory is the host's.
    fn free_memory(&self) -> Option<usize> {
        None
    }
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

/// The GPU runs the fused AdamW kernel of `kernels/engine.cu`: the same arithmetic, fused
/// multiply-adds included, as zeroflow-optim's AVX2 and AVX-512 kernels.
impl DeviceAdamW for CudaDevice {
    fn adamw<P: Float>(
        &self,
        stream: &CudaStream,
        step: &AdamWStep,
        state: &DeviceAdamState<Self>,
        range: Range<usize>,
        grads: &CudaBuffer<f32>,
        out: &CudaBuffer<P>,
        out_offset: usize,
    ) -> Result<(), DeviceError> {
        let buffers = AdamWBuffers {
            master: &state.master,
            exp_avg: &state.exp_avg,
            exp_avg_sq: &state.exp_avg_sq,
            grads,
        };
        self.adamw_step(stream, &step.scalars(), buffers, range, out, out_offset)
    }

    fn free_memory(&self) -> Option<usize> {
        self.memory_info().ok().map(|(free, _total)| free)
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

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use zeroflow_core::dtype::bf16;
    use zeroflow_device::StreamKind;
    use zeroflow_optim::{AdamW, AdamWConfig};

    use super::*;

    /// Three AdamW steps over `range` of the state `init` on `device`; returns the master
    /// weights and the bf16 output.
    fn run<D: DeviceAdamW>(
        device: &D,
        init: &[Vec<f32>; 3],
        grads: &[Vec<f32>],
        steps: &[AdamWStep],
        range: Range<usize>,
    ) -> (Vec<f32>, Vec<bf16>) {
        let [master, exp_avg, exp_avg_sq] = init.each_ref().map(|v| device.upload(v).unwrap());
        let state = DeviceAdamState { master, exp_avg, exp_avg_sq, no_decay: NoDecay::default() };
        let out = device.alloc::<bf16>(range.len() + 3).unwrap();
        for (grads, step) in grads.iter().zip(steps) {
            let grads = device.upload(grads).unwrap();
            let stream = device.stream(StreamKind::Compute);
            device.adamw(stream, step, &state, range.clone(), &grads, &out, 3).unwrap();
        }
        (device.download(&state.master).unwrap(), device.download(&out).unwrap())
    }

    /// The GPU's AdamW takes the CPU device's step: every scalar reaches the kernel under its
    /// own name (a swapped pair would change the weights far beyond rounding).
    #[test]
    fn cuda_adamw_matches_the_cpu_device() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let n = 100_003;
        let mut random = |low: f32, high: f32| -> Vec<f32> {
            (0..n).map(|_| rng.random_range(low..high)).collect()
        };
        let init = [random(-1.0, 1.0), random(-1e-3, 1e-3), random(1e-8, 1e-6)];
        let grads: Vec<Vec<f32>> = (0..3).map(|_| random(-1e-2, 1e-2)).collect();
        let config = AdamWConfig { weight_decay: 0.05, ..AdamWConfig::default() };
        let mut optimizer = AdamW::new(config).unwrap();
        let steps: Vec<AdamWStep> = (0..3).map(|_| optimizer.next_step(0.5)).collect();
        let range = 5..n - 7;
        // The CPU side first, so that machines without a GPU run it too.
        let cpu = CpuDevice::new().unwrap();
        let (cpu_master, cpu_out) = run(&cpu, &init, &grads, &steps, range.clone());
        let Some(gpu) = zeroflow_device::cuda::info::gpu_or_skip(0) else { return };
        let (gpu_master, gpu_out) = run(&gpu, &init, &grads, &steps, range);
        let mut worst = 0.0f32;
        for (i, (g, c)) in gpu_master.iter().zip(&cpu_master).enumerate() {
            let err = (g - c).abs() / c.abs().max(f32::MIN_POSITIVE);
            assert!(err <= 1e-6, "master[{i}]: GPU {g}, CPU device {c}");
            worst = worst.max(err);
        }
        let mismatched = gpu_out.iter().zip(&cpu_out).filter(|(g, c)| g != c).count();
        assert!(mismatched <= n / 1000, "{mismatched} bf16 outputs differ");
        println!(
            "RESULT engine_adamw_cuda_vs_cpu max_rel_err={worst:.3e} bf16_mismatches={mismatched}"
        );
    }
}
