//! How the CUDA backend runs a [`Plan`]: the plan's launches turned, once, into operations over
//! places in the GPU's buffers. Pure code (no GPU), so that its properties are tested on any
//! machine.
//!
//! Three decisions are made here:
//!
//! - **Where each range lives.** Activations are bf16 at the plan's own offsets, except the
//!   LayerNorm statistics, the losses and flash attention's log-sum-exp, which live in a small f32
//!   buffer (`Stats`; their bf16 slots in the activation buffer stay unused). Activation
//!   gradients are packed into a buffer allocated by liveness: a range gets memory from the launch
//!   that first writes it to the launch that last reads it, first fit, so the blocks of backward
//!   reuse the same few gigabytes instead of holding one gradient per activation.
//! - **Overwrite or accumulate.** The plan zeroes every accumulated activation gradient first and
//!   then adds to it. Here the first launch that writes a gradient overwrites it instead (cuBLASLt
//!   `beta = 0`, an `accumulate` flag of 0), later ones add, and the zeroing launch is dropped. The
//!   schedule refuses a plan where that is not exact (a partial overlap, a read before any write).
//! - **Fusions.** A forward matmul with bias followed by the GELU of its output becomes one
//!   cuBLASLt call with the `BiasGelu` epilogue (the pre-GELU values go to the GELU's input, as
//!   the plan keeps them). A backward matmul whose input gradient only feeds the GELU backward
//!   becomes one call with the `DGelu` epilogue writing the GELU input's gradient directly. Both
//!   need the GELU's width to be a multiple of 8 (cuBLASLt's rule for the auxiliary buffer);
//!   other widths keep the separate GELU kernels.

use std::collections::HashMap;
use std::ops::Range;

use crate::error::GptError;
use crate::kernels::{Kernel, WeightLayout};
use crate::params::GradsReady;
use crate::plan::{Access, Arg, AttentionActs, Buf, Launch, Plan, Step};

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
    /// The f32 LayerNorm statistics, losses and flash attention's log-sum-exp.
    Stats,
    /// The u32 token buffer: inputs at 0, targets at `tokens` (see [`Schedule::targets_offset`]).
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
pub enum OpKind {
    /// One launch of the plan, its arguments in the order [`Kernel`] documents.
    Kernel(Kernel),
    /// `Matmul { bias: true }` + `Gelu`. Arguments: W out (after GELU), W pre-GELU, R inp, R
    /// weight, R bias.
    MatmulBiasGelu { c: usize, oc: usize, layout: WeightLayout },
    /// `MatmulBackward` + `GeluBackward`. Arguments: W the gradient of the GELU's input, U
    /// dweight, [U dbias], R dout, R inp (the GELU's output), R weight, R pre-GELU.
    MatmulBackwardDGelu { c: usize, oc: usize, layout: WeightLayout, bias: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Op {
    pub kind: OpKind,
    pub args: Vec<Place>,
}

impl Op {
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
pub enum BackwardOp {
    Op(Op),
    Ready(GradsReady),
}

/// The operations of forward and backward and the sizes of the buffers they use.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub forward: Vec<Op>,
    pub backward: Vec<BackwardOp>,
    /// Elements of the bf16 activation buffer.
    pub acts_len: usize,
    /// Elements of the packed bf16 activation-gradient buffer.
    pub act_grads_len: usize,
    /// Elements of the f32 statistics buffer.
    pub stats_len: usize,
    /// Elements of the u32 token buffer the schedule addresses (inputs and targets).
    pub tokens_len: usize,
    /// Where the mean loss is, in the statistics buffer.
    pub loss_offset: usize,
}

impl Schedule {
    /// The schedule of `plan`; `fuse_gelu` allows the GELU fusions (where the widths permit).
    pub fn new(plan: &Plan, fuse_gelu: bool) -> Result<Self, GptError> {
        let stats = StatsMap::new(plan);
        let tokens = plan.tokens();
        let place = |arg: &Arg, accumulate: bool| -> Result<Place, GptError> {
            let (space, offset) = match arg.buf {
                Buf::Params => (Space::Params, arg.range.start),
                Buf::Grads => (Space::Grads, arg.range.start),
                Buf::Acts => match stats.get(&arg.range) {
                    Some(offset) => (Space::Stats, offset),
                    None => (Space::Acts, arg.range.start),
                },
                // Placeholder offsets: the plan's, replaced once liveness has packed them.
                Buf::ActGrads => (Space::ActGrads, arg.range.start),
                Buf::Inputs => (Space::Tokens, arg.range.start),
                Buf::Targets => (Space::Tokens, tokens + arg.range.start),
            };
            Ok(Place { space, offset, len: arg.range.len(), accumulate })
        };
        let forward = fuse_forward(&plan.forward, fuse_gelu, &place)?;
        let flags = accumulate_flags(&plan.backward)?;
        let mut backward = fuse_backward(&plan.backward, &flags, fuse_gelu, &place)?;
        let act_grads_len = pack_act_grads(&mut backward);
        Ok(Schedule {
            forward,
            backward,
            acts_len: plan.acts.len,
            act_grads_len,
            stats_len: stats.len,
            tokens_len: 2 * tokens,
            loss_offset: stats.get(&plan.acts.loss).expect("the loss is a statistic"),
        })
    }

    /// Where the targets start in the token buffer.
    pub fn targets_offset(&self) -> usize {
        self.tokens_len / 2
    }

    /// Every operation of forward and backward.
    pub fn ops(&self) -> impl Iterator<Item = &Op> {
        self.forward.iter().chain(self.backward.iter().filter_map(|step| match step {
            BackwardOp::Op(op) => Some(op),
            BackwardOp::Ready(_) => None,
        }))
    }
}

/// The activation ranges kept in f32 (LayerNorm statistics, flash attention's log-sum-exp, the
/// losses), and their offsets in the statistics buffer.
struct StatsMap {
    offsets: HashMap<(usize, usize), usize>,
    len: usize,
}

impl StatsMap {
    fn new(plan: &Plan) -> Self {
        let a = &plan.acts;
        let mut ranges: Vec<&Range<usize>> = Vec::new();
        for block in &a.blocks {
            ranges.extend([&block.ln_1_mean, &block.ln_1_rstd, &block.ln_2_mean, &block.ln_2_rstd]);
            if let AttentionActs::LogSumExp(lse) = &block.attention {
                ranges.push(lse);
            }
        }
        ranges.extend([&a.ln_f_mean, &a.ln_f_rstd, &a.losses, &a.loss]);
        let mut offsets = HashMap::new();
        let mut len = 0;
        for range in ranges {
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

type PlaceFn<'a> = dyn Fn(&Arg, bool) -> Result<Place, GptError> + 'a;

fn schedule_error(reason: String) -> GptError {
    GptError::Kernel { kernel: "cuda schedule", reason }
}

/// The forward launches as operations, with matmul + GELU fused.
fn fuse_forward(
    launches: &[Launch],
    fuse_gelu: bool,
    place: &PlaceFn<'_>,
) -> Result<Vec<Op>, GptError> {
    let mut ops = Vec::with_capacity(launches.len());
    let mut i = 0;
    while i < launches.len() {
        let launch = &launches[i];
        let args = |launch: &Launch| -> Result<Vec<Place>, GptError> {
            launch.args.iter().map(|arg| place(arg, false)).collect()
        };
        if let (Kernel::Matmul { c, oc, layout, bias: true }, Some(next)) =
            (&launch.kernel, launches.get(i + 1))
            && fuse_gelu
            && next.kernel == Kernel::Gelu
            && oc.is_multiple_of(8)
            && next.args[1].range == launch.args[0].range
            && next.args[1].buf == launch.args[0].buf
        {
            // [out, inp, weight, bias] and [gelu out, gelu inp = out].
            let (matmul, gelu) = (args(launch)?, args(next)?);
            ops.push(Op {
                kind: OpKind::MatmulBiasGelu { c: *c, oc: *oc, layout: *layout },
                args: vec![gelu[0], matmul[0], matmul[1], matmul[2], matmul[3]],
            });
            i += 2;
            continue;
        }
        ops.push(Op { kind: OpKind::Kernel(launch.kernel.clone()), args: args(launch)? });
        i += 1;
    }
    Ok(ops)
}

/// For every argument of every backward launch: whether it accumulates. Gradients of parameters
/// always do; an activation gradient is overwritten by the first launch that writes it and
/// accumulated by the later ones. The plan's zeroing launch gets no flags (it is dropped).
fn accumulate_flags(steps: &[Step]) -> Result<Vec<Vec<bool>>, GptError> {
    let mut written: Vec<Range<usize>> = Vec::new();
    let mut flags = Vec::with_capacity(steps.len());
    for step in steps {
        let Step::Launch(launch) = step else {
            flags.push(Vec::new());
            continue;
        };
        if matches!(launch.kernel, Kernel::Zero { .. }) {
            flags.push(Vec::new());
            continue;
        }
        let mut mine = Vec::with_capacity(launch.args.len());
        for arg in &launch.args {
            let seen = written.iter().find(|r| r.start < arg.range.end && arg.range.start < r.end);
            let exact = seen.is_some_and(|r| *r == arg.range);
            let accumulate = match (arg.buf, arg.access) {
                (Buf::Grads, _) => true,
                (Buf::ActGrads, Access::Read) if exact => false,
                (Buf::ActGrads, Access::Read) => {
                    return Err(schedule_error(format!(
                        "{} reads activation gradients {:?} before any launch writes them",
                        launch.kernel.name(),
                        arg.range
                    )));
                }
                (Buf::ActGrads, Access::Write | Access::Update) if seen.is_none() => {
                    written.push(arg.range.clone());
                    false
                }
                (Buf::ActGrads, Access::Update) if exact => true,
                (Buf::ActGrads, Access::Write) if exact => false,
                (Buf::ActGrads, _) => {
                    return Err(schedule_error(format!(
                        "{} writes activation gradients {:?} that overlap others partly",
                        launch.kernel.name(),
                        arg.range
                    )));
                }
                _ => false,
            };
            mine.push(accumulate);
        }
        if let Kernel::AttentionBackward { .. } | Kernel::FlashAttentionBackward { .. } =
            launch.kernel
            && mine[0]
        {
            return Err(schedule_error(
                "attention backward overwrites dqkv, but another launch wrote it first".into(),
            ));
        }
        flags.push(mine);
    }
    Ok(flags)
}

/// The backward launches as operations, with matmul backward + GELU backward fused where the
/// matmul's input gradient is written first there and read only by the GELU backward.
fn fuse_backward(
    steps: &[Step],
    flags: &[Vec<bool>],
    fuse_gelu: bool,
    place: &PlaceFn<'_>,
) -> Result<Vec<BackwardOp>, GptError> {
    let mut ops = Vec::with_capacity(steps.len());
    let args = |i: usize| -> Result<Vec<Place>, GptError> {
        let Step::Launch(launch) = &steps[i] else { unreachable!("a launch") };
        launch.args.iter().zip(&flags[i]).map(|(arg, &acc)| place(arg, acc)).collect()
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
        if let Kernel::MatmulBackward { c, oc, layout, bias } = launch.kernel
            && fuse_gelu
            && let Some(next) = launch_at(i + 1)
            && next.kernel == Kernel::GeluBackward
            && c.is_multiple_of(8)
            && next.args[2].range == launch.args[0].range
            && !flags[i][0]
            && !flags[i + 1][0]
            && !steps[i + 2..].iter().any(|step| touches(step, &launch.args[0]))
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

/// Whether `step` uses the buffer range of `arg`.
fn touches(step: &Step, arg: &Arg) -> bool {
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
fn pack_act_grads(backward: &mut [BackwardOp]) -> usize {
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
    by_first.sort_unstable();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::ParamRanges;
    use crate::plan::AttentionKind;
    use crate::{GptConfig, flat_layout};

    fn schedule(config: &GptConfig, batch: usize, seq: usize) -> (Plan, Schedule) {
        schedule_with(config, batch, seq, AttentionKind::Gemm)
    }

    fn schedule_with(
        config: &GptConfig,
        batch: usize,
        seq: usize,
        attention: AttentionKind,
    ) -> (Plan, Schedule) {
        let layout = flat_layout(config, 1).unwrap();
        let params = ParamRanges::new(config, &layout).unwrap();
        let plan = Plan::with_attention(config, &params, batch, seq, attention).unwrap();
        let schedule = Schedule::new(&plan, true).unwrap();
        (plan, schedule)
    }

    const TAILS: GptConfig =
        GptConfig { n_layer: 3, n_head: 4, d_model: 200, vocab_size: 301, context: 40 };

    /// No two activation gradients that are live at the same time share memory: packing the
    /// backward of `TAILS` again, each argument is known by its plan offset before packing.
    #[test]
    fn live_activation_gradients_never_overlap() {
        let (plan, s) = schedule(&TAILS, 3, 37);
        let place = |arg: &Arg, accumulate: bool| -> Result<Place, GptError> {
            let space = if arg.buf == Buf::ActGrads { Space::ActGrads } else { Space::Acts };
            Ok(Place { space, offset: arg.range.start, len: arg.range.len(), accumulate })
        };
        let flags = accumulate_flags(&plan.backward).unwrap();
        let unpacked = fuse_backward(&plan.backward, &flags, true, &place).unwrap();
        let ops = |steps: &[BackwardOp]| -> Vec<Op> {
            steps
                .iter()
                .filter_map(|step| match step {
                    BackwardOp::Op(op) => Some(op.clone()),
                    BackwardOp::Ready(_) => None,
                })
                .collect()
        };
        let (unpacked, packed) = (ops(&unpacked), ops(&s.backward));
        // Plan offset → (first op, last op, packed place).
        let mut lives: HashMap<usize, (usize, usize, Place)> = HashMap::new();
        for (i, (before, after)) in unpacked.iter().zip(&packed).enumerate() {
            for (arg, place) in before.args.iter().zip(&after.args) {
                if arg.space != Space::ActGrads {
                    continue;
                }
                let life = lives.entry(arg.offset).or_insert((i, i, *place));
                assert_eq!(life.2, Place { accumulate: life.2.accumulate, ..*place });
                life.1 = i;
            }
        }
        assert!(lives.len() > 10);
        for (key_a, a) in &lives {
            assert!(a.2.end() <= s.act_grads_len);
            for (key_b, b) in &lives {
                let same_time = a.0 <= b.1 && b.0 <= a.1;
                let same_memory = a.2.offset < b.2.end() && b.2.offset < a.2.end();
                assert!(key_a == key_b || !(same_time && same_memory), "{a:?} and {b:?}");
            }
        }
    }

    /// Each block's fc matmul is fused with its GELU forward and backward, the zeroing launch is
    /// gone, and the packed activation gradients take far less than one per activation.
    #[test]
    fn fusions_apply_once_per_block_and_packing_saves_memory() {
        let config = GptConfig { n_layer: 6, ..TAILS };
        let (plan, s) = schedule(&config, 2, 40);
        let count = |pred: &dyn Fn(&OpKind) -> bool| s.ops().filter(|op| pred(&op.kind)).count();
        assert_eq!(count(&|k| matches!(k, OpKind::MatmulBiasGelu { .. })), 6);
        assert_eq!(count(&|k| matches!(k, OpKind::MatmulBackwardDGelu { .. })), 6);
        assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Gelu))), 0);
        assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::GeluBackward))), 0);
        assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Zero { .. }))), 0);
        let unfused = Schedule::new(&plan, false).unwrap();
        assert!(unfused.ops().all(|op| matches!(op.kind, OpKind::Kernel(_))));
        assert!(s.act_grads_len * 3 < plan.acts.len, "{} vs {}", s.act_grads_len, plan.acts.len);
        let ready = s.backward.iter().filter(|s| matches!(s, BackwardOp::Ready(_))).count();
        assert_eq!(ready, config.n_layer + 2);
    }

    /// Where the GELU's width is no multiple of 8, the GELU kernels stay separate.
    #[test]
    fn odd_widths_keep_the_gelu_kernels() {
        let narrow = GptConfig { n_layer: 2, n_head: 3, d_model: 15, vocab_size: 70, context: 11 };
        let (_, s) = schedule(&narrow, 2, 9);
        let count = |pred: &dyn Fn(&OpKind) -> bool| s.ops().filter(|op| pred(&op.kind)).count();
        assert_eq!(count(&|k| matches!(k, OpKind::MatmulBiasGelu { .. })), 0);
        assert_eq!(count(&|k| matches!(k, OpKind::MatmulBackwardDGelu { .. })), 0);
        assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Gelu))), 2);
        assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::GeluBackward))), 2);
    }

    /// The first write of every activation gradient overwrites, the others add, parameter
    /// gradients always add, and every place lies inside its buffer.
    #[test]
    fn first_writes_overwrite_and_places_fit_their_buffers() {
        let (plan, s) = schedule(&TAILS, 3, 37);
        let mut seen = std::collections::HashSet::new();
        for op in s.ops() {
            for arg in &op.args {
                let len = match arg.space {
                    Space::Acts => s.acts_len,
                    Space::ActGrads => s.act_grads_len,
                    Space::Stats => s.stats_len,
                    Space::Tokens => s.tokens_len,
                    Space::Params | Space::Grads => usize::MAX,
                };
                assert!(arg.end() <= len, "{arg:?}");
                if arg.space == Space::Grads {
                    assert!(arg.accumulate);
                }
            }
        }
        let flags = accumulate_flags(&plan.backward).unwrap();
        for (step, flags) in plan.backward.iter().zip(&flags) {
            let Step::Launch(launch) = step else { continue };
            for (arg, &accumulate) in launch.args.iter().zip(flags) {
                if arg.buf == Buf::ActGrads && arg.access == Access::Update {
                    assert_eq!(accumulate, !seen.insert(arg.range.clone()), "{launch:?}");
                }
            }
        }
        assert!(s.stats_len < plan.acts.len);
    }

    /// With flash attention, each block's forward writes its lse into the f32 statistics and its
    /// backward reads it from the same place, the backward overwrites dqkv (its first write), and
    /// no place anywhere has the size of the weights `[batch, n_head, seq, seq]`.
    #[test]
    fn flash_attention_keeps_its_lse_with_the_statistics() {
        let (batch, seq) = (3, 37);
        let (plan, s) = schedule_with(&TAILS, batch, seq, AttentionKind::Flash);
        let rows = batch * TAILS.n_head * seq;
        let forward: Vec<&Op> = s
            .forward
            .iter()
            .filter(|op| matches!(op.kind, OpKind::Kernel(Kernel::FlashAttention { .. })))
            .collect();
        let backward: Vec<&Op> = s
            .ops()
            .filter(|op| matches!(op.kind, OpKind::Kernel(Kernel::FlashAttentionBackward { .. })))
            .collect();
        assert_eq!((forward.len(), backward.len()), (TAILS.n_layer, TAILS.n_layer));
        for (forward, backward) in forward.iter().zip(backward.iter().rev()) {
            // [out, lse, qkv] and [dqkv, dout, qkv, out, lse]
            let lse = forward.args[1];
            assert_eq!((lse.space, lse.len), (Space::Stats, rows));
            assert!(lse.offset.is_multiple_of(4), "16-byte aligned f32");
            assert_eq!(backward.args[4], lse);
            assert_eq!(backward.args[3], forward.args[0]);
            assert_eq!(backward.args[2], forward.args[2]);
            assert!(!backward.args[0].accumulate, "flash backward overwrites dqkv");
        }
        assert!(s.ops().all(|op| op.args.iter().all(|arg| arg.len != rows * seq)));
        let (_, gemm) = schedule(&TAILS, batch, seq);
        assert_eq!(s.stats_len - gemm.stats_len, TAILS.n_layer * rows.div_ceil(4) * 4);
        assert!(s.act_grads_len <= gemm.act_grads_len);
        assert!(s.acts_len < gemm.acts_len && s.acts_len == plan.acts.len);
    }
}
