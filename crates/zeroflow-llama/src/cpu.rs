//! A Llama-family model on the [`CpuDevice`]: its plan run by zeroflow-nn's [`CpuRunner`] (every
//! launch a kernel queued on the compute stream, in f32, with its buffers' ranges declared, so the
//! device's happens-before checker sees exactly what each kernel reads and writes).

use zeroflow_core::layout::FlatLayout;
use zeroflow_device::cpu::{CpuBuffer, KernelArgs};
use zeroflow_device::{CpuDevice, Device, DeviceBuffer, StreamKind};
use zeroflow_nn::plan::GradsReady;
use zeroflow_nn::{AttentionKind, CpuRunner};

use crate::acts::ActLayout;
use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::kernels::LlamaKernel;
use crate::plan::{LlamaPlan, Plan, PlanOptions};
use crate::ranges::ParamRanges;

/// A model for one (batch, seq) whose activations live on a [`CpuDevice`]. The engine owns the
/// flat parameter and gradient buffers and passes them to each call.
#[derive(Debug)]
pub struct CpuLlama {
    config: LlamaConfig,
    acts: ActLayout,
    runner: CpuRunner<LlamaKernel>,
}

impl CpuLlama {
    /// Allocates the activations for micro-batches of `batch` sequences of `seq` tokens, whose
    /// attention keeps what `attention` says.
    pub fn new(
        device: &CpuDevice,
        config: &LlamaConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        attention: AttentionKind,
    ) -> Result<Self, LlamaError> {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(device, config, layout, batch, seq, options)
    }

    /// The model over `layout` for micro-batches of `batch` sequences of `seq` tokens, its plan
    /// built as `options` say.
    pub fn with_options(
        device: &CpuDevice,
        config: &LlamaConfig,
        layout: &FlatLayout,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Result<Self, LlamaError> {
        let params = ParamRanges::new(config, layout)?;
        let LlamaPlan { acts, plan } =
            LlamaPlan::with_options(config, &params, batch, seq, options)?;
        let runner = CpuRunner::new(device, plan, layout.padded_len())?;
        Ok(CpuLlama { config: config.clone(), acts, runner })
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

    /// Queues the upload of a micro-batch (`[batch, seq]` inputs and targets) on the compute
    /// stream. Token ids are checked against the vocabulary by the kernels that read them.
    pub fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), LlamaError> {
        Ok(self.runner.set_batch(inputs, targets)?)
    }

    /// [`CpuLlama::set_batch`] of packed rows (a model built with
    /// [`zeroflow_nn::PlanOptions::packed`]): `positions [batch, seq]`, each token's position in
    /// its document.
    pub fn set_packed_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<(), LlamaError> {
        Ok(self.runner.set_packed_batch(inputs, targets, positions)?)
    }

    /// Queues forward on the compute stream.
    pub fn forward(&mut self, params: &CpuBuffer<f32>) -> Result<(), LlamaError> {
        Ok(self.runner.forward(params)?)
    }

    /// [`Self::forward`], telling `open(end)` before queuing the first operation that reads
    /// flat weights below `end`, and `open(usize::MAX)` once the forward is queued (the
    /// engine's `ModelIo::open`).
    pub fn forward_opening(
        &mut self,
        params: &CpuBuffer<f32>,
        open: &mut dyn FnMut(usize),
    ) -> Result<(), LlamaError> {
        Ok(self.runner.forward_opening(params, open)?)
    }

    /// Waits for the last forward and returns its mean loss (copied out on the D2H stream).
    pub fn loss(&mut self) -> Result<f32, LlamaError> {
        Ok(self.runner.loss()?)
    }

    /// Queues backward on the compute stream: adds the gradient of `loss_scale` × (the last
    /// forward's mean loss) to `grads`. Right after the launches that complete a group of
    /// parameter gradients are queued, `on_ready` is told (in backward order).
    pub fn backward(
        &mut self,
        params: &CpuBuffer<f32>,
        grads: &CpuBuffer<f32>,
        loss_scale: f64,
        on_ready: impl FnMut(&GradsReady),
    ) -> Result<(), LlamaError> {
        Ok(self.runner.backward(params, grads, loss_scale, on_ready)?)
    }
}

/// Queues the initialisation of a flat parameter buffer on the device's compute stream (see
/// [`crate::init_params`]): no host copy of the parameters is made.
pub fn init_params_on_device(
    device: &CpuDevice,
    params: &CpuBuffer<f32>,
    config: &LlamaConfig,
    layout: &FlatLayout,
    seed: u64,
) -> Result<(), LlamaError> {
    ParamRanges::new(config, layout)?;
    if params.len() != layout.padded_len() {
        let (expected, found) = (layout.padded_len(), params.len());
        return Err(LlamaError::Length { what: "parameter buffer", expected, found });
    }
    let (config, layout) = (config.clone(), layout.clone());
    let args = KernelArgs::new().output(params, 0..layout.padded_len());
    device.launch(device.stream(StreamKind::Compute), "init_params", args, move |ctx| {
        crate::init_params(&config, &layout, seed, ctx.output::<f32>(0)).map_err(|e| e.to_string())
    })?;
    Ok(())
}
