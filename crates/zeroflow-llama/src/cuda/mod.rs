//! A Llama-family model on an NVIDIA GPU: [`CudaLlama`], the twin of [`crate::CpuLlama`] for the
//! engine: its plan run by zeroflow-nn's [`CudaRunner`] (bf16 storage with f32 accumulation,
//! cuBLASLt matmuls, gemm or flash attention with grouped-query heads, activation gradients packed
//! by liveness; see [`zeroflow_nn::cuda`]), with the family's RMSNorm, RoPE, SwiGLU and embedding
//! kernels (`kernels/*.cu`, [`kernels`]).
//!
//! This module picks the attention: [`flash::FlashAttention`](zeroflow_nn::cuda::flash) where its
//! kernels take the head size (`head_dim` 64 or 128), or else (or where its options ask for gemm)
//! [`attention::CudaAttention`](zeroflow_nn::cuda::attention).

pub mod decode;
pub mod kernels;

use std::sync::Arc;
use std::time::Duration;

use zeroflow_core::bf16;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::CudaDevice;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_nn::AttentionKind;
pub use zeroflow_nn::cuda::ActivationMemory;
use zeroflow_nn::cuda::{CudaRunner, flash};
use zeroflow_nn::plan::GradsReady;

use self::kernels::LlamaKernels;
use crate::acts::ActLayout;
use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::kernels::LlamaKernel;
use crate::plan::{LlamaPlan, Plan, PlanOptions};
use crate::ranges::ParamRanges;

/// A model for one (batch, seq) whose activations live on a GPU. The engine owns the flat bf16
/// parameter and gradient buffers and passes them to each call.
#[derive(Debug)]
pub struct CudaLlama {
    config: LlamaConfig,
    acts: ActLayout,
    runner: CudaRunner<LlamaKernel, LlamaKernels>,
}

/// Choices of [`CudaLlama::with_options`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaLlamaOptions {
    /// How attention keeps what its backward needs ([`AttentionKind`]; `Gemm` in `default()`,
    /// which takes any model; [`CudaLlamaOptions::for_model`] picks `Flash` where it can).
    /// [`AttentionKind::Flash`] needs a `head_dim` of 64 or 128 ([`flash::HEAD_SIZES`]).
    pub attention: AttentionKind,
    /// Keep only each layer's output for backward and recompute the rest of the layer there
    /// ([`PlanOptions::activation_checkpointing`]). Off by default.
    pub activation_checkpointing: bool,
    /// Sequence packing: several documents per row, batches through
    /// [`CudaLlama::set_packed_batch`] ([`PlanOptions::packed`]). Off by default.
    pub packed: bool,
}

impl CudaLlamaOptions {
    /// The plan options these ask for.
    fn plan(&self) -> PlanOptions {
        PlanOptions {
            attention: self.attention,
            activation_checkpointing: self.activation_checkpointing,
            packed: self.packed,
        }
    }

    /// The defaults, with the attention `requested` (`None`: the fastest that takes `config`,
    /// [`auto_attention`]). Whether the attention takes the model is checked when it is built.
    pub fn for_model(config: &LlamaConfig, requested: Option<AttentionKind>) -> Self {
        CudaLlamaOptions {
            attention: requested.unwrap_or_else(|| auto_attention(config)),
            ..CudaLlamaOptions::default()
        }
    }
}

/// The attention a model gets unless its options ask for another: flash where its kernels take
/// the head size, gemm otherwise.
pub fn auto_attention(config: &LlamaConfig) -> AttentionKind {
    match check_attention_fits(config, AttentionKind::Flash) {
        Ok(()) => AttentionKind::Flash,
        Err(_) => AttentionKind::Gemm,
    }
}

/// An error unless `attention` can run `config`: flash attention has kernels for head sizes 64
/// and 128 only ([`flash::HEAD_SIZES`]).
fn check_attention_fits(config: &LlamaConfig, attention: AttentionKind) -> Result<(), LlamaError> {
    if attention == AttentionKind::Gemm || flash::HEAD_SIZES.contains(&config.head_dim) {
        return Ok(());
    }
    Err(LlamaError::Batch(format!(
        "attention flash: the flash kernels take head sizes {:?}, and this model's head_dim is \
         {}; use attention gemm (or auto) for this model",
        flash::HEAD_SIZES,
        config.head_dim
    )))
}

/// An error unless the sizes the kernels index with 32 bits fit: the rows of the per-head norms
/// (tokens · heads), the widest row (the vocabulary, the MLP, the qkv row).
fn check_32_bit_sizes(config: &LlamaConfig, tokens: usize) -> Result<(), LlamaError> {
    let qkv_width = config.q_dim() + 2 * config.kv_dim();
    let widest = [
        tokens * config.num_attention_heads,
        config.vocab_size,
        config.intermediate_size,
        qkv_width,
    ];
    if widest.iter().all(|&size| u32::try_from(size + 1).is_ok()) {
        return Ok(());
    }
    Err(LlamaError::Batch(format!(
        "{tokens} tokens with {} heads, vocabulary {}, MLP width {}, qkv width {qkv_width}: the \
         kernels index rows and columns with 32 bits",
        config.num_attention_heads, config.vocab_size, config.intermediate_size
    )))
}

/// The memory a [`CudaLlama::with_options`] of these arguments holds, computed without a GPU
/// (what [`CudaLlama::activation_memory`] reports once it is built; its scratch includes the
/// rotary table).
pub fn planned_memory(
    config: &LlamaConfig,
    layout: &FlatLayout,
    (batch, seq): (usize, usize),
    options: CudaLlamaOptions,
) -> Result<ActivationMemory, LlamaError> {
    let params = ParamRanges::new(config, layout)?;
    let LlamaPlan { plan, .. } =
        LlamaPlan::with_options(config, &params, batch, seq, options.plan())?;
    let mut memory = ActivationMemory::planned(&plan, false)?;
    memory.scratch += kernels::table_bytes(&plan)?;
    Ok(memory)
}

impl CudaLlama {
    /// Loads the kernels, creates a cuBLASLt handle and allocates everything forward and backward
    /// use, for micro-batches of `batch` sequences of `seq` tokens, with the attention that fits
    /// the model best ([`auto_attention`]).
    pub fn new(
        device: &CudaDevice,
        config: &LlamaConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
    ) -> Result<Self, LlamaError> {
        let blas = Arc::new(Blas::new(device)?);
        let options = CudaLlamaOptions::for_model(config, None);
        Self::with_options(device, blas, config, layout, (batch, seq), options)
    }

    /// [`CudaLlama::new`] with a cuBLASLt handle shared with other users of the compute stream,
    /// and the options given (the attention among them).
    pub fn with_options(
        device: &CudaDevice,
        blas: Arc<Blas>,
        config: &LlamaConfig,
        layout: &FlatLayout,
        (batch, seq): (usize, usize),
        options: CudaLlamaOptions,
    ) -> Result<Self, LlamaError> {
        check_attention_fits(config, options.attention)?;
        check_32_bit_sizes(config, batch * seq)?;
        let params = ParamRanges::new(config, layout)?;
        let LlamaPlan { acts, plan } =
            LlamaPlan::with_options(config, &params, batch, seq, options.plan())?;
        let layers = LlamaKernels::load(device, &plan)?;
        // No GELU to fuse: the family's kernels have no cuBLASLt epilogue.
        let runner = CudaRunner::new(device, blas, plan, layout.padded_len(), false, layers)?;
        Ok(CudaLlama { config: config.clone(), acts, runner })
    }

    pub fn config(&self) -> &LlamaConfig {
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

    /// The GPU memory this model holds besides the engine's parameters and gradients (the rotary
    /// table counted with the scratch).
    pub fn activation_memory(&self) -> ActivationMemory {
        let mut memory = self.runner.activation_memory();
        memory.scratch += self.runner.layers().bytes();
        memory
    }

    /// Checks a micro-batch (`[batch, seq]` inputs and targets, ids below the vocabulary) and
    /// queues its upload on the compute stream. Does not wait for the GPU.
    pub fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), LlamaError> {
        Ok(self.runner.set_batch(inputs, targets, self.config.vocab_size)?)
    }

    /// [`CudaLlama::set_batch`] of packed rows (a model built with [`CudaLlamaOptions::packed`]):
    /// `positions [batch, seq]`, each token's position in its document (0 at a document's first
    /// token in the row, then one more at each token), uploaded with the tokens. No attention
    /// crosses a document boundary, and each token is rotated by its position.
    pub fn set_packed_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<(), LlamaError> {
        let vocab = self.config.vocab_size;
        Ok(self.runner.set_packed_batch(inputs, targets, positions, vocab)?)
    }

    /// Queues forward on the compute stream.
    pub fn forward(&mut self, params: &CudaBuffer<bf16>) -> Result<(), LlamaError> {
        Ok(self.runner.forward(params)?)
    }

    /// [`Self::forward`], telling `open(end)` before queuing the first operation that reads
    /// flat weights below `end`, and `open(usize::MAX)` once the forward is queued (the
    /// engine's `ModelIo::open`).
    pub fn forward_opening(
        &mut self,
        params: &CudaBuffer<bf16>,
        open: &mut dyn FnMut(usize),
    ) -> Result<(), LlamaError> {
        Ok(self.runner.forward_opening(params, open)?)
    }

    /// Waits for the last forward and returns its mean loss (copied out on the compute stream).
    pub fn loss(&mut self) -> Result<f32, LlamaError> {
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
    ) -> Result<(), LlamaError> {
        Ok(self.runner.backward(params, grads, loss_scale, on_ready)?)
    }

    /// Runs forward and backward once more on the last batch, waiting for the GPU after each
    /// operation, and returns the time each kind of operation took, summed, in first-run order
    /// (for benchmarks). `grads` is added to.
    pub fn profile(
        &mut self,
        params: &CudaBuffer<bf16>,
        grads: &CudaBuffer<bf16>,
    ) -> Result<Vec<(String, Duration)>, LlamaError> {
        Ok(self.runner.profile(params, grads)?)
    }

    /// The logits of the last forward, `[batch, seq, vocab]`. Waits for the GPU: for tests and
    /// tools, not for the training loop.
    pub fn logits(&self) -> Result<Vec<f32>, LlamaError> {
        Ok(self.runner.download_activations(self.acts.logits.clone())?)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::{AttentionKind, CudaLlamaOptions, auto_attention, check_attention_fits};
    use crate::LlamaConfig;

    fn config(head_dim: usize) -> LlamaConfig {
        let json = json!({
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 11, "hidden_size": 96, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2,
            "head_dim": head_dim, "rms_norm_eps": 1e-5, "rope_theta": 50.0,
            "tie_word_embeddings": false,
        });
        LlamaConfig::from_hf_config(&json).unwrap()
    }

    /// The engine may run each rank's model on a thread of its own.
    #[test]
    fn the_model_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<super::CudaLlama>();
    }

    /// Unless told otherwise a model gets flash attention where its head_dim has kernels (64,
    /// 128), gemm elsewhere; flash is refused, by name, for other head sizes.
    #[test]
    fn flash_attention_is_picked_and_taken_only_at_head_dims_with_kernels() {
        for head_dim in [64, 128] {
            assert_eq!(auto_attention(&config(head_dim)), AttentionKind::Flash, "{head_dim}");
        }
        let odd = config(48);
        assert_eq!(auto_attention(&odd), AttentionKind::Gemm);
        let requested = CudaLlamaOptions::for_model(&odd, Some(AttentionKind::Flash));
        assert_eq!(requested.attention, AttentionKind::Flash);
        let message = check_attention_fits(&odd, AttentionKind::Flash).unwrap_err().to_string();
        for needed in ["attention flash", "[64, 128]", "head_dim is 48", "attention gemm"] {
            assert!(message.contains(needed), "{message}");
        }
        assert!(check_attention_fits(&odd, AttentionKind::Gemm).is_ok());
    }
}
