//! A plan on the [`CpuDevice`]: every launch is a kernel queued on the compute stream, in f32,
//! with its buffers' ranges declared, so the device's happens-before checker sees exactly what
//! each kernel reads and writes.

use zeroflow_device::cpu::{CpuBuffer, CpuEvent, KernelArgs, KernelCtx};
use zeroflow_device::{CpuDevice, Device, HostBuffer, HostMemory, StreamKind};

use crate::error::NnError;
use crate::kernels::{self, ArgSlices, Kernel, LayerKernel, Slot};
use crate::plan::{Access, Buf, GradsReady, Launch, Plan, Step, open_before};

/// A plan for one (batch, seq) whose activations live on a [`CpuDevice`]. The engine owns the
/// flat parameter and gradient buffers (of `padded_len` elements) and passes them to each call.
#[derive(Debug)]
pub struct CpuRunner<X> {
    device: CpuDevice,
    padded_len: usize,
    plan: Plan<X>,
    acts: CpuBuffer<f32>,
    act_grads: CpuBuffer<f32>,
    inputs: CpuBuffer<u32>,
    targets: CpuBuffer<u32>,
    /// Each token's position in its document (a packed plan's; one element otherwise).
    positions: CpuBuffer<u32>,
    loss_host: HostBuffer<f32>,
    loss_written: CpuEvent,
}

impl<X: LayerKernel> CpuRunner<X> {
    /// Allocates the activations of `plan`, whose flat parameter and gradient buffers have
    /// `padded_len` elements.
    pub fn new(device: &CpuDevice, plan: Plan<X>, padded_len: usize) -> Result<Self, NnError> {
        Ok(CpuRunner {
            acts: device.alloc(plan.acts_len)?,
            act_grads: device.alloc(plan.acts_len)?,
            inputs: device.alloc(plan.tokens())?,
            targets: device.alloc(plan.tokens())?,
            positions: device.alloc(if plan.is_packed() { plan.tokens() } else { 1 })?,
            loss_host: device.alloc_host(1, HostMemory::Pinned)?,
            loss_written: device.new_event()?,
            device: device.clone(),
            padded_len,
            plan,
        })
    }

    pub fn plan(&self) -> &Plan<X> {
        &self.plan
    }

    /// Queues the upload of a micro-batch (`[batch, seq]` inputs and targets) on the compute
    /// stream. Token ids are checked against the vocabulary by the kernels that read them.
    pub fn set_batch(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), NnError> {
        self.plan.check_positions(None)?;
        self.upload_tokens(inputs, targets)
    }

    /// [`CpuRunner::set_batch`] of packed rows (a plan built with
    /// [`crate::plan::PlanOptions::packed`]): `positions [batch, seq]`, each token's position in
    /// its document, uploaded with the tokens.
    pub fn set_packed_batch(
        &mut self,
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<(), NnError> {
        self.plan.check_positions(Some(positions))?;
        self.upload_tokens(inputs, targets)?;
        let (n, positions) = (self.plan.tokens(), positions.to_vec());
        let args = KernelArgs::new().output(&self.positions, 0..n);
        self.device.launch(self.compute(), "upload_positions", args, move |ctx| {
            ctx.output::<u32>(0).copy_from_slice(&positions);
            Ok(())
        })?;
        Ok(())
    }

    fn upload_tokens(&mut self, inputs: &[u32], targets: &[u32]) -> Result<(), NnError> {
        let n = self.plan.tokens();
        for (what, tokens) in [("inputs", inputs), ("targets", targets)] {
            if tokens.len() != n {
                return Err(NnError::Length { what, expected: n, found: tokens.len() });
            }
        }
        let (inputs, targets) = (inputs.to_vec(), targets.to_vec());
        let args = KernelArgs::new().output(&self.inputs, 0..n).output(&self.targets, 0..n);
        self.device.launch(self.compute(), "upload_tokens", args, move |ctx| {
            ctx.output::<u32>(0).copy_from_slice(&inputs);
            ctx.output::<u32>(1).copy_from_slice(&targets);
            Ok(())
        })?;
        Ok(())
    }

    /// Queues forward on the compute stream.
    pub fn forward(&mut self, params: &CpuBuffer<f32>) -> Result<(), NnError> {
        self.forward_opening(params, &mut |_| {})
    }

    /// [`CpuRunner::forward`], telling `open(end)` before queuing the first launch that reads
    /// flat weights below `end` (growing through the forward), and `open(usize::MAX)` once the
    /// forward is queued (see `CudaRunner::forward_opening`).
    pub fn forward_opening(
        &mut self,
        params: &CpuBuffer<f32>,
        open: &mut dyn FnMut(usize),
    ) -> Result<(), NnError> {
        self.check_flat("parameter buffer", params)?;
        let mut opened = 0;
        for launch in &self.plan.forward {
            let params_end = launch.args.iter().filter(|a| a.buf == Buf::Params);
            open_before(&mut opened, params_end.map(|a| a.range.end).max(), open);
            self.launch(launch, launch.kernel.clone(), params, None)?;
        }
        open(usize::MAX);
        self.device.record(&mut self.loss_written, self.device.stream(StreamKind::Compute))?;
        Ok(())
    }

    /// Waits for the last forward and returns its mean loss (copied out on the D2H stream).
    pub fn loss(&mut self) -> Result<f32, NnError> {
        let d2h = self.device.stream(StreamKind::D2h);
        self.device.wait_event(d2h, &self.loss_written)?;
        let range = self.plan.loss.clone();
        let filled =
            self.device.copy_d2h(d2h, &self.acts, range, &mut self.loss_host, 0)?.wait()?;
        Ok(filled[0])
    }

    /// Queues backward on the compute stream: adds the gradient of `loss_scale` × (the last
    /// forward's mean loss) to `grads`. Right after the launches that complete a group of
    /// parameter gradients are queued, `on_ready` is told (in backward order), so the caller can
    /// record an event and start reducing or offloading that range while the rest runs.
    pub fn backward(
        &mut self,
        params: &CpuBuffer<f32>,
        grads: &CpuBuffer<f32>,
        loss_scale: f64,
        mut on_ready: impl FnMut(&GradsReady),
    ) -> Result<(), NnError> {
        self.check_flat("parameter buffer", params)?;
        self.check_flat("gradient buffer", grads)?;
        for step in &self.plan.backward {
            match step {
                Step::Launch(launch) => self.launch(
                    launch,
                    launch.kernel.with_loss_scale(loss_scale),
                    params,
                    Some(grads),
                )?,
                Step::GradsReady(ready) => on_ready(ready),
            }
        }
        Ok(())
    }

    fn compute(&self) -> &zeroflow_device::cpu::CpuStream {
        self.device.stream(StreamKind::Compute)
    }

    fn check_flat(&self, what: &'static str, buffer: &CpuBuffer<f32>) -> Result<(), NnError> {
        use zeroflow_device::DeviceBuffer;
        if buffer.len() == self.padded_len {
            Ok(())
        } else {
            Err(NnError::Length { what, expected: self.padded_len, found: buffer.len() })
        }
    }

    fn launch(
        &self,
        launch: &Launch<X>,
        kernel: Kernel<X>,
        params: &CpuBuffer<f32>,
        grads: Option<&CpuBuffer<f32>>,
    ) -> Result<(), NnError> {
        let mut args = KernelArgs::new();
        for arg in &launch.args {
            let range = arg.range.clone();
            args = match arg.buf {
                Buf::Inputs => args.input(&self.inputs, range),
                Buf::Targets => args.input(&self.targets, range),
                Buf::Positions => args.input(&self.positions, range),
                Buf::Params => declare(args, params, range, arg.access),
                Buf::Grads => {
                    let grads = grads.expect("only backward touches gradients");
                    declare(args, grads, range, arg.access)
                }
                Buf::Acts => declare(args, &self.acts, range, arg.access),
                Buf::ActGrads => declare(args, &self.act_grads, range, arg.access),
            };
        }
        let kinds: Vec<(Buf, Access)> = launch.args.iter().map(|a| (a.buf, a.access)).collect();
        self.device.launch(self.compute(), kernel.name(), args, move |ctx| {
            kernels::run(&kernel, &mut arg_slices(ctx, &kinds))
        })?;
        Ok(())
    }
}

fn declare(
    args: KernelArgs,
    buffer: &CpuBuffer<f32>,
    range: std::ops::Range<usize>,
    access: Access,
) -> KernelArgs {
    match access {
        Access::Read => args.input(buffer, range),
        Access::Write => args.output(buffer, range),
        Access::Update => args.in_out(buffer, range),
    }
}

/// The declared arguments of a running kernel as the slices [`kernels::run`] takes.
fn arg_slices<'a>(ctx: &'a KernelCtx, kinds: &[(Buf, Access)]) -> ArgSlices<'a, f32> {
    let slots = kinds
        .iter()
        .enumerate()
        .map(|(i, &(buf, access))| match (buf, access) {
            (Buf::Inputs | Buf::Targets | Buf::Positions, _) => Slot::Tokens(ctx.input::<u32>(i)),
            (_, Access::Read) => Slot::Read(ctx.input::<f32>(i)),
            (_, Access::Write | Access::Update) => Slot::Write(Some(ctx.output::<f32>(i))),
        })
        .collect();
    ArgSlices::new(slots)
}
