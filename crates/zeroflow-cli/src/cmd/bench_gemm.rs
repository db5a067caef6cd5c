//! `zeroflow bench gemm`: bf16 matrix multiplication throughput through cuBLASLt (bf16 in and
//! out, fp32 accumulation, the layout of a linear layer's forward pass), timed with CUDA events.

use anyhow::Context;
use zeroflow_device::CudaDevice;
use zeroflow_device::cuda::blas::bench_gemm;
use zeroflow_device::cuda::{is_absent, short_reason};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Rows of the output.
    #[arg(long, short, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    m: u64,
    /// Columns of the output.
    #[arg(long, short, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    n: u64,
    /// The inner dimension.
    #[arg(long, short, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..))]
    k: u64,
    /// Timed products after the warm-up; the median is reported.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    iters: u32,
    /// Which GPU (its ordinal).
    #[arg(long, default_value_t = 0)]
    gpu: usize,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let options = crate::settings::cuda_device_options(&crate::settings::env::from_process()?);
    let device = CudaDevice::with_options(args.gpu, options).map_err(|error| {
        if is_absent(&error) {
            anyhow::anyhow!(
                "no CUDA GPU found ({}); `zeroflow bench gemm` measures cuBLASLt on a GPU and \
                 needs one",
                short_reason(&error)
            )
        } else {
            anyhow::Error::new(error).context(format!("opening GPU {}", args.gpu))
        }
    })?;
    let (m, n, k) = (args.m as usize, args.n as usize, args.k as usize);
    let bench = bench_gemm(&device, m, n, k, args.iters as usize)
        .with_context(|| format!("timing a {m}x{n}x{k} bf16 GEMM on GPU {}", args.gpu))?;
    println!("{bench}");
    // For the result table of scripts/gpu-run.sh: `gemm_8192` for a cube, else `gemm_MxNxK`.
    let name = if m == n && n == k { format!("gemm_{m}") } else { format!("gemm_{m}x{n}x{k}") };
    println!("RESULT {name} tflops={:.1} median_ms={:.3}", bench.tflops, bench.median_ms);
    Ok(())
}
