//! `bench gpt`'s measurement: forward + backward of a model of any family on one GPU (bf16, no
//! optimizer), timed, with the memory it holds and, where asked, the time of each kind of
//! operation.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::{CudaDevice, Device};
pub use zeroflow_nn::PlanOptions;
use zeroflow_nn::cuda::ActivationMemory;

use crate::error::{Result, TrainError};
use crate::{Family, Model, ModelSpec, with_family};

/// What to measure: `iters` timed steps of micro-batches of `batch` × `seq` tokens after
/// `warmup` untimed ones, the model built with `options` (and GPT-2's GELU fused into its
/// matmuls unless `fuse_gelu` is false).
#[derive(Clone, Copy, Debug)]
pub struct GptBenchOptions {
    pub batch: usize,
    pub seq: usize,
    pub iters: u32,
    pub warmup: u32,
    pub options: PlanOptions,
    pub fuse_gelu: bool,
    /// Also one step waiting after each operation, timed by kind.
    pub profile: bool,
}

/// What [`measure`] measured.
#[derive(Debug)]
pub struct GptBench {
    /// Seconds per forward + backward, fastest first.
    pub times: Vec<f64>,
    pub memory: ActivationMemory,
    /// Bytes of the bf16 parameters and gradients.
    pub params_and_grads: usize,
    /// Bytes of GPU memory in use (the driver's context included).
    pub in_use: usize,
    pub loss: f32,
    /// The profiled step's time by kind of operation, in first-run order.
    pub profile: Option<Vec<(String, Duration)>>,
}

/// Builds `model`'s GPU model on `device` (`name` for the error) and times its forward +
/// backward on random tokens.
pub fn measure(
    device: &CudaDevice,
    model: &ModelSpec,
    name: &str,
    bench: &GptBenchOptions,
) -> Result<GptBench> {
    with_family!(model, family => measure_family(device, family, name, bench))
}

fn measure_family<F: Family>(
    device: &CudaDevice,
    family: &F,
    name: &str,
    bench: &GptBenchOptions,
) -> Result<GptBench> {
    let (batch, seq) = (bench.batch, bench.seq);
    let layout = family.flat_layout(1)?;
    let mut host = vec![0.0f32; layout.padded_len()];
    family.init(&layout, 1, &mut host)?;
    let host: Vec<bf16> = host.iter().map(|&x| bf16::from_f32(x)).collect();
    let params = device.upload(&host)?;
    drop(host);
    let grads = device.alloc::<bf16>(layout.padded_len())?;
    let blas = Arc::new(Blas::new(device)?);
    let shape = (batch, seq);
    let mut model = family
        .cuda_bench_model(device, blas, &layout, shape, bench.options, bench.fuse_gelu)
        .map_err(|e| e.context(format!("setting up {name} at micro-batch {batch} × {seq}")))?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let vocab = family.vocab_size() as u32;
    let mut draw =
        || -> Vec<u32> { (0..batch * seq).map(|_| rng.random_range(0..vocab)).collect() };
    let (inputs, targets) = (draw(), draw());
    let model_error = |e| TrainError::model(e);
    model.set_batch(&inputs, &targets, None).map_err(model_error)?;
    let mut step = || -> Result<f64> {
        let started = Instant::now();
        model.forward(&params).map_err(model_error)?;
        model.backward(&params, &grads, 1.0, &mut |_| {}).map_err(model_error)?;
        device.synchronize()?;
        Ok(started.elapsed().as_secs_f64())
    };
    for _ in 0..bench.warmup {
        step()?;
    }
    let mut times = (0..bench.iters).map(|_| step()).collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    let memory = F::cuda_activation_memory(&model);
    let in_use = <F::Cuda as Model>::memory_in_use(device).unwrap_or(0);
    let loss = model.loss().map_err(model_error)?;
    let profile =
        if bench.profile { Some(F::cuda_profile(&mut model, &params, &grads)?) } else { None };
    let params_and_grads = 2 * layout.padded_len() * size_of::<bf16>();
    Ok(GptBench { times, memory, params_and_grads, in_use, loss, profile })
}
