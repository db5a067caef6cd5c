//! The optimizer's device share (`StreamOptions::device_share`): the last elements of the
//! partition keep their fp32 master weights and moments in device memory only, and the device's
//! AdamW steps them on the compute stream while the CPU streams the rest. The host memory the
//! exact step moves per step — the bound of that step (DESIGN.md §5) — shrinks by the share, and
//! so does the host memory the optimizer holds: the host optimizer's state is the partition's
//! first elements, up to [`DeviceShare::from`].
//!
//! Whatever reads the whole partition's state reads the share's from the device: a snapshot and
//! the master weights download it, a checkpoint's view joins the host's part (lent) to the
//! share's (downloaded a piece at a time as it is written, [`DeviceShare::view`]); a restore
//! reads the share's part of the saved state a piece at a time and uploads it
//! ([`DeviceShare::restore`]). The share starts from the partition's initial weights, uploaded
//! the same way, and zero moments.
//!
//! Events: the compute stream waits for `norm_done` (the comm stream is past the reductions and
//! the norm) before it casts the share's gradients; the weights it writes are read by the next
//! forward and backward on the same stream. `stepped` (compute → h2d) orders a restore's uploads
//! after the last step (a download waits for every stream); where the gradients are the window's
//! sum on the device, also (compute → comm) the sum's clear after the share's reading of it
//! ([`DeviceShare::order_after_step`]); with several ranks (each sharing its own partition), the
//! gather of the share's weights to the others, in the last pieces or with the whole partition.

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_device::{Device, DeviceBuffer, HostMemory, StreamKind};
use zeroflow_optim::{AdamWStep, NoDecay};

use super::state::SavedState;
use crate::EngineError;
use crate::checkpoint::{Elements, MomentView, PartView};
use crate::device_adamw::{DeviceAdamState, DeviceAdamW};
use crate::host::{HostMoments, HostOptimizer};

/// The elements a share's set-up and restore upload at a time, through two buffers of them
/// (64 MiB each, page-locked where the budget has room): one filled while the other is copied.
const UPLOAD_PIECE: usize = 1 << 24;

/// The bytes of each of a share's two upload buffers.
pub const SHARE_UPLOAD_PIECE_BYTES: usize = UPLOAD_PIECE * size_of::<f32>();

/// The host memory a share's set-up or restore holds beside the engine's: its two upload buffers.
pub const SHARE_UPLOAD_BYTES: usize = 2 * SHARE_UPLOAD_PIECE_BYTES;

/// The share's state on the device, and where it starts in the partition.
pub(super) struct DeviceShare<D: Device> {
    /// The share is the partition's elements from here to its end.
    from: usize,
    state: DeviceAdamState<D>,
    /// The share's gradients as f32, for the AdamW.
    grads: D::Buffer<f32>,
    /// Compute → h2d: the share's last step is done (once one was recorded).
    stepped: D::Event,
    recorded: bool,
}

impl<D: DeviceAdamW> DeviceShare<D> {
    /// The share of the partition's elements `from..` whose initial weights are `initial`
    /// (uploaded as f32 master weights; the moments zero); `None` where `initial` is empty. The
    /// share keeps fp32 moments: `moments` must say so. The partition's elements `no_decay`
    /// take no weight decay.
    pub fn new<P: Float>(
        device: &D,
        from: usize,
        initial: &[P],
        moments: OptimizerStateDtype,
        no_decay: &NoDecay,
    ) -> Result<Option<Self>, EngineError> {
        let share = initial.len();
        if share == 0 {
            return Ok(None);
        }
        if moments != OptimizerStateDtype::Fp32 {
            return Err(EngineError::Config(
                "the optimizer's device share (--device-share, ZEROFLOW_DEVICE_SHARE, \
                 zeroflow.offload.device_share) needs fp32 moments \
                 (zeroflow.optimizer_state_dtype): set it to 0 for this run",
            ));
        }
        let state = DeviceAdamState {
            master: device.alloc::<f32>(share)?,
            exp_avg: device.alloc::<f32>(share)?,
            exp_avg_sq: device.alloc::<f32>(share)?,
            no_decay: no_decay.within(from..from + share),
        };
        let grads = device.alloc::<f32>(share)?;
        let stepped = device.new_event()?;
        let share = DeviceShare { from, state, grads, stepped, recorded: false };
        let master = &share.state.master;
        device.upload_in_pieces(master, UPLOAD_PIECE, HostMemory::Pinned, |range, piece| {
            piece.iter_mut().zip(&initial[range]).for_each(|(m, p)| *m = p.to_f32());
            Ok::<_, EngineError>(())
        })?;
        let compute = device.stream(StreamKind::Compute);
        for moment in [&share.state.exp_avg, &share.state.exp_avg_sq] {
            device.fill(compute, moment, 0..moment.len(), 0.0)?;
        }
        device.synchronize()?;
        Ok(Some(share))
    }

    /// Where the share starts in the partition: the CPU steps the elements before it (and the
    /// host optimizer holds only theirs).
    pub fn from(&self) -> usize {
        self.from
    }

    /// The share's step on the compute stream, after `norm_done`: its gradients, at `at + from`
    /// of `source` (the reduced gradients, or the window's sum), cast to f32; the AdamW of
    /// [`DeviceAdamState::step`], writing the weights at `params_at + from` of `params`.
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
        let (grads, out_at) = (&self.grads, params_at + self.from);
        self.state.step(device, compute, step, 0..share, grads, params, out_at)?;
        device.record(&mut self.stepped, compute)?;
        self.recorded = true;
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

    /// Takes the share's part of the partition's saved state (`from..`) into the device's, a
    /// piece at a time (the host's part is the host optimizer's to restore).
    fn restore(&mut self, device: &D, saved: &SavedState<'_>) -> Result<(), EngineError> {
        let share = self.grads.len();
        if saved.len() != self.from + share {
            return Err(EngineError::Internal(
                "a restored state's length differs from the partition's",
            ));
        }
        if self.recorded {
            // After the last step's AdamW read and wrote the state.
            device.wait_event(device.stream(StreamKind::H2d), &self.stepped)?;
        }
        let started = std::time::Instant::now();
        for (array, target) in self.buffers().into_iter().enumerate() {
            let from = self.from;
            device.upload_in_pieces(target, UPLOAD_PIECE, HostMemory::Pinned, |range, piece| {
                saved.read_array(array, from + range.start..from + range.end, piece)
            })?;
        }
        let seconds = started.elapsed().as_secs_f64();
        tracing::debug!(
            "restore: the device share's state ({share} elements) read and uploaded in {seconds:.2} s"
        );
        Ok(())
    }

    /// The master weights and both moments on the device.
    fn buffers(&self) -> [&D::Buffer<f32>; 3] {
        [&self.state.master, &self.state.exp_avg, &self.state.exp_avg_sq]
    }
}

/// The whole partition's master weights: the host optimizer's, with a device share's downloaded
/// after them (after its last step).
pub(super) fn master<D: DeviceAdamW>(
    share: Option<&DeviceShare<D>>,
    device: &D,
    host: &HostOptimizer,
) -> Result<Vec<f32>, EngineError> {
    let mut master = host.master.to_vec();
    if let Some(share) = share {
        master.extend_from_slice(&device.download(&share.state.master)?);
    }
    Ok(master)
}

/// The whole partition's state, `[master, exp_avg, exp_avg_sq]` as f32: the host optimizer's,
/// with a device share's downloaded after it (after its last step).
pub(super) fn state<D: DeviceAdamW>(
    share: Option<&DeviceShare<D>>,
    device: &D,
    host: &HostOptimizer,
) -> Result<[Vec<f32>; 3], EngineError> {
    let mut state = host.to_f32();
    if let Some(share) = share {
        for (out, buffer) in state.iter_mut().zip(share.buffers()) {
            out.extend_from_slice(&device.download(buffer)?);
        }
    }
    Ok(state)
}

/// The partition `flat`'s state as a checkpoint writes it: the host optimizer's lent, a device
/// share's joined after it, downloaded a piece at a time as it is written (after its last step).
pub(super) fn view<'a, D: DeviceAdamW>(
    share: Option<&'a DeviceShare<D>>,
    device: &'a D,
    host: &'a HostOptimizer,
    flat: Range<usize>,
) -> Result<PartView<'a>, EngineError> {
    let Some(share) = share else {
        return Ok(host.view(flat));
    };
    let HostMoments::F32 { exp_avg, exp_avg_sq } = &host.moments else {
        return Err(EngineError::Internal("a device share is built over fp32 moments"));
    };
    let len = share.grads.len();
    let joined = |head: &'a [f32], tail: &'a D::Buffer<f32>| Elements::Joined {
        head,
        tail: Box::new(Elements::downloaded(device, tail, len)),
    };
    let [master, m, v] = share.buffers();
    Ok(PartView {
        flat,
        master: joined(&host.master, master),
        exp_avg: MomentView::F32(joined(exp_avg, m)),
        exp_avg_sq: MomentView::F32(joined(exp_avg_sq, v)),
        zenflow: None,
    })
}

/// Takes the partition's saved state: the host's part into the host optimizer, in place, and a
/// device share's into the device, a piece at a time.
pub(super) fn restore<D: DeviceAdamW>(
    share: Option<&mut DeviceShare<D>>,
    device: &D,
    host: &mut HostOptimizer,
    saved: &SavedState<'_>,
) -> Result<(), EngineError> {
    let Some(share) = share else {
        return host.restore(saved);
    };
    host.restore_head(saved)?;
    share.restore(device, saved)
}

#[cfg(test)]
mod tests {
    use zeroflow_core::layout::{Alignment, FlatLayout, ParamSpec};
    use zeroflow_device::CpuDevice;

    use super::super::path::UpdatePath;
    use super::super::stream::StreamCpu;
    use super::*;
    use crate::{AccumulateOn, Offload, Placement};

    /// With a device share the host optimizer holds the partition's elements before the share
    /// and no more, and the whole state reads back as the initial weights and zero moments (the
    /// share's part from the device): one micro-step per step (streamed) and two summed on the
    /// device, several shares, bf16 and f32 weights.
    #[test]
    fn the_host_holds_only_the_elements_before_the_share() {
        check::<f32>();
        check::<zeroflow_core::bf16>();
    }

    fn check<P: Float>() {
        let specs = [ParamSpec::new("w", [37, 29]), ParamSpec::new("b", [29])];
        let layout = FlatLayout::new(&specs, 1, Alignment::default()).unwrap();
        let n = layout.padded_len();
        let initial: Vec<P> = (0..n).map(|i| P::from_f32((i % 97) as f32 * 0.25 - 6.0)).collect();
        let device = CpuDevice::new().unwrap();
        for (grad_accum, share) in [(1, 0.3), (1, 0.9), (2, 0.5), (1, 0.0)] {
            let mut offload = Offload::exact(HostMemory::Pageable, 1);
            offload.stream.device_share = share;
            offload.stream.chunk = 64;
            offload.stream.accumulate_on = AccumulateOn::Device;
            let opts = crate::memory::tests::options(Placement::Offload(offload), grad_accum);
            let from = n - crate::memory::device_share_len(n, share);
            let what =
                format!("accumulation {grad_accum}, share {share} ({} of {n} on the host)", from);
            let path =
                UpdatePath::<CpuDevice, P>::new(&device, &layout, &(0..n), &opts, initial.clone())
                    .unwrap();
            let (host_len, state) = match path {
                UpdatePath::Stream(mut stream) => {
                    let host_len = match &stream.cpu {
                        StreamCpu::Inline(buffers) => buffers.state.master.len(),
                        StreamCpu::Delayed(_) => panic!("{what}: the delayed update"),
                    };
                    (host_len, stream.state(&device).unwrap())
                }
                UpdatePath::Summed(mut summed) => {
                    (summed.buffers.state.master.len(), summed.state(&device).unwrap())
                }
                _ => panic!("{what}: neither the streamed nor the summed path"),
            };
            assert_eq!(host_len, from, "{what}");
            let want: Vec<f32> = initial.iter().map(|p| p.to_f32()).collect();
            assert_eq!(state.master, want, "{what}: master weights");
            assert_eq!(state.exp_avg, vec![0.0; n], "{what}: first moments");
            assert_eq!(state.exp_avg_sq, vec![0.0; n], "{what}: second moments");
        }
    }
}
