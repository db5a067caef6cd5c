//! The element-wise kernels the engine needs, on any device.
//!
//! Each is queued on a stream like a copy. The CPU device runs them as kernels on the stream's
//! worker; the CUDA device as NVRTC kernels.

use std::ops::Range;

use zeroflow_core::Float;

use crate::{Device, Result};

/// Element-wise kernels of the ZeRO engine.
pub trait Kernels: Device {
    /// `dst[dst_offset + i] += scale × src[src_range.start + i]`, in `f32`.
    fn accumulate<S: Float>(
        &self,
        stream: &Self::Stream,
        src: &Self::Buffer<S>,
        src_range: Range<usize>,
        dst: &Self::Buffer<f32>,
        dst_offset: usize,
        scale: f32,
    ) -> Result<()>;

    /// `dst[dst_offset + i] = T::from_f32(src[src_range.start + i].to_f32())` (round to nearest
    /// even).
    fn cast<S: Float, T: Float>(
        &self,
        stream: &Self::Stream,
        src: &Self::Buffer<S>,
        src_range: Range<usize>,
        dst: &Self::Buffer<T>,
        dst_offset: usize,
    ) -> Result<()>;

    /// `buf[range] *= alpha`.
    fn scale<S: Float>(
        &self,
        stream: &Self::Stream,
        buf: &Self::Buffer<S>,
        range: Range<usize>,
        alpha: f32,
    ) -> Result<()>;

    /// `out[slot] = Σ src[range]²`, accumulated in `f64`. A non-finite element makes the sum
    /// non-finite, which is how overflow is detected.
    fn sum_squares<S: Float>(
        &self,
        stream: &Self::Stream,
        src: &Self::Buffer<S>,
        range: Range<usize>,
        out: &Self::Buffer<f32>,
        slot: usize,
    ) -> Result<()>;
}
