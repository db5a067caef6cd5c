//! The optimizer's device share (`StreamOptions::device_share`): the last elements of the
//! partition keep their fp32 master weights and moments in device memory only, and the device's
//! AdamW steps them on the compute stream while the CPU streams the rest; or
//! (`StreamOptions::device_share_state`: host) keep them in page-locked host memory, staged
//! through a few device slots a piece at a time on two streams of the share's own ([`Staged`]).
//! The host memory the exact step moves per step — the bound of that step (DESIGN.md §5) —
//! shrinks by the share, and so does the host memory the optimizer holds: the host optimizer's
//! state is the partition's first elements, up to [`DeviceShare::from`].
//!
//! Whatever reads the whole partition's state reads the share's from the device: a snapshot and
//! the master weights download it, a checkpoint's view joins the host's part (lent) to the
//! share's (downloaded a piece at a time as it is written, [`view`]); a restore
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
use zeroflow_device::{Device, DeviceBuffer, HostBuffer, HostMemory, StreamKind};
use zeroflow_optim::{AdamWStep, NoDecay};

use super::state::SavedState;
use crate::EngineError;
use crate::checkpoint::{Elements, MomentView, PartView};
use crate::device_adamw::{DeviceAdamState, DeviceAdamW};
use crate::host::{HostMoments, HostOptimizer};
use crate::options::ShareState;

/// The elements a share's set-up and restore upload at a time, through two buffers of them
/// (64 MiB each, page-locked where the budget has room): one filled while the other is copied.
const UPLOAD_PIECE: usize = 1 << 24;

/// The bytes of each of a share's two upload buffers.
pub const SHARE_UPLOAD_PIECE_BYTES: usize = UPLOAD_PIECE * size_of::<f32>();

/// The host memory a share's set-up or restore holds beside the engine's: its two upload buffers.
pub const SHARE_UPLOAD_BYTES: usize = 2 * SHARE_UPLOAD_PIECE_BYTES;

/// The elements a share whose state lives in host memory ([`ShareState::Host`]) copies up,
/// steps and copies back at a time, at most (64 MiB per array), and the device buffers it cycles
/// them through: one piece copied up while one is stepped and one copied back.
const STAGED_PIECE: usize = 1 << 24;
const STAGED_SLOTS: usize = 3;

/// The elements of each piece of a share staged from host memory, for stream chunks of
/// `chunk` elements: twice a chunk (so that the small chunks of the tests cut several pieces),
/// at most [`STAGED_PIECE`], whole packs of eight.
pub(crate) fn staged_piece(chunk: usize) -> usize {
    (chunk.saturating_mul(2).min(STAGED_PIECE) / 8 * 8).max(8)
}

/// The device memory a share of `len` elements staged from host memory in pieces of `piece`
/// holds, in bytes: its slots' state and f32 gradients.
pub(crate) fn staged_device_bytes(len: usize, piece: usize) -> usize {
    let slots = STAGED_SLOTS.min(len.div_ceil(piece));
    slots * 4 * piece.min(len) * size_of::<f32>()
}

/// The share's state, and where it starts in the partition.
pub(super) struct DeviceShare<D: Device> {
    /// The share is the partition's elements from here to its end.
    from: usize,
    len: usize,
    place: Place<D>,
    /// → compute and h2d: the share's last step is done (once one was recorded): recorded on
    /// the compute stream (state on the device) or on the staging's load stream.
    stepped: D::Event,
    recorded: bool,
}

/// Where a share's state lives ([`ShareState`]).
enum Place<D: Device> {
    Device {
        state: DeviceAdamState<D>,
        /// The share's gradients as f32, for the AdamW.
        grads: D::Buffer<f32>,
    },
    Host(Box<Staged<D>>),
}

/// A share's state in page-locked host memory, a piece at a time, and the device buffers its
/// step stages them through. Each piece is copied up on the `load` stream (after the slot's last
/// download), stepped there (after `norm_done` and `compute_done`: the gradients are final, the
/// last forward and backward are done with the weights) and copied back on the `store` stream
/// (after the slot's `stepped`). The training thread queues the pieces as the slots come free:
/// [`DeviceShare::pump`] between the CPU's chunks, without waiting, and [`DeviceShare::finish`]
/// the rest, after which the compute stream waits for the last step.
struct Staged<D: Device> {
    /// `[master, exp_avg, exp_avg_sq]` of each piece.
    pieces: Vec<[HostBuffer<f32>; 3]>,
    piece: usize,
    slots: Vec<Slot<D>>,
    load: D::Stream,
    store: D::Stream,
    /// The step under way, and its pieces queued up (and stepped) and back.
    step: Option<AdamWStep>,
    loaded: usize,
    stored: usize,
}

/// One piece's device buffers, and the events of its last use.
struct Slot<D: Device> {
    state: DeviceAdamState<D>,
    grads: D::Buffer<f32>,
    /// Load → store: the piece's copies up are done (the host may copy into its buffers).
    loaded: D::Event,
    /// Load → store: the piece is stepped.
    stepped: D::Event,
    /// Store → load: the piece's copies back are done (the slot may take the next).
    stored: D::Event,
    used: bool,
}

impl<D: DeviceAdamW> DeviceShare<D> {
    /// The share of the partition's elements `from..` whose initial weights are `initial`
    /// (taken as f32 master weights; the moments zero), its state kept as `state` says (in host
    /// memory: staged through the device in pieces of `piece` elements); `None` where `initial`
    /// is empty. The share keeps fp32 moments: `moments` must say so. The partition's elements
    /// `no_decay` take no weight decay.
    pub fn new<P: Float>(
        device: &D,
        from: usize,
        initial: &[P],
        moments: OptimizerStateDtype,
        no_decay: &NoDecay,
        (state, piece): (ShareState, usize),
    ) -> Result<Option<Self>, EngineError> {
        let len = initial.len();
        if len == 0 {
            return Ok(None);
        }
        if moments != OptimizerStateDtype::Fp32 {
            return Err(EngineError::Config(
                "the optimizer's device share (--device-share, ZEROFLOW_DEVICE_SHARE, \
                 zeroflow.offload.device_share) needs fp32 moments \
                 (zeroflow.optimizer_state_dtype): set it to 0 for this run",
            ));
        }
        let no_decay = no_decay.within(from..from + len);
        let place = match state {
            ShareState::Device => {
                let state = DeviceAdamState {
                    master: device.alloc::<f32>(len)?,
                    exp_avg: device.alloc::<f32>(len)?,
                    exp_avg_sq: device.alloc::<f32>(len)?,
                    no_decay,
                };
                let master = &state.master;
                device.upload_in_pieces(
                    master,
                    UPLOAD_PIECE,
                    HostMemory::Pinned,
                    |range, piece| {
                        piece.iter_mut().zip(&initial[range]).for_each(|(m, p)| *m = p.to_f32());
                        Ok::<_, EngineError>(())
                    },
                )?;
                let compute = device.stream(StreamKind::Compute);
                for moment in [&state.exp_avg, &state.exp_avg_sq] {
                    device.fill(compute, moment, 0..moment.len(), 0.0)?;
                }
                device.synchronize()?;
                Place::Device { state, grads: device.alloc::<f32>(len)? }
            }
            ShareState::Host => {
                Place::Host(Box::new(Staged::new(device, initial, piece, no_decay)?))
            }
        };
        let stepped = device.new_event()?;
        Ok(Some(DeviceShare { from, len, place, stepped, recorded: false }))
    }

    /// Where the share starts in the partition: the CPU steps the elements before it (and the
    /// host optimizer holds only theirs).
    pub fn from(&self) -> usize {
        self.from
    }

    /// True where the share's state lives in host memory: its step is queued piece by piece
    /// ([`DeviceShare::pump`], [`DeviceShare::finish`]).
    pub fn staged(&self) -> bool {
        matches!(self.place, Place::Host(_))
    }

    /// True while a staged step is under way (started, not yet finished).
    pub fn running(&self) -> bool {
        matches!(&self.place, Place::Host(staged) if staged.step.is_some())
    }

    /// Starts the share's step: its gradients, at `at + from` of `source` (the reduced
    /// gradients, or the window's sum), cast to f32; the AdamW of [`DeviceAdamState::step`],
    /// writing the weights at `params_at + from` of `params`; after `norm_done` and
    /// `compute_done` (`events`). With the state on the device, all of it on the compute stream;
    /// staged from host memory, the first pieces queued, the rest by [`DeviceShare::pump`] and
    /// [`DeviceShare::finish`], which the caller must call before anything reads the weights.
    pub fn step<G: Float, P: Float>(
        &mut self,
        device: &D,
        step: &AdamWStep,
        (norm_done, compute_done): (&D::Event, &D::Event),
        source: (&D::Buffer<G>, usize),
        params: (&D::Buffer<P>, usize),
    ) -> Result<(), EngineError> {
        match &mut self.place {
            Place::Device { state, grads } => {
                let compute = device.stream(StreamKind::Compute);
                device.wait_event(compute, norm_done)?;
                let (source, at) = source;
                let from = at + self.from;
                device.cast(compute, source, from..from + self.len, grads, 0)?;
                let (params, params_at) = params;
                state.step(
                    device,
                    compute,
                    step,
                    0..self.len,
                    grads,
                    params,
                    params_at + self.from,
                )?;
                device.record(&mut self.stepped, compute)?;
                self.recorded = true;
            }
            Place::Host(staged) => {
                if staged.step.is_some() {
                    return Err(EngineError::Internal("a device share's step was left unfinished"));
                }
                for event in [norm_done, compute_done] {
                    device.wait_event(&staged.load, event)?;
                }
                (staged.step, staged.loaded, staged.stored) = (Some(*step), 0, 0);
                staged.pump(device, self.from, source, params, false)?;
            }
        }
        Ok(())
    }

    /// Queues what the share's staged step can without waiting: pieces up into the free slots,
    /// and back from those whose copies up are done. Nothing where the state is on the device.
    pub fn pump<G: Float, P: Float>(
        &mut self,
        device: &D,
        source: (&D::Buffer<G>, usize),
        params: (&D::Buffer<P>, usize),
    ) -> Result<(), EngineError> {
        match &mut self.place {
            Place::Host(staged) if staged.step.is_some() => {
                staged.pump(device, self.from, source, params, false)
            }
            _ => Ok(()),
        }
    }

    /// Queues the rest of the share's staged step (waiting for slots as they come free) and
    /// makes the compute stream wait for its last piece: the weights it wrote, the gradients it
    /// read. Nothing where the state is on the device (stepped on the compute stream).
    pub fn finish<G: Float, P: Float>(
        &mut self,
        device: &D,
        source: (&D::Buffer<G>, usize),
        params: (&D::Buffer<P>, usize),
    ) -> Result<(), EngineError> {
        let Place::Host(staged) = &mut self.place else { return Ok(()) };
        if staged.step.is_none() {
            return Ok(());
        }
        staged.pump(device, self.from, source, params, true)?;
        staged.step = None;
        device.record(&mut self.stepped, &staged.load)?;
        self.recorded = true;
        device.wait_event(device.stream(StreamKind::Compute), &self.stepped)?;
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

    /// An error where a staged step is still under way (its state half written).
    fn settled(&self) -> Result<(), EngineError> {
        match self.running() {
            true => Err(EngineError::Internal("a device share's state was read during its step")),
            false => Ok(()),
        }
    }

    /// Takes the share's part of the partition's saved state (`from..`) into the share's, a
    /// piece at a time (the host's part is the host optimizer's to restore).
    fn restore(&mut self, device: &D, saved: &SavedState<'_>) -> Result<(), EngineError> {
        self.settled()?;
        if saved.len() != self.from + self.len {
            return Err(EngineError::Internal(
                "a restored state's length differs from the partition's",
            ));
        }
        let started = std::time::Instant::now();
        let from = self.from;
        match &mut self.place {
            Place::Device { state, .. } => {
                if self.recorded {
                    // After the last step's AdamW read and wrote the state.
                    device.wait_event(device.stream(StreamKind::H2d), &self.stepped)?;
                }
                for (array, target) in state.arrays().into_iter().enumerate() {
                    device.upload_in_pieces(
                        target,
                        UPLOAD_PIECE,
                        HostMemory::Pinned,
                        |r, piece| saved.read_array(array, from + r.start..from + r.end, piece),
                    )?;
                }
            }
            Place::Host(staged) => {
                // (Writing a piece waits for the copies still reading or writing it.)
                for (p, arrays) in staged.pieces.iter_mut().enumerate() {
                    let at = from + p * staged.piece;
                    for (array, target) in arrays.iter_mut().enumerate() {
                        let target = &mut target[..];
                        saved.read_array(array, at..at + target.len(), target)?;
                    }
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        let len = self.len;
        tracing::debug!(
            "restore: the device share's state ({len} elements) read in {seconds:.2} s"
        );
        Ok(())
    }

    /// Array `array` of the share's state (0 the master weights, 1 and 2 the moments), whole.
    fn array(&self, device: &D, array: usize) -> Result<Vec<f32>, EngineError> {
        self.settled()?;
        Ok(match &self.place {
            Place::Device { state, .. } => device.download(state.arrays()[array])?,
            Place::Host(staged) => {
                staged.pieces.iter().flat_map(|p| p[array].iter().copied()).collect()
            }
        })
    }

    /// Array `array` of the share's state as a checkpoint writes it: downloaded a piece at a
    /// time from the device, or read from host memory.
    fn elements<'a>(&'a self, device: &'a D, array: usize) -> Elements<'a, f32> {
        match &self.place {
            Place::Device { state, .. } => {
                Elements::downloaded(device, state.arrays()[array], self.len)
            }
            Place::Host(staged) => {
                let (pieces, piece) = (&staged.pieces, staged.piece);
                let fetch = move |range: Range<usize>| {
                    let mut out = Vec::with_capacity(range.len());
                    let mut at = range.start;
                    while at < range.end {
                        let (p, within) = (at / piece, at % piece);
                        let take = (piece - within).min(range.end - at);
                        out.extend_from_slice(&pieces[p][array][within..within + take]);
                        at += take;
                    }
                    Ok(out)
                };
                Elements::Fetched { len: self.len, fetch: Box::new(fetch) }
            }
        }
    }
}

impl<D: DeviceAdamW> Staged<D> {
    /// The state of `initial` (master weights; the moments zero) in page-locked host memory in
    /// pieces of `piece` elements, and the slots and streams its step goes through.
    fn new<P: Float>(
        device: &D,
        initial: &[P],
        piece: usize,
        no_decay: NoDecay,
    ) -> Result<Self, EngineError> {
        let mut pieces = Vec::with_capacity(initial.len().div_ceil(piece));
        for weights in initial.chunks(piece) {
            let alloc = || device.alloc_host::<f32>(weights.len(), HostMemory::Pinned);
            let mut master = alloc()?;
            master.iter_mut().zip(weights).for_each(|(m, p)| *m = p.to_f32());
            pieces.push([master, alloc()?, alloc()?]);
        }
        let slot_len = piece.min(initial.len());
        let mut slots = Vec::with_capacity(STAGED_SLOTS);
        for _ in 0..STAGED_SLOTS.min(pieces.len()) {
            let state = DeviceAdamState {
                master: device.alloc::<f32>(slot_len)?,
                exp_avg: device.alloc::<f32>(slot_len)?,
                exp_avg_sq: device.alloc::<f32>(slot_len)?,
                // The share's, counted from its start: a slot steps a piece of it shifted.
                no_decay: no_decay.clone(),
            };
            let grads = device.alloc::<f32>(slot_len)?;
            let [loaded, stepped, stored] = [(); 3].map(|()| device.new_event());
            let (loaded, stepped, stored) = (loaded?, stepped?, stored?);
            slots.push(Slot { state, grads, loaded, stepped, stored, used: false });
        }
        let (load, store) = (device.new_stream("share-load")?, device.new_stream("share-store")?);
        Ok(Staged { pieces, piece, slots, load, store, step: None, loaded: 0, stored: 0 })
    }

    /// Queues pieces of the step under way: up and stepped while a slot is free (its last
    /// download queued), back once their copies up are done; with `all`, until every piece is
    /// queued back (waiting for the copies up where they are not done), else only what needs
    /// no wait. The share starts at `from` of the partition.
    fn pump<G: Float, P: Float>(
        &mut self,
        device: &D,
        from: usize,
        (source, at): (&D::Buffer<G>, usize),
        (params, params_at): (&D::Buffer<P>, usize),
        all: bool,
    ) -> Result<(), EngineError> {
        let step =
            self.step.ok_or(EngineError::Internal("a device share's step is not under way"))?;
        let (count, slots) = (self.pieces.len(), self.slots.len());
        while self.stored < count {
            while self.loaded < count && self.loaded < self.stored + slots {
                let k = self.loaded;
                let range = k * self.piece..k * self.piece + self.pieces[k][0].len();
                let slot = &mut self.slots[k % slots];
                if slot.used {
                    device.wait_event(&self.load, &slot.stored)?;
                }
                for (host, target) in self.pieces[k].iter().zip(slot.state.arrays()) {
                    device.copy_h2d(&self.load, host, 0..range.len(), target, 0)?.detach();
                }
                device.record(&mut slot.loaded, &self.load)?;
                let grads = at + from + range.start..at + from + range.end;
                device.cast(&self.load, source, grads, &slot.grads, 0)?;
                // The piece is the share's elements from `range.start`.
                let (shift, out) = (range.start, params_at + from + range.start);
                let (load, grads) = (&self.load, &slot.grads);
                let within = 0..range.len();
                slot.state.step_shifted(device, load, &step, shift, within, grads, params, out)?;
                device.record(&mut slot.stepped, &self.load)?;
                slot.used = true;
                self.loaded += 1;
            }
            let k = self.stored;
            let slot = &mut self.slots[k % slots];
            // Queuing a piece's copies back waits (on the host) for its copies up, which read
            // the same host buffers: without `all`, only once they are done.
            if !all && !device.event_done(&slot.loaded)? {
                break;
            }
            device.wait_event(&self.store, &slot.stepped)?;
            for (host, source) in self.pieces[k].iter_mut().zip(slot.state.arrays()) {
                let len = host.len();
                device.copy_d2h(&self.store, source, 0..len, host, 0)?.detach();
            }
            device.record(&mut slot.stored, &self.store)?;
            self.stored += 1;
        }
        Ok(())
    }
}

/// The whole partition's master weights: the host optimizer's, with a device share's after
/// them (after its last step).
pub(super) fn master<D: DeviceAdamW>(
    share: Option<&DeviceShare<D>>,
    device: &D,
    host: &HostOptimizer,
) -> Result<Vec<f32>, EngineError> {
    let mut master = host.master.to_vec();
    if let Some(share) = share {
        master.extend_from_slice(&share.array(device, 0)?);
    }
    Ok(master)
}

/// The whole partition's state, `[master, exp_avg, exp_avg_sq]` as f32: the host optimizer's,
/// with a device share's after it (after its last step).
pub(super) fn state<D: DeviceAdamW>(
    share: Option<&DeviceShare<D>>,
    device: &D,
    host: &HostOptimizer,
) -> Result<[Vec<f32>; 3], EngineError> {
    let mut state = host.to_f32();
    if let Some(share) = share {
        for (array, out) in state.iter_mut().enumerate() {
            out.extend_from_slice(&share.array(device, array)?);
        }
    }
    Ok(state)
}

/// The partition `flat`'s state as a checkpoint writes it: the host optimizer's lent, a device
/// share's joined after it, downloaded a piece at a time as it is written, or read from host
/// memory (after its last step).
pub(super) fn view<'a, D: DeviceAdamW>(
    share: Option<&'a DeviceShare<D>>,
    device: &'a D,
    host: &'a HostOptimizer,
    flat: Range<usize>,
) -> Result<PartView<'a>, EngineError> {
    let Some(share) = share else {
        return Ok(host.view(flat));
    };
    share.settled()?;
    let HostMoments::F32 { exp_avg, exp_avg_sq } = &host.moments else {
        return Err(EngineError::Internal("a device share is built over fp32 moments"));
    };
    let joined = |head: &'a [f32], array| Elements::Joined {
        head,
        tail: Box::new(share.elements(device, array)),
    };
    Ok(PartView {
        flat,
        master: joined(&host.master, 0),
        exp_avg: MomentView::F32(joined(exp_avg, 1)),
        exp_avg_sq: MomentView::F32(joined(exp_avg_sq, 2)),
        zenflow: None,
    })
}

/// Takes the partition's saved state: the host's part into the host optimizer, in place, and a
/// device share's where it lives, a piece at a time.
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
