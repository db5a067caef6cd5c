//! Host buffers and the in-flight tokens of asynchronous copies.
//!
//! This is where DESIGN.md §3 rule 1 lives: **a host buffer that a copy is writing cannot be read,
//! and a host buffer that a copy is reading cannot be written.**
//!
//! - A device-to-host copy returns a [`Filling`] token that mutably borrows the destination buffer,
//!   so the borrow checker rejects any read of it until the token is gone. The only ways to end the
//!   token are [`Filling::wait`] and dropping it, and both wait for the event recorded right after
//!   the copy.
//! - A host-to-device copy returns a [`Draining`] token that borrows the source buffer shared: the
//!   host may read it meanwhile but not overwrite it.
//! - A token that is detached ([`Filling::detach`], [`Draining::detach`], or leaked with
//!   `mem::forget`) ends the borrow without waiting. The buffer remembers
//!   its pending copies, so the next access waits for them: leaking a token costs a stall, never a
//!   stale read. Safe code cannot observe a half-finished copy.

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use zeroflow_core::Element;

use crate::error::{DeviceError, Result};

/// The completion of one asynchronous operation (an event recorded right after it).
pub trait Completion: Send + Sync + fmt::Debug {
    /// Blocks until the operation has finished.
    fn wait(&self) -> Result<()>;
}

/// Where errors go that happen where nobody can return them (a token's drop).
pub trait ErrorSink: Send + Sync + fmt::Debug {
    fn park(&self, error: DeviceError);
}

/// Host memory owned by a device backend: page-locked memory of the CUDA driver, or an aligned heap
/// allocation for the CPU device.
///
/// # Safety
/// `ptr()` must point to `bytes()` bytes that stay valid, readable and writable, and are not
/// accessed by anyone but the owning [`HostBuffer`] (and the copies it hands the memory to) until
/// the value is dropped. The memory must be zero-filled when the value is created.
pub unsafe trait RawHostMemory: Send + Sync + fmt::Debug {
    fn ptr(&self) -> NonNull<u8>;
    fn bytes(&self) -> usize;
    /// True for page-locked memory.
    fn pinned(&self) -> bool;
}

/// An aligned, zero-filled heap allocation: the host memory of the CPU device, and pageable memory
/// for any device.
#[derive(Debug)]
pub struct HeapMemory {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl HeapMemory {
    /// Cache-line aligned (and AVX-512 aligned) so SIMD kernels can use aligned loads.
    const ALIGN: usize = 64;

    pub fn zeroed(bytes: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(bytes.max(1), Self::ALIGN)
            .map_err(|_| DeviceError::OutOfMemory { memory: "host", bytes })?;
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or(DeviceError::OutOfMemory { memory: "host", bytes })?;
        Ok(HeapMemory { ptr, layout })
    }
}

impl Drop for HeapMemory {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with this layout and is freed once, here.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: HeapMemory owns its allocation exclusively; it is plain memory usable from any thread.
unsafe impl Send for HeapMemory {}
// SAFETY: as above; `&HeapMemory` only exposes the pointer value.
unsafe impl Sync for HeapMemory {}

// SAFETY: the allocation is `layout.size() >= bytes()` bytes, zero-filled by `alloc_zeroed`, and
// freed only on drop.
unsafe impl RawHostMemory for HeapMemory {
    fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.layout.size()
    }
    fn pinned(&self) -> bool {
        false
    }
}

/// Copies that have not been waited on, remembered so that an access after a leaked token waits.
#[derive(Default)]
struct Pending {
    /// A copy writing into the buffer.
    write: Option<Arc<dyn Completion>>,
    /// Copies reading from the buffer.
    reads: Vec<Arc<dyn Completion>>,
}

/// A buffer in host memory that asynchronous copies can fill or drain. Dereferences to `[T]`.
pub struct HostBuffer<T: Element> {
    memory: Box<dyn RawHostMemory>,
    ptr: NonNull<T>,
    len: usize,
    /// Fast path: false when `pending` is certainly empty.
    has_pending: AtomicBool,
    pending: Mutex<Pending>,
    sink: Arc<dyn ErrorSink>,
    _owns: PhantomData<T>,
}

// SAFETY: the buffer owns its memory; the element type is Send + Sync (Element requires it).
unsafe impl<T: Element> Send for HostBuffer<T> {}
// SAFETY: shared access hands out `&[T]` only after pending writes completed; `pending` is a Mutex.
unsafe impl<T: Element> Sync for HostBuffer<T> {}

impl<T: Element> HostBuffer<T> {
    /// Wraps zero-filled memory of at least `len` elements.
    ///
    /// # Panics
    /// If the memory is too small or misaligned for `T` (a backend bug).
    pub fn new(memory: Box<dyn RawHostMemory>, len: usize, sink: Arc<dyn ErrorSink>) -> Self {
        assert!(memory.bytes() >= len * std::mem::size_of::<T>(), "host memory too small");
        let ptr = memory.ptr().cast::<T>();
        assert!(ptr.as_ptr().is_aligned(), "host memory misaligned");
        HostBuffer {
            memory,
            ptr,
            len,
            has_pending: AtomicBool::new(false),
            pending: Mutex::new(Pending::default()),
            sink,
            _owns: PhantomData,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True if the memory is page-locked.
    pub fn pinned(&self) -> bool {
        self.memory.pinned()
    }

    fn raw_ptr(&self) -> NonNull<T> {
        self.ptr
    }

    /// Waits for every pending copy that conflicts with the access (`write` = the host will write).
    fn settle_for(&self, write: bool) {
        if !self.has_pending.load(Ordering::Acquire) {
            return;
        }
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(copy) = pending.write.take() {
            self.park_err(copy.wait());
        }
        if write {
            for copy in pending.reads.drain(..) {
                self.park_err(copy.wait());
            }
        }
        let empty = pending.write.is_none() && pending.reads.is_empty();
        self.has_pending.store(!empty, Ordering::Release);
    }

    /// Waits for every copy still using the buffer (into it or out of it) whose token was
    /// detached ([`Filling::detach`], [`Draining::detach`]); an error of such a copy is parked.
    pub fn settle(&mut self) {
        self.settle_for(true);
    }

    fn park_err(&self, result: Result<()>) {
        if let Err(e) = result {
            self.sink.park(e);
        }
    }

    fn add_pending(&self, completion: Arc<dyn Completion>, write: bool) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if write {
            pending.write = Some(completion);
        } else {
            pending.reads.push(completion);
        }
        self.has_pending.store(true, Ordering::Release);
    }

    fn remove_pending(&self, completion: &Arc<dyn Completion>) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.write.as_ref().is_some_and(|w| Arc::ptr_eq(w, completion)) {
            pending.write = None;
        }
        pending.reads.retain(|r| !Arc::ptr_eq(r, completion));
        let empty = pending.write.is_none() && pending.reads.is_empty();
        self.has_pending.store(!empty, Ordering::Release);
    }

    /// Reads the buffer without waiting for a copy that may be writing it.
    ///
    /// # Safety
    /// This deliberately races: a copy may be writing the elements while they are read, which is a
    /// data race. It exists only so that tests can show that chaos mode exposes the race the token
    /// API prevents. The caller must accept reading torn or stale values and must not use it
    /// outside such a test.
    #[cfg(any(test, feature = "race-demo"))]
    pub unsafe fn read_unsynchronized(&self) -> Vec<T> {
        (0..self.len)
            // SAFETY: in bounds; the caller accepts the race (see above). Volatile keeps the
            // compiler from assuming the memory is unchanged.
            .map(|i| unsafe { std::ptr::read_volatile(self.ptr.as_ptr().add(i)) })
            .collect()
    }
}

impl<T: Element> Deref for HostBuffer<T> {
    type Target = [T];

    /// Waits for any copy into the buffer whose token was leaked, then gives the elements.
    fn deref(&self) -> &[T] {
        self.settle_for(false);
        // SAFETY: `ptr` points to `len` initialised elements (zero-filled, and every bit pattern of
        // an Element is valid); no copy writes them any more (settled above, and a live `Filling`
        // token would hold `&mut self`, so none can start while this borrow lives).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> DerefMut for HostBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.settle_for(true);
        // SAFETY: as in `deref`, and additionally no copy reads the elements any more, and `&mut
        // self` excludes every other borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Element> Drop for HostBuffer<T> {
    fn drop(&mut self) {
        // The memory must outlive every copy that uses it, even those whose token leaked.
        self.settle_for(true);
    }
}

impl<T: Element> fmt::Debug for HostBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("dtype", &T::DTYPE)
            .field("len", &self.len)
            .field("pinned", &self.pinned())
            .finish()
    }
}

/// A copy from the device into a host buffer, in flight. Holds the buffer mutably borrowed: nothing
/// can read it until [`Filling::wait`] returns (or the token is dropped, which also waits).
#[must_use = "the buffer stays borrowed until the copy is waited on"]
#[derive(Debug)]
pub struct Filling<'a, T: Element> {
    buffer: &'a mut HostBuffer<T>,
    done: Option<Arc<dyn Completion>>,
}

impl<'a, T: Element> Filling<'a, T> {
    /// For backends: waits out any copy still using the buffer (after a leaked token), lets
    /// `enqueue` start the copy into the raw memory, and makes the token.
    pub fn start(
        buffer: &'a mut HostBuffer<T>,
        enqueue: impl FnOnce(NonNull<T>, usize) -> Result<Arc<dyn Completion>>,
    ) -> Result<Self> {
        buffer.settle_for(true);
        let done = enqueue(buffer.raw_ptr(), buffer.len())?;
        buffer.add_pending(done.clone(), true);
        Ok(Filling { buffer, done: Some(done) })
    }

    /// Waits for the copy (its event) and gives the filled buffer back.
    pub fn wait(mut self) -> Result<&'a mut HostBuffer<T>> {
        let done = self.done.take().expect("a live token has its completion");
        let result = done.wait();
        self.buffer.remove_pending(&done);
        // Moving the field out of a type with Drop is not allowed; take a copy of the reference.
        let buffer: *mut HostBuffer<T> = self.buffer;
        drop(self);
        // SAFETY: `buffer` is the `&'a mut` this token held; the token is gone, so this is again
        // the only reference.
        result.map(|()| unsafe { &mut *buffer })
    }
}

impl<T: Element> Filling<'_, T> {
    /// Lets the copy run on without waiting for it here: the borrow ends, and the buffer, which
    /// remembers the copy, waits for it at its next access (or [`HostBuffer::settle`]).
    pub fn detach(mut self) {
        self.done = None;
    }

    /// The buffer being filled, for the race demonstration only (see
    /// [`HostBuffer::read_unsynchronized`]): safe code can do nothing with it but that.
    #[cfg(any(test, feature = "race-demo"))]
    pub fn buffer_for_race_demo(&self) -> &HostBuffer<T> {
        self.buffer
    }
}

impl<T: Element> Drop for Filling<'_, T> {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let result = done.wait();
            self.buffer.remove_pending(&done);
            self.buffer.park_err(result);
        }
    }
}

/// A copy from a host buffer to the device, in flight. Holds the buffer shared: the host may read it
/// but not overwrite it until the copy has been waited on.
#[must_use = "the buffer stays borrowed until the copy is waited on"]
#[derive(Debug)]
pub struct Draining<'a, T: Element> {
    buffer: &'a HostBuffer<T>,
    done: Option<Arc<dyn Completion>>,
}

impl<'a, T: Element> Draining<'a, T> {
    /// For backends: waits out any copy still writing the buffer (after a leaked token), lets
    /// `enqueue` start the copy out of the raw memory, and makes the token.
    pub fn start(
        buffer: &'a HostBuffer<T>,
        enqueue: impl FnOnce(NonNull<T>, usize) -> Result<Arc<dyn Completion>>,
    ) -> Result<Self> {
        buffer.settle_for(false);
        let done = enqueue(buffer.raw_ptr(), buffer.len())?;
        buffer.add_pending(done.clone(), false);
        Ok(Draining { buffer, done: Some(done) })
    }

    /// The buffer being copied, for reading.
    pub fn buffer(&self) -> &HostBuffer<T> {
        self.buffer
    }

    /// Lets the copy run on without waiting for it here: the borrow ends, and the buffer, which
    /// remembers the copy, waits for it before its next write (or at [`HostBuffer::settle`]).
    pub fn detach(mut self) {
        self.done = None;
    }

    /// Waits for the copy (its event).
    pub fn wait(mut self) -> Result<()> {
        let done = self.done.take().expect("a live token has its completion");
        let result = done.wait();
        self.buffer.remove_pending(&done);
        result
    }
}

impl<T: Element> Drop for Draining<'_, T> {
    fn drop(&mut self) {
        if let Some(done) = self.done.take() {
            let result = done.wait();
            self.buffer.remove_pending(&done);
            self.buffer.park_err(result);
        }
    }
}
