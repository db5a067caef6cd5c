//! Kernels of the CPU device: closures queued on a stream, with declared arguments.
//!
//! A kernel names every range it reads or writes up front ([`KernelArgs`]); the happens-before
//! checker admits it against those, and inside the closure [`KernelCtx`] hands out exactly those
//! ranges as slices. A kernel cannot reach memory it did not declare.

use std::cell::Cell;
use std::ops::Range;
use std::sync::Arc;

use zeroflow_core::{DType, Element};

use super::hb::Touch;
use super::{CpuBuffer, CpuDevice, CpuStream, SendPtr};
use crate::check_range;
use crate::error::{DeviceError, Result};
use crate::host::HeapMemory;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Access {
    Read,
    Write,
    ReadWrite,
}

#[derive(Debug)]
struct Arg {
    /// Keeps the memory alive while the kernel is queued.
    _storage: Arc<HeapMemory>,
    base: SendPtr<u8>,
    buffer: u64,
    dtype: DType,
    len: usize,
    range: Range<usize>,
    access: Access,
}

/// The declared arguments of a kernel, in order: argument `i` is the `i`-th call.
#[derive(Debug, Default)]
pub struct KernelArgs {
    args: Vec<Arg>,
}

impl KernelArgs {
    pub fn new() -> Self {
        Self::default()
    }

    fn push<T: Element>(
        mut self,
        buffer: &CpuBuffer<T>,
        range: Range<usize>,
        access: Access,
    ) -> Self {
        self.args.push(Arg {
            _storage: buffer.storage.clone(),
            base: SendPtr(buffer.base().0.cast()),
            buffer: buffer.id,
            dtype: T::DTYPE,
            len: buffer.len,
            range,
            access,
        });
        self
    }

    /// The kernel reads `buffer[range]`.
    pub fn input<T: Element>(self, buffer: &CpuBuffer<T>, range: Range<usize>) -> Self {
        self.push(buffer, range, Access::Read)
    }

    /// The kernel writes `buffer[range]` (and may read what it wrote).
    pub fn output<T: Element>(self, buffer: &CpuBuffer<T>, range: Range<usize>) -> Self {
        self.push(buffer, range, Access::Write)
    }

    /// The kernel reads and updates `buffer[range]` in place.
    pub fn in_out<T: Element>(self, buffer: &CpuBuffer<T>, range: Range<usize>) -> Self {
        self.push(buffer, range, Access::ReadWrite)
    }

    /// Bounds and aliasing: every range fits its buffer, and no written range overlaps another
    /// argument's range in the same buffer.
    fn validate(&self, kernel: &'static str) -> Result<()> {
        for arg in &self.args {
            check_range(kernel, &arg.range, arg.len)?;
        }
        for (i, a) in self.args.iter().enumerate() {
            for (j, b) in self.args.iter().enumerate().skip(i + 1) {
                let writes = a.access != Access::Read || b.access != Access::Read;
                let overlap = a.range.start < b.range.end && b.range.start < a.range.end;
                if a.buffer == b.buffer && writes && overlap {
                    let (arg, other) = if a.access != Access::Read { (i, j) } else { (j, i) };
                    return Err(DeviceError::AliasedArguments { kernel, arg, other });
                }
            }
        }
        Ok(())
    }

    fn touches(&self) -> Vec<Touch> {
        self.args
            .iter()
            .map(|a| Touch {
                buffer: a.buffer,
                dtype: a.dtype,
                range: a.range.clone(),
                write: a.access != Access::Read,
            })
            .collect()
    }
}

/// What a running kernel sees: its declared arguments as slices.
#[derive(Debug)]
pub struct KernelCtx {
    name: &'static str,
    args: Vec<Arg>,
    taken: Vec<Cell<bool>>,
}

impl KernelCtx {
    fn arg<T: Element>(&self, index: usize, writable: bool) -> &Arg {
        let arg = self
            .args
            .get(index)
            .unwrap_or_else(|| panic!("kernel `{}` has no argument {index}", self.name));
        assert_eq!(arg.dtype, T::DTYPE, "kernel `{}` argument {index}: wrong dtype", self.name);
        let allowed =
            if writable { arg.access != Access::Read } else { arg.access != Access::Write };
        assert!(allowed, "kernel `{}` argument {index} is declared {:?}", self.name, arg.access);
        arg
    }

    /// Argument `index` (declared `input` or `in_out`), for reading.
    ///
    /// # Panics
    /// If the argument does not exist, has another dtype, is write-only, or was taken with
    /// [`KernelCtx::output`]. The panic is reported as an error of the stream.
    pub fn input<T: Element>(&self, index: usize) -> &[T] {
        let arg = self.arg::<T>(index, false);
        assert!(!self.taken[index].get(), "kernel `{}` argument {index} taken mutably", self.name);
        // SAFETY: the range is in bounds (validated at launch) and the storage alive (the Arc in
        // `arg`). No written argument overlaps it (validated at launch), this argument is not
        // handed out mutably (checked above; once taken mutably it is never handed out again),
        // and the checker guarantees no other stream writes it while the kernel runs.
        unsafe {
            let ptr = arg.base.ptr().cast::<T>().add(arg.range.start);
            std::slice::from_raw_parts(ptr, arg.range.len())
        }
    }

    /// Argument `index` (declared `output` or `in_out`), for writing. Each argument can be taken
    /// this way once per launch.
    ///
    /// # Panics
    /// If the argument does not exist, has another dtype, is read-only, or was already taken.
    #[allow(clippy::mut_from_ref, reason = "each argument is handed out mutably at most once")]
    pub fn output<T: Element>(&self, index: usize) -> &mut [T] {
        let arg = self.arg::<T>(index, true);
        assert!(
            !self.taken[index].replace(true),
            "kernel `{}` argument {index} taken twice",
            self.name
        );
        // SAFETY: as in `input`, and: this argument is handed out mutably only this once, no other
        // argument overlaps a written one, and no other stream reads or writes it while the
        // kernel runs.
        unsafe {
            let ptr = arg.base.ptr().cast::<T>().add(arg.range.start);
            std::slice::from_raw_parts_mut(ptr, arg.range.len())
        }
    }
}

impl CpuDevice {
    /// Queues `kernel` on `stream`. It runs on the stream's worker, after everything queued
    /// before it on that stream, with the arguments `args` declares.
    ///
    /// The closure's error (a message) is parked as [`DeviceError::Kernel`] and returned by the
    /// next [`crate::Device::synchronize`].
    pub fn launch(
        &self,
        stream: &CpuStream,
        name: &'static str,
        args: KernelArgs,
        kernel: impl FnOnce(&KernelCtx) -> std::result::Result<(), String> + Send + 'static,
    ) -> Result<()> {
        args.validate(name)?;
        let touches = args.touches();
        let taken = args.args.iter().map(|_| Cell::new(false)).collect();
        let ctx = KernelCtx { name, args: args.args, taken };
        let work = Box::new(move || {
            kernel(&ctx).map_err(|reason| DeviceError::Kernel { kernel: name, reason })
        });
        self.enqueue(stream, name, &touches, work).map(drop)
    }
}
