//! `CpuDevice`: the device contract on the CPU, with truly asynchronous streams.
//!
//! Every stream is a worker thread; operations are queued and run later. Events complete when the
//! worker reaches them. Two things make this device the place where synchronisation bugs are caught
//! without a GPU:
//!
//! - the happens-before checker (`hb`) refuses, deterministically and at the moment it is queued,
//!   any operation that touches memory another stream may still be using without an event between
//!   them;
//! - chaos mode ([`Chaos`]) sleeps a random short time before each operation, so that host-side
//!   races (outside the device) show up as wrong values.

mod comm;
mod hb;
mod kernel;
mod ops;
mod worker;

use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

pub use comm::CpuComm;
pub use kernel::{KernelArgs, KernelCtx};
pub use worker::Chaos;
use zeroflow_core::Element;

use self::hb::{Checker, Clock, Touch};
use self::worker::{Op, Progress, Work, Worker};
use crate::error::{DeviceError, Result};
use crate::host::{
    Completion, Draining, ErrorSink, Filling, HeapMemory, HostBuffer, RawHostMemory,
};
use crate::pinned::{PinnedBudget, pinned_or_pageable};
use crate::{Device, DeviceBuffer, HostMemory, StreamKind, check_range};

/// The CPU device. Cheap to clone: clones share the streams.
#[derive(Clone)]
pub struct CpuDevice {
    inner: Arc<Inner>,
}

struct Inner {
    checker: Mutex<Checker>,
    standard: [CpuStream; 4],
    workers: Mutex<Vec<Arc<Worker>>>,
    errors: Arc<ErrorList>,
    chaos: Option<Chaos>,
    next_buffer: AtomicU64,
    copied: crate::CopyCounters,
    /// The pinned budget, as on a GPU: its "pinned" buffers are heap memory counted against it,
    /// so that the fallback past the budget runs (and is tested) without a GPU.
    pinned: Arc<PinnedBudget>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        for worker in self.workers.get_mut().unwrap_or_else(|e| e.into_inner()).iter() {
            worker.shut_down();
        }
    }
}

/// A stream of the CPU device.
#[derive(Clone)]
pub struct CpuStream {
    index: usize,
    worker: Arc<Worker>,
}

impl fmt::Debug for CpuStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuStream({})", self.worker.name)
    }
}

/// An event of the CPU device: a position in one stream's queue, with the order it implies.
#[derive(Debug, Default)]
pub struct CpuEvent {
    stamp: Option<Stamp>,
}

#[derive(Clone, Debug)]
struct Stamp {
    progress: Arc<Progress>,
    position: u64,
    clock: Clock,
}

/// A buffer of the CPU device: heap memory that only stream workers touch.
pub struct CpuBuffer<T: Element> {
    storage: Arc<HeapMemory>,
    len: usize,
    id: u64,
    device: Arc<Inner>,
    _elements: PhantomData<T>,
}

impl<T: Element> CpuBuffer<T> {
    /// A number that names this buffer in race reports.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn base(&self) -> SendPtr<T> {
        SendPtr(self.storage.ptr().cast())
    }
}

impl<T: Element> DeviceBuffer for CpuBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: Element> Drop for CpuBuffer<T> {
    fn drop(&mut self) {
        // Operations still queued hold their own reference to the storage.
        self.device.checker().forget(self.id);
    }
}

impl<T: Element> fmt::Debug for CpuBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CpuBuffer#{}<{}>[{}]", self.id, T::DTYPE, self.len)
    }
}

/// A raw pointer that may cross to a worker thread. Whoever dereferences it must know the memory
/// is alive and not accessed concurrently (the checker and the tokens ensure that).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SendPtr<T>(NonNull<T>);

// SAFETY: the pointer is only a value; dereferencing it is what needs justification, at each use.
unsafe impl<T> Send for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// # Safety
    /// `offset` must be within the allocation the pointer points into.
    pub(crate) unsafe fn add(self, offset: usize) -> Self {
        // SAFETY: guaranteed by the caller.
        SendPtr(unsafe { self.0.add(offset) })
    }

    pub(crate) fn ptr(self) -> *mut T {
        self.0.as_ptr()
    }
}

/// Errors parked by operations that failed on a worker, or by dropped tokens.
#[derive(Debug, Default)]
struct ErrorList(Mutex<Vec<DeviceError>>);

impl ErrorSink for ErrorList {
    fn park(&self, error: DeviceError) {
        tracing::debug!(%error, "device error parked");
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(error);
    }
}

/// The completion of an operation queued at `stamp.position`.
#[derive(Debug)]
struct CpuCompletion {
    stamp: Stamp,
    device: Arc<Inner>,
}

impl Completion for CpuCompletion {
    fn wait(&self) -> Result<()> {
        self.stamp.progress.wait_for(self.stamp.position);
        self.device.checker().host_waits(&self.stamp.clock);
        Ok(())
    }
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuDevice").field("chaos", &self.chaos).finish_non_exhaustive()
    }
}

impl fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

impl Inner {
    fn checker(&self) -> MutexGuard<'_, Checker> {
        self.checker.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl CpuDevice {
    /// A CPU device without chaos.
    pub fn new() -> Result<Self> {
        Self::build(None)
    }

    /// A CPU device whose streams sleep randomly before each operation.
    pub fn with_chaos(chaos: Chaos) -> Result<Self> {
        Self::build(Some(chaos))
    }

    fn build(chaos: Option<Chaos>) -> Result<Self> {
        let errors = Arc::new(ErrorList::default());
        let mut checker = Checker::default();
        let mut workers = Vec::new();
        let mut spawn = |name: &'static str| -> Result<CpuStream> {
            let index = checker.add_stream(name);
            let worker = Worker::spawn(name, index, chaos, errors.clone())?;
            workers.push(worker.clone());
            Ok(CpuStream { index, worker })
        };
        let standard = [
            spawn(StreamKind::Compute.name())?,
            spawn(StreamKind::Comm.name())?,
            spawn(StreamKind::D2h.name())?,
            spawn(StreamKind::H2d.name())?,
        ];
        Ok(CpuDevice {
            inner: Arc::new(Inner {
                checker: Mutex::new(checker),
                standard,
                workers: Mutex::new(workers),
                errors,
                chaos,
                next_buffer: AtomicU64::new(1),
                copied: crate::CopyCounters::default(),
                pinned: Arc::default(),
            }),
        })
    }

    /// The chaos settings, if any.
    pub fn chaos(&self) -> Option<Chaos> {
        self.inner.chaos
    }

    /// Queues `work` on `stream` after checking `touches` against the happens-before order.
    /// Returns the stamp of the operation (for a token or event).
    fn enqueue(
        &self,
        stream: &CpuStream,
        op: &'static str,
        touches: &[Touch],
        work: Work,
    ) -> Result<Stamp> {
        let mut checker = self.inner.checker();
        let position = checker.admit(stream.index, op, touches)?;
        // Pushed while the checker is locked, so queue order is position order.
        stream.worker.push(Op::Run { position, work })?;
        Ok(Stamp {
            progress: stream.worker.progress.clone(),
            position,
            clock: checker.snapshot(stream.index),
        })
    }

    fn completion(&self, stamp: Stamp) -> Arc<dyn Completion> {
        Arc::new(CpuCompletion { stamp, device: self.inner.clone() })
    }

    fn touch<T: Element>(buffer: &CpuBuffer<T>, range: &Range<usize>, write: bool) -> Touch {
        Touch { buffer: buffer.id, dtype: T::DTYPE, range: range.clone(), write }
    }
}

/// Copies `len` elements between two places on a worker.
///
/// `keep` holds the device storages involved; a host buffer needs no such reference because its drop
/// waits for the copies it has pending.
fn copy_work<T: Element>(keep: Keep, src: SendPtr<T>, dst: SendPtr<T>, len: usize) -> Work {
    Box::new(move || {
        // SAFETY: both ranges were bounds-checked when queued; device storages are kept alive by
        // `keep` and host buffers by their pending-copy wait on drop; the checker (device memory)
        // and the token (host memory) guarantee that nothing else accesses either range until
        // this operation has finished; `ptr::copy` allows overlap (a copy within one buffer).
        unsafe { std::ptr::copy(src.ptr(), dst.ptr(), len) };
        drop(keep);
        Ok(())
    })
}

/// Device storages that a queued operation keeps alive.
type Keep = (Option<Arc<HeapMemory>>, Option<Arc<HeapMemory>>);

impl Device for CpuDevice {
    type Buffer<T: Element> = CpuBuffer<T>;
    type Stream = CpuStream;
    type Event = CpuEvent;

    fn describe(&self) -> String {
        match self.inner.chaos {
            None => "cpu".into(),
            Some(c) => format!("cpu (chaos seed {})", c.seed),
        }
    }

    fn alloc<T: Element>(&self, len: usize) -> Result<CpuBuffer<T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(DeviceError::OutOfMemory { memory: "device", bytes: usize::MAX })?;
        Ok(CpuBuffer {
            storage: Arc::new(HeapMemory::zeroed(bytes)?),
            len,
            id: self.inner.next_buffer.fetch_add(1, Ordering::Relaxed),
            device: self.inner.clone(),
            _elements: PhantomData,
        })
    }

    /// Heap memory either way; a pinned buffer within the budget counts as pinned.
    fn alloc_host<T: Element>(&self, len: usize, memory: HostMemory) -> Result<HostBuffer<T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(DeviceError::OutOfMemory { memory: "host", bytes: usize::MAX })?;
        let raw: Box<dyn RawHostMemory> = match memory {
            HostMemory::Pinned => pinned_or_pageable(&self.inner.pinned, bytes, |bytes| {
                Ok(HeapMemory::zeroed(bytes))
            })?,
            HostMemory::Pageable => Box::new(HeapMemory::zeroed(bytes)?),
        };
        Ok(HostBuffer::new(raw, len, self.inner.errors.clone()))
    }

    fn pinned_budget(&self) -> &PinnedBudget {
        &self.inner.pinned
    }

    fn stream(&self, kind: StreamKind) -> &CpuStream {
        &self.inner.standard[kind as usize]
    }

    fn new_stream(&self, name: &'static str) -> Result<CpuStream> {
        let index = self.inner.checker().add_stream(name);
        let worker = Worker::spawn(name, index, self.inner.chaos, self.inner.errors.clone())?;
        self.inner.workers.lock().unwrap_or_else(|e| e.into_inner()).push(worker.clone());
        Ok(CpuStream { index, worker })
    }

    fn new_event(&self) -> Result<CpuEvent> {
        Ok(CpuEvent::default())
    }

    fn record(&self, event: &mut CpuEvent, stream: &CpuStream) -> Result<()> {
        let checker = self.inner.checker();
        let clock = checker.snapshot(stream.index);
        event.stamp = Some(Stamp {
            progress: stream.worker.progress.clone(),
            position: clock.get(stream.index),
            clock,
        });
        Ok(())
    }

    fn wait_event(&self, stream: &CpuStream, event: &CpuEvent) -> Result<()> {
        let stamp = event.stamp.as_ref().ok_or(DeviceError::EventNotRecorded)?;
        let mut checker = self.inner.checker();
        let own = checker.admit(stream.index, "wait_event", &[])?;
        checker.stream_waits(stream.index, &stamp.clock);
        stream.worker.push(Op::Wait {
            own,
            other: stamp.progress.clone(),
            position: stamp.position,
        })
    }

    fn sync_event(&self, event: &CpuEvent) -> Result<()> {
        let stamp = event.stamp.clone().ok_or(DeviceError::EventNotRecorded)?;
        self.completion(stamp).wait()
    }

    fn event_done(&self, event: &CpuEvent) -> Result<bool> {
        let stamp = event.stamp.as_ref().ok_or(DeviceError::EventNotRecorded)?;
        let done = stamp.progress.reached(stamp.position);
        if done {
            // What the host learns here is what a wait would have taught it.
            self.inner.checker().host_waits(&stamp.clock);
        }
        Ok(done)
    }

    fn synchronize(&self) -> Result<()> {
        let streams: Vec<CpuStream> = {
            let workers = self.inner.workers.lock().unwrap_or_else(|e| e.into_inner());
            workers
                .iter()
                .enumerate()
                .map(|(index, worker)| CpuStream { index, worker: worker.clone() })
                .collect()
        };
        for stream in &streams {
            let mut event = CpuEvent::default();
            self.record(&mut event, stream)?;
            self.sync_event(&event)?;
        }
        match self.take_errors().into_iter().next() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    fn take_errors(&self) -> Vec<DeviceError> {
        std::mem::take(&mut *self.inner.errors.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn copied_bytes(&self) -> crate::CopiedBytes {
        self.inner.copied.get()
    }

    fn copy_d2h<'a, T: Element>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<T>,
        src_range: Range<usize>,
        dst: &'a mut HostBuffer<T>,
        dst_offset: usize,
    ) -> Result<Filling<'a, T>> {
        check_range("copy_d2h source", &src_range, src.len)?;
        let len = src_range.len();
        check_range("copy_d2h destination", &(dst_offset..dst_offset + len), dst.len())?;
        self.inner.copied.add(false, len * size_of::<T>());
        let touches = [Self::touch(src, &src_range, false)];
        Filling::start(dst, |host, _| {
            // SAFETY: both offsets were bounds-checked above.
            let (from, to) =
                unsafe { (src.base().add(src_range.start), SendPtr(host).add(dst_offset)) };
            let work = copy_work((Some(src.storage.clone()), None), from, to, len);
            let stamp = self.enqueue(stream, "copy_d2h", &touches, work)?;
            Ok(self.completion(stamp))
        })
    }

    fn copy_h2d<'a, T: Element>(
        &self,
        stream: &CpuStream,
        src: &'a HostBuffer<T>,
        src_range: Range<usize>,
        dst: &CpuBuffer<T>,
        dst_offset: usize,
    ) -> Result<Draining<'a, T>> {
        check_range("copy_h2d source", &src_range, src.len())?;
        let len = src_range.len();
        let dst_range = dst_offset..dst_offset + len;
        check_range("copy_h2d destination", &dst_range, dst.len)?;
        self.inner.copied.add(true, len * size_of::<T>());
        let touches = [Self::touch(dst, &dst_range, true)];
        Draining::start(src, |host, _| {
            // SAFETY: both offsets were bounds-checked above.
            let (from, to) =
                unsafe { (SendPtr(host).add(src_range.start), dst.base().add(dst_offset)) };
            let work = copy_work((None, Some(dst.storage.clone())), from, to, len);
            let stamp = self.enqueue(stream, "copy_h2d", &touches, work)?;
            Ok(self.completion(stamp))
        })
    }

    fn copy_d2d<T: Element>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<T>,
        src_range: Range<usize>,
        dst: &CpuBuffer<T>,
        dst_offset: usize,
    ) -> Result<()> {
        check_range("copy_d2d source", &src_range, src.len)?;
        let len = src_range.len();
        let dst_range = dst_offset..dst_offset + len;
        check_range("copy_d2d destination", &dst_range, dst.len)?;
        let touches = [Self::touch(src, &src_range, false), Self::touch(dst, &dst_range, true)];
        // SAFETY: both offsets were bounds-checked above.
        let (from, to) = unsafe { (src.base().add(src_range.start), dst.base().add(dst_offset)) };
        let work = copy_work((Some(src.storage.clone()), Some(dst.storage.clone())), from, to, len);
        self.enqueue(stream, "copy_d2d", &touches, work).map(drop)
    }

    fn fill<T: Element>(
        &self,
        stream: &CpuStream,
        dst: &CpuBuffer<T>,
        range: Range<usize>,
        value: T,
    ) -> Result<()> {
        check_range("fill", &range, dst.len)?;
        let touches = [Self::touch(dst, &range, true)];
        // SAFETY: the offset was bounds-checked above.
        let to = unsafe { dst.base().add(range.start) };
        let keep = dst.storage.clone();
        let len = range.len();
        let work: Work = Box::new(move || {
            // SAFETY: in bounds; the storage is alive (`keep`); the checker guarantees no other
            // stream touches the range until this operation has finished.
            let slice = unsafe { std::slice::from_raw_parts_mut(to.ptr(), len) };
            slice.fill(value);
            drop(keep);
            Ok(())
        });
        self.enqueue(stream, "fill", &touches, work).map(drop)
    }
}

#[cfg(test)]
mod tests;
