//! Causal attention on the GPU, llm.c's way: the heads are gathered into head-major tensors, the
//! two products of each direction are cuBLASLt strided-batched matmuls over the
//! `batch · n_kv_head` key/value heads, and the causal softmax (and its backward) is a row kernel
//! of `kernels/attention.cu`.
//!
//! The maths and the layouts are those of [`crate::kernels::attention`]: `qkv [B, T, W]` holds
//! `[q | k | v]`, `W = C + 2·KV` with `KV = n_kv_head · hs`, query head `h` at columns `h·hs ..`
//! and key/value head `j` at columns `C + j·hs ..` and `C + KV + j·hs ..`; query head `h` attends
//! with key/value head `h / G`, `G = n_head / n_kv_head` the group (multi-head attention is
//! `G = 1`, `W = 3C`). `att [B, NH, T, T]` holds the softmax weights with the masked entries zero,
//! `out [B, T, C]`. Every tensor is bf16; the matmuls accumulate in fp32 and the softmax runs in
//! fp32.
//!
//! Grouped-query attention costs no kernel of its own: the query heads of a group are adjacent,
//! so head-major q `[B, NH, T, hs]` is `[B, n_kv_head, G·T, hs]`, and one product per key/value
//! head with `G·T` rows covers its whole group; the scores `[B, n_kv_head, G·T, T]` are
//! `[B, NH, T, T]`, and row `r` of them belongs to query `r % T` (the causal mask of the softmax
//! kernels). In backward the products with the group on their inner dimension (`dv`, `dk`) sum
//! over the group's query heads.
//!
//! Forward, per key/value head (row-major, `hs` the head size):
//!
//! ```text
//! q       [G·T, hs] = the group's query heads of qkv;  k, v [T, hs] its key/value head
//! scores  [G·T, T]  = q · kᵀ
//! scores            = causal_softmax(scale · scores)   (in place; zeros above the diagonal) → att
//! y       [G·T, hs] = scores · v                       → scattered into out
//! ```
//!
//! Backward, with `dy` the heads of `dout`:
//!
//! ```text
//! scores  = att                                      (a copy)
//! dv      = scoresᵀ · dy                             ([T, hs]: summed over the group)
//! scores  = dy · vᵀ                                  (d loss / d att)
//! scores  = scale · att ⊙ (scores − rowsum(att ⊙ scores))   (in place: d loss / d raw scores)
//! dq      = scores · k
//! dk      = scoresᵀ · q                              → dq, dk, dv scattered into dqkv
//! ```
//!
//! Every matmul operand is a buffer of ours: cuBLASLt operands are [`Operand`]s made from a whole
//! [`CudaBuffer`] of ours, while the caller's tensors come as [`DeviceSlice`]s of theirs. So the scores live in our own
//! `scores` scratch of att's size; the softmax writes the weights both there and into the
//! caller's `att`, and backward copies `att` into it. (With operands made from addresses, att
//! itself could hold the scores and `datt_scratch` their gradient: forward would save one write of
//! att, backward one copy, and the scratch would shrink by att's size.)
//!
//! The head-major scratch is reused: `dq` overwrites `dy`, `dk` overwrites `k` (read only by the
//! product before).
//!
//! Packed rows (several documents per row, [`crate::plan::PlanOptions::packed`]) go through
//! [`forward_packed`](CudaAttention::forward_packed) and
//! [`backward_packed`](CudaAttention::backward_packed), which take each token's position in its
//! document, `positions [B, T]` (u32): the same products, and the softmax kernels' `_packed` forms,
//! which mask the keys before the query's document (`t1 − positions[t1]`) as they mask the future
//! ones, so those weights and their gradients are zero and the products carry nothing across a
//! document boundary. The plain forms launch exactly what they launched before packing existed.

use std::sync::Arc;

use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::{Blas, Matmul, MatmulOperands, Operand};
use zeroflow_device::cuda::{
    CudaBuffer, CudaFunction, CudaStream, DeviceSlice, DeviceSliceMut, Dim3, KernelParams,
};
use zeroflow_device::{CudaDevice, Device, DeviceError};

use super::attention_shape::{Shape, check_tensor, to_u32};
use crate::kernels::AttentionShape;

/// The CUDA source of the row kernels.
pub const SOURCE: &str = include_str!("../../kernels/attention.cu");

/// The widths (bf16 values per load and store) the kernels are compiled for, widest first.
const PACK_WIDTHS: [usize; 4] = [8, 4, 2, 1];

/// Threads per block of the softmax kernels: one warp per row of `att`.
const SOFTMAX_THREADS: u32 = 256;

/// Threads per block, and at most so many blocks, of the grid-stride copy.
const COPY_THREADS: u32 = 256;
const COPY_MAX_BLOCKS: usize = 8192;

/// Causal self-attention (multi-head or grouped-query) for one (batch, [`AttentionShape`]), with
/// its scratch allocated once.
#[derive(Debug)]
pub struct CudaAttention {
    device: CudaDevice,
    blas: Arc<Blas>,
    shape: Shape,
    products: Products,
    kernels: Kernels,
    /// Head-major scratch: the query heads `q` and the output heads `y` (forward) or `dy`
    /// (backward), `[batch, n_head, seq, head_size]`; the key/value heads `k`, `v` and `dv`,
    /// `[batch, n_kv_head, seq, head_size]`. See the module documentation for how backward reuses
    /// them.
    q: CudaBuffer<bf16>,
    k: CudaBuffer<bf16>,
    v: CudaBuffer<bf16>,
    y: CudaBuffer<bf16>,
    dv: CudaBuffer<bf16>,
    /// `[batch, n_head, seq, seq]`: the scores and then the weights (forward); a copy of att and
    /// then the gradient of the scores (backward).
    scores: CudaBuffer<bf16>,
}

/// The products of one key/value head, row-major (`T` the sequence, `hs` the head size, `G·T` the
/// query rows of its group, `T` with multi-head attention), as [`Matmul::row_major`] problems.
#[derive(Clone, Copy, Debug)]
struct Products {
    /// `[G·T, T] = x[G·T, hs] · y[T, hs]ᵀ`: the scores `q · kᵀ`, and the gradient of att
    /// `dy · vᵀ`.
    x_yt: Matmul,
    /// `[G·T, hs] = x[G·T, T] · y[T, hs]`: the output `att · v`, and `dq = dscores · k`.
    x_y: Matmul,
    /// `[T, hs] = x[G·T, T]ᵀ · y[G·T, hs]`: `dv = attᵀ · dy` and `dk = dscoresᵀ · q`, each a sum
    /// over the group.
    xt_y: Matmul,
}

impl Products {
    fn new(shape: Shape) -> Self {
        let Shape { seq, head_size, .. } = shape;
        let query_rows = shape.group() * seq;
        Products {
            x_yt: Matmul::row_major(query_rows, seq, head_size, false, true),
            x_y: Matmul::row_major(query_rows, head_size, seq, false, false),
            xt_y: Matmul::row_major(seq, head_size, query_rows, true, false),
        }
    }
}

/// The kernels of `attention.cu`, each compiled for every width of [`PACK_WIDTHS`] (same order).
#[derive(Debug)]
struct Kernels {
    rows_to_heads: Vec<CudaFunction>,
    heads_to_rows: Vec<CudaFunction>,
    softmax_forward: Vec<CudaFunction>,
    softmax_backward: Vec<CudaFunction>,
    softmax_forward_packed: Vec<CudaFunction>,
    softmax_backward_packed: Vec<CudaFunction>,
    copy: Vec<CudaFunction>,
}

impl Kernels {
    fn load(device: &CudaDevice) -> Result<Self, DeviceError> {
        let module = device.load_module("attention", SOURCE)?;
        let all = |kernel: &str| -> Result<Vec<CudaFunction>, DeviceError> {
            PACK_WIDTHS.iter().map(|&width| module.function(&kernel_name(kernel, width))).collect()
        };
        let [
            rows_to_heads,
            heads_to_rows,
            softmax_forward,
            softmax_backward,
            softmax_forward_packed,
            softmax_backward_packed,
            copy,
        ] = KERNELS;
        Ok(Kernels {
            rows_to_heads: all(rows_to_heads)?,
            heads_to_rows: all(heads_to_rows)?,
            softmax_forward: all(softmax_forward)?,
            softmax_backward: all(softmax_backward)?,
            softmax_forward_packed: all(softmax_forward_packed)?,
            softmax_backward_packed: all(softmax_backward_packed)?,
            copy: all(copy)?,
        })
    }
}

/// The kernels of [`SOURCE`], each exported once per pack width as `{kernel}_{width}`.
const KERNELS: [&str; 7] = [
    "rows_to_heads",
    "heads_to_rows",
    "causal_softmax_forward",
    "causal_softmax_backward",
    "causal_softmax_forward_packed",
    "causal_softmax_backward_packed",
    "copy_packs",
];

fn kernel_name(kernel: &str, width: usize) -> String {
    format!("{kernel}_{width}")
}

/// Every kernel name [`CudaAttention`] loads from [`SOURCE`].
pub fn kernel_names() -> Vec<String> {
    KERNELS
        .iter()
        .flat_map(|kernel| PACK_WIDTHS.iter().map(move |&width| kernel_name(kernel, width)))
        .collect()
}

/// The widest pack width that divides `len` and to which every address is aligned, and its index
/// in [`PACK_WIDTHS`].
fn pack_width(len: usize, addresses: &[u64]) -> (usize, usize) {
    PACK_WIDTHS
        .iter()
        .copied()
        .enumerate()
        .map(|(index, width)| (width, index))
        .find(|&(width, _)| {
            let bytes = (2 * width) as u64;
            len.is_multiple_of(width)
                && addresses.iter().all(|address| address.is_multiple_of(bytes))
        })
        .unwrap_or((1, PACK_WIDTHS.len() - 1))
}

fn invalid(reason: String) -> DeviceError {
    DeviceError::Kernel { kernel: "attention", reason }
}

impl CudaAttention {
    /// Loads the kernels and allocates the scratch ([`scratch_bytes`](Self::scratch_bytes)) for
    /// inputs of `batch` sequences of `shape` (its `t` tokens, `c` channels, `n_head` query heads
    /// and `n_kv_head` key/value heads, which must divide `n_head`).
    pub fn new(
        device: &CudaDevice,
        blas: Arc<Blas>,
        batch: usize,
        shape: AttentionShape,
    ) -> Result<Self, DeviceError> {
        let shape = Shape::new(batch, shape, invalid)?;
        shape.check_32_bit_sizes(invalid)?;
        to_u32(shape.query_rows(), "batch · heads · seq", invalid)?;
        let kernels = Kernels::load(device)?;
        let heads = || device.alloc::<bf16>(shape.heads_len());
        let kv_heads = || device.alloc::<bf16>(shape.kv_heads_len());
        Ok(CudaAttention {
            device: device.clone(),
            blas,
            shape,
            products: Products::new(shape),
            kernels,
            q: heads()?,
            k: kv_heads()?,
            v: kv_heads()?,
            y: heads()?,
            dv: kv_heads()?,
            scores: device.alloc::<bf16>(shape.att_len())?,
        })
    }

    /// Bytes of GPU memory this attention holds as scratch.
    pub fn scratch_bytes(&self) -> usize {
        let Shape { batch, seq, c, n_head, n_kv_head, .. } = self.shape;
        Self::scratch_bytes_for(batch, AttentionShape { t: seq, c, n_head, n_kv_head })
    }

    /// [`scratch_bytes`](Self::scratch_bytes) of a `CudaAttention` of this shape: two head-major
    /// `[B, T, C]` tensors (q, y), three `[B, T, n_kv_head · hs]` ones (k, v, dv) and the
    /// `[B, NH, T, T]` scores, bf16.
    pub fn scratch_bytes_for(batch: usize, shape: AttentionShape) -> usize {
        let AttentionShape { t, c, n_head, .. } = shape;
        let (heads_len, kv_heads_len) = (batch * t * c, batch * t * shape.kv_width());
        let att_len = batch * n_head * t * t;
        (2 * heads_len + 3 * kv_heads_len + att_len) * size_of::<bf16>()
    }

    /// `out = attention(qkv)`; `att` receives the softmax weights (masked entries zero).
    ///
    /// `qkv [B, T, C + 2·n_kv_head·hs]`, `out [B, T, C]` and `att [B, NH, T, T]` are bf16 slices
    /// of this GPU holding at least those many elements (an error otherwise); `out` and `att`
    /// should overlap nothing else. Ordering them against other streams is the caller's (the
    /// device contract).
    pub fn forward(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        out: DeviceSliceMut<'_, bf16>,
        att: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        self.forward_within(stream, qkv, None, out, att)
    }

    /// [`forward`](Self::forward) of packed rows: each query attends its own document's keys
    /// only, `t1 − positions[b, t1] ..= t1`, and the weights outside them are zero (the CPU
    /// twin's [`attention_forward_packed`](crate::kernels::attention::attention_forward_packed)).
    /// `positions [B, T]` (a u32 slice of this GPU, at least that long) holds each token's position
    /// in its document, each at most its index in the row (checked where the batch is set).
    pub fn forward_packed(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        positions: DeviceSlice<'_, u32>,
        out: DeviceSliceMut<'_, bf16>,
        att: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        self.forward_within(stream, qkv, Some(positions), out, att)
    }

    fn forward_within(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        positions: Option<DeviceSlice<'_, u32>>,
        out: DeviceSliceMut<'_, bf16>,
        att: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let (heads_len, att_len) = (self.shape.heads_len(), self.shape.att_len());
        self.check(("qkv", qkv.len(), qkv.is_on(&self.device)), self.shape.qkv_len())?;
        self.check(("out", out.len(), out.is_on(&self.device)), heads_len)?;
        self.check(("att", att.len(), att.is_on(&self.device)), att_len)?;
        self.check_positions(positions)?;
        let (q, k, v, y, scores) = (&self.q, &self.k, &self.v, &self.y, &self.scores);
        let Products { x_yt, x_y, .. } = self.products;
        self.split_qkv(stream, qkv)?;
        // scores = q · kᵀ (the softmax scales them).
        self.per_head(stream, x_yt, Operand::of(q, 0), Operand::of(k, 0), Operand::of(scores, 0))?;
        // scores = att = causal_softmax(scale · scores).
        self.softmax_forward(stream, att, positions)?;
        // y = att · v.
        self.per_head(stream, x_y, Operand::of(scores, 0), Operand::of(v, 0), Operand::of(y, 0))?;
        self.heads_to_rows(stream, out, self.shape.c, y, self.shape.n_head)
    }

    /// Overwrites `dqkv` (qkv's shape) with d(loss)/d(qkv), given `dout [B, T, C]` = d(loss)/d(out)
    /// and the `qkv` and `att` of the forward pass.
    ///
    /// The same requirements as [`forward`](Self::forward) (`dqkv` as `qkv`, `dout` as `out`);
    /// `dqkv` should overlap nothing else. `datt_scratch` (of att's size) is not used: the
    /// gradient of the scores lives in our own scratch (see the module documentation).
    pub fn backward(
        &self,
        stream: &CudaStream,
        dout: DeviceSlice<'_, bf16>,
        qkv: DeviceSlice<'_, bf16>,
        att: DeviceSlice<'_, bf16>,
        dqkv: DeviceSliceMut<'_, bf16>,
        datt_scratch: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let _ = datt_scratch;
        self.backward_within(stream, dout, qkv, att, None, dqkv)
    }

    /// [`backward`](Self::backward) of [`forward_packed`](Self::forward_packed), with the same
    /// `positions`: the gradients of the weights outside each query's document are zero.
    pub fn backward_packed(
        &self,
        stream: &CudaStream,
        dout: DeviceSlice<'_, bf16>,
        qkv: DeviceSlice<'_, bf16>,
        att: DeviceSlice<'_, bf16>,
        positions: DeviceSlice<'_, u32>,
        dqkv: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        self.backward_within(stream, dout, qkv, att, Some(positions), dqkv)
    }

    fn backward_within(
        &self,
        stream: &CudaStream,
        dout: DeviceSlice<'_, bf16>,
        qkv: DeviceSlice<'_, bf16>,
        att: DeviceSlice<'_, bf16>,
        positions: Option<DeviceSlice<'_, u32>>,
        dqkv: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let (heads_len, att_len) = (self.shape.heads_len(), self.shape.att_len());
        self.check(("dout", dout.len(), dout.is_on(&self.device)), heads_len)?;
        let qkv_len = self.shape.qkv_len();
        self.check(("qkv", qkv.len(), qkv.is_on(&self.device)), qkv_len)?;
        self.check(("att", att.len(), att.is_on(&self.device)), att_len)?;
        self.check(("dqkv", dqkv.len(), dqkv.is_on(&self.device)), qkv_len)?;
        self.check_positions(positions)?;
        let Shape { c, n_head, n_kv_head, .. } = self.shape;
        let (width, kv_width) = (self.shape.qkv_width(), self.shape.kv_width());
        let (q, k, v, dy, dv, scores) =
            (&self.q, &self.k, &self.v, &self.y, &self.dv, &self.scores);
        let Products { x_yt, x_y, xt_y } = self.products;
        self.split_qkv(stream, qkv)?;
        self.rows_to_heads(stream, dy, dout, c, n_head)?;
        // dv = attᵀ · dy, through a copy of att in our scratch.
        self.copy_att(stream, att)?;
        self.per_head(
            stream,
            xt_y,
            Operand::of(scores, 0),
            Operand::of(dy, 0),
            Operand::of(dv, 0),
        )?;
        // scores = dy · vᵀ: the gradient of att; then, in place, the gradient of the raw scores.
        self.per_head(stream, x_yt, Operand::of(dy, 0), Operand::of(v, 0), Operand::of(scores, 0))?;
        self.softmax_backward(stream, att, positions)?;
        // dq = dscores · k, over dy (read by nothing after the product above).
        let dq = dy;
        self.per_head(stream, x_y, Operand::of(scores, 0), Operand::of(k, 0), Operand::of(dq, 0))?;
        // dk = dscoresᵀ · q, over k (read by nothing after dq).
        let dk = k;
        self.per_head(stream, xt_y, Operand::of(scores, 0), Operand::of(q, 0), Operand::of(dk, 0))?;
        self.heads_to_rows(stream, dqkv, width, dq, n_head)?;
        self.heads_to_rows(stream, dqkv.skip(c), width, dk, n_kv_head)?;
        self.heads_to_rows(stream, dqkv.skip(c + kv_width), width, dv, n_kv_head)
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

    /// Gathers the heads of q, k and v from `qkv [B, T, W]`.
    fn split_qkv(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let Shape { c, n_head, n_kv_head, .. } = self.shape;
        let (width, kv_width) = (self.shape.qkv_width(), self.shape.kv_width());
        self.rows_to_heads(stream, &self.q, qkv, width, n_head)?;
        self.rows_to_heads(stream, &self.k, qkv.skip(c), width, n_kv_head)?;
        self.rows_to_heads(stream, &self.v, qkv.skip(c + kv_width), width, n_kv_head)
    }

    /// `product` (a [`Matmul::row_major`] product `out = op(x) · op(y)` of one key/value head
    /// and its group of query heads) for each of the `batch · n_kv_head` key/value heads. Every
    /// operand is contiguous per key/value head (a group's query heads are adjacent), so its
    /// batch stride is its size.
    fn per_head(
        &self,
        stream: &CudaStream,
        product: Matmul,
        x: Operand<'_>,
        y: Operand<'_>,
        out: Operand<'_>,
    ) -> Result<(), DeviceError> {
        let heads = self.shape.batch * self.shape.n_kv_head;
        // Row-major `out[rows, cols] = op(x)[rows, inner] · op(y)[inner, cols]` is the column-major
        // problem m = cols, n = rows, k = inner.
        let (rows, cols, inner) = (product.n as i64, product.m as i64, product.k as i64);
        let product = product.batched_row_major(heads, rows * inner, inner * cols, rows * cols);
        self.blas.matmul(stream, &product, MatmulOperands::row_major(x, y, out))
    }

    /// Gathers the `heads` heads of a row-major `[B, T, ·]` tensor whose head `h` is at columns
    /// `h·hs ..` from `rows` (row stride `row_stride` elements) into head-major `into`
    /// (`[B, heads, T, hs]`).
    fn rows_to_heads(
        &self,
        stream: &CudaStream,
        into: &CudaBuffer<bf16>,
        rows: DeviceSlice<'_, bf16>,
        row_stride: usize,
        heads: usize,
    ) -> Result<(), DeviceError> {
        let (width, index) = pack_width(self.shape.head_size, &[rows.address()]);
        let function = &self.kernels.rows_to_heads[index];
        let params = KernelParams::new().ptr(into, 0).slice(rows);
        let params = self.heads_params(params, row_stride, heads);
        // SAFETY: the parameters match `rows_to_heads_*(bf16_t*, const bf16_t*, u32, u32, u32,
        // u32)`. Block `r` of the grid (one per row `b·T + t`) reads columns `0..heads·hs` of row
        // `r` of `rows`, which holds `B·T` rows of `row_stride = W` elements, those columns
        // inside each (`forward` and `backward` checked the caller's slices hold `B·T·W`; the
        // k and v parts start `C` and `C + KV` into qkv and are `KV = n_kv_head·hs` wide); it
        // writes row `t` of every head `(b, ·)` of `into`, a buffer of `B·T·heads·hs` elements
        // (q and y of `B·T·C`, k, v and dv of `B·T·KV`, and the callers pass their head counts).
        // Both addresses are aligned to the pack width (`pack_width`; our buffers are 256-byte
        // aligned, and every head starts at a multiple of `hs`).
        unsafe {
            self.device.launch(
                stream,
                function,
                self.rows_grid(),
                self.rows_block(width, heads),
                0,
                &params,
            )
        }
    }

    /// The inverse of [`rows_to_heads`](Self::rows_to_heads): writes columns `h·hs ..` of every
    /// row of `rows` for each of the `heads` heads of head-major `from`.
    fn heads_to_rows(
        &self,
        stream: &CudaStream,
        rows: DeviceSliceMut<'_, bf16>,
        row_stride: usize,
        from: &CudaBuffer<bf16>,
        heads: usize,
    ) -> Result<(), DeviceError> {
        let (width, index) = pack_width(self.shape.head_size, &[rows.address()]);
        let function = &self.kernels.heads_to_rows[index];
        let params = KernelParams::new().slice_mut(rows).ptr(from, 0);
        let params = self.heads_params(params, row_stride, heads);
        // SAFETY: as in `rows_to_heads`, with the roles of the two tensors swapped: each block
        // writes columns `0..heads·hs` of its row of `rows` (the caller's) and reads `from` (ours).
        unsafe {
            self.device.launch(
                stream,
                function,
                self.rows_grid(),
                self.rows_block(width, heads),
                0,
                &params,
            )
        }
    }

    fn heads_params(&self, params: KernelParams, row_stride: usize, heads: usize) -> KernelParams {
        let Shape { seq, head_size, .. } = self.shape;
        // The sizes fit u32: checked in `new` (`row_stride ≤ W`, `T ≤ B·T`, `heads ≤ hs·heads ≤
        // W`, `hs ≤ C`).
        params.u32(row_stride as u32).u32(seq as u32).u32(heads as u32).u32(head_size as u32)
    }

    /// One block per token row.
    fn rows_grid(&self) -> Dim3 {
        Dim3::from((self.shape.batch * self.shape.seq) as u32)
    }

    /// Enough threads for one pack each of a row's `heads` heads (`heads·hs / width` packs),
    /// whole warps, at most 256.
    fn rows_block(&self, width: usize, heads: usize) -> Dim3 {
        let packs = heads * self.shape.head_size / width;
        Dim3::from(packs.next_multiple_of(32).min(256) as u32)
    }

    /// The forward causal softmax: the raw scores in our `scores` in place, and the weights into
    /// the caller's `att`; with `positions`, the packed form.
    fn softmax_forward(
        &self,
        stream: &CudaStream,
        att: DeviceSliceMut<'_, bf16>,
        positions: Option<DeviceSlice<'_, u32>>,
    ) -> Result<(), DeviceError> {
        let (_, index) = pack_width(self.shape.seq, &[att.address()]);
        let params = KernelParams::new().ptr(&self.scores, 0).slice_mut(att);
        let kernels = &self.kernels;
        match positions {
            None => self.softmax(stream, &kernels.softmax_forward[index], params),
            Some(positions) => {
                let function = &kernels.softmax_forward_packed[index];
                self.softmax_packed(stream, function, params, positions)
            }
        }
    }

    /// The backward causal softmax: d loss / d att in our `scores` becomes d loss / d raw scores,
    /// in place, with the weights read from the caller's `att`; with `positions`, the packed form.
    fn softmax_backward(
        &self,
        stream: &CudaStream,
        att: DeviceSlice<'_, bf16>,
        positions: Option<DeviceSlice<'_, u32>>,
    ) -> Result<(), DeviceError> {
        let (_, index) = pack_width(self.shape.seq, &[att.address()]);
        let params = KernelParams::new().ptr(&self.scores, 0).slice(att);
        let kernels = &self.kernels;
        match positions {
            None => self.softmax(stream, &kernels.softmax_backward[index], params),
            Some(positions) => {
                let function = &kernels.softmax_backward_packed[index];
                self.softmax_packed(stream, function, params, positions)
            }
        }
    }

    /// One of the two causal-softmax kernels (`function`, for att's pack width), `params` holding
    /// our `scores` and the caller's `att`.
    fn softmax(
        &self,
        stream: &CudaStream,
        function: &CudaFunction,
        params: KernelParams,
    ) -> Result<(), DeviceError> {
        let params = params
            .u32(self.shape.query_rows() as u32)
            .u32(self.shape.seq as u32)
            .f32(self.shape.scale());
        // SAFETY: the parameters match `causal_softmax_{forward,backward}_*(bf16_t*, bf16_t*, u32,
        // u32, float)`. Each warp handles one of the `B·NH·T` rows of `T` elements: it reads and
        // writes that row of our `scores` (`B·NH·T·T` elements) and writes (forward) or reads
        // (backward) the same row of att, which holds as many (checked in `forward` and
        // `backward`); both are
        // aligned to the pack width (`pack_width`; ours is 256-byte aligned, and `T` is a
        // multiple of the width, so every row is).
        unsafe {
            let grid = self.softmax_grid();
            self.device.launch(stream, function, grid, SOFTMAX_THREADS, 0, &params)
        }
    }

    /// One of the two packed causal-softmax kernels (`function`, for att's pack width), `params`
    /// holding our `scores` and the caller's `att`, then `positions`.
    fn softmax_packed(
        &self,
        stream: &CudaStream,
        function: &CudaFunction,
        params: KernelParams,
        positions: DeviceSlice<'_, u32>,
    ) -> Result<(), DeviceError> {
        let params = params
            .slice(positions)
            .u32(self.shape.query_rows() as u32)
            .u32(self.shape.seq as u32)
            .u32(self.shape.n_head as u32)
            .f32(self.shape.scale());
        // SAFETY: the parameters match `causal_softmax_{forward,backward}_packed_*(bf16_t*,
        // bf16_t*, const u32*, u32, u32, u32, float)`. Each warp handles one of the `B·NH·T` rows
        // of `T` elements as the plain kernels do (see `softmax`: the same rows of our `scores`
        // and of att, the same pack-width alignment), and reads one element of positions, that of
        // its row's sequence `b = row / (NH·T)` and query `t1 = row % T`, below `B·T` (which
        // positions holds, checked in `forward_within` and `backward_within`). A position only
        // moves where the row's unmasked keys start, inside the row.
        unsafe {
            let grid = self.softmax_grid();
            self.device.launch(stream, function, grid, SOFTMAX_THREADS, 0, &params)
        }
    }

    /// Copies the caller's `att` into our `scores`.
    fn copy_att(&self, stream: &CudaStream, att: DeviceSlice<'_, bf16>) -> Result<(), DeviceError> {
        let len = self.shape.att_len();
        let (width, index) = pack_width(len, &[att.address()]);
        let function = &self.kernels.copy[index];
        let params = KernelParams::new().ptr(&self.scores, 0).slice(att).u64(len as u64);
        let blocks = len.div_ceil(width * COPY_THREADS as usize).min(COPY_MAX_BLOCKS) as u32;
        // SAFETY: the parameters match `copy_packs_*(bf16_t*, const bf16_t*, u64)`. The grid-stride
        // loop copies elements `0..len` from att (checked in `backward` to hold them) into our
        // `scores` (exactly `len`), two distinct allocations; both are aligned to the width.
        unsafe { self.device.launch(stream, function, blocks, COPY_THREADS, 0, &params) }
    }

    fn softmax_grid(&self) -> Dim3 {
        let rows_per_block = (SOFTMAX_THREADS / 32) as usize;
        Dim3::from(self.shape.query_rows().div_ceil(rows_per_block) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::{CudaAttention, Products, Shape, invalid, pack_width};
    use crate::kernels::AttentionShape;

    /// With groups of query heads the key/value scratch (k, v, dv) shrinks to the key/value
    /// heads' width, while q, y and the scores keep the query heads'.
    #[test]
    fn grouped_query_scratch_holds_the_key_value_heads_only() {
        let (batch, t) = (2, 37);
        let mha = CudaAttention::scratch_bytes_for(batch, AttentionShape::multi_head(t, 384, 6));
        let gqa = AttentionShape { t, c: 384, n_head: 6, n_kv_head: 2 };
        let kv_saved = 3 * batch * t * (384 - 128) * size_of::<u16>();
        assert_eq!(CudaAttention::scratch_bytes_for(batch, gqa), mha - kv_saved);
        let heads = 2 * batch * t * 384 + 3 * batch * t * 128 + batch * 6 * t * t;
        assert_eq!(CudaAttention::scratch_bytes_for(batch, gqa), heads * size_of::<u16>());
    }

    /// Each product runs once per key/value head over the `group · T` query rows of its group;
    /// with multi-head attention (a group of one) they are the per-head products of `T` rows.
    #[test]
    fn the_products_cover_a_whole_group_of_query_heads() {
        let gqa = Shape::new(2, AttentionShape { t: 37, c: 384, n_head: 6, n_kv_head: 2 }, invalid)
            .unwrap();
        let Products { x_yt, x_y, xt_y } = Products::new(gqa);
        // Column-major m × n: row-major rows are n, columns m.
        assert_eq!((x_yt.n, x_yt.m, x_yt.k), (3 * 37, 37, 64));
        assert_eq!((x_y.n, x_y.m, x_y.k), (3 * 37, 64, 37));
        assert_eq!((xt_y.n, xt_y.m, xt_y.k), (37, 64, 3 * 37));
        let mha = Shape::new(2, AttentionShape::multi_head(37, 384, 6), invalid).unwrap();
        let Products { x_yt, .. } = Products::new(mha);
        assert_eq!((x_yt.n, x_yt.m, x_yt.k), (37, 37, 64));
        let refused =
            Shape::new(2, AttentionShape { t: 37, c: 384, n_head: 6, n_kv_head: 4 }, invalid);
        assert!(refused.unwrap_err().to_string().contains("must divide the query heads"));
    }

    #[test]
    fn pack_width_is_the_widest_that_divides_the_length_and_every_alignment() {
        assert_eq!(pack_width(128, &[0x1000, 0x2010]), (8, 0));
        assert_eq!(pack_width(1024, &[0x1008]), (4, 1));
        assert_eq!(pack_width(50, &[0x1000]), (2, 2));
        assert_eq!(pack_width(37, &[0x1000]), (1, 3));
        assert_eq!(pack_width(128, &[0x1000, 0x1002]), (1, 3));
    }
}
