//! The AdamW kernels, one module per instruction set, and the dispatch between them.
//!
//! Each kernel updates one [`Piece`] on the calling thread. All of them compute, per element,
//!
//! ```text
//! g  = fma(p, l2, g * grad_scale)               L2 mode: l2 = wd, else 0
//! m  = fma(1 - β1, g - m, m)                     torch's lerp_(g, 1 - β1)
//! v  = fma(1 - β2, g * g - v, v)
//! p  = fma(p, -lr wd, p)                         decoupled mode, else -lr wd = 0
//! p  = fma(m / fma(sqrt(v), 1 / sqrt(bc2), eps), -lr / bc1, p)
//! ```
//!
//! with `fma` a fused multiply-add in the AVX2 and AVX-512 kernels (and `g * g - v` a fused
//! multiply-subtract) and a multiply then an add in the portable one. This is torch's and
//! DeepSpeed's arithmetic, except that the moments are updated as `m + (1 - β)(g - m)` (torch's
//! form for `m`) and the decay as `p - lr wd p` (DeepSpeed's form): `β` and `1 - lr wd` rounded to
//! f32 are off by up to 3e-8, which `m β`, `v β` and `p (1 - lr wd)` would compound every step
//! in the same direction (1.7e-6 after 100 steps), while these forms round only the small
//! increments.
//!
//! The moments are `f32` or `bf16` ([`MomentElem`]): a bf16 moment is widened to f32, updated with
//! the same arithmetic, and stored rounded stochastically with the random bits of its element
//! index and the step ([`crate::rounding`]); every kernel rounds with the same integer ops, so
//! the rounding adds no difference between levels.

mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use crate::config::StepScalars;
use crate::roofline::RooflineVariant;
use crate::{SimdLevel, Stores};

/// How far ahead (in elements) the AVX2 and AVX-512 kernels prefetch each input stream: 4 KiB
/// of f32. The hardware prefetchers alone leave the streams short of the memory's bandwidth once
/// the kernel's arithmetic delays the loads. Measured on a 16-core H200 host (5e8 parameters,
/// AVX-512, f32 gradients, Gparam/s): none 5.0, 256 elements 5.5–5.7, 512 5.6–5.7, 1024
/// 5.7–5.8, 2048 5.2–5.7; with 1 thread none 0.71, 1024 0.94; with 8 threads none 3.50,
/// 1024 4.08. The T1 hint (into L2 only) was 3% slower than T0.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) const PREFETCH_DISTANCE: usize = 1024;
use crate::piece::{GradElem, MomentElem, Piece};
use crate::rounding::MomentSeeds;

/// A [`SimdLevel`] that this CPU was checked to support: the proof the dispatch's `unsafe`
/// calls rely on. It can only be made by [`SupportedLevel::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SupportedLevel(SimdLevel);

impl SupportedLevel {
    /// `Some` if this CPU runs `level`'s kernels.
    pub fn new(level: SimdLevel) -> Option<Self> {
        level.is_available().then_some(SupportedLevel(level))
    }

    /// The widest level this CPU supports.
    pub fn detect() -> Self {
        SupportedLevel(SimdLevel::detect())
    }

    pub fn level(self) -> SimdLevel {
        self.0
    }
}

/// Updates one piece, whose first element is element `start` of the partition, with AdamW on the
/// calling thread, writing the bf16 copy (if any) with ordinary or, where the level has them and
/// the buffer allows, non-temporal stores.
pub(crate) fn adamw<G: GradElem, M: MomentElem>(
    level: SupportedLevel,
    scalars: &StepScalars,
    seeds: MomentSeeds,
    copy_stores: Stores,
    start: usize,
    piece: Piece<'_, G, M>,
) {
    let stream_copy = copy_stores == Stores::NonTemporal;
    match level.0 {
        SimdLevel::Scalar => scalar::adamw(scalars, seeds, start, piece),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `SupportedLevel` is only made after `is_available` found AVX2 and FMA on
        // this CPU, which is all `avx2::adamw` requires.
        SimdLevel::Avx2 => unsafe { avx2::adamw(scalars, seeds, stream_copy, start, piece) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX-512F, AVX2 and FMA found for this level.
        SimdLevel::Avx512 => unsafe { avx512::adamw(scalars, seeds, stream_copy, start, piece) },
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 | SimdLevel::Avx512 => {
            let _ = (stream_copy, seeds, start);
            unreachable!("SupportedLevel is never an x86 level on another architecture")
        }
    }
}

/// Copies `from` (f32, or bf16 widened exactly) into `into` on the calling thread, with
/// streaming stores where the level has them (the AVX-512 level uses the AVX2 copy: a copy is
/// bound by memory, not by the vectors' width).
pub(crate) fn save<M: MomentElem>(level: SupportedLevel, from: &[M], into: &mut [f32]) {
    match level.0 {
        SimdLevel::Scalar => scalar::save(from, into),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `SupportedLevel` guarantees AVX2 and FMA on this CPU at both levels.
        SimdLevel::Avx2 | SimdLevel::Avx512 => unsafe { avx2::save(from, into) },
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 | SimdLevel::Avx512 => {
            unreachable!("SupportedLevel is never an x86 level on another architecture")
        }
    }
}

/// `into[i] = from[i]` as f32 with ordinary stores, on the calling thread: the portable level's
/// [`save`], for a copy that should go through the caches as ordinary code's does.
pub(crate) fn widen<M: MomentElem>(from: &[M], into: &mut [f32]) {
    scalar::save(from, into);
}

/// The roofline's trivial update (`t = c g; p += t; m += t; v += t`, bf16 moments and the bf16
/// copy truncated) on the calling thread, writing the state and the
/// copy with ordinary or, where the level has them and the slices allow, non-temporal stores,
/// with or without software prefetch.
pub(crate) fn stream<G: GradElem, M: MomentElem>(
    level: SupportedLevel,
    c: f32,
    variant: RooflineVariant,
    piece: Piece<'_, G, M>,
) {
    let stream_state = variant.state == Stores::NonTemporal;
    let stream_copy = variant.copy == Stores::NonTemporal;
    let prefetch = variant.prefetch;
    match level.0 {
        SimdLevel::Scalar => scalar::stream(c, piece),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `SupportedLevel` guarantees AVX2 and FMA on this CPU.
        SimdLevel::Avx2 => unsafe { avx2::stream(c, stream_state, stream_copy, prefetch, piece) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `SupportedLevel` guarantees AVX-512F, AVX2 and FMA on this CPU.
        SimdLevel::Avx512 => unsafe {
            avx512::stream(c, stream_state, stream_copy, prefetch, piece)
        },
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 | SimdLevel::Avx512 => {
            let _ = (stream_state, stream_copy, prefetch);
            unreachable!("SupportedLevel is never an x86 level on another architecture")
        }
    }
}
