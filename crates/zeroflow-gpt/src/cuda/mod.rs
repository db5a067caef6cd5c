//! GPT-2 on an NVIDIA GPU: [`CudaGpt`], the twin of [`crate::CpuGpt`] for the engine: its plan
//! run by zeroflow-nn's [`CudaRunner`] (bf16 storage with f32 accumulation, cuBLASLt matmuls with
//! GELU fused into the fc matmul's epilogues, gemm or flash attention, activation gradients packed
//! by liveness; see [`zeroflow_nn::cuda`]), with GPT-2's LayerNorm and GELU kernels
//! (`kernels/*.cu`, [`kernels`]).
//!
//! This module picks the attention: [`flash::FlashAttention`](zeroflow_nn::cuda::flash) where its
//! kernels take the head size, or else (or where its options ask for gemm: the binary's
//! `--attention`, `zeroflow.attention`, `ZEROFLOW_ATTENTION`)
//! [`attention::CudaAttention`](zeroflow_nn::cuda::attention).

pub mod decode;
pub mod kernels;

use std::sync::{Arc, Once};
use std::time::Duration;

use zeroflow_core::bf16;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::CudaDevice;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_nn::AttentionKind;
pub use zeroflow_nn::cuda::ActivationMemory;
use zeroflow_nn::cuda::{CudaRunner, flash};

use self::kernels::GptKernels;
use crate::GptConfig;
use crate::error::GptError;
use crate::kernels::GptKernel;
use crate::params::{GradsReady, ParamRanges};
use crate::plan::{ActLayout, GptPlan, Plan, PlanOptions};

/// A model for one (batch, seq) whose activations live on a GPU. The engine owns the flat bf16
/// parameter and gradient buffers and passes them to each call.
#[derive(Debug)]
pub struct CudaGpt {
    config: GptConfig,
    acts: ActLayout,
    runner: CudaRunner<GptKernel, GptKernels>,
}

/// The memory a [`CudaGpt::with_options`] of these arguments holds, computed without a GPU (what
/// [`CudaGpt::activation_memory`] reports once it is built).
pub fn planned_memory(
    config: &GptConfig,
    layout: &FlatLayout,
    (batch, seq): (usize, usize),
    options: CudaGptOptions,
) -> Result<ActivationMemory, GptError> {
    let params = ParamRanges::new(config, layout)?;
    let GptPlan { plan, .. } =
        GptPlan::with_options(config, &params, batch, seq, options.plan_options())?;
    Ok(ActivationMemory::planned(&plan, options.fuse_gelu)?)
}

/// Says once per process, at info level, that the model's attention is flash.
fn announce_flash() {
    static ANNOUNCED: Once = Once::new();
    ANNOUNCED.call_once(|| {
        tracing::info!(
            "attention: FlashAttention-2 kernels, keeping the log-sum-exp of each query row for \
             backward instead of the attention weights (attention gemm for the cuBLASLt \
             products)"
        );
    });
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
    /// Keep only each block's output from forward to backward and recompute the rest right
    /// before the block's backward ([`PlanOptions::activation_checkpointing`]): less activation
    /// memory for about one more forward of the blocks. Off by default.
    pub activation_checkpointing: bool,
    /// Sequence packing: several documents per row, batches through
    /// [`CudaGpt::set_packed_batch`] ([`PlanOptions::packed`]). Off by default.
    pub packed: bool,
}

impl Default for CudaGptOptions {
    fn default() -> Self {
        CudaGptOptions {
            fuse_gelu: true,
            attention: AttentionKind::Gemm,
            activation_checkpointing: false,
            packed: false,
        }
    }
}

impl CudaGptOptions {
    /// The defaults, with the attention `requested` (`None`: the fastest that takes `config`,
    /// [`auto_attention`]). Whether the attention takes the model is checked when it is built.
    pub fn for_model(config: &GptConfig, requested: Option<AttentionKind>) -> Self {
        let attention = requested.unwrap_or_else(|| auto_attention(config));
        CudaGptOptions { attention, ..CudaGptOptions::default() }
    }

    /// How the model's plan is built.
    pub fn plan_options(&self) -> PlanOptions {
        PlanOptions {
            attention: self.attention,
            activation_checkpointing: self.activation_checkpointing,
            packed: self.packed,
        }
    }
}

/// The attention a model gets unless its options ask for another: flash where its kernels
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
        "attention flash: the flash kernels take head sizes {:?}, and this model's is \
         {head_size} (d_model {} / {} heads); use attention gemm (or auto) for this model",
        flash::HEAD_SIZES,
        config.d_model,
        config.n_head
    )))
}

impl CudaGpt {
    /// Loads the kernels, creates a cuBLASLt handle and allocates everything forward and backward
    /// use, for micro-batches of `batch` sequences of `seq` tokens, with the attention that fits
    /// the model best ([`auto_attention`]).
    pub fn new(
        device: &CudaDevice,
        config: &GptConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
    ) -> Result<Self, GptError> {
        let blas = Arc::new(Blas::new(device)?);
        let options = CudaGptOptions::for_model(config, None);
        Self::with_options(device, blas, config, layout, batch, seq, options)
    }

    /// [`CudaGpt::new`] with a cuBLASLt handle shared with other users of the compute stream,
    /// and the options given (the attention among them).
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
        let GptPlan { acts, plan } =
            GptPlan::with_options(config, &params, batch, seq, options.plan_options())?;
        let widest = [plan.tokens(), config.padded_vocab_size(), 4 * config.d_model];
        if widest.iter().any(|&size| u32::try_from(size + 1).is_err()) {
            return Err(GptError::Batch(format!(
                "batch {batch} × seq {seq} with width {} and vocabulary {}: the kernels index \
                 rows and columns with 32 bits",
                config.d_model,
                config.padded_vocab_size()
            )));
        }
        let padded_len = layout.padded_len();
        let layers = GptKernels::load(device)?;
        let runner = CudaRunner::new(device, blas, plan, padded_len, options.fuse_gelu, layers)?;
        if attention == AttentionKind::Flash {
            announce_flash();
        }
        Ok(CudaGpt { config: *config, acts, runner })
    }

    pub fn config(&self) -> &GptConfig {
        &self.config
    }

    pub fn plan(&self) -> &Plan {
        self.runner.plan()
    }

    /// Where the activations lie.
    pub fn acts(&self) -> &ActLayout {
        &self.acts
    }

    /// The attention every layer uses.
    pub fn attention(&self) -> AttentionKind {
        self.runner.attention().unwrap_or_default()
    }

    /// The GPU memory this model holds besides the engine's parameters and gradients.
    pub fn activation_memory(&self) -> ActivationMemory {
        self.runner.activation_memory()
    }

    /// [`ActivationMemory::total`]: every byte of GPU memory the model holds.
    pub fn activation_bytes(&self) -> usize {
        self.activation_memory().total()
    }

    /// Checks a micro-batch (`[batch, seq]` inputs and targets, ids below the vocabulary) and
    /// queues its upload on the compute stream. Does not wait for the GPU.
    pub fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), GptError> {
        Ok(self.runner.set_batch(inputs, targets, self.config.vocab_size)?)
    }

    /// [`CudaGpt::set_batch`] of packed rows (a model built with [`CudaGptOptions::packed`]):
    /// `positions [batch, seq]`, each token's position in its document (0 at a document's first
    /// token in the row, then one more at each token), uploaded with the tokens. No attention
    /// crosses a document boundary, and the position embedding is read at each token's position.
    pub fn set_packed_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<(), GptError> {
        let vocab = self.config.vocab_size;
        Ok(self.runner.set_packed_batch(inputs, targets, positions, vocab)?)
    }

    /// Queues forward on the compute stream.
    pub fn forward(&mut self, params: &CudaBuffer<bf16>) -> Result<(), GptError> {
        Ok(self.runner.forward(params)?)
    }

    /// [`Self::forward`], telling `open(end)` before queuing the first operation that reads
    /// flat weights below `end`, and `open(usize::MAX)` once the forward is queued (the
    /// engine's `ModelIo::open`).
    pub fn forward_opening(
        &mut self,
        params: &CudaBuffer<bf16>,
        open: &mut dyn FnMut(usize),
    ) -> Result<(), GptError> {
        Ok(self.runner.forward_opening(params, open)?)
    }

    /// Waits for the last forward and returns its mean loss (copied out on the compute stream).
    pub fn loss(&mut self) -> Result<f32, GptError> {
        Ok(self.runner.loss()?)
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
        on_ready: impl FnMut(&GradsReady),
    ) -> Result<(), GptError> {
        Ok(self.runner.backward(params, grads, loss_scale, on_ready)?)
    }

    /// Runs forward and backward once more on the last batch, waiting for the GPU after each
    /// operation, and returns the time each kind of operation took, summed, in first-run order
    /// (for benchmarks: the waits add a launch latency to every operation). `grads` is added to.
    pub fn profile(
        &mut self,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
    ) -> Result<Vec<(String, Duration)>, GptError> {
        Ok(self.runner.profile(params, grads)?)
    }

    /// The logits of the last forward, `[batch, seq, padded_vocab]`. Waits for the GPU: for tests
    /// and tools, not for the training loop.
    pub fn logits(&self) -> Result<Vec<f32>, GptError> {
        Ok(self.runner.download_activations(self.acts.logits.clone())?)
    }
}

/// Bytes of the GPU's memory in use now, by every process and context (`cuMemGetInfo`): the
/// model allocates everything up front, so after a step this is the peak. For reports.
pub fn device_memory_in_use(device: &CudaDevice) -> Result<usize, GptError> {
    let (free, total) = device.memory_info()?;
    Ok(total - free)
}

#[cfg(test)]
mod tests {
    use super::{
        AttentionKind, CudaGptOptions, auto_attention, check_attention_fits, planned_memory,
    };
    use crate::{GptConfig, flat_layout};

    /// The engine may run each rank's model on a thread of its own.
    #[test]
    fn the_model_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<super::CudaGpt>();
    }

    /// The options keep the attention asked for, and pick the model's best where none is.
    #[test]
    fn the_options_take_the_attention_asked_for_else_the_models_best() {
        let config = GptConfig::named("gpt2-124m").unwrap();
        let options = |requested| CudaGptOptions::for_model(&config, requested).attention;
        assert_eq!(options(None), AttentionKind::Flash);
        assert_eq!(options(Some(AttentionKind::Gemm)), AttentionKind::Gemm);
        assert_eq!(options(Some(AttentionKind::Flash)), AttentionKind::Flash);
        assert!(CudaGptOptions::for_model(&config, None).fuse_gelu);
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
        for needed in ["attention flash", "head sizes [64, 128]", "is 50", "attention gemm"] {
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
            planned_memory(&config, &layout, (batch, seq), options).unwrap()
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
