//! Measurements of the GPU for `zeroflow bench`: copy bandwidth between host memory and the GPU.

use std::time::Instant;

use crate::error::Result;
use crate::{CudaDevice, Device, HostMemory, StreamKind};

/// Copy bandwidth of one kind of host memory, in GB/s (10^9 bytes per second), best of the
/// repeats.
#[derive(Clone, Debug, PartialEq)]
pub struct CopyBandwidth {
    pub memory: HostMemory,
    /// Bytes per copy.
    pub bytes: usize,
    /// Host to device, alone.
    pub h2d_gbps: f64,
    /// Device to host, alone.
    pub d2h_gbps: f64,
    /// Both directions at once (on the h2d and d2h streams), counting the bytes of both.
    pub both_gbps: f64,
    /// One host thread summing the buffer the GPU copied into (cached page-locked memory should
    /// read like pageable memory; write-combined memory would be far slower).
    pub host_read_gbps: f64,
}

/// Measures the copy bandwidth of `bytes`-byte copies (rounded down to whole 4-byte words) between
/// `memory` and `device`: each direction alone, both at once, and a host read, each the best of
/// `repeats` runs after one warm-up run. Allocates two device and two host buffers of that size.
pub fn copy_bandwidth(
    device: &CudaDevice,
    memory: HostMemory,
    bytes: usize,
    repeats: usize,
) -> Result<CopyBandwidth> {
    let len = bytes / size_of::<u32>();
    let bytes = len * size_of::<u32>();
    let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
    let gpu_down = device.alloc::<u32>(len)?;
    let gpu_up = device.alloc::<u32>(len)?;
    let mut down = device.alloc_host::<u32>(len, memory)?;
    let mut up = device.alloc_host::<u32>(len, memory)?;
    up.fill(7);
    let h2d_gbps = best_rate(repeats, bytes, || {
        device.copy_h2d(h2d, &up, 0..len, &gpu_up, 0)?.wait()?;
        Ok(())
    })?;
    let d2h_gbps = best_rate(repeats, bytes, || {
        device.copy_d2h(d2h, &gpu_down, 0..len, &mut down, 0)?.wait()?;
        Ok(())
    })?;
    let both_gbps = best_rate(repeats, 2 * bytes, || {
        let sending = device.copy_h2d(h2d, &up, 0..len, &gpu_up, 0)?;
        let receiving = device.copy_d2h(d2h, &gpu_down, 0..len, &mut down, 0)?;
        sending.wait()?;
        receiving.wait()?;
        Ok(())
    })?;
    let mut checksum = 0u64;
    let host_read_gbps = best_rate(repeats, bytes, || {
        checksum = down.iter().fold(checksum, |sum, &x| sum.wrapping_add(u64::from(x)));
        Ok(())
    })?;
    std::hint::black_box(checksum);
    device.synchronize()?;
    Ok(CopyBandwidth { memory, bytes, h2d_gbps, d2h_gbps, both_gbps, host_read_gbps })
}

/// GB/s for `bytes` moved in the best of `repeats` (at least one) runs of `run`, after one
/// untimed run (first-touch and mapping costs).
fn best_rate(repeats: usize, bytes: usize, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let started = Instant::now();
        run()?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok(bytes as f64 / best / 1e9)
}
