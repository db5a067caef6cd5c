//! ZenFlow's host side, either of two: the window streamed from the device through bounded
//! staging (`ZenFlowAside::Device`, `zenflow.rs`), or the path before it, kept whole and
//! selectable (`ZenFlowAside::Host`): at the window end the window is copied into the pinned
//! host accumulator and cleared on the d2h stream (`window_copied`, d2h → compute, orders the
//! next add after it); the CPU steps the whole partition from there into the upload buffer, and
//! its weights reach the flat weights from the host (inline) or, with `overlap_step`, from the
//! aside weights the worker uploads them into (a second accumulator swapped in for the next
//! window). 22 B per parameter of host memory, no second device window.

use zeroflow_core::Float;
use zeroflow_device::{Comm, StreamKind};
use zeroflow_optim::AdamWStep;

use super::shared::{Shared, slot};
use super::state::SavedState;
use super::zenflow::ZenFlowUpdate;
use crate::EngineError;
use crate::device_adamw::DeviceAdamW;
use crate::host::{CpuStep, HostAccumulator, HostOptimizer, ZenFlowHost};

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
    /// step, inline or (with `overlap_step`) on the worker after the last window's weights are
    /// applied.
    pub(super) fn end_window_on_host<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
        cpu_step: AdamWStep,
    ) -> Result<(), EngineError> {
        self.take_window(shared)?;
        let started = std::time::Instant::now();
        let HostSide::Accumulated(host) = &mut self.host else {
            return Err(EngineError::Internal("ZenFlow's streamed path on the host"));
        };
        if let CpuStep::Inline(_) = host.cpu {
            host.step_now(&cpu_step)?;
            shared.cpu_wait += started.elapsed();
            return self.apply_and_gather(shared);
        }
        // The last window's CPU step finished meanwhile: its weights go to the device now; this
        // window's runs in the background until the next window ends.
        if host.weights_ahead() {
            host.join()?;
            shared.cpu_wait += started.elapsed();
            self.apply_and_gather(shared)?;
        } else {
            shared.gather_from(StreamKind::Compute)?;
        }
        self.start_worker_on_host(shared, cpu_step)
    }

    /// Copies the window into the host accumulator and clears it, on the d2h stream. The copy's
    /// token is detached: the accumulator remembers the copy, and the CPU step's first read of
    /// it (here or on the worker) waits for it.
    fn take_window<C: Comm<Device = D>>(
        &mut self,
        shared: &mut Shared<D, C, P>,
    ) -> Result<(), EngineError> {
        let (device, zenflow) = (&shared.device, &mut self.zenflow);
        let HostSide::Accumulated(host) = &mut self.host else {
            return Err(EngineError::Internal("ZenFlow's streamed path on the host"));
        };
        let d2h = device.stream(StreamKind::D2h);
        device.wait_event(d2h, &zenflow.window_ready)?;
        let len = shared.owned.len();
        device.copy_d2h(d2h, &*zenflow.window, 0..len, &mut host.acc, 0)?.detach();
        device.fill(d2h, &*zenflow.window, 0..len, 0.0)?;
        let copied = slot(&mut zenflow.window_copied, device)?;
        device.record(copied, d2h)?;
        Ok(())
    }

    /// Starts the CPU step of the window just taken on the worker, which then uploads its
    /// weights into the aside weights on the h2d stream (after the last application of the aside
    /// weights, queued there before).
    fn start_worker_on_host<C: Comm<Device = D>>(
        &mut self,
        shared: &Shared<D, C, P>,
        cpu_step: AdamWStep,
    ) -> Result<(), EngineError> {
        let aside = self.zenflow.aside.clone();
        let aside = aside.ok_or(EngineError::Internal("overlap_step without its aside buffer"))?;
        let (device, len) = (shared.device.clone(), shared.owned.len());
        let HostSide::Accumulated(host) = &mut self.host else {
            return Err(EngineError::Internal("ZenFlow's streamed path on the host"));
        };
        self.zenflow.aside_ready = true;
        host.start_delayed(cpu_step, move |whole| {
            let h2d = device.stream(StreamKind::H2d);
            device.copy_h2d(h2d, &whole.upload, 0..len, &aside, 0)?.wait()?;
            Ok(())
        })
    }
}
