//! What the attention tests (`attention.rs`, `flash.rs`) share: random bf16 inputs, the caller's
//! tensors between NaN guards, and the relative error against the CPU reference.

use std::iter::repeat_n;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::{Element, bf16};
use zeroflow_device::cuda::{CudaBuffer, DeviceSlice, DeviceSliceMut};
use zeroflow_device::{CudaDevice, Device, StreamKind};

/// Uniform values in ±`bound`, none zero, rounded to bf16.
pub fn random_bf16(len: usize, bound: f64, seed: u64) -> Vec<bf16> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len)
        .map(|_| {
            let x: f64 = rng.random_range(-bound..bound);
            bf16::from_f64(if x == 0.0 { bound / 2.0 } else { x })
        })
        .collect()
}

pub fn widen(values: &[bf16]) -> Vec<f64> {
    values.iter().map(|x| x.to_f64()).collect()
}

/// ‖gpu − cpu‖₂ / ‖cpu‖₂; NaN (a failure) if the GPU left a NaN. Where the reference is all
/// zeros (flash's dq and dk at T = 1: one key, so the softmax passes no gradient), the root mean
/// square of the GPU's values instead: those are rounding residues of `dP − delta`, near 1e-7.
pub fn relative_error(gpu: &[f64], cpu: &[f64]) -> f64 {
    assert_eq!(gpu.len(), cpu.len());
    let (mut diff, mut norm) = (0.0, 0.0);
    for (&g, &c) in gpu.iter().zip(cpu) {
        diff += (g - c).powi(2);
        norm += c * c;
    }
    if norm == 0.0 { (diff / gpu.len().max(1) as f64).sqrt() } else { (diff / norm).sqrt() }
}

/// Elements of NaN after each of the caller's tensors, which must stay NaN.
pub const GUARD: usize = 16;

/// One of the caller's tensors (bf16, or f32 for flash's lse): `len` elements `offset_bytes` into
/// a buffer whose other elements are NaN guards.
pub struct Placed<T: Element> {
    buffer: CudaBuffer<T>,
    /// Elements before the tensor.
    offset: usize,
    len: usize,
}

impl<T: Element> Placed<T> {
    fn offset(offset_bytes: usize) -> usize {
        assert_eq!(offset_bytes % size_of::<T>(), 0, "{offset_bytes} bytes is no whole element");
        offset_bytes / size_of::<T>()
    }

    /// `len` NaNs (so that an element the kernels fail to write shows up) between the guards.
    pub fn poisoned(device: &CudaDevice, len: usize, offset_bytes: usize) -> Self {
        let offset = Self::offset(offset_bytes);
        let total = offset + len + GUARD;
        let buffer = device.alloc::<T>(total).unwrap();
        let nan = T::from_f64(f64::NAN);
        device.fill(device.stream(StreamKind::Compute), &buffer, 0..total, nan).unwrap();
        Placed { buffer, offset, len }
    }

    /// `values` between the guards (a read outside them would spread a NaN into the results).
    pub fn holding(device: &CudaDevice, values: &[T], offset_bytes: usize) -> Self {
        let offset = Self::offset(offset_bytes);
        let nan = T::from_f64(f64::NAN);
        let all: Vec<T> = repeat_n(nan, offset)
            .chain(values.iter().copied())
            .chain(repeat_n(nan, GUARD))
            .collect();
        Placed { buffer: device.upload(&all).unwrap(), offset, len: values.len() }
    }

    /// The tensor, to be read by the GPU.
    pub fn slice(&self) -> DeviceSlice<'_, T> {
        self.buffer.slice(self.offset..self.offset + self.len)
    }

    /// The tensor, to be written by the GPU.
    pub fn slice_mut(&self) -> DeviceSliceMut<'_, T> {
        self.buffer.slice_mut(self.offset..self.offset + self.len)
    }

    /// The tensor widened to f64 (exactly), after checking that nothing was written outside it.
    pub fn read(&self, device: &CudaDevice, what: &str) -> Vec<f64> {
        let all = device.download(&self.buffer).unwrap();
        let (before, rest) = all.split_at(self.offset);
        let (inside, after) = rest.split_at(self.len);
        let written = before.iter().chain(after).filter(|x| !x.to_f64().is_nan()).count();
        assert_eq!(written, 0, "{what}: {written} elements outside the tensor were written");
        inside.iter().map(|x| x.to_f64()).collect()
    }
}
