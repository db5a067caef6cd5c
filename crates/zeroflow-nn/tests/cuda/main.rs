//! Tests of the shared layers' CUDA kernels (attention, flash attention, and their packed forms
//! with the encoder's) on a real GPU against the CPU twins, compiled as one test binary.
//!
//! Every test first opens GPU 0. Where there is no CUDA driver or no GPU it prints
//! `skipped: no CUDA device (<reason>)` and passes, so CI on CPU-only machines stays green and
//! says why; with `ZEROFLOW_REQUIRE_GPU=1` a missing GPU fails instead. Run with
//! `--test-threads=1 --nocapture`: the tests share the GPU and print figures. Lines starting with
//! `RESULT ` are collected by `scripts/gpu-run.sh` into its table.

mod attention;
mod decode;
mod flash;
mod packed;
mod support;

use zeroflow_device::CudaDevice;

/// GPU 0, or `None` (after printing why) where this machine has none.
fn gpu() -> Option<CudaDevice> {
    zeroflow_device::cuda::info::gpu_or_skip(0)
}
