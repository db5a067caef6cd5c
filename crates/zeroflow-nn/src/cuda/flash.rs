//! Causal attention (multi-head or grouped-query) on the GPU as FlashAttention-2: one fused
//! kernel for forward and two (after a small one) for backward, with the tiles of q, k and v read
//! straight from `qkv` and the attention matrix never stored. The algorithm, the tiles and the
//! layouts are in the header of `kernels/flash_attention.cu`; the maths is that of
//! [`crate::kernels::attention`] and of [`CudaAttention`](super::attention::CudaAttention):
//! `qkv [B, T, W]` holds `[q | k | v]`, `W = C + 2·n_kv_head·hs`, query head `h` attending with
//! key/value head `h / (n_head / n_kv_head)`; `out [B, T, C]`, scale `1/sqrt(hs)`, bf16 storage,
//! f32 softmax and accumulators. With grouped-query attention the dk/dv kernel's blocks are one
//! per key/value head and sum over the query heads of its group in a fixed order, so the kernels
//! still use no atomics.
//!
//! Memory. [`CudaAttention`](super::attention::CudaAttention) holds five head-major `[B, T, C]`
//! bf16 tensors and a `[B, NH, T, T]` bf16 scores tensor as scratch, and its caller keeps the
//! `[B, NH, T, T]` weights `att` of every layer from forward to backward. This one's caller keeps
//! instead the log-sum-exp of each query row, `lse [B, NH, T]` f32, and its scratch is `delta [B,
//! NH, T]` f32 ([`scratch_bytes`](FlashAttention::scratch_bytes)). At gpt-1.3b's shapes (B 8, T
//! 1024, C 2048, 16 heads) that is 512 KiB of lse per layer instead of 256 MiB of att, and 512 KiB
//! of scratch instead of 416 MiB.
//!
//! The caller owns `lse` as it owns `att`: [`forward`](FlashAttention::forward) writes it and
//! [`backward`](FlashAttention::backward) reads it, so one value serves every layer of a model
//! (each layer with its own lse). No kernel uses atomics: every element of out, lse and dqkv is
//! written once, after sums in a fixed order, so forward and backward repeat bit for bit. The
//! price is that backward computes the probabilities and their gradient twice, once for dq
//! (parallel over query blocks) and once for dk and dv (parallel over key blocks).
//!
//! Packed rows (several documents per row, [`crate::plan::PlanOptions::packed`]) go through
//! [`forward_packed`](FlashAttention::forward_packed) and
//! [`backward_packed`](FlashAttention::backward_packed), which take each token's position in its
//! document, `positions [B, T]` (u32), and launch the `_packed` forms of the tile kernels: each
//! query attends its document's keys only, `t − positions[t] ..= t`, and the key tiles wholly
//! before a query tile's documents are skipped (the header of `kernels/flash_attention.cu`). The
//! plain forms launch exactly what they launched before packing existed.

use zeroflow_core::bf16;
use zeroflow_device::cuda::{
    CudaBuffer, CudaFunction, CudaStream, DeviceSlice, DeviceSliceMut, Dim3, KernelParams,
};
use zeroflow_device::{CudaDevice, Device, DeviceError};

use super::attention_shape::{Shape, check_tensor};
use crate::kernels::AttentionShape;

/// The CUDA source of the kernels: the shared header, then `flash_attention.cu`.
pub const SOURCE: &str = concat!(
    include_str!("../../kernels/common.cuh"),
    include_str!("../../kernels/flash_attention.cu")
);

/// The head sizes the tile kernels are compiled for (`flash_forward_{hs}`,
/// `flash_backward_dq_{hs}`, `flash_backward_dkdv_{hs}`, and their `_packed_{hs}` forms).
pub const HEAD_SIZES: [usize; 2] = [64, 128];

/// Threads per block of the tile kernels (four warps) and of the preprocess kernel.
const TILE_THREADS: u32 = 128;
/// Query rows and keys per tile (`BR = BC` in the source).
const TILE: usize = 64;
/// bf16 of padding after each shared-memory row of a tile (`PAD` in the source).
const PAD: usize = 8;
/// The alignment, in bytes, of every bf16 tensor the kernels take (they move 16-byte vectors).
const ALIGNMENT: u64 = 16;
/// The alignment, in bytes, of `lse` (read and written one f32 at a time).
const LSE_ALIGNMENT: u64 = 4;

/// Causal self-attention for one (batch, [`AttentionShape`]), FlashAttention-2 style, with its
/// scratch allocated once.
#[derive(Debug)]
pub struct FlashAttention {
    device: CudaDevice,
    shape: Shape,
    kernels: Kernels,
    /// `[B, NH, T]`: `Σ_d dout · out` of each query row (backward).
    delta: CudaBuffer<f32>,
}

impl Shape {
    /// The shape, or an error saying which size the flash kernels cannot take.
    fn for_flash(batch: usize, attention: AttentionShape) -> Result<Self, DeviceError> {
        let shape = Shape::new(batch, attention, invalid)?;
        let Shape { c, n_head, head_size, .. } = shape;
        if !HEAD_SIZES.contains(&head_size) {
            return Err(invalid(format!(
                "head size {head_size} (channels {c} / heads {n_head}) has no flash kernel: they \
                 are compiled for head sizes {HEAD_SIZES:?} (CudaAttention takes any)"
            )));
        }
        shape.check_32_bit_sizes(invalid)?;
        // Batch and heads are grid axes.
        if batch > usize::from(u16::MAX) || n_head > usize::from(u16::MAX) {
            return Err(invalid(format!(
                "batch {batch} and heads {n_head} must each be at most 65535 (grid axes)"
            )));
        }
        Ok(shape)
    }

    /// One tile kernel's block per (64-row block of the sequence, head, sequence), `heads` the
    /// query heads (forward, dq) or the key/value heads (dk/dv).
    fn tile_grid(&self, heads: usize) -> Dim3 {
        let blocks = self.seq.div_ceil(TILE);
        Dim3::from((blocks as u32, heads as u32, self.batch as u32))
    }
}

/// The caller's tensors the backward tile kernels take (`positions` for the packed forms only).
#[derive(Clone, Copy)]
struct BackwardTensors<'a> {
    dqkv: DeviceSliceMut<'a, bf16>,
    qkv: DeviceSlice<'a, bf16>,
    dout: DeviceSlice<'a, bf16>,
    lse: DeviceSlice<'a, f32>,
    positions: Option<DeviceSlice<'a, u32>>,
}

/// Bytes of one shared-memory tile of 64 rows of `head_size` bf16 (padded).
fn tile_bytes(head_size: usize) -> usize {
    TILE * (head_size + PAD) * size_of::<u16>()
}

/// Dynamic shared memory of `flash_forward_{hs}`: the Q, K and V tiles.
fn forward_shared_bytes(head_size: usize) -> usize {
    3 * tile_bytes(head_size)
}

/// Dynamic shared memory of `flash_backward_dq_{hs}`: the Q, dO, K and V tiles.
fn backward_dq_shared_bytes(head_size: usize) -> usize {
    4 * tile_bytes(head_size)
}

/// Dynamic shared memory of `flash_backward_dkdv_{hs}`: the K, V, Q and dO tiles, and the lse and
/// delta of the query block; the packed form's also where each query's document starts.
fn backward_dkdv_shared_bytes(head_size: usize, packed: bool) -> usize {
    let per_query =
        if packed { 2 * size_of::<f32>() + size_of::<u32>() } else { 2 * size_of::<f32>() };
    4 * tile_bytes(head_size) + TILE * per_query
}

/// The three tile kernels of [`SOURCE`] of one form (plain or packed) for one head size.
#[derive(Debug)]
struct TileKernels {
    forward: CudaFunction,
    backward_dq: CudaFunction,
    backward_dkdv: CudaFunction,
}

/// The kernels of [`SOURCE`] for one head size.
#[derive(Debug)]
struct Kernels {
    plain: TileKernels,
    packed: TileKernels,
    preprocess: CudaFunction,
}

impl Kernels {
    fn load(device: &CudaDevice, head_size: usize) -> Result<Self, DeviceError> {
        let module = device.load_module("flash_attention", SOURCE)?;
        let tiles = |[forward, backward_dq, backward_dkdv]: [&str; 3], packed: bool| {
            let function = |kernel: &str| module.function(&tile_kernel_name(kernel, head_size));
            let tiles = TileKernels {
                forward: function(forward)?,
                backward_dq: function(backward_dq)?,
                backward_dkdv: function(backward_dkdv)?,
            };
            // Each may need more than the 48 KiB of shared memory a kernel gets by default.
            device.bind()?;
            let dkdv_bytes = backward_dkdv_shared_bytes(head_size, packed);
            tiles.forward.set_max_dynamic_shared(forward_shared_bytes(head_size) as u32)?;
            tiles.backward_dq.set_max_dynamic_shared(backward_dq_shared_bytes(head_size) as u32)?;
            tiles.backward_dkdv.set_max_dynamic_shared(dkdv_bytes as u32)?;
            Ok::<_, DeviceError>(tiles)
        };
        Ok(Kernels {
            plain: tiles(TILE_KERNELS, false)?,
            packed: tiles(PACKED_TILE_KERNELS, true)?,
            preprocess: module.function("flash_backward_preprocess")?,
        })
    }

    /// The tile kernels of rows that are packed (`true`) or not.
    fn tiles(&self, packed: bool) -> &TileKernels {
        if packed { &self.packed } else { &self.plain }
    }
}

/// The tile kernels of [`SOURCE`], each exported once per head size as `{kernel}_{hs}`.
const TILE_KERNELS: [&str; 3] = ["flash_forward", "flash_backward_dq", "flash_backward_dkdv"];

/// Their forms for packed rows, which take the tokens' positions in their documents after the
/// other tensors.
const PACKED_TILE_KERNELS: [&str; 3] =
    ["flash_forward_packed", "flash_backward_dq_packed", "flash_backward_dkdv_packed"];

fn tile_kernel_name(kernel: &str, head_size: usize) -> String {
    format!("{kernel}_{head_size}")
}

/// Every kernel name [`FlashAttention`] may load from [`SOURCE`] (every head size).
pub fn kernel_names() -> Vec<String> {
    let kernels = TILE_KERNELS.iter().chain(&PACKED_TILE_KERNELS);
    let tile_kernels = HEAD_SIZES.iter().flat_map(|&head_size| {
        kernels.clone().map(move |kernel| tile_kernel_name(kernel, head_size))
    });
    tile_kernels.chain(["flash_backward_preprocess".to_string()]).collect()
}

fn invalid(reason: String) -> DeviceError {
    DeviceError::Kernel { kernel: "flash attention", reason }
}

/// An error unless every named address is aligned to its number of bytes.
fn check_aligned(addresses: &[(&str, u64, u64)]) -> Result<(), DeviceError> {
    let misaligned = addresses.iter().find(|(_, address, bytes)| !address.is_multiple_of(*bytes));
    match misaligned {
        None => Ok(()),
        Some((what, address, bytes)) => Err(invalid(format!(
            "{what} at {address:#x} is not {bytes}-byte aligned: the kernels move {bytes}-byte \
             pieces of it (CudaAttention takes any alignment)"
        ))),
    }
}

impl FlashAttention {
    /// Loads the kernels and allocates the scratch ([`scratch_bytes`](Self::scratch_bytes)) for
    /// inputs of `batch` sequences of `shape` (its `t` tokens, `c` channels, `n_head` query heads
    /// and `n_kv_head` key/value heads, which must divide `n_head`). The head size `c / n_head`
    /// must be one of [`HEAD_SIZES`].
    pub fn new(
        device: &CudaDevice,
        batch: usize,
        shape: AttentionShape,
    ) -> Result<Self, DeviceError> {
        let shape = Shape::for_flash(batch, shape)?;
        Ok(FlashAttention {
            kernels: Kernels::load(device, shape.head_size)?,
            delta: device.alloc(shape.query_rows())?,
            device: device.clone(),
            shape,
        })
    }

    /// Elements of the caller's `lse` (f32), `[B, NH, T]`: one per query row and query head.
    pub fn lse_len(&self) -> usize {
        self.shape.query_rows()
    }

    /// Bytes of GPU memory this attention holds: backward's delta (see the module documentation
    /// for how that compares with `CudaAttention`).
    pub fn scratch_bytes(&self) -> usize {
        let Shape { batch, seq, n_head, .. } = self.shape;
        Self::scratch_bytes_for(batch, seq, n_head)
    }

    /// [`scratch_bytes`](Self::scratch_bytes) of a `FlashAttention` of this shape: `delta [B, NH,
    /// T]` f32.
    pub fn scratch_bytes_for(batch: usize, seq: usize, n_head: usize) -> usize {
        batch * n_head * seq * size_of::<f32>()
    }

    /// `out = attention(qkv)`, and `lse` = the log-sum-exp `log Σ_k exp(scale · q·k)` of each
    /// query row, which [`backward`](Self::backward) reads.
    ///
    /// `qkv [B, T, C + 2·n_kv_head·hs]` and `out [B, T, C]` are 16-byte aligned bf16 slices of this GPU holding
    /// at least those many elements, `lse [B, NH, T]` a 4-byte aligned f32 one
    /// ([`lse_len`](Self::lse_len) elements), or an error says which is not; `out` and `lse`
    /// should overlap nothing else. Ordering them against other streams is the caller's (the
    /// device contract).
    pub fn forward(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        out: DeviceSliceMut<'_, bf16>,
        lse: DeviceSliceMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        self.forward_within(stream, qkv, None, out, lse)
    }

    /// [`forward`](Self::forward) of packed rows: each query attends its own document's keys
    /// only, `t − positions[b, t] ..= t`, its log-sum-exp over them (the CPU twin's
    /// [`flash_attention_forward_packed`](crate::kernels::attention::flash_attention_forward_packed)).
    /// `positions [B, T]` (a u32 slice of this GPU, at least that long, 4-byte aligned) holds each
    /// token's position in its document, each 0 or one more than the previous token's (checked
    /// where the batch is set).
    pub fn forward_packed(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        positions: DeviceSlice<'_, u32>,
        out: DeviceSliceMut<'_, bf16>,
        lse: DeviceSliceMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        self.forward_within(stream, qkv, Some(positions), out, lse)
    }

    fn forward_within(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        positions: Option<DeviceSlice<'_, u32>>,
        out: DeviceSliceMut<'_, bf16>,
        lse: DeviceSliceMut<'_, f32>,
    ) -> Result<(), DeviceError> {
        let (rows_len, lse_len) =
            (self.shape.batch * self.shape.seq * self.shape.c, self.lse_len());
        self.check(("qkv", qkv.len(), qkv.is_on(&self.device)), self.shape.qkv_len())?;
        self.check(("out", out.len(), out.is_on(&self.device)), rows_len)?;
        self.check(("lse", lse.len(), lse.is_on(&self.device)), lse_len)?;
        self.check_positions(positions)?;
        check_aligned(&[
            ("qkv", qkv.address(), ALIGNMENT),
            ("out", out.address(), ALIGNMENT),
            ("lse", lse.address(), LSE_ALIGNMENT),
        ])?;
        let Shape { seq, n_head, n_kv_head, head_size, .. } = self.shape;
        let params = KernelParams::new().slice_mut(out).slice_mut(lse).slice(qkv);
        let params = match positions {
            Some(positions) => params.slice(positions),
            None => params,
        };
        let params =
            params.u32(seq as u32).u32(n_head as u32).u32(n_kv_head as u32).f32(self.shape.scale());
        // SAFETY: the parameters match `flash_forward_{hs}(bf16_t*, float*, const bf16_t*, u32,
        // u32, u32, float)` with `hs` the head size the function was loaded for, or with
        // positions `flash_forward_packed_{hs}(bf16_t*, float*, const bf16_t*, const u32*, u32,
        // u32, u32, float)`. Block (i, h, b) reads rows 64i .. 64i+63 below `T` of sequence `b` of
        // qkv (query head h's columns and those of its key/value head `h / (NH / NKV)`, which
        // `Shape::new` checked divides; qkv holds `B·T·W` elements, checked above), and of
        // positions (`B·T`, checked; a position only narrows which of those key rows are
        // visited, from the key block of a row's document start on, never past the query block),
        // writes the same rows of out (`B·T·C`) and of lse (`B·NH·T`), both the caller's. Every
        // bf16 address is 16-byte aligned (checked above) and `C` and `W` are multiples of 8, so
        // every 16-byte access is too; lse is 4-byte aligned (checked), positions u32s of a u32
        // slice. The shared memory asked for is what the kernel's tiles take, allowed in
        // `Kernels::load`.
        unsafe {
            self.device.launch(
                stream,
                &self.kernels.tiles(positions.is_some()).forward,
                self.shape.tile_grid(n_head),
                TILE_THREADS,
                forward_shared_bytes(head_size) as u32,
                &params,
            )
        }
    }

    /// Overwrites `dqkv` (qkv's shape) with d(loss)/d(qkv), given `dout [B, T, C]` = d(loss)/d(out)
    /// and the `qkv`, `out` and `lse` of the [`forward`](Self::forward) that made `out`.
    ///
    /// The same requirements as [`forward`](Self::forward) (`dqkv` as `qkv`, `dout` as `out`);
    /// `dqkv` should overlap nothing else.
    pub fn backward(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        out: DeviceSlice<'_, bf16>,
        dout: DeviceSlice<'_, bf16>,
        lse: DeviceSlice<'_, f32>,
        dqkv: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let tensors = BackwardTensors { dqkv, qkv, dout, lse, positions: None };
        self.backward_within(stream, out, tensors)
    }

    /// [`backward`](Self::backward) of [`forward_packed`](Self::forward_packed), with the same
    /// `positions`.
    #[allow(clippy::too_many_arguments, reason = "backward's tensors and the positions")]
    pub fn backward_packed(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        out: DeviceSlice<'_, bf16>,
        dout: DeviceSlice<'_, bf16>,
        lse: DeviceSlice<'_, f32>,
        positions: DeviceSlice<'_, u32>,
        dqkv: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let tensors = BackwardTensors { dqkv, qkv, dout, lse, positions: Some(positions) };
        self.backward_within(stream, out, tensors)
    }

    fn backward_within(
        &self,
        stream: &CudaStream,
        out: DeviceSlice<'_, bf16>,
        tensors: BackwardTensors<'_>,
    ) -> Result<(), DeviceError> {
        let BackwardTensors { dqkv, qkv, dout, lse, positions } = tensors;
        let (rows_len, lse_len) =
            (self.shape.batch * self.shape.seq * self.shape.c, self.lse_len());
        let qkv_len = self.shape.qkv_len();
        self.check(("qkv", qkv.len(), qkv.is_on(&self.device)), qkv_len)?;
        self.check(("out", out.len(), out.is_on(&self.device)), rows_len)?;
        self.check(("dout", dout.len(), dout.is_on(&self.device)), rows_len)?;
        self.check(("lse", lse.len(), lse.is_on(&self.device)), lse_len)?;
        self.check(("dqkv", dqkv.len(), dqkv.is_on(&self.device)), qkv_len)?;
        self.check_positions(positions)?;
        check_aligned(&[
            ("qkv", qkv.address(), ALIGNMENT),
            ("out", out.address(), ALIGNMENT),
            ("dout", dout.address(), ALIGNMENT),
            ("lse", lse.address(), LSE_ALIGNMENT),
            ("dqkv", dqkv.address(), ALIGNMENT),
        ])?;
        self.preprocess(stream, out, dout)?;
        let addresses = tensors;
        let Shape { n_head, n_kv_head, head_size, .. } = self.shape;
        let (tiles, packed) = (self.kernels.tiles(positions.is_some()), positions.is_some());
        let dq = (&tiles.backward_dq, backward_dq_shared_bytes(head_size));
        let dkdv = (&tiles.backward_dkdv, backward_dkdv_shared_bytes(head_size, packed));
        // The dq kernel's blocks are per query head, the dk/dv kernel's per key/value head.
        self.backward_tiles(stream, dq, self.shape.tile_grid(n_head), addresses)?;
        self.backward_tiles(stream, dkdv, self.shape.tile_grid(n_kv_head), addresses)
    }

    /// An error unless a caller's tensor holds `needed` elements of this GPU.
    fn check(&self, tensor: (&str, usize, bool), needed: usize) -> Result<(), DeviceError> {
        check_tensor(tensor, needed, invalid)
    }

    /// An error unless packed rows' `positions` (if any) hold `B·T` elements of this GPU.
    fn check_positions(&self, positions: Option<DeviceSlice<'_, u32>>) -> Result<(), DeviceError> {
        let Some(positions) = positions else { return Ok(()) };
        let tokens = self.shape.batch * self.shape.seq;
        self.check(("positions", positions.len(), positions.is_on(&self.device)), tokens)
    }

    /// `delta = rowsum(dout ∘ out)` per head.
    fn preprocess(
        &self,
        stream: &CudaStream,
        out: DeviceSlice<'_, bf16>,
        dout: DeviceSlice<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let Shape { batch, seq, n_head, head_size, .. } = self.shape;
        let params = KernelParams::new()
            .ptr(&self.delta, 0)
            .slice(out)
            .slice(dout)
            .u32(seq as u32)
            .u32(n_head as u32)
            .u32(head_size as u32);
        // SAFETY: the parameters match `flash_backward_preprocess(float*, const bf16_t*, const
        // bf16_t*, u32, u32, u32)`. Block `r` (one per token row `b·T + t`) reads row `r` of out
        // and dout (`C` elements each; `backward` checked they hold `B·T·C`) and writes `delta[b, ·, t]`
        // (ours, `B·NH·T`). The addresses are 16-byte aligned and `hs` even, so the kernel's
        // 4-byte loads are aligned.
        unsafe {
            let rows = (batch * seq) as u32;
            self.device.launch(stream, &self.kernels.preprocess, rows, TILE_THREADS, 0, &params)
        }
    }

    /// One of the two backward tile kernels, `flash_backward_dq_{hs}` or
    /// `flash_backward_dkdv_{hs}` (which take the same parameters), or one of their packed forms
    /// (with the positions after delta), with its shared memory and grid.
    fn backward_tiles(
        &self,
        stream: &CudaStream,
        (function, shared_bytes): (&CudaFunction, usize),
        grid: Dim3,
        addresses: BackwardTensors<'_>,
    ) -> Result<(), DeviceError> {
        let BackwardTensors { dqkv, qkv, dout, lse, positions } = addresses;
        let Shape { seq, n_head, n_kv_head, .. } = self.shape;
        let params = KernelParams::new()
            .slice_mut(dqkv)
            .slice(qkv)
            .slice(dout)
            .slice(lse)
            .ptr(&self.delta, 0);
        let params = match positions {
            Some(positions) => params.slice(positions),
            None => params,
        };
        let params =
            params.u32(seq as u32).u32(n_head as u32).u32(n_kv_head as u32).f32(self.shape.scale());
        // SAFETY: the parameters match `flash_backward_{dq,dkdv}_{hs}(bf16_t*, const bf16_t*,
        // const bf16_t*, const float*, const float*, u32, u32, u32, float)`, `hs` the head size
        // both were loaded for, or with positions their `_packed_{hs}` forms, which take `const
        // u32* positions` after delta and read the elements of sequence `b` below `T` of it
        // (`B·T`, checked in `backward_within`; a position only narrows which blocks are visited
        // and which entries are masked, inside the rows named below). Block (x, h, b) of the dq kernel (`h` a query head) or of the
        // dk/dv kernel (`h` a key/value head, looping over the query heads of its group) reads
        // rows below `T` of sequence `b` of qkv and dout (those heads' columns; `backward`
        // checked they hold `B·T·W` and `B·T·C` elements), of lse (the caller's, `B·NH·T`,
        // checked) and of our delta (`B·NH·T`, written by `preprocess` earlier on this stream).
        // It writes rows 64x .. 64x+63 below `T` of head h's columns of dqkv (`B·T·W`, the
        // caller's): of the q part in the dq kernel, of the k and v parts in the dk/dv kernel,
        // which no other block of either writes (one dk/dv block per key/value head). Alignment
        // as in `forward`; the shared memory is what the kernel's tiles take, allowed in
        // `Kernels::load`; `grid` is `tile_grid` of the kernel's heads (`backward`).
        unsafe {
            let shared_bytes = shared_bytes as u32;
            self.device.launch(stream, function, grid, TILE_THREADS, shared_bytes, &params)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        ALIGNMENT, HEAD_SIZES, LSE_ALIGNMENT, Shape, backward_dkdv_shared_bytes,
        backward_dq_shared_bytes, check_aligned, forward_shared_bytes, kernel_names,
    };
    use crate::kernels::AttentionShape;

    #[test]
    fn only_the_compiled_head_sizes_and_sizes_that_fit_the_kernels_are_accepted() {
        let mha = |t, c, n_head| AttentionShape::multi_head(t, c, n_head);
        assert_eq!(Shape::for_flash(2, mha(37, 128, 2)).unwrap().head_size, 64);
        assert_eq!(Shape::for_flash(8, mha(1024, 2048, 16)).unwrap().head_size, 128);
        let refused = [(1, 8, 96, 2), (1, 8, 768, 3), (0, 8, 128, 2), (1, 8, 130, 2)];
        for (batch, seq, c, n_head) in refused {
            let shape = mha(seq, c, n_head);
            assert!(Shape::for_flash(batch, shape).is_err(), "{batch} {seq} {c} {n_head}");
        }
        let message = Shape::for_flash(1, mha(8, 96, 2)).unwrap_err().to_string();
        assert!(message.contains("head size 48"), "{message}");
        assert!(Shape::for_flash(1 << 16, mha(1, 128, 2)).is_err(), "batch beyond the grid's z");
        assert!(Shape::for_flash(1, mha(1 << 32, 128, 2)).is_err(), "sequence beyond 32 bits");
    }

    /// Grouped-query shapes are taken when the key/value heads divide the query heads, and the
    /// qkv row then holds `C + 2·n_kv_head·hs` channels.
    #[test]
    fn grouped_query_shapes_need_key_value_heads_that_divide_the_query_heads() {
        let gqa = |n_head, n_kv_head| AttentionShape { t: 65, c: 64 * n_head, n_head, n_kv_head };
        let shape = Shape::for_flash(2, gqa(6, 2)).unwrap();
        assert_eq!((shape.group(), shape.kv_width(), shape.qkv_width()), (3, 128, 384 + 256));
        assert_eq!(Shape::for_flash(1, gqa(8, 1)).unwrap().qkv_len(), 65 * (512 + 128));
        for (n_head, n_kv_head) in [(6, 4), (4, 0), (2, 4)] {
            let message = Shape::for_flash(1, gqa(n_head, n_kv_head)).unwrap_err().to_string();
            assert!(message.contains("must divide the query heads"), "{message}");
        }
    }

    #[test]
    fn bf16_tensors_must_be_16_byte_aligned_and_lse_4_byte_aligned() {
        let qkv = ("qkv", 0x1000, ALIGNMENT);
        assert!(check_aligned(&[qkv, ("out", 0x2010, ALIGNMENT), ("lse", 0x3004, 4)]).is_ok());
        let message = check_aligned(&[qkv, ("out", 0x2008, ALIGNMENT)]).unwrap_err().to_string();
        assert!(message.contains("out at 0x2008 is not 16-byte aligned"), "{message}");
        let message = check_aligned(&[qkv, ("lse", 0x3002, LSE_ALIGNMENT)]).unwrap_err();
        assert!(message.to_string().contains("lse at 0x3002 is not 4-byte"), "{message}");
    }

    /// An H100/H200 SM offers 227 KiB of shared memory to one block, an A100's 163 KiB.
    #[test]
    fn the_tiles_fit_the_shared_memory_of_an_sm80_block() {
        for head_size in HEAD_SIZES {
            for bytes in [
                forward_shared_bytes(head_size),
                backward_dq_shared_bytes(head_size),
                backward_dkdv_shared_bytes(head_size, false),
                backward_dkdv_shared_bytes(head_size, true),
            ] {
                assert!(bytes <= 163 * 1024, "{head_size}: {bytes}");
            }
        }
        assert_eq!(forward_shared_bytes(128), 52_224);
        assert_eq!(backward_dq_shared_bytes(128), 69_632);
        assert_eq!(backward_dkdv_shared_bytes(128, false), 70_144);
        assert_eq!(backward_dkdv_shared_bytes(128, true), 70_400);
    }

    /// Three tile kernels per head size, plain and packed, and the preprocess kernel, no name
    /// twice.
    #[test]
    fn every_kernel_is_named_once() {
        let mut names = kernel_names();
        assert_eq!(names.len(), 6 * HEAD_SIZES.len() + 1);
        assert!(names.contains(&"flash_backward_dq_128".to_string()), "{names:?}");
        assert!(names.contains(&"flash_backward_dkdv_packed_64".to_string()), "{names:?}");
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 6 * HEAD_SIZES.len() + 1);
    }
}
