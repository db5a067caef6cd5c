//! The engine's element-wise kernels on the CPU device.

use std::ops::Range;

use zeroflow_core::Float;

use super::{CpuBuffer, CpuDevice, CpuStream, KernelArgs};
use crate::Result;
use crate::ops::Kernels;

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
}
