//! The device contract of zeroflow (DESIGN.md §3) and its implementations.
//!
//! A [`Device`] gives device buffers, [`HostBuffer`]s (page-locked within its [`PinnedBudget`]),
//! streams, events, asynchronous copies between the two, and (through [`Comm`]) collectives. Its
//! rules are enforced by types:
//!
//! 1. A host buffer that a copy is writing cannot be read: device-to-host copies return a
//!    [`Filling`] token that mutably borrows the buffer until the copy's own event has been waited
//!    on. Copies out of a host buffer return a [`Draining`] token that borrows it shared.
//! 2. Streams are ordered only by explicit events that the caller owns ([`Device::record`],
//!    [`Device::wait_event`]). [`CpuDevice`] checks every operation against the happens-before
//!    order those events create and refuses, with [`DeviceError::Race`], any operation that would
//!    touch memory another stream may still be using.
//! 3. Errors are values: every call returns a `Result`, and errors that happen where nobody can
//!    return them (a token dropped without waiting) are parked and collected by
//!    [`Device::take_errors`].

pub mod comm;
pub mod cpu;
pub mod cuda;
pub mod error;
pub mod host;
pub mod ops;
pub mod pinned;

use std::fmt;
use std::ops::Range;

pub use comm::{Comm, ReduceOp};
pub use cpu::{Chaos, CpuDevice};
pub use cuda::CudaDevice;
pub use error::{DeviceError, Race, Result};
pub use host::{Draining, Filling, HostBuffer};
pub use ops::{Kernels, Matrix};
pub use pinned::{PinnedBudget, PinnedUse};
use zeroflow_core::{Element, Float};

/// The four streams every device has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Forward, backward and optimizer kernels.
    Compute,
    /// Collectives: reduce-scatter of gradients, all-gather of weights.
    Comm,
    /// Device-to-host copies (gradients to the CPU optimizer).
    D2h,
    /// Host-to-device copies (updated weights back).
    H2d,
}

impl StreamKind {
    pub const ALL: [StreamKind; 4] =
        [StreamKind::Compute, StreamKind::Comm, StreamKind::D2h, StreamKind::H2d];

    pub const fn name(self) -> &'static str {
        match self {
            StreamKind::Compute => "compute",
            StreamKind::Comm => "comm",
            StreamKind::D2h => "d2h",
            StreamKind::H2d => "h2d",
        }
    }
}

/// Bytes a device's copies have moved between host and device memory since it was opened (each
/// copy counted when it is queued): what crossed PCIe, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CopiedBytes {
    pub host_to_device: u64,
    pub device_to_host: u64,
}

impl CopiedBytes {
    /// What was copied after `earlier` (a reading of the same device's counters).
    pub fn since(self, earlier: CopiedBytes) -> CopiedBytes {
        CopiedBytes {
            host_to_device: self.host_to_device - earlier.host_to_device,
            device_to_host: self.device_to_host - earlier.device_to_host,
        }
    }
}

/// The counters behind [`Device::copied_bytes`].
#[derive(Debug, Default)]
pub(crate) struct CopyCounters {
    host_to_device: std::sync::atomic::AtomicU64,
    device_to_host: std::sync::atomic::AtomicU64,
}

impl CopyCounters {
    pub(crate) fn add(&self, to_device: bool, bytes: usize) {
        let counter = if to_device { &self.host_to_device } else { &self.device_to_host };
        counter.fetch_add(bytes as u64, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> CopiedBytes {
        let load = |c: &std::sync::atomic::AtomicU64| c.load(std::sync::atomic::Ordering::Relaxed);
        CopiedBytes {
            host_to_device: load(&self.host_to_device),
            device_to_host: load(&self.device_to_host),
        }
    }
}

/// What kind of host memory to allocate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostMemory {
    /// Page-locked (pinned) memory that the copy engines reach directly. The default for staging.
    /// Counted against the device's [`PinnedBudget`]: past it, or where pinning fails, the
    /// buffer is pageable instead ([`HostBuffer::pinned`] says which it got).
    Pinned,
    /// Ordinary pageable memory (`pin_memory: false`): copies are slower.
    Pageable,
}

/// The largest staging buffer [`Device::download`] copies through.
pub const DOWNLOAD_CHUNK_BYTES: usize = 64 << 20;

/// The bytes of each of the two buffers [`Device::upload`] copies through.
pub const UPLOAD_PIECE_BYTES: usize = DOWNLOAD_CHUNK_BYTES / 2;

/// The host memory [`Device::upload_in_pieces`] holds to upload `bytes` in pieces of
/// `piece_bytes`: one buffer of them where they are one piece, else two pieces'.
pub fn upload_staging_bytes(bytes: usize, piece_bytes: usize) -> usize {
    if bytes <= piece_bytes { bytes } else { 2 * piece_bytes }
}

/// A buffer in device memory.
pub trait DeviceBuffer: fmt::Debug + Send + Sync {
    /// Number of elements.
    fn len(&self) -> usize;

    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Elements of a download's staging buffer for `len` elements of `T`: at most
/// [`DOWNLOAD_CHUNK_BYTES`], at least one.
fn download_chunk<T: Element>(len: usize) -> usize {
    (DOWNLOAD_CHUNK_BYTES / size_of::<T>()).clamp(1, len.max(1))
}

/// A compute device with asynchronous streams. See the crate documentation for the rules.
///
/// Every operation that takes a stream is asynchronous: it is queued on that stream and returns at
/// once. Operations on one stream run in order; operations on different streams are unordered unless
/// an event orders them.
pub trait Device: fmt::Debug + Send + Sync + 'static {
    /// A buffer of `T` in device memory, zero-filled when allocated.
    type Buffer<T: Element>: DeviceBuffer;
    /// A queue of operations.
    type Stream: fmt::Debug + Send + Sync;
    /// A point in a stream's queue that other streams and the host can wait for.
    type Event: fmt::Debug + Send + Sync;

    /// A short description ("cpu (4 streams, chaos seed 7)", "NVIDIA H200 (sm_90)").
    fn describe(&self) -> String;

    /// Allocates a zero-filled device buffer of `len` elements.
    fn alloc<T: Element>(&self, len: usize) -> Result<Self::Buffer<T>>;

    /// Allocates a zero-filled host buffer of `len` elements. A pinned buffer that the device's
    /// [`PinnedBudget`] has no room for, or that the driver cannot pin, is pageable instead (and
    /// counted there): never an error for want of pinned memory.
    fn alloc_host<T: Element>(&self, len: usize, memory: HostMemory) -> Result<HostBuffer<T>>;

    /// The page-locked host memory this device holds against its limit, and what fell back.
    fn pinned_budget(&self) -> &PinnedBudget;

    /// One of the device's four streams.
    fn stream(&self, kind: StreamKind) -> &Self::Stream;

    /// A new stream beyond the standard four, named `name` (for example one that loads the
    /// device, or a pipeline of its own beside the four).
    fn new_stream(&self, name: &'static str) -> Result<Self::Stream>;

    /// A new event, not yet recorded.
    fn new_event(&self) -> Result<Self::Event>;

    /// Records `event` at the current end of `stream`'s queue (replacing any earlier recording).
    fn record(&self, event: &mut Self::Event, stream: &Self::Stream) -> Result<()>;

    /// Makes `stream` wait, before its next operation, until `event` has completed.
    fn wait_event(&self, stream: &Self::Stream, event: &Self::Event) -> Result<()>;

    /// Blocks the host until `event` has completed.
    fn sync_event(&self, event: &Self::Event) -> Result<()>;

    /// True if `event` has completed, without blocking (where true, as [`Device::sync_event`]
    /// would have returned).
    fn event_done(&self, event: &Self::Event) -> Result<bool>;

    /// Blocks the host until every stream is idle, then returns the first parked error, if any.
    fn synchronize(&self) -> Result<()>;

    /// Takes the errors parked since the last call (from dropped tokens or failed operations).
    fn take_errors(&self) -> Vec<DeviceError>;

    /// The bytes host↔device copies have moved so far (see [`CopiedBytes`]).
    fn copied_bytes(&self) -> CopiedBytes;

    /// Copies `src[src_range]` into `dst[dst_offset..]` on `stream`. `dst` stays borrowed by the
    /// returned token until the copy has completed.
    fn copy_d2h<'a, T: Element>(
        &self,
        stream: &Self::Stream,
        src: &Self::Buffer<T>,
        src_range: Range<usize>,
        dst: &'a mut HostBuffer<T>,
        dst_offset: usize,
    ) -> Result<Filling<'a, T>>;

    /// Copies `src[src_range]` into `dst[dst_offset..]` on `stream`. `src` stays borrowed (shared)
    /// by the returned token until the copy has completed.
    fn copy_h2d<'a, T: Element>(
        &self,
        stream: &Self::Stream,
        src: &'a HostBuffer<T>,
        src_range: Range<usize>,
        dst: &Self::Buffer<T>,
        dst_offset: usize,
    ) -> Result<Draining<'a, T>>;

    /// Copies `src[src_range]` into `dst[dst_offset..]` on `stream`.
    fn copy_d2d<T: Element>(
        &self,
        stream: &Self::Stream,
        src: &Self::Buffer<T>,
        src_range: Range<usize>,
        dst: &Self::Buffer<T>,
        dst_offset: usize,
    ) -> Result<()>;

    /// Sets `dst[range]` to `value` on `stream`.
    fn fill<T: Element>(
        &self,
        stream: &Self::Stream,
        dst: &Self::Buffer<T>,
        range: Range<usize>,
        value: T,
    ) -> Result<()>;

    /// Uploads `data` into a new device buffer and waits for it ([`Device::upload_filled`]: at
    /// most [`DOWNLOAD_CHUNK_BYTES`] of staging, so that a large model's weights are never copied
    /// whole in host memory). For set-up and tests, not for the training loop.
    fn upload<T: Element>(&self, data: &[T]) -> Result<Self::Buffer<T>> {
        self.upload_filled(data.len(), |range, out| out.copy_from_slice(&data[range]))
    }

    /// [`Device::upload`] of `data` converted to `T` (through f32: rounded where `T` is narrower)
    /// a piece at a time, as it is copied up (no whole copy of them in `T` in host memory).
    fn upload_rounded<T: Float, S: Float>(&self, data: &[S]) -> Result<Self::Buffer<T>> {
        self.upload_filled(data.len(), |range, out| {
            out.iter_mut().zip(&data[range]).for_each(|(o, &x)| *o = T::from_f32(x.to_f32()));
        })
    }

    /// A new device buffer of `len` elements, `fill` writing each range of them into the staging
    /// it is copied up from ([`Device::upload_in_pieces`], two buffers of
    /// [`UPLOAD_PIECE_BYTES`], page-locked where the data is larger than
    /// [`DOWNLOAD_CHUNK_BYTES`]), waited for.
    fn upload_filled<T: Element>(
        &self,
        len: usize,
        mut fill: impl FnMut(Range<usize>, &mut [T]),
    ) -> Result<Self::Buffer<T>> {
        let buffer = self.alloc::<T>(len)?;
        let piece = UPLOAD_PIECE_BYTES / size_of::<T>();
        let memory = match len * size_of::<T>() > DOWNLOAD_CHUNK_BYTES {
            true => HostMemory::Pinned,
            false => HostMemory::Pageable,
        };
        self.synchronize()?;
        self.upload_in_pieces(&buffer, piece, memory, |range, out| {
            fill(range, out);
            Ok::<_, DeviceError>(())
        })?;
        Ok(buffer)
    }

    /// Fills `target` `piece` elements at a time: `fill` writes elements `range` of it into one
    /// of two host buffers (of `memory`; the second allocated where there is a second piece),
    /// which is then copied up on the h2d stream while `fill` writes the next range into the
    /// other (a buffer's next write waits for its last copy): [`upload_staging_bytes`] of host
    /// memory. Returns once every copy is done, or with the first error of `fill`.
    fn upload_in_pieces<T: Element, E: From<DeviceError>>(
        &self,
        target: &Self::Buffer<T>,
        piece: usize,
        memory: HostMemory,
        mut fill: impl FnMut(Range<usize>, &mut [T]) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let len = target.len();
        let piece = piece.clamp(1, len.max(1));
        let mut pieces: [Option<HostBuffer<T>>; 2] = [None, None];
        let h2d = self.stream(StreamKind::H2d);
        for (index, start) in (0..len).step_by(piece).enumerate() {
            let end = (start + piece).min(len);
            let buffer = match &mut pieces[index % 2] {
                Some(buffer) => buffer,
                empty => empty.insert(self.alloc_host(piece, memory)?),
            };
            fill(start..end, &mut buffer[..end - start])?;
            self.copy_h2d(h2d, buffer, 0..end - start, target, start)?.detach();
        }
        self.synchronize()?;
        Ok(())
    }

    /// Waits for every stream, then downloads `src` into a `Vec`, through a staging buffer of at
    /// most [`DOWNLOAD_CHUNK_BYTES`], so that host memory holds the data once (a large model's
    /// weights for a checkpoint). For tests and checkpoints, not for the training loop.
    fn download<T: Element>(&self, src: &Self::Buffer<T>) -> Result<Vec<T>> {
        self.download_range(src, 0..src.len())
    }

    /// [`Device::download`] of `src[range]` (a checkpoint's piece of a device buffer).
    fn download_range<T: Element>(
        &self,
        src: &Self::Buffer<T>,
        range: Range<usize>,
    ) -> Result<Vec<T>> {
        let chunk = download_chunk::<T>(range.len());
        let mut staging = Some(self.alloc_host::<T>(chunk, HostMemory::Pageable)?);
        self.download_range_via(src, range, &mut staging)
    }

    /// [`Device::download_range`] through `staging`, a host buffer the caller keeps from one
    /// call to the next (allocated by the first: at most [`DOWNLOAD_CHUNK_BYTES`], page-locked
    /// where the [`PinnedBudget`] has room), so that the pieces of a checkpoint are copied at the
    /// bus's speed and no staging buffer is allocated and zeroed per piece.
    fn download_range_via<T: Element>(
        &self,
        src: &Self::Buffer<T>,
        range: Range<usize>,
        staging: &mut Option<HostBuffer<T>>,
    ) -> Result<Vec<T>> {
        let chunk = kept_staging(self, staging, src.len(), 0)?.len().max(1);
        let mut out = Vec::with_capacity(range.len());
        for start in range.clone().step_by(chunk) {
            let end = (start + chunk).min(range.end);
            out.extend_from_slice(self.download_staged(src, start..end, staging)?);
        }
        Ok(out)
    }

    /// Waits for every stream, then downloads `src[range]` into `staging`, a host buffer the
    /// caller keeps from one call to the next (allocated or grown to hold the range: at least
    /// [`DOWNLOAD_CHUNK_BYTES`] where `src` is that large, page-locked where the [`PinnedBudget`]
    /// has room), and lends the range from there (a checkpoint writes it to its file as it lies).
    fn download_staged<'s, T: Element>(
        &self,
        src: &Self::Buffer<T>,
        range: Range<usize>,
        staging: &'s mut Option<HostBuffer<T>>,
    ) -> Result<&'s [T]> {
        let n = range.len();
        let host = kept_staging(self, staging, src.len(), n)?;
        self.synchronize()?;
        let filled = self.copy_d2h(self.stream(StreamKind::D2h), src, range, host, 0)?.wait()?;
        Ok(&filled[..n])
    }
}

/// `staging`, allocated where it is not yet (a download's chunk of a buffer of `len` elements,
/// page-locked where the budget has room) or where it holds fewer than `at_least` elements.
fn kept_staging<'s, D: Device + ?Sized, T: Element>(
    device: &D,
    staging: &'s mut Option<HostBuffer<T>>,
    len: usize,
    at_least: usize,
) -> Result<&'s mut HostBuffer<T>> {
    if staging.as_ref().is_none_or(|host| host.len() < at_least) {
        let elements = download_chunk::<T>(len).max(at_least);
        *staging = Some(device.alloc_host::<T>(elements, HostMemory::Pinned)?);
    }
    Ok(staging.as_mut().expect("allocated above"))
}

/// Checks that `range` lies within a buffer of `len` elements.
pub(crate) fn check_range(what: &'static str, range: &Range<usize>, len: usize) -> Result<()> {
    if range.start <= range.end && range.end <= len {
        Ok(())
    } else {
        Err(DeviceError::OutOfBounds { what, range: range.clone(), len })
    }
}
