//! Tests of `CudaDevice` on a real GPU, compiled as one test binary.
//!
//! Every test first opens GPU 0. Where there is no CUDA driver or no GPU it prints
//! `skipped: no CUDA device (<reason>)` and passes, so CI on CPU-only machines stays green and
//! says why; with `ZEROFLOW_REQUIRE_GPU=1` (set by `scripts/gpu-run.sh`) a missing GPU fails
//! instead. Run with `--test-threads=1 --nocapture`: the tests share the GPU and print figures.
//! Lines starting with `RESULT ` are collected by `scripts/gpu-run.sh` into its table.

mod bandwidth;
mod copies;
mod pinned;

use zeroflow_device::cuda::{CudaBuffer, CudaStream, is_absent, short_reason};
use zeroflow_device::{CudaDevice, Device};

/// GPU 0, or `None` (after printing why) where this machine has none.
fn gpu() -> Option<CudaDevice> {
    match CudaDevice::new(0) {
        Ok(device) => Some(device),
        Err(error) if std::env::var_os("ZEROFLOW_REQUIRE_GPU").is_none() && is_absent(&error) => {
            println!("skipped: no CUDA device ({})", short_reason(&error));
            None
        }
        Err(error) => panic!("opening GPU 0 failed: {error}"),
    }
}

/// A number from the environment, or `default`.
fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Keeps the GPU busy from its own stream: large device-to-device copies back and forth.
struct Load {
    stream: CudaStream,
    a: CudaBuffer<u32>,
    b: CudaBuffer<u32>,
}

impl Load {
    /// Two buffers of `mib` MiB each.
    fn new(device: &CudaDevice, mib: usize) -> Self {
        let len = mib << 18;
        Load {
            stream: device.new_stream("load").unwrap(),
            a: device.alloc(len).unwrap(),
            b: device.alloc(len).unwrap(),
        }
    }

    /// Enqueues `copies` copies of one buffer into the other and returns an event recorded after
    /// them.
    fn run(&self, device: &CudaDevice, copies: usize) -> <CudaDevice as Device>::Event {
        use zeroflow_device::DeviceBuffer;
        let len = self.a.len();
        for i in 0..copies {
            let (src, dst) = if i % 2 == 0 { (&self.a, &self.b) } else { (&self.b, &self.a) };
            device.copy_d2d(&self.stream, src, 0..len, dst, 0).unwrap();
        }
        let mut event = device.new_event().unwrap();
        device.record(&mut event, &self.stream).unwrap();
        event
    }
}
