//! What a checkpoint takes from the engine ([`Snapshot`]) and gives back ([`Restore`]), and the
//! assembly of a rank's optimizer state from parts saved at any world size.

use std::borrow::Cow;
use std::ops::Range;

use zeroflow_core::Float;
use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::layout::FlatLayout;
use zeroflow_device::{Comm, DeviceBuffer};

use super::Engine;
use crate::checkpoint::{Elements, PartView};
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
    /// before the next backward.
    pub fn restore(&mut self, weights: &[P], from: Restore<'_>) -> Result<(), EngineError> {
        let rank = self.shared.comm.rank();
        let zenflow = self.path.check_restore(&self.shared, &from)?;
        let Restore { parts, optimizer_steps, micro_steps, upload_pending, scaler, .. } = from;
        if weights.len() != self.shared.layout.padded_len() {
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
        self.warn_on_moment_conversion(&parts);
        let state = assemble_parts(&self.shared.layout, &self.shared.owned, parts, rank)?;
        self.shared.device.synchronize()?;
        super::shared::overwrite(&self.shared.device, &self.shared.params, weights)?;
        self.path.restore(&mut self.shared, state, upload_pending, zenflow)?;
        self.adamw.resume_at(optimizer_steps);
        self.micro_steps = micro_steps;
        self.scaler = scaler.clone();
        Ok(())
    }

    /// Says so where restored moments change dtype: bf16 to fp32 is exact, fp32 to bf16 rounds
    /// each moment to the nearest bf16 (once; the run goes on with stochastic rounding).
    fn warn_on_moment_conversion(&self, parts: &[OptimizerPart]) {
        let Some(saved) = parts.iter().map(|p| p.moments).find(|m| *m != self.moments) else {
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
    /// Optimizer state saved by any number of ranks: lent, or given (then a part that is this
    /// rank's partition exactly becomes the engine's state without a copy).
    pub parts: Cow<'a, [OptimizerPart]>,
    pub optimizer_steps: u64,
    pub micro_steps: u64,
    /// See [`Snapshot::upload_pending`].
    pub upload_pending: bool,
    pub scaler: &'a LossScaler,
    /// A ZenFlow run's state, saved by any number of ranks (`parts` hold the consolidated
    /// optimizer state); empty for any other run.
    pub zenflow: &'a [ZenFlowSnapshot],
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

/// Master weights and moments of `owned` from parts saved at any world size, for `rank`.
/// Parameter elements must be covered; padding may be missing (it is zero).
/// [`assemble`] of parts lent or given: a given part whose range is `owned` exactly, with
/// arrays of its length, is moved rather than copied (a resume at the world size it was saved at).
pub(super) fn assemble_parts(
    layout: &FlatLayout,
    owned: &Range<usize>,
    parts: Cow<'_, [OptimizerPart]>,
    rank: usize,
) -> Result<[Vec<f32>; 3], EngineError> {
    match parts {
        Cow::Owned(mut parts) => {
            let whole = parts.iter().position(|part| {
                part.flat == *owned
                    && [part.master.len(), part.exp_avg.len(), part.exp_avg_sq.len()]
                        .iter()
                        .all(|&len| len == owned.len())
            });
            match whole {
                Some(at) => {
                    let part = parts.swap_remove(at);
                    Ok([part.master, part.exp_avg, part.exp_avg_sq])
                }
                None => assemble(layout, owned, &parts, rank),
            }
        }
        Cow::Borrowed(parts) => assemble(layout, owned, parts, rank),
    }
}

pub(super) fn assemble(
    layout: &FlatLayout,
    owned: &Range<usize>,
    parts: &[OptimizerPart],
    rank: usize,
) -> Result<[Vec<f32>; 3], EngineError> {
    let mut out = [vec![0f32; owned.len()], vec![0f32; owned.len()], vec![0f32; owned.len()]];
    let mut covered = vec![false; owned.len()];
    for part in parts {
        let lens = [part.master.len(), part.exp_avg.len(), part.exp_avg_sq.len()];
        if lens.iter().any(|&len| len != part.flat.len()) {
            let reason = "an optimizer part's arrays differ from its range";
            return Err(EngineError::Restore { rank, reason });
        }
        let start = part.flat.start.max(owned.start);
        let end = part.flat.end.min(owned.end);
        for i in start..end {
            let (src, dst) = (i - part.flat.start, i - owned.start);
            out[0][dst] = part.master[src];
            out[1][dst] = part.exp_avg[src];
            out[2][dst] = part.exp_avg_sq[src];
            covered[dst] = true;
        }
    }
    for index in layout.params_in(owned.clone()) {
        let param = &layout.params()[index];
        let range = param.flat_range();
        let inside = range.start.max(owned.start)..range.end.min(owned.end);
        if inside.clone().any(|i| !covered[i - owned.start]) {
            return Err(EngineError::IncompleteOptimizerState { rank, param: param.name.clone() });
        }
    }
    Ok(out)
}
