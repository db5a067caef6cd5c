//! A Llama-family model run directly on host vectors, in any [`Float`], by zeroflow-nn's
//! [`HostRunner`]: the f64 oracle of the tests (finite differences) and a device-free reference.

use zeroflow_core::layout::FlatLayout;
use zeroflow_nn::infer::{EvalResult, EvalStream, eval_on_host};
use zeroflow_nn::plan::GradsReady;
use zeroflow_nn::{AttentionKind, Float, HostRunner};

use crate::acts::ActLayout;
use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::kernels::LlamaKernel;
use crate::plan::{LlamaPlan, Plan, PlanOptions};
use crate::ranges::ParamRanges;

/// A model for one (batch, seq) whose activations live in host vectors.
#[derive(Debug)]
pub struct HostLlama<F> {
    config: LlamaConfig,
    acts: ActLayout,
    runner: HostRunner<F, LlamaKernel>,
}

impl<F: Float> HostLlama<F> {
    /// The model over `layout` for micro-batches of `batch` sequences of `seq` tokens, whose
    /// attention keeps what `attention` says.
    pub fn new(
        config: &LlamaConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        attention: AttentionKind,
    ) -> Result<Self, LlamaError> {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(config, layout, batch, seq, options)
    }

    /// The model over `layout` for micro-batches of `batch` sequences of `seq` tokens, its plan
    /// built as `options` say.
    pub fn with_options(
        config: &LlamaConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Result<Self, LlamaError> {
        let params = ParamRanges::new(config, layout)?;
        let LlamaPlan { acts, plan } =
            LlamaPlan::with_options(config, &params, batch, seq, options)?;
        let runner = HostRunner::new(plan, layout.padded_len());
        Ok(HostLlama { config: config.clone(), acts, runner })
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

    /// The activations of the last forward, laid out as [`HostLlama::acts`] says.
    pub fn activations(&self) -> &[F] {
        self.runner.activations()
    }

    /// The logits `[batch, seq, vocab]` of the last forward.
    pub fn logits(&self) -> &[F] {
        &self.runner.activations()[self.acts.logits.clone()]
    }

    /// Runs forward on `inputs` → `targets` (each `[batch, seq]`) and returns the mean loss.
    pub fn forward(
        &mut self,
        params: &[F],
        inputs: &[u32],
        targets: &[u32],
    ) -> Result<F, LlamaError> {
        Ok(self.runner.forward(params, inputs, targets)?)
    }

    /// [`HostLlama::forward`] of packed rows (a model built with [`PlanOptions::packed`]):
    /// `positions [batch, seq]`, each token's position in its document.
    pub fn forward_packed(
        &mut self,
        params: &[F],
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<F, LlamaError> {
        Ok(self.runner.forward_packed(params, inputs, targets, positions)?)
    }

    /// Adds the gradient of `loss_scale` × (the last forward's mean loss) to `grads`. After each
    /// group's launches, `on_ready` gets the group and the gradient buffer.
    pub fn backward(
        &mut self,
        params: &[F],
        grads: &mut [F],
        loss_scale: f64,
        on_ready: impl FnMut(&GradsReady, &[F]),
    ) -> Result<(), LlamaError> {
        Ok(self.runner.backward(params, grads, loss_scale, on_ready)?)
    }
}

/// The loss and perplexity of the model `params` (of `layout`) over `stream` in windows of
/// `window` inputs (zeroflow-nn's [`eval_windows`](zeroflow_nn::infer::eval_windows): the
/// targets its mask leaves out, where given, not counted; where it is packed, no attention across
/// its documents), each window by the training forward.
pub fn eval_stream<F: Float>(
    config: &LlamaConfig,
    layout: &FlatLayout,
    params: &[F],
    stream: EvalStream<'_>,
    window: usize,
) -> Result<EvalResult, LlamaError> {
    let ranges = ParamRanges::new(config, layout)?;
    eval_on_host(params, stream, window, |seq, packed| {
        let options =
            PlanOptions { attention: AttentionKind::Gemm, packed, ..PlanOptions::default() };
        let LlamaPlan { plan, .. } = LlamaPlan::with_options(config, &ranges, 1, seq, options)?;
        Ok(HostRunner::new(plan, layout.padded_len()))
    })
}
