//! The key/value cache of inference on the GPU ([`CudaKvCache`]): every layer's keys and values
//! `[layers, batch, n_kv_head, capacity, head_dim]` in bf16, and the two kernels of
//! `kernels/decode.cu` that a cached step runs per layer: `kv_write` (each token row's key and
//! value heads into the cache at its sequence and position) and `decode_attention` (each row's
//! query heads over its sequence's positions up to its own, one block per (row, head), an online
//! softmax in f32 per warp). Their CPU twins are [`crate::infer::decode_attention`].
//!
//! A step's rows ([`CachedRow`]) are set once ([`CudaKvCache::set_rows`]) and serve every layer:
//! a prefill's rows are every prompt position (each attends causally), a decode step's one row
//! per sequence.

use zeroflow_core::bf16;
use zeroflow_device::cuda::{
    CudaBuffer, CudaFunction, CudaStream, DeviceSlice, DeviceSliceMut, KernelParams,
};
use zeroflow_device::{CudaDevice, Device, DeviceError, HostBuffer, HostMemory};

use crate::infer::decode_attention::{DECODE_WARPS, DeviceCacheLayout, MAX_HEAD_DIM, WARP};
use crate::infer::{CachedAttention, CachedRow};

/// The CUDA source of the cached attention (the shared header first).
pub const SOURCE: &str =
    concat!(include_str!("../../kernels/common.cuh"), include_str!("../../kernels/decode.cu"));

/// The kernels of [`SOURCE`].
pub const KERNEL_NAMES: [&str; 2] = ["kv_write", "decode_attention"];

/// Threads per block of `decode_attention` (its `DECODE_THREADS`).
const DECODE_THREADS: u32 = (DECODE_WARPS * WARP) as u32;
/// Threads per block, and at most so many blocks, of the grid-stride `kv_write`.
const WRITE_THREADS: u32 = 256;
const WRITE_MAX_BLOCKS: usize = 1 << 16;
/// The most blocks a grid's x dimension takes.
const MAX_GRID_X: usize = (1 << 31) - 1;

// The launch limits, checked as the crate compiles: a block of whole warps, at most 1024
// threads, its shared accumulators (DECODE_WARPS rows of MAX_HEAD_DIM floats with each warp's
// max and sum) under the 48 KiB a block gets without opting in, and whole lanes' dimensions.
const _: () = assert!(DECODE_THREADS.is_multiple_of(32) && DECODE_THREADS <= 1024);
const _: () = assert!(DECODE_WARPS * (MAX_HEAD_DIM + 2) * 4 <= 48 * 1024);
const _: () = assert!(MAX_HEAD_DIM.is_multiple_of(WARP));

fn invalid(reason: String) -> DeviceError {
    DeviceError::Kernel { kernel: "decode_attention", reason }
}

/// Every layer's keys and values for a batch of sequences, the rows of the current step, and the
/// kernels.
#[derive(Debug)]
pub struct CudaKvCache {
    device: CudaDevice,
    layers: usize,
    layout: DeviceCacheLayout,
    keys: CudaBuffer<bf16>,
    values: CudaBuffer<bf16>,
    /// `[row_seq max_rows | row_pos max_rows]` of the current step, and its staging.
    row_ids: CudaBuffer<u32>,
    staging: HostBuffer<u32>,
    max_rows: usize,
    rows: usize,
    kv_write: CudaFunction,
    decode_attention: CudaFunction,
}

impl CudaKvCache {
    /// Loads the kernels and allocates the cache of `layers` layers of `layout` (zeros) for steps
    /// of at most `max_rows` token rows. An error where the kernels do not take the shape: a head
    /// size above [`MAX_HEAD_DIM`], query heads not a multiple of the key/value heads, or sizes
    /// that do not fit the kernels' 32-bit indices.
    pub fn new(
        device: &CudaDevice,
        layers: usize,
        layout: DeviceCacheLayout,
        max_rows: usize,
    ) -> Result<Self, DeviceError> {
        check_layout(&layout, max_rows)?;
        let module = device.load_module("nn_decode", SOURCE)?;
        let len = layers * layout.len();
        let (keys, values) = (device.alloc::<bf16>(len)?, device.alloc::<bf16>(len)?);
        let stream = device.stream(zeroflow_device::StreamKind::Compute);
        device.fill(stream, &keys, 0..len, bf16::ZERO)?;
        device.fill(stream, &values, 0..len, bf16::ZERO)?;
        Ok(CudaKvCache {
            device: device.clone(),
            layers,
            layout,
            keys,
            values,
            row_ids: device.alloc::<u32>(2 * max_rows.max(1))?,
            staging: device.alloc_host::<u32>(2 * max_rows.max(1), HostMemory::Pageable)?,
            max_rows,
            rows: 0,
            kv_write: module.function("kv_write")?,
            decode_attention: module.function("decode_attention")?,
        })
    }

    pub fn layout(&self) -> &DeviceCacheLayout {
        &self.layout
    }

    /// Bytes of GPU memory the keys and values hold.
    pub fn bytes(&self) -> usize {
        2 * self.layers * self.layout.len() * size_of::<bf16>()
    }

    /// Makes `rows` the rows of the next `write` and `attend` calls: checks each against the
    /// batch and the capacity, and copies them to the GPU on `stream` (waiting for the copy).
    pub fn set_rows(&mut self, stream: &CudaStream, rows: &[CachedRow]) -> Result<(), DeviceError> {
        if rows.len() > self.max_rows {
            let max = self.max_rows;
            return Err(invalid(format!("{} rows in a step; the cache takes {max}", rows.len())));
        }
        let DeviceCacheLayout { batch, capacity, .. } = self.layout;
        if let Some(row) = rows.iter().find(|r| r.seq >= batch || r.pos >= capacity) {
            return Err(invalid(format!(
                "row {row:?} is outside the cache of {batch} sequences of {capacity} positions"
            )));
        }
        let n = rows.len();
        for (i, row) in rows.iter().enumerate() {
            // Below the batch and the capacity, which `check_layout` fitted into u32.
            self.staging[i] = row.seq as u32;
            self.staging[self.max_rows + i] = row.pos as u32;
        }
        let max = self.max_rows;
        self.device.copy_h2d(stream, &self.staging, 0..n, &self.row_ids, 0)?.wait()?;
        self.device.copy_h2d(stream, &self.staging, max..max + n, &self.row_ids, max)?.wait()?;
        self.rows = n;
        Ok(())
    }

    /// Layer `layer`'s `kv_write` of the current rows: their `qkv` rows (`[rows, qkv_stride]`,
    /// stride at least the qkv width) into the cache.
    pub fn write(
        &self,
        stream: &CudaStream,
        layer: usize,
        qkv: DeviceSlice<'_, bf16>,
        qkv_stride: usize,
    ) -> Result<(), DeviceError> {
        let shape = self.layout.shape;
        self.check_rows("qkv", qkv.len(), qkv_stride, shape.qkv_width())?;
        let layer = self.layer(layer)?;
        let work = self.rows * shape.kv_width();
        let blocks = work.div_ceil(WRITE_THREADS as usize).min(WRITE_MAX_BLOCKS) as u32;
        let params = KernelParams::new()
            .slice_mut(self.keys.slice_mut(layer.clone()))
            .slice_mut(self.values.slice_mut(layer))
            .slice(qkv)
            .ptr(&self.row_ids, 0)
            .ptr(&self.row_ids, self.max_rows)
            .u32(self.rows as u32)
            .u32(qkv_stride as u32)
            .u32(shape.q_width() as u32)
            .u32(shape.n_kv_head as u32)
            .u32(shape.head_dim as u32)
            .u32(self.layout.capacity as u32);
        // SAFETY: the parameters match `kv_write(bf16_t*, bf16_t*, const bf16_t*, const u32*,
        // const u32*, u32 × 6)`. The grid-stride loop covers `rows · KV` elements: it reads
        // columns `q_width .. q_width + 2·KV` (the qkv width, at most the stride) of rows
        // `0..rows` of qkv, which holds `rows · stride` elements (`check_rows`), and the row ids
        // `0..rows` of both halves of `row_ids` (set by `set_rows`); it writes slot
        // `((seq·KVH + j)·L + pos)·hs + d` of this layer's keys and values, inside them because
        // every row's seq and pos were checked below the batch and the capacity.
        unsafe { self.device.launch(stream, &self.kv_write, blocks, WRITE_THREADS, 0, &params) }
    }

    /// Layer `layer`'s `decode_attention` of the current rows: their query heads (of `qkv`, as
    /// in [`write`](Self::write), which must have run first) over the cache, into `out`
    /// (`[rows, out_stride]`, stride at least `n_head · head_dim`).
    pub fn attend(
        &self,
        stream: &CudaStream,
        layer: usize,
        qkv: DeviceSlice<'_, bf16>,
        qkv_stride: usize,
        out: DeviceSliceMut<'_, bf16>,
        out_stride: usize,
    ) -> Result<(), DeviceError> {
        let shape = self.layout.shape;
        self.check_rows("qkv", qkv.len(), qkv_stride, shape.qkv_width())?;
        self.check_rows("out", out.len(), out_stride, shape.q_width())?;
        let layer = self.layer(layer)?;
        let scale = 1.0 / (shape.head_dim as f32).sqrt();
        let params = KernelParams::new()
            .slice_mut(out)
            .slice(qkv)
            .slice(self.keys.slice(layer.clone()))
            .slice(self.values.slice(layer))
            .ptr(&self.row_ids, 0)
            .ptr(&self.row_ids, self.max_rows)
            .u32(shape.n_head as u32)
            .u32(shape.n_kv_head as u32)
            .u32(shape.head_dim as u32)
            .u32(self.layout.capacity as u32)
            .u32(qkv_stride as u32)
            .u32(out_stride as u32)
            .f32(scale);
        let blocks = (self.rows * shape.n_head) as u32;
        // SAFETY: the parameters match `decode_attention(bf16_t*, const bf16_t*, const bf16_t*,
        // const bf16_t*, const u32*, const u32*, u32 × 6, float)`. Block `r·NH + h` (`rows · NH`
        // blocks, at most 2³¹ − 1 by `check_layout`) reads query head h of qkv row r (columns
        // below `q_width`, inside `rows · stride` elements by `check_rows`), positions
        // `0..=pos` of its sequence's key/value head of this layer (inside it: seq below the
        // batch and pos below the capacity, checked by `set_rows`), and writes columns
        // `h·hs .. (h+1)·hs` of row r of out (below `q_width ≤ out_stride`, `rows · out_stride`
        // elements by `check_rows`). head_dim ≤ DECODE_MAX_HEAD_DIM (`check_layout`) keeps every
        // lane's dimensions inside its registers and the shared accumulators.
        unsafe {
            self.device.launch(stream, &self.decode_attention, blocks, DECODE_THREADS, 0, &params)
        }
    }

    /// Copies the first `positions` positions of sequence 0 of every layer's keys and values
    /// from `from` (a cache of as many layers of the same shape) into this cache's sequence 0,
    /// on `stream`: a cache made larger for a conversation's next turn keeps what it held.
    pub fn copy_prefix(
        &self,
        stream: &CudaStream,
        from: &CudaKvCache,
        positions: usize,
    ) -> Result<(), DeviceError> {
        let (to, of) = (&self.layout, &from.layout);
        let fits = [to, of].iter().all(|l| l.batch >= 1 && positions <= l.capacity);
        if self.layers != from.layers || to.shape != of.shape || !fits {
            return Err(invalid(format!(
                "{positions} positions of a cache of {} layers of {of:?} into one of {} of {to:?}",
                from.layers, self.layers
            )));
        }
        let hd = to.shape.head_dim;
        for layer in 0..self.layers {
            for head in 0..to.shape.n_kv_head {
                let src = layer * of.len() + of.at(0, head, 0);
                let dst = layer * to.len() + to.at(0, head, 0);
                let range = src..src + positions * hd;
                self.device.copy_d2d(stream, &from.keys, range.clone(), &self.keys, dst)?;
                self.device.copy_d2d(stream, &from.values, range, &self.values, dst)?;
            }
        }
        Ok(())
    }

    /// The keys and values of layer `layer` (for tests), waiting for the GPU.
    pub fn download_layer(&self, layer: usize) -> Result<(Vec<bf16>, Vec<bf16>), DeviceError> {
        let range = self.layer(layer)?;
        let all = (self.device.download(&self.keys)?, self.device.download(&self.values)?);
        Ok((all.0[range.clone()].to_vec(), all.1[range].to_vec()))
    }

    fn layer(&self, layer: usize) -> Result<std::ops::Range<usize>, DeviceError> {
        if layer >= self.layers {
            return Err(invalid(format!("layer {layer} of a cache of {}", self.layers)));
        }
        let len = self.layout.len();
        Ok(layer * len..(layer + 1) * len)
    }

    /// An error unless a `len`-element tensor of `rows` rows of `stride` (at least `width`) holds
    /// the current rows, with the stride fitting u32.
    fn check_rows(
        &self,
        what: &str,
        len: usize,
        stride: usize,
        width: usize,
    ) -> Result<(), DeviceError> {
        if stride < width || u32::try_from(stride).is_err() || len < self.rows * stride {
            return Err(invalid(format!(
                "{what}: {len} elements of stride {stride} for {} rows of width {width}",
                self.rows
            )));
        }
        Ok(())
    }
}

/// An error unless the kernels take `layout` and steps of `max_rows` rows.
fn check_layout(layout: &DeviceCacheLayout, max_rows: usize) -> Result<(), DeviceError> {
    let CachedAttention { n_head, n_kv_head, head_dim } = layout.shape;
    if head_dim == 0 || head_dim > MAX_HEAD_DIM {
        return Err(invalid(format!("head_dim {head_dim}: the kernel takes 1 to {MAX_HEAD_DIM}")));
    }
    if n_kv_head == 0 || !n_head.is_multiple_of(n_kv_head) {
        return Err(invalid(format!("{n_head} query heads over {n_kv_head} key/value heads")));
    }
    let fits = [layout.batch, layout.capacity, layout.shape.qkv_width(), max_rows * n_head]
        .iter()
        .all(|&size| u32::try_from(size).is_ok());
    if !fits || max_rows * n_head > MAX_GRID_X {
        return Err(invalid(format!(
            "batch {}, capacity {}, {max_rows} rows of {n_head} heads: the kernels index with 32 \
             bits",
            layout.batch, layout.capacity
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LAYOUT: DeviceCacheLayout = DeviceCacheLayout {
        shape: CachedAttention { n_head: 8, n_kv_head: 2, head_dim: 128 },
        batch: 16,
        capacity: 4096,
    };

    #[test]
    fn the_kernels_take_head_sizes_up_to_256_and_whole_groups_only() {
        assert!(check_layout(&LAYOUT, 16 * 4096).is_ok());
        let shape = |n_head, n_kv_head, head_dim| DeviceCacheLayout {
            shape: CachedAttention { n_head, n_kv_head, head_dim },
            ..LAYOUT
        };
        assert!(check_layout(&shape(8, 2, 256), 1).is_ok());
        let error = |layout, rows| check_layout(&layout, rows).unwrap_err().to_string();
        assert!(error(shape(8, 2, 257), 1).contains("head_dim 257"));
        assert!(error(shape(8, 3, 64), 1).contains("8 query heads over 3"));
        assert!(error(shape(8, 0, 64), 1).contains("over 0"));
        assert!(error(LAYOUT, 1 << 29).contains("32 bits"), "2^29 rows of 8 heads pass 2^31 − 1");
    }
}
