//! AdamW on the CPU, as fast as the memory allows.
//!
//! The offload path of zeroflow steps the optimizer over a whole partition of fp32 master weights
//! and moments held in host memory. That pass reads 16 bytes and writes 12 bytes per parameter and
//! does little arithmetic, so its speed is the host's memory bandwidth. This crate provides:
//!
//! - [`AdamWConfig`] (torch's hyper-parameters, decoupled weight decay or Adam's L2 mode, optional
//!   bias correction as in DeepSpeed) and [`AdamW`], its step counter, which hands out one
//!   [`AdamWStep`] per optimizer step with every per-step scalar computed once;
//! - [`CpuAdam`], the executor: SIMD kernels chosen at run time ([`SimdLevel`]) run over chunks of
//!   the partition on a persistent thread pool (8 chunks per thread, handed out by work
//!   stealing), prefetching ahead of the hardware prefetchers. Gradients are read as f32 or bf16
//!   ([`Grads`]), scaled on the fly (un-scaling and clipping fused), and the updated weights can
//!   be written as bf16 in the same pass ([`Output`]), with streaming stores by default
//!   ([`Stores`]). [`CpuAdam::step_range`] updates one bucket of a partition so that the engine
//!   can start each chunk's upload as soon as it is written;
//! - [`roofline`]: the same access pattern with trivial arithmetic, the memory-bound ceiling that
//!   `zeroflow bench cpu-adam` compares the optimizer against, and [`Workload`], that
//!   benchmark's buffers.
//!
//! Every element is computed by the same instruction sequence wherever it falls (chunk boundaries,
//! thread count, position in the tail: the tail runs through the vector code on padded scratch
//! lanes), so results are bit-identical for any number of threads within one SIMD level.
//!
//! ```
//! use zeroflow_optim::{AdamState, AdamW, AdamWConfig, CpuAdam, Grads, Output, SimdLevel, bf16};
//!
//! let adam = CpuAdam::new(2, SimdLevel::detect())?;
//! let mut optimizer = AdamW::new(AdamWConfig { lr: 3e-4, ..AdamWConfig::default() })?;
//! let (mut params, mut exp_avg, mut exp_avg_sq) = (vec![1.0f32; 1000], vec![0.0; 1000], vec![0.0; 1000]);
//! let grads = vec![bf16::from_f32(0.5); 1000];
//! let mut upload = vec![bf16::ZERO; 1000];
//!
//! // One step: gradients un-scaled by a loss scale of 1024, bf16 weights written for the upload.
//! let step = optimizer.next_step(1.0 / 1024.0);
//! let state = AdamState { params: &mut params, exp_avg: &mut exp_avg, exp_avg_sq: &mut exp_avg_sq };
//! adam.step(&step, state, Grads::Bf16(&grads), Output::AlsoBf16(&mut upload))?;
//! assert!(params[0] < 1.0);
//! assert_eq!(upload[0], bf16::from_f32(params[0]));
//! # Ok::<(), zeroflow_optim::OptimError>(())
//! ```

mod config;
mod error;
mod executor;
mod kernels;
mod piece;
pub mod roofline;
pub mod rounding;
mod simd;
mod workload;

pub use config::{AdamW, AdamWConfig, AdamWStep, NoDecay, StepScalars, WeightDecayMode};
pub use error::OptimError;
pub use executor::{AdamState, CHUNK_ALIGN, CpuAdam, Grads, Output, Saved, Stores};
pub use half::bf16;
pub use piece::MomentElem;
pub use simd::{SimdLevel, UnknownSimdLevel};
pub use workload::{GradDtype, SaveBuffers, Timings, Workload, measure};
pub use zeroflow_core::adamw::OptimizerStateDtype;
