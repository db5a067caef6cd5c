//! Tests of the GPT model on a real GPU against the CPU model, on plain and on packed rows
//! (`packing.rs`), compiled as one test binary (the attention kernels' own tests are
//! zeroflow-nn's).
//!
//! Every test first opens GPU 0. Where there is no CUDA driver or no GPU it prints
//! `skipped: no CUDA device (<reason>)` and passes, so CI on CPU-only machines stays green and
//! says why; with `ZEROFLOW_REQUIRE_GPU=1` a missing GPU fails instead. Run with
//! `--test-threads=1 --nocapture`: the tests share the GPU and print figures. Lines starting with
//! `RESULT ` are collected by `scripts/gpu-run.sh` into its table.

mod decode;
mod model;
mod packing;

use zeroflow_device::CudaDevice;

/// GPU 0, or `None` (after printing why) where this machine has none.
fn gpu() -> Option<CudaDevice> {
    zeroflow_device::cuda::info::gpu_or_skip(0)
}
