//! Collectives between the ranks of a data-parallel job.
//!
//! Every rank calls the same collectives in the same order (as with NCCL). Each call is queued on a
//! stream of the rank's device like any other operation: it reads and writes device buffers when
//! the stream reaches it, and events order it against the other streams.

use std::ops::Range;

use zeroflow_core::Element;

use crate::{Device, DeviceError, Result};

/// How values from the ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the world size.
    Avg,
    Max,
}

/// A communicator: this rank's handle on a group of ranks.
pub trait Comm: std::fmt::Debug + Send {
    type Device: Device;

    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;

    fn world_size(&self) -> usize;

    /// Replaces `buf[range]` on every rank by the reduction over ranks.
    fn all_reduce<T: Element>(
        &self,
        stream: &<Self::Device as Device>::Stream,
        buf: &<Self::Device as Device>::Buffer<T>,
        range: Range<usize>,
        op: ReduceOp,
    ) -> Result<()>;

    /// `src[src_range]` has `world_size × n` elements on every rank; rank `r` receives the
    /// reduction of chunk `r` over ranks in `dst[dst_offset..dst_offset + n]`. The output may
    /// overlap the input of the same buffer only as NCCL's in-place form: exactly this rank's
    /// chunk of it (`dst_offset == src_range.start + rank × n`); any other overlap is refused.
    fn reduce_scatter<T: Element>(
        &self,
        stream: &<Self::Device as Device>::Stream,
        src: &<Self::Device as Device>::Buffer<T>,
        src_range: Range<usize>,
        dst: &<Self::Device as Device>::Buffer<T>,
        dst_offset: usize,
        op: ReduceOp,
    ) -> Result<()>;

    /// Rank `root` receives the reduction over ranks of `src[src_range]` in
    /// `dst[dst_offset..dst_offset + len]`; `dst` is untouched on the other ranks. On the root the
    /// output may overlap the input of the same buffer only by being exactly it
    /// (`dst_offset == src_range.start`).
    #[allow(clippy::too_many_arguments, reason = "mirrors ncclReduce")]
    fn reduce<T: Element>(
        &self,
        stream: &<Self::Device as Device>::Stream,
        src: &<Self::Device as Device>::Buffer<T>,
        src_range: Range<usize>,
        dst: &<Self::Device as Device>::Buffer<T>,
        dst_offset: usize,
        root: usize,
        op: ReduceOp,
    ) -> Result<()>;

    /// `src[src_range]` has `n` elements on every rank; every rank receives them all, rank `r`'s
    /// in chunk `r` of `dst[dst_range]` (`world_size × n` elements). `src` may lie inside
    /// `dst_range` of the same buffer only as this rank's own chunk (`src_range.start ==
    /// dst_range.start + rank × n`: NCCL's in-place form, ZeRO's gather of its partitions, whose
    /// input is then left as it was); any other overlap is refused.
    fn all_gather<T: Element>(
        &self,
        stream: &<Self::Device as Device>::Stream,
        src: &<Self::Device as Device>::Buffer<T>,
        src_range: Range<usize>,
        dst: &<Self::Device as Device>::Buffer<T>,
        dst_range: Range<usize>,
    ) -> Result<()>;

    /// Copies `buf[range]` of rank `root` into `buf[range]` of every rank.
    fn broadcast<T: Element>(
        &self,
        stream: &<Self::Device as Device>::Stream,
        buf: &<Self::Device as Device>::Buffer<T>,
        range: Range<usize>,
        root: usize,
    ) -> Result<()>;
}

/// Refuses an input and an output of the same buffer that overlap, unless `in_place` says the
/// input sits where the collective's in-place form puts it (`rule` says where, for the error).
/// Both implementations of [`Comm`] call it, so a placement NCCL would misread fails on the CPU
/// device too, where the three-phase rendezvous would otherwise compute it correctly.
pub(crate) fn check_placement(
    op: &'static str,
    rank: usize,
    same_buffer: bool,
    (src_range, dst_range): (&Range<usize>, &Range<usize>),
    in_place: bool,
    rule: &str,
) -> Result<()> {
    // An empty range overlaps nothing (a non-root's output of `reduce` is empty wherever it is).
    let overlap = same_buffer
        && !src_range.is_empty()
        && !dst_range.is_empty()
        && src_range.start < dst_range.end
        && dst_range.start < src_range.end;
    if !overlap || in_place {
        return Ok(());
    }
    let reason = format!(
        "the input {src_range:?} overlaps the output {dst_range:?} of the same buffer without \
         being in place ({rule})"
    );
    Err(DeviceError::Collective { op, rank, reason })
}

/// The rules [`check_placement`] names, one per collective with an in-place form.
pub(crate) const ALL_GATHER_IN_PLACE: &str =
    "in place, the input must be this rank's chunk of the output";
pub(crate) const REDUCE_SCATTER_IN_PLACE: &str =
    "in place, the output must be this rank's chunk of the input";
pub(crate) const REDUCE_IN_PLACE: &str = "in place, the output must start where the input does";
