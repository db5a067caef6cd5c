//! `bench_gemm`: the bf16 throughput of cuBLASLt on this GPU, timed with CUDA events.

use std::fmt;

use cudarc::driver::sys as cu_sys;
use zeroflow_core::dtype::bf16;

use super::super::library::driver_error;
use super::super::{CudaDevice, KernelParams};
use super::{Blas, Matmul, MatmulOperands, Operand};
use crate::error::{DeviceError, Result};
use crate::{Device, StreamKind};

/// Fills a bf16 buffer with values uniform in [-1, 1) from a counter-based hash of the index and
/// a seed (random, never zeros: a GEMM of zeros can run faster than one of real data).
const FILL_SOURCE: &str = r#"
static __device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

extern "C" __global__ void fill_uniform_bf16(bf16_t* out, u64 n, u64 seed) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 bits = splitmix64(seed ^ (i * 0x2545f4914f6cdd1dull));
        float unit = (float)(bits >> 40) * (1.0f / 16777216.0f);
        out[i] = f32_to_bf16(2.0f * unit - 1.0f);
    }
}
"#;

/// The outcome of [`bench_gemm`].
#[derive(Clone, Debug, PartialEq)]
pub struct GemmBench {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Timed iterations.
    pub iters: usize,
    /// Median time of one product, in milliseconds.
    pub median_ms: f64,
    /// Fastest time of one product, in milliseconds.
    pub min_ms: f64,
    /// 2·m·n·k over the median time, in 10¹² per second.
    pub tflops: f64,
}

impl fmt::Display for GemmBench {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "bf16 {}x{}x{}: {:.3} ms, {:.1} TFLOP/s (median of {})",
            self.m, self.n, self.k, self.median_ms, self.tflops, self.iters
        )
    }
}

/// Times `D[m, n] = Aᵀ · B` (column-major, A stored k×m, B k×n: both operands K-major, the
/// layout of a linear layer's forward pass), bf16 in and out with fp32 accumulation, on random
/// data on the compute stream: `max(3, iters / 10)` untimed products, then `iters` products each
/// between two timing events. Reports the median.
pub fn bench_gemm(
    device: &CudaDevice,
    m: usize,
    n: usize,
    k: usize,
    iters: usize,
) -> Result<GemmBench> {
    if m == 0 || n == 0 || k == 0 || iters == 0 {
        return Err(DeviceError::Kernel {
            kernel: "bench_gemm",
            reason: format!("sizes and iterations must be at least 1 (got {m}x{n}x{k}, {iters})"),
        });
    }
    let blas = Blas::new(device)?;
    let stream = device.stream(StreamKind::Compute).clone();
    let a = device.alloc::<bf16>(k * m)?;
    let b = device.alloc::<bf16>(k * n)?;
    let d = device.alloc::<bf16>(m * n)?;
    let fill = device.load_module("bench_gemm_fill", FILL_SOURCE)?.function("fill_uniform_bf16")?;
    for (seed, (buffer, len)) in [(&a, k * m), (&b, k * n)].into_iter().enumerate() {
        let params = KernelParams::new().ptr(buffer, 0).u64(len as u64).u64(seed as u64 + 1);
        // SAFETY: the kernel takes (bf16_t*, u64, u64) and writes elements below `len`, the
        // buffer's length; the buffer is used by this stream only.
        unsafe { device.launch(&stream, &fill, 1024u32, 256u32, 0, &params)? };
    }

    let problem = Matmul::col_major(m, n, k, true, false);
    let operands = MatmulOperands::new(Operand::of(&a, 0), Operand::of(&b, 0), Operand::of(&d, 0));
    for _ in 0..(iters / 10).max(3) {
        blas.matmul(&stream, &problem, operands)?;
    }
    let ctx = device.context();
    let timing_event = || {
        ctx.new_event(Some(cu_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| driver_error("cuEventCreate", e))
    };
    let mut marks = Vec::with_capacity(iters);
    for _ in 0..iters {
        let (start, stop) = (timing_event()?, timing_event()?);
        start.record(stream.raw()).map_err(|e| driver_error("cuEventRecord", e))?;
        blas.matmul(&stream, &problem, operands)?;
        stop.record(stream.raw()).map_err(|e| driver_error("cuEventRecord", e))?;
        marks.push((start, stop));
    }
    let mut times = marks
        .iter()
        .map(|(start, stop)| {
            start.elapsed_ms(stop).map(f64::from).map_err(|e| driver_error("cuEventElapsedTime", e))
        })
        .collect::<Result<Vec<f64>>>()?;
    device.synchronize()?;
    times.sort_by(f64::total_cmp);
    let median_ms = times[times.len() / 2];
    Ok(GemmBench {
        m,
        n,
        k,
        iters,
        median_ms,
        min_ms: times[0],
        tflops: problem.flops() / (median_ms * 1e-3) / 1e12,
    })
}
