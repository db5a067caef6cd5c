//! Tests of `CudaDevice` on a real GPU, compiled as one test binary.
//!
//! Every test first opens GPU 0. Where there is no CUDA driver or no GPU it prints
//! `skipped: no CUDA device (<reason>)` and passes, so CI on CPU-only machines stays green and
//! says why; with `ZEROFLOW_REQUIRE_GPU=1` (set by `scripts/gpu-run.sh`) a missing GPU fails
//! instead. Run with `--test-threads=1 --nocapture`: the tests share the GPU and print figures.
//! Lines starting with `RESULT ` are collected by `scripts/gpu-run.sh` into its table.

mod blas;
mod compile;
mod copies;
mod kernels;
mod nccl;
mod pinned;

use zeroflow_core::dtype::bf16;
use zeroflow_device::cuda::blas::{Blas, Matmul, MatmulOperands, Operand};
use zeroflow_device::cuda::{CudaBuffer, CudaStream};
use zeroflow_device::{CudaDevice, Device};

/// GPU 0, or `None` (after printing why) where this machine has none.
fn gpu() -> Option<CudaDevice> {
    zeroflow_device::cuda::info::gpu_or_skip(0)
}

/// A number from the environment, or `default`.
fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Keeps the GPU busy from its own stream, as the training step's compute does: square bf16 GEMMs
/// through cuBLASLt (8192³ by default, ~1.4 ms each on an H200; `ZEROFLOW_LOAD_GEMM=n` changes n).
struct Load {
    stream: CudaStream,
    /// Its own `Blas`: the workspace is used from the load stream only.
    blas: Blas,
    problem: Matmul,
    a: CudaBuffer<bf16>,
    b: CudaBuffer<bf16>,
    d: CudaBuffer<bf16>,
}

impl Load {
    fn new(device: &CudaDevice) -> Self {
        let n = env_usize("ZEROFLOW_LOAD_GEMM", 8192);
        let stream = device.new_stream("load").unwrap();
        let (a, b, d) = (
            device.alloc(n * n).unwrap(),
            device.alloc(n * n).unwrap(),
            device.alloc(n * n).unwrap(),
        );
        device.fill(&stream, &a, 0..n * n, bf16::from_f32(1.0)).unwrap();
        device.fill(&stream, &b, 0..n * n, bf16::from_f32(0.5)).unwrap();
        let blas = Blas::new(device).unwrap_or_else(|e| panic!("cuBLASLt for the GEMM load: {e}"));
        Load { stream, blas, problem: Matmul::col_major(n, n, n, false, false), a, b, d }
    }

    /// What the load is, for the printed results ("gemm8192").
    fn name(&self) -> String {
        format!("gemm{}", self.problem.m)
    }

    /// Enqueues `gemms` GEMMs on the load stream and returns an event recorded after them.
    fn run(&self, device: &CudaDevice, gemms: usize) -> <CudaDevice as Device>::Event {
        let operands = MatmulOperands::new(
            Operand::of(&self.a, 0),
            Operand::of(&self.b, 0),
            Operand::of(&self.d, 0),
        );
        for _ in 0..gemms {
            self.blas.matmul(&self.stream, &self.problem, operands).unwrap();
        }
        let mut event = device.new_event().unwrap();
        device.record(&mut event, &self.stream).unwrap();
        event
    }
}
