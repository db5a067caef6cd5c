//! How the CUDA backend runs a [`Plan`]: the plan's launches turned, once, into operations over
//! places in the GPU's buffers. Pure code (no GPU), so that its properties are tested on any
//! machine.
//!
//! Three decisions are made here:
//!
//! - **Where each range lives.** Activations are bf16 at the plan's own offsets, except those the
//!   plan lists as f32 ([`Plan::f32_acts`]: norm statistics, the losses and flash attention's
//!   log-sum-exp), which live in a small f32 buffer (`Stats`; their bf16 slots in the activation
//!   buffer stay unused). Activation
//!   gradients are packed into a buffer allocated by liveness: a range gets memory from the launch
//!   that first writes it to the launch that last reads it, first fit, so the blocks of backward
//!   reuse the same few gigabytes instead of holding one gradient per activation.
//! - **Overwrite or accumulate.** The plan zeroes every accumulated activation gradient first and
//!   then adds to it. Here the first launch that writes a gradient overwrites it instead (cuBLASLt
//!   `beta = 0`, an `accumulate` flag of 0), later ones add, and the zeroing launch is dropped. The
//!   schedule refuses a plan where that is not exact (a partial overlap, a read before any write).
//!   A checkpointed plan ([`crate::checkpoint`]) zeroes its layers' shared internal gradients
//!   again before each layer's backward: each such launch (and each whole overwrite) ends a life
//!   of the ranges it covers, the next write overwrites, and liveness packs every life on its
//!   own (the `lives` module).
//! - **Fusions.** A forward matmul with bias followed by the GELU of its output (a family kernel
//!   that is [`Fusable::Gelu`]; in forward, or recomputed in a checkpointed backward) becomes one
//!   cuBLASLt call with the `BiasGelu` epilogue (the pre-GELU values go to the GELU's input, as
//!   the plan keeps them). A backward matmul whose input gradient only feeds the GELU backward
//!   becomes one call with the `DGelu` epilogue writing the GELU input's gradient directly. Both
//!   need the GELU's width to be a multiple of 8 (cuBLASLt's rule for the auxiliary buffer);
//!   other widths keep the separate GELU kernels.

use std::collections::HashMap;
use std::ops::Range;

use self::lives::{ArgUse, accumulate_flags};
use crate::error::NnError;
use crate::kernels::{Fusable, Kernel, LayerKernel, WeightLayout};
use crate::plan::{Arg, Buf, GradsReady, Launch, Plan, Step};

mod lives;

/// Activation-gradient offsets are multiples of this many elements (128 bytes of bf16), so every
/// range satisfies the 16-byte alignment of vector loads and cuBLASLt.
pub const ACT_GRAD_ALIGN: usize = 64;

/// A buffer of the CUDA backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// The engine's flat bf16 parameters.
    Params,
    /// The engine's flat bf16 gradients (always accumulated into).
    Grads,
    /// The bf16 activations, at the plan's offsets.
    Acts,
    /// The packed bf16 activation gradients.
    ActGrads,
    /// The f32 activations: norm statistics, losses and flash attention's log-sum-exp.
    Stats,
    /// The u32 token buffer: inputs at 0, targets at `tokens` (see [`Schedule::targets_offset`]),
    /// a packed plan's positions at `2 · tokens` ([`Schedule::positions_offset`]).
    Tokens,
}

/// Where one argument of an operation lives, and whether a written gradient is added to (`true`)
/// or overwritten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub space: Space,
    pub offset: usize,
    pub len: usize,
    pub accumulate: bool,
}

impl Place {
    pub fn end(&self) -> usize {
        self.offset + self.len
    }
}

/// What an operation computes.
#[derive(Clone, Debug, PartialEq)]
pub enum OpKind<X> {
    /// One launch of the plan, its arguments in the order [`Kernel`] documents.
    Kernel(Kernel<X>),
    /// `Matmul { bias: true }` + `Gelu`. Arguments: W out (after GELU), W pre-GELU, R inp, R
    /// weight, R bias.
    MatmulBiasGelu { c: usize, oc: usize, layout: WeightLayout },
    /// `MatmulBackward` + `GeluBackward`. Arguments: W the gradient of the GELU's input, U
    /// dweight, [U dbias], R dout, R inp (the GELU's output), R weight, R pre-GELU.
    MatmulBackwardDGelu { c: usize, oc: usize, layout: WeightLayout, bias: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Op<X> {
    pub kind: OpKind<X>,
    pub args: Vec<Place>,
}

impl<X: LayerKernel> Op<X> {
    /// A name for reports: the kernel's, with the shape for matmuls.
    pub fn name(&self) -> String {
        match &self.kind {
            OpKind::Kernel(Kernel::Matmul { c, oc, .. }) => format!("matmul_forward {c}x{oc}"),
            OpKind::Kernel(Kernel::MatmulBackward { c, oc, .. }) => {
                format!("matmul_backward {c}x{oc}")
            }
            OpKind::Kernel(kernel) => kernel.name().to_string(),
            OpKind::MatmulBiasGelu { c, oc, .. } => format!("matmul_bias_gelu {c}x{oc}"),
            OpKind::MatmulBackwardDGelu { c, oc, .. } => format!("matmul_backward_dgelu {c}x{oc}"),
        }
    }
}

/// One step of backward.
#[derive(Clone, Debug, PartialEq)]
pub enum BackwardOp<X> {
    Op(Op<X>),
    Ready(GradsReady),
}

/// The operations of forward and backward and the sizes of the buffers they use.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule<X> {
    pub forward: Vec<Op<X>>,
    pub backward: Vec<BackwardOp<X>>,
    /// Elements of the bf16 activation buffer.
    pub acts_len: usize,
    /// Elements of the packed bf16 activation-gradient buffer.
    pub act_grads_len: usize,
    /// Elements of the f32 statistics buffer.
    pub stats_len: usize,
    /// Tokens per micro-batch.
    pub tokens: usize,
    /// Elements of the u32 token buffer the schedule addresses (inputs and targets, and a packed
    /// plan's positions).
    pub tokens_len: usize,
    /// Where the mean loss is, in the statistics buffer.
    pub loss_offset: usize,
}

impl<X: LayerKernel> Schedule<X> {
    /// The schedule of `plan`; `fuse_gelu` allows the GELU fusions (where the widths permit).
    pub fn new(plan: &Plan<X>, fuse_gelu: bool) -> Result<Self, NnError> {
        let stats = StatsMap::new(plan);
        let tokens = plan.tokens();
        let place = |arg: &Arg, using: ArgUse| -> Result<Place, NnError> {
            let (space, offset) = match arg.buf {
                Buf::Params => (Space::Params, arg.range.start),
                Buf::Grads => (Space::Grads, arg.range.start),
                Buf::Acts => match stats.get(&arg.range) {
                    Some(offset) => (Space::Stats, offset),
                    None => (Space::Acts, arg.range.start),
                },
                // Placeholder offsets, one per life of a range, replaced once liveness has
                // packed them.
                Buf::ActGrads => (Space::ActGrads, using.life_key(arg, plan.acts_len)),
                Buf::Inputs => (Space::Tokens, arg.range.start),
                Buf::Targets => (Space::Tokens, tokens + arg.range.start),
                Buf::Positions => (Space::Tokens, 2 * tokens + arg.range.start),
            };
            Ok(Place { space, offset, len: arg.range.len(), accumulate: using.accumulate })
        };
        let forward = fuse_forward(&plan.forward, fuse_gelu, &place)?;
        let flags = accumulate_flags(&plan.backward)?;
        let mut backward = fuse_backward(&plan.backward, &flags, fuse_gelu, &place)?;
        let act_grads_len = pack_act_grads(&mut backward, plan.acts_len.max(1));
        let loss_offset = stats.get(&plan.loss).ok_or_else(|| {
            schedule_error(format!("the loss {:?} is not among the f32 activations", plan.loss))
        })?;
        Ok(Schedule {
            forward,
            backward,
            acts_len: plan.acts_len,
            act_grads_len,
            stats_len: stats.len,
            tokens,
            tokens_len: if plan.is_packed() { 3 * tokens } else { 2 * tokens },
            loss_offset,
        })
    }

    /// The backward operations of `plan` as [`Schedule::new`] makes them before it packs the
    /// activation gradients (each at a key of its life: its plan offset, plus the plan's
    /// activation length for every time a zeroing launch has ended a life of the range before):
    /// for tests of the packing.
    pub fn unpacked_backward(
        plan: &Plan<X>,
        fuse_gelu: bool,
    ) -> Result<Vec<BackwardOp<X>>, NnError> {
        let place = |arg: &Arg, using: ArgUse| -> Result<Place, NnError> {
            let (space, offset) = match arg.buf {
                Buf::ActGrads => (Space::ActGrads, using.life_key(arg, plan.acts_len)),
                _ => (Space::Acts, arg.range.start),
            };
            Ok(Place { space, offset, len: arg.range.len(), accumulate: using.accumulate })
        };
        let flags = accumulate_flags(&plan.backward)?;
        fuse_backward(&plan.backward, &flags, fuse_gelu, &place)
    }

    /// Whether each argument of each backward launch of `plan` accumulates (see
    /// [`Schedule::new`]; none for the zeroing launch and the notices): for tests.
    pub fn accumulate_flags(plan: &Plan<X>) -> Result<Vec<Vec<bool>>, NnError> {
        let uses = accumulate_flags(&plan.backward)?;
        Ok(uses.iter().map(|args| args.iter().map(|using| using.accumulate).collect()).collect())
    }

    /// Where the targets start in the token buffer.
    pub fn targets_offset(&self) -> usize {
        self.tokens
    }

    /// Where a packed plan's positions start in the token buffer (after the targets).
    pub fn positions_offset(&self) -> usize {
        2 * self.tokens
    }

    /// Every operation of forward and backward.
    pub fn ops(&self) -> impl Iterator<Item = &Op<X>> {
        self.forward.iter().chain(self.backward.iter().filter_map(|step| match step {
            BackwardOp::Op(op) => Some(op),
            BackwardOp::Ready(_) => None,
        }))
    }
}

/// The activation ranges kept in f32 (the plan's [`Plan::f32_acts`]), and their offsets in the
/// statistics buffer.
struct StatsMap {
    offsets: HashMap<(usize, usize), usize>,
    len: usize,
}

impl StatsMap {
    fn new<X>(plan: &Plan<X>) -> Self {
        let mut offsets = HashMap::new();
        let mut len = 0;
        for range in &plan.f32_acts {
            if offsets.contains_key(&(range.start, range.end)) {
                continue;
            }
            offsets.insert((range.start, range.end), len);
            // Keep 16-byte alignment for every range.
            len += range.len().div_ceil(4) * 4;
        }
        StatsMap { offsets, len }
    }

    fn get(&self, range: &Range<usize>) -> Option<usize> {
        self.offsets.get(&(range.start, range.end)).copied()
    }
}

type PlaceFn<'a> = dyn Fn(&Arg, ArgUse) -> Result<Place, NnError> + 'a;

fn schedule_error(reason: String) -> NnError {
    NnError::Kernel { kernel: "cuda schedule", reason }
}

/// The forward launches as operations, with matmul + GELU fused.
fn fuse_forward<X: LayerKernel>(
    launches: &[Launch<X>],
    fuse_gelu: bool,
    place: &PlaceFn<'_>,
) -> Result<Vec<Op<X>>, NnError> {
    let mut ops = Vec::with_capacity(launches.len());
    let mut i = 0;
    while i < launches.len() {
        let launch = &launches[i];
        if let Some(fused) = fuse_matmul_gelu(launch, launches.get(i + 1), fuse_gelu, place)? {
            ops.push(fused);
            i += 2;
            continue;
        }
        let args = launch.args.iter().map(|arg| place(arg, ArgUse::default()));
        ops.push(Op {
            kind: OpKind::Kernel(launch.kernel.clone()),
            args: args.collect::<Result<_, _>>()?,
        });
        i += 1;
    }
    Ok(ops)
}

/// A forward matmul with bias and the GELU of its output after it (`next`) as one operation,
/// where `fuse_gelu` allows it and the width permits; `None` otherwise.
fn fuse_matmul_gelu<X: LayerKernel>(
    launch: &Launch<X>,
    next: Option<&Launch<X>>,
    fuse_gelu: bool,
    place: &PlaceFn<'_>,
) -> Result<Option<Op<X>>, NnError> {
    let args = |launch: &Launch<X>| -> Result<Vec<Place>, NnError> {
        launch.args.iter().map(|arg| place(arg, ArgUse::default())).collect()
    };
    if let (Kernel::Matmul { c, oc, layout, bias: true }, Some(next)) = (&launch.kernel, next)
        && fuse_gelu
        && next.kernel.fusable() == Some(Fusable::Gelu)
        && oc.is_multiple_of(8)
        && next.args[1].range == launch.args[0].range
        && next.args[1].buf == launch.args[0].buf
    {
        // [out, inp, weight, bias] and [gelu out, gelu inp = out].
        let (matmul, gelu) = (args(launch)?, args(next)?);
        return Ok(Some(Op {
            kind: OpKind::MatmulBiasGelu { c: *c, oc: *oc, layout: *layout },
            args: vec![gelu[0], matmul[0], matmul[1], matmul[2], matmul[3]],
        }));
    }
    Ok(None)
}

/// The backward launches as operations, with matmul backward + GELU backward fused where the
/// matmul's input gradient is written first there and read only by the GELU backward, and the
/// forward launches a checkpointed plan recomputes fused as forward's are.
fn fuse_backward<X: LayerKernel>(
    steps: &[Step<X>],
    flags: &[Vec<ArgUse>],
    fuse_gelu: bool,
    place: &PlaceFn<'_>,
) -> Result<Vec<BackwardOp<X>>, NnError> {
    let mut ops = Vec::with_capacity(steps.len());
    let args = |i: usize| -> Result<Vec<Place>, NnError> {
        let Step::Launch(launch) = &steps[i] else { unreachable!("a launch") };
        launch.args.iter().zip(&flags[i]).map(|(arg, &using)| place(arg, using)).collect()
    };
    let launch_at = |i: usize| match steps.get(i) {
        Some(Step::Launch(launch)) => Some(launch),
        _ => None,
    };
    let mut i = 0;
    while i < steps.len() {
        let launch = match &steps[i] {
            Step::GradsReady(ready) => {
                ops.push(BackwardOp::Ready(ready.clone()));
                i += 1;
                continue;
            }
            Step::Launch(launch) => launch,
        };
        if matches!(launch.kernel, Kernel::Zero { .. }) {
            i += 1;
            continue;
        }
        if let Some(fused) = fuse_matmul_gelu(launch, launch_at(i + 1), fuse_gelu, place)? {
            ops.push(BackwardOp::Op(fused));
            i += 2;
            continue;
        }
        if let Kernel::MatmulBackward { c, oc, layout, bias } = launch.kernel
            && fuse_gelu
            && let Some(next) = launch_at(i + 1)
            && next.kernel.fusable() == Some(Fusable::GeluBackward)
            && c.is_multiple_of(8)
            && next.args[2].range == launch.args[0].range
            && !flags[i][0].accumulate
            && !flags[i + 1][0].accumulate
            && !used_again(&steps[i + 2..], &launch.args[0])
        {
            // [dinp, dweight, (dbias), dout, inp, weight] and [gelu dinp, gelu inp, gelu dout].
            let (matmul, gelu) = (args(i)?, args(i + 1)?);
            let mut fused = vec![gelu[0]];
            fused.extend_from_slice(&matmul[1..]);
            fused.push(gelu[1]);
            ops.push(BackwardOp::Op(Op {
                kind: OpKind::MatmulBackwardDGelu { c, oc, layout, bias },
                args: fused,
            }));
            i += 2;
            continue;
        }
        ops.push(BackwardOp::Op(Op {
            kind: OpKind::Kernel(launch.kernel.clone()),
            args: args(i)?,
        }));
        i += 1;
    }
    Ok(ops)
}

/// Whether a step of `steps` uses the range of `arg` before a zeroing launch covers it (which
/// ends that life of the range).
fn used_again<X>(steps: &[Step<X>], arg: &Arg) -> bool {
    for step in steps {
        if let Step::Launch(launch) = step
            && matches!(launch.kernel, crate::kernels::Kernel::Zero { .. })
            && launch.args.iter().any(|zeroed| {
                zeroed.buf == arg.buf
                    && zeroed.range.start <= arg.range.start
                    && arg.range.end <= zeroed.range.end
            })
        {
            return false;
        }
        if touches(step, arg) {
            return true;
        }
    }
    false
}

/// Whether `step` uses the buffer range of `arg`.
fn touches<X>(step: &Step<X>, arg: &Arg) -> bool {
    match step {
        Step::Launch(launch) => launch.args.iter().any(|other| {
            other.buf == arg.buf
                && other.range.start < arg.range.end
                && arg.range.start < other.range.end
        }),
        Step::GradsReady(_) => false,
    }
}

/// Packs the activation gradients by liveness (first fit) and rewrites their offsets; returns the
/// buffer's length. A range is live from the operation that first uses it to the one that last
/// does, both included, so an operation's inputs and outputs never share memory.
fn pack_act_grads<X>(backward: &mut [BackwardOp<X>], acts_len: usize) -> usize {
    // The plan offset of each range → (first op, last op, length).
    let mut lives: HashMap<usize, (usize, usize, usize)> = HashMap::new();
    for (i, step) in backward.iter().enumerate() {
        let BackwardOp::Op(op) = step else { continue };
        for arg in op.args.iter().filter(|a| a.space == Space::ActGrads) {
            lives.entry(arg.offset).and_modify(|life| life.1 = i).or_insert((i, i, arg.len));
        }
    }
    let mut by_first: Vec<(usize, usize, usize, usize)> =
        lives.iter().map(|(&key, &(first, last, len))| (first, key, last, len)).collect();
    // Ranges born together are placed in the order of their plan offsets (a key less its lives).
    by_first.sort_unstable_by_key(|&(first, key, ..)| (first, key % acts_len, key));
    let mut free = FreeList::default();
    let mut packed: HashMap<usize, usize> = HashMap::new();
    let mut ending: Vec<(usize, usize, usize)> = Vec::new(); // (last, offset, size)
    let mut next = by_first.iter().peekable();
    for i in 0..backward.len() {
        while let Some(&&(first, key, last, len)) = next.peek()
            && first == i
        {
            let size = len.div_ceil(ACT_GRAD_ALIGN) * ACT_GRAD_ALIGN;
            let offset = free.take(size);
            packed.insert(key, offset);
            ending.push((last, offset, size));
            next.next();
        }
        ending.retain(|&(last, offset, size)| {
            if last == i {
                free.give(offset, size);
            }
            last != i
        });
    }
    for step in backward.iter_mut() {
        let BackwardOp::Op(op) = step else { continue };
        for arg in op.args.iter_mut().filter(|a| a.space == Space::ActGrads) {
            arg.offset = packed[&arg.offset];
        }
    }
    free.end
}

/// Free ranges of a growing buffer (sorted, merged), allocated first fit.
#[derive(Debug, Default)]
struct FreeList {
    free: Vec<Range<usize>>,
    end: usize,
}

impl FreeList {
    fn take(&mut self, size: usize) -> usize {
        if let Some(i) = self.free.iter().position(|r| r.len() >= size) {
            let offset = self.free[i].start;
            self.free[i].start += size;
            if self.free[i].is_empty() {
                self.free.remove(i);
            }
            return offset;
        }
        // Grow the buffer, starting inside a free range that ends at the end, if any.
        let offset = match self.free.last() {
            Some(last) if last.end == self.end => {
                let start = last.start;
                self.free.pop();
                start
            }
            _ => self.end,
        };
        self.end = offset + size;
        offset
    }

    fn give(&mut self, offset: usize, size: usize) {
        let at = self.free.partition_point(|r| r.start < offset);
        self.free.insert(at, offset..offset + size);
        // Merge with the neighbours.
        if at + 1 < self.free.len() && self.free[at].end == self.free[at + 1].start {
            self.free[at].end = self.free[at + 1].end;
            self.free.remove(at + 1);
        }
        if at > 0 && self.free[at - 1].end == self.free[at].start {
            self.free[at - 1].end = self.free[at].end;
            self.free.remove(at);
        }
    }
}
