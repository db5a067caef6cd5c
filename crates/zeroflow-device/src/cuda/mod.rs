//! `CudaDevice`: the device contract on an NVIDIA GPU, through cudarc.
//!
//! The CUDA libraries are opened at run time ([`library`]), so one binary serves CPU-only and GPU
//! machines; a missing library is a [`DeviceError::Library`] naming it and the fix, never a panic.
//!
//! One context per device, four non-blocking streams (compute, comm, d2h, h2d). cudarc's own event
//! tracking is turned off before anything is allocated: streams are ordered only by the events the
//! caller records and waits on, as the contract says, and every asynchronous copy is followed by an
//! event of our own whose completion ends its [`Filling`] or [`Draining`] token. (cudarc's
//! `memcpy_dtoh` into pinned memory followed by a host read returned stale data on the H200 unless
//! its tracking was on in multi-stream mode; here no read is possible before that event.)
//!
//! Device memory is raw `cuMemAlloc` memory owned by [`CudaBuffer`]; pinned host memory comes from
//! `cuMemHostAlloc` with flags 0 (cached, not write-combined) and becomes a common [`HostBuffer`].

pub mod bench;
pub mod blas;
pub mod info;
pub mod kernels;
pub mod library;
pub mod load;
mod memory;
pub mod module;
pub mod nccl;
mod slice;

use std::fmt;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{self as driver, result as cu, sys as cu_sys};
pub use info::{CudaReport, GpuInfo, LibraryReport, LoadedLibrary, is_absent, short_reason};
pub use library::{CudaLibrary, LIBRARY_PATH_FIX};
pub use memory::CudaBuffer;
pub use module::{CudaFunction, CudaModule, Dim3, KernelParams};
pub use slice::{DeviceSlice, DeviceSliceMut};
use zeroflow_core::Element;

use self::library::driver_error;
use self::memory::{FillPattern, PinnedMemory};
use crate::error::{DeviceError, Result};
use crate::host::{
    Completion, Draining, ErrorSink, Filling, HeapMemory, HostBuffer, RawHostMemory,
};
use crate::pinned::{PinnedBudget, pinned_or_pageable};
use crate::{Device, DeviceBuffer, HostMemory, StreamKind, check_range};

/// One NVIDIA GPU. Cheap to clone: clones share the context and streams.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<Inner>,
}

struct Inner {
    ctx: Arc<driver::CudaContext>,
    standard: [CudaStream; 4],
    errors: Arc<ErrorList>,
    description: String,
    compute_capability: (i32, i32),
    modules: module::ModuleCache,
    /// Where compiled kernels are cached ([`CudaDeviceOptions::kernel_cache`]).
    kernel_cache: Option<PathBuf>,
    engine_kernels: std::sync::OnceLock<kernels::EngineKernels>,
    copied: crate::CopyCounters,
    /// Without a limit until the caller sets one ([`PinnedBudget::set_limit`]).
    pinned: Arc<PinnedBudget>,
}

impl Inner {
    /// Makes the device's context current on the calling thread (every raw driver call needs it).
    /// An error cudarc parked in one of its drops is moved to our parked errors first, so that it
    /// is reported by `take_errors` rather than as a failure of this call.
    fn bind(&self) -> Result<()> {
        self.park_cudarc_errors();
        self.ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))
    }

    fn park_cudarc_errors(&self) {
        if let Err(e) = self.ctx.check_err() {
            self.errors.park(driver_error("a call in a drop (cudarc)", e));
        }
    }
}

impl fmt::Debug for Inner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ctx.ordinal())
            .field("description", &self.description)
            .finish_non_exhaustive()
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

/// A stream of the CUDA device (a non-blocking `CUstream`).
#[derive(Clone)]
pub struct CudaStream {
    name: &'static str,
    stream: Arc<driver::CudaStream>,
}

impl CudaStream {
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The cudarc stream, for launching kernels and calling libraries on it.
    pub fn raw(&self) -> &Arc<driver::CudaStream> {
        &self.stream
    }

    /// The raw `CUstream`, for libraries (cuBLASLt, NCCL) that take one.
    pub fn cu(&self) -> cu_sys::CUstream {
        self.stream.cu_stream()
    }
}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaStream({})", self.name)
    }
}

/// An event of the CUDA device (`CUevent` without timing).
#[derive(Debug)]
pub struct CudaEvent {
    event: driver::CudaEvent,
    recorded: bool,
}

/// Errors parked by drops and failed operations.
#[derive(Debug, Default)]
struct ErrorList(Mutex<Vec<DeviceError>>);

impl ErrorSink for ErrorList {
    fn park(&self, error: DeviceError) {
        tracing::debug!(%error, "device error parked");
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(error);
    }
}

/// How a host thread that waits for the GPU (an event, a copy's completion, the context) spends
/// the wait: the primary context's scheduling flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostWaits {
    /// The driver's choice (`CU_CTX_SCHED_AUTO`: it spins while the process has fewer active
    /// contexts than the host has cores). The default: on the H200 host the delayed update of
    /// gpt-1.3b ran as fast with `Block` (0.312 s/step against 0.314 s, BENCHMARKS.md).
    Auto,
    /// Sleeps on an OS primitive (`CU_CTX_SCHED_BLOCKING_SYNC`), freeing its core for a CPU
    /// optimizer running on every core while the training thread waits. A wake-up costs
    /// microseconds.
    Block,
    /// Spins (`CU_CTX_SCHED_SPIN`): the lowest latency, one core busy for the whole wait.
    Spin,
}

impl HostWaits {
    /// Each setting by its name: `auto`, `block`, `spin`.
    pub const NAMES: [(&'static str, HostWaits); 3] =
        [("auto", HostWaits::Auto), ("block", HostWaits::Block), ("spin", HostWaits::Spin)];

    /// The setting's name in [`HostWaits::NAMES`].
    pub fn name(self) -> &'static str {
        match self {
            HostWaits::Auto => "auto",
            HostWaits::Block => "block",
            HostWaits::Spin => "spin",
        }
    }

    fn flag(self) -> Option<cu_sys::CUctx_flags> {
        match self {
            HostWaits::Auto => None,
            HostWaits::Block => Some(cu_sys::CUctx_flags::CU_CTX_SCHED_BLOCKING_SYNC),
            HostWaits::Spin => Some(cu_sys::CUctx_flags::CU_CTX_SCHED_SPIN),
        }
    }
}

/// Sets the scheduling flag of GPU `ordinal`'s primary context before it is retained. Best
/// effort: where the driver refuses (the context is already active with other flags, in another
/// library's hands), the waits stay as they are, with a debug message.
fn set_host_waits(ordinal: usize, waits: HostWaits) {
    let Some(flag) = waits.flag() else { return };
    let set = i32::try_from(ordinal).map_err(|_| "ordinal out of range".to_string()).and_then(
        |ordinal| {
            let device = cu::device::get(ordinal).map_err(|e| e.to_string())?;
            // SAFETY: `device` is a valid handle from cuDeviceGet; the call takes no pointers.
            unsafe { cu_sys::cuDevicePrimaryCtxSetFlags_v2(device, flag as u32) }
                .result()
                .map_err(|e| e.to_string())
        },
    );
    if let Err(reason) = set {
        tracing::debug!(ordinal, ?waits, %reason, "could not set how host threads wait for the GPU");
    }
}

/// The completion of one asynchronous copy: an event recorded right after it on its stream.
#[derive(Debug)]
struct CudaCompletion {
    event: driver::CudaEvent,
    device: Arc<Inner>,
}

impl Completion for CudaCompletion {
    /// Returns only once the copy has finished (or the context has failed): the caller gets the
    /// host buffer back when this returns, even with an error. So binding the context is best
    /// effort, and the event is waited on whatever binding said.
    fn wait(&self) -> Result<()> {
        let bound = self.device.bind();
        // SAFETY: the event is alive (owned by `self`) and belongs to the device's context.
        let waited = unsafe { cu::event::synchronize(self.event.cu_event()) }
            .map_err(|e| driver_error("cuEventSynchronize", e));
        waited.and(bound)
    }
}

/// How [`CudaDevice::with_options`] opens a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceOptions {
    /// How host threads wait for the GPU.
    pub host_waits: HostWaits,
    /// The folder compiled kernels are cached in ([`module`]); `None`: they are compiled every
    /// time a device loads them.
    pub kernel_cache: Option<PathBuf>,
}

impl Default for CudaDeviceOptions {
    /// The driver's waits, and the kernel cache in the user's cache folder
    /// ([`module::default_cache_dir`]).
    fn default() -> Self {
        CudaDeviceOptions { host_waits: HostWaits::Auto, kernel_cache: module::default_cache_dir() }
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` with the default [`CudaDeviceOptions`].
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_options(ordinal, CudaDeviceOptions::default())
    }

    /// Opens GPU `ordinal` as `options` say: loads the driver, sets how host threads wait,
    /// creates the context with cudarc's event tracking off, and the four streams.
    pub fn with_options(ordinal: usize, options: CudaDeviceOptions) -> Result<Self> {
        library::init_driver()?;
        // cudarc panics on a symbol it cannot find; the driver version was checked above, so this
        // is a last resort that turns such a panic into an error.
        catch_unwind(AssertUnwindSafe(|| Self::open(ordinal, options))).unwrap_or_else(|panic| {
            Err(DeviceError::Library {
                library: CudaLibrary::Driver.name(),
                reason: format!("cudarc panicked opening GPU {ordinal}: {}", panic_text(&*panic)),
            })
        })
    }

    fn open(ordinal: usize, options: CudaDeviceOptions) -> Result<Self> {
        let gpus = info::list_gpus()?;
        let gpu = gpus.get(ordinal).ok_or_else(|| DeviceError::Library {
            library: CudaLibrary::Driver.name(),
            reason: format!(
                "{} {ordinal}: the driver sees {} GPU(s) (check CUDA_VISIBLE_DEVICES)",
                library::NO_DEVICE,
                gpus.len()
            ),
        })?;
        set_host_waits(ordinal, options.host_waits);
        let ctx = driver::CudaContext::new(ordinal)
            .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
        // SAFETY: nothing has been allocated in this context by us yet, and nothing we allocate
        // later is a cudarc `CudaSlice`; every cross-stream hand-off is ordered by events the
        // caller records and waits on (the contract), and buffers wait for all streams before
        // they are freed.
        unsafe { ctx.disable_event_tracking() };
        let stream = |kind: StreamKind| -> Result<CudaStream> {
            let stream = ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
            Ok(CudaStream { name: kind.name(), stream })
        };
        let standard = [
            stream(StreamKind::Compute)?,
            stream(StreamKind::Comm)?,
            stream(StreamKind::D2h)?,
            stream(StreamKind::H2d)?,
        ];
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                ctx,
                standard,
                errors: Arc::new(ErrorList::default()),
                description: gpu.to_string(),
                compute_capability: gpu.compute_capability,
                modules: module::ModuleCache::default(),
                kernel_cache: options.kernel_cache,
                engine_kernels: std::sync::OnceLock::new(),
                copied: crate::CopyCounters::default(),
                pinned: Arc::default(),
            }),
        })
    }

    /// The GPU's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ctx.ordinal()
    }

    /// The GPU's compute capability, (9, 0) for sm_90.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.compute_capability
    }

    /// The cudarc context, for kernels and libraries. Its event tracking is off.
    pub fn context(&self) -> &Arc<driver::CudaContext> {
        &self.inner.ctx
    }

    /// Makes the device's context current on this thread (before calls on its [`CudaFunction`]s
    /// that take no stream, such as [`CudaFunction::set_max_dynamic_shared`]).
    pub fn bind(&self) -> Result<()> {
        self.inner.bind()
    }

    /// The GPU's free and total memory now, in bytes (`cuMemGetInfo`), counting every process
    /// and context on it.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        self.inner.bind()?;
        cu::mem_get_info().map_err(|e| driver_error("cuMemGetInfo", e))
    }

    /// A new event without timing.
    fn new_raw_event(&self) -> Result<driver::CudaEvent> {
        self.inner.bind()?;
        self.inner.ctx.new_event(None).map_err(|e| driver_error("cuEventCreate", e))
    }

    /// Enqueues an asynchronous copy with `enqueue` and records an event right after it. The event
    /// is created first, so that once the copy is in flight the only thing left that can fail is
    /// the record; if it does, the stream is drained before the error returns, so that no copy
    /// outlives the borrow of its host buffer.
    fn enqueue_tracked(
        &self,
        stream: &CudaStream,
        enqueue: impl FnOnce() -> Result<()>,
    ) -> Result<Arc<dyn Completion>> {
        let event = self.new_raw_event()?;
        enqueue()?;
        if let Err(error) = record_raw(&event, stream) {
            // SAFETY: the stream is alive (borrowed).
            if let Err(e) = unsafe { cu::stream::synchronize(stream.cu()) } {
                self.inner.errors.park(driver_error("cuStreamSynchronize", e));
            }
            return Err(error);
        }
        Ok(Arc::new(CudaCompletion { event, device: self.inner.clone() }))
    }
}

/// Records `event` at the end of `stream` (the context must be current).
fn record_raw(event: &driver::CudaEvent, stream: &CudaStream) -> Result<()> {
    // SAFETY: both handles are alive (borrowed) and belong to the same context.
    unsafe { cu::event::record(event.cu_event(), stream.cu()) }
        .map_err(|e| driver_error("cuEventRecord", e))
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}

impl Device for CudaDevice {
    type Buffer<T: Element> = CudaBuffer<T>;
    type Stream = CudaStream;
    type Event = CudaEvent;

    fn describe(&self) -> String {
        self.inner.description.clone()
    }

    fn alloc<T: Element>(&self, len: usize) -> Result<CudaBuffer<T>> {
        CudaBuffer::zeroed(self.inner.clone(), len)
    }

    fn alloc_host<T: Element>(&self, len: usize, memory: HostMemory) -> Result<HostBuffer<T>> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(DeviceError::OutOfMemory { memory: "host", bytes: usize::MAX })?;
        let sink: Arc<dyn ErrorSink> = self.inner.errors.clone();
        let raw: Box<dyn RawHostMemory> = match memory {
            HostMemory::Pinned => {
                let ctx = &self.inner.ctx;
                pinned_or_pageable(&self.inner.pinned, bytes, |bytes| {
                    PinnedMemory::zeroed(ctx.clone(), bytes, sink.clone())
                })?
            }
            HostMemory::Pageable => Box::new(HeapMemory::zeroed(bytes)?),
        };
        Ok(HostBuffer::new(raw, len, sink))
    }

    fn pinned_budget(&self) -> &PinnedBudget {
        &self.inner.pinned
    }

    fn stream(&self, kind: StreamKind) -> &CudaStream {
        &self.inner.standard[kind as usize]
    }

    fn new_stream(&self, name: &'static str) -> Result<CudaStream> {
        let stream = self.inner.ctx.new_stream().map_err(|e| driver_error("cuStreamCreate", e))?;
        Ok(CudaStream { name, stream })
    }

    fn new_event(&self) -> Result<CudaEvent> {
        Ok(CudaEvent { event: self.new_raw_event()?, recorded: false })
    }

    fn record(&self, event: &mut CudaEvent, stream: &CudaStream) -> Result<()> {
        self.inner.bind()?;
        record_raw(&event.event, stream)?;
        event.recorded = true;
        Ok(())
    }

    fn wait_event(&self, stream: &CudaStream, event: &CudaEvent) -> Result<()> {
        if !event.recorded {
            return Err(DeviceError::EventNotRecorded);
        }
        self.inner.bind()?;
        let flags = cu_sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT;
        // SAFETY: both handles are alive (borrowed) and belong to the device's context.
        unsafe { cu::stream::wait_event(stream.cu(), event.event.cu_event(), flags) }
            .map_err(|e| driver_error("cuStreamWaitEvent", e))
    }

    fn sync_event(&self, event: &CudaEvent) -> Result<()> {
        if !event.recorded {
            return Err(DeviceError::EventNotRecorded);
        }
        self.inner.bind()?;
        // SAFETY: the event is alive (borrowed) and belongs to the device's context.
        unsafe { cu::event::synchronize(event.event.cu_event()) }
            .map_err(|e| driver_error("cuEventSynchronize", e))
    }

    fn event_done(&self, event: &CudaEvent) -> Result<bool> {
        if !event.recorded {
            return Err(DeviceError::EventNotRecorded);
        }
        self.inner.bind()?;
        // SAFETY: the event is alive (borrowed) and belongs to the device's context.
        match unsafe { cu::event::query(event.event.cu_event()) } {
            Ok(()) => Ok(true),
            Err(e) if e.0 == cu_sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            Err(e) => Err(driver_error("cuEventQuery", e)),
        }
    }

    fn synchronize(&self) -> Result<()> {
        self.inner.bind()?;
        self.inner.ctx.synchronize().map_err(|e| driver_error("cuCtxSynchronize", e))?;
        match self.take_errors().into_iter().next() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }

    fn take_errors(&self) -> Vec<DeviceError> {
        self.inner.park_cudarc_errors();
        std::mem::take(&mut *self.inner.errors.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn copied_bytes(&self) -> crate::CopiedBytes {
        self.inner.copied.get()
    }

    fn copy_d2h<'a, T: Element>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<T>,
        src_range: Range<usize>,
        dst: &'a mut HostBuffer<T>,
        dst_offset: usize,
    ) -> Result<Filling<'a, T>> {
        check_range("copy_d2h source", &src_range, src.len())?;
        let len = src_range.len();
        check_range("copy_d2h destination", &(dst_offset..dst_offset + len), dst.len())?;
        self.inner.copied.add(false, len * size_of::<T>());
        let from = src.address(src_range.start);
        Filling::start(dst, |host, _| {
            self.enqueue_tracked(stream, || {
                if len == 0 {
                    return Ok(());
                }
                // SAFETY: both ranges were bounds-checked above; the host memory stays alive and
                // unread until the event recorded after this copy completes (the token holds it
                // mutably borrowed; a leaked token makes its next access wait); the device range
                // is ordered against other streams by the caller's events (the contract).
                let status = unsafe {
                    cu_sys::cuMemcpyDtoHAsync_v2(
                        host.as_ptr().add(dst_offset).cast(),
                        from,
                        len * size_of::<T>(),
                        stream.cu(),
                    )
                };
                status.result().map_err(|e| driver_error("cuMemcpyDtoHAsync", e))
            })
        })
    }

    fn copy_h2d<'a, T: Element>(
        &self,
        stream: &CudaStream,
        src: &'a HostBuffer<T>,
        src_range: Range<usize>,
        dst: &CudaBuffer<T>,
        dst_offset: usize,
    ) -> Result<Draining<'a, T>> {
        check_range("copy_h2d source", &src_range, src.len())?;
        let len = src_range.len();
        check_range("copy_h2d destination", &(dst_offset..dst_offset + len), dst.len())?;
        self.inner.copied.add(true, len * size_of::<T>());
        let to = dst.address(dst_offset);
        Draining::start(src, |host, _| {
            self.enqueue_tracked(stream, || {
                if len == 0 {
                    return Ok(());
                }
                // SAFETY: both ranges were bounds-checked above; the host memory stays alive and
                // unwritten until the event recorded after this copy completes (the token holds
                // it borrowed); the device range is ordered by the caller's events.
                let status = unsafe {
                    cu_sys::cuMemcpyHtoDAsync_v2(
                        to,
                        host.as_ptr().add(src_range.start).cast_const().cast(),
                        len * size_of::<T>(),
                        stream.cu(),
                    )
                };
                status.result().map_err(|e| driver_error("cuMemcpyHtoDAsync", e))
            })
        })
    }

    fn copy_d2d<T: Element>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<T>,
        src_range: Range<usize>,
        dst: &CudaBuffer<T>,
        dst_offset: usize,
    ) -> Result<()> {
        check_range("copy_d2d source", &src_range, src.len())?;
        let len = src_range.len();
        check_range("copy_d2d destination", &(dst_offset..dst_offset + len), dst.len())?;
        if std::ptr::eq(src, dst)
            && src_range.start < dst_offset + len
            && dst_offset < src_range.end
        {
            // cuMemcpy's result is undefined for overlapping ranges.
            return Err(DeviceError::AliasedArguments { kernel: "copy_d2d", arg: 1, other: 0 });
        }
        if len == 0 {
            return Ok(());
        }
        self.inner.bind()?;
        // SAFETY: both ranges were bounds-checked above, lie in live allocations (a buffer's drop
        // waits for every stream) and do not overlap; ordering against other streams is the
        // caller's events' job.
        let status = unsafe {
            cu_sys::cuMemcpyDtoDAsync_v2(
                dst.address(dst_offset),
                src.address(src_range.start),
                len * size_of::<T>(),
                stream.cu(),
            )
        };
        status.result().map_err(|e| driver_error("cuMemcpyDtoDAsync", e))
    }

    fn fill<T: Element>(
        &self,
        stream: &CudaStream,
        dst: &CudaBuffer<T>,
        range: Range<usize>,
        value: T,
    ) -> Result<()> {
        check_range("fill", &range, dst.len())?;
        let pattern = FillPattern::of(value)?;
        if range.is_empty() {
            return Ok(());
        }
        self.inner.bind()?;
        // SAFETY: the range was bounds-checked and lies in a live allocation; element addresses
        // are aligned to the element size (allocations are 256-byte aligned); ordering against
        // other streams is the caller's events' job.
        unsafe {
            pattern.enqueue(dst.address(range.start), range.len(), size_of::<T>(), stream.cu())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::HostWaits;

    #[test]
    fn every_host_wait_is_named_by_its_name() {
        for (name, waits) in HostWaits::NAMES {
            assert_eq!(waits.name(), name);
        }
    }
}
