//! GPT-2 run directly on host vectors, in any [`Float`], by zeroflow-nn's [`HostRunner`]: the f64
//! oracle of the tests (finite differences) and a device-free reference. Launches run
//! synchronously, one after the other.

use zeroflow_core::layout::FlatLayout;
use zeroflow_nn::infer::{EvalResult, EvalStream, eval_on_host};
use zeroflow_nn::{AttentionKind, Float, HostRunner};

use crate::GptConfig;
use crate::error::GptError;
use crate::kernels::GptKernel;
use crate::params::{GradsReady, ParamRanges};
use crate::plan::{ActLayout, GptPlan, Plan, PlanOptions};

/// A model for one (batch, seq) whose activations live in host vectors.
#[derive(Debug)]
pub struct HostGpt<F> {
    config: GptConfig,
    acts: ActLayout,
    runner: HostRunner<F, GptKernel>,
}

impl<F: Float> HostGpt<F> {
    pub fn new(
        config: &GptConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
    ) -> Result<Self, GptError> {
        Self::with_attention(config, layout, batch, seq, AttentionKind::Gemm)
    }

    /// [`HostGpt::new`] whose attention keeps what `attention` says: the plan the CUDA model runs
    /// with that attention, on the host.
    pub fn with_attention(
        config: &GptConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        attention: AttentionKind,
    ) -> Result<Self, GptError> {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(config, layout, batch, seq, options)
    }

    /// The model whose plan is built as `options` say (the attention, activation
    /// checkpointing).
    pub fn with_options(
        config: &GptConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Result<Self, GptError> {
        let params = ParamRanges::new(config, layout)?;
        let GptPlan { acts, plan } = GptPlan::with_options(config, &params, batch, seq, options)?;
        let runner = HostRunner::new(plan, layout.padded_len());
        Ok(HostGpt { config: *config, acts, runner })
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

    /// The activations of the last forward, laid out as [`HostGpt::acts`] says.
    pub fn activations(&self) -> &[F] {
        self.runner.activations()
    }

    /// Runs forward on `inputs` → `targets` (each `[batch, seq]`) and returns the mean loss.
    pub fn forward(
        &mut self,
        params: &[F],
        inputs: &[u32],
        targets: &[u32],
    ) -> Result<F, GptError> {
        Ok(self.runner.forward(params, inputs, targets)?)
    }

    /// [`HostGpt::forward`] of packed rows (a model built with [`PlanOptions::packed`]):
    /// `positions [batch, seq]`, each token's position in its document.
    pub fn forward_packed(
        &mut self,
        params: &[F],
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<F, GptError> {
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
    ) -> Result<(), GptError> {
        Ok(self.runner.backward(params, grads, loss_scale, on_ready)?)
    }

    /// Runs forward and backward once more on the last batch and returns the time each kernel
    /// took, summed by kernel name, in first-launch order (for benchmarks).
    pub fn profile(
        &mut self,
        params: &[F],
        grads: &mut [F],
    ) -> Result<Vec<(&'static str, std::time::Duration)>, GptError> {
        Ok(self.runner.profile(params, grads)?)
    }
}

/// The loss and perplexity of the model `params` (of `layout`) over `stream` in windows of
/// `window` inputs (zeroflow-nn's [`eval_windows`](zeroflow_nn::infer::eval_windows): the
/// targets its mask leaves out, where given, not counted; where it is packed, no attention across
/// its documents), each window by the training forward.
pub fn eval_stream<F: Float>(
    config: &GptConfig,
    layout: &FlatLayout,
    params: &[F],
    stream: EvalStream<'_>,
    window: usize,
) -> Result<EvalResult, GptError> {
    let ranges = ParamRanges::new(config, layout)?;
    eval_on_host(params, stream, window, |seq, packed| {
        let options =
            PlanOptions { attention: AttentionKind::Gemm, packed, ..PlanOptions::default() };
        let GptPlan { plan, .. } = GptPlan::with_options(config, &ranges, 1, seq, options)?;
        Ok(HostRunner::new(plan, layout.padded_len()))
    })
}
