//! The unit of work the executor splits across threads: equal-length sub-slices of the weights,
//! the gradients, both moments and (optionally) the bf16 weight copy.

use half::bf16;

use crate::executor::Output;

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

/// Equal-length slices of one stretch of a partition: what one kernel call updates.
#[derive(Debug)]
pub(crate) struct Piece<'a, G> {
    pub params: &'a mut [f32],
    pub grads: &'a [G],
    pub exp_avg: &'a mut [f32],
    pub exp_avg_sq: &'a mut [f32],
    pub out: Output<'a>,
}

impl<G: GradElem> Split for Piece<'_, G> {
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
pub(crate) struct TailScratch<G, const N: usize> {
    pub params: [f32; N],
    pub grads: [G; N],
    pub exp_avg: [f32; N],
    pub exp_avg_sq: [f32; N],
    pub out: [bf16; N],
}

impl<G: GradElem, const N: usize> TailScratch<G, N> {
    /// Scratch lanes holding the tail; unused lanes hold zeros (their results are discarded).
    #[inline]
    pub fn load(params: &[f32], grads: &[G], exp_avg: &[f32], exp_avg_sq: &[f32]) -> Self {
        let len = params.len();
        let mut scratch = TailScratch {
            params: [0.0; N],
            grads: [G::default(); N],
            exp_avg: [0.0; N],
            exp_avg_sq: [0.0; N],
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
        exp_avg: &mut [f32],
        exp_avg_sq: &mut [f32],
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
/// that every element goes through the same instruction sequence wherever it lies. The bf16
/// output array is passed when the piece writes one.
///
/// `#[inline(always)]` so that it is inlined into each kernel's `#[target_feature]` function and
/// the `lanes` closure (defined there, inheriting its features) is inlined into the loop.
#[inline(always)]
pub(crate) fn for_each_lanes<G: GradElem, const N: usize>(
    piece: Piece<'_, G>,
    mut lanes: impl FnMut(&mut [f32; N], &[G; N], &mut [f32; N], &mut [f32; N], Option<&mut [bf16; N]>),
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
    let body = params_body.iter_mut().zip(grads_body).zip(exp_avg_body).zip(exp_avg_sq_body);
    let out_tail = match out {
        Output::MasterOnly => {
            for (((p, g), m), v) in body {
                lanes(p, g, m, v, None);
            }
            None
        }
        Output::AlsoBf16(out) => {
            assert_eq!(out.len(), len, "a piece's bf16 output has the length of its weights");
            let (out_body, out_tail) = out.as_chunks_mut::<N>();
            for ((((p, g), m), v), o) in body.zip(out_body) {
                lanes(p, g, m, v, Some(o));
            }
            Some(out_tail)
        }
    };
    if params_tail.is_empty() {
        return;
    }
    let mut scratch =
        TailScratch::<G, N>::load(params_tail, grads_tail, exp_avg_tail, exp_avg_sq_tail);
    let TailScratch { params, grads, exp_avg, exp_avg_sq, out } = &mut scratch;
    lanes(params, grads, exp_avg, exp_avg_sq, out_tail.is_some().then_some(out));
    scratch.store(params_tail, exp_avg_tail, exp_avg_sq_tail, out_tail);
}

#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // Used by the x86 kernels.
impl<G> Piece<'_, G> {
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
pub(crate) fn split_for_streaming<G: GradElem>(
    piece: Piece<'_, G>,
    addr: usize,
    elem_size: usize,
    align: usize,
    lanes: usize,
) -> [Piece<'_, G>; 3] {
    let head_len = ((align - addr % align) % align / elem_size).min(piece.len());
    let (head, rest) = piece.split_at(head_len);
    let body_len = rest.len() / lanes * lanes;
    let (body, tail) = rest.split_at(body_len);
    [head, body, tail]
}
