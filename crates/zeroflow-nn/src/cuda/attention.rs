//! Causal multi-head attention on the GPU, llm.c's way: the heads are gathered into head-major
//! tensors, the two products of each direction are cuBLASLt strided-batched matmuls over the
//! `batch · n_head` heads, and the causal softmax (and its backward) is a row kernel of
//! `kernels/attention.cu`.
//!
//! The maths and the layouts are those of [`crate::kernels::attention`]: `qkv [B, T, 3C]` holds
//! `[q | k | v]` with head `h` at columns `h·hs ..`, `att [B, NH, T, T]` holds the softmax weights
//! with the masked entries zero, `out [B, T, C]`. Every tensor is bf16; the matmuls accumulate in
//! fp32 and the softmax runs in fp32.
//!
//! Forward, per head (row-major, `hs` the head size):
//!
//! ```text
//! q, k, v [T, hs] = heads of qkv
//! scores  [T, T]  = q · kᵀ
//! scores          = causal_softmax(scale · scores)   (in place; zeros above the diagonal) → att
//! y       [T, hs] = scores · v                       → scattered into out
//! ```
//!
//! Backward, with `dy` the heads of `dout`:
//!
//! ```text
//! scores  = att                                      (a copy)
//! dv      = scoresᵀ · dy
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

use std::sync::Arc;

use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::{Blas, Matmul, MatmulOperands, Operand};
use zeroflow_device::cuda::{
    CudaBuffer, CudaFunction, CudaStream, DeviceSlice, DeviceSliceMut, Dim3, KernelParams,
};
use zeroflow_device::{CudaDevice, Device, DeviceError};

/// The CUDA source of the row kernels.
pub const SOURCE: &str = include_str!("../../kernels/attention.cu");

/// The widths (bf16 values per load and store) the kernels are compiled for, widest first.
const PACK_WIDTHS: [usize; 4] = [8, 4, 2, 1];

/// Threads per block of the softmax kernels: one warp per row of `att`.
const SOFTMAX_THREADS: u32 = 256;

/// Threads per block, and at most so many blocks, of the grid-stride copy.
const COPY_THREADS: u32 = 256;
const COPY_MAX_BLOCKS: usize = 8192;

/// Causal multi-head self-attention for one (batch, seq, channels, heads) shape, with its scratch
/// allocated once.
#[derive(Debug)]
pub struct CudaAttention {
    device: CudaDevice,
    blas: Arc<Blas>,
    shape: Shape,
    products: Products,
    kernels: Kernels,
    /// Head-major `[batch, n_head, seq, head_size]` scratch: the heads of q, k and v, the
    /// output heads `y` (forward) or `dy` (backward), and `dv`. See the module documentation for
    /// how backward reuses them.
    q: CudaBuffer<bf16>,
    k: CudaBuffer<bf16>,
    v: CudaBuffer<bf16>,
    y: CudaBuffer<bf16>,
    dv: CudaBuffer<bf16>,
    /// `[batch, n_head, seq, seq]`: the scores and then the weights (forward); a copy of att and
    /// then the gradient of the scores (backward).
    scores: CudaBuffer<bf16>,
}

/// The shape of one attention: `batch` sequences of `seq` tokens, `c` channels in `n_head` heads
/// of `head_size`. [`FlashAttention`](super::flash::FlashAttention)'s too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    pub(super) batch: usize,
    pub(super) seq: usize,
    pub(super) c: usize,
    pub(super) n_head: usize,
    pub(super) head_size: usize,
}

impl Shape {
    /// The shape, or an error (made by `invalid`) unless every size is positive and the channels
    /// a multiple of the heads.
    pub(super) fn new(
        batch: usize,
        seq: usize,
        c: usize,
        n_head: usize,
        invalid: fn(String) -> DeviceError,
    ) -> Result<Self, DeviceError> {
        if batch == 0 || seq == 0 || n_head == 0 || c == 0 || !c.is_multiple_of(n_head) {
            return Err(invalid(format!(
                "batch {batch}, seq {seq}, channels {c}, heads {n_head}: every size must be \
                 positive and the channels a multiple of the heads"
            )));
        }
        Ok(Shape { batch, seq, c, n_head, head_size: c / n_head })
    }

    /// An error (made by `invalid`) unless batch · seq and 3 · channels fit the kernels' 32-bit
    /// sizes (they index with 32-bit sizes and 64-bit offsets).
    pub(super) fn check_32_bit_sizes(
        &self,
        invalid: fn(String) -> DeviceError,
    ) -> Result<(), DeviceError> {
        to_u32(self.batch * self.seq, "batch · seq", invalid)?;
        to_u32(3 * self.c, "3 · channels", invalid)?;
        Ok(())
    }

    /// Elements of one head-major tensor `[batch, n_head, seq, head_size]` (= of `[B, T, C]`).
    fn heads_len(&self) -> usize {
        self.batch * self.seq * self.c
    }

    /// Elements of `att [batch, n_head, seq, seq]`.
    fn att_len(&self) -> usize {
        self.batch * self.n_head * self.seq * self.seq
    }

    /// One per (sequence, head, query): the rows of `att`, the elements of flash's `lse` and
    /// `delta`, `[B, NH, T]`.
    pub(super) fn query_rows(&self) -> usize {
        self.batch * self.n_head * self.seq
    }

    /// `1 / sqrt(head_size)`, the scale of the scores.
    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.head_size as f32).sqrt()
    }
}

/// The per-head products, row-major (`T` the sequence, `hs` the head size), as
/// [`Matmul::row_major`] problems of one head.
#[derive(Clone, Copy, Debug)]
struct Products {
    /// `[T, T] = x[T, hs] · y[T, hs]ᵀ`: the scores `q · kᵀ`, and the gradient of att `dy · vᵀ`.
    x_yt: Matmul,
    /// `[T, hs] = x[T, T] · y[T, hs]`: the output `att · v`, and `dq = dscores · k`.
    x_y: Matmul,
    /// `[T, hs] = x[T, T]ᵀ · y[T, hs]`: `dv = attᵀ · dy` and `dk = dscoresᵀ · q`.
    xt_y: Matmul,
}

impl Products {
    fn new(Shape { seq, head_size, .. }: Shape) -> Self {
        Products {
            x_yt: Matmul::row_major(seq, seq, head_size, false, true),
            x_y: Matmul::row_major(seq, head_size, seq, false, false),
            xt_y: Matmul::row_major(seq, head_size, seq, true, false),
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
    copy: Vec<CudaFunction>,
}

impl Kernels {
    fn load(device: &CudaDevice) -> Result<Self, DeviceError> {
        let module = device.load_module("attention", SOURCE)?;
        let all = |kernel: &str| -> Result<Vec<CudaFunction>, DeviceError> {
            PACK_WIDTHS.iter().map(|&width| module.function(&kernel_name(kernel, width))).collect()
        };
        let [rows_to_heads, heads_to_rows, softmax_forward, softmax_backward, copy] = KERNELS;
        Ok(Kernels {
            rows_to_heads: all(rows_to_heads)?,
            heads_to_rows: all(heads_to_rows)?,
            softmax_forward: all(softmax_forward)?,
            softmax_backward: all(softmax_backward)?,
            copy: all(copy)?,
        })
    }
}

/// The kernels of [`SOURCE`], each exported once per pack width as `{kernel}_{width}`.
const KERNELS: [&str; 5] = [
    "rows_to_heads",
    "heads_to_rows",
    "causal_softmax_forward",
    "causal_softmax_backward",
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

/// An error (made by `invalid`) unless a caller's tensor `what`, of `len` elements, holds at least
/// `needed` and lies on the attention's GPU (`on_device`).
pub(super) fn check_tensor(
    (what, len, on_device): (&str, usize, bool),
    needed: usize,
    invalid: fn(String) -> DeviceError,
) -> Result<(), DeviceError> {
    if !on_device {
        return Err(invalid(format!("{what} is memory of another GPU than the attention's")));
    }
    if len < needed {
        return Err(invalid(format!(
            "{what} holds {len} elements, fewer than the {needed} of this shape"
        )));
    }
    Ok(())
}

/// `value` as a kernel's `u32` argument, or an error (made by `invalid`) naming what is too large.
fn to_u32(
    value: usize,
    what: &str,
    invalid: fn(String) -> DeviceError,
) -> Result<u32, DeviceError> {
    u32::try_from(value)
        .map_err(|_| invalid(format!("{what} = {value} does not fit the kernels' 32-bit sizes")))
}

impl CudaAttention {
    /// Loads the kernels and allocates the scratch ([`scratch_bytes`](Self::scratch_bytes)) for
    /// inputs of `batch` sequences of `seq` tokens, `c` channels and `n_head` heads.
    ///
    /// Multi-head attention only: as many key/value heads as query heads (`qkv` rows of `3C`).
    /// Grouped-query attention has no kernels here yet (they come with the Llama family); the
    /// executor refuses such a plan with an error ([`super::check_multi_head`]), and the CPU
    /// twin ([`crate::kernels::attention`]) runs it.
    pub fn new(
        device: &CudaDevice,
        blas: Arc<Blas>,
        batch: usize,
        seq: usize,
        c: usize,
        n_head: usize,
    ) -> Result<Self, DeviceError> {
        let shape = Shape::new(batch, seq, c, n_head, invalid)?;
        shape.check_32_bit_sizes(invalid)?;
        to_u32(shape.query_rows(), "batch · heads · seq", invalid)?;
        let kernels = Kernels::load(device)?;
        let heads = || device.alloc::<bf16>(shape.heads_len());
        Ok(CudaAttention {
            device: device.clone(),
            blas,
            shape,
            products: Products::new(shape),
            kernels,
            q: heads()?,
            k: heads()?,
            v: heads()?,
            y: heads()?,
            dv: heads()?,
            scores: device.alloc::<bf16>(shape.att_len())?,
        })
    }

    /// Bytes of GPU memory this attention holds as scratch.
    pub fn scratch_bytes(&self) -> usize {
        let Shape { batch, seq, c, n_head, .. } = self.shape;
        Self::scratch_bytes_for(batch, seq, c, n_head)
    }

    /// [`scratch_bytes`](Self::scratch_bytes) of a `CudaAttention` of this shape: five head-major
    /// `[B, T, C]` tensors and the `[B, NH, T, T]` scores, bf16.
    pub fn scratch_bytes_for(batch: usize, seq: usize, c: usize, n_head: usize) -> usize {
        let (heads_len, att_len) = (batch * seq * c, batch * n_head * seq * seq);
        (5 * heads_len + att_len) * size_of::<bf16>()
    }

    /// `out = attention(qkv)`; `att` receives the softmax weights (masked entries zero).
    ///
    /// `qkv [B, T, 3C]`, `out [B, T, C]` and `att [B, NH, T, T]` are bf16 slices of this GPU
    /// holding at least those many elements (an error otherwise); `out` and `att` should overlap
    /// nothing else. Ordering them against other streams is the caller's (the device contract).
    pub fn forward(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
        out: DeviceSliceMut<'_, bf16>,
        att: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let (heads_len, att_len) = (self.shape.heads_len(), self.shape.att_len());
        self.check(("qkv", qkv.len(), qkv.is_on(&self.device)), 3 * heads_len)?;
        self.check(("out", out.len(), out.is_on(&self.device)), heads_len)?;
        self.check(("att", att.len(), att.is_on(&self.device)), att_len)?;
        let (q, k, v, y, scores) = (&self.q, &self.k, &self.v, &self.y, &self.scores);
        let Products { x_yt, x_y, .. } = self.products;
        self.split_qkv(stream, qkv)?;
        // scores = q · kᵀ (the softmax scales them).
        self.per_head(stream, x_yt, Operand::of(q, 0), Operand::of(k, 0), Operand::of(scores, 0))?;
        // scores = att = causal_softmax(scale · scores).
        self.softmax_forward(stream, att)?;
        // y = att · v.
        self.per_head(stream, x_y, Operand::of(scores, 0), Operand::of(v, 0), Operand::of(y, 0))?;
        self.heads_to_rows(stream, out, self.shape.c, y)
    }

    /// Overwrites `dqkv [B, T, 3C]` with d(loss)/d(qkv), given `dout [B, T, C]` = d(loss)/d(out)
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
        let (heads_len, att_len) = (self.shape.heads_len(), self.shape.att_len());
        self.check(("dout", dout.len(), dout.is_on(&self.device)), heads_len)?;
        self.check(("qkv", qkv.len(), qkv.is_on(&self.device)), 3 * heads_len)?;
        self.check(("att", att.len(), att.is_on(&self.device)), att_len)?;
        self.check(("dqkv", dqkv.len(), dqkv.is_on(&self.device)), 3 * heads_len)?;
        let c = self.shape.c;
        let (q, k, v, dy, dv, scores) =
            (&self.q, &self.k, &self.v, &self.y, &self.dv, &self.scores);
        let Products { x_yt, x_y, xt_y } = self.products;
        self.split_qkv(stream, qkv)?;
        self.rows_to_heads(stream, dy, dout, c)?;
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
        self.softmax_backward(stream, att)?;
        // dq = dscores · k, over dy (read by nothing after the product above).
        let dq = dy;
        self.per_head(stream, x_y, Operand::of(scores, 0), Operand::of(k, 0), Operand::of(dq, 0))?;
        // dk = dscoresᵀ · q, over k (read by nothing after dq).
        let dk = k;
        self.per_head(stream, xt_y, Operand::of(scores, 0), Operand::of(q, 0), Operand::of(dk, 0))?;
        self.heads_to_rows(stream, dqkv, 3 * c, dq)?;
        self.heads_to_rows(stream, dqkv.skip(c), 3 * c, dk)?;
        self.heads_to_rows(stream, dqkv.skip(2 * c), 3 * c, dv)
    }

    /// An error unless a caller's tensor holds `needed` elements of this GPU.
    fn check(&self, tensor: (&str, usize, bool), needed: usize) -> Result<(), DeviceError> {
        check_tensor(tensor, needed, invalid)
    }

    /// Gathers the heads of q, k and v from `qkv [B, T, 3C]`.
    fn split_qkv(
        &self,
        stream: &CudaStream,
        qkv: DeviceSlice<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let c = self.shape.c;
        self.rows_to_heads(stream, &self.q, qkv, 3 * c)?;
        self.rows_to_heads(stream, &self.k, qkv.skip(c), 3 * c)?;
        self.rows_to_heads(stream, &self.v, qkv.skip(2 * c), 3 * c)
    }

    /// `product` (a [`Matmul::row_major`] product `out = op(x) · op(y)` of one head) for each of
    /// the `batch · n_head` heads. Every operand is contiguous per head, so its batch stride is
    /// its size.
    fn per_head(
        &self,
        stream: &CudaStream,
        product: Matmul,
        x: Operand<'_>,
        y: Operand<'_>,
        out: Operand<'_>,
    ) -> Result<(), DeviceError> {
        let heads = self.shape.batch * self.shape.n_head;
        // Row-major `out[rows, cols] = op(x)[rows, inner] · op(y)[inner, cols]` is the column-major
        // problem m = cols, n = rows, k = inner.
        let (rows, cols, inner) = (product.n as i64, product.m as i64, product.k as i64);
        let product = product.batched_row_major(heads, rows * inner, inner * cols, rows * cols);
        self.blas.matmul(stream, &product, MatmulOperands::row_major(x, y, out))
    }

    /// Gathers the heads of a row-major `[B, T, ·]` tensor whose head `h` is at columns
    /// `h·hs ..` from `rows` (row stride `row_stride` elements) into head-major `heads`.
    fn rows_to_heads(
        &self,
        stream: &CudaStream,
        heads: &CudaBuffer<bf16>,
        rows: DeviceSlice<'_, bf16>,
        row_stride: usize,
    ) -> Result<(), DeviceError> {
        let (width, index) = pack_width(self.shape.head_size, &[rows.address()]);
        let function = &self.kernels.rows_to_heads[index];
        let params = self.heads_params(KernelParams::new().ptr(heads, 0).slice(rows), row_stride);
        // SAFETY: the parameters match `rows_to_heads_*(bf16_t*, const bf16_t*, u32, u32, u32,
        // u32)`. Block `r` of the grid (one per row `b·T + t`) reads columns `0..C` of row `r` of
        // `rows`, which holds `B·T` rows of `row_stride ≥ C` elements (`forward` and `backward`
        // checked the caller's slices: the k and v thirds start `C` and `2C` into qkv); it
        // writes row `t` of every head `(b, ·)` of `heads`, a buffer of `B·T·C` elements. Both
        // addresses are aligned to the pack width (`pack_width`; our buffers are 256-byte aligned).
        unsafe {
            self.device.launch(
                stream,
                function,
                self.rows_grid(),
                self.rows_block(width),
                0,
                &params,
            )
        }
    }

    /// The inverse of [`rows_to_heads`](Self::rows_to_heads): writes columns `h·hs ..` of every
    /// row of `rows` from head-major `heads`.
    fn heads_to_rows(
        &self,
        stream: &CudaStream,
        rows: DeviceSliceMut<'_, bf16>,
        row_stride: usize,
        heads: &CudaBuffer<bf16>,
    ) -> Result<(), DeviceError> {
        let (width, index) = pack_width(self.shape.head_size, &[rows.address()]);
        let function = &self.kernels.heads_to_rows[index];
        let params =
            self.heads_params(KernelParams::new().slice_mut(rows).ptr(heads, 0), row_stride);
        // SAFETY: as in `rows_to_heads`, with the roles of the two tensors swapped: each block
        // writes columns `0..C` of its row of `rows` (the caller's) and reads `heads` (ours).
        unsafe {
            self.device.launch(
                stream,
                function,
                self.rows_grid(),
                self.rows_block(width),
                0,
                &params,
            )
        }
    }

    fn heads_params(&self, params: KernelParams, row_stride: usize) -> KernelParams {
        let Shape { seq, n_head, head_size, .. } = self.shape;
        // The sizes fit u32: checked in `new` (`row_stride ≤ 3C`, `T ≤ B·T`, `hs ≤ C`).
        params.u32(row_stride as u32).u32(seq as u32).u32(n_head as u32).u32(head_size as u32)
    }

    /// One block per token row.
    fn rows_grid(&self) -> Dim3 {
        Dim3::from((self.shape.batch * self.shape.seq) as u32)
    }

    /// Enough threads for one pack each of a row (`C / width` packs), whole warps, at most 256.
    fn rows_block(&self, width: usize) -> Dim3 {
        let packs = self.shape.c / width;
        Dim3::from(packs.next_multiple_of(32).min(256) as u32)
    }

    /// The forward causal softmax: the raw scores in our `scores` in place, and the weights into
    /// the caller's `att`.
    fn softmax_forward(
        &self,
        stream: &CudaStream,
        att: DeviceSliceMut<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let (_, index) = pack_width(self.shape.seq, &[att.address()]);
        let params = KernelParams::new().ptr(&self.scores, 0).slice_mut(att);
        self.softmax(stream, &self.kernels.softmax_forward[index], params)
    }

    /// The backward causal softmax: d loss / d att in our `scores` becomes d loss / d raw scores,
    /// in place, with the weights read from the caller's `att`.
    fn softmax_backward(
        &self,
        stream: &CudaStream,
        att: DeviceSlice<'_, bf16>,
    ) -> Result<(), DeviceError> {
        let (_, index) = pack_width(self.shape.seq, &[att.address()]);
        let params = KernelParams::new().ptr(&self.scores, 0).slice(att);
        self.softmax(stream, &self.kernels.softmax_backward[index], params)
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
    use super::pack_width;

    #[test]
    fn pack_width_is_the_widest_that_divides_the_length_and_every_alignment() {
        assert_eq!(pack_width(128, &[0x1000, 0x2010]), (8, 0));
        assert_eq!(pack_width(1024, &[0x1008]), (4, 1));
        assert_eq!(pack_width(50, &[0x1000]), (2, 2));
        assert_eq!(pack_width(37, &[0x1000]), (1, 3));
        assert_eq!(pack_width(128, &[0x1000, 0x1002]), (1, 3));
    }
}
