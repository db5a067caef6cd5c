//! Tests of the Llama family on a real GPU, compiled as one test binary: each of the family's
//! CUDA kernels against its CPU twin (`kernels.rs`), `CudaLlama` against the f64 host model
//! (`model.rs`), and on packed rows against its documents run alone and against the host model
//! on the same rows (`packing.rs`). The attention kernels' own tests are zeroflow-nn's.
//!
//! Every test first opens GPU 0. Where there is no CUDA driver or no GPU it prints
//! `skipped: no CUDA device (<reason>)` and passes, so CI on CPU-only machines stays green and
//! says why; with `ZEROFLOW_REQUIRE_GPU=1` a missing GPU fails instead. Run with
//! `--test-threads=1 --nocapture`: the tests share the GPU and print figures. Lines starting with
//! `RESULT ` are collected by `scripts/gpu-run.sh` into its table.

mod decode;
mod kernels;
mod model;
mod packing;
#[path = "../support.rs"]
mod support;

use zeroflow_device::CudaDevice;

/// GPU 0, or `None` (after printing why) where this machine has none.
fn gpu() -> Option<CudaDevice> {
    zeroflow_device::cuda::info::gpu_or_skip(0)
}
