//! The engine's kernels on the CUDA device: `kernels/engine.cu`, compiled by NVRTC once per device
//! and launched on the caller's stream.
//!
//! [`Kernels`] (cast, scale, accumulate, sum of squares) plus what only the GPU path needs:
//! [`CudaDevice::nonfinite`], [`CudaDevice::sum_squares_with`] (f32 or f64 accumulation),
//! [`CudaDevice::adamw_step`], [`CudaDevice::gather_columns`], [`CudaDevice::scatter_columns`]
//! and [`CudaDevice::column_abs_sums`]. Every call checks its ranges and the aliasing of what it
//! writes before anything is queued, and returns an error rather than panicking.
//!
//! Element-wise kernels move 8 elements per access where every pointer can be 16-byte aligned at
//! the same element (the host computes that element, the kernel's `head`); otherwise they go one
//! element at a time. Reductions are deterministic: one partial per block into a scratch area
//! owned by the stream, then one block adds the partials in a fixed order.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::{self as driver, result as cu, sys as cu_sys};
use zeroflow_core::adamw::StepScalars;
use zeroflow_core::{DType, Element, Float};

use super::library::driver_error;
use super::{CudaBuffer, CudaDevice, CudaFunction, CudaStream, Dim3, KernelParams};
use crate::error::{DeviceError, Result};
use crate::ops::{Kernels, Matrix};
use crate::{DeviceBuffer, check_range};

/// The CUDA C source of the engine's kernels (compiled after the prelude).
pub const ENGINE_SOURCE: &str = include_str!("../../kernels/engine.cu");

/// Threads per block of every engine kernel (`BLOCK` in engine.cu; the reductions rely on it).
const BLOCK: u32 = 256;
/// Scratch slots (8 bytes each) per stream for the reductions' block partials, and so the most
/// blocks a reduction's grid has.
const MAX_PARTIALS: u32 = 1024;
/// Element-wise kernels handle this many elements per vector access.
const PACK: usize = 8;
/// Columns per block of `column_abs_sums` (`COLUMN_STRIPE` in engine.cu): the block's x threads.
const COLUMN_STRIPE: u32 = 32;
/// Row groups per block of `column_abs_sums` (`COLUMN_GROUPS` in engine.cu): the block's y
/// threads, so that a block has `COLUMN_STRIPE × COLUMN_GROUPS = BLOCK` threads.
const COLUMN_GROUPS: u32 = 8;
const _: () = assert!(COLUMN_STRIPE * COLUMN_GROUPS == BLOCK, "launch_bounds(BLOCK) in engine.cu");
/// The most blocks of a grid's y dimension.
const MAX_GRID_Y: u32 = 65_535;

/// The name suffix of each floating type's kernels.
const FLOAT_SUFFIXES: [&str; 3] = ["f32", "bf16", "f16"];
/// Kernels that exist once per floating type, as `{name}_{suffix}`.
const PER_TYPE_KERNELS: [&str; 9] = [
    "scale",
    "accumulate",
    "sum_squares_f64",
    "sum_squares_f32",
    "nonfinite",
    "adamw",
    "gather_columns",
    "scatter_columns",
    "column_abs_sums",
];

/// A kernel of the module: its operation and element types, `("cast", "bf16", "f32")` for
/// `cast_bf16_f32` (unused parts empty). Launches look kernels up by key, so that finding one
/// allocates nothing.
type Key = (&'static str, &'static str, &'static str);

/// The keys of every kernel the device loads from [`ENGINE_SOURCE`].
fn kernel_keys() -> Vec<Key> {
    let mut keys = vec![("sum_squares_finish", "", ""), ("nonfinite_finish", "", "")];
    for s in FLOAT_SUFFIXES {
        keys.extend(FLOAT_SUFFIXES.iter().map(|t| ("cast", s, *t)));
        keys.extend(PER_TYPE_KERNELS.iter().map(|op| (*op, s, "")));
    }
    keys
}

/// The kernel's name in the source: the key's non-empty parts joined by `_`.
fn kernel_name((op, a, b): Key) -> String {
    [op, a, b].iter().filter(|part| !part.is_empty()).copied().collect::<Vec<_>>().join("_")
}

/// Every kernel the device loads from [`ENGINE_SOURCE`].
pub fn kernel_names() -> Vec<String> {
    kernel_keys().into_iter().map(kernel_name).collect()
}

/// How [`CudaDevice::sum_squares_with`] accumulates within a thread (blocks and the final sum
/// always add in f64).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulation {
    /// Each thread sums its squares in f32 (squares above 3.4e38 overflow to inf).
    F32,
    /// Each thread sums its squares in f64, like the CPU device.
    F64,
}

/// The f32 buffers one AdamW step reads and updates: master weights, moments (updated in place)
/// and gradients (read).
#[derive(Clone, Copy, Debug)]
pub struct AdamWBuffers<'a> {
    pub master: &'a CudaBuffer<f32>,
    pub exp_avg: &'a CudaBuffer<f32>,
    pub exp_avg_sq: &'a CudaBuffer<f32>,
    pub grads: &'a CudaBuffer<f32>,
}

/// A row-major `[rows, cols]` matrix stored in `buffer[offset..offset + rows * cols]`: the
/// device contract's [`Matrix`] on this device.
pub type RowMajor<'a, T> = Matrix<'a, CudaDevice, T>;

/// The elements of `m` in its buffer, checked to fit (without overflowing).
fn checked_range<T: Element>(m: &RowMajor<'_, T>, what: &'static str) -> Result<Range<usize>> {
    let len = m.rows.saturating_mul(m.cols);
    let range = m.offset..m.offset.saturating_add(len);
    check_range(what, &range, m.buffer.len())?;
    Ok(range)
}

/// The engine module of one device: its kernels, the SM count, and the reductions' scratch.
pub(super) struct EngineKernels {
    kernels: HashMap<Key, Kernel>,
    sm_count: u32,
    /// One scratch area per stream that has run a reduction. Held locked while a reduction queues
    /// its two kernels, so that two host threads cannot interleave theirs on one stream.
    scratch: Mutex<Vec<Scratch>>,
    ctx: Arc<driver::CudaContext>,
}

/// One kernel of the module and how many of its blocks of `BLOCK` threads one SM runs at once.
struct Kernel {
    function: CudaFunction,
    blocks_per_sm: u32,
}

/// `MAX_PARTIALS` 8-byte slots of device memory used only on `stream`. The stream is kept alive
/// so that its handle cannot be reused by another stream while the memory is in use.
struct Scratch {
    stream: Arc<driver::CudaStream>,
    partials: cu_sys::CUdeviceptr,
}

impl EngineKernels {
    fn load(device: &CudaDevice) -> Result<Self> {
        let module = device.load_module("engine", ENGINE_SOURCE)?;
        device.inner.bind()?;
        let kernels = kernel_keys()
            .into_iter()
            .map(|key| {
                let function = module.function(&kernel_name(key))?;
                let blocks_per_sm = function.max_active_blocks_per_sm(BLOCK, 0)?.max(1);
                Ok((key, Kernel { function, blocks_per_sm }))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let ctx = device.inner.ctx.clone();
        let sms = ctx
            .attribute(cu_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("cuDeviceGetAttribute", e))?;
        let sm_count = u32::try_from(sms).unwrap_or(1).max(1);
        Ok(EngineKernels { kernels, sm_count, scratch: Mutex::default(), ctx })
    }

    fn kernel(&self, key: Key) -> Result<&Kernel> {
        self.kernels.get(&key).ok_or_else(|| DeviceError::Kernel {
            kernel: "engine",
            reason: format!("the engine module has no kernel `{}`", kernel_name(key)),
        })
    }

    /// Blocks of `kernel` for `work` items, one per thread, capped at one full wave of the GPU
    /// (the kernels loop over the rest).
    fn blocks(&self, kernel: &Kernel, work: usize) -> u32 {
        let wanted = work.div_ceil(BLOCK as usize).max(1);
        let wave = self.sm_count.saturating_mul(kernel.blocks_per_sm);
        u32::try_from(wanted).unwrap_or(u32::MAX).min(wave)
    }

    /// The scratch area of `stream`, allocated on its first reduction (the context is current).
    fn partials_for(&self, scratch: &mut Vec<Scratch>, stream: &CudaStream) -> Result<u64> {
        if let Some(found) = scratch.iter().find(|s| s.stream.cu_stream() == stream.cu()) {
            return Ok(found.partials);
        }
        // SAFETY: the caller made the context current; the size is non-zero.
        let partials = unsafe { cu::malloc_sync(MAX_PARTIALS as usize * 8) }
            .map_err(|e| driver_error("cuMemAlloc", e))?;
        scratch.push(Scratch { stream: stream.raw().clone(), partials });
        Ok(partials)
    }
}

impl Drop for EngineKernels {
    /// Waits for the device (a queued reduction may still use its scratch), then frees the
    /// scratch areas. Errors are only logged: nobody is left to take them.
    fn drop(&mut self) {
        let scratch = self.scratch.get_mut().unwrap_or_else(|e| e.into_inner());
        if scratch.is_empty() {
            return;
        }
        if let Err(e) = self.ctx.synchronize() {
            tracing::warn!(error = %e, "engine kernels: synchronising before freeing scratch");
            return;
        }
        for area in scratch.drain(..) {
            // SAFETY: the memory came from cuMemAlloc in this context, is freed once, here, and
            // no queued kernel uses it any more (the context was synchronised above).
            if let Err(e) = unsafe { cu::free_sync(area.partials) } {
                tracing::warn!(error = %e, "engine kernels: freeing scratch");
            }
        }
    }
}

/// The suffix of `T`'s kernels.
fn suffix<T: Element>() -> Result<&'static str> {
    match T::DTYPE {
        DType::F32 => Ok("f32"),
        DType::Bf16 => Ok("bf16"),
        DType::F16 => Ok("f16"),
        other => Err(DeviceError::Kernel {
            kernel: "engine",
            reason: format!("no engine kernel takes {other} elements"),
        }),
    }
}

/// The number of leading elements done one at a time so that every pointer (address, element
/// size) is 16-byte aligned at the first pack, or `n` where no such number exists.
fn vector_head(n: usize, pointers: &[(u64, usize)]) -> usize {
    (0..PACK)
        .find(|&h| {
            pointers.iter().all(|&(address, size)| (address + (h * size) as u64).is_multiple_of(16))
        })
        .map_or(n, |h| h.min(n))
}

/// Threads an element-wise kernel over `n` elements with `head` can use: one per pack or one per
/// single element, whichever is more.
fn elementwise_work(n: usize, head: usize) -> usize {
    let packs = (n - head) / PACK;
    packs.max(n - PACK * packs)
}

/// The bytes `range` of `buffer` occupies (the range was checked to fit).
fn span<T: Element>(buffer: &CudaBuffer<T>, range: &Range<usize>) -> Range<u64> {
    buffer.address(range.start)..buffer.address(range.end)
}

/// Refuses a call where a written argument overlaps another one. `args` are (bytes, written).
fn check_disjoint(kernel: &'static str, args: &[(Range<u64>, bool)]) -> Result<()> {
    for (i, (a, a_written)) in args.iter().enumerate() {
        for (j, (b, b_written)) in args.iter().enumerate().skip(i + 1) {
            let overlap = !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end;
            if overlap && (*a_written || *b_written) {
                let (arg, other) = if *a_written { (i, j) } else { (j, i) };
                return Err(DeviceError::AliasedArguments { kernel, arg, other });
            }
        }
    }
    Ok(())
}

/// `offset..offset + len` without overflow (a range that cannot fit any buffer instead).
fn range_at(offset: usize, len: usize) -> Range<usize> {
    offset..offset.saturating_add(len)
}

impl CudaDevice {
    /// Compiles (or takes from the disk cache) and loads the engine's kernels now rather than in
    /// the first call that needs them: compiling takes seconds, so an engine does this at
    /// start-up. Later calls return at once.
    pub fn load_engine_kernels(&self) -> Result<()> {
        self.engine().map(drop)
    }

    /// The engine module, compiled and loaded on first use.
    fn engine(&self) -> Result<&EngineKernels> {
        if let Some(engine) = self.inner.engine_kernels.get() {
            return Ok(engine);
        }
        let loaded = EngineKernels::load(self)?;
        // Two threads may both have loaded it; the module cache made that cheap, and the loser's
        // copy (no scratch yet) is dropped.
        Ok(self.inner.engine_kernels.get_or_init(|| loaded))
    }

    /// Queues the element-wise kernel `name` over `n` elements whose pointers (with their
    /// element sizes) lead `params`, followed by `n`, `head` and `scalars`.
    ///
    /// # Safety
    /// `name` must take exactly those parameters, and every pointer must address `n` elements of
    /// its size that the kernel may access, ordered against other streams by the caller.
    unsafe fn launch_elementwise(
        &self,
        stream: &CudaStream,
        name: Key,
        pointers: &[(u64, usize)],
        n: usize,
        scalars: &[f32],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let engine = self.engine()?;
        let kernel = engine.kernel(name)?;
        let head = vector_head(n, pointers);
        let params =
            pointers.iter().fold(KernelParams::new(), |p, &(address, _)| p.raw_ptr(address));
        let params = scalars.iter().fold(params.u64(n as u64).u64(head as u64), |p, &x| p.f32(x));
        let blocks = engine.blocks(kernel, elementwise_work(n, head));
        // SAFETY: guaranteed by the caller; the grid only changes which thread does which
        // element, and the kernel touches exactly elements 0..n of each pointer.
        unsafe { self.launch(stream, &kernel.function, blocks, BLOCK, 0, &params) }
    }

    /// Queues the deterministic reduction `partial` over `src[range]` and `finish`, which writes
    /// one value at `out`.
    ///
    /// # Safety
    /// `partial` must take (src, n, head, partials) and `finish` (partials, count, out), and
    /// `out` must address the one element `finish` writes, ordered against other streams.
    unsafe fn launch_reduction<S: Float>(
        &self,
        stream: &CudaStream,
        partial: Key,
        finish: Key,
        src: &CudaBuffer<S>,
        range: Range<usize>,
        out: u64,
    ) -> Result<()> {
        let engine = self.engine()?;
        let (partial, finish) = (engine.kernel(partial)?, engine.kernel(finish)?);
        let n = range.len();
        let from = src.address(range.start);
        let head = vector_head(n, &[(from, size_of::<S>())]);
        let blocks = engine.blocks(partial, elementwise_work(n, head)).min(MAX_PARTIALS);
        let mut scratch = engine.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.inner.bind()?;
        let partials = engine.partials_for(&mut scratch, stream)?;
        let params =
            KernelParams::new().raw_ptr(from).u64(n as u64).u64(head as u64).raw_ptr(partials);
        // SAFETY: `src[range]` is in bounds (checked by the caller) and read only; the kernel
        // writes partials[0..blocks] (blocks <= MAX_PARTIALS) of this stream's scratch, which only
        // this stream uses, and the scratch lock keeps another host thread from interleaving.
        unsafe { self.launch(stream, &partial.function, blocks, BLOCK, 0, &params)? };
        let params = KernelParams::new().raw_ptr(partials).u32(blocks).raw_ptr(out);
        // SAFETY: reads the partials just written on this stream; writes the one element at
        // `out` (the caller's guarantee).
        unsafe { self.launch(stream, &finish.function, 1, BLOCK, 0, &params) }
    }

    /// `out[slot] = Σ src[range]²`, accumulated within each thread as `accumulation` says and in
    /// f64 beyond. A non-finite element makes the sum non-finite, and so does a sum above the f32
    /// range. Deterministic for a given device and range.
    pub fn sum_squares_with<S: Float>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<S>,
        range: Range<usize>,
        out: &CudaBuffer<f32>,
        slot: usize,
        accumulation: Accumulation,
    ) -> Result<()> {
        check_range("sum_squares source", &range, src.len())?;
        let slot_range = range_at(slot, 1);
        check_range("sum_squares output", &slot_range, out.len())?;
        check_disjoint(
            "sum_squares",
            &[(span(src, &range), false), (span(out, &slot_range), true)],
        )?;
        let op = match accumulation {
            Accumulation::F32 => "sum_squares_f32",
            Accumulation::F64 => "sum_squares_f64",
        };
        let partial = (op, suffix::<S>()?, "");
        // SAFETY: `sum_squares_{acc}_{S}` takes (const S*, i64, i64, double*) and
        // `sum_squares_finish` (const double*, u32, float*); `out[slot]` was checked to fit.
        unsafe {
            self.launch_reduction(
                stream,
                partial,
                ("sum_squares_finish", "", ""),
                src,
                range,
                out.address(slot),
            )
        }
    }

    /// `out[slot]` = the number of infinite or NaN elements in `src[range]` (saturating at
    /// `u32::MAX`). Deterministic; the overflow check of mixed-precision training.
    pub fn nonfinite<S: Float>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<S>,
        range: Range<usize>,
        out: &CudaBuffer<u32>,
        slot: usize,
    ) -> Result<()> {
        check_range("nonfinite source", &range, src.len())?;
        let slot_range = range_at(slot, 1);
        check_range("nonfinite output", &slot_range, out.len())?;
        check_disjoint("nonfinite", &[(span(src, &range), false), (span(out, &slot_range), true)])?;
        let partial = ("nonfinite", suffix::<S>()?, "");
        // SAFETY: `nonfinite_{S}` takes (const S*, i64, i64, u64*) and `nonfinite_finish`
        // (const u64*, u32, u32*); `out[slot]` was checked to fit.
        unsafe {
            self.launch_reduction(
                stream,
                partial,
                ("nonfinite_finish", "", ""),
                src,
                range,
                out.address(slot),
            )
        }
    }

    /// One AdamW step over `buffers.{master, exp_avg, exp_avg_sq}[range]` with the gradients
    /// `buffers.grads[range]` (times `scalars.grad_scale`), writing the updated weights as `P`
    /// into `out[out_offset..out_offset + range.len()]`. The arithmetic is zeroflow-optim's AVX2
    /// and AVX-512 kernels', fused multiply-adds included.
    pub fn adamw_step<P: Float>(
        &self,
        stream: &CudaStream,
        scalars: &StepScalars,
        buffers: AdamWBuffers<'_>,
        range: Range<usize>,
        out: &CudaBuffer<P>,
        out_offset: usize,
    ) -> Result<()> {
        let AdamWBuffers { master, exp_avg, exp_avg_sq, grads } = buffers;
        check_range("adamw master", &range, master.len())?;
        check_range("adamw exp_avg", &range, exp_avg.len())?;
        check_range("adamw exp_avg_sq", &range, exp_avg_sq.len())?;
        check_range("adamw grads", &range, grads.len())?;
        let out_range = range_at(out_offset, range.len());
        check_range("adamw output", &out_range, out.len())?;
        check_disjoint(
            "adamw",
            &[
                (span(master, &range), true),
                (span(exp_avg, &range), true),
                (span(exp_avg_sq, &range), true),
                (span(grads, &range), false),
                (span(out, &out_range), true),
            ],
        )?;
        let name = ("adamw", suffix::<P>()?, "");
        let pointers = [
            (master.address(range.start), 4),
            (exp_avg.address(range.start), 4),
            (exp_avg_sq.address(range.start), 4),
            (grads.address(range.start), 4),
            (out.address(out_offset), size_of::<P>()),
        ];
        let s = scalars;
        let scalars = [
            s.grad_scale,
            s.l2,
            s.one_minus_beta1,
            s.one_minus_beta2,
            s.inv_sqrt_bias_correction2,
            s.eps,
            s.neg_lr_weight_decay,
            s.neg_step_size,
        ];
        // SAFETY: `adamw_{P}` takes (float*, float*, float*, const float*, P*, i64, i64, 8 ×
        // float); every range was checked to fit and the written ones not to overlap anything.
        unsafe { self.launch_elementwise(stream, name, &pointers, range.len(), &scalars) }
    }

    /// `dst[r, j] = src[r, index[j]]` for every row `r` and every `j` in `index_range`: `dst` is
    /// `[src.rows, index_range.len()]`. An index `>= src.cols` gives NaN (it cannot be checked
    /// before the kernel runs).
    pub fn gather_columns<T: Float>(
        &self,
        stream: &CudaStream,
        src: RowMajor<'_, T>,
        index: &CudaBuffer<u32>,
        index_range: Range<usize>,
        dst: RowMajor<'_, T>,
    ) -> Result<()> {
        self.launch_columns("gather_columns", stream, src, index, index_range, dst, false)
    }

    /// `dst[r, index[j]] = src[r, j]` for every row `r` and every `j` in `index_range`: `src` is
    /// `[dst.rows, index_range.len()]`. An index `>= dst.cols` is skipped; with duplicate indices
    /// one of the values is written.
    pub fn scatter_columns<T: Float>(
        &self,
        stream: &CudaStream,
        src: RowMajor<'_, T>,
        index: &CudaBuffer<u32>,
        index_range: Range<usize>,
        dst: RowMajor<'_, T>,
    ) -> Result<()> {
        self.launch_columns("scatter_columns", stream, src, index, index_range, dst, true)
    }

    /// Gather (the full matrix is `src`) or scatter (the full matrix is `dst`).
    #[allow(clippy::too_many_arguments, reason = "the two public calls' arguments and which one")]
    fn launch_columns<T: Float>(
        &self,
        kernel: &'static str,
        stream: &CudaStream,
        src: RowMajor<'_, T>,
        index: &CudaBuffer<u32>,
        index_range: Range<usize>,
        dst: RowMajor<'_, T>,
        scatter: bool,
    ) -> Result<()> {
        check_range(kernel, &index_range, index.len())?;
        let src_range = checked_range(&src, kernel)?;
        let dst_range = checked_range(&dst, kernel)?;
        let (full, selected) = if scatter { (&dst, &src) } else { (&src, &dst) };
        let k = index_range.len();
        if selected.rows != full.rows {
            let (left, right) = (selected.rows, full.rows);
            return Err(DeviceError::LengthMismatch {
                what: "rows of the two matrices",
                left,
                right,
            });
        }
        if selected.cols != k {
            let (left, right) = (selected.cols, k);
            return Err(DeviceError::LengthMismatch {
                what: "selected columns vs indices",
                left,
                right,
            });
        }
        check_disjoint(
            kernel,
            &[
                (span(src.buffer, &src_range), false),
                (span(index, &index_range), false),
                (span(dst.buffer, &dst_range), true),
            ],
        )?;
        if k == 0 || full.rows == 0 {
            return Ok(());
        }
        let engine = self.engine()?;
        let function = &engine.kernel((kernel, suffix::<T>()?, ""))?.function;
        let block_x = u32::try_from(k.next_multiple_of(32)).unwrap_or(BLOCK).min(BLOCK);
        let grid_x = u32::try_from(k.div_ceil(block_x as usize)).unwrap_or(u32::MAX).min(65_535);
        let grid_y = u32::try_from(full.rows).unwrap_or(u32::MAX).min(65_535);
        let params = KernelParams::new()
            .ptr(src.buffer, src.offset)
            .u64(full.rows as u64)
            .u64(full.cols as u64)
            .ptr(index, index_range.start)
            .u64(k as u64)
            .ptr(dst.buffer, dst.offset);
        // SAFETY: `{gather,scatter}_columns_{T}` takes (const T*, i64, i64, const u32*, i64, T*);
        // the kernel reads `index[0..k]`, touches rows 0..rows of both matrices (checked to fit
        // their buffers), and only columns < cols of the full matrix; the written matrix overlaps
        // nothing else.
        unsafe {
            self.launch(stream, function, Dim3 { x: grid_x, y: grid_y, z: 1 }, block_x, 0, &params)
        }
    }

    /// `out[out_offset + c] += Σ_r |src[r, c]|` for every column `c` of `src`, summed in f32.
    /// Deterministic: one block per stripe of 32 columns, whose 8 row groups each sum their rows
    /// in increasing order and are then added in a fixed order; `out` must hold
    /// `out_offset + src.cols` elements. A non-finite element makes its column's sum non-finite.
    pub fn column_abs_sums<S: Float>(
        &self,
        stream: &CudaStream,
        src: RowMajor<'_, S>,
        out: &CudaBuffer<f32>,
        out_offset: usize,
    ) -> Result<()> {
        let src_range = checked_range(&src, "column_abs_sums source")?;
        let out_range = range_at(out_offset, src.cols);
        check_range("column_abs_sums output", &out_range, out.len())?;
        check_disjoint(
            "column_abs_sums",
            &[(span(src.buffer, &src_range), false), (span(out, &out_range), true)],
        )?;
        if src.rows == 0 || src.cols == 0 {
            return Ok(());
        }
        let engine = self.engine()?;
        let function = &engine.kernel(("column_abs_sums", suffix::<S>()?, ""))?.function;
        // One block per stripe along x; y takes the stripes beyond x's limit (2³¹ - 1), and the
        // kernel strides over any left beyond the whole grid.
        let stripes = src.cols.div_ceil(COLUMN_STRIPE as usize);
        let grid_x = u32::try_from(stripes).unwrap_or(u32::MAX).min(i32::MAX as u32);
        let grid_y =
            u32::try_from(stripes.div_ceil(grid_x as usize)).unwrap_or(u32::MAX).min(MAX_GRID_Y);
        let params = KernelParams::new()
            .ptr(src.buffer, src.offset)
            .u64(src.rows as u64)
            .u64(src.cols as u64)
            .ptr(out, out_offset);
        // SAFETY: `column_abs_sums_{S}` takes (const S*, i64, i64, float*); it reads rows 0..rows
        // of the matrix (checked to fit its buffer) and updates `out[out_offset..][..cols]`
        // (checked to fit and not to overlap the matrix).
        unsafe {
            self.launch(
                stream,
                function,
                Dim3 { x: grid_x, y: grid_y, z: 1 },
                Dim3 { x: COLUMN_STRIPE, y: COLUMN_GROUPS, z: 1 },
                0,
                &params,
            )
        }
    }
}

impl Kernels for CudaDevice {
    fn accumulate<S: Float>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<S>,
        src_range: Range<usize>,
        dst: &CudaBuffer<f32>,
        dst_offset: usize,
        scale: f32,
    ) -> Result<()> {
        check_range("accumulate source", &src_range, src.len())?;
        let dst_range = range_at(dst_offset, src_range.len());
        check_range("accumulate destination", &dst_range, dst.len())?;
        check_disjoint(
            "accumulate",
            &[(span(src, &src_range), false), (span(dst, &dst_range), true)],
        )?;
        let name = ("accumulate", suffix::<S>()?, "");
        let pointers =
            [(src.address(src_range.start), size_of::<S>()), (dst.address(dst_offset), 4)];
        // SAFETY: `accumulate_{S}` takes (const S*, float*, i64, i64, float); both ranges were
        // checked to fit and not to overlap.
        unsafe { self.launch_elementwise(stream, name, &pointers, src_range.len(), &[scale]) }
    }

    fn cast<S: Float, T: Float>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<S>,
        src_range: Range<usize>,
        dst: &CudaBuffer<T>,
        dst_offset: usize,
    ) -> Result<()> {
        check_range("cast source", &src_range, src.len())?;
        let dst_range = range_at(dst_offset, src_range.len());
        check_range("cast destination", &dst_range, dst.len())?;
        check_disjoint("cast", &[(span(src, &src_range), false), (span(dst, &dst_range), true)])?;
        let name = ("cast", suffix::<S>()?, suffix::<T>()?);
        let pointers = [
            (src.address(src_range.start), size_of::<S>()),
            (dst.address(dst_offset), size_of::<T>()),
        ];
        // SAFETY: `cast_{S}_{T}` takes (const S*, T*, i64, i64); both ranges were checked to fit
        // and not to overlap.
        unsafe { self.launch_elementwise(stream, name, &pointers, src_range.len(), &[]) }
    }

    fn scale<S: Float>(
        &self,
        stream: &CudaStream,
        buf: &CudaBuffer<S>,
        range: Range<usize>,
        alpha: f32,
    ) -> Result<()> {
        check_range("scale", &range, buf.len())?;
        let name = ("scale", suffix::<S>()?, "");
        let pointers = [(buf.address(range.start), size_of::<S>())];
        // SAFETY: `scale_{S}` takes (S*, i64, i64, float); the range was checked to fit.
        unsafe { self.launch_elementwise(stream, name, &pointers, range.len(), &[alpha]) }
    }

    fn sum_squares<S: Float>(
        &self,
        stream: &CudaStream,
        src: &CudaBuffer<S>,
        range: Range<usize>,
        out: &CudaBuffer<f32>,
        slot: usize,
    ) -> Result<()> {
        self.sum_squares_with(stream, src, range, out, slot, Accumulation::F64)
    }

    fn gather_columns<T: Float>(
        &self,
        stream: &CudaStream,
        src: Matrix<'_, Self, T>,
        index: &CudaBuffer<u32>,
        index_range: Range<usize>,
        dst: Matrix<'_, Self, T>,
    ) -> Result<()> {
        CudaDevice::gather_columns(self, stream, src, index, index_range, dst)
    }

    fn scatter_columns<T: Float>(
        &self,
        stream: &CudaStream,
        src: Matrix<'_, Self, T>,
        index: &CudaBuffer<u32>,
        index_range: Range<usize>,
        dst: Matrix<'_, Self, T>,
    ) -> Result<()> {
        CudaDevice::scatter_columns(self, stream, src, index, index_range, dst)
    }

    fn column_abs_sums<S: Float>(
        &self,
        stream: &CudaStream,
        src: Matrix<'_, Self, S>,
        out: &CudaBuffer<f32>,
        out_offset: usize,
    ) -> Result<()> {
        CudaDevice::column_abs_sums(self, stream, src, out, out_offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_head_aligns_every_pointer_or_gives_up() {
        // f32 and bf16 both at 16-byte boundaries: no head.
        assert_eq!(vector_head(100, &[(0x1000, 4), (0x2000, 2)]), 0);
        // f32 at +12 bytes needs 1 or 5 more elements, bf16 at +2 bytes needs 7: never both.
        assert_eq!(vector_head(100, &[(0x100c, 4), (0x2002, 2)]), 100);
        // f32 at +12 bytes needs 1 or 5, bf16 at +10 bytes needs 3: never both.
        assert_eq!(vector_head(100, &[(0x100c, 4), (0x200a, 2)]), 100);
        // f32 at +4 bytes needs 3 or 7, bf16 at +2 bytes needs 7: both after 7.
        assert_eq!(vector_head(100, &[(0x1004, 4), (0x2002, 2)]), 7);
        // A head longer than the range is the whole range.
        assert_eq!(vector_head(3, &[(0x1004, 4)]), 3);
        assert_eq!(vector_head(0, &[(0x1000, 4)]), 0);
    }

    #[test]
    fn elementwise_work_covers_packs_and_singles() {
        assert_eq!(elementwise_work(1, 1), 1);
        assert_eq!(elementwise_work(1000, 0), 125);
        assert_eq!(elementwise_work(1003, 3), 125);
        assert_eq!(elementwise_work(17, 7), 7 + 2);
        assert_eq!(elementwise_work(1000, 1000), 1000);
    }

    #[test]
    fn overlapping_written_arguments_are_refused() {
        let err = check_disjoint("k", &[(0..16, false), (8..24, true)]).unwrap_err();
        assert_eq!(err, DeviceError::AliasedArguments { kernel: "k", arg: 1, other: 0 });
        assert!(check_disjoint("k", &[(0..16, false), (0..16, false)]).is_ok());
        assert!(check_disjoint("k", &[(0..16, true), (16..32, true)]).is_ok());
        assert!(check_disjoint("k", &[(0..16, true), (4..4, true)]).is_ok());
    }

    #[test]
    fn kernel_names_are_unique() {
        let names = kernel_names();
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        assert_eq!(names.len(), 2 + 3 * (3 + PER_TYPE_KERNELS.len()));
    }
}
