//! Collectives between the ranks of a data-parallel job.
//!
//! Every rank calls the same collectives in the same order (as with NCCL). Each call is queued on a
//! stream of the rank's device like any other operation: it reads and writes device buffers when
//! the stream reaches it, and events order it against the other streams.

use std::ops::Range;

use zeroflow_core::Element;

use crate::{Device, Result};

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
    /// reduction of chunk `r` over ranks in `dst[dst_offset..dst_offset + n]`.
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
    /// `dst[dst_offset..dst_offset + len]`; `dst` is untouched on the other ranks.
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
    /// `dst_range` (the in-place all-gather of ZeRO's partitions).
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
