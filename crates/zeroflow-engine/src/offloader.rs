//! The copies of gradient pieces to the host during a backward ([`Offloader`]), and where each
//! piece lands once its copy is waited on ([`Landing`]): the host accumulator, the speculative
//! step, or both.

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use zeroflow_core::Float;
use zeroflow_device::{Filling, HostBuffer};
use zeroflow_optim::Grads;

use crate::EngineError;
use crate::engine::{Handoff, StagingSlots};
use crate::host::{HostOptimizer, PAR_CHUNK, STAGING_BUFFERS, as_grads};
use crate::speculation::Speculation;

/// Where a staged gradient piece goes once its copy is waited on.
pub(crate) enum Landing<'s, P: Float> {
    /// Added into the accumulator (the accumulating paths), then stepped speculatively where
    /// `speculate` is given and the step is speculated.
    Accumulate { acc: &'s mut HostBuffer<f32>, speculate: Option<Speculating<'s, P>> },
    /// Stepped speculatively as it is (the streaming path, whose pieces reach the host during
    /// backward only to be stepped).
    Step(Speculating<'s, P>),
}

/// The speculative step's part of a backward: the speculation, the optimizer state it steps
/// (`None` until an opening of the last step hands it on: [`Offloader::handed`]) and, on the
/// accumulating path, the upload buffer the updated weights go into.
pub(crate) struct Speculating<'s, P: Float> {
    pub speculation: &'s mut Speculation<P>,
    pub state: Option<&'s mut HostOptimizer>,
    pub upload: Option<&'s mut HostBuffer<P>>,
}

impl<P: Float> Speculating<'_, P> {
    /// A final piece of the partition's gradients, `offset..offset + grads.len()`, is on the
    /// host: counted into the running norm, and stepped if the step is still speculated and the
    /// budget has room (`at`: room reserved when its copy was issued).
    ///
    /// `late`: the GPU is past the backward, so the piece is not stepped (nor any after it):
    /// stepped now, with its backup, it would cost more than in the step that follows.
    /// `waited`: how long the courier waited for the piece's copy.
    fn land(
        &mut self,
        offset: usize,
        at: Option<usize>,
        grads: Grads<'_>,
        late: bool,
        waited: Duration,
    ) -> Result<(), EngineError> {
        self.speculation.waited(waited);
        if late {
            self.speculation.stop();
        }
        self.speculation.observe(grads);
        if !self.speculation.active() {
            return Ok(());
        }
        let len = grads.len();
        let Some(state) = self.state.as_deref_mut() else { return Ok(()) };
        let Some(at) = at.or_else(|| self.speculation.reserve(len)) else { return Ok(()) };
        let out = self.upload.as_deref_mut().map(|upload| &mut upload[offset..offset + len]);
        self.speculation.step_piece(state, offset..offset + len, at, grads, out)
    }
}

/// One copy in flight: the piece's offset in the partition, its length, the backup room reserved
/// for it (streaming speculation), and the copy's token.
type InFlight<'s, S> = (usize, usize, Option<usize>, Filling<'s, S>);

/// Copies of gradient pieces (of type `S`: the model's dtype, or f32 from a device accumulator)
/// to the host that are in flight, and the staging buffers they fill; `P` is the model's dtype.
/// A piece lands ([`Landing`]) only after its copy's token has been waited on: there is no way to
/// read a staging buffer earlier. Fixed-size arrays: the ring allocates nothing (the courier
/// that runs it, `courier.rs`, is a thread and a channel per backward).
pub(crate) struct Offloader<'s, S: Float, P: Float> {
    free: StagingSlots<'s, S>,
    /// Where the staging and the optimizer come from, until they have come
    /// ([`Offloader::handed`]).
    handoff: Option<Receiver<Handoff<'s, S>>>,
    /// A ring of copies in flight, oldest at `head`.
    in_flight: [Option<InFlight<'s, S>>; STAGING_BUFFERS],
    head: usize,
    count: usize,
    piece_len: usize,
    landing: Landing<'s, P>,
    /// True once the GPU is past the backward ([`Offloader::stop_after`]).
    ended: Option<Ended<'s>>,
}

/// Whether the GPU is past the backward.
type Ended<'s> = Box<dyn FnMut() -> bool + Send + 's>;

/// The most elements one copy through `free`'s buffers moves (1 before any has come).
fn piece_len<S: Float>(free: &StagingSlots<'_, S>) -> usize {
    free.iter().flatten().map(|b| b.len()).next().unwrap_or(1).max(1)
}

impl<'s, S: Float, P: Float> Offloader<'s, S, P> {
    pub(crate) fn new(staging: &'s mut [HostBuffer<S>], landing: Landing<'s, P>) -> Self {
        let mut buffers = staging.iter_mut();
        Self::with(std::array::from_fn(|_| buffers.next()), None, landing)
    }

    /// An offloader whose staging buffers and optimizer `handoff` brings: from the opening of
    /// the last step, once it has stepped every chunk with them (`Stream::open`). Until they
    /// have come, no piece is copied ([`Offloader::admit`]): in a forward that opens every
    /// weight before its backward, they are there before the first piece is reduced.
    pub(crate) fn handed(handoff: Receiver<Handoff<'s, S>>, landing: Landing<'s, P>) -> Self {
        Self::with(std::array::from_fn(|_| None), Some(handoff), landing)
    }

    fn with(
        free: StagingSlots<'s, S>,
        handoff: Option<Receiver<Handoff<'s, S>>>,
        landing: Landing<'s, P>,
    ) -> Self {
        Offloader {
            piece_len: piece_len(&free),
            free,
            in_flight: std::array::from_fn(|_| None),
            head: 0,
            count: 0,
            landing,
            handoff,
            ended: None,
        }
    }

    /// True once the staging buffers are here (taking them, and the optimizer, from the
    /// handoff where they have just come).
    fn staged(&mut self) -> bool {
        let Some(handoff) = &self.handoff else { return true };
        let Ok((state, free)) = handoff.try_recv() else { return false };
        self.piece_len = piece_len(&free);
        self.free = free;
        if let Landing::Step(speculating) = &mut self.landing {
            speculating.state = Some(state);
        }
        self.handoff = None;
        true
    }

    /// From now on, pieces are stepped speculatively only while `ended` says the GPU is not
    /// past the backward yet: a piece the backward does not hide costs the speculation its
    /// backup besides its step, more than the step after the backward would spend on it.
    pub(crate) fn stop_after(&mut self, ended: Ended<'s>) {
        self.ended = Some(ended);
    }

    /// The partition's elements a piece may reach, from the first: where the speculation steps
    /// the pieces, those whose state the host holds (a device share's are stepped on the
    /// device); all where pieces are accumulated.
    pub(crate) fn limit(&self) -> usize {
        match &self.landing {
            Landing::Accumulate { .. } => usize::MAX,
            Landing::Step(speculating) => speculating.speculation.host_len(),
        }
    }

    /// The most elements one copy moves (a staging buffer's length).
    pub(crate) fn piece_len(&mut self) -> usize {
        self.staged();
        self.piece_len
    }

    /// Whether a piece of `len` elements is to be copied: always where it is accumulated; on the
    /// streaming path, while the step is speculated and the budget has room for it (then
    /// `Some(Some(room))`).
    pub(crate) fn admit(&mut self, len: usize) -> Option<Option<usize>> {
        if !self.staged() {
            return None;
        }
        match &mut self.landing {
            Landing::Accumulate { .. } => Some(None),
            Landing::Step(speculating) => speculating.speculation.reserve(len).map(Some),
        }
    }

    /// A free staging buffer, waiting for the oldest copy if all are in flight.
    pub(crate) fn staging(&mut self) -> Result<&'s mut HostBuffer<S>, EngineError> {
        if self.free.iter().all(Option::is_none) {
            self.retire_oldest()?;
        }
        Ok(self.free.iter_mut().find_map(Option::take).expect("a buffer is free"))
    }

    /// Registers a copy of `len` gradients into the staging buffer that `filling` holds,
    /// destined for `offset..offset + len` of the partition, with the room [`Offloader::admit`]
    /// gave it.
    pub(crate) fn push(
        &mut self,
        offset: usize,
        len: usize,
        room: Option<usize>,
        filling: Filling<'s, S>,
    ) {
        let slot = (self.head + self.count) % STAGING_BUFFERS;
        self.in_flight[slot] = Some((offset, len, room, filling));
        self.count += 1;
    }

    /// Waits for the oldest copy and lands its piece.
    fn retire_oldest(&mut self) -> Result<(), EngineError> {
        let (offset, len, room, filling) =
            self.in_flight[self.head].take().expect("a copy is in flight");
        self.head = (self.head + 1) % STAGING_BUFFERS;
        self.count -= 1;
        let asked = Instant::now();
        let staged = filling.wait()?;
        let waited = asked.elapsed();
        let late = self.ended.as_mut().is_some_and(|ended| ended());
        match &mut self.landing {
            Landing::Accumulate { acc, speculate } => {
                let acc = &mut acc[offset..offset + len];
                // In parallel: a piece is up to a staging buffer's length (the stream chunk), and
                // the accumulation of a whole partition per micro-step must keep up with the
                // copies.
                acc.par_chunks_mut(PAR_CHUNK).zip(staged[..len].par_chunks(PAR_CHUNK)).for_each(
                    |(acc, staged)| {
                        acc.iter_mut().zip(staged).for_each(|(a, g)| *a += g.to_f32());
                    },
                );
                if let Some(speculating) = speculate {
                    speculating.land(offset, None, Grads::F32(acc), late, waited)?;
                }
            }
            Landing::Step(speculating) => {
                let grads = as_grads(&staged[..len]).ok_or(EngineError::Internal(
                    "the streaming step reads f32 or bf16 gradients",
                ))?;
                speculating.land(offset, room, grads, late, waited)?;
            }
        }
        let slot = self.free.iter_mut().find(|slot| slot.is_none()).expect("a slot is empty");
        *slot = Some(staged);
        Ok(())
    }

    /// Waits for every copy and lands it, in the order the copies were made.
    pub(crate) fn drain(&mut self) -> Result<(), EngineError> {
        while self.count > 0 {
            self.retire_oldest()?;
        }
        Ok(())
    }
}
