//! The engine's element-wise kernels on the CPU device.

use std::ops::Range;

use zeroflow_core::Float;

use super::{CpuBuffer, CpuDevice, CpuStream, KernelArgs};
use crate::ops::{Kernels, Matrix};
use crate::{DeviceError, Result};

impl Kernels for CpuDevice {
    fn accumulate<S: Float>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<S>,
        src_range: Range<usize>,
        dst: &CpuBuffer<f32>,
        dst_offset: usize,
        scale: f32,
    ) -> Result<()> {
        let dst_range = dst_offset..dst_offset + src_range.len();
        let args = KernelArgs::new().input(src, src_range).in_out(dst, dst_range);
        self.launch(stream, "accumulate", args, move |ctx| {
            let (src, dst) = (ctx.input::<S>(0), ctx.output::<f32>(1));
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += scale * s.to_f32());
            Ok(())
        })
    }

    fn cast<S: Float, T: Float>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<S>,
        src_range: Range<usize>,
        dst: &CpuBuffer<T>,
        dst_offset: usize,
    ) -> Result<()> {
        let dst_range = dst_offset..dst_offset + src_range.len();
        let args = KernelArgs::new().input(src, src_range).output(dst, dst_range);
        self.launch(stream, "cast", args, |ctx| {
            let (src, dst) = (ctx.input::<S>(0), ctx.output::<T>(1));
            dst.iter_mut().zip(src).for_each(|(d, s)| *d = T::from_f32(s.to_f32()));
            Ok(())
        })
    }

    fn scale<S: Float>(
        &self,
        stream: &CpuStream,
        buf: &CpuBuffer<S>,
        range: Range<usize>,
        alpha: f32,
    ) -> Result<()> {
        self.launch(stream, "scale", KernelArgs::new().in_out(buf, range), move |ctx| {
            ctx.output::<S>(0).iter_mut().for_each(|x| *x = S::from_f32(alpha * x.to_f32()));
            Ok(())
        })
    }

    fn sum_squares<S: Float>(
        &self,
        stream: &CpuStream,
        src: &CpuBuffer<S>,
        range: Range<usize>,
        out: &CpuBuffer<f32>,
        slot: usize,
    ) -> Result<()> {
        let args = KernelArgs::new().input(src, range).output(out, slot..slot + 1);
        self.launch(stream, "sum_squares", args, |ctx| {
            let sum: f64 = ctx.input::<S>(0).iter().map(|x| f64::from(x.to_f32()).powi(2)).sum();
            ctx.output::<f32>(1)[0] = sum as f32;
            Ok(())
        })
    }

    fn gather_columns<T: Float>(
        &self,
        stream: &CpuStream,
        src: Matrix<'_, Self, T>,
        index: &CpuBuffer<u32>,
        index_range: Range<usize>,
        dst: Matrix<'_, Self, T>,
    ) -> Result<()> {
        check_columns(src.rows, dst, &index_range)?;
        let (rows, cols, k) = (src.rows, src.cols, index_range.len());
        let args = KernelArgs::new()
            .input(src.buffer, src.range())
            .input(index, index_range)
            .output(dst.buffer, dst.range());
        self.launch(stream, "gather_columns", args, move |ctx| {
            let (src, index, dst) = (ctx.input::<T>(0), ctx.input::<u32>(1), ctx.output::<T>(2));
            for r in 0..rows {
                for (j, &c) in index.iter().enumerate() {
                    let c = c as usize;
                    dst[r * k + j] =
                        if c < cols { src[r * cols + c] } else { T::from_f32(f32::NAN) };
                }
            }
            Ok(())
        })
    }

    fn scatter_columns<T: Float>(
        &self,
        stream: &CpuStream,
        src: Matrix<'_, Self, T>,
        index: &CpuBuffer<u32>,
        index_range: Range<usize>,
        dst: Matrix<'_, Self, T>,
    ) -> Result<()> {
        check_columns(dst.rows, src, &index_range)?;
        let (rows, cols, k) = (dst.rows, dst.cols, index_range.len());
        // The other columns of `dst` keep their values: the kernel reads and updates the matrix.
        let args = KernelArgs::new()
            .input(src.buffer, src.range())
            .input(index, index_range)
            .in_out(dst.buffer, dst.range());
        self.launch(stream, "scatter_columns", args, move |ctx| {
            let (src, index, dst) = (ctx.input::<T>(0), ctx.input::<u32>(1), ctx.output::<T>(2));
            for r in 0..rows {
                for (j, &c) in index.iter().enumerate() {
                    let c = c as usize;
                    if c < cols {
                        dst[r * cols + c] = src[r * k + j];
                    }
                }
            }
            Ok(())
        })
    }

    fn column_abs_sums<S: Float>(
        &self,
        stream: &CpuStream,
        src: Matrix<'_, Self, S>,
        out: &CpuBuffer<f32>,
        out_offset: usize,
    ) -> Result<()> {
        // Saturating, so that a shape too large for any buffer is refused as out of bounds by the
        // launch's checks rather than overflowing here.
        let elements = src.rows.saturating_mul(src.cols);
        let src_range = src.offset..src.offset.saturating_add(elements);
        let out_range = out_offset..out_offset.saturating_add(src.cols);
        let cols = src.cols;
        // `out` is read and updated: the sums are added to what it holds.
        let args = KernelArgs::new().input(src.buffer, src_range).in_out(out, out_range);
        self.launch(stream, "column_abs_sums", args, move |ctx| {
            let (src, out) = (ctx.input::<S>(0), ctx.output::<f32>(1));
            if cols == 0 {
                return Ok(());
            }
            // Each column summed over its rows in increasing row order, then added to `out`.
            let mut sums = vec![0.0f32; cols];
            for row in src.chunks_exact(cols) {
                sums.iter_mut().zip(row).for_each(|(s, x)| *s += x.to_f32().abs());
            }
            out.iter_mut().zip(&sums).for_each(|(o, s)| *o += s);
            Ok(())
        })
    }
}

/// The compact matrix of a gather or scatter has the full matrix's rows and one column per index.
fn check_columns<T: Float>(
    rows: usize,
    compact: Matrix<'_, CpuDevice, T>,
    index_range: &Range<usize>,
) -> Result<()> {
    if compact.rows != rows {
        let (left, right) = (compact.rows, rows);
        return Err(DeviceError::LengthMismatch { what: "rows of the two matrices", left, right });
    }
    if compact.cols != index_range.len() {
        let (left, right) = (compact.cols, index_range.len());
        return Err(DeviceError::LengthMismatch {
            what: "selected columns vs indices",
            left,
            right,
        });
    }
    Ok(())
}
