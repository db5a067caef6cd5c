//! The courier: a thread that, during a backward, brings this rank's reduced gradient pieces to
//! the host and lands them (adds them into the host accumulator, steps them speculatively), so
//! that the training thread goes on queueing the model's backward meanwhile and the GPU is not
//! left waiting for the CPU's work.
//!
//! For each reduced bucket the training thread records a fresh event on the comm stream after
//! the reduction (and after the device sum's add) and sends it with the piece; the courier has
//! the d2h stream wait on that event before the piece's copies, so each copy waits for its own
//! bucket only. It waits on each copy's token before the piece lands ([`Offloader`]), and the
//! backward returns only after the courier has landed every piece.

use std::ops::Range;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::sync::{Arc, OnceLock};

use zeroflow_core::Float;
use zeroflow_device::{Device, StreamKind};

use crate::EngineError;
use crate::offloader::Offloader;
use crate::reduction::Sink;

/// Pieces the training thread may send ahead of the courier before it waits.
const REQUESTS: usize = 1024;

/// One reduced piece for the courier: `range` of its source, destined for the partition from
/// `offset`, ready once `reduced` has fired (`None`: the mutation self-check's missing wait).
pub(crate) struct Request<D: Device> {
    pub range: Range<usize>,
    pub offset: usize,
    pub reduced: Option<D::Event>,
}

/// The training thread's end of a courier: where it sends the reduced pieces, and where it puts,
/// once the whole backward is queued, an event after its last kernel (past which no piece is
/// stepped speculatively). A slot, not a message: the courier must see it while the pieces
/// before it are still queued.
pub(crate) struct Courier<D: Device> {
    pub requests: SyncSender<Request<D>>,
    pub backward_queued: Arc<OnceLock<D::Event>>,
}

/// What the reduction does with each reduced piece of this rank (from the path's [`Sink`]).
pub(crate) enum Route<'s, D: Device> {
    /// Leaves it where the reduction put it.
    Keep,
    /// Adds it into a device accumulator on the comm stream.
    Add(&'s D::Buffer<f32>),
    /// Sends it to the courier.
    Copy(Courier<D>),
    /// Adds it into the device accumulator, then sends the sum's piece to the courier.
    AddThenCopy(&'s D::Buffer<f32>, Courier<D>),
}

/// Runs `backward` with the route `sink` asks for, and the courier where pieces go to the host
/// (from `source`, where the reduction leaves this rank's pieces, or from the device sum). Gives
/// `backward`'s result and the courier's (it has landed every piece by then).
pub(crate) fn run<'s, D: Device, P: Float, R>(
    device: &'s D,
    sink: Sink<'s, D, P>,
    source: &'s D::Buffer<P>,
    backward: impl FnOnce(Route<'s, D>) -> R,
) -> (R, Result<(), EngineError>) {
    match sink {
        Sink::Keep => (backward(Route::Keep), Ok(())),
        Sink::Device(acc) | Sink::DeviceThenHost { acc, offloader: None } => {
            (backward(Route::Add(acc)), Ok(()))
        }
        Sink::Host(offloader) => {
            with_courier(device, offloader, source, |courier| backward(Route::Copy(courier)))
        }
        Sink::DeviceThenHost { acc, offloader: Some(offloader) } => {
            with_courier(device, offloader, acc, |courier| {
                backward(Route::AddThenCopy(acc, courier))
            })
        }
    }
}

/// Runs `backward` while a courier thread delivers the requests it sends from `source` through
/// `offloader`.
fn with_courier<'s, D: Device, S: Float, P: Float, R>(
    device: &'s D,
    offloader: Offloader<'s, S, P>,
    source: &'s D::Buffer<S>,
    backward: impl FnOnce(Courier<D>) -> R,
) -> (R, Result<(), EngineError>) {
    let (requests, received) = sync_channel(REQUESTS);
    let backward_queued = Arc::new(OnceLock::new());
    let sender = Courier { requests, backward_queued: Arc::clone(&backward_queued) };
    std::thread::scope(|scope| {
        let courier = std::thread::Builder::new()
            .name("zeroflow-courier".into())
            .spawn_scoped(scope, move || {
                deliver(device, offloader, source, received, backward_queued)
            });
        // Without a courier the requests go nowhere (their receiver is gone): the backward runs
        // and the error is the courier's.
        let result = backward(sender);
        let landed = match courier {
            Ok(courier) => courier
                .join()
                .unwrap_or(Err(EngineError::Internal("the gradient courier panicked"))),
            Err(e) => Err(EngineError::Thread(e)),
        };
        (result, landed)
    })
}

/// The courier's loop: each request's copies once its reduction is done, then every piece
/// landed.
fn deliver<'s, D: Device, S: Float, P: Float>(
    device: &'s D,
    mut offloader: Offloader<'s, S, P>,
    source: &D::Buffer<S>,
    requests: Receiver<Request<D>>,
    backward_queued: Arc<OnceLock<D::Event>>,
) -> Result<(), EngineError> {
    let d2h = device.stream(StreamKind::D2h);
    offloader.stop_after(Box::new(move || {
        backward_queued.get().is_some_and(|queued| device.event_done(queued).unwrap_or(true))
    }));
    for Request { range, offset, reduced } in requests {
        if let Some(reduced) = &reduced {
            device.wait_event(d2h, reduced)?;
        }
        copy_out(device, &mut offloader, source, range, offset)?;
    }
    offloader.drain()
}

/// Copies `range` of `source` to the host on the d2h stream, in pieces of at most one staging
/// buffer as long as the landing takes them, destined for the partition from `offset` (up to
/// the landing's limit: a device share's elements stay on the device).
fn copy_out<'s, D: Device, S: Float, P: Float>(
    device: &D,
    offloader: &mut Offloader<'s, S, P>,
    source: &D::Buffer<S>,
    range: Range<usize>,
    offset: usize,
) -> Result<(), EngineError> {
    let d2h = device.stream(StreamKind::D2h);
    let end = range.len().min(offloader.limit().saturating_sub(offset));
    let mut start = 0;
    while start < end {
        let len = offloader.piece_len().min(end - start);
        let Some(room) = offloader.admit(len) else { break };
        let staging = offloader.staging()?;
        let from = range.start + start..range.start + start + len;
        let filling = device.copy_d2h(d2h, source, from, staging, 0)?;
        offloader.push(offset + start, len, room, filling);
        start += len;
    }
    Ok(())
}
