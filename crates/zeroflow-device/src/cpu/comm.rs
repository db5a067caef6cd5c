//! Collectives between in-process ranks, each a thread with its own `CpuDevice`.
//!
//! A collective is queued on the rank's stream like any kernel. When the stream reaches it, the
//! rank meets the others in three phases: all arrive (publishing where their input is), each
//! computes its own output into scratch from everybody's input, all wait until every input has been
//! read, then each writes its output. Reads therefore finish before any write, so in-place
//! collectives are correct. Reductions add in rank order in `f64`, so every rank gets the same bits.
//!
//! A rank whose communicator is dropped (its thread failed, or ended) leaves the group once its
//! queued collectives have run: from then on every collective of the others, already waiting or
//! started later, fails at once with an error naming that rank, instead of waiting out the timeout.
//!
//! A barrier that fails (a rank timed out, or one left) breaks the group for good: every later
//! barrier of every rank fails at once with the first failure's reason. The rank that gave up
//! stays counted as arrived and its input published, but it has left the collective (its buffers
//! may be freed); a rank arriving late must not complete that barrier and read them.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use zeroflow_core::{DType, Element};

use super::hb::Touch;
use super::{CpuBuffer, CpuDevice, CpuStream, SendPtr, Work};
use crate::check_range;
use crate::comm::{
    ALL_GATHER_IN_PLACE, Comm, REDUCE_IN_PLACE, REDUCE_SCATTER_IN_PLACE, ReduceOp, check_placement,
};
use crate::error::{DeviceError, Result};

/// Where a rank's input is, published for the others during a collective. Other ranks read it only
/// between the first and the second barrier of that collective, while the owning rank's stream is
/// blocked inside it and the checker keeps that rank's other streams off the range.
#[derive(Clone, Copy, Debug)]
struct Published {
    op: &'static str,
    dtype: DType,
    ptr: SendPtr<u8>,
    len: usize,
}

#[derive(Debug)]
struct Rendezvous {
    /// Generation of the barrier and how many ranks reached it.
    generation: u64,
    arrived: usize,
    slots: Vec<Option<Published>>,
    /// Each rank's collectives queued on its streams and not yet finished (or dropped unrun).
    pending: Vec<usize>,
    /// The ranks whose communicator has been dropped, in the order they were.
    dropped: Vec<usize>,
    /// Why the first barrier that failed did (the group is broken from then on).
    broken: Option<String>,
}

impl Rendezvous {
    /// The first rank that has left the group: its communicator is gone and so is every
    /// collective it queued, so it can never arrive again. The first to go is named, not a rank
    /// that failed because of it and went too.
    fn departed(&self) -> Option<usize> {
        self.dropped.iter().copied().find(|&rank| self.pending[rank] == 0)
    }
}

#[derive(Debug)]
struct Group {
    world: usize,
    timeout: Duration,
    state: Mutex<Rendezvous>,
    changed: Condvar,
}

impl Group {
    fn lock(&self) -> std::sync::MutexGuard<'_, Rendezvous> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A barrier among all ranks; fails if they do not all arrive within the timeout, or at once
    /// when a rank has left the group.
    fn barrier(&self, op: &'static str, rank: usize) -> Result<()> {
        let mut state = self.lock();
        if let Some(first) = &state.broken {
            let reason = format!("the group broke in an earlier collective: {first}");
            return Err(DeviceError::Collective { op, rank, reason });
        }
        let generation = state.generation;
        state.arrived += 1;
        if state.arrived == self.world {
            state.arrived = 0;
            state.generation += 1;
            self.changed.notify_all();
            return Ok(());
        }
        let deadline = Instant::now() + self.timeout;
        while state.generation == generation {
            let failed = if let Some(first) = &state.broken {
                Some(format!("the group broke while rank {rank} waited: {first}"))
            } else if let Some(departed) = state.departed() {
                Some(format!(
                    "rank {departed} left the group (it failed or ended) and will never arrive"
                ))
            } else if deadline.saturating_duration_since(Instant::now()).is_zero() {
                let missing = self.world - state.arrived;
                Some(format!("{missing} rank(s) did not arrive within {:?}", self.timeout))
            } else {
                None
            };
            if let Some(reason) = failed {
                state.broken.get_or_insert_with(|| reason.clone());
                self.changed.notify_all();
                return Err(DeviceError::Collective { op, rank, reason });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            state = self.changed.wait_timeout(state, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        Ok(())
    }
}

/// One rank's communicator among in-process ranks.
#[derive(Debug)]
pub struct CpuComm {
    rank: usize,
    device: CpuDevice,
    group: Arc<Group>,
}

impl CpuComm {
    /// One communicator per device, rank `i` on `devices[i]`. A collective that some rank does not
    /// join within `timeout` fails on the ranks that waited.
    pub fn group(devices: &[CpuDevice], timeout: Duration) -> Vec<CpuComm> {
        let world = devices.len();
        let group = Arc::new(Group {
            world,
            timeout,
            state: Mutex::new(Rendezvous {
                generation: 0,
                arrived: 0,
                slots: vec![None; world],
                pending: vec![0; world],
                dropped: Vec::with_capacity(world),
                broken: None,
            }),
            changed: Condvar::new(),
        });
        devices
            .iter()
            .enumerate()
            .map(|(rank, device)| CpuComm { rank, device: device.clone(), group: group.clone() })
            .collect()
    }

    /// Queues one collective: `input` is published to the other ranks; `compute` builds this
    /// rank's output from all ranks' inputs (in rank order); the output is written to `output`.
    fn collective<T: Element>(
        &self,
        op: &'static str,
        stream: &CpuStream,
        input: (&CpuBuffer<T>, Range<usize>),
        output: (&CpuBuffer<T>, Range<usize>),
        compute: impl Fn(&[&[T]], &mut [T]) + Send + 'static,
    ) -> Result<()> {
        let (src, src_range) = input;
        let (dst, dst_range) = output;
        check_range(op, &src_range, src.len)?;
        check_range(op, &dst_range, dst.len)?;
        let touches = [
            Touch { buffer: src.id, dtype: T::DTYPE, range: src_range.clone(), write: false },
            Touch { buffer: dst.id, dtype: T::DTYPE, range: dst_range.clone(), write: true },
        ];
        let keep = (src.storage.clone(), dst.storage.clone());
        // SAFETY: both offsets were bounds-checked above.
        let (from, to) =
            unsafe { (src.base().add(src_range.start), dst.base().add(dst_range.start)) };
        let (rank, group) = (self.rank, self.group.clone());
        let mine =
            Published { op, dtype: T::DTYPE, ptr: SendPtr(from.0.cast()), len: src_range.len() };
        let out_len = dst_range.len();
        let queued = Queued::new(group.clone(), rank);
        let work: Work = Box::new(move || {
            let result = run_collective(&group, rank, mine, to, out_len, compute);
            drop((keep, queued));
            result
        });
        self.device.enqueue(stream, op, &touches, work).map(drop)
    }
}

impl Drop for CpuComm {
    /// This rank leaves the group once its queued collectives are done (see the module's docs).
    fn drop(&mut self) {
        self.group.lock().dropped.push(self.rank);
        self.group.changed.notify_all();
    }
}

/// A collective queued on a rank's stream, counted in [`Rendezvous::pending`] until it has run or
/// its work was dropped unrun.
struct Queued {
    group: Arc<Group>,
    rank: usize,
}

impl Queued {
    fn new(group: Arc<Group>, rank: usize) -> Queued {
        group.lock().pending[rank] += 1;
        Queued { group, rank }
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.group.lock().pending[self.rank] -= 1;
        self.group.changed.notify_all();
    }
}

fn run_collective<T: Element>(
    group: &Group,
    rank: usize,
    mine: Published,
    out: SendPtr<T>,
    out_len: usize,
    compute: impl Fn(&[&[T]], &mut [T]),
) -> Result<()> {
    let fail = |reason: String| DeviceError::Collective { op: mine.op, rank, reason };
    group.state.lock().unwrap_or_else(|e| e.into_inner()).slots[rank] = Some(mine);
    group.barrier(mine.op, rank)?;
    let published: Vec<Published> = {
        let state = group.state.lock().unwrap_or_else(|e| e.into_inner());
        state.slots.iter().map(|s| s.expect("every rank published before the barrier")).collect()
    };
    let agree =
        published.iter().all(|p| p.op == mine.op && p.dtype == mine.dtype && p.len == mine.len);
    let mut scratch = vec![T::default(); out_len];
    if agree {
        // SAFETY: every rank's input stays valid and unwritten until the last barrier below (see
        // `Published`); lengths and dtypes agree (checked).
        let inputs: Vec<&[T]> = published
            .iter()
            .map(|p| unsafe { std::slice::from_raw_parts(p.ptr.ptr().cast::<T>(), p.len) })
            .collect();
        compute(&inputs, &mut scratch);
    }
    // Everybody has read every input: outputs may now be written, even over inputs.
    group.barrier(mine.op, rank)?;
    if !agree {
        let ops: Vec<_> =
            published.iter().map(|p| format!("{}<{}>[{}]", p.op, p.dtype, p.len)).collect();
        group.barrier(mine.op, rank)?;
        return Err(fail(format!("the ranks called different collectives: {}", ops.join(", "))));
    }
    // SAFETY: `out` points to `out_len` elements of this rank's buffer, kept alive by the caller;
    // the checker keeps other streams off that range; other ranks no longer read it (barrier).
    unsafe { std::ptr::copy_nonoverlapping(scratch.as_ptr(), out.ptr(), out_len) };
    group.barrier(mine.op, rank)
}

fn reduce<T: Element>(inputs: &[&[T]], offset: usize, out: &mut [T], op: ReduceOp) {
    for (i, out) in out.iter_mut().enumerate() {
        let values = inputs.iter().map(|input| input[offset + i].to_f64());
        let combined = match op {
            ReduceOp::Sum => values.sum(),
            ReduceOp::Avg => values.sum::<f64>() / inputs.len() as f64,
            ReduceOp::Max => values.fold(f64::NEG_INFINITY, f64::max),
        };
        *out = T::from_f64(combined);
    }
}

impl Comm for CpuComm {
    type Device = CpuDevice;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.group.world
    }

    fn all_reduce<T: Element>(
        &self,
        stream: &CpuStream,
        buf: &CpuBuffer<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()> {
        let compute = move |inputs: &[&[T]], out: &mut [T]| reduce(inputs, 0, out, op);
        self.collective("all_reduce", stream, (buf, range.clone()), (buf, range), compute)
    }

    fn reduce_scatter<T: Element>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<T>,
        src_range: Range<usize>,
        dst: &CpuBuffer<T>,
        dst_offset: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let world = self.group.world;
        if !src_range.len().is_multiple_of(world) {
            return Err(DeviceError::LengthMismatch {
                what: "reduce_scatter: input length is not a multiple of the world size",
                left: src_range.len(),
                right: world,
            });
        }
        let n = src_range.len() / world;
        let offset = self.rank * n;
        let dst_range = dst_offset..dst_offset + n;
        let in_place = dst_offset == src_range.start + offset;
        let (input, output) = ((src, src_range), (dst, dst_range));
        self.check_placement("reduce_scatter", &input, &output, in_place, REDUCE_SCATTER_IN_PLACE)?;
        let compute = move |inputs: &[&[T]], out: &mut [T]| reduce(inputs, offset, out, op);
        self.collective("reduce_scatter", stream, input, output, compute)
    }

    fn reduce<T: Element>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<T>,
        src_range: Range<usize>,
        dst: &CpuBuffer<T>,
        dst_offset: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_root("reduce", root)?;
        // Only the root writes: the other ranks declare (and write) an empty output range.
        let len = if self.rank == root { src_range.len() } else { 0 };
        let in_place = dst_offset == src_range.start;
        let (input, output) = ((src, src_range), (dst, dst_offset..dst_offset + len));
        self.check_placement("reduce", &input, &output, in_place, REDUCE_IN_PLACE)?;
        let compute = move |inputs: &[&[T]], out: &mut [T]| reduce(inputs, 0, out, op);
        self.collective("reduce", stream, input, output, compute)
    }

    fn all_gather<T: Element>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<T>,
        src_range: Range<usize>,
        dst: &CpuBuffer<T>,
        dst_range: Range<usize>,
    ) -> Result<()> {
        if dst_range.len() != src_range.len() * self.group.world {
            return Err(DeviceError::LengthMismatch {
                what: "all_gather: output length is not world size × input length",
                left: dst_range.len(),
                right: src_range.len() * self.group.world,
            });
        }
        let in_place = src_range.start == dst_range.start + self.rank * src_range.len();
        let (input, output) = ((src, src_range), (dst, dst_range));
        self.check_placement("all_gather", &input, &output, in_place, ALL_GATHER_IN_PLACE)?;
        let compute = |inputs: &[&[T]], out: &mut [T]| {
            for (chunk, input) in out.chunks_mut(inputs[0].len().max(1)).zip(inputs) {
                chunk.copy_from_slice(input);
            }
        };
        self.collective("all_gather", stream, input, output, compute)
    }

    fn broadcast<T: Element>(
        &self,
        stream: &CpuStream,
        buf: &CpuBuffer<T>,
        range: Range<usize>,
        root: usize,
    ) -> Result<()> {
        self.check_root("broadcast", root)?;
        let compute = move |inputs: &[&[T]], out: &mut [T]| out.copy_from_slice(inputs[root]);
        self.collective("broadcast", stream, (buf, range.clone()), (buf, range), compute)
    }
}

impl CpuComm {
    /// Bounds-checks both ranges, then refuses an overlap of input and output that is not the
    /// collective's in-place form, as `NcclComm` does (see [`check_placement`]).
    fn check_placement<T: Element>(
        &self,
        op: &'static str,
        (src, src_range): &(&CpuBuffer<T>, Range<usize>),
        (dst, dst_range): &(&CpuBuffer<T>, Range<usize>),
        in_place: bool,
        rule: &str,
    ) -> Result<()> {
        check_range(op, src_range, src.len)?;
        check_range(op, dst_range, dst.len)?;
        let same = src.id == dst.id;
        check_placement(op, self.rank, same, (src_range, dst_range), in_place, rule)
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root < self.group.world {
            return Ok(());
        }
        let reason = format!("root {root} is not a rank of a world of {}", self.group.world);
        Err(DeviceError::Collective { op, rank: self.rank, reason })
    }
}
