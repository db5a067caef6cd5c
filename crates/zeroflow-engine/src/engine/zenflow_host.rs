//! ZenFlow's host side, either of two: the window streamed from the device through bounded
//! staging (`ZenFlowAside::Device`, `zenflow.rs`), or the path before it, kept whole and
//! selectable (`ZenFlowAside::Host`) for a GPU without room for the second window: at the window
//! end the window is copied into the pinned host accumulator and cleared on the d2h stream
//! (`window_copied`, d2h → compute, orders the next add after it); the CPU steps the whole
//! partition from there into the upload buffer, whose weights reach the flat weights from the
//! host: at once (inline), or with `overlap_step` at the next window's end, where the worker is
//! joined and its weights uploaded before that window is copied into the same accumulator. 18 B
//! per parameter of host memory with fp32 moments (14 with bf16), and on the device the window
//! alone, as inline.

use zeroflow_core::Float;
use zeroflow_device::{Comm, StreamKind};
use zeroflow_optim::AdamWStep;

use super::shared::{Shared, slot};
use super::state::SavedState;
use super::zenflow::ZenFlowUpdate;
use crate::EngineError;
use crate::device_adamw::DeviceAdamW;
use crate::host::{CpuStep, HostAccumulator, HostOptimizer, ZenFlowHost};
use crate::zenflow::ZenFlow;

/// ZenFlow's host side ([`crate::ZenFlowAside`]).
#[derive(Debug)]
pub(super) enum HostSide<P: Float> {
    /// The window stays on the device and is streamed through the CPU step.
    Streamed(ZenFlowHost<P>),
    /// The window is copied into the host accumulator (the path before).
    Accumulated(HostAccumulator<P>),
}

impl<P: Float> HostSide<P> {
    /// True if the optimizer's weights have not reached the device's flat weights yet.
    pub(super) fn weights_ahead(&self) -> bool {
        match self {
            HostSide::Streamed(host) => host.weights_ahead(),
            HostSide::Accumulated(host) => host.weights_ahead(),
        }
    }

    /// The optimizer, after waiting for a running CPU step (whose weights are then pending).
    pub(super) fn join(&mut self) -> Result<&mut HostOptimizer, EngineError> {
        match self {
            HostSide::Streamed(host) => Ok(&mut host.join()?.state),
            HostSide::Accumulated(host) => Ok(&mut host.join()?.state),
        }
    }

    /// This rank's optimizer state, copied (waiting for a running step first).
    pub(super) fn state(&mut self) -> Result<[Vec<f32>; 3], EngineError> {
        match self {
            HostSide::Streamed(host) => host.state(),
            HostSide::Accumulated(host) => host.state(),
        }
    }

    /// Takes a checkpoint's state (waiting for a running step first).
    pub(super) fn restore(
        &mut self,
        state: &SavedState<'_>,
        upload_pending: bool,
    ) -> Result<(), EngineError> {
        match self {
            HostSide::Streamed(host) => host.restore(state, upload_pending),
            HostSide::Accumulated(host) => host.restore(state, upload_pending),
        }
    }

    /// The optimizer, where no step is running (after [`HostSide::join`]).
    pub(super) fn settled(&self) -> Option<&HostOptimizer> {
        match self {
            HostSide::Streamed(host) => host.settled(),
            HostSide::Accumulated(host) => host.settled(),
        }
    }

    /// The optimizer holds weights newer than the device's flat weights.
    pub(super) fn upload_pending(&self) -> bool {
        match self {
            HostSide::Streamed(host) => host.upload_pending,
            HostSide::Accumulated(host) => host.upload_pending,
        }
    }

    /// The streamed host side, or an internal error on the host path.
    pub(super) fn streamed(&mut self) -> Result<&mut ZenFlowHost<P>, EngineError> {
        match self {
            HostSide::Streamed(host) => Ok(host),
            HostSide::Accumulated(_) => Err(EngineError::Internal("ZenFlow's host path streamed")),
        }
    }

    /// The host accumulator (the host path).
    pub(super) fn accumulator(&self) -> Option<&[f32]> {
        match self {
            HostSide::Streamed(_) => None,
            HostSide::Accumulated(host) => Some(&host.acc),
        }
    }
}

impl<D: DeviceAdamW, P: Float> ZenFlowUpdate<D, P> {
    /// The host path's end of a window (its norm taken): the window to the host and the CPU
    /// step, inline or (with `overlap_step`) on the worker after the last window's step is
    /// joined and its weights applied.
    pub(super) fn end_window_on_host<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        cpu_step: AdamWStep,
    ) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let (zenflow, host) = self.accumulated()?;
        if let CpuStep::Inline(_) = host.cpu {
            take_window(shared, zenflow, host)?;
            host.step_now(&cpu_step)?;
            shared.cpu_wait += started.elapsed();
            return self.apply_and_gather(shared);
        }
        // The last window's CPU step finished meanwhile: joined, it hands the accumulator back,
        // and its weights go to the device now; this window's runs in the background until the
        // next window ends, its weights left in the upload buffer until then.
        if host.weights_ahead() {
            host.join()?;
            shared.cpu_wait += started.elapsed();
            self.apply_and_gather(shared)?;
        } else {
            shared.gather_from(StreamKind::Compute)?;
        }
        let (zenflow, host) = self.accumulated()?;
        take_window(shared, zenflow, host)?;
        host.start_delayed(cpu_step)
    }

    /// The device side and the host accumulator (the host path).
    fn accumulated(
        &mut self,
    ) -> Result<(&mut ZenFlow<D, P>, &mut HostAccumulator<P>), EngineError> {
        match &mut self.host {
            HostSide::Accumulated(host) => Ok((&mut self.zenflow, host)),
            HostSide::Streamed(_) => {
                Err(EngineError::Internal("ZenFlow's streamed path on the host"))
            }
        }
    }
}

/// Copies the window into the host accumulator and clears it, on the d2h stream. The copy's token
/// is detached: the accumulator remembers the copy, and the CPU step's first read of it (here or
/// on the worker) waits for it.
fn take_window<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &Shared<D, C, P>,
    zenflow: &mut ZenFlow<D, P>,
    host: &mut HostAccumulator<P>,
) -> Result<(), EngineError> {
    let device = &shared.device;
    let d2h = device.stream(StreamKind::D2h);
    device.wait_event(d2h, &zenflow.window_ready)?;
    let len = shared.owned.len();
    device.copy_d2h(d2h, &*zenflow.window, 0..len, &mut host.acc, 0)?.detach();
    device.fill(d2h, &*zenflow.window, 0..len, 0.0)?;
    let copied = slot(&mut zenflow.window_copied, device)?;
    device.record(copied, d2h)?;
    Ok(())
}
