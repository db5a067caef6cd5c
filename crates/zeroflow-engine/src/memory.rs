//! What the engine allocates, as a function of its options, before it allocates it: the engine's
//! lines of the memory plan (`zeroflow plan`, DESIGN.md §4, "The memory plan").
//!
//! Each update path's constructor allocates through the same helpers these lines are computed
//! from (the staging length, the streaming choice, ZenFlow's compact capacity, the device sum's
//! choice, the speculation's capacity), so that a change to a path's buffers is a change here or
//! a failing test (`tests/engine/memory_plan.rs` on the CPU device).

use std::ops::Range;

use zeroflow_core::DType;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{UPLOAD_PIECE_BYTES, upload_staging_bytes};

use crate::engine::{staged_device_bytes, staged_piece};
use crate::host::{OUTGOING_BUFFERS, STAGING_BUFFERS, staging_len};
use crate::zenflow::EXCHANGE_PIECE;
use crate::{
    AccumulateOn, EngineOptions, Offload, OffloadUpdate, Placement, SHARE_UPLOAD_PIECE_BYTES,
    ShareState, Stage, ZenFlowAside,
};

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// The device's memory (on the CPU device: host memory too).
    Device,
    /// Host memory (pinned or pageable, as the offload's `memory` says).
    Host,
}

/// What a buffer holds, for the plan's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferKind {
    /// The flat weights in the model's dtype.
    Weights,
    /// The flat gradients in the model's dtype, and a rank's reduced partition.
    Gradients,
    /// fp32 master weights and Adam's two moments.
    MasterAndMoments,
    /// fp32 sums of gradients over micro-steps or a ZenFlow window.
    GradientAccumulator,
    /// Copies in flight between host and device (staging, outgoing weights, upload buffers).
    Staging,
    /// The delayed update's second buffers (set-aside gradients, next weights).
    DelayedUpdate,
    /// ZenFlow's compact device state of the selected columns, and its column statistics.
    ZenFlowSelected,
    /// The speculative step's backups.
    Speculation,
    /// Held only while the engine is built: the initial weights in the model's dtype, and
    /// (optimizer on the device) the fp32 master weights before their upload.
    SetUp,
}

impl BufferKind {
    pub fn name(self) -> &'static str {
        match self {
            BufferKind::Weights => "weights",
            BufferKind::Gradients => "gradients",
            BufferKind::MasterAndMoments => "master weights and moments",
            BufferKind::GradientAccumulator => "gradient accumulator",
            BufferKind::Staging => "staging and upload buffers",
            BufferKind::DelayedUpdate => "delayed-update buffers",
            BufferKind::ZenFlowSelected => "ZenFlow selected columns",
            BufferKind::Speculation => "speculation backups",
            BufferKind::SetUp => "engine set-up (transient)",
        }
    }
}

/// One buffer (or a group of buffers of one kind) the engine allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedBuffer {
    pub memory: MemoryKind,
    pub kind: BufferKind,
    pub bytes: u64,
}

fn line(
    memory: MemoryKind,
    kind: BufferKind,
    elements: usize,
    element_bytes: usize,
) -> PlannedBuffer {
    PlannedBuffer { memory, kind, bytes: elements as u64 * element_bytes as u64 }
}

/// Bytes of host memory one speculated element costs: its backup (fp32 master and moments), and
/// on the streaming path its weights awaiting upload.
/// The elements of a partition of `len` that a device share of `fraction` steps on the device
/// (`StreamOptions::device_share`): rounded down to whole packs of eight, the device kernels'.
pub fn device_share_len(len: usize, fraction: f64) -> usize {
    ((len as f64 * fraction.clamp(0.0, 1.0)) as usize) / 8 * 8
}

/// Bytes per element of a device share in device memory: the fp32 master weights and moments,
/// and the gradients cast to f32 for the AdamW.
pub(crate) const DEVICE_SHARE_ELEMENT_BYTES: usize = 16;

pub(crate) fn speculated_element_bytes(with_weights: bool, element_bytes: usize) -> usize {
    12 + if with_weights { element_bytes } else { 0 }
}

/// Elements the speculation of a partition of `partition` elements backs up within `budget`.
pub(crate) fn speculation_capacity(
    partition: usize,
    budget: usize,
    with_weights: bool,
    element_bytes: usize,
) -> usize {
    (budget / speculated_element_bytes(with_weights, element_bytes)).min(partition)
}

/// ZeRO-2 with gradient accumulation sums its window on the device: where `on` says, or (`Auto`)
/// where the device's `free` memory is at least twice the accumulator (it then leaves as much free
/// as it takes).
pub(crate) fn sums_on_device(
    opts: &EngineOptions,
    on: AccumulateOn,
    partition: usize,
    free: impl FnOnce() -> Option<usize>,
) -> bool {
    let summing = opts.stage == Stage::Zero2 && opts.grad_accum > 1;
    let bytes = partition.saturating_mul(4);
    summing
        && match on {
            AccumulateOn::Host => false,
            AccumulateOn::Device => true,
            AccumulateOn::Auto => free().is_some_and(|free| bytes <= free / 2),
        }
}

impl EngineOptions {
    /// The offload step streams (one micro-step per step, no ZenFlow, f32 or bf16 weights: the
    /// CPU reads the gradients as they are; f16 goes through the accumulator).
    pub fn streams(&self, dtype: DType) -> bool {
        let zenflow = self.zenflow().is_some();
        self.grad_accum == 1 && !zenflow && matches!(dtype, DType::F32 | DType::Bf16)
    }

    /// The exact offload step streams the window's sum from the device (ZeRO-2 with gradient
    /// accumulation summing on the device, `on_device` as the crate's `sums_on_device` chooses,
    /// f32 or bf16 weights; the delayed update sums on the host).
    pub fn streams_sum(&self, dtype: DType, on_device: bool) -> bool {
        let exact = matches!(
            &self.placement,
            Placement::Offload(Offload { update: OffloadUpdate::Exact, .. })
        );
        exact && on_device && !self.streams(dtype) && matches!(dtype, DType::F32 | DType::Bf16)
    }

    /// Whether the optimizer's device share (`StreamOptions::device_share`) can act: on the
    /// exact offload step streaming its gradients — one micro-step per step (on every rank's
    /// partition), or the window summed on the device (`on_device` as `sums_on_device` chooses)
    /// where the rank holds every weight (`holds_all`: one rank, or ZeRO-0); a speculation steps
    /// the host's elements only. Its fp32 moments are asked for apart (the share refuses bf16
    /// moments with its own message).
    pub fn shares(&self, dtype: DType, on_device: bool, holds_all: bool) -> bool {
        let Placement::Offload(offload) = &self.placement else {
            return false;
        };
        offload.update == OffloadUpdate::Exact
            && (self.streams(dtype) || (self.streams_sum(dtype, on_device) && holds_all))
    }

    /// The elements of a partition of `n` of `layout` that the device share steps on the device
    /// and holds the state of (`on_device`: a window is summed on the device): 0 where no share
    /// is asked or it cannot act.
    fn acting_share(&self, layout: &FlatLayout, n: usize, dtype: DType, on_device: bool) -> usize {
        let Placement::Offload(offload) = &self.placement else {
            return 0;
        };
        let fp32 = offload.moments == OptimizerStateDtype::Fp32;
        match fp32 && self.shares(dtype, on_device, n == layout.padded_len()) {
            true => device_share_len(n, offload.stream.device_share),
            false => 0,
        }
    }

    /// The buffers [`crate::Engine::with_weights`] allocates on `rank` of `layout` for weights of
    /// `dtype`, by where they live and what they hold; `device_free` is the device's free memory
    /// when the engine is built (for `AccumulateOn::Auto`; `None`: unknown, summed on the host).
    /// Buffers of a few elements (the norm, events) are left out.
    pub fn planned_buffers(
        &self,
        layout: &FlatLayout,
        rank: usize,
        dtype: DType,
        device_free: Option<u64>,
    ) -> Vec<PlannedBuffer> {
        use BufferKind as K;
        use MemoryKind::{Device, Host};
        let p = dtype.size();
        let owned = match self.stage {
            Stage::Zero0 => 0..layout.padded_len(),
            Stage::Zero1 | Stage::Zero2 => layout.partition_range(rank),
        };
        let n = owned.len();
        let free = || device_free.map(|free| usize::try_from(free).unwrap_or(usize::MAX));
        // Where an offload sums a window of gradients (`AccumulateOn::Auto`: where the device's
        // free memory has room).
        let on_device = match &self.placement {
            Placement::Offload(offload) => {
                sums_on_device(self, offload.stream.accumulate_on, n, free)
            }
            Placement::Device => false,
        };
        // The device share's elements, whose state is held on the device only: the host's is the
        // partition's before them, its master weights filled at set-up. (Where a share cannot act
        // the engine refuses to start: `UpdatePath::new`.)
        let shared = self.acting_share(layout, n, dtype, on_device);
        // A share whose state lives in host memory holds it there from the start (staged).
        let staged = match &self.placement {
            Placement::Offload(o) if o.stream.device_share_state == ShareState::Host => shared,
            _ => 0,
        };
        let set_up = set_up_peak(self, layout.padded_len(), n - shared, shared - staged, staged, p);
        let mut lines = vec![
            line(Device, K::Weights, layout.padded_len(), p),
            line(Device, K::Gradients, layout.padded_len(), p),
            line(Host, K::SetUp, set_up, 1),
        ];
        if self.stage != Stage::Zero0 && layout.world_size() > 1 {
            lines.push(line(Device, K::Gradients, n, p));
        }
        let offload = match &self.placement {
            Placement::Device => {
                lines.push(line(Device, K::MasterAndMoments, n, 12));
                lines.push(line(Device, K::GradientAccumulator, n, 4));
                return lines;
            }
            Placement::Offload(offload) => offload,
        };
        // Every offload path's host optimizer: fp32 master weights and the moments in their dtype
        // (`zeroflow.optimizer_state_dtype`: 12 bytes per element with fp32 moments, 8 with bf16).
        let state_bytes = offload.moments.state_bytes_per_param();
        lines.push(line(Host, K::MasterAndMoments, n - shared, state_bytes));
        match offload.update {
            OffloadUpdate::ZenFlow(z) => {
                lines.extend(zenflow_buffers(layout, &owned, z.topk_ratio, p));
                lines.extend(zenflow_host_buffers(offload, z.overlap_step, n, p));
            }
            OffloadUpdate::Exact | OffloadUpdate::Delayed { .. } => {
                let partition = ExactPartition { n, shared, staged, on_device };
                lines.extend(self.exact_or_delayed_buffers(offload, partition, dtype));
            }
        }
        lines
    }

    /// [`EngineOptions::planned_buffers`] of the exact or the delayed offload step past the host
    /// optimizer's state (`UpdatePath::new`'s `exact_or_delayed`): the speculation's backups, a
    /// device share's state, and the staging and accumulators of the path the step takes
    /// (streamed, from the window's sum on the device, or through the host accumulator).
    fn exact_or_delayed_buffers(
        &self,
        offload: &Offload,
        partition: ExactPartition,
        dtype: DType,
    ) -> Vec<PlannedBuffer> {
        use BufferKind as K;
        use MemoryKind::{Device, Host};
        let ExactPartition { n, shared, staged, on_device } = partition;
        let (p, chunk, bucket) = (dtype.size(), offload.stream.chunk, self.reduce_bucket);
        let delayed = matches!(offload.update, OffloadUpdate::Delayed { .. });
        let budget = if delayed { 0 } else { offload.stream.speculation_budget };
        let streaming = self.streams(dtype);
        let summed = self.streams_sum(dtype, on_device);
        // The streaming steps keep the speculated pieces' weights until their upload.
        let with_weights = streaming || summed;
        let speculated = speculation_capacity(n - shared, budget, with_weights, p);
        let mut lines = Vec::new();
        if speculated > 0 {
            let bytes = speculated_element_bytes(with_weights, p);
            lines.push(line(Host, K::Speculation, speculated, bytes));
        }
        if staged > 0 {
            // In page-locked host memory, and a few pieces' slots on the device.
            lines.push(line(Host, K::MasterAndMoments, staged, 12));
            let slots = staged_device_bytes(staged, staged_piece(chunk));
            lines.push(line(Device, K::Staging, slots, 1));
        } else if shared > 0 {
            lines.push(line(Device, K::MasterAndMoments, shared, DEVICE_SHARE_ELEMENT_BYTES));
        }
        if streaming {
            let staging = staging_len(n, chunk);
            lines.push(line(Host, K::Staging, staging, (STAGING_BUFFERS + OUTGOING_BUFFERS) * p));
            if delayed {
                lines.push(line(Device, K::DelayedUpdate, n, 2 * p));
            }
            return lines;
        }
        if summed {
            // The window's sum on the device, streamed through f32 staging.
            lines.push(line(Device, K::GradientAccumulator, n, 4));
            let bytes = STAGING_BUFFERS * 4 + OUTGOING_BUFFERS * p;
            lines.push(line(Host, K::Staging, staging_len(n, chunk), bytes));
            return lines;
        }
        if on_device {
            lines.push(line(Device, K::GradientAccumulator, n, 4));
            let piece = bucket.min(chunk);
            let staging = staging_len(piece.min(n), piece);
            lines.push(line(Host, K::Staging, staging, STAGING_BUFFERS * 4));
        }
        lines.extend(accumulator_buffers(n, bucket, chunk, delayed, p));
        lines
    }
}

/// The most host memory the engine holds while it is built, in bytes: the initial weights (`p`
/// bytes per element of the `padded` buffer), with the staging `Device::upload` copies them up
/// through; then with the fp32 master weights of the `n` elements of the partition the host holds
/// (offload: the host's own, filled from them; those before a device share of `shared`
/// elements, whose own go up through its two upload buffers first, or of `staged` elements
/// whose state is kept in host memory, 12 bytes each, filled first); on the device, the master
/// weights, uploaded through staging once the initial weights are dropped.
fn set_up_peak(
    opts: &EngineOptions,
    padded: usize,
    n: usize,
    shared: usize,
    staged: usize,
    p: usize,
) -> usize {
    let staging = |bytes| upload_staging_bytes(bytes, UPLOAD_PIECE_BYTES);
    let weights = padded * p;
    let master = weights + 4 * n;
    let upload = weights + staging(weights);
    match opts.placement {
        Placement::Device => upload.max(master).max(4 * n + staging(4 * n)),
        Placement::Offload(_) => {
            let share = upload_staging_bytes(4 * shared, SHARE_UPLOAD_PIECE_BYTES);
            upload.max(master + 12 * staged).max(weights + share)
        }
    }
}

/// `HostAccumulator::new`'s buffers beside the optimizer state: the upload buffer, the staging,
/// A partition of `n` elements as the exact or delayed offload step holds it: the device share's
/// last `shared` elements (of them `staged` with their state in host memory), and whether a
/// window is summed on the device.
struct ExactPartition {
    n: usize,
    shared: usize,
    staged: usize,
    on_device: bool,
}

/// ZenFlow's host buffers past the host optimizer's state, for a partition of `n` elements of
/// `p` bytes each: the CPU step streams the device's window through bounded staging (f32 in, the
/// weights' type out; with `overlap_step` from a second, aside window, into the aside weights),
/// or the window is copied into the host accumulator (pieces of one element; one accumulator with
/// `overlap_step` too: the worker is joined before the next copy).
fn zenflow_host_buffers(
    offload: &Offload,
    overlap_step: bool,
    n: usize,
    p: usize,
) -> Vec<PlannedBuffer> {
    use BufferKind as K;
    use MemoryKind::{Device, Host};
    let chunk = offload.stream.chunk;
    match offload.stream.zenflow_aside {
        ZenFlowAside::Device => {
            let bytes = STAGING_BUFFERS * 4 + OUTGOING_BUFFERS * p;
            let mut lines = vec![line(Host, K::Staging, staging_len(n, chunk), bytes)];
            if overlap_step {
                lines.push(line(Device, K::GradientAccumulator, n, 4));
                lines.push(line(Device, K::DelayedUpdate, n, p));
            }
            lines
        }
        ZenFlowAside::Host => accumulator_buffers(n, 1, chunk, false, p),
    }
}

/// the fp32 accumulator, and with `spare` (the delayed update) the second accumulator.
fn accumulator_buffers(
    n: usize,
    bucket: usize,
    chunk: usize,
    spare: bool,
    p: usize,
) -> Vec<PlannedBuffer> {
    use BufferKind as K;
    use MemoryKind::Host;
    let staging = staging_len(bucket.min(n), chunk);
    let mut lines = vec![
        PlannedBuffer {
            memory: Host,
            kind: K::Staging,
            bytes: (n * p + STAGING_BUFFERS * staging * p) as u64,
        },
        line(Host, K::GradientAccumulator, n, 4),
    ];
    if spare {
        lines.push(line(Host, K::DelayedUpdate, n, 4));
    }
    lines
}

/// `ZenFlow::new`'s device buffers: the compact state of the largest selection (fp32 master and
/// moments, the gradients in the model's dtype and in f32, the weights), the column indices and
/// importance, the fp32 window; in host memory, the importance's pinned copy, and at a selection
/// the compact master weights and moments downloaded a piece at a time to hand the leaving columns
/// to the host optimizer (three f32 pieces and one download's staging: 16 bytes per element of a
/// piece of at most [`EXCHANGE_PIECE`]).
fn zenflow_buffers(
    layout: &FlatLayout,
    owned: &Range<usize>,
    ratio: f64,
    p: usize,
) -> Vec<PlannedBuffer> {
    use BufferKind as K;
    use MemoryKind::{Device, Host};
    let (capacity, indices, columns) = crate::zenflow::compact_elements(layout, owned, ratio);
    let n = owned.len().max(1);
    let compact = capacity as u64 * (12 + p as u64 + 4 + p as u64) + indices as u64 * 4;
    vec![
        PlannedBuffer {
            memory: Device,
            kind: K::ZenFlowSelected,
            bytes: compact + columns as u64 * 4,
        },
        PlannedBuffer {
            memory: Host,
            kind: K::ZenFlowSelected,
            bytes: columns as u64 * 4 + capacity.min(EXCHANGE_PIECE) as u64 * 16,
        },
        line(Device, K::GradientAccumulator, n, 4),
    ]
}

#[cfg(test)]
pub(crate) mod tests {
    use zeroflow_core::config::{Selection, UpdateInterval};
    use zeroflow_core::layout::{Alignment, ParamSpec};
    use zeroflow_device::HostMemory;
    use zeroflow_optim::AdamWConfig;

    use super::*;
    use crate::{LossScaler, Offload, ZenFlowOptions};

    fn layout_of(world: usize) -> FlatLayout {
        let specs = [ParamSpec::new("w", [96, 40]), ParamSpec::new("b", [40])];
        FlatLayout::new(&specs, world, Alignment::default()).unwrap()
    }

    /// ZeRO-2 with clipping at 1 and `placement`, `grad_accum` micro-steps per step.
    pub(crate) fn options(placement: Placement, grad_accum: u64) -> EngineOptions {
        EngineOptions {
            stage: Stage::Zero2,
            grad_accum,
            clip: Some(1.0),
            reduce_bucket: 1000,
            adamw: AdamWConfig::default(),
            scaler: LossScaler::None,
            placement,
        }
    }

    fn offload(update: OffloadUpdate, chunk: usize) -> Placement {
        let mut offload = Offload::exact(HostMemory::Pinned, 1);
        offload.update = update;
        offload.stream.chunk = chunk;
        Placement::Offload(offload)
    }

    fn total(lines: &[PlannedBuffer], memory: MemoryKind, kind: Option<BufferKind>) -> u64 {
        let wanted = |l: &&PlannedBuffer| l.memory == memory && kind.is_none_or(|k| l.kind == k);
        lines.iter().filter(wanted).map(|l| l.bytes).sum()
    }

    /// Without offload the device holds the weights and gradients of the whole padded buffer
    /// (bf16) and, for its partition, fp32 master weights and moments and the fp32 accumulator:
    /// 2 + 2 + (12 + 4) / world bytes per element, plus the reduced partition with two ranks.
    #[test]
    fn the_device_optimizer_holds_sixteen_bytes_per_element_of_its_partition() {
        let layout = layout_of(2);
        let (padded, n) = (layout.padded_len() as u64, layout.partition_len() as u64);
        let lines = options(Placement::Device, 1).planned_buffers(&layout, 1, DType::Bf16, None);
        assert_eq!(total(&lines, MemoryKind::Device, None), 4 * padded + 2 * n + 16 * n);
        // Set-up on one rank: the master weights and their upload's staging (the whole small
        // buffer: one piece), 8 B per element, more than the initial bf16 weights with theirs
        // (4 B) or with the master (6 B).
        let layout = layout_of(1);
        let padded = layout.padded_len() as u64;
        let lines = options(Placement::Device, 1).planned_buffers(&layout, 0, DType::Bf16, None);
        assert_eq!(total(&lines, MemoryKind::Host, Some(BufferKind::SetUp)), 8 * padded);
    }

    /// The streaming exact step holds 12 bytes per element of host state and six staging
    /// buffers of one chunk of bf16; with chunks longer than the partition, six partitions.
    #[test]
    fn the_streaming_offload_holds_twelve_bytes_and_six_chunks_of_staging() {
        let layout = layout_of(1);
        let n = layout.partition_len() as u64;
        for (chunk, staged) in [(256, 256), (1 << 20, n)] {
            let opts = options(offload(OffloadUpdate::Exact, chunk), 1);
            let lines = opts.planned_buffers(&layout, 0, DType::Bf16, None);
            let host = total(&lines, MemoryKind::Host, None)
                - total(&lines, MemoryKind::Host, Some(BufferKind::SetUp));
            assert_eq!(host, 12 * n + 6 * staged * 2, "chunk {chunk}");
            assert_eq!(total(&lines, MemoryKind::Device, None), 4 * n);
        }
    }

    /// The plans of the exact offload of `layout` (bf16, `accum` micro-steps summed on the
    /// device, stream chunks of `chunk`) without a share and with a share of 0.3 whose state is
    /// kept as `state` says.
    fn share_plans(
        layout: &FlatLayout,
        accum: u64,
        chunk: usize,
        state: ShareState,
    ) -> (Vec<PlannedBuffer>, Vec<PlannedBuffer>) {
        let mut placement = offload(OffloadUpdate::Exact, chunk);
        if let Placement::Offload(offload) = &mut placement {
            offload.stream.accumulate_on = AccumulateOn::Device;
        }
        let plan = |placement: Placement| {
            options(placement, accum).planned_buffers(layout, 0, DType::Bf16, None)
        };
        let plain = plan(placement.clone());
        if let Placement::Offload(offload) = &mut placement {
            offload.stream.device_share = 0.3;
            offload.stream.device_share_state = state;
        }
        (plain, plan(placement))
    }

    /// A device share adds its state and f32 gradients (16 bytes per element, whole packs of
    /// eight) to the device and takes its state (12 bytes per element) from the host, and its
    /// master weights from the host's set-up: with one micro-step per step, and with a window of
    /// four summed on the device.
    #[test]
    fn a_device_share_holds_sixteen_bytes_per_element_on_the_device() {
        let layout = layout_of(1);
        let n = layout.partition_len();
        for accum in [1, 4] {
            let (plain, lines) = share_plans(&layout, accum, 256, ShareState::Device);
            let share = (n * 3 / 10 / 8 * 8) as u64;
            assert!(share > 0);
            let device = |lines: &[PlannedBuffer]| total(lines, MemoryKind::Device, None);
            assert_eq!(device(&lines), device(&plain) + 16 * share, "accumulation {accum}");
            let host = |lines: &[PlannedBuffer], kind| total(lines, MemoryKind::Host, Some(kind));
            let state = BufferKind::MasterAndMoments;
            assert_eq!(
                host(&lines, state),
                host(&plain, state) - 12 * share,
                "accumulation {accum}"
            );
            // The set-up fills the host's master weights of the elements before the share only
            // (bf16 weights: the initial weights and the master weights are its peak here, more
            // than the weights with their upload's staging or with the share's upload buffer).
            let padded = layout.padded_len() as u64;
            let set_up = BufferKind::SetUp;
            assert_eq!(host(&plain, set_up), 2 * padded + 4 * n as u64, "accumulation {accum}");
            let shared = 2 * padded + 4 * (n as u64 - share);
            assert!(shared > (2 * padded + 4 * share).max(4 * padded));
            assert_eq!(host(&lines, set_up), shared, "accumulation {accum}");
        }
    }

    /// A share staged from host memory keeps the whole partition's state on the host (12 bytes
    /// per element, the share's in pieces of its own) and holds only its slots on the device:
    /// three pieces of twice the chunk, 16 bytes per element, or fewer where the share is
    /// smaller; its master weights are filled at set-up beside the host's.
    #[test]
    fn a_share_staged_from_host_memory_holds_its_slots_on_the_device() {
        let layout = layout_of(1);
        let n = layout.partition_len();
        for (accum, chunk) in [(1, 16), (4, 16), (1, 1 << 20)] {
            let (plain, lines) = share_plans(&layout, accum, chunk, ShareState::Host);
            let share = (n * 3 / 10 / 8 * 8) as u64;
            let piece = (2 * chunk as u64).min(share);
            let slots = 3.min(share.div_ceil(2 * chunk as u64));
            let what = format!("accumulation {accum}, chunk {chunk}");
            assert!(slots >= 1 && share > 0, "{what}");
            let device = |lines: &[PlannedBuffer]| total(lines, MemoryKind::Device, None);
            assert_eq!(device(&lines), device(&plain) + slots * 16 * piece, "{what}");
            let host = |lines: &[PlannedBuffer], kind| total(lines, MemoryKind::Host, Some(kind));
            let state = BufferKind::MasterAndMoments;
            assert_eq!(host(&lines, state), host(&plain, state), "{what}");
            assert_eq!(host(&lines, state), 12 * n as u64, "{what}");
            let set_up = BufferKind::SetUp;
            let padded = layout.padded_len() as u64;
            let staged = 2 * padded + 4 * (n as u64 - share) + 12 * share;
            assert_eq!(host(&lines, set_up), staged, "{what}");
        }
    }

    /// The streaming step's speculation backs up and keeps the weights of at most the elements
    /// whose state the host holds (14 bytes each with bf16 weights): all of the partition, or
    /// those before a device share, which it acts beside with one micro-step per step and with
    /// a window summed on the device alike.
    #[test]
    fn the_speculation_counts_the_hosts_elements_only_beside_a_share() {
        let layout = layout_of(1);
        let n = layout.partition_len();
        let speculating = |share: f64, accum: u64| {
            let mut placement = offload(OffloadUpdate::Exact, 256);
            if let Placement::Offload(offload) = &mut placement {
                offload.stream.speculation_budget = usize::MAX;
                offload.stream.device_share = share;
                offload.stream.accumulate_on = AccumulateOn::Device;
            }
            options(placement, accum)
        };
        let kind = Some(BufferKind::Speculation);
        let lines = speculating(0.0, 1).planned_buffers(&layout, 0, DType::Bf16, None);
        assert_eq!(total(&lines, MemoryKind::Host, kind), 14 * n as u64);
        let opts = speculating(0.3, 1);
        assert!(opts.shares(DType::Bf16, false, true), "one micro-step: the share acts");
        let share = n * 3 / 10 / 8 * 8;
        let lines = opts.planned_buffers(&layout, 0, DType::Bf16, None);
        assert_eq!(total(&lines, MemoryKind::Host, kind), 14 * (n - share) as u64);
        let summed = speculating(0.3, 4);
        assert!(summed.shares(DType::Bf16, true, true), "summed on the device: the share acts");
        let lines = summed.planned_buffers(&layout, 0, DType::Bf16, None);
        assert_eq!(total(&lines, MemoryKind::Host, kind), 14 * (n - share) as u64);
    }

    /// With gradient accumulation the offload accumulates on the host (Auto with an unknown
    /// device: the host): the upload buffer, the accumulator and four staging buffers of one
    /// bucket beside the state; `AccumulateOn::Device` moves the sum to an fp32 device buffer.
    #[test]
    fn the_accumulating_offload_counts_its_accumulator_where_it_sums() {
        let layout = layout_of(1);
        let n = layout.partition_len() as u64;
        let mut opts = options(offload(OffloadUpdate::Exact, 1 << 20), 4);
        let lines = opts.planned_buffers(&layout, 0, DType::Bf16, None);
        let acc = Some(BufferKind::GradientAccumulator);
        assert_eq!(total(&lines, MemoryKind::Host, acc), 4 * n);
        assert_eq!(total(&lines, MemoryKind::Device, acc), 0);
        let staging = Some(BufferKind::Staging);
        assert_eq!(total(&lines, MemoryKind::Host, staging), 2 * n + 4 * 1000 * 2);
        opts.offload_mut().unwrap().stream.accumulate_on = AccumulateOn::Device;
        let lines = opts.planned_buffers(&layout, 0, DType::Bf16, None);
        assert_eq!(total(&lines, MemoryKind::Device, acc), 4 * n);
    }

    /// With the exact update the device's sum streams through the step: no host accumulator and
    /// no upload buffer, only the state and six chunks of staging (four f32, two bf16), as with
    /// one micro-step; the delayed update still copies the sum into the host accumulator. `Auto`
    /// sums on the device where its free memory is at least twice the accumulator.
    #[test]
    fn the_summed_offload_holds_the_state_and_staging_only() {
        let layout = layout_of(1);
        let n = layout.partition_len() as u64;
        let host_beside_set_up = |opts: &EngineOptions, free: Option<u64>| {
            let lines = opts.planned_buffers(&layout, 0, DType::Bf16, free);
            let host = total(&lines, MemoryKind::Host, None)
                - total(&lines, MemoryKind::Host, Some(BufferKind::SetUp));
            (host, total(&lines, MemoryKind::Device, Some(BufferKind::GradientAccumulator)))
        };
        let opts = options(offload(OffloadUpdate::Exact, 1 << 20), 4);
        let summed = (12 * n + n * (4 * 4 + 2 * 2), 4 * n);
        assert_eq!(host_beside_set_up(&opts, Some(8 * n)), summed);
        // Less than twice the accumulator free: the host sums (accumulator, upload, staging).
        let on_host = host_beside_set_up(&opts, Some(8 * n - 1));
        assert_eq!(on_host, (12 * n + 4 * n + 2 * n + 4 * 1000 * 2, 0));
        let delayed = options(offload(OffloadUpdate::Delayed { warmup: 2 }, 1 << 20), 4);
        let (host, device) = host_beside_set_up(&delayed, Some(8 * n));
        assert_eq!(device, 4 * n);
        assert!(host >= 12 * n + 2 * 4 * n + 2 * n, "the delayed update's host sum: {host}");
    }

    /// ZenFlow with every column selected holds the whole partition in compact buffers; with
    /// ratio 0 only one element per buffer. Its fp32 window is on the device either way.
    #[test]
    fn zenflow_compact_state_grows_with_the_ratio() {
        let layout = layout_of(1);
        let n = layout.partition_len() as u64;
        let zenflow = |topk_ratio| {
            let z = ZenFlowOptions {
                topk_ratio,
                selection: Selection::Step { interval: 8 },
                update_interval: UpdateInterval::Every(4),
                auto_ratio: 0.99,
                overlap_step: true,
                full_warm_up_rounds: 0,
            };
            let opts = options(offload(OffloadUpdate::ZenFlow(z), 1 << 20), 1);
            let lines = opts.planned_buffers(&layout, 0, DType::Bf16, None);
            total(&lines, MemoryKind::Device, Some(BufferKind::ZenFlowSelected))
        };
        // The importance: one f32 per column of the 2-D weight.
        let columns = 40;
        // Every element: fp32 master and moments, bf16 and f32 gradients, bf16 weights; an
        // index per selected column (the bias is one column of 40 rows).
        let params = 96 * 40 + 40;
        assert_eq!(zenflow(1.0), params * 20 + (40 + 1) * 4 + columns * 4);
        assert_eq!(zenflow(0.0), 20 + 4 + columns * 4);
        assert!(n >= params);
    }
}
