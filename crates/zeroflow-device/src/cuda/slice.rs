//! Typed views of GPU memory: a range of a live [`CudaBuffer`], borrowed, so that code above this
//! crate hands kernels and libraries ranges of buffers instead of raw device addresses.
//!
//! [`DeviceSlice`] is read by the GPU, [`DeviceSliceMut`] written (or read and written). Both are
//! made from a shared `&CudaBuffer`, as every GPU write of the device contract is: what orders the
//! uses of one buffer on different streams is the caller's events, not Rust's borrows. What the
//! types do promise is the rest of a kernel's preconditions that a raw address cannot: the memory
//! is alive for the borrow, belongs to one device, holds elements of `T`, and `len` of them from
//! the start.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use zeroflow_core::Element;

use super::{CudaBuffer, CudaDevice};
use crate::DeviceBuffer;

/// Elements `range` of a [`CudaBuffer<T>`] that a GPU operation reads.
pub struct DeviceSlice<'a, T: Element> {
    buffer: &'a CudaBuffer<T>,
    start: usize,
    len: usize,
}

/// Elements `range` of a [`CudaBuffer<T>`] that a GPU operation writes (or updates in place).
pub struct DeviceSliceMut<'a, T: Element> {
    buffer: &'a CudaBuffer<T>,
    start: usize,
    len: usize,
}

impl<T: Element> CudaBuffer<T> {
    /// Elements `range` of the buffer, to be read by the GPU.
    ///
    /// # Panics
    /// If `range` is not inside the buffer.
    pub fn slice(&self, range: Range<usize>) -> DeviceSlice<'_, T> {
        let (start, len) = checked(self.len(), &range);
        DeviceSlice { buffer: self, start, len }
    }

    /// Elements `range` of the buffer, to be written by the GPU (ordering the write against other
    /// streams is the caller's, by events, as for every buffer of the device contract).
    ///
    /// # Panics
    /// If `range` is not inside the buffer.
    pub fn slice_mut(&self, range: Range<usize>) -> DeviceSliceMut<'_, T> {
        let (start, len) = checked(self.len(), &range);
        DeviceSliceMut { buffer: self, start, len }
    }

    /// The whole buffer, to be read.
    pub fn as_slice(&self) -> DeviceSlice<'_, T> {
        self.slice(0..self.len())
    }

    /// The whole buffer, to be written.
    pub fn as_slice_mut(&self) -> DeviceSliceMut<'_, T> {
        self.slice_mut(0..self.len())
    }
}

/// The start and length of `range` of a buffer of `buffer_len` elements.
///
/// # Panics
/// If `range` is not inside the buffer.
fn checked(buffer_len: usize, range: &Range<usize>) -> (usize, usize) {
    assert!(
        range.start <= range.end && range.end <= buffer_len,
        "range {range:?} is not inside a buffer of {buffer_len} elements"
    );
    (range.start, range.end - range.start)
}

macro_rules! slice_methods {
    ($slice:ident) => {
        impl<'a, T: Element> $slice<'a, T> {
            /// Elements in the slice.
            pub fn len(&self) -> usize {
                self.len
            }

            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            /// Where the slice starts in its buffer, in elements.
            pub fn start(&self) -> usize {
                self.start
            }

            /// The buffer the slice is part of.
            pub fn buffer(&self) -> &'a CudaBuffer<T> {
                self.buffer
            }

            /// The slice without its first `count` elements (for a tensor whose rows start at a
            /// column: the k third of `qkv` starts at column `C`).
            ///
            /// # Panics
            /// If `count > len`.
            #[must_use]
            pub fn skip(&self, count: usize) -> Self {
                assert!(count <= self.len, "skipping {count} of {} elements", self.len);
                $slice { buffer: self.buffer, start: self.start + count, len: self.len - count }
            }

            /// Whether the slice's first element lies at a multiple of `bytes` in device memory.
            pub fn is_aligned(&self, bytes: u64) -> bool {
                self.address().is_multiple_of(bytes)
            }

            /// Whether the slice's memory is on `device`.
            pub fn is_on(&self, device: &CudaDevice) -> bool {
                Arc::ptr_eq(self.buffer.device(), &device.inner)
            }

            /// The device address of the first element (for messages and alignment arithmetic;
            /// kernels take the slice itself, [`KernelParams::slice`](super::KernelParams)).
            pub fn address(&self) -> u64 {
                self.buffer.address(self.start)
            }
        }

        impl<T: Element> Clone for $slice<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }

        impl<T: Element> Copy for $slice<'_, T> {}

        impl<T: Element> fmt::Debug for $slice<'_, T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let (start, end) = (self.start, self.start + self.len);
                write!(
                    f,
                    "{}<{}>[{start}..{end}] of {:?}",
                    stringify!($slice),
                    T::DTYPE,
                    self.buffer
                )
            }
        }
    };
}

slice_methods!(DeviceSlice);
slice_methods!(DeviceSliceMut);

impl<'a, T: Element> DeviceSliceMut<'a, T> {
    /// The same elements, to be read.
    pub fn as_read(&self) -> DeviceSlice<'a, T> {
        DeviceSlice { buffer: self.buffer, start: self.start, len: self.len }
    }
}

#[cfg(test)]
mod tests {
    use super::checked;

    /// A slice is made only of a range inside its buffer (one past the end and empty included).
    #[test]
    fn slices_are_ranges_inside_their_buffer() {
        assert_eq!(checked(10, &(2..7)), (2, 5));
        assert_eq!(checked(10, &(10..10)), (10, 0));
        assert_eq!(checked(10, &(0..10)), (0, 10));
        for bad in [0..11, 11..11, std::ops::Range { start: 7, end: 2 }] {
            let panicked = std::panic::catch_unwind(|| checked(10, &bad)).is_err();
            assert!(panicked, "{bad:?} of 10 elements was taken");
        }
    }
}
