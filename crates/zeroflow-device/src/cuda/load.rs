//! A background load on a GPU: square bf16 GEMMs through cuBLASLt on a stream of their own, as a
//! training step's compute would run, for as long as the load lives. `zeroflow stress --gpu-load`
//! runs the race protocol under it, so that the copies and events it checks compete with real work.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

use zeroflow_core::bf16;

use super::CudaDevice;
use super::blas::{Blas, Matmul, MatmulOperands, Operand};
use crate::error::Result;
use crate::{Device, DeviceError};

/// GEMMs running on a GPU until dropped.
#[derive(Debug)]
pub struct GemmLoad {
    stop: Arc<AtomicBool>,
    gemms: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<()>>>,
    n: usize,
}

impl GemmLoad {
    /// Starts `n × n × n` bf16 GEMMs (8192: ~1.4 ms each on an H200) on a new stream of `device`.
    pub fn start(device: &CudaDevice, n: usize) -> Result<Self> {
        let stream = device.new_stream("gemm-load")?;
        let (a, b, d) =
            (device.alloc::<bf16>(n * n)?, device.alloc(n * n)?, device.alloc::<bf16>(n * n)?);
        device.fill(&stream, &a, 0..n * n, bf16::from_f32(1.0))?;
        device.fill(&stream, &b, 0..n * n, bf16::from_f32(0.5))?;
        let blas = Blas::new(device)?;
        let problem = Matmul::col_major(n, n, n, false, false);
        let stop = Arc::new(AtomicBool::new(false));
        let gemms = Arc::new(AtomicU64::new(0));
        let (device, flag, count) = (device.clone(), stop.clone(), gemms.clone());
        let thread = std::thread::Builder::new()
            .name("gemm-load".into())
            .spawn(move || -> Result<()> {
                let mut done = device.new_event()?;
                let operands =
                    MatmulOperands::new(Operand::of(&a, 0), Operand::of(&b, 0), Operand::of(&d, 0));
                while !flag.load(Ordering::Relaxed) {
                    for _ in 0..4 {
                        blas.matmul(&stream, &problem, operands)?;
                    }
                    device.record(&mut done, &stream)?;
                    device.sync_event(&done)?;
                    count.fetch_add(4, Ordering::Relaxed);
                }
                Ok(())
            })
            .map_err(|e| DeviceError::Kernel {
                kernel: "gemm-load",
                reason: format!("cannot start the load thread: {e}"),
            })?;
        Ok(GemmLoad { stop, gemms, thread: Some(thread), n })
    }

    /// The GEMMs completed so far.
    pub fn gemms(&self) -> u64 {
        self.gemms.load(Ordering::Relaxed)
    }

    /// The GEMM size.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Stops the load and returns its error, if it failed.
    pub fn finish(mut self) -> Result<u64> {
        self.stop.store(true, Ordering::Relaxed);
        let thread = self.thread.take().expect("joined once");
        match thread.join() {
            Ok(result) => result.map(|()| self.gemms()),
            Err(_) => Err(DeviceError::Kernel {
                kernel: "gemm-load",
                reason: "the load thread panicked".into(),
            }),
        }
    }
}

impl Drop for GemmLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
