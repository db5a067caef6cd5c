//! Which write of an activation gradient overwrites it and which adds to it, and the lives of
//! each range (a checkpointed plan writes the ranges of its layers' internals once per layer):
//! what the schedule needs to drop the plan's zeroing launches and pack the gradients.

use std::collections::HashMap;
use std::ops::Range;

use super::schedule_error;
use crate::error::NnError;
use crate::kernels::{Kernel, LayerKernel};
use crate::plan::{Access, Arg, Buf, Launch, Step};

/// How one argument of a backward launch uses its range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct ArgUse {
    /// Whether a written gradient is added to (see [`accumulate_flags`]).
    pub(super) accumulate: bool,
    /// How many lives of this activation-gradient range ended before (a zeroing launch after
    /// its first write ends one: a checkpointed plan reuses the ranges of its layers' internals).
    life: usize,
}

impl ArgUse {
    /// The placeholder offset of an activation-gradient argument: one per life of its range.
    pub(super) fn life_key(self, arg: &Arg, acts_len: usize) -> usize {
        self.life * acts_len.max(1) + arg.range.start
    }
}

/// For every argument of every backward launch: whether it accumulates, and which life of its
/// range it belongs to. Gradients of parameters always accumulate; an activation gradient is
/// overwritten by the first launch that writes it and accumulated by the later ones. A zeroing
/// launch gets no flags (it is dropped): the first one clears what nothing wrote yet; a later one
/// (a checkpointed plan's, before each layer) ends the lives of the ranges it covers, so the next
/// write of each overwrites it again. A life also ends where a launch overwrites a whole range.
pub(super) fn accumulate_flags<X: LayerKernel>(
    steps: &[Step<X>],
) -> Result<Vec<Vec<ArgUse>>, NnError> {
    let mut written: Vec<Range<usize>> = Vec::new();
    let mut lives: HashMap<usize, usize> = HashMap::new();
    let mut flags = Vec::with_capacity(steps.len());
    for step in steps {
        let Step::Launch(launch) = step else {
            flags.push(Vec::new());
            continue;
        };
        if matches!(launch.kernel, Kernel::Zero { .. }) {
            end_lives(launch, &mut written, &mut lives)?;
            flags.push(Vec::new());
            continue;
        }
        let mut mine = Vec::with_capacity(launch.args.len());
        for arg in &launch.args {
            if overwrites_again(launch, arg, &written) {
                *lives.entry(arg.range.start).or_default() += 1;
            }
            let accumulate = accumulates(launch, arg, &mut written)?;
            let life = lives.get(&arg.range.start).copied().unwrap_or(0);
            mine.push(ArgUse { accumulate, life: if arg.buf == Buf::ActGrads { life } else { 0 } });
        }
        if let Kernel::AttentionBackward(_) | Kernel::FlashAttentionBackward(_) = launch.kernel
            && mine[0].accumulate
        {
            return Err(schedule_error(
                "attention backward overwrites dqkv, but another launch wrote it first".into(),
            ));
        }
        flags.push(mine);
    }
    Ok(flags)
}

/// Whether `arg` of `launch` accumulates, given the activation-gradient ranges `written` so far
/// (to which a first write adds its range).
fn accumulates<X: LayerKernel>(
    launch: &Launch<X>,
    arg: &Arg,
    written: &mut Vec<Range<usize>>,
) -> Result<bool, NnError> {
    let seen = written.iter().find(|r| r.start < arg.range.end && arg.range.start < r.end);
    let exact = seen.is_some_and(|r| *r == arg.range);
    Ok(match (arg.buf, arg.access) {
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
    })
}

/// Whether `arg` of `launch` overwrites a whole activation gradient written before, which no
/// other argument of the launch uses: what was there is dead, and a new life of the range starts
/// (a checkpointed plan's scratch gradients, written again by every block).
fn overwrites_again<X>(launch: &Launch<X>, arg: &Arg, written: &[Range<usize>]) -> bool {
    arg.buf == Buf::ActGrads
        && arg.access == Access::Write
        && written.contains(&arg.range)
        && launch.args.iter().filter(|other| other.buf == Buf::ActGrads).all(|other| {
            std::ptr::eq(other, arg)
                || other.range.end <= arg.range.start
                || arg.range.end <= other.range.start
        })
}

/// A zeroing launch in backward: every written range it covers is forgotten (its next write
/// overwrites it) and starts a new life. A range it covers only partly is refused.
fn end_lives<X: LayerKernel>(
    zero: &Launch<X>,
    written: &mut Vec<Range<usize>>,
    lives: &mut HashMap<usize, usize>,
) -> Result<(), NnError> {
    for cleared in zero.args.iter().map(|arg| &arg.range) {
        let mut i = 0;
        while i < written.len() {
            let range = &written[i];
            if range.end <= cleared.start || cleared.end <= range.start {
                i += 1;
                continue;
            }
            if range.start < cleared.start || cleared.end < range.end {
                return Err(schedule_error(format!(
                    "a zeroing launch clears {cleared:?}, part of the activation gradients \
                     {range:?}"
                )));
            }
            *lives.entry(range.start).or_default() += 1;
            written.swap_remove(i);
        }
    }
    Ok(())
}
