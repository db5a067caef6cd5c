//! The unit of work the executor splits across threads: equal-length sub-slices of the weights,
//! the gradients, both moments and (optionally) the bf16 weight copy.

use half::bf16;
use zeroflow_core::adamw::OptimizerStateDtype;

use crate::executor::Output;
use crate::rounding::{random_bits, stochastic_bf16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// A gradient element type the kernels read: `f32` or `bf16`, nothing else (the trait is
/// sealed, and the SIMD kernels rely on that to pick the load for each).
pub(crate) trait GradElem: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// True for `bf16` (2 bytes, widened by a shift), false for `f32` (4 bytes).
    const IS_BF16: bool;

    fn to_f32(self) -> f32;
}

impl GradElem for f32 {
    const IS_BF16: bool = false;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl GradElem for bf16 {
    const IS_BF16: bool = true;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

/// The element type of the Adam moments: `f32` or `bf16` (sealed). The kernels read a moment as
/// f32, update it in f32 and store it back: an f32 as it is, a bf16 rounded stochastically
/// ([`crate::rounding`]).
pub trait MomentElem: sealed::Sealed + Copy + Default + Send + Sync + 'static {
    /// True for `bf16`, false for `f32`.
    const IS_BF16: bool;
    /// The dtype's name in configs and checkpoints.
    const DTYPE: OptimizerStateDtype;

    fn to_f32(self) -> f32;

    /// The updated moment `x` of the element at `index` of the partition, stored: as it is for
    /// f32, rounded stochastically with the bits of (`seed`, `index`) for bf16.
    fn store_rounded(x: f32, seed: u32, index: usize) -> Self;

    /// `x` with the roofline's rounding: as it is for f32, truncated for bf16.
    fn truncated(x: f32) -> Self;
}

impl MomentElem for f32 {
    const IS_BF16: bool = false;
    const DTYPE: OptimizerStateDtype = OptimizerStateDtype::Fp32;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn store_rounded(x: f32, _seed: u32, _index: usize) -> Self {
        x
    }

    #[inline(always)]
    fn truncated(x: f32) -> Self {
        x
    }
}

impl MomentElem for bf16 {
    const IS_BF16: bool = true;
    const DTYPE: OptimizerStateDtype = OptimizerStateDtype::Bf16;

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.to_f32()
    }

    #[inline(always)]
    fn store_rounded(x: f32, seed: u32, index: usize) -> Self {
        stochastic_bf16(x, random_bits(seed, index))
    }

    #[inline(always)]
    fn truncated(x: f32) -> Self {
        bf16::from_bits((x.to_bits() >> 16) as u16)
    }
}

/// Something the executor can cut in two at an element index and hand to two threads.
pub(crate) trait Split: Sized + Send {
    fn len(&self) -> usize;
    fn split_at(self, mid: usize) -> (Self, Self);
}

impl<T: Send> Split for &mut [T] {
    fn len(&self) -> usize {
        <[T]>::len(self)
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        self.split_at_mut(mid)
    }
}

/// Two things cut at the same element: a piece and the buffers that go with it.
impl<A: Split, B: Split> Split for (A, B) {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (a0, a1) = self.0.split_at(mid);
        let (b0, b1) = self.1.split_at(mid);
        ((a0, b0), (a1, b1))
    }
}

/// Equal-length slices of one stretch of a partition: what one kernel call updates.
#[derive(Debug)]
pub(crate) struct Piece<'a, G, M> {
    pub params: &'a mut [f32],
    pub grads: &'a [G],
    pub exp_avg: &'a mut [M],
    pub exp_avg_sq: &'a mut [M],
    pub out: Output<'a>,
}

impl<G: GradElem, M: MomentElem> Split for Piece<'_, G, M> {
    fn len(&self) -> usize {
        self.params.len()
    }

    fn split_at(self, mid: usize) -> (Self, Self) {
        let (params_a, params_b) = self.params.split_at_mut(mid);
        let (grads_a, grads_b) = self.grads.split_at(mid);
        let (exp_avg_a, exp_avg_b) = self.exp_avg.split_at_mut(mid);
        let (exp_avg_sq_a, exp_avg_sq_b) = self.exp_avg_sq.split_at_mut(mid);
        let (out_a, out_b) = match self.out {
            Output::MasterOnly => (Output::MasterOnly, Output::MasterOnly),
            Output::AlsoBf16(out) => {
                let (a, b) = out.split_at_mut(mid);
                (Output::AlsoBf16(a), Output::AlsoBf16(b))
            }
        };
        (
            Piece {
                params: params_a,
                grads: grads_a,
                exp_avg: exp_avg_a,
                exp_avg_sq: exp_avg_sq_a,
                out: out_a,
            },
            Piece {
                params: params_b,
                grads: grads_b,
                exp_avg: exp_avg_b,
                exp_avg_sq: exp_avg_sq_b,
                out: out_b,
            },
        )
    }
}

/// Copies `N`-lane scratch arrays in and out for the last `len < N` elements of a piece, so that
/// the tail runs through exactly the same vector code as the body.
pub(crate) struct TailScratch<G, M, const N: usize> {
    pub params: [f32; N],
    pub grads: [G; N],
    pub exp_avg: [M; N],
    pub exp_avg_sq: [M; N],
    pub out: [bf16; N],
}

impl<G: GradElem, M: MomentElem, const N: usize> TailScratch<G, M, N> {
    /// Scratch lanes holding the tail; unused lanes hold zeros (their results are discarded).
    #[inline]
    pub fn load(params: &[f32], grads: &[G], exp_avg: &[M], exp_avg_sq: &[M]) -> Self {
        let len = params.len();
        let mut scratch = TailScratch {
            params: [0.0; N],
            grads: [G::default(); N],
            exp_avg: [M::default(); N],
            exp_avg_sq: [M::default(); N],
            out: [bf16::ZERO; N],
        };
        scratch.params[..len].copy_from_slice(params);
        scratch.grads[..len].copy_from_slice(grads);
        scratch.exp_avg[..len].copy_from_slice(exp_avg);
        scratch.exp_avg_sq[..len].copy_from_slice(exp_avg_sq);
        scratch
    }

    /// Writes the tail's results back.
    #[inline]
    pub fn store(
        &self,
        params: &mut [f32],
        exp_avg: &mut [M],
        exp_avg_sq: &mut [M],
        out: Option<&mut [bf16]>,
    ) {
        let len = params.len();
        params.copy_from_slice(&self.params[..len]);
        exp_avg.copy_from_slice(&self.exp_avg[..len]);
        exp_avg_sq.copy_from_slice(&self.exp_avg_sq[..len]);
        if let Some(out) = out {
            out.copy_from_slice(&self.out[..len]);
        }
    }
}

/// Runs `lanes` over a piece `N` elements at a time, then once more over the zero-padded tail, so
/// that every element goes through the same instruction sequence wherever it lies. `lanes` gets
/// the index in the piece of its first element, and the bf16 output array when the piece writes
/// one.
///
/// `#[inline(always)]` so that it is inlined into each kernel's `#[target_feature]` function and
/// the `lanes` closure (defined there, inheriting its features) is inlined into the loop.
#[inline(always)]
pub(crate) fn for_each_lanes<G: GradElem, M: MomentElem, const N: usize>(
    piece: Piece<'_, G, M>,
    mut lanes: impl FnMut(
        usize,
        &mut [f32; N],
        &[G; N],
        &mut [M; N],
        &mut [M; N],
        Option<&mut [bf16; N]>,
    ),
) {
    let Piece { params, grads, exp_avg, exp_avg_sq, out } = piece;
    let len = params.len();
    assert!(
        grads.len() == len && exp_avg.len() == len && exp_avg_sq.len() == len,
        "a piece's slices have equal lengths"
    );
    let (params_body, params_tail) = params.as_chunks_mut::<N>();
    let (grads_body, grads_tail) = grads.as_chunks::<N>();
    let (exp_avg_body, exp_avg_tail) = exp_avg.as_chunks_mut::<N>();
    let (exp_avg_sq_body, exp_avg_sq_tail) = exp_avg_sq.as_chunks_mut::<N>();
    let tail_index = params_body.len() * N;
    let body = params_body.iter_mut().zip(grads_body).zip(exp_avg_body).zip(exp_avg_sq_body);
    let out_tail = match out {
        Output::MasterOnly => {
            for (i, (((p, g), m), v)) in body.enumerate() {
                lanes(i * N, p, g, m, v, None);
            }
            None
        }
        Output::AlsoBf16(out) => {
            assert_eq!(out.len(), len, "a piece's bf16 output has the length of its weights");
            let (out_body, out_tail) = out.as_chunks_mut::<N>();
            for (i, ((((p, g), m), v), o)) in body.zip(out_body).enumerate() {
                lanes(i * N, p, g, m, v, Some(o));
            }
            Some(out_tail)
        }
    };
    if params_tail.is_empty() {
        return;
    }
    let mut scratch =
        TailScratch::<G, M, N>::load(params_tail, grads_tail, exp_avg_tail, exp_avg_sq_tail);
    let TailScratch { params, grads, exp_avg, exp_avg_sq, out } = &mut scratch;
    lanes(tail_index, params, grads, exp_avg, exp_avg_sq, out_tail.is_some().then_some(out));
    scratch.store(params_tail, exp_avg_tail, exp_avg_sq_tail, out_tail);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // Used by the x86 kernels.
impl<G, M> Piece<'_, G, M> {
    /// The address of the first element of the bf16 copy, if the piece writes one.
    pub fn out_addr(&self) -> Option<usize> {
        match &self.out {
            Output::MasterOnly => None,
            Output::AlsoBf16(out) => Some(out.as_ptr() as usize),
        }
    }
}

/// Splits `piece` into `[head, body, tail]` for streaming stores into one of its buffers, whose
/// element 0 lies at `addr` and whose elements are `elem_size` bytes: the body starts where that
/// buffer is `align`-byte aligned (the head has fewer than `align / elem_size` elements) and its
/// length is a multiple of `lanes` (the tail has fewer than `lanes`). A piece too short for a
/// body is all head.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // Used by the x86 kernels.
pub(crate) fn split_for_streaming<G: GradElem, M: MomentElem>(
    piece: Piece<'_, G, M>,
    addr: usize,
    elem_size: usize,
    align: usize,
    lanes: usize,
) -> [Piece<'_, G, M>; 3] {
    let head_len = ((align - addr % align) % align / elem_size).min(piece.len());
    let (head, rest) = piece.split_at(head_len);
    let body_len = rest.len() / lanes * lanes;
    let (body, tail) = rest.split_at(body_len);
    [head, body, tail]
}
