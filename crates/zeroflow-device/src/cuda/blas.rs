//! Matrix multiplications on the GPU through cuBLASLt, with the fused epilogues GPT-2 needs.
//!
//! # Conventions
//!
//! [`Matmul`] describes one cuBLASLt call in cuBLAS's own terms, **column-major**:
//!
//! ```text
//! D[m, n] = epilogue(alpha · op(A)[m, k] · op(B)[k, n] + beta · C[m, n])
//! ```
//!
//! where `op(A) = A` stored as an m×k column-major matrix with leading dimension `lda ≥ m`, or,
//! with `trans_a`, `op(A) = Aᵀ` with A stored as k×m (`lda ≥ k`); likewise B (k×n, or n×k with
//! `trans_b`). C and D are m×n with leading dimension `ldc ≥ m`; D may be C (`d == c`, the usual
//! case) and `beta = 1` then accumulates into it.
//!
//! The model thinks **row-major** (llm.c's `out[B·T, OC] = inp[B·T, C] · weight[OC, C]ᵀ`). A
//! row-major matrix X[r, c] with row stride `ld` *is* the column-major matrix Xᵀ (c×r, same `ld`),
//! so the row-major product `out = op(x) · op(y)` is the column-major product
//! `outᵀ = op(y)ᵀ · op(x)ᵀ`: A is `y`, B is `x`, m and n swap, and the transpose flags stay with
//! their operands. Use the row-major constructors, which do this once and for all:
//!
//! - [`Matmul::row_major`] with [`MatmulOperands::row_major`], for any product;
//! - [`Matmul::linear_forward`], [`Matmul::linear_backward_input`] and
//!   [`Matmul::linear_backward_weight`] for a linear layer with llm.c's weight layout `[OC, C]`.
//!
//! In row-major terms the bias of [`Epilogue::Bias`] is a vector over the output's **columns**
//! (one value per output feature), added to every row. For example, a GPT-2 MLP (`rows = B·T`):
//!
//! ```text
//! // fch_gelu[rows, 4C] = gelu(ln2[rows, C] · fc_w[4C, C]ᵀ + fc_b), saving fch (pre-GELU) in aux
//! let fc = Matmul::linear_forward(rows, c, 4 * c).with_epilogue(Epilogue::BiasGelu);
//! let ops = MatmulOperands::row_major(Operand::of(&acts, ln2), Operand::of(&params, fc_w),
//!                                     Operand::of(&acts, fch_gelu))
//!     .with_bias(Operand::of(&params, fc_b)).with_aux(Operand::of(&acts, fch));
//! blas.matmul(stream, &fc, ops)?;
//! // backward of the projection, through the GELU: dfch[rows, 4C] = (dout · proj_w) ⊙ gelu'(fch),
//! // and dfc_b[4C] = Σ_rows dfch (written, not accumulated)
//! let back = Matmul::linear_backward_input(rows, 4 * c, c).with_epilogue(Epilogue::DGeluBGrad);
//! let ops = MatmulOperands::row_major(Operand::of(&grads_acts, dout), Operand::of(&params, proj_w),
//!                                     Operand::of(&grads_acts, dfch))
//!     .with_bias(Operand::of(&scratch, dfc_b)).with_aux(Operand::of(&acts, fch));
//! // weight gradient, accumulated: dproj_w[C, 4C] += dout[rows, C]ᵀ · fch_gelu[rows, 4C]
//! let dw = Matmul::linear_backward_weight(rows, 4 * c, c).with_beta(1.0);
//! let ops = MatmulOperands::row_major(Operand::of(&grads_acts, dout), Operand::of(&acts, fch_gelu),
//!                                     Operand::of(&grads, proj_w));
//! ```
//!
//! The bias-gradient epilogues (`DGeluBGrad`, `BGradA`, `BGradB`) **overwrite** the bias operand
//! whatever beta is: to accumulate a bias gradient over micro-batches, let them write a scratch
//! vector and add it (or reduce the bias gradient with a kernel of your own, as llm.c does).
//!
//! # Types
//!
//! Compute type `CUBLAS_COMPUTE_32F` (fp32 accumulation, no TF32), scale type f32 (`alpha` and
//! `beta` are `f32`). A and B share [`Matmul::ab_type`]; C and D share [`Matmul::c_type`].
//! Accepted: bf16 in → bf16 out, bf16 in → f32 out, f32 in → f32 out. The bias (read by
//! `Bias`/`BiasGelu`, or written by the bias-gradient epilogues) has the type of D:
//! `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` is set to D's type, which is also cuBLASLt's default for
//! these types (bf16 bias with bf16 D, as llm.c; f32 bias with f32 D). The GELU auxiliary
//! buffer (`BiasGelu` writes it, `DGelu*` read it) has D's type too (cuBLASLt's default for
//! `CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE`). A combination this cuBLASLt does not
//! implement is an error naming the problem (the heuristic finds no algorithm), not a wrong
//! result.
//!
//! # Requirements (checked; a violation is an error, never a wrong result)
//!
//! - Every operand address (A, B, C, D, bias, aux) is 16-byte aligned. [`CudaBuffer`]
//!   allocations are 256-byte aligned, so this is a constraint on offsets into them: a multiple
//!   of 8 bf16 or 4 f32 elements.
//! - Each operand lies inside the buffer it was taken from, for every batch (bounds-checked from
//!   the layout), and every buffer belongs to this `Blas`'s GPU.
//! - Epilogues are for `batch == 1`. `aux_ld` is a multiple of 8 and at least m (cuBLASLt's rule
//!   for GELU auxiliary buffers).
//! - In a batch, matrices after the first need not be 16-byte aligned (`T·T` bf16 attention
//!   scores are not): the plan tells cuBLASLt the alignment the strides leave.
//!
//! Leading dimensions need not be multiples of 8, but cuBLASLt's fast (TMA) kernels on Hopper
//! need 16-byte aligned columns: keep `lda`, `ldb`, `ldc` multiples of 8 (bf16) where speed
//! matters.
//!
//! # Streams
//!
//! One `Blas` owns one 32 MiB workspace, which cuBLASLt may use during any call: matmuls of one
//! `Blas` on different streams must not overlap in time (order them with events, or give each
//! stream its own `Blas`).

mod bench;
mod check;
mod plan;

use std::collections::HashMap;
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys as cu_sys;
use zeroflow_core::{DType, Element};

pub use self::bench::{GemmBench, bench_gemm};
use self::plan::{Addresses, Handle, Plan, PlanKey};
use super::{CudaBuffer, CudaDevice, CudaStream};
use crate::error::{DeviceError, Result};

/// The size of the workspace cuBLASLt may use per call (what NVIDIA recommends for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// The alignment every operand address must have, in bytes.
pub const OPERAND_ALIGNMENT: u64 = 16;

/// Matrix multiplications on one GPU. Send + Sync; see the module documentation for the
/// conventions and the one-stream-at-a-time rule of the workspace.
pub struct Blas {
    device: CudaDevice,
    /// `WORKSPACE_BYTES` of device memory (as `u32`s: bytes are no element type). Dropped first
    /// of the GPU resources: its drop waits for every stream of the device, so the
    /// plans and the handle dropped after it are no longer used by any queued product.
    workspace: CudaBuffer<u32>,
    /// The descriptors, layouts and algorithm of every problem seen so far.
    plans: Mutex<HashMap<PlanKey, Arc<Plan>>>,
    handle: Handle,
}

impl fmt::Debug for Blas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plans = self.plans.lock().map_or(0, |plans| plans.len());
        f.debug_struct("Blas").field("device", &self.device).field("plans", &plans).finish()
    }
}

/// Element type of A and B, or of C and D.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BlasType {
    Bf16,
    F32,
}

impl BlasType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            BlasType::Bf16 => 2,
            BlasType::F32 => 4,
        }
    }

    /// The matching element type of buffers.
    pub const fn dtype(self) -> DType {
        match self {
            BlasType::Bf16 => DType::Bf16,
            BlasType::F32 => DType::F32,
        }
    }
}

/// What cuBLASLt does with the product before writing D (column-major terms; `x` is
/// `alpha · op(A) · op(B) + beta · C`, GELU is the tanh approximation GPT-2 uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `D = x`.
    None,
    /// `D = x + bias`, bias of length m added to every column (in row-major terms: one value per
    /// output column, added to every row). Needs `bias`.
    Bias,
    /// `D = gelu(x)`.
    Gelu,
    /// `aux = x + bias; D = gelu(aux)`: writes the pre-GELU values to `aux` (m×n, `aux_ld`) for
    /// the backward pass. Needs `bias` and `aux`.
    BiasGelu,
    /// `D = x ⊙ gelu'(aux)`: the gradient through a GELU whose input `BiasGelu` saved. Needs
    /// `aux`.
    DGelu,
    /// `DGelu`, and also **writes** (never accumulates) `bias[i] = Σ_j D[i, j]` (length m): the
    /// bias gradient of the layer before the GELU. Needs `aux` and `bias`.
    DGeluBGrad,
    /// `D = x`, and **writes** the bias gradient `bias[i] = Σ_l op(A)[i, l]` (length m, the
    /// reduction over k). Needs `bias`.
    BGradA,
    /// `D = x`, and **writes** the bias gradient `bias[j] = Σ_l op(B)[l, j]` (length n, the
    /// reduction over k). For [`Matmul::linear_backward_weight`] this is
    /// `dbias[OC] = Σ_rows dout`. Needs `bias`.
    BGradB,
}

impl Epilogue {
    /// Whether the epilogue reads or writes the `bias` operand.
    pub const fn uses_bias(self) -> bool {
        matches!(
            self,
            Epilogue::Bias
                | Epilogue::BiasGelu
                | Epilogue::DGeluBGrad
                | Epilogue::BGradA
                | Epilogue::BGradB
        )
    }

    /// Whether the epilogue reads or writes the `aux` operand.
    pub const fn uses_aux(self) -> bool {
        matches!(self, Epilogue::BiasGelu | Epilogue::DGelu | Epilogue::DGeluBGrad)
    }

    /// The length of the bias vector for an m×n output.
    pub const fn bias_len(self, m: usize, n: usize) -> usize {
        match self {
            Epilogue::BGradB => n,
            _ => m,
        }
    }
}

/// One matrix multiplication, in cuBLAS's column-major terms (see the module documentation). The
/// constructors fill in contiguous leading dimensions, bf16 everywhere, `alpha = 1`, `beta = 0`,
/// no batch and no epilogue; the `with_*` methods change one thing each.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Matmul {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    /// Number of independent products (strided batched); 1 for a plain matmul.
    pub batch: usize,
    /// Elements from one batch's A (B, C and D) to the next. Ignored when `batch == 1`.
    pub stride_a: i64,
    pub stride_b: i64,
    pub stride_c: i64,
    pub ab_type: BlasType,
    pub c_type: BlasType,
    pub epilogue: Epilogue,
    pub alpha: f32,
    /// 0 overwrites D; 1 accumulates into C (= D).
    pub beta: f32,
    /// Leading dimension of the GELU auxiliary buffer (m×n column-major); used by `BiasGelu`,
    /// `DGelu` and `DGeluBGrad` only.
    pub aux_ld: usize,
}

impl Matmul {
    /// Column-major `D[m, n] = op(A)[m, k] · op(B)[k, n]`, leading dimensions those of contiguous
    /// storage (`lda = trans_a ? k : m`, `ldb = trans_b ? n : k`, `ldc = m`).
    pub fn col_major(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> Self {
        Matmul {
            m,
            n,
            k,
            trans_a,
            trans_b,
            lda: if trans_a { k } else { m },
            ldb: if trans_b { n } else { k },
            ldc: m,
            batch: 1,
            stride_a: 0,
            stride_b: 0,
            stride_c: 0,
            ab_type: BlasType::Bf16,
            c_type: BlasType::Bf16,
            epilogue: Epilogue::None,
            alpha: 1.0,
            beta: 0.0,
            aux_ld: m,
        }
    }

    /// Row-major `out[rows, cols] = op(x)[rows, inner] · op(y)[inner, cols]`, where
    /// `op(x) = x` stored `[rows, inner]`, or with `trans_x`, `op(x) = xᵀ` with x stored
    /// `[inner, rows]`; likewise `op(y) = y` stored `[inner, cols]`, or with `trans_y`, y stored
    /// `[cols, inner]`. All contiguous. Pair it with [`MatmulOperands::row_major`]`(x, y, out)`.
    ///
    /// (The column-major problem: m = cols, n = rows, k = inner, A = y with `trans_a = trans_y`,
    /// B = x with `trans_b = trans_x`.) To use row strides other than contiguous ones, set `lda`
    /// to y's row stride, `ldb` to x's and `ldc` to out's.
    pub fn row_major(rows: usize, cols: usize, inner: usize, trans_x: bool, trans_y: bool) -> Self {
        Matmul::col_major(cols, rows, inner, trans_y, trans_x)
    }

    /// A linear layer's forward pass, llm.c's layout:
    /// `out[rows, out_features] = inp[rows, in_features] · weight[out_features, in_features]ᵀ`
    /// (`+ bias[out_features]` with [`Epilogue::Bias`]; `BiasGelu` also applies GELU and saves the
    /// pre-GELU values, `[rows, out_features]`, in aux). Operands:
    /// `MatmulOperands::row_major(inp, weight, out)`.
    pub fn linear_forward(rows: usize, in_features: usize, out_features: usize) -> Self {
        Matmul::row_major(rows, out_features, in_features, false, true)
    }

    /// A linear layer's input gradient:
    /// `dinp[rows, in_features] = dout[rows, out_features] · weight[out_features, in_features]`.
    /// With [`Epilogue::DGelu`] the result is multiplied by `gelu'(aux)`, aux the
    /// `[rows, in_features]` pre-GELU values the forward saved; [`Epilogue::DGeluBGrad`] also
    /// writes `bias[in_features] = Σ_rows dinp` (the bias gradient of the layer that produced
    /// the pre-GELU values). Operands: `MatmulOperands::row_major(dout, weight, dinp)`.
    pub fn linear_backward_input(rows: usize, in_features: usize, out_features: usize) -> Self {
        Matmul::row_major(rows, in_features, out_features, false, false)
    }

    /// A linear layer's weight gradient:
    /// `dweight[out_features, in_features] = dout[rows, out_features]ᵀ · inp[rows, in_features]`
    /// (`with_beta(1.0)` accumulates into dweight). [`Epilogue::BGradB`] also **writes**
    /// `dbias[out_features] = Σ_rows dout`. Operands:
    /// `MatmulOperands::row_major(dout, inp, dweight)`.
    pub fn linear_backward_weight(rows: usize, in_features: usize, out_features: usize) -> Self {
        Matmul::row_major(out_features, in_features, rows, true, false)
    }

    /// Makes this `batch` independent products, the operands of product `i` starting
    /// `i · stride` elements after the first's (row-major or column-major alike).
    #[must_use]
    pub fn batched(self, batch: usize, stride_a: i64, stride_b: i64, stride_c: i64) -> Self {
        Matmul { batch, stride_a, stride_b, stride_c, ..self }
    }

    /// Row-major batched: the strides of x, y and out, in elements.
    #[must_use]
    pub fn batched_row_major(
        self,
        batch: usize,
        stride_x: i64,
        stride_y: i64,
        stride_out: i64,
    ) -> Self {
        self.batched(batch, stride_y, stride_x, stride_out)
    }

    #[must_use]
    pub fn with_epilogue(self, epilogue: Epilogue) -> Self {
        Matmul { epilogue, ..self }
    }

    #[must_use]
    pub fn with_types(self, ab_type: BlasType, c_type: BlasType) -> Self {
        Matmul { ab_type, c_type, ..self }
    }

    #[must_use]
    pub fn with_alpha(self, alpha: f32) -> Self {
        Matmul { alpha, ..self }
    }

    /// `beta = 1` accumulates into the output.
    #[must_use]
    pub fn with_beta(self, beta: f32) -> Self {
        Matmul { beta, ..self }
    }

    #[must_use]
    pub fn with_aux_ld(self, aux_ld: usize) -> Self {
        Matmul { aux_ld, ..self }
    }

    /// Floating-point operations of the product (2·m·n·k per batch).
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }
}

/// Where one operand lies: an address inside a live buffer of a known device and element type.
/// Borrows the buffer, so it cannot be freed while the operand exists.
#[derive(Clone, Copy)]
pub struct Operand<'a> {
    address: cu_sys::CUdeviceptr,
    /// Elements from `address` to the end of the buffer.
    available: usize,
    dtype: DType,
    /// The identity of the buffer's device (the address of its shared state).
    device: usize,
    _buffer: PhantomData<&'a ()>,
}

impl fmt::Debug for Operand<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Operand<{}>[{}]@{:#x}", self.dtype, self.available, self.address)
    }
}

impl<'a> Operand<'a> {
    /// The matrix (or vector) starting at element `index` of `buffer`.
    ///
    /// # Panics
    /// If `index > buffer.len()`.
    pub fn of<T: Element>(buffer: &'a CudaBuffer<T>, index: usize) -> Self {
        use crate::DeviceBuffer;
        Operand {
            address: buffer.address(index),
            available: buffer.len() - index,
            dtype: T::DTYPE,
            device: Arc::as_ptr(buffer.device()) as usize,
            _buffer: PhantomData,
        }
    }

    /// The device address.
    pub fn address(&self) -> cu_sys::CUdeviceptr {
        self.address
    }
}

/// The operands of one [`Matmul`]: A, B, C, D (C may be D, and is when made by the
/// constructors), and the bias and GELU auxiliary buffer of the epilogue.
#[derive(Clone, Copy, Debug)]
pub struct MatmulOperands<'a> {
    pub a: Operand<'a>,
    pub b: Operand<'a>,
    pub c: Operand<'a>,
    pub d: Operand<'a>,
    pub bias: Option<Operand<'a>>,
    pub aux: Option<Operand<'a>>,
}

impl<'a> MatmulOperands<'a> {
    /// Column-major operands, `C = D = d`.
    pub fn new(a: Operand<'a>, b: Operand<'a>, d: Operand<'a>) -> Self {
        MatmulOperands { a, b, c: d, d, bias: None, aux: None }
    }

    /// The operands of a [`Matmul::row_major`] product `out = op(x) · op(y)` (A = y, B = x),
    /// `C = D = out`.
    pub fn row_major(x: Operand<'a>, y: Operand<'a>, out: Operand<'a>) -> Self {
        MatmulOperands::new(y, x, out)
    }

    /// A separate input C (`D = … + beta · C`).
    #[must_use]
    pub fn with_c(self, c: Operand<'a>) -> Self {
        MatmulOperands { c, ..self }
    }

    /// The bias read by `Bias`/`BiasGelu` or written by the `BGrad*` epilogues.
    #[must_use]
    pub fn with_bias(self, bias: Operand<'a>) -> Self {
        MatmulOperands { bias: Some(bias), ..self }
    }

    /// The GELU auxiliary buffer written by `BiasGelu`, read by `DGelu*`.
    #[must_use]
    pub fn with_aux(self, aux: Operand<'a>) -> Self {
        MatmulOperands { aux: Some(aux), ..self }
    }
}

impl Blas {
    /// Creates the cuBLASLt handle and the workspace on `device`. An error (never a panic) where
    /// libcublasLt cannot be loaded.
    pub fn new(device: &CudaDevice) -> Result<Self> {
        super::CudaLibrary::CublasLt.ensure_loadable()?;
        let workspace = crate::Device::alloc::<u32>(device, WORKSPACE_BYTES / 4)?;
        device.inner.bind()?;
        let handle = Handle::new()?;
        Ok(Blas { device: device.clone(), workspace, plans: Mutex::default(), handle })
    }

    /// The GPU this `Blas` runs on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// Enqueues `problem` on `stream`. Validates the problem and the operands first (see the
    /// module documentation); the first call for a problem picks its algorithm (a host-side
    /// heuristic query, cached), later calls only enqueue.
    ///
    /// The operands must be ordered against other streams by the caller's events, like every
    /// operation of the device, and no other matmul of this `Blas` may run concurrently on
    /// another stream (the shared workspace).
    pub fn matmul(
        &self,
        stream: &CudaStream,
        problem: &Matmul,
        operands: MatmulOperands<'_>,
    ) -> Result<()> {
        check::validate(problem, &operands, Arc::as_ptr(&self.device.inner) as usize)?;
        let o = &operands;
        let addresses = Addresses {
            a: o.a.address,
            b: o.b.address,
            c: o.c.address,
            d: o.d.address,
            bias: o.bias.map(|bias| bias.address),
            aux: o.aux.map(|aux| aux.address),
        };
        let key = PlanKey::new(problem, [addresses.a, addresses.b, addresses.c, addresses.d]);
        self.device.inner.bind()?;
        let plan = {
            let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
            match plans.get(&key) {
                Some(plan) => plan.clone(),
                None => {
                    let plan = Arc::new(Plan::new(
                        &self.handle,
                        problem,
                        &key,
                        &addresses,
                        WORKSPACE_BYTES,
                    )?);
                    plans.insert(key, plan.clone());
                    plan
                }
            }
        };
        // SAFETY: the device's context is current (bound above); `validate` checked that every
        // operand lies, with the extent the problem gives it, inside a live buffer of this device
        // (the operands borrow their buffers, which cannot be freed before this returns, and a
        // buffer's drop waits for every stream), with the element type and alignment the plan
        // was built for, and that no written operand overlaps another; ordering against other
        // streams, and the workspace's use by one stream at a time, are the caller's (this
        // method's documentation).
        unsafe {
            plan.enqueue(
                &self.handle,
                problem.epilogue,
                &addresses,
                self.workspace.address(0),
                WORKSPACE_BYTES,
                stream.cu(),
            )
        }
    }
}

/// A cuBLASLt failure as a device error.
pub(crate) fn blas_error(call: &str, reason: impl fmt::Display) -> DeviceError {
    DeviceError::Library {
        library: super::CudaLibrary::CublasLt.name(),
        reason: format!("{call} failed: {reason}"),
    }
}

#[cfg(test)]
mod tests;
