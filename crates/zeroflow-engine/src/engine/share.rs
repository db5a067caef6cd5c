//! The optimizer's device share (`StreamOptions::device_share`): the last elements of the
//! partition keep their fp32 master weights and moments in device memory as well, and the
//! device's AdamW steps them on the compute stream while the CPU streams the rest. The host
//! memory the exact step moves per step — the bound of that step (DESIGN.md §5) — shrinks by the
//! share.
//!
//! The host's copy of the share's state falls behind at the first step and is brought up to date
//! ([`DeviceShare::sync`]) before anything reads the host state (a snapshot, a checkpoint's view,
//! the master weights); a restore writes the host state and uploads the share's part
//! ([`DeviceShare::restore`]).
//!
//! Events: the compute stream waits for `norm_done` (the comm stream is past the reductions and
//! the norm) before it casts the share's gradients; the weights it writes are read by the next
//! forward and backward on the same stream. `stepped` (compute → d2h) orders a sync's copies after
//! the last step; where the gradients are the window's sum on the device, also (compute → comm)
//! the sum's clear after the share's reading of it ([`DeviceShare::order_after_step`]); with
//! several ranks (each sharing its own partition), the gather of the share's weights to the
//! others, in the last pieces or with the whole partition.

use zeroflow_core::Float;
use zeroflow_device::{Device, DeviceBuffer, StreamKind};
use zeroflow_optim::AdamWStep;

use crate::EngineError;
use crate::device_adamw::{DeviceAdamState, DeviceAdamW};
use crate::host::{HostMoments, HostOptimizer};
use crate::memory::device_share_len;

/// The share's state on the device, and where it starts in the partition.
pub(super) struct DeviceShare<D: Device> {
    /// The share is the partition's elements from here to its end.
    from: usize,
    state: DeviceAdamState<D>,
    /// The share's gradients as f32, for the AdamW.
    grads: D::Buffer<f32>,
    /// Compute → d2h, h2d: the share's last step is done (once one was recorded).
    stepped: D::Event,
    recorded: bool,
    /// The device's state is newer than the host's copy of it.
    ahead: bool,
}

impl<D: DeviceAdamW> DeviceShare<D> {
    /// The share of `fraction` of the partition held by `host` (rounded down to whole packs of
    /// eight: [`device_share_len`]), its state copied from there; `None` where that is no
    /// element.
    pub fn new(
        device: &D,
        host: &HostOptimizer,
        fraction: f64,
    ) -> Result<Option<Self>, EngineError> {
        let len = host.master.len();
        let share = device_share_len(len, fraction);
        if share == 0 {
            return Ok(None);
        }
        let HostMoments::F32 { .. } = &host.moments else {
            return Err(EngineError::Config(
                "the optimizer's device share (--device-share, ZEROFLOW_DEVICE_SHARE, \
                 zeroflow.offload.device_share) needs fp32 moments \
                 (zeroflow.optimizer_state_dtype): set it to 0 for this run",
            ));
        };
        let from = len - share;
        // Filled from the host state by `restore`, with no host copy of it on the way.
        let state = DeviceAdamState {
            master: device.alloc::<f32>(share)?,
            exp_avg: device.alloc::<f32>(share)?,
            exp_avg_sq: device.alloc::<f32>(share)?,
        };
        let grads = device.alloc::<f32>(share)?;
        let stepped = device.new_event()?;
        let (recorded, ahead) = (false, false);
        let mut share = DeviceShare { from, state, grads, stepped, recorded, ahead };
        share.restore(device, host)?;
        Ok(Some(share))
    }

    /// Where the share starts in the partition: the CPU steps the elements before it.
    pub fn from(&self) -> usize {
        self.from
    }

    /// The share's step on the compute stream, after `norm_done`: its gradients, at `at + from`
    /// of `source` (the reduced gradients, or the window's sum), cast to f32; the AdamW of
    /// [`DeviceAdamW::adamw`], writing the weights at `params_at + from` of `params`.
    pub fn step<G: Float, P: Float>(
        &mut self,
        device: &D,
        step: &AdamWStep,
        norm_done: &D::Event,
        (source, at): (&D::Buffer<G>, usize),
        (params, params_at): (&D::Buffer<P>, usize),
    ) -> Result<(), EngineError> {
        let compute = device.stream(StreamKind::Compute);
        device.wait_event(compute, norm_done)?;
        let share = self.grads.len();
        let from = at + self.from;
        device.cast(compute, source, from..from + share, &self.grads, 0)?;
        device.adamw(
            compute,
            step,
            &self.state,
            0..share,
            &self.grads,
            params,
            params_at + self.from,
        )?;
        device.record(&mut self.stepped, compute)?;
        (self.recorded, self.ahead) = (true, true);
        Ok(())
    }

    /// Makes `kind`'s later work wait for the share's last step (and its reading of the
    /// gradients): before the window's sum is cleared on the comm stream.
    pub fn order_after_step(&self, device: &D, kind: StreamKind) -> Result<(), EngineError> {
        if self.recorded {
            device.wait_event(device.stream(kind), &self.stepped)?;
        }
        Ok(())
    }

    /// Brings the host's copy of the share's state up to date (after its last step).
    pub fn sync(&mut self, device: &D, host: &mut HostOptimizer) -> Result<(), EngineError> {
        if !self.ahead {
            return Ok(());
        }
        let d2h = device.stream(StreamKind::D2h);
        device.wait_event(d2h, &self.stepped)?;
        let HostMoments::F32 { exp_avg, exp_avg_sq } = &mut host.moments else {
            return Err(EngineError::Internal("a device share is built over fp32 moments"));
        };
        let share = self.grads.len();
        let targets = [&mut host.master, exp_avg, exp_avg_sq];
        for (source, target) in self.buffers().into_iter().zip(targets) {
            device.copy_d2h(d2h, source, 0..share, target, self.from)?.wait()?;
        }
        self.ahead = false;
        Ok(())
    }

    /// Takes the share's part of the host state (just restored) into the device's.
    pub fn restore(&mut self, device: &D, host: &HostOptimizer) -> Result<(), EngineError> {
        let HostMoments::F32 { exp_avg, exp_avg_sq } = &host.moments else {
            return Err(EngineError::Internal("a device share is built over fp32 moments"));
        };
        let h2d = device.stream(StreamKind::H2d);
        if self.recorded {
            // After the last step's AdamW read and wrote the state.
            device.wait_event(h2d, &self.stepped)?;
        }
        let (share, started) = (self.grads.len(), std::time::Instant::now());
        let sources = [&host.master, exp_avg, exp_avg_sq];
        for (target, source) in self.buffers().into_iter().zip(sources) {
            let from = self.from..self.from + share;
            device.copy_h2d(h2d, source, from, target, 0)?.wait()?;
        }
        let seconds = started.elapsed().as_secs_f64();
        tracing::debug!(
            "restore: the device share's state ({share} elements) uploaded in {seconds:.2} s"
        );
        self.ahead = false;
        Ok(())
    }

    /// The master weights and both moments on the device.
    fn buffers(&self) -> [&D::Buffer<f32>; 3] {
        [&self.state.master, &self.state.exp_avg, &self.state.exp_avg_sq]
    }
}
