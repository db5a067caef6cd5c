//! The streaming CPU step (DESIGN.md §5): the gradients go to the host chunk by chunk through
//! bounded staging, the CPU steps each chunk as it lands and its weights' upload starts at once
//! ([`ChunkStream`]); inline ([`stream_step`]) each uploaded piece is gathered to the other ranks
//! while the CPU steps the next ([`PieceGather`]).

use std::ops::Range;
use std::time::Instant;

use zeroflow_core::Float;
use zeroflow_device::{Comm, Device, Filling, HostBuffer, StreamKind};
use zeroflow_optim::AdamWStep;

use super::share::DeviceShare;
use super::shared::Shared;
use crate::EngineError;
use crate::device_adamw::DeviceAdamW;
use crate::host::{
    HostOptimizer, OUTGOING_BUFFERS, STAGING_BUFFERS, StepTimes, StreamBuffers, as_grads,
};
use crate::speculation::{Speculation, segments};

/// The streaming step gathers its uploaded chunks in pieces of this many elements (32 MiB of
/// bf16), however small the chunks, or an eighth of the partition where that is less: one
/// collective per rank and piece.
const GATHER_PIECE: usize = 1 << 24;
/// The gradients a streaming step reads (`source` from element `at`: this rank's partition of
/// them), the event its pieces' gathers wait on, whether it gathers in pieces, and where the
/// training thread's time goes.
pub(super) struct StepIo<'a, D: Device, G: Float> {
    pub(super) source: &'a D::Buffer<G>,
    pub(super) at: usize,
    /// The partition's elements the CPU steps, from the first (all but a device share).
    pub(super) len: usize,
    pub(super) uploaded_event: &'a mut D::Event,
    pub(super) gather_in_pieces: bool,
    pub(super) times: &'a mut StepTimes,
}

/// The streaming CPU step, inline (see [`stream_chunks`]): from this rank's gradients on the
/// device (`io`: the reduced gradients, or the window's sum) to the updated weights in this
/// rank's partition of the flat weights, and into the other ranks' copies piece by piece: each
/// piece, once uploaded, goes from every rank to every rank on the comm stream (one broadcast
/// per rank, the same piece of each partition), while the CPU steps the next chunks
/// ([`PieceGather`]). Only the last piece's gather is left when the CPU is done, not the whole
/// partition's. Where a speculation stands, its pieces are stepped already: their weights are
/// uploaded from where it keeps them, and only the rest is streamed. Gives whether the pieces
/// were gathered, for [`finish_stream_step`].
pub(super) fn stream_step<D: DeviceAdamW, C: Comm<Device = D>, P: Float, G: Float>(
    shared: &Shared<D, C, P>,
    buffers: &mut StreamBuffers<P, G>,
    io: StepIo<'_, D, G>,
    step: &AdamWStep,
    speculated: Option<&Speculation<P>>,
    share: Option<&DeviceShare<D>>,
) -> Result<bool, EngineError> {
    let Shared { ref device, ref comm, ref params, ref events, ref owned, ref layout, .. } =
        *shared;
    let StepIo { source, at, len, uploaded_event, gather_in_pieces, times } = io;
    let h2d = device.stream(StreamKind::H2d);
    order_for_step(device, &events.norm_done, &events.compute_done, events.params_ready.as_ref())?;
    // The gathers write the other ranks' partitions, which the last forward/backward read.
    let gathers = gather_in_pieces && owned.len() < layout.padded_len();
    if gathers {
        device.wait_event(device.stream(StreamKind::Comm), &events.compute_done)?;
    }
    let partition = owned.len();
    let mut gather = PieceGather::new(device, comm, params, uploaded_event, partition, gathers);
    let stepped = speculated.map_or(&[][..], Speculation::stepped);
    let StreamBuffers { state, staging, outgoing } = buffers;
    for (segment, speculated_at) in segments(len, stepped) {
        let target_at = owned.start + segment.start;
        if let (Some(from), Some(weights)) =
            (speculated_at, speculated.and_then(Speculation::weights))
        {
            let len = segment.len();
            device.copy_h2d(h2d, weights, from..from + len, params, target_at)?.detach();
            gather.uploaded(segment)?;
            continue;
        }
        let offset = segment.start;
        let uploaded = &mut |r: Range<usize>| gather.uploaded(offset + r.start..offset + r.end);
        let times = &mut *times;
        let source_at = at + offset;
        let (state_at, target) = (offset, params);
        let chunks = Chunks { state_at, source, source_at, target, target_at, uploaded, times };
        stream_chunks(device, step, state, staging, outgoing, chunks, segment.len())?;
    }
    // The device share's weights (the partition from `len` on), written on the compute stream
    // before the CPU's, go to the other ranks once that step is done: in the gather's last
    // pieces, or with the whole partition after the step (`finish_stream_step`).
    if let Some(share) = share
        && partition < layout.padded_len()
    {
        share.order_after_step(device, StreamKind::Comm)?;
        gather.uploaded(len..partition)?;
    }
    Ok(gathers)
}

/// Orders the streams a streaming step copies on: the d2h stream after `norm_done` (the comm
/// stream computed the norm over the final gradients), the h2d stream after `compute_done` and
/// `params_ready` (the last forward/backward and the last upload or gather are past the weights).
pub(super) fn order_for_step<D: Device>(
    device: &D,
    norm_done: &D::Event,
    compute_done: &D::Event,
    params_ready: Option<&D::Event>,
) -> Result<(), EngineError> {
    let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
    device.wait_event(d2h, norm_done)?;
    device.wait_event(h2d, compute_done)?;
    if let Some(written) = params_ready {
        device.wait_event(h2d, written)?;
    }
    Ok(())
}

/// After [`stream_step`]: the next backward overwrites the gradients only after its copies read
/// them; the weights are current once the last piece's gather is done (`gathered`), or after
/// the gather of the whole partition queued here.
pub(super) fn finish_stream_step<D: DeviceAdamW, C: Comm<Device = D>, P: Float>(
    shared: &mut Shared<D, C, P>,
    gathered: bool,
) -> Result<(), EngineError> {
    shared.record_d2h_done()?;
    if !gathered {
        return shared.gather_from(StreamKind::H2d);
    }
    shared.record_params_ready(StreamKind::Comm)
}

/// The streaming step's gather in pieces: every rank's partition is cut into the same pieces
/// (of [`GATHER_PIECE`] elements, or an eighth of the partition where that is less), and each
/// piece goes from every rank to every rank once this rank's uploads cover it. The pieces do not
/// depend on how the uploads are cut (chunks, speculated pieces), so the ranks' collectives match.
struct PieceGather<'a, D: Device, C: Comm<Device = D>, P: Float> {
    device: &'a D,
    comm: &'a C,
    params: &'a D::Buffer<P>,
    uploaded_event: &'a mut D::Event,
    partition: usize,
    piece_len: usize,
    /// Uploads are queued for the partition up to here.
    uploaded_to: usize,
    /// Pieces are gathered up to here.
    gathered_to: usize,
    enabled: bool,
}

impl<'a, D: Device, C: Comm<Device = D>, P: Float> PieceGather<'a, D, C, P> {
    fn new(
        device: &'a D,
        comm: &'a C,
        params: &'a D::Buffer<P>,
        uploaded_event: &'a mut D::Event,
        partition: usize,
        enabled: bool,
    ) -> Self {
        let piece_len = GATHER_PIECE.min(partition.div_ceil(8)).max(1);
        let (uploaded_to, gathered_to) = (0, 0);
        PieceGather {
            device,
            comm,
            params,
            uploaded_event,
            partition,
            piece_len,
            uploaded_to,
            gathered_to,
            enabled,
        }
    }

    /// The upload of `range` of the partition (the next after the last) is queued on the h2d
    /// stream (or, for the device share's, the comm stream waits for its step): gathers the
    /// pieces it completes.
    fn uploaded(&mut self, range: Range<usize>) -> Result<(), EngineError> {
        if !self.enabled {
            return Ok(());
        }
        if range.start != self.uploaded_to {
            return Err(EngineError::Internal("the streaming step's uploads skipped a range"));
        }
        self.uploaded_to = range.end;
        let (device, comm_stream) = (self.device, self.device.stream(StreamKind::Comm));
        let mut recorded = false;
        while self.gathered_to < self.partition {
            let end = (self.gathered_to + self.piece_len).min(self.partition);
            if end > self.uploaded_to {
                break;
            }
            if !recorded {
                device.record(self.uploaded_event, device.stream(StreamKind::H2d))?;
                device.wait_event(comm_stream, self.uploaded_event)?;
                recorded = true;
            }
            for root in 0..self.comm.world_size() {
                let at = root * self.partition;
                let piece = at + self.gathered_to..at + end;
                self.comm.broadcast(comm_stream, self.params, piece, root)?;
            }
            self.gathered_to = end;
        }
        Ok(())
    }
}

/// Where the streaming step reads gradients and writes weights: `len` elements of each, from
/// element `source_at` of `source` and `target_at` of `target`, stepping the optimizer's state
/// from `state_at`; `uploaded` hears of each chunk (its range from the first element) once its
/// upload is queued on the h2d stream (the engine gathers
/// it from there); `times` adds up where the calling thread's time went. The gradients are `G`:
/// the model's `P`, or ZenFlow's `f32` window.
pub(super) struct Chunks<'a, D: Device, G: Float, P: Float> {
    /// Where the elements start in the optimizer's state (the partition).
    pub(super) state_at: usize,
    pub(super) source: &'a D::Buffer<G>,
    pub(super) source_at: usize,
    pub(super) target: &'a D::Buffer<P>,
    pub(super) target_at: usize,
    pub(super) uploaded: &'a mut dyn FnMut(Range<usize>) -> Result<(), EngineError>,
    pub(super) times: &'a mut StepTimes,
}

/// Says at debug level how long a CPU step on a worker (`path`: the delayed update's or
/// ZenFlow's) took since `begun`, and where: chunk waits, upload waits, the AdamW.
pub(super) fn trace_worker(path: &'static str, begun: Instant, times: &StepTimes) {
    let StepTimes { chunk_wait, upload_wait, adam, .. } = *times;
    let took = begun.elapsed();
    tracing::debug!(path, ?took, ?chunk_wait, ?upload_wait, ?adam, "CPU step on the worker");
}

/// The streaming CPU step over `len` elements of a partition, all of it: [`ChunkStream`] run to
/// its end.
pub(super) fn stream_chunks<'a, D: Device, G: Float, P: Float>(
    device: &'a D,
    step: &AdamWStep,
    optimizer: &'a mut HostOptimizer,
    staging: &'a mut [HostBuffer<G>],
    outgoing: &'a mut [HostBuffer<P>],
    io: Chunks<'a, D, G, P>,
    len: usize,
) -> Result<(), EngineError> {
    ChunkStream::new(device, *step, optimizer, staging, outgoing, io, len, &[]).advance(len)
}

/// The streaming CPU step over `len` elements of a partition, advanced as far as its caller
/// asks ([`ChunkStream::advance`]): the gradients go to the host chunk by chunk on the d2h stream
/// (up to [`STAGING_BUFFERS`] chunks ahead), the CPU steps each chunk as soon as its copy's token
/// has been waited on, writing the new weights as `P` into an outgoing buffer, and that buffer's
/// upload on the h2d stream starts at once, overlapping the next chunks. The caller orders the
/// d2h stream after the gradients' writers and the h2d stream after the target's readers; the
/// uploads are not waited for (each outgoing buffer remembers its copy, and its next write waits
/// for it).
pub(super) struct ChunkStream<'a, D: Device, G: Float, P: Float> {
    device: &'a D,
    step: AdamWStep,
    optimizer: &'a mut HostOptimizer,
    outgoing: &'a mut [HostBuffer<P>],
    io: Chunks<'a, D, G, P>,
    free: StagingSlots<'a, G>,
    in_flight: [Option<Filling<'a, G>>; STAGING_BUFFERS],
    len: usize,
    /// The chunks to step, in order: the `len` elements cut into pieces of at most a staging
    /// buffer, around the ranges stepped already (a speculation's, [`ChunkStream::new`]).
    pieces: Vec<Range<usize>>,
    /// Chunks whose copy is queued, and chunks stepped (and their uploads queued).
    issued: usize,
    stepped: usize,
}

/// The staging buffers a chunk stream or an offloader holds, each `None` while its copy is in
/// flight.
pub(crate) type StagingSlots<'a, G> = [Option<&'a mut HostBuffer<G>>; STAGING_BUFFERS];

/// What an [`Opening`](super::opening::Opening) hands the backward's speculation once it has
/// stepped everything: the optimizer and the staging buffers, which the speculation steps and
/// copies through while the backward runs (`offloader.rs`).
pub(crate) type Handoff<'a, G> = (&'a mut HostOptimizer, StagingSlots<'a, G>);

impl<'a, D: Device, G: Float, P: Float> ChunkStream<'a, D, G, P> {
    /// The stream over `len` elements but the ranges in `stepped` (sorted and disjoint, within
    /// `len`: stepped already, their weights uploaded by the caller), which it leaves alone.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        device: &'a D,
        step: AdamWStep,
        optimizer: &'a mut HostOptimizer,
        staging: &'a mut [HostBuffer<G>],
        outgoing: &'a mut [HostBuffer<P>],
        io: Chunks<'a, D, G, P>,
        len: usize,
        stepped: &[Range<usize>],
    ) -> Self {
        let chunk = staging.first().map_or(1, |b| b.len()).max(1);
        let free = {
            let mut buffers = staging.iter_mut();
            std::array::from_fn(|_| buffers.next())
        };
        let in_flight = Default::default();
        let mut pieces = Vec::with_capacity(len.div_ceil(chunk) + stepped.len());
        let mut cut = |range: Range<usize>| {
            let mut start = range.start;
            while start < range.end {
                let end = (start + chunk).min(range.end);
                pieces.push(start..end);
                start = end;
            }
        };
        let mut cursor = 0;
        for range in stepped {
            cut(cursor..range.start.min(len));
            cursor = cursor.max(range.end);
        }
        cut(cursor..len);
        ChunkStream {
            device,
            step,
            optimizer,
            outgoing,
            io,
            free,
            in_flight,
            len,
            pieces,
            issued: 0,
            stepped: 0,
        }
    }

    /// Elements done so far, from the first: stepped (their uploads queued) or left alone.
    pub(super) fn done(&self) -> usize {
        self.pieces.get(self.stepped).map_or(self.len, |piece| piece.start)
    }

    /// The elements it steps, from the first.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn piece(&self, c: usize) -> Range<usize> {
        self.pieces[c].clone()
    }

    /// The optimizer and the staging buffers back, every chunk stepped ([`Handoff`]).
    pub(super) fn release(self) -> Handoff<'a, G> {
        (self.optimizer, self.free)
    }

    /// Steps chunks until the first `to` elements (at most all) are stepped and their uploads
    /// queued.
    pub(super) fn advance(&mut self, to: usize) -> Result<(), EngineError> {
        let (d2h, h2d) = (self.device.stream(StreamKind::D2h), self.device.stream(StreamKind::H2d));
        let chunks = self.pieces.len();
        while self.done() < to.min(self.len) {
            let c = self.stepped;
            // Keep the d2h stream busy: every free staging buffer receives the next chunk.
            while self.issued < chunks {
                let Some(buffer) = self.free.iter_mut().find_map(Option::take) else { break };
                let range = self.piece(self.issued);
                let from = self.io.source_at + range.start..self.io.source_at + range.end;
                let filling = self.device.copy_d2h(d2h, self.io.source, from, buffer, 0)?;
                self.in_flight[self.issued % STAGING_BUFFERS] = Some(filling);
                self.issued += 1;
            }
            let range = self.piece(c);
            let filling = self.in_flight[c % STAGING_BUFFERS].take().expect("issued above");
            let times = &mut *self.io.times;
            let waiting = Instant::now();
            let staged = filling.wait()?;
            times.chunk_wait += waiting.elapsed();
            let grads = as_grads(&staged[..range.len()])
                .ok_or(EngineError::Internal("the streaming step reads f32 or bf16 gradients"))?;
            // Waits for the upload that last read this buffer (its token was let go below).
            let waiting = Instant::now();
            let out = &mut self.outgoing[c % OUTGOING_BUFFERS][..range.len()];
            let stepping = Instant::now();
            times.upload_wait += stepping - waiting;
            let in_state = self.io.state_at + range.start..self.io.state_at + range.end;
            self.optimizer.step_range(&self.step, in_state, grads, out)?;
            times.adam += stepping.elapsed();
            let outgoing_buffer = &self.outgoing[c % OUTGOING_BUFFERS];
            let target = self.io.target_at + range.start;
            let draining = self.device.copy_h2d(
                h2d,
                outgoing_buffer,
                0..range.len(),
                self.io.target,
                target,
            )?;
            // Not waited on here: the buffer remembers the copy, and its next write (two chunks
            // on, or the next step) waits for it. That is what lets the upload overlap the CPU.
            draining.detach();
            (self.io.uploaded)(range)?;
            *self.free.iter_mut().find(|slot| slot.is_none()).expect("a slot is empty") =
                Some(staged);
            self.stepped += 1;
        }
        Ok(())
    }
}
