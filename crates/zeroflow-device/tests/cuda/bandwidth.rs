//! Copy bandwidth between pinned (and pageable) host memory and the GPU, 1 GiB per copy. A
//! measurement, not a check: ignored by default, run by `scripts/gpu-run.sh` with `--ignored`.

use std::time::Instant;

use zeroflow_device::{Device, HostMemory, StreamKind};

use crate::{env_usize, gpu};

const GIB: usize = 1 << 30;

/// GB/s (10^9 bytes) for `bytes` moved in the best of `repeats` runs of `run`.
fn best_rate(repeats: usize, bytes: usize, mut run: impl FnMut()) -> f64 {
    run(); // Warm-up: first-touch and mapping costs.
    let best = (0..repeats)
        .map(|_| {
            let started = Instant::now();
            run();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    bytes as f64 / best / 1e9
}

#[test]
#[ignore = "a measurement: run with --ignored on a GPU machine"]
fn copy_bandwidth_of_one_gib() {
    let Some(device) = gpu() else { return };
    let repeats = env_usize("ZEROFLOW_BANDWIDTH_REPEATS", 5);
    let len = GIB / 4;
    let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
    let gpu_down = device.alloc::<u32>(len).unwrap();
    let gpu_up = device.alloc::<u32>(len).unwrap();
    for memory in [HostMemory::Pinned, HostMemory::Pageable] {
        let mut down = device.alloc_host::<u32>(len, memory).unwrap();
        let mut up = device.alloc_host::<u32>(len, memory).unwrap();
        up.fill(7);
        let name = if memory == HostMemory::Pinned { "pinned" } else { "pageable" };
        let h2d_rate = best_rate(repeats, GIB, || {
            device.copy_h2d(h2d, &up, 0..len, &gpu_up, 0).unwrap().wait().unwrap();
        });
        let d2h_rate = best_rate(repeats, GIB, || {
            device.copy_d2h(d2h, &gpu_down, 0..len, &mut down, 0).unwrap().wait().unwrap();
        });
        let both_rate = best_rate(repeats, 2 * GIB, || {
            let sending = device.copy_h2d(h2d, &up, 0..len, &gpu_up, 0).unwrap();
            let receiving = device.copy_d2h(d2h, &gpu_down, 0..len, &mut down, 0).unwrap();
            sending.wait().unwrap();
            receiving.wait().unwrap();
        });
        // One thread summing the buffer: page-locked memory allocated with flags 0 is cached,
        // so this should match pageable memory (write-combined memory would be far slower).
        let mut checksum = 0u64;
        let read_rate = best_rate(repeats, GIB, || {
            checksum = down.iter().fold(checksum, |sum, &x| sum.wrapping_add(u64::from(x)));
        });
        println!("{name} 1 GiB: host read (one thread) {read_rate:.1} GB/s (checksum {checksum})");
        println!("RESULT host_read_{name} gbps={read_rate:.1}");
        println!(
            "{name} 1 GiB: H2D {h2d_rate:.1} GB/s, D2H {d2h_rate:.1} GB/s, both at once \
             {both_rate:.1} GB/s total (best of {repeats})"
        );
        println!(
            "RESULT bandwidth_{name} h2d_gbps={h2d_rate:.1} d2h_gbps={d2h_rate:.1} both_gbps={both_rate:.1}"
        );
    }
    device.synchronize().unwrap();
}
