//! What a checkpoint takes from the engine ([`Snapshot`]) and gives back ([`Restore`]), and the
//! assembly of a rank's optimizer state from parts saved at any world size.

use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{Comm, DeviceBuffer};

use super::Engine;
use crate::checkpoint::{Elements, PartFile, PartView};
use crate::device_adamw::DeviceAdamW;
use crate::{EngineError, LossScaler, ZenFlowSnapshot};

/// This rank's optimizer state and the engine's counters (see [`crate::Engine::snapshot`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    pub part: OptimizerPart,
    /// The delayed update's weights are newer than the saved device weights.
    pub upload_pending: bool,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    pub scaler: LossScaler,
    /// ZenFlow's selection, window position and window sums (`part` holds the consolidated
    /// optimizer state: the device's for the selected columns).
    pub zenflow: Option<ZenFlowSnapshot>,
}

/// This rank's optimizer state (with its ZenFlow state), lent or fetched in pieces, the flat
/// weights fetched from the device in pieces, and the engine's counters: what
/// [`crate::Engine::checkpoint_state`] gives a checkpoint.
#[derive(Debug)]
pub struct CheckpointState<'a, P: Clone> {
    pub part: PartView<'a>,
    /// The device's flat weights (the whole flat buffer), downloaded a piece at a time.
    pub weights: Elements<'a, P>,
    /// See [`Snapshot::upload_pending`].
    pub upload_pending: bool,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    pub scaler: LossScaler,
    /// The element type the run keeps the moments in.
    pub moments: OptimizerStateDtype,
}

impl<D: DeviceAdamW, C: Comm<Device = D>, P: Float> Engine<D, C, P> {
    /// This rank's optimizer state and the engine's counters, for a checkpoint (save the weights
    /// of [`Engine::params`] with it). With the delayed update, a running step is waited for but
    /// its weights stay pending, exactly as without the snapshot, so checkpointing does not
    /// change the run.
    pub fn snapshot(&mut self) -> Result<Snapshot, EngineError> {
        self.complete_step()?;
        let state = self.path.state(&self.shared)?;
        Ok(Snapshot {
            upload_pending: state.upload_pending,
            part: OptimizerPart {
                flat: self.shared.owned.clone(),
                master: state.master,
                exp_avg: state.exp_avg,
                exp_avg_sq: state.exp_avg_sq,
                moments: self.moments,
            },
            optimizer_steps: self.adamw.steps_taken(),
            micro_steps: self.micro_steps,
            scaler: self.scaler.clone(),
            zenflow: self.path.zenflow_snapshot(&self.shared)?,
        })
    }

    /// Continues from a checkpoint: the flat weights (in this engine's layout), the optimizer
    /// state of any set of parts that together cover this rank's parameters (saved at any world
    /// size), the counters, and for a ZenFlow run its selection, window position and window
    /// (`from.zenflow`, which must be empty for any other run). Call it between optimizer steps,
    /// before the next backward. `weights: None` keeps the flat weights the engine holds: an
    /// engine built with the checkpoint's weights (as `zeroflow train --resume` builds it, so
    /// that a resume does not hold them twice).
    pub fn restore(&mut self, weights: Option<&[P]>, from: Restore<'_>) -> Result<(), EngineError> {
        let rank = self.shared.comm.rank();
        let zenflow = self.path.check_restore(&self.shared, &from)?;
        let Restore { parts, optimizer_steps, micro_steps, upload_pending, scaler, .. } = from;
        if weights.is_some_and(|w| w.len() != self.shared.layout.padded_len()) {
            return Err(EngineError::Misuse("restored weights must fill the whole flat buffer"));
        }
        if self.backward_pending || !micro_steps.is_multiple_of(self.grad_accum) {
            return Err(EngineError::Misuse("restore only at an optimizer-step boundary"));
        }
        // Each optimizer step ends a window of micro-steps (skipped steps count none): more is a
        // damaged or hand-made checkpoint, and the next step must still be countable.
        if micro_steps == u64::MAX || optimizer_steps > micro_steps / self.grad_accum {
            return Err(EngineError::Restore {
                rank,
                reason: "the checkpoint's step counters are inconsistent: more optimizer steps \
                         than its micro-steps allow, or no step left to count",
            });
        }
        self.complete_step()?;
        let state = SavedState::new(&self.shared.layout, &self.shared.owned, parts, rank)?;
        self.warn_on_moment_conversion(state.moments());
        self.shared.device.synchronize()?;
        if let Some(weights) = weights {
            super::shared::overwrite(&self.shared.device, &self.shared.params, weights)?;
        }
        self.path.restore(&mut self.shared, state, upload_pending, zenflow)?;
        self.adamw.resume_at(optimizer_steps);
        self.micro_steps = micro_steps;
        self.scaler = scaler.clone();
        Ok(())
    }

    /// Says so where restored moments change dtype: bf16 to fp32 is exact, fp32 to bf16 rounds
    /// each moment to the nearest bf16 (once; the run goes on with stochastic rounding).
    fn warn_on_moment_conversion(&self, saved: &[OptimizerStateDtype]) {
        let Some(saved) = saved.iter().copied().find(|m| *m != self.moments) else {
            return;
        };
        let how = match self.moments {
            OptimizerStateDtype::Fp32 => "widened exactly",
            OptimizerStateDtype::Bf16 => "rounded to the nearest bf16",
        };
        tracing::warn!(
            "the checkpoint's Adam moments are {saved}, this run keeps them in {}: they are {how} \
             (zeroflow.optimizer_state_dtype)",
            self.moments
        );
    }

    /// [`Engine::snapshot`] without copying: a running CPU step is waited for (its weights
    /// staying pending), the offloaded optimizer state is lent as it lies, and what is in device
    /// memory (the weights; the device optimizer's state; ZenFlow's window and selected columns)
    /// is fetched a piece at a time as the checkpoint is written, so that saving a large model
    /// holds no second copy of it. Call it between optimizer steps.
    pub fn checkpoint_state(&mut self) -> Result<CheckpointState<'_, P>, EngineError> {
        self.complete_step()?;
        let shared = &self.shared;
        let (part, upload_pending) = self.path.checkpoint_view(shared)?;
        let weights = Elements::downloaded(&shared.device, &shared.params, shared.params.len());
        Ok(CheckpointState {
            part,
            weights,
            upload_pending,
            optimizer_steps: self.adamw.steps_taken(),
            micro_steps: self.micro_steps,
            scaler: self.scaler.clone(),
            moments: self.moments,
        })
    }
}

/// What [`crate::Engine::restore`] continues from, besides the weights.
#[derive(Clone, Debug)]
pub struct Restore<'a> {
    /// Optimizer state saved by any number of ranks ([`SavedParts`]).
    pub parts: SavedParts<'a>,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    /// See [`Snapshot::upload_pending`].
    pub upload_pending: bool,
    pub scaler: &'a LossScaler,
    /// A ZenFlow run's state, saved by any number of ranks (`parts` hold the consolidated
    /// optimizer state); empty for any other run.
    pub zenflow: &'a [ZenFlowSnapshot],
}

/// The optimizer state a restore continues from, saved by any number of ranks: parts in memory
/// (snapshots), or a checkpoint's files, read a piece at a time into the engine's own state, so
/// that a resume holds no second copy of it.
#[derive(Clone, Copy, Debug)]
pub enum SavedParts<'a> {
    Memory(&'a [OptimizerPart]),
    Files(&'a [PartFile]),
}

impl<'a> From<&'a [OptimizerPart]> for SavedParts<'a> {
    fn from(parts: &'a [OptimizerPart]) -> Self {
        SavedParts::Memory(parts)
    }
}

impl<'a> From<&'a [PartFile]> for SavedParts<'a> {
    fn from(parts: &'a [PartFile]) -> Self {
        SavedParts::Files(parts)
    }
}

impl SavedParts<'_> {
    /// Each part's flat range and moments' dtype.
    fn ranges(&self) -> Vec<(Range<usize>, OptimizerStateDtype)> {
        match self {
            SavedParts::Memory(parts) => {
                parts.iter().map(|p| (p.flat.clone(), p.moments)).collect()
            }
            SavedParts::Files(parts) => parts.iter().map(|p| (p.flat.clone(), p.moments)).collect(),
        }
    }
}

/// This rank's optimizer state in saved parts ([`SavedParts`]), checked to cover every parameter
/// element of the partition: what an update path restores from, an array (or a range of one)
/// at a time ([`SavedState::read_array`]) into its own state, or whole ([`SavedState::to_vecs`]).
#[derive(Debug)]
pub(crate) struct SavedState<'a> {
    owned: Range<usize>,
    parts: SavedParts<'a>,
    /// Each part's flat range and moments' dtype, in the parts' order.
    ranges: Vec<Range<usize>>,
    moments: Vec<OptimizerStateDtype>,
}

/// The elements a piecewise restore reads at a time (the moments through two f32 arrays of it,
/// 32 MiB; the master weights are read in place).
pub const RESTORE_PIECE: usize = 1 << 22;

impl<'a> SavedState<'a> {
    /// Checks `parts` against the partition `owned` of `layout`: each part's arrays of its
    /// range's length, and every parameter element of the partition in some part (padding may
    /// be missing: it is zero).
    pub(crate) fn new(
        layout: &FlatLayout,
        owned: &Range<usize>,
        parts: SavedParts<'a>,
        rank: usize,
    ) -> Result<SavedState<'a>, EngineError> {
        if let SavedParts::Memory(parts) = &parts {
            for part in parts.iter() {
                let lens = [part.master.len(), part.exp_avg.len(), part.exp_avg_sq.len()];
                if lens.iter().any(|&len| len != part.flat.len()) {
                    let reason = "an optimizer part's arrays differ from its range";
                    return Err(EngineError::Restore { rank, reason });
                }
            }
        }
        let (ranges, moments): (Vec<_>, Vec<_>) = parts.ranges().into_iter().unzip();
        check_covered(layout, owned, ranges.clone(), rank)?;
        Ok(SavedState { owned: owned.clone(), parts, ranges, moments })
    }

    /// The partition's length.
    pub(crate) fn len(&self) -> usize {
        self.owned.len()
    }

    /// The moments' dtype of every part.
    pub(crate) fn moments(&self) -> &[OptimizerStateDtype] {
        &self.moments
    }

    /// Elements `range` of the partition (counted from its start) of one array (numbered as
    /// [`crate::checkpoint::PART_ARRAYS`]: master weights, first and second moments) into `out`
    /// as f32, zero where no part holds them (padding): a file's part in one read of its range.
    pub(crate) fn read_array(
        &self,
        array: usize,
        range: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let at = self.owned.start + range.start..self.owned.start + range.end;
        read_from(&self.ranges, at, out, |index, src, to| match self.parts {
            SavedParts::Memory(parts) => {
                let part = &parts[index];
                let from = [&part.master, &part.exp_avg, &part.exp_avg_sq][array];
                to.copy_from_slice(&from[src]);
                Ok(())
            }
            SavedParts::Files(parts) => parts[index].read(array, src, to).map_err(file_error),
        })
    }

    /// The whole partition's state as vectors.
    pub(crate) fn to_vecs(&self) -> Result<[Vec<f32>; 3], EngineError> {
        let len = self.len();
        let [mut master, mut exp_avg, mut exp_avg_sq] =
            [vec![0.0; len], vec![0.0; len], vec![0.0; len]];
        for (array, out) in [&mut master, &mut exp_avg, &mut exp_avg_sq].into_iter().enumerate() {
            self.read_array(array, 0..len, out)?;
        }
        Ok([master, exp_avg, exp_avg_sq])
    }
}

/// True if the sorted `ranges` cover all of `inside`.
fn covered(ranges: &[Range<usize>], inside: Range<usize>) -> bool {
    let mut next = inside.start;
    for range in ranges {
        if next >= inside.end {
            break;
        }
        if range.start <= next && range.end > next {
            next = range.end;
        }
    }
    next >= inside.end
}

/// Checks that `ranges` (saved parts' flat ranges) cover every parameter element of the
/// partition `owned` of `layout` (padding may be missing: it is zero).
fn check_covered(
    layout: &FlatLayout,
    owned: &Range<usize>,
    mut ranges: Vec<Range<usize>>,
    rank: usize,
) -> Result<(), EngineError> {
    ranges.sort_by_key(|r| r.start);
    for index in layout.params_in(owned.clone()) {
        let param = &layout.params()[index];
        let range = param.flat_range();
        let inside = range.start.max(owned.start)..range.end.min(owned.end);
        if !covered(&ranges, inside) {
            let param = param.name.clone();
            return Err(EngineError::IncompleteOptimizerState { rank, param });
        }
    }
    Ok(())
}

/// Flat elements `at` into `out` from saved parts of flat `ranges`: zero where none holds them,
/// and where part `index` does, `read(index, range within the part, out's slice)`.
fn read_from(
    ranges: &[Range<usize>],
    at: Range<usize>,
    out: &mut [f32],
    mut read: impl FnMut(usize, Range<usize>, &mut [f32]) -> Result<(), EngineError>,
) -> Result<(), EngineError> {
    // Where parts hold elements of `at`, relative to it; the rest is zeroed (not the whole of
    // `out` first: a resume's arrays are gigabytes, written once).
    let mut held = Vec::new();
    for (index, flat) in ranges.iter().enumerate() {
        let (start, end) = (flat.start.max(at.start), flat.end.min(at.end));
        if start < end {
            let to = &mut out[start - at.start..end - at.start];
            read(index, start - flat.start..end - flat.start, to)?;
            held.push(start - at.start..end - at.start);
        }
    }
    held.sort_by_key(|range| range.start);
    let mut next = 0;
    for range in held.into_iter().chain(std::iter::once(out.len()..out.len())) {
        if range.start > next {
            out[next..range.start].fill(0.0);
        }
        next = next.max(range.end);
    }
    Ok(())
}

fn file_error(error: crate::checkpoint::CheckpointError) -> EngineError {
    EngineError::Checkpoint(Box::new(error))
}

/// A ZenFlow run's saved window sums for this rank's partition, read as [`SavedState`] reads the
/// optimizer state: from the ranks' snapshots in memory, or (a restore from `SavedParts::Files`)
/// from the checkpoint's files a piece at a time.
pub(crate) struct SavedWindow<'a> {
    owned: Range<usize>,
    snapshots: &'a [ZenFlowSnapshot],
    files: Option<&'a [PartFile]>,
    /// Each rank's window range, in rank order (the files' or the snapshots').
    ranges: Vec<Range<usize>>,
}

impl<'a> SavedWindow<'a> {
    /// Checks the windows (each of its range's length where in memory) cover every parameter
    /// element of the partition.
    pub(crate) fn new(
        layout: &FlatLayout,
        owned: &Range<usize>,
        snapshots: &'a [ZenFlowSnapshot],
        parts: &SavedParts<'a>,
        rank: usize,
    ) -> Result<SavedWindow<'a>, EngineError> {
        let files = match parts {
            SavedParts::Files(files) => Some(*files),
            SavedParts::Memory(_) => None,
        };
        let ranges: Vec<Range<usize>> = match files {
            Some(files) => files.iter().map(|f| f.flat.clone()).collect(),
            None => {
                let short = snapshots.iter().any(|s| s.window_grads.len() != s.window_flat.len());
                if short {
                    let reason = "a ZenFlow window's sums differ from its range";
                    return Err(EngineError::Restore { rank, reason });
                }
                snapshots.iter().map(|s| s.window_flat.clone()).collect()
            }
        };
        check_covered(layout, owned, ranges.clone(), rank)?;
        Ok(SavedWindow { owned: owned.clone(), snapshots, files, ranges })
    }

    /// Elements `range` of the partition's window (counted from its start) into `out`.
    pub(crate) fn read(&self, range: Range<usize>, out: &mut [f32]) -> Result<(), EngineError> {
        let at = self.owned.start + range.start..self.owned.start + range.end;
        read_from(&self.ranges, at, out, |index, src, to| match self.files {
            Some(files) => files[index].read_window(src, to).map_err(file_error),
            None => {
                to.copy_from_slice(&self.snapshots[index].window_grads[src]);
                Ok(())
            }
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.owned.len()
    }
}

/// The optimizer state of one flat range: a rank's partition, as saved. The moments are held as
/// f32 whatever `moments` says; where it is bf16 they are bf16 values (widened exactly), and a
/// checkpoint stores them as bf16.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerPart {
    pub flat: Range<usize>,
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// The element type the run kept the moments in.
    pub moments: OptimizerStateDtype,
}

/// A rank's optimizer state, as an update path hands it out for a snapshot and takes it back.
pub(super) struct PathState {
    pub master: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// See [`Snapshot::upload_pending`].
    pub upload_pending: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Elements of `at` that parts hold come from them (each told its range within the part),
    /// the rest are zero, whatever `out` held before, and the parts in any order.
    #[test]
    fn read_from_fills_what_parts_hold_and_zeroes_the_rest() {
        let ranges = [10..12, 0..3, 5..8];
        let mut out = [f32::NAN; 10];
        read_from(&ranges, 2..12, &mut out, |index, src, to| {
            for (i, value) in to.iter_mut().enumerate() {
                *value = (1000 + 100 * index + src.start + i) as f32;
            }
            Ok(())
        })
        .unwrap();
        // Elements 2..12: 2 from part 1 (its element 2), 3 and 4 none, 5..8 part 2, 8 and 9
        // none, 10 and 11 part 0.
        let want = [1102.0, 0.0, 0.0, 1200.0, 1201.0, 1202.0, 0.0, 0.0, 1000.0, 1001.0];
        assert_eq!(out, want);
        let mut none = [f32::NAN; 4];
        read_from(&[], 0..4, &mut none, |_, _, _| unreachable!()).unwrap();
        assert_eq!(none, [0.0; 4]);
    }
}
