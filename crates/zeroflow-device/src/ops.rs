//! The element-wise kernels the engine needs, on any device.
//!
//! Each is queued on a stream like a copy. The CPU device runs them as kernels on the stream's
//! worker; the CUDA device as NVRTC kernels.

use std::ops::Range;

use zeroflow_core::{Element, Float};

use crate::{Device, Result};

/// A row-major `[rows, cols]` matrix stored in `buffer[offset..offset + rows × cols]`: the view
/// that [`Kernels::gather_columns`], [`Kernels::scatter_columns`] and
/// [`Kernels::column_abs_sums`] take.
pub struct Matrix<'a, D: Device + ?Sized, T: Element> {
    pub buffer: &'a D::Buffer<T>,
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
}

impl<D: Device + ?Sized, T: Element> Matrix<'_, D, T> {
    /// The elements of the matrix in its buffer.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.rows * self.cols
    }
}

impl<D: Device + ?Sized, T: Element> Clone for Matrix<'_, D, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<D: Device + ?Sized, T: Element> Copy for Matrix<'_, D, T> {}

impl<D: Device + ?Sized, T: Element> std::fmt::Debug for Matrix<'_, D, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matrix")
            .field("offset", &self.offset)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

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

    /// `dst[r, j] = src[r, index[j]]` for every row `r` and every `j` in `index_range`: `dst` is
    /// `[src.rows, index_range.len()]` (ZenFlow's compact buffer of selected columns). An index
    /// `>= src.cols` gives NaN.
    fn gather_columns<T: Float>(
        &self,
        stream: &Self::Stream,
        src: Matrix<'_, Self, T>,
        index: &Self::Buffer<u32>,
        index_range: Range<usize>,
        dst: Matrix<'_, Self, T>,
    ) -> Result<()>;

    /// `dst[r, index[j]] = src[r, j]` for every row `r` and every `j` in `index_range`: `src` is
    /// `[dst.rows, index_range.len()]`; the other columns of `dst` are left as they are. An index
    /// `>= dst.cols` is skipped; with duplicate indices one of the values is written.
    fn scatter_columns<T: Float>(
        &self,
        stream: &Self::Stream,
        src: Matrix<'_, Self, T>,
        index: &Self::Buffer<u32>,
        index_range: Range<usize>,
        dst: Matrix<'_, Self, T>,
    ) -> Result<()>;

    /// `out[out_offset + c] += Σ_r |src[r, c]|` for every column `c` of `src` (ZenFlow's column
    /// importance: the L1 norm of each gradient column). Summed in `f32` in an order fixed by the
    /// shape (deterministic: the same inputs give the same bits, run after run); `out` must hold
    /// `out_offset + src.cols` elements. A non-finite element makes its column's sum non-finite.
    fn column_abs_sums<S: Float>(
        &self,
        stream: &Self::Stream,
        src: Matrix<'_, Self, S>,
        out: &Self::Buffer<f32>,
        out_offset: usize,
    ) -> Result<()>;
}
