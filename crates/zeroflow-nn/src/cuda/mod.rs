//! A plan on an NVIDIA GPU: [`CudaRunner`], the twin of [`crate::cpu::CpuRunner`] for the engine.
//!
//! It walks the family's [`Plan`] (so the ranges, the order of the launches and the
//! [`GradsReady`] notices are single-sourced), through a [`schedule::Schedule`] that places the
//! plan's ranges in GPU buffers, fuses a matmul with a GELU after it (forward and backward), and
//! lets the first write of each activation gradient overwrite it. Storage is bf16 (parameters,
//! gradients, activations, activation gradients); every kernel and matmul accumulates in f32, and
//! the activations the plan lists as f32 (norm statistics, losses) are kept in f32.
//!
//! Matmuls go through cuBLASLt ([`Blas`]), attention through [`flash::FlashAttention`] or
//! [`attention::CudaAttention`] (as the plan's [`AttentionKind`] says), the shared kernels through
//! `kernels/*.cu` ([`kernels`]), and the family's own kernels through its [`CudaLayers`].
//! Everything is allocated and loaded in [`CudaRunner::new`]; forward and backward only queue work
//! on the compute stream and never wait for the GPU.
//!
//! A packed plan ([`crate::plan::PlanOptions::packed`]) takes its batches through
//! [`CudaRunner::set_packed_batch`]: each token's position in its document goes up beside the
//! token ids, and the launches that read it ([`crate::plan::Buf::Positions`]) run the packed forms
//! of the kernels (attention bounded by document, the position embedding and the rotation at each
//! token's position); a plan built without packing runs exactly the kernels it ran before.
//!
//! The two attentions differ in what they keep for backward ([`AttentionKind`]): `gemm` keeps
//! the softmax weights `att [B, NH, T, T]` of every layer as bf16 activations; `flash` keeps only
//! the log-sum-exp of each query row, `lse [B, NH, T]`, in f32 with the statistics, and recomputes
//! the weights in backward (head sizes 64 and 128 only). Both take multi-head and grouped-query
//! attention (`n_kv_head` a divisor of `n_head`; multi-head runs the same products and kernels as
//! before grouped-query attention came: a group of one).
//!
//! Gradients of parameters are added deterministically: weight gradients by cuBLASLt with
//! `beta = 1`, bias gradients by column sums in two fixed-order steps in f32 (then added to the
//! bf16 gradient once), the token embedding's by buckets of equal tokens sorted on the host, the
//! position embedding's by one thread per element. The shared kernels use no atomics
//! (FlashAttention's included), so with cuBLASLt's algorithms fixed (they are picked once per
//! problem) the same batch gives the same bits.

pub mod attention;
mod attention_shape;
pub mod cached;
pub mod decode;
mod exec;
pub mod flash;
pub mod kernels;
pub mod schedule;
mod tokens;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::{CudaBuffer, CudaStream};
use zeroflow_device::{CudaDevice, Device, DeviceBuffer, HostBuffer, HostMemory, StreamKind};

use self::attention::CudaAttention;
pub use self::exec::LayerCtx;
use self::flash::FlashAttention;
use self::kernels::{NnKernels, chunks_for};
use self::schedule::{BackwardOp, OpKind, Place, Schedule, Space};
pub use self::tokens::Tokens;
use crate::error::NnError;
use crate::kernels::{AttentionShape, Kernel, LayerKernel, NoLayers};
use crate::plan::{AttentionKind, GradsReady, Plan, open_before};

/// What the CUDA executor must know of a family's kernel without a GPU.
pub trait CudaLayerKernel: LayerKernel {
    /// Elements of the f32 column-sum partials ([`LayerCtx::column_partials`]) this launch needs,
    /// given the lengths of its places; 0 if it sums no columns.
    fn column_partials_len(&self, args: &[Place]) -> usize {
        let _ = args;
        0
    }
}

impl CudaLayerKernel for NoLayers {}

/// A family's own kernels on the GPU, loaded once.
pub trait CudaLayers<X>: fmt::Debug + Send {
    /// Queues `kernel` with its places (`args`, in the order the kernel documents) on the
    /// compute stream.
    fn run(&self, ctx: &LayerCtx<'_>, kernel: &X, args: &[Place]) -> Result<(), NnError>;
}

/// The kernels of a family without kernels of its own.
impl CudaLayers<NoLayers> for () {
    fn run(&self, _: &LayerCtx<'_>, kernel: &NoLayers, _: &[Place]) -> Result<(), NnError> {
        match *kernel {}
    }
}

/// A plan for one (batch, seq) whose activations live on a GPU. The engine owns the flat bf16
/// parameter and gradient buffers and passes them to each call.
#[derive(Debug)]
pub struct CudaRunner<X, L> {
    device: CudaDevice,
    padded_len: usize,
    plan: Plan<X>,
    schedule: Schedule<X>,
    kernels: NnKernels,
    layers: L,
    blas: Arc<Blas>,
    attention: Attentions,
    acts: CudaBuffer<bf16>,
    act_grads: CudaBuffer<bf16>,
    stats: CudaBuffer<f32>,
    /// The first step's partial sums of the column sums (bias and norm gradients).
    column_partials: CudaBuffer<f32>,
    tokens: Tokens,
    loss_host: HostBuffer<f32>,
}

/// The attention of every layer, as the plan's launches say.
#[derive(Debug)]
#[allow(clippy::large_enum_variant, reason = "one per model, made once")]
enum Attentions {
    None,
    Gemm(CudaAttention),
    Flash(FlashAttention),
}

/// The attention the plan's launches use, with its shape (every layer's must be the same).
fn plan_attention<X: LayerKernel>(
    plan: &Plan<X>,
) -> Result<Option<(AttentionKind, AttentionShape)>, NnError> {
    let mut found = None;
    for launch in plan.launches() {
        let this = match launch.kernel {
            Kernel::Attention(shape) | Kernel::AttentionBackward(shape) => {
                (AttentionKind::Gemm, shape)
            }
            Kernel::FlashAttention(shape) | Kernel::FlashAttentionBackward(shape) => {
                (AttentionKind::Flash, shape)
            }
            _ => continue,
        };
        match found {
            None => found = Some(this),
            Some(first) if first == this => {}
            Some(first) => {
                return Err(NnError::Batch(format!(
                    "the plan's attentions differ ({first:?} and {this:?}); the CUDA executor \
                     runs one kind and shape for every layer"
                )));
            }
        }
    }
    Ok(found)
}

impl Attentions {
    fn new(
        device: &CudaDevice,
        blas: &Arc<Blas>,
        batch: usize,
        attention: Option<(AttentionKind, AttentionShape)>,
    ) -> Result<Self, NnError> {
        Ok(match attention {
            None => Attentions::None,
            Some((AttentionKind::Gemm, shape)) => {
                Attentions::Gemm(CudaAttention::new(device, blas.clone(), batch, shape)?)
            }
            Some((AttentionKind::Flash, shape)) => {
                Attentions::Flash(FlashAttention::new(device, batch, shape)?)
            }
        })
    }

    fn scratch_bytes(&self) -> usize {
        match self {
            Attentions::None => 0,
            Attentions::Gemm(attention) => attention.scratch_bytes(),
            Attentions::Flash(flash) => flash.scratch_bytes(),
        }
    }
}

/// The GPU memory a [`CudaRunner`] holds, in bytes (the parameters and gradients are the engine's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationMemory {
    /// bf16 activations kept from forward for backward: the attention weights of every layer with
    /// gemm attention; a bf16 slot (unused) for each f32 statistic.
    pub activations: usize,
    /// bf16 activation gradients, packed by liveness.
    pub activation_grads: usize,
    /// f32 statistics, losses and, with flash attention, the lse of every layer.
    pub stats: usize,
    /// Scratch: attention's (gemm: head-major tensors and scores; flash: delta), column-sum
    /// partials, token ids.
    pub scratch: usize,
}

impl ActivationMemory {
    pub fn total(&self) -> usize {
        self.activations + self.activation_grads + self.stats + self.scratch
    }

    /// The memory a [`CudaRunner`] of `plan` holds, computed without a GPU (what
    /// [`CudaRunner::activation_memory`] reports once it is built).
    pub fn planned<X: CudaLayerKernel>(plan: &Plan<X>, fuse_gelu: bool) -> Result<Self, NnError> {
        let schedule = Schedule::new(plan, fuse_gelu)?;
        let attention_scratch = match plan_attention(plan)? {
            None => 0,
            Some((AttentionKind::Gemm, shape)) => {
                CudaAttention::scratch_bytes_for(plan.batch, shape)
            }
            Some((AttentionKind::Flash, AttentionShape { t, n_head, .. })) => {
                FlashAttention::scratch_bytes_for(plan.batch, t, n_head)
            }
        };
        Ok(ActivationMemory {
            activations: schedule.acts_len * size_of::<bf16>(),
            activation_grads: schedule.act_grads_len * size_of::<bf16>(),
            stats: schedule.stats_len * size_of::<f32>(),
            scratch: attention_scratch
                + column_partials_len(&schedule) * size_of::<f32>()
                + Tokens::bytes_for(plan.tokens(), plan.is_packed()),
        })
    }
}

impl<X: CudaLayerKernel, L: CudaLayers<X>> CudaRunner<X, L> {
    /// Loads the shared kernels, makes the attention and allocates everything forward and
    /// backward of `plan` use; `layers` runs the family's own kernels, `blas` the matmuls (shared
    /// with other users of the compute stream). The flat parameter and gradient buffers have
    /// `padded_len` elements.
    pub fn new(
        device: &CudaDevice,
        blas: Arc<Blas>,
        plan: Plan<X>,
        padded_len: usize,
        fuse_gelu: bool,
        layers: L,
    ) -> Result<Self, NnError> {
        let attention = plan_attention(&plan)?;
        let schedule = Schedule::new(&plan, fuse_gelu)?;
        let attention = Attentions::new(device, &blas, plan.batch, attention)?;
        let partials = column_partials_len(&schedule);
        Ok(CudaRunner {
            kernels: NnKernels::load(device)?,
            acts: device.alloc(schedule.acts_len)?,
            act_grads: device.alloc(schedule.act_grads_len)?,
            stats: device.alloc(schedule.stats_len)?,
            column_partials: device.alloc(partials)?,
            tokens: Tokens::new(device, plan.tokens(), plan.is_packed())?,
            loss_host: device.alloc_host(1, HostMemory::Pinned)?,
            device: device.clone(),
            padded_len,
            plan,
            schedule,
            layers,
            blas,
            attention,
        })
    }

    pub fn plan(&self) -> &Plan<X> {
        &self.plan
    }

    /// The family's kernels this runner was made with.
    pub fn layers(&self) -> &L {
        &self.layers
    }

    /// The attention every layer uses (`None` for a plan without attention).
    pub fn attention(&self) -> Option<AttentionKind> {
        match self.attention {
            Attentions::None => None,
            Attentions::Gemm(_) => Some(AttentionKind::Gemm),
            Attentions::Flash(_) => Some(AttentionKind::Flash),
        }
    }

    /// The GPU memory this runner holds besides the engine's parameters and gradients.
    pub fn activation_memory(&self) -> ActivationMemory {
        let bf16_bytes = size_of::<bf16>();
        ActivationMemory {
            activations: self.acts.len() * bf16_bytes,
            activation_grads: self.act_grads.len() * bf16_bytes,
            stats: self.stats.len() * size_of::<f32>(),
            scratch: self.attention.scratch_bytes()
                + self.column_partials.len() * size_of::<f32>()
                + self.tokens.bytes(),
        }
    }

    /// Checks a micro-batch (`[batch, seq]` inputs and targets, ids below `vocab`) and queues its
    /// upload on the compute stream. Does not wait for the GPU.
    pub fn set_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        vocab: usize,
    ) -> Result<(), NnError> {
        self.plan.check_positions(None)?;
        let compute = self.device.stream(StreamKind::Compute);
        self.tokens.set(&self.device, compute, (inputs, targets), None, vocab)
    }

    /// [`CudaRunner::set_batch`] of packed rows (a plan built with
    /// [`crate::plan::PlanOptions::packed`]): `positions [batch, seq]`, each token's position in
    /// its document (checked: [`Plan::check_positions`]), uploaded with the tokens.
    pub fn set_packed_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
        vocab: usize,
    ) -> Result<(), NnError> {
        self.plan.check_positions(Some(positions))?;
        let compute = self.device.stream(StreamKind::Compute);
        self.tokens.set(&self.device, compute, (inputs, targets), Some(positions), vocab)
    }

    /// Queues forward on the compute stream.
    pub fn forward(&mut self, params: &CudaBuffer<bf16>) -> Result<(), NnError> {
        self.forward_opening(params, &mut |_| {})
    }

    /// [`CudaRunner::forward`], telling `open(end)` before queuing the first operation that reads
    /// flat weights below `end` (growing through the forward), and `open(usize::MAX)` once the
    /// forward is queued: where the weights are still being uploaded, the caller makes the
    /// compute stream wait for those below `end` (the engine's `ModelIo::open`).
    pub fn forward_opening(
        &mut self,
        params: &CudaBuffer<bf16>,
        open: &mut dyn FnMut(usize),
    ) -> Result<(), NnError> {
        self.check_flat("parameter buffer", params)?;
        let mut opened = 0;
        for op in &self.schedule.forward {
            let params_end = op.args.iter().filter(|p| p.space == Space::Params);
            open_before(&mut opened, params_end.map(Place::end).max(), open);
            self.run(op, params, None, 1.0)?;
        }
        open(usize::MAX);
        Ok(())
    }

    /// Waits for the last forward and returns its mean loss (copied out on the compute stream).
    pub fn loss(&mut self) -> Result<f32, NnError> {
        // On the compute stream, which wrote it: four bytes, which must not queue behind the
        // engine's bulk copies on the d2h stream.
        let compute = self.device.stream(StreamKind::Compute);
        let at = self.schedule.loss_offset;
        let filled = self
            .device
            .copy_d2h(compute, &self.stats, at..at + 1, &mut self.loss_host, 0)?
            .wait()?;
        Ok(filled[0])
    }

    /// Queues backward on the compute stream: adds the gradient of `loss_scale` × (the last
    /// forward's mean loss) to `grads`. Right after the launches that complete a group of
    /// parameter gradients are queued, `on_ready` is told (in backward order), so the caller can
    /// record an event and start reducing or offloading that range while the rest runs.
    pub fn backward(
        &mut self,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
        loss_scale: f64,
        mut on_ready: impl FnMut(&GradsReady),
    ) -> Result<(), NnError> {
        self.check_flat("parameter buffer", params)?;
        self.check_flat("gradient buffer", grads)?;
        for step in &self.schedule.backward {
            match step {
                BackwardOp::Op(op) => self.run(op, params, Some(grads), loss_scale)?,
                BackwardOp::Ready(ready) => on_ready(ready),
            }
        }
        Ok(())
    }

    /// Runs forward and backward once more on the last batch, waiting for the GPU after each
    /// operation, and returns the time each kind of operation took, summed, in first-run order
    /// (for benchmarks: the waits add a launch latency to every operation). `grads` is added to.
    pub fn profile(
        &mut self,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
    ) -> Result<Vec<(String, Duration)>, NnError> {
        self.check_flat("parameter buffer", params)?;
        self.check_flat("gradient buffer", grads)?;
        self.device.synchronize()?;
        let mut times: Vec<(String, Duration)> = Vec::new();
        let forward = self.schedule.forward.iter().map(|op| (op, None));
        let backward = self.schedule.backward.iter().filter_map(|step| match step {
            BackwardOp::Op(op) => Some((op, Some(grads))),
            BackwardOp::Ready(_) => None,
        });
        for (op, grads) in forward.chain(backward) {
            let started = Instant::now();
            self.run(op, params, grads, 1.0)?;
            self.device.synchronize()?;
            let name = op.name();
            match times.iter_mut().find(|(n, _)| *n == name) {
                Some((_, total)) => *total += started.elapsed(),
                None => times.push((name, started.elapsed())),
            }
        }
        Ok(times)
    }

    /// Elements `range` of the activations of the last forward, widened to f32. Waits for the
    /// GPU: for tests and tools, not for the training loop.
    pub fn download_activations(&self, range: std::ops::Range<usize>) -> Result<Vec<f32>, NnError> {
        let mut host = self.device.alloc_host::<bf16>(range.len(), HostMemory::Pageable)?;
        self.device.synchronize()?;
        let d2h = self.device.stream(StreamKind::D2h);
        let filled = self.device.copy_d2h(d2h, &self.acts, range, &mut host, 0)?.wait()?;
        Ok(filled.iter().map(|x| x.to_f32()).collect())
    }

    fn compute(&self) -> &CudaStream {
        self.device.stream(StreamKind::Compute)
    }

    /// The gemm attention, for the plan's `Attention` launches.
    fn gemm_attention(&self) -> &CudaAttention {
        match &self.attention {
            Attentions::Gemm(attention) => attention,
            _ => unreachable!("only a gemm plan has gemm attention launches"),
        }
    }

    /// The flash attention, for the plan's `FlashAttention` launches.
    fn flash_attention(&self) -> &FlashAttention {
        match &self.attention {
            Attentions::Flash(flash) => flash,
            _ => unreachable!("only a flash plan has flash attention launches"),
        }
    }

    fn check_flat(&self, what: &'static str, buffer: &CudaBuffer<bf16>) -> Result<(), NnError> {
        if buffer.len() == self.padded_len {
            Ok(())
        } else {
            Err(NnError::Length { what, expected: self.padded_len, found: buffer.len() })
        }
    }
}

/// Elements of the column-sum partials the widest column sum of `schedule` needs: the bias
/// gradients of its matmuls and what the family's kernels ask for.
fn column_partials_len<X: CudaLayerKernel>(schedule: &Schedule<X>) -> usize {
    schedule
        .ops()
        .map(|op| match &op.kind {
            OpKind::Kernel(Kernel::Layer(kernel)) => kernel.column_partials_len(&op.args),
            &OpKind::Kernel(Kernel::MatmulBackward { oc, bias: true, .. })
            | &OpKind::MatmulBackwardDGelu { oc, bias: true, .. } => {
                // The output gradient (dout) follows dinp, dweight and dbias.
                chunks_for(op.args[3].len / oc) * oc
            }
            _ => 0,
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::{CudaRunner, plan_attention};
    use crate::kernels::{AttentionShape, Kernel, NoLayers};
    use crate::plan::{AttentionKind, Launch, Plan, Step};

    /// The engine may run each rank's model on a thread of its own.
    #[test]
    fn the_runner_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<CudaRunner<NoLayers, ()>>();
    }

    /// A plan with grouped-query attention is taken (the CUDA attentions run it), with its shape;
    /// the plan's attentions must still agree on one kind and shape.
    #[test]
    fn the_cuda_executor_takes_grouped_query_attention_of_one_shape() {
        let gqa = AttentionShape { t: 16, c: 64, n_head: 4, n_kv_head: 2 };
        let launch = |kernel| Launch { kernel, args: Vec::new() };
        let plan = |forward| Plan::<NoLayers> {
            batch: 2,
            seq: 16,
            acts_len: 0,
            forward,
            backward: vec![Step::Launch(launch(Kernel::FlashAttentionBackward(gqa)))],
            loss: 0..1,
            f32_acts: Vec::new(),
        };
        let taken = plan_attention(&plan(vec![launch(Kernel::FlashAttention(gqa))])).unwrap();
        assert_eq!(taken, Some((AttentionKind::Flash, gqa)));
        let mixed = plan(vec![launch(Kernel::Attention(gqa))]);
        let message = plan_attention(&mixed).unwrap_err().to_string();
        assert!(message.contains("the plan's attentions differ"), "{message}");
    }
}
