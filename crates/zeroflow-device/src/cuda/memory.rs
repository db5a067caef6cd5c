//! Device buffers and page-locked host memory of the CUDA device.

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result as cu, sys as cu_sys};
use zeroflow_core::Element;

use super::Inner;
use super::library::driver_error;
use crate::DeviceBuffer;
use crate::error::{DeviceError, Result};
use crate::host::{ErrorSink, RawHostMemory};

/// A buffer in GPU memory, allocated with `cuMemAlloc` and zero-filled.
pub struct CudaBuffer<T: Element> {
    ptr: cu_sys::CUdeviceptr,
    len: usize,
    device: Arc<Inner>,
    _elements: PhantomData<T>,
}

impl<T: Element> CudaBuffer<T> {
    /// Allocates `len` zero-filled elements. Waits until the zeros are written, so that every
    /// stream may use the buffer at once.
    pub(super) fn zeroed(device: Arc<Inner>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(size_of::<T>())
            .ok_or(DeviceError::OutOfMemory { memory: "device", bytes: usize::MAX })?;
        device.bind()?;
        // SAFETY: the context is current; a zero-byte allocation is refused by the driver, so at
        // least one byte is asked for.
        let ptr = unsafe { cu::malloc_sync(bytes.max(1)) }.map_err(|e| match e.0 {
            cu_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                DeviceError::OutOfMemory { memory: "device", bytes }
            }
            _ => driver_error("cuMemAlloc", e),
        })?;
        // Owned from here on: an error below frees it.
        let buffer = CudaBuffer { ptr, len, device, _elements: PhantomData };
        // SAFETY: `ptr` is a fresh allocation of at least `bytes` bytes. The memset runs on the
        // legacy default stream, which our non-blocking streams never wait for, so the host waits
        // for that stream before the buffer is handed out.
        unsafe {
            cu_sys::cuMemsetD8_v2(ptr, 0, bytes)
                .result()
                .map_err(|e| driver_error("cuMemsetD8", e))?;
            cu::stream::synchronize(cu::stream::null())
                .map_err(|e| driver_error("cuStreamSynchronize", e))?;
        }
        Ok(buffer)
    }

    /// The device address of element `index` (for kernels and libraries taking raw pointers).
    ///
    /// # Panics
    /// If `index > len` (one past the end is allowed).
    pub fn address(&self, index: usize) -> cu_sys::CUdeviceptr {
        assert!(index <= self.len, "index {index} beyond a buffer of {} elements", self.len);
        self.ptr + (index * size_of::<T>()) as u64
    }

    /// The device the buffer belongs to.
    pub(super) fn device(&self) -> &Arc<Inner> {
        &self.device
    }
}

impl<T: Element> DeviceBuffer for CudaBuffer<T> {
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: Element> Drop for CudaBuffer<T> {
    /// Waits for every stream of the device (an operation still queued may use the buffer; no
    /// reference count follows the GPU's queues), then frees the memory. Buffers are allocated
    /// once at start-up, so this happens at shutdown, not in the training loop.
    fn drop(&mut self) {
        let freed = self.device.bind().and_then(|()| {
            self.device.ctx.synchronize().map_err(|e| driver_error("cuCtxSynchronize", e))?;
            // SAFETY: `ptr` came from `cuMemAlloc`, is freed once, here, and no queued operation
            // uses it any more (the context was synchronised above).
            unsafe { cu::free_sync(self.ptr) }.map_err(|e| driver_error("cuMemFree", e))
        });
        if let Err(error) = freed {
            self.device.errors.park(error);
        }
    }
}

impl<T: Element> fmt::Debug for CudaBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaBuffer<{}>[{}]@{:#x}", T::DTYPE, self.len, self.ptr)
    }
}

/// Page-locked host memory from `cuMemHostAlloc` with flags 0: cached, not write-combined, so the
/// CPU reads it at full speed (the optimizer reads every gradient the GPU copies into it).
pub(crate) struct PinnedMemory {
    ptr: NonNull<u8>,
    bytes: usize,
    ctx: Arc<CudaContext>,
    sink: Arc<dyn ErrorSink>,
}

impl PinnedMemory {
    /// `bytes` of zero-filled page-locked memory, or (inner `Err`) why the driver would not pin
    /// them: the caller falls back to pageable memory then. The outer `Err` is a failure to make
    /// the context current, which is not about the memory.
    pub(super) fn zeroed(
        ctx: Arc<CudaContext>,
        bytes: usize,
        sink: Arc<dyn ErrorSink>,
    ) -> Result<Result<Self>> {
        ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e))?;
        // SAFETY: the context is current; flags 0 asks for plain page-locked memory; at least one
        // byte is asked for.
        let raw = match unsafe { cu::malloc_host(bytes.max(1), 0) } {
            Ok(raw) => raw,
            Err(e) if e.0 == cu_sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Ok(Err(DeviceError::OutOfMemory { memory: "pinned host", bytes }));
            }
            Err(e) => return Ok(Err(driver_error("cuMemHostAlloc", e))),
        };
        let Some(ptr) = NonNull::new(raw.cast::<u8>()) else {
            return Ok(Err(DeviceError::OutOfMemory { memory: "pinned host", bytes }));
        };
        // SAFETY: `ptr` points to at least `bytes` writable bytes that nobody else uses yet.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, bytes) };
        Ok(Ok(PinnedMemory { ptr, bytes, ctx, sink }))
    }
}

impl Drop for PinnedMemory {
    fn drop(&mut self) {
        // The owning HostBuffer has waited for every copy that used the memory before dropping it.
        // An error cudarc parked elsewhere is passed on first, so that binding does not fail on it.
        if let Err(e) = self.ctx.check_err() {
            self.sink.park(driver_error("a call in a drop (cudarc)", e));
        }
        let freed = self.ctx.bind_to_thread().map_err(|e| driver_error("cuCtxSetCurrent", e));
        let freed = freed.and_then(|()| {
            // SAFETY: `ptr` came from `cuMemHostAlloc` and is freed once, here; no copy uses it.
            unsafe { cu::free_host(self.ptr.as_ptr().cast::<c_void>()) }
                .map_err(|e| driver_error("cuMemFreeHost", e))
        });
        if let Err(error) = freed {
            self.sink.park(error);
        }
    }
}

impl fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedMemory({} bytes @ {:p})", self.bytes, self.ptr)
    }
}

// SAFETY: the allocation is owned exclusively by this value and is plain memory usable from any
// thread; the context handle is thread safe.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above; `&PinnedMemory` only exposes the pointer value.
unsafe impl Sync for PinnedMemory {}

// SAFETY: `ptr` points to `bytes` bytes (at least one byte more were never asked for), page
// aligned, zero-filled in `zeroed`, valid until drop, and handed to nobody but the owner.
unsafe impl RawHostMemory for PinnedMemory {
    fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }
    fn bytes(&self) -> usize {
        self.bytes
    }
    fn pinned(&self) -> bool {
        true
    }
}

/// The pattern a `cuMemsetD*Async` call writes to fill with one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum FillPattern {
    D8(u8),
    D16(u16),
    D32(u32),
}

impl FillPattern {
    /// The narrowest pattern that writes `value` into every element: one byte where all bytes of
    /// the value are equal (zero, for example), else one pattern per element.
    pub(super) fn of<T: Element>(value: T) -> Result<Self> {
        let size = size_of::<T>();
        // SAFETY: `value` is a live `T` of `size` bytes; Element types are plain numbers without
        // padding, so every byte is initialised.
        let bytes =
            unsafe { std::slice::from_raw_parts(std::ptr::from_ref(&value).cast::<u8>(), size) };
        if let Some(&first) = bytes.first()
            && bytes.iter().all(|&b| b == first)
        {
            return Ok(FillPattern::D8(first));
        }
        match *bytes {
            [a, b] => Ok(FillPattern::D16(u16::from_ne_bytes([a, b]))),
            [a, b, c, d] => Ok(FillPattern::D32(u32::from_ne_bytes([a, b, c, d]))),
            _ => Err(DeviceError::Kernel {
                kernel: "fill",
                reason: format!("{size}-byte elements cannot be set by cuMemsetD8/16/32"),
            }),
        }
    }

    /// Enqueues the memset of `len` elements of `element_size` bytes at `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` must be the address of `len` elements of `element_size` bytes of device memory,
    /// aligned to the element size, that nothing else uses until the stream reaches the memset.
    pub(super) unsafe fn enqueue(
        self,
        dst: cu_sys::CUdeviceptr,
        len: usize,
        element_size: usize,
        stream: cu_sys::CUstream,
    ) -> Result<()> {
        // SAFETY: guaranteed by the caller; each call writes exactly `len * element_size` bytes.
        let status = unsafe {
            match self {
                FillPattern::D8(byte) => {
                    cu_sys::cuMemsetD8Async(dst, byte, len * element_size, stream)
                }
                FillPattern::D16(half) => cu_sys::cuMemsetD16Async(dst, half, len, stream),
                FillPattern::D32(word) => cu_sys::cuMemsetD32Async(dst, word, len, stream),
            }
        };
        status.result().map_err(|e| driver_error("cuMemsetAsync", e))
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_core::dtype::{bf16, f16};

    use super::FillPattern;

    #[test]
    fn fill_patterns_cover_every_element_type() {
        assert_eq!(FillPattern::of(0.0f32).unwrap(), FillPattern::D8(0));
        assert_eq!(FillPattern::of(1.0f32).unwrap(), FillPattern::D32(1.0f32.to_bits()));
        assert_eq!(FillPattern::of(-1i32).unwrap(), FillPattern::D8(0xff));
        assert_eq!(FillPattern::of(7u32).unwrap(), FillPattern::D32(7));
        let one = bf16::from_f32(1.0);
        assert_eq!(FillPattern::of(one).unwrap(), FillPattern::D16(one.to_bits()));
        let half = f16::from_f32(0.5);
        assert_eq!(FillPattern::of(half).unwrap(), FillPattern::D16(half.to_bits()));
    }
}
