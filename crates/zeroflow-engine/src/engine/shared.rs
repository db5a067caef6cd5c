//! What every update path uses: the flat buffers, the events shared by the paths, the norm's
//! way to the host, the all-gather of the updated partitions, and the normalisation of a
//! gradient norm.

use std::ops::Range;
use std::time::Duration;

use zeroflow_core::Float;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{
    Comm, DOWNLOAD_CHUNK_BYTES, Device, HostBuffer, HostMemory, Kernels, ReduceOp, StreamKind,
};

use crate::host::StepTimes;
use crate::{EngineError, Stage};

/// The events that more than one path records or waits on (see the table in `path.rs`).
pub(super) struct Events<D: Device> {
    /// Compute → comm: a bucket's gradients are complete.
    pub bucket_ready: D::Event,
    /// Comm and d2h → compute: the last backward's gradients have been consumed.
    pub comm_done: Option<D::Event>,
    pub d2h_done: Option<D::Event>,
    /// → compute: the weights are updated.
    pub params_ready: Option<D::Event>,
    /// Compute → h2d/comm: the last forward/backward has stopped reading the weights.
    pub compute_done: D::Event,
    /// Comm → d2h/compute: the global norm is computed.
    pub norm_done: D::Event,
}

impl<D: Device> Events<D> {
    pub fn new(device: &D) -> Result<Self, EngineError> {
        Ok(Events {
            bucket_ready: device.new_event()?,
            comm_done: None,
            d2h_done: None,
            params_ready: None,
            compute_done: device.new_event()?,
            norm_done: device.new_event()?,
        })
    }
}

/// One rank's flat buffers and what the paths share.
pub(super) struct Shared<D: Device, C: Comm<Device = D>, P: Float> {
    pub device: D,
    pub comm: C,
    pub layout: FlatLayout,
    pub stage: Stage,
    pub clip: Option<f64>,
    /// The flat elements whose optimizer state this rank holds.
    pub owned: Range<usize>,
    pub params: D::Buffer<P>,
    pub grads: D::Buffer<P>,
    /// The reduced gradients of `owned` (stages 1 and 2 with more than one rank).
    pub reduced: Option<D::Buffer<P>>,
    pub norm: D::Buffer<f32>,
    pub norm_host: HostBuffer<f32>,
    pub events: Events<D>,
    /// Time the calling thread has spent on or waiting for the CPU optimizer
    /// ([`crate::Engine::cpu_wait`]).
    pub cpu_wait: Duration,
    /// Where the training thread's optimizer steps went ([`crate::Engine::step_times`]).
    pub step_times: StepTimes,
}

impl<D: Device + Kernels, C: Comm<Device = D>, P: Float> Shared<D, C, P> {
    /// True if the ranks hold parts of the gradients (stages 1 and 2 with several ranks), so
    /// that sums over them need an all-reduce.
    pub fn across_ranks(&self) -> bool {
        self.comm.world_size() > 1 && self.stage != Stage::Zero0
    }

    /// Where this rank's reduced gradients are: the `reduced` buffer from its start (stages 1
    /// and 2 with several ranks), or the gradient buffer at the partition's start.
    pub fn reduced_source(&self) -> (&D::Buffer<P>, usize) {
        reduced_source::<D, P>(&self.reduced, &self.grads, self.owned.start)
    }

    /// Records where the gradients of this backward were last read (the comm stream, and the
    /// d2h stream where the path copies them out), so the next backward waits.
    pub fn record_consumers(&mut self, offloads: bool) -> Result<(), EngineError> {
        self.record_comm_done()?;
        if offloads {
            self.record_d2h_done()?;
        }
        Ok(())
    }

    /// Records `comm_done` on the comm stream: what it has queued so far is the last read of the
    /// gradients.
    pub fn record_comm_done(&mut self) -> Result<(), EngineError> {
        let comm_done = slot(&mut self.events.comm_done, &self.device)?;
        self.device.record(comm_done, self.device.stream(StreamKind::Comm))?;
        Ok(())
    }

    /// Records `params_ready` on `stream`: what it has queued so far writes the weights last.
    pub fn record_params_ready(&mut self, stream: StreamKind) -> Result<(), EngineError> {
        let params_ready = slot(&mut self.events.params_ready, &self.device)?;
        self.device.record(params_ready, self.device.stream(stream))?;
        Ok(())
    }

    /// Records `d2h_done` on the d2h stream: what it has queued so far is the last read of the
    /// gradients (or of what was set aside from them).
    pub fn record_d2h_done(&mut self) -> Result<(), EngineError> {
        let d2h_done = slot(&mut self.events.d2h_done, &self.device)?;
        self.device.record(d2h_done, self.device.stream(StreamKind::D2h))?;
        Ok(())
    }

    /// Orders the h2d stream after everything that reads or writes the weights: the last
    /// forward/backward and the last gather.
    pub fn h2d_after_weights_free(&self) -> Result<(), EngineError> {
        let h2d = self.device.stream(StreamKind::H2d);
        self.device.wait_event(h2d, &self.events.compute_done)?;
        if let Some(gathered) = &self.events.params_ready {
            self.device.wait_event(h2d, gathered)?;
        }
        Ok(())
    }

    /// Σ g² of `range` of `source` on the comm stream, summed over the ranks and read to the
    /// host (in loss-scaled, summed units).
    pub fn comm_sum_squares(
        &mut self,
        source: &D::Buffer<f32>,
        range: Range<usize>,
    ) -> Result<f64, EngineError> {
        let comm_stream = self.device.stream(StreamKind::Comm);
        self.device.sum_squares(comm_stream, source, range, &self.norm, 0)?;
        self.read_norm()
    }

    /// Σ g² over this step's reduced gradients, still on the device, on the comm stream: the
    /// compute stream wrote them (one rank) or the comm stream reduced them after it.
    pub fn reduced_sum_squares(&mut self) -> Result<f64, EngineError> {
        let comm_stream = self.device.stream(StreamKind::Comm);
        self.device.wait_event(comm_stream, &self.events.compute_done)?;
        let (source, at) = self.reduced_source();
        let range = at..at + self.owned.len();
        self.device.sum_squares(comm_stream, source, range, &self.norm, 0)?;
        self.read_norm()
    }

    /// The norm the comm stream has queued into `norm`, summed over the ranks where they hold
    /// parts, on the host.
    pub fn read_norm(&mut self) -> Result<f64, EngineError> {
        let across = self.across_ranks();
        let (norm, host) = (&self.norm, &mut self.norm_host);
        let done = &mut self.events.norm_done;
        let read =
            sum_to_host(&self.device, &self.comm, across, StreamKind::Comm, done, norm, host)?;
        Ok(f64::from(read[0]))
    }

    /// Records that `writer` has written this rank's partition of the weights and gathers the
    /// other partitions after it; `params_ready` then marks the weights current.
    pub fn gather_from(&mut self, writer: StreamKind) -> Result<(), EngineError> {
        self.record_params_ready(writer)?;
        if let Some(written) = &self.events.params_ready
            && self.owned.len() < self.layout.padded_len()
        {
            // Gather the other partitions once this rank's is written and nothing reads the
            // weights any more.
            let comm_stream = self.device.stream(StreamKind::Comm);
            self.device.wait_event(comm_stream, written)?;
            self.device.wait_event(comm_stream, &self.events.compute_done)?;
            let everything = 0..self.layout.padded_len();
            let own = self.owned.clone();
            self.comm.all_gather(comm_stream, &self.params, own, &self.params, everything)?;
            self.record_params_ready(StreamKind::Comm)?;
        }
        Ok(())
    }
}

/// A gradient norm in the model's units and what follows from it for the step.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Normalised {
    pub grad_norm: f64,
    /// The clip coefficient (1 where the norm is within the clip, or not finite).
    pub clip_coef: f64,
    /// The factor the optimizer multiplies the summed gradients by: clip over the sum's count.
    pub grad_scale: f32,
}

/// The norm of gradients summed over `ranks` ranks and `steps` micro-steps (or window steps) at
/// `loss_scale`, from their Σ g², clipped to `clip`: the one place the engine's step and
/// ZenFlow's window step compute it.
pub(crate) fn normalise(
    sum_squares: f64,
    loss_scale: f32,
    ranks: usize,
    steps: u64,
    clip: Option<f64>,
) -> Normalised {
    let summed = f64::from(loss_scale) * ranks as f64 * steps as f64;
    let grad_norm = sum_squares.sqrt() / summed;
    let clip_coef = match clip {
        Some(max) if grad_norm + 1e-6 > max => max / (grad_norm + 1e-6),
        _ => 1.0,
    };
    Normalised { grad_norm, clip_coef, grad_scale: (clip_coef / summed) as f32 }
}

/// Reads `buf[..host.len()]` into `host` once what `writer` has queued so far is done, summed
/// over the ranks first when `across` (an all-reduce on the comm stream): `event` is recorded on
/// the writer (and again after the all-reduce), the copy runs on the d2h stream and is waited for.
pub(super) fn sum_to_host<'h, D: Device, C: Comm<Device = D>>(
    device: &D,
    comm: &C,
    across: bool,
    writer: StreamKind,
    event: &mut D::Event,
    buf: &D::Buffer<f32>,
    host: &'h mut HostBuffer<f32>,
) -> Result<&'h mut HostBuffer<f32>, EngineError> {
    let len = host.len();
    device.record(event, device.stream(writer))?;
    if across {
        let comm_stream = device.stream(StreamKind::Comm);
        device.wait_event(comm_stream, event)?;
        comm.all_reduce(comm_stream, buf, 0..len, ReduceOp::Sum)?;
        device.record(event, comm_stream)?;
    }
    let d2h = device.stream(StreamKind::D2h);
    device.wait_event(d2h, event)?;
    Ok(device.copy_d2h(d2h, buf, 0..len, host, 0)?.wait()?)
}

/// Waits for every stream, then uploads `data` into `buffer` from its start.
pub(super) fn overwrite<D: Device, T: zeroflow_core::Element>(
    device: &D,
    buffer: &D::Buffer<T>,
    data: &[T],
) -> Result<(), EngineError> {
    overwrite_at(device, buffer, 0, data)
}

/// Waits for every stream, then uploads `data` into `buffer[at..]` through a pageable staging
/// buffer of at most [`DOWNLOAD_CHUNK_BYTES`] (so that host memory holds `data` once), and waits
/// for the copies. For set-up, restores and selections, not for the training loop.
pub(super) fn overwrite_at<D: Device, T: zeroflow_core::Element>(
    device: &D,
    buffer: &D::Buffer<T>,
    at: usize,
    data: &[T],
) -> Result<(), EngineError> {
    let chunk = (DOWNLOAD_CHUNK_BYTES / size_of::<T>()).clamp(1, data.len().max(1));
    let mut host = device.alloc_host::<T>(chunk, HostMemory::Pageable)?;
    device.synchronize()?;
    let h2d = device.stream(StreamKind::H2d);
    for start in (0..data.len()).step_by(chunk) {
        let end = (start + chunk).min(data.len());
        host[..end - start].copy_from_slice(&data[start..end]);
        device.copy_h2d(h2d, &host, 0..end - start, buffer, at + start)?.wait()?;
    }
    device.synchronize()?;
    Ok(())
}

/// The event in `slot`, created on first use.
pub(super) fn slot<'e, D: Device>(
    slot: &'e mut Option<D::Event>,
    device: &D,
) -> Result<&'e mut D::Event, EngineError> {
    if slot.is_none() {
        *slot = Some(device.new_event()?);
    }
    Ok(slot.as_mut().expect("just filled"))
}

/// [`Shared::reduced_source`], from the fields (for callers that borrow others mutably).
pub(super) fn reduced_source<'a, D: Device, P: Float>(
    reduced: &'a Option<D::Buffer<P>>,
    grads: &'a D::Buffer<P>,
    owned_start: usize,
) -> (&'a D::Buffer<P>, usize) {
    match reduced {
        Some(reduced) => (reduced, 0),
        None => (grads, owned_start),
    }
}
