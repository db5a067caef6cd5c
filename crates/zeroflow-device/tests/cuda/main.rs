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

/// `info::memory_now` reads the GPU's free and total memory from this process's primary
/// context: the total is the driver's, an allocation of 1 GiB on the open device is seen as 1 GiB
/// less free, and releasing the reading's hold on the context leaves the open device working.
#[test]
fn memory_now_sees_this_process_allocations_and_leaves_the_device_open() {
    let Some(device) = gpu() else { return };
    let info = zeroflow_device::cuda::info::memory_now;
    let (free, total) = info(0).unwrap();
    let gpus = zeroflow_device::cuda::info::list_gpus().unwrap();
    assert_eq!(total, gpus[0].memory_bytes);
    assert!(0 < free && free <= total, "{free} of {total}");
    let (len, bytes) = (1 << 28, 1 << 30);
    let held = device.alloc::<u32>(len).unwrap();
    let (fewer, _) = info(0).unwrap();
    assert!(free - fewer >= bytes, "{free} free, then {fewer} with 1 GiB allocated");
    let compute = device.stream(zeroflow_device::StreamKind::Compute);
    device.fill(compute, &held, 0..len, 7u32).unwrap();
    assert!(device.download(&held).unwrap().iter().all(|&b| b == 7));
    let gib = |bytes: usize| bytes as f64 / f64::from(1u32 << 30);
    println!("RESULT memory_now free_gib={:.2} total_gib={:.2}", gib(free), gib(total));
}
