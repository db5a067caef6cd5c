//! The GPT model on an NVIDIA GPU: [`CudaGpt`], the twin of [`crate::CpuGpt`] for the engine.
//!
//! It walks the same [`Plan`] (so the ranges, the order of the launches and the
//! [`GradsReady`] notices are single-sourced), through a [`schedule::Schedule`] that places the
//! plan's ranges in GPU buffers, fuses the fc matmul with its GELU (forward and backward), and
//! lets the first write of each activation gradient overwrite it. Storage is bf16 (parameters,
//! gradients, activations, activation gradients); every kernel and matmul accumulates in f32, and
//! the LayerNorm statistics and the losses are kept in f32.
//!
//! Matmuls go through cuBLASLt ([`Blas`]), attention through [`flash::FlashAttention`] where its
//! kernels take the head size or else (or with `ZEROFLOW_ATTENTION=gemm`, [`ATTENTION_VAR`])
//! through [`attention::CudaAttention`], the rest
//! through the kernels of `kernels/*.cu` ([`kernels`]). Everything is allocated and loaded in
//! [`CudaGpt::new`]; forward and backward only queue work on the compute stream and never wait
//! for the GPU.
//!
//! The two attentions differ in what they keep for backward ([`AttentionKind`]): `gemm` keeps
//! the softmax weights `att [B, NH, T, T]` of every layer as bf16 activations;
//! `flash` keeps only the log-sum-exp of each query row, `lse [B, NH, T]`, in f32 with the
//! LayerNorm statistics, and recomputes the weights in backward (head sizes 64 and 128 only).
//!
//! Gradients of parameters are added deterministically: weight gradients by cuBLASLt with
//! `beta = 1`, bias and LayerNorm gradients by column sums in two fixed-order steps in f32 (then
//! added to the bf16 gradient once), the token embedding's by buckets of equal tokens sorted on
//! the host, the position embedding's by one thread per element. The model's kernels use no
//! atomics (FlashAttention's included), so with cuBLASLt's algorithms fixed (they are picked once
//! per problem) the same batch gives the same bits.

pub mod attention;
mod exec;
pub mod flash;
pub mod kernels;
pub mod schedule;
mod tokens;

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use zeroflow_core::bf16;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::{CudaBuffer, CudaStream};
use zeroflow_device::{CudaDevice, Device, DeviceBuffer, HostBuffer, HostMemory, StreamKind};

use self::attention::CudaAttention;
use self::flash::FlashAttention;
use self::kernels::{GptKernels, chunks_for};
use self::schedule::{BackwardOp, OpKind, Schedule};
use self::tokens::Tokens;
use crate::GptConfig;
use crate::error::GptError;
use crate::kernels::Kernel;
use crate::params::{GradsReady, ParamRanges};
use crate::plan::{AttentionKind, Plan};

/// The environment variable that picks the model's attention when it is built: `auto` (the
/// default; unset or blank too: `flash` where its kernels take the model, `gemm` otherwise),
/// `flash` or `gemm`. See [`attention_from_env`].
pub const ATTENTION_VAR: &str = "ZEROFLOW_ATTENTION";

/// A model for one (batch, seq) whose activations live on a GPU. The engine owns the flat bf16
/// parameter and gradient buffers and passes them to each call.
#[derive(Debug)]
pub struct CudaGpt {
    device: CudaDevice,
    config: GptConfig,
    padded_len: usize,
    plan: Plan,
    schedule: Schedule,
    kernels: GptKernels,
    blas: Arc<Blas>,
    attention: ModelAttention,
    acts: CudaBuffer<bf16>,
    act_grads: CudaBuffer<bf16>,
    stats: CudaBuffer<f32>,
    /// The first step's partial sums of the column sums (bias and LayerNorm gradients).
    column_partials: CudaBuffer<f32>,
    tokens: Tokens,
    loss_host: HostBuffer<f32>,
}

/// The attention of every layer, as the plan's [`AttentionKind`] says.
#[derive(Debug)]
#[allow(clippy::large_enum_variant, reason = "one per model, made once")]
enum ModelAttention {
    Gemm(CudaAttention),
    Flash(FlashAttention),
}

impl ModelAttention {
    /// The attention `kind` for micro-batches of `batch` sequences of `seq` tokens (the head size
    /// checked already); says once per process, at info level, when it is flash.
    fn new(
        device: &CudaDevice,
        blas: &Arc<Blas>,
        config: &GptConfig,
        (batch, seq): (usize, usize),
        kind: AttentionKind,
    ) -> Result<Self, GptError> {
        let (c, n_head) = (config.d_model, config.n_head);
        Ok(match kind {
            AttentionKind::Gemm => {
                let attention = CudaAttention::new(device, blas.clone(), batch, seq, c, n_head)?;
                ModelAttention::Gemm(attention)
            }
            AttentionKind::Flash => {
                let flash = FlashAttention::new(device, batch, seq, c, n_head)?;
                static ANNOUNCED: Once = Once::new();
                ANNOUNCED.call_once(|| {
                    tracing::info!(
                        "attention: FlashAttention-2 kernels, keeping the log-sum-exp of each \
                         query row for backward instead of the attention weights \
                         ({ATTENTION_VAR}=gemm for the cuBLASLt products)"
                    );
                });
                ModelAttention::Flash(flash)
            }
        })
    }
}

/// The GPU memory a [`CudaGpt`] holds, in bytes (the parameters and gradients are the engine's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationMemory {
    /// bf16 activations kept from forward for backward: the attention weights of every layer with
    /// gemm attention; a bf16 slot (unused) for each f32 statistic.
    pub activations: usize,
    /// bf16 activation gradients, packed by liveness.
    pub activation_grads: usize,
    /// f32 LayerNorm statistics, losses and, with flash attention, the lse of every layer.
    pub stats: usize,
    /// Scratch: attention's (gemm: head-major tensors and scores; flash: delta), column-sum
    /// partials, token ids.
    pub scratch: usize,
}

/// Choices of [`CudaGpt::with_options`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaGptOptions {
    /// Fuse GELU into the fc matmul's cuBLASLt epilogues, forward (`BiasGelu`) and backward
    /// (`DGelu`), where the width is a multiple of 8. On by default; off runs the GELU kernels
    /// (for comparisons).
    pub fuse_gelu: bool,
    /// How attention keeps what its backward needs ([`AttentionKind`]; `Gemm` in `default()`,
    /// which takes any model; [`CudaGptOptions::for_model`] picks `Flash` where it can).
    /// [`AttentionKind::Flash`] needs a head size of 64 or 128 ([`flash::HEAD_SIZES`]).
    pub attention: AttentionKind,
}

impl Default for CudaGptOptions {
    fn default() -> Self {
        CudaGptOptions { fuse_gelu: true, attention: AttentionKind::Gemm }
    }
}

impl CudaGptOptions {
    /// The defaults, with the attention `ZEROFLOW_ATTENTION` asks for ([`attention_from_env`])
    /// or, where it asks for none, the fastest that takes `config` ([`auto_attention`]).
    pub fn for_model(config: &GptConfig) -> Result<Self, GptError> {
        let attention = attention_from_env()?.unwrap_or_else(|| auto_attention(config));
        Ok(CudaGptOptions { attention, ..CudaGptOptions::default() })
    }
}

impl ActivationMemory {
    pub fn total(&self) -> usize {
        self.activations + self.activation_grads + self.stats + self.scratch
    }

    /// The memory a [`CudaGpt::with_options`] of these arguments holds, computed without a GPU
    /// (what [`CudaGpt::activation_memory`] reports once it is built).
    pub fn planned(
        config: &GptConfig,
        layout: &FlatLayout,
        (batch, seq): (usize, usize),
        options: CudaGptOptions,
    ) -> Result<Self, GptError> {
        let attention = options.attention;
        let params = ParamRanges::new(config, layout)?;
        let plan = Plan::with_attention(config, &params, batch, seq, attention)?;
        let schedule = Schedule::new(&plan, options.fuse_gelu)?;
        let (c, n_head) = (config.d_model, config.n_head);
        let attention_scratch = match attention {
            AttentionKind::Gemm => CudaAttention::scratch_bytes_for(batch, seq, c, n_head),
            AttentionKind::Flash => FlashAttention::scratch_bytes_for(batch, seq, n_head),
        };
        Ok(ActivationMemory {
            activations: schedule.acts_len * size_of::<bf16>(),
            activation_grads: schedule.act_grads_len * size_of::<bf16>(),
            stats: schedule.stats_len * size_of::<f32>(),
            scratch: attention_scratch
                + column_partials_len(&schedule) * size_of::<f32>()
                + Tokens::bytes_for(plan.tokens()),
        })
    }
}

/// The attention `ZEROFLOW_ATTENTION` ([`ATTENTION_VAR`]) asks for: `None` where it is unset,
/// blank or `auto`, or the error [`parse_attention`] gives.
pub fn attention_from_env() -> Result<Option<AttentionKind>, GptError> {
    parse_attention(zeroflow_core::env::var(ATTENTION_VAR).as_deref())
}

/// The attention a value of `ZEROFLOW_ATTENTION` asks for: none (`None`, blank or `auto`: the
/// model's choice, [`auto_attention`]), `gemm` or `flash`, spaces and case ignored; anything else
/// is an error naming the variable and the accepted values.
pub fn parse_attention(value: Option<&str>) -> Result<Option<AttentionKind>, GptError> {
    let kinds = [
        ("auto", None),
        ("gemm", Some(AttentionKind::Gemm)),
        ("flash", Some(AttentionKind::Flash)),
    ];
    zeroflow_core::env::choice(value, &kinds).map(Option::flatten).map_err(|value| {
        GptError::InvalidConfig(format!(
            "{ATTENTION_VAR}={value:?} is not `auto` (the default: `flash` where the model's head \
             size has kernels, `gemm` otherwise), `flash` (FlashAttention-2 kernels, head sizes \
             {:?}) or `gemm` (cuBLASLt products, the attention weights kept for backward)",
            flash::HEAD_SIZES
        ))
    })
}

/// The attention a model gets unless `ZEROFLOW_ATTENTION` says otherwise: flash where its kernels
/// take the head size (faster and smaller on the H200: gpt-1.3b at micro-batch 8 × 1024 trains
/// 6 % faster in 6.4 GiB less memory, BENCHMARKS.md), gemm otherwise.
pub fn auto_attention(config: &GptConfig) -> AttentionKind {
    match check_attention_fits(config, AttentionKind::Flash) {
        Ok(()) => AttentionKind::Flash,
        Err(_) => AttentionKind::Gemm,
    }
}

/// An error unless `attention` can run `config`: flash attention has kernels for head sizes 64
/// and 128 only ([`flash::HEAD_SIZES`]).
fn check_attention_fits(config: &GptConfig, attention: AttentionKind) -> Result<(), GptError> {
    let head_size = config.d_model / config.n_head;
    if attention == AttentionKind::Gemm || flash::HEAD_SIZES.contains(&head_size) {
        return Ok(());
    }
    Err(GptError::InvalidConfig(format!(
        "{ATTENTION_VAR}=flash: the flash kernels take head sizes {:?}, and this model's is \
         {head_size} (d_model {} / {} heads); use {ATTENTION_VAR}=gemm (or leave it unset) for \
         this model",
        flash::HEAD_SIZES,
        config.d_model,
        config.n_head
    )))
}

impl CudaGpt {
    /// Loads the kernels, creates a cuBLASLt handle and allocates everything forward and backward
    /// use, for micro-batches of `batch` sequences of `seq` tokens.
    pub fn new(
        device: &CudaDevice,
        config: &GptConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
    ) -> Result<Self, GptError> {
        let blas = Arc::new(Blas::new(device)?);
        let options = CudaGptOptions::for_model(config)?;
        Self::with_options(device, blas, config, layout, batch, seq, options)
    }

    /// [`CudaGpt::new`] with a cuBLASLt handle shared with other users of the compute stream,
    /// and the options given (the attention among them: not read from the environment).
    pub fn with_options(
        device: &CudaDevice,
        blas: Arc<Blas>,
        config: &GptConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        options: CudaGptOptions,
    ) -> Result<Self, GptError> {
        let attention = options.attention;
        check_attention_fits(config, attention)?;
        let params = ParamRanges::new(config, layout)?;
        let plan = Plan::with_attention(config, &params, batch, seq, attention)?;
        let widest = [plan.tokens(), config.padded_vocab_size(), 4 * config.d_model];
        if widest.iter().any(|&size| u32::try_from(size + 1).is_err()) {
            return Err(GptError::Batch(format!(
                "batch {batch} × seq {seq} with width {} and vocabulary {}: the kernels index \
                 rows and columns with 32 bits",
                config.d_model,
                config.padded_vocab_size()
            )));
        }
        let schedule = Schedule::new(&plan, options.fuse_gelu)?;
        let attention = ModelAttention::new(device, &blas, config, (batch, seq), attention)?;
        let partials = column_partials_len(&schedule);
        Ok(CudaGpt {
            kernels: GptKernels::load(device)?,
            acts: device.alloc(schedule.acts_len)?,
            act_grads: device.alloc(schedule.act_grads_len)?,
            stats: device.alloc(schedule.stats_len)?,
            column_partials: device.alloc(partials)?,
            tokens: Tokens::new(device, plan.tokens())?,
            loss_host: device.alloc_host(1, HostMemory::Pinned)?,
            device: device.clone(),
            config: *config,
            padded_len: layout.padded_len(),
            plan,
            schedule,
            blas,
            attention,
        })
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The attention every layer uses.
    pub fn attention(&self) -> AttentionKind {
        match self.attention {
            ModelAttention::Gemm(_) => AttentionKind::Gemm,
            ModelAttention::Flash(_) => AttentionKind::Flash,
        }
    }

    /// The GPU memory this model holds besides the engine's parameters and gradients.
    pub fn activation_memory(&self) -> ActivationMemory {
        let bf16_bytes = size_of::<bf16>();
        ActivationMemory {
            activations: self.acts.len() * bf16_bytes,
            activation_grads: self.act_grads.len() * bf16_bytes,
            stats: self.stats.len() * size_of::<f32>(),
            scratch: self.attention_scratch_bytes()
                + self.column_partials.len() * size_of::<f32>()
                + self.tokens.bytes(),
        }
    }

    /// [`ActivationMemory::total`]: every byte of GPU memory the model holds.
    pub fn activation_bytes(&self) -> usize {
        self.activation_memory().total()
    }

    /// Checks a micro-batch (`[batch, seq]` inputs and targets, ids below the vocabulary) and
    /// queues its upload on the compute stream. Does not wait for the GPU.
    pub fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), GptError> {
        let compute = self.device.stream(StreamKind::Compute);
        let vocab = self.config.vocab_size;
        self.tokens.set(&self.device, compute, inputs, targets, vocab)
    }

    /// Queues forward on the compute stream.
    pub fn forward(&mut self, params: &CudaBuffer<bf16>) -> Result<(), GptError> {
        self.check_flat("parameter buffer", params)?;
        for op in &self.schedule.forward {
            self.run(op, params, None, 1.0)?;
        }
        Ok(())
    }

    /// Waits for the last forward and returns its mean loss (copied out on the compute stream).
    pub fn loss(&mut self) -> Result<f32, GptError> {
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
    ) -> Result<(), GptError> {
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
    ) -> Result<Vec<(String, Duration)>, GptError> {
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

    /// The logits of the last forward, `[batch, seq, padded_vocab]`. Waits for the GPU: for tests
    /// and tools, not for the training loop.
    pub fn logits(&self) -> Result<Vec<f32>, GptError> {
        let range = self.plan.acts.logits.clone();
        let mut host = self.device.alloc_host::<bf16>(range.len(), HostMemory::Pageable)?;
        self.device.synchronize()?;
        let d2h = self.device.stream(StreamKind::D2h);
        let filled = self.device.copy_d2h(d2h, &self.acts, range, &mut host, 0)?.wait()?;
        Ok(filled.iter().map(|x| x.to_f32()).collect())
    }

    fn compute(&self) -> &CudaStream {
        self.device.stream(StreamKind::Compute)
    }

    fn attention_scratch_bytes(&self) -> usize {
        match &self.attention {
            ModelAttention::Gemm(attention) => attention.scratch_bytes(),
            ModelAttention::Flash(flash) => flash.scratch_bytes(),
        }
    }

    /// The gemm attention, for the plan's `Attention` launches.
    fn gemm_attention(&self) -> &CudaAttention {
        match &self.attention {
            ModelAttention::Gemm(attention) => attention,
            ModelAttention::Flash(_) => unreachable!("a flash model's plan has no gemm attention"),
        }
    }

    /// The flash attention, for the plan's `FlashAttention` launches.
    fn flash_attention(&self) -> &FlashAttention {
        match &self.attention {
            ModelAttention::Flash(flash) => flash,
            ModelAttention::Gemm(_) => unreachable!("a gemm model's plan has no flash attention"),
        }
    }

    fn check_flat(&self, what: &'static str, buffer: &CudaBuffer<bf16>) -> Result<(), GptError> {
        if buffer.len() == self.padded_len {
            Ok(())
        } else {
            Err(GptError::Length { what, expected: self.padded_len, found: buffer.len() })
        }
    }
}

/// Bytes of the GPU's memory in use now, by every process and context (`cuMemGetInfo`): the
/// model allocates everything up front, so after a step this is the peak. For reports.
pub fn device_memory_in_use(device: &CudaDevice) -> Result<usize, GptError> {
    let failed = |e: cudarc::driver::DriverError| GptError::Kernel {
        kernel: "cuMemGetInfo",
        reason: e.to_string(),
    };
    device.context().bind_to_thread().map_err(failed)?;
    let (free, total) = cudarc::driver::result::mem_get_info().map_err(failed)?;
    Ok(total - free)
}

/// Elements of the column-sum partials the widest column sum of `schedule` needs.
fn column_partials_len(schedule: &Schedule) -> usize {
    schedule
        .ops()
        .map(|op| match op.kind {
            OpKind::Kernel(Kernel::LayerNormBackward { c }) => {
                chunks_for(op.args[0].len / c) * 2 * c
            }
            OpKind::Kernel(Kernel::MatmulBackward { oc, bias: true, .. })
            | OpKind::MatmulBackwardDGelu { oc, bias: true, .. } => {
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
    use super::{
        ActivationMemory, AttentionKind, CudaGptOptions, auto_attention, check_attention_fits,
        parse_attention,
    };
    use crate::{GptConfig, flat_layout};

    /// The engine may run each rank's model on a thread of its own.
    #[test]
    fn the_model_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<super::CudaGpt>();
    }

    #[test]
    fn zeroflow_attention_takes_auto_gemm_or_flash_and_names_itself_otherwise() {
        for (value, kind) in [
            (None, None),
            (Some(""), None),
            (Some(" Auto"), None),
            (Some(" gemm "), Some(AttentionKind::Gemm)),
            (Some("flash"), Some(AttentionKind::Flash)),
            (Some("FLASH"), Some(AttentionKind::Flash)),
        ] {
            assert_eq!(parse_attention(value).unwrap(), kind, "{value:?}");
        }
        let message = parse_attention(Some("flash2")).unwrap_err().to_string();
        for needed in ["ZEROFLOW_ATTENTION=\"flash2\"", "`auto`", "`gemm`", "`flash`"] {
            assert!(message.contains(needed), "{message}");
        }
    }

    /// Unless told otherwise, a model gets flash attention where its head size has kernels (the
    /// named sizes: 64 and 128) and gemm where it has not.
    #[test]
    fn auto_attention_is_flash_where_the_kernels_take_the_head_size() {
        for name in ["gpt2-124m", "gpt2-350m", "gpt-1.3b"] {
            let config = GptConfig::named(name).unwrap();
            assert_eq!(auto_attention(&config), AttentionKind::Flash, "{name}");
        }
        let odd = GptConfig { n_layer: 2, n_head: 4, d_model: 200, vocab_size: 301, context: 40 };
        assert_eq!(auto_attention(&odd), AttentionKind::Gemm);
    }

    /// Flash attention takes the named sizes' heads of 64 and 128, and no other; gemm any.
    #[test]
    fn flash_attention_refuses_head_sizes_it_has_no_kernels_for() {
        for name in ["gpt2-124m", "gpt-1.3b"] {
            let config = GptConfig::named(name).unwrap();
            assert!(check_attention_fits(&config, AttentionKind::Flash).is_ok(), "{name}");
        }
        let odd = GptConfig { n_layer: 2, n_head: 4, d_model: 200, vocab_size: 301, context: 40 };
        assert!(check_attention_fits(&odd, AttentionKind::Gemm).is_ok());
        let message = check_attention_fits(&odd, AttentionKind::Flash).unwrap_err().to_string();
        for needed in ["ZEROFLOW_ATTENTION=flash", "head sizes [64, 128]", "is 50", "=gemm"] {
            assert!(message.contains(needed), "{message}");
        }
    }

    /// gpt-1.3b at micro-batch 8 × 1024 tokens: flash attention holds, per layer, no bf16 weights
    /// `att [B, NH, T, T]` but a bf16 slot for the lse in the activation plan (unused: the lse
    /// lives in f32 with the statistics), an f32 lse `[B, NH, T]` with the statistics, and delta
    /// instead of CudaAttention's scratch. The activation gradients do not grow (here they are
    /// equal: the logits' gradient, not attention's, sets their peak).
    #[test]
    fn flash_attention_holds_the_log_sum_exp_instead_of_the_weights() {
        let config = GptConfig::named("gpt-1.3b").unwrap();
        let layout = flat_layout(&config, 1).unwrap();
        let (batch, seq) = (8, 1024);
        let planned = |attention| {
            let options = CudaGptOptions { attention, ..CudaGptOptions::default() };
            ActivationMemory::planned(&config, &layout, (batch, seq), options).unwrap()
        };
        let (gemm, flash) = (planned(AttentionKind::Gemm), planned(AttentionKind::Flash));
        let (layers, c) = (config.n_layer, config.d_model);
        let rows = batch * config.n_head * seq;
        let (att, lse) = (layers * rows * seq, layers * rows);
        assert_eq!(gemm.activations - flash.activations, (att - lse) * 2);
        assert_eq!(flash.stats - gemm.stats, lse * 4);
        let cuda_attention_scratch = (5 * batch * seq * c + rows * seq) * 2;
        assert_eq!(gemm.scratch - flash.scratch, cuda_attention_scratch - rows * 4);
        assert!(flash.activation_grads <= gemm.activation_grads);
        let gib = |bytes: usize| bytes as f64 / f64::from(1u32 << 30);
        for (name, memory) in [("gemm", gemm), ("flash", flash)] {
            println!(
                "gpt-1.3b B{batch} T{seq} {name}: activations {} ({:.2} GiB), activation grads {}, \
                 stats {}, scratch {}, total {} ({:.2} GiB)",
                memory.activations,
                gib(memory.activations),
                memory.activation_grads,
                memory.stats,
                memory.scratch,
                memory.total(),
                gib(memory.total())
            );
        }
    }
}
