//! `zeroflow bench copy`: copy bandwidth between host memory and the GPU, host to device, device
//! to host and both at once, for pinned and pageable host memory (1 GiB per copy by default).

use anyhow::Context;
use clap::ValueEnum;
use zeroflow_device::cuda::bench::{CopyBandwidth, copy_bandwidth};
use zeroflow_device::cuda::{is_absent, short_reason};
use zeroflow_device::{CudaDevice, Device, HostMemory};

use crate::InputError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// MiB per copy.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..))]
    mib: u64,
    /// Timed runs of each kind after one warm-up; the best is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    repeats: u32,
    /// Which GPU (its ordinal).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Which host memory to measure.
    #[arg(long, value_enum, default_value_t = MemoryArg::Both)]
    memory: MemoryArg,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum MemoryArg {
    Pinned,
    Pageable,
    Both,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let bytes = usize::try_from(args.mib << 20)
        .map_err(|_| InputError::from_display("--mib is too large for this machine"))?;
    let options = crate::settings::cuda_device_options(&crate::settings::env::from_process()?);
    let device = CudaDevice::with_options(args.gpu, options).map_err(|error| {
        if is_absent(&error) {
            anyhow::anyhow!(
                "no CUDA GPU found ({}); `zeroflow bench copy` measures copies to a GPU and needs \
                 one",
                short_reason(&error)
            )
        } else {
            anyhow::Error::new(error).context(format!("opening GPU {}", args.gpu))
        }
    })?;
    let memories: &[HostMemory] = match args.memory {
        MemoryArg::Pinned => &[HostMemory::Pinned],
        MemoryArg::Pageable => &[HostMemory::Pageable],
        MemoryArg::Both => &[HostMemory::Pinned, HostMemory::Pageable],
    };
    let results = memories
        .iter()
        .map(|&memory| {
            copy_bandwidth(&device, memory, bytes, args.repeats as usize)
                .with_context(|| format!("measuring {} copies", name(memory)))
        })
        .collect::<anyhow::Result<Vec<CopyBandwidth>>>()?;
    if args.json {
        let results: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "memory": name(r.memory),
                    "h2d_gbps": r.h2d_gbps,
                    "d2h_gbps": r.d2h_gbps,
                    "both_gbps": r.both_gbps,
                    "host_read_gbps": r.host_read_gbps,
                })
            })
            .collect();
        let json = serde_json::json!({
            "bench": "copy",
            "gpu": args.gpu,
            "device": device.describe(),
            "bytes_per_copy": bytes,
            "repeats": args.repeats,
            "results": results,
        });
        println!("{json}");
        return Ok(());
    }
    println!(
        "copy bandwidth: {} MiB per copy, best of {} runs, GPU {}: {} (GB/s = 10^9 bytes/s)",
        args.mib,
        args.repeats,
        args.gpu,
        device.describe()
    );
    println!("  memory      H2D GB/s   D2H GB/s   both GB/s   host read GB/s (one thread)");
    for r in &results {
        println!(
            "  {:<9} {:>10.1} {:>10.1} {:>11.1} {:>16.1}",
            name(r.memory),
            r.h2d_gbps,
            r.d2h_gbps,
            r.both_gbps,
            r.host_read_gbps
        );
    }
    Ok(())
}

fn name(memory: HostMemory) -> &'static str {
    match memory {
        HostMemory::Pinned => "pinned",
        HostMemory::Pageable => "pageable",
    }
}
