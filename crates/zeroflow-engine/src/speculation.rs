//! The speculative CPU step (DESIGN.md §5): as the pieces of this rank's partition reach the host
//! during the backward that ends an optimizer step, the CPU steps each one as if no clipping
//! applied, after saving its master weights and moments. At the step, once the global norm and
//! the overflow check are known, the speculation stands if the step's scalars are the ones it
//! assumed (the common case: no clipping, no overflow, no change of learning rate), and otherwise
//! every stepped piece is put back from its backup and stepped again with the real scalars, or
//! left restored where the step is skipped. The backup, not an algebraic inverse of Adam, is what
//! makes this bit-identical to the step without speculation.
//!
//! Host memory is bounded by a budget: pieces are stepped while their backups (and, on the
//! streaming path, their updated weights awaiting upload) fit; the rest is stepped at the step,
//! as without speculation. Once the running Σ g² of this rank's pieces alone says that the
//! global norm will be clipped, no further piece of that step is stepped speculatively.

use std::ops::Range;
use std::time::{Duration, Instant};

use zeroflow_core::Float;
use zeroflow_device::{Device, HostBuffer, HostMemory};
use zeroflow_optim::{AdamWStep, Grads, Saved};

use crate::EngineError;
use crate::host::HostOptimizer;

/// The default of [`crate::StreamOptions::speculation_budget`]: none (speculation off). Since it
/// stops at the backward's end and works beside the forward's opening, a 16 GiB budget made the
/// exact offload step with the whole optimizer in host memory 1.05–1.09× faster at llama-1b and
/// 1.00–1.12× at gpt-1.3b on H100s where the clip did not fire (the more, the faster the host's
/// memory: it steps 13–20 % of the partition under the backward), and llama-8b's at its default
/// share (0.75 of the optimizer on the host) 1.09× (1.04–1.06× with a clip of 1.0 that fired on
/// its first two steps); where the clip fired on every step it was 0–9 % slower over six to eight
/// steps and 3–5 % over 40, redone and then sitting out (BENCHMARKS.md); its buffers are host
/// memory the run must ask for (2 B/param more at llama-8b).
pub const DEFAULT_SPECULATION_BUDGET: usize = 0;

/// What the speculative step did so far ([`crate::Engine::speculation_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpeculationStats {
    /// Optimizer steps (or skipped steps) for which at least one piece was stepped
    /// speculatively.
    pub speculated_steps: u64,
    /// Elements stepped speculatively, over all those steps.
    pub speculated_elements: u64,
    /// Steps whose speculative pieces were rolled back: redone with the step's real scalars
    /// (the clip coefficient, a changed learning rate), or restored because the step was
    /// skipped (non-finite gradients).
    pub redone_steps: u64,
    /// Steps not speculated on because the clip fired on the last one speculated on (see
    /// `MAX_PAUSE`).
    pub paused_steps: u64,
    /// Speculated steps whose pieces stopped being stepped because the GPU was past the
    /// backward (the pieces that reached the host after it are stepped at the step).
    pub stopped_at_backward_end: u64,
    /// Time the courier waited for pieces' copies to reach the host while it could still step
    /// them: with `stepping`, what the courier did during the backwards it speculated in.
    pub copy_wait: Duration,
    /// Time the courier spent stepping pieces speculatively, their backups included.
    pub stepping: Duration,
}

/// The most optimizer steps the speculation sits out after the clip fired on a step it
/// speculated on. The clip firing on a step says it will likely fire on the next (early in a
/// run, the norm stays above the clip for many steps), and a step that is redone costs more than
/// one not speculated on: its pieces are stepped twice and their backups written and read. So
/// after a step redone for its clip coefficient the speculation pauses for one step, then two,
/// four, … up to this many while the clip goes on firing, and speculates on every step again from
/// the first that stands. The results do not depend on it: a step not speculated on is the plain
/// exact step.
pub const MAX_PAUSE: u64 = 32;

/// What a boundary backward speculates with: the step it assumes, and how to tell early that
/// clipping will fire.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Assumed {
    /// The step as it will be if the norm is within the clip: the scalars of
    /// `normalise(_, loss scale, world, accumulation, None)`.
    pub step: AdamWStep,
    /// The factor between Σ g² in the gradients' units and the norm: loss scale × ranks × steps.
    pub summed: f64,
    /// The clip threshold of the norm.
    pub clip: Option<f64>,
}

/// A piece stepped speculatively: its range in the partition and where its backup starts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Stepped {
    pub range: Range<usize>,
    pub at: usize,
}

/// How the speculation of a step ended ([`Speculation::validate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Nothing was stepped speculatively.
    Nothing,
    /// The stepped pieces stand ([`Speculation::stepped`] lists them).
    Stands,
    /// The stepped pieces were restored from their backups.
    RolledBack,
}

/// The backups of the speculatively stepped pieces of one step, and its bookkeeping.
pub(crate) struct Speculation<P: Float> {
    /// The partition's elements whose state the host holds (all but a device share's), from
    /// the first: no piece past them is stepped here.
    host_len: usize,
    /// Elements the budget allows.
    capacity: usize,
    /// Master weights, first and second moments of the stepped pieces before their step.
    backup: [Vec<f32>; 3],
    /// The streaming path's updated weights as `P`, awaiting their upload at the step.
    weights: Option<HostBuffer<P>>,
    stepped: Vec<Stepped>,
    /// Backup elements handed out this step.
    reserved: usize,
    /// The step being speculated, from the boundary backward to its validation.
    assumed: Option<Assumed>,
    /// No further piece of this step is stepped (the clip will fire).
    stopped: bool,
    /// Σ g² of the pieces seen this step (this rank's only: a lower bound of the global sum).
    partial: f64,
    /// Steps left to sit out, and the length of the last pause ([`MAX_PAUSE`]).
    pause_left: u64,
    pause: u64,
    stats: SpeculationStats,
}

impl<P: Float> Speculation<P> {
    /// The speculation of the first `partition` elements of a partition (those whose state the
    /// host holds) within `budget` bytes, or `None` where the budget holds no element.
    /// `with_weights`: the streaming path, which keeps the updated weights until their upload
    /// (the accumulating path writes them into its upload buffer).
    pub(crate) fn new<D: Device>(
        device: &D,
        partition: usize,
        budget: usize,
        with_weights: bool,
        memory: HostMemory,
    ) -> Result<Option<Self>, EngineError> {
        let capacity = crate::memory::speculation_capacity(
            partition,
            budget,
            with_weights,
            std::mem::size_of::<P>(),
        );
        if capacity == 0 {
            return Ok(None);
        }
        let weights = match with_weights {
            true => Some(device.alloc_host::<P>(capacity, memory)?),
            false => None,
        };
        Ok(Some(Speculation {
            host_len: partition,
            capacity,
            backup: std::array::from_fn(|_| vec![0.0; capacity]),
            weights,
            stepped: Vec::new(),
            reserved: 0,
            assumed: None,
            stopped: false,
            partial: 0.0,
            pause_left: 0,
            pause: 0,
            stats: SpeculationStats::default(),
        }))
    }

    /// The partition's elements it may step, from the first (past them, a device share's).
    pub(crate) fn host_len(&self) -> usize {
        self.host_len
    }

    pub(crate) fn stats(&self) -> SpeculationStats {
        self.stats
    }

    /// Starts a step's speculation (`None`: this backward does not end a step; a step in a
    /// pause after the clip fired is not speculated on either, see [`MAX_PAUSE`]). Pieces of an
    /// earlier speculation never validated (a backward that failed) are restored first.
    pub(crate) fn begin(&mut self, state: &mut HostOptimizer, assumed: Option<Assumed>) {
        self.abandon(state);
        self.stepped.clear();
        self.reserved = 0;
        self.partial = 0.0;
        self.stopped = false;
        self.assumed = match assumed {
            Some(_) if self.pause_left > 0 => {
                self.pause_left -= 1;
                self.stats.paused_steps += 1;
                None
            }
            assumed => assumed,
        };
    }

    /// True while pieces of this step may still be stepped.
    pub(crate) fn active(&self) -> bool {
        self.assumed.is_some() && !self.stopped
    }

    /// Hands out backup room for `len` elements, if the step is speculated and the budget has
    /// it: the offset of the room.
    pub(crate) fn reserve(&mut self, len: usize) -> Option<usize> {
        if !self.active() || self.reserved + len > self.capacity {
            return None;
        }
        let at = self.reserved;
        self.reserved += len;
        Some(at)
    }

    /// Steps no further piece of this step (the GPU is past the backward that would hide it).
    pub(crate) fn stop(&mut self) {
        self.stats.stopped_at_backward_end += u64::from(self.active());
        self.stopped = true;
    }

    /// Counts `waited`, the time a piece's copy took to reach the host after the courier asked
    /// for it, while pieces may still be stepped.
    pub(crate) fn waited(&mut self, waited: Duration) {
        if self.active() {
            self.stats.copy_wait += waited;
        }
    }

    /// Adds a piece's Σ g² to the running sum, and stops the step's speculation once that sum
    /// alone makes the norm exceed the clip (or is not finite): the step will not stand.
    pub(crate) fn observe(&mut self, grads: Grads<'_>) {
        let Some(assumed) = self.assumed.filter(|_| !self.stopped) else { return };
        let Some(max) = assumed.clip else { return };
        self.partial += sum_squares(grads);
        // The global Σ g² is at least this rank's part of it: `normalise` clips above this.
        let norm = self.partial.sqrt() / assumed.summed;
        if !norm.is_finite() || norm + 1e-6 > max {
            self.stopped = true;
        }
    }

    /// Steps `range` of the partition speculatively with `grads`, after saving its state into
    /// the backup at `at` (from [`Speculation::reserve`]). The updated weights go into `out`
    /// where given (the accumulating path's upload buffer), else into this speculation's own
    /// weights at `at`.
    pub(crate) fn step_piece(
        &mut self,
        state: &mut HostOptimizer,
        range: Range<usize>,
        at: usize,
        grads: Grads<'_>,
        out: Option<&mut [P]>,
    ) -> Result<(), EngineError> {
        let Some(assumed) = self.assumed.filter(|_| !self.stopped) else {
            return Err(EngineError::Internal("a speculative step without a step to assume"));
        };
        let len = range.len();
        // Saved in the step's pass over the state (bf16 moments as f32, exactly: put back
        // exactly).
        let [params, exp_avg, exp_avg_sq] = self.backup.each_mut().map(|b| &mut b[at..at + len]);
        let saved = Saved { params, exp_avg, exp_avg_sq };
        let out = match (out, &mut self.weights) {
            (Some(out), _) => out,
            (None, Some(weights)) => &mut weights[at..at + len],
            (None, None) => return Err(EngineError::Internal("speculated weights have no place")),
        };
        let started = Instant::now();
        state.step_range_saving(&assumed.step, range.clone(), grads, out, Some(saved))?;
        self.stats.stepping += started.elapsed();
        self.stepped.push(Stepped { range, at });
        self.stats.speculated_elements += len as u64;
        Ok(())
    }

    /// Ends the step's speculation: it stands if `actual` (the step taken; `None` where it is
    /// skipped) is the step assumed, else every stepped piece is restored from its backup.
    pub(crate) fn validate(
        &mut self,
        state: &mut HostOptimizer,
        actual: Option<&AdamWStep>,
    ) -> Verdict {
        let assumed = self.assumed.take().map(|assumed| assumed.step);
        if self.stepped.is_empty() {
            return Verdict::Nothing;
        }
        self.stats.speculated_steps += 1;
        if actual.is_some() && actual == assumed.as_ref() {
            self.stepped.sort_by_key(|piece| piece.range.start);
            self.pause = 0;
            return Verdict::Stands;
        }
        // The gradients' scale differs from the one assumed: the clip fired (or the loss scale
        // changed). Sit out the next steps, longer each time it happens again.
        if let (Some(actual), Some(assumed)) = (actual, assumed)
            && actual.grad_scale() != assumed.grad_scale()
        {
            self.pause = (2 * self.pause).clamp(1, MAX_PAUSE);
            self.pause_left = self.pause;
        }
        self.rollback(state);
        Verdict::RolledBack
    }

    /// Restores the pieces of a speculation not validated yet (a skipped step, a state read
    /// between the backward and the step, a backward that failed), counted as redone.
    pub(crate) fn abandon(&mut self, state: &mut HostOptimizer) {
        if self.assumed.take().is_some() {
            self.stats.speculated_steps += u64::from(!self.stepped.is_empty());
            self.rollback(state);
        }
    }

    /// Puts every stepped piece back from its backup and forgets it (counted as redone).
    fn rollback(&mut self, state: &mut HostOptimizer) {
        if self.stepped.is_empty() {
            return;
        }
        self.stats.redone_steps += 1;
        let HostOptimizer { master, moments, adam } = state;
        for piece in self.stepped.drain(..) {
            let [master_backup, exp_avg_backup, exp_avg_sq_backup] =
                self.backup.each_ref().map(|b| &b[piece.at..piece.at + piece.range.len()]);
            adam.for_each_chunk_mut(&mut master[piece.range.clone()], |offset, chunk| {
                chunk.copy_from_slice(&master_backup[offset..offset + chunk.len()]);
            });
            moments.write(adam, piece.range.clone(), [exp_avg_backup, exp_avg_sq_backup]);
        }
    }

    /// The pieces that stand after [`Speculation::validate`], in ascending order of their ranges.
    pub(crate) fn stepped(&self) -> &[Stepped] {
        &self.stepped
    }

    /// The streaming path's updated weights of the stepped pieces.
    pub(crate) fn weights(&self) -> Option<&HostBuffer<P>> {
        self.weights.as_ref()
    }
}

/// Validates the streaming paths' `speculation` (if any) against the step taken: it, where it
/// stands (its pieces are stepped and their weights kept), else `None` (restored, or nothing
/// was stepped).
pub(crate) fn standing<'a, P: Float>(
    speculation: Option<&'a mut Speculation<P>>,
    state: &mut HostOptimizer,
    step: &AdamWStep,
) -> Option<&'a Speculation<P>> {
    let speculation = speculation?;
    match speculation.validate(state, Some(step)) {
        Verdict::Stands => Some(speculation),
        Verdict::Nothing | Verdict::RolledBack => None,
    }
}

/// Σ g² of a piece in f64 (only to decide whether to go on speculating; the norm the step uses
/// is computed where it always is).
fn sum_squares(grads: Grads<'_>) -> f64 {
    match grads {
        Grads::F32(g) => crate::host::sum_of_squares(g),
        Grads::Bf16(g) => crate::host::sum_of_squares(g),
    }
}

/// The stretches of a partition of `len` elements in ascending order, each either stepped
/// speculatively (`Some` of the piece) or not (`None`): `stepped` sorted by start and disjoint.
pub(crate) fn segments(len: usize, stepped: &[Stepped]) -> Vec<(Range<usize>, Option<usize>)> {
    let mut out = Vec::with_capacity(2 * stepped.len() + 1);
    let mut cursor = 0;
    for piece in stepped {
        if cursor < piece.range.start {
            out.push((cursor..piece.range.start, None));
        }
        out.push((piece.range.clone(), Some(piece.at)));
        cursor = piece.range.end;
    }
    if cursor < len {
        out.push((cursor..len, None));
    }
    out
}

#[cfg(test)]
mod tests {
    use zeroflow_core::adamw::OptimizerStateDtype;
    use zeroflow_device::CpuDevice;
    use zeroflow_optim::{AdamW, AdamWConfig, CpuAdam, SimdLevel};

    use super::*;

    fn speculation(budget: usize) -> Option<Speculation<f32>> {
        let device = CpuDevice::new().unwrap();
        Speculation::new(&device, 100, budget, true, HostMemory::Pageable).unwrap()
    }

    fn assumed(clip: Option<f64>) -> Assumed {
        let step = AdamW::new(AdamWConfig::default()).unwrap().next_step(1.0);
        Assumed { step, summed: 1.0, clip }
    }

    /// The stretches of a partition cover it in order, the stepped ones where they are.
    #[test]
    fn segments_cover_the_partition_in_order() {
        let stepped = [Stepped { range: 10..20, at: 5 }, Stepped { range: 20..30, at: 0 }];
        let want = vec![(0..10, None), (10..20, Some(5)), (20..30, Some(0)), (30..40, None)];
        assert_eq!(segments(40, &stepped), want);
        assert_eq!(segments(30, &stepped[1..]), vec![(0..20, None), (20..30, Some(0))]);
        assert_eq!(segments(7, &[]), vec![(0..7, None)]);
    }

    /// The budget holds whole elements of backup (16 bytes each here, with the f32 weights) and
    /// never more than the partition; rooms are handed out only while a step is speculated.
    #[test]
    fn the_budget_bounds_the_rooms() {
        assert!(speculation(15).is_none());
        let mut spec = speculation(16 * 30 + 15).unwrap();
        assert_eq!(spec.capacity, 30);
        assert_eq!(speculation(usize::MAX).unwrap().capacity, 100);
        assert_eq!(spec.reserve(10), None, "no step is speculated yet");
        let mut state = host_optimizer(OptimizerStateDtype::Fp32);
        spec.begin(&mut state, Some(assumed(None)));
        assert_eq!(spec.reserve(20), Some(0));
        assert_eq!(spec.reserve(11), None);
        assert_eq!(spec.reserve(10), Some(20));
    }

    /// The running Σ g² stops a step's speculation once it alone puts the norm above the clip,
    /// or is not finite; without a clip it is not kept.
    #[test]
    fn the_running_norm_stops_speculating_once_the_clip_will_fire() {
        let mut state = host_optimizer(OptimizerStateDtype::Fp32);
        let mut spec = speculation(usize::MAX).unwrap();
        spec.begin(&mut state, Some(assumed(Some(5.0))));
        spec.observe(Grads::F32(&[3.0, 3.0]));
        assert!(spec.active(), "norm 4.24 is within 5");
        spec.observe(Grads::F32(&[2.0]));
        assert!(spec.active(), "norm 4.69 is within 5");
        spec.observe(Grads::F32(&[2.0]));
        assert!(!spec.active(), "norm 5.10 is not");
        assert_eq!(spec.reserve(1), None);
        spec.begin(&mut state, Some(assumed(Some(5.0))));
        assert!(spec.active(), "a new step speculates again");
        spec.observe(Grads::F32(&[f32::INFINITY]));
        assert!(!spec.active(), "an infinite norm");
        spec.begin(&mut state, Some(assumed(None)));
        spec.observe(Grads::F32(&[1e30, f32::INFINITY]));
        assert!(spec.active(), "without a clip only the step's check decides");
    }

    /// A stepped piece is put back bit for bit when the step differs (or is skipped), and stands,
    /// equal to stepping it directly, when the step is the one assumed: with f32 moments and with
    /// bf16 moments (backed up as f32).
    #[test]
    fn a_piece_rolls_back_exactly_or_stands() {
        for dtype in OptimizerStateDtype::ALL {
            let mut state = host_optimizer(dtype);
            state.master.iter_mut().enumerate().for_each(|(i, m)| *m = i as f32 * 0.25 - 7.0);
            let exp_avg: Vec<f32> = (0..100).map(|i| i as f32 * 1e-3).collect();
            let exp_avg_sq: Vec<f32> = (0..100).map(|i| i as f32 * 1e-4).collect();
            state.moments.write(&state.adam, 0..100, [&exp_avg, &exp_avg_sq]);
            let before = state.to_f32();
            let grads: Vec<f32> = (0..20).map(|i| i as f32 - 9.5).collect();
            let assumed = assumed(None);
            let mut spec = speculation(usize::MAX).unwrap();
            for actual in [None, Some(AdamW::new(AdamWConfig::default()).unwrap().next_step(0.5))] {
                spec.begin(&mut state, Some(assumed));
                let at = spec.reserve(20).unwrap();
                spec.step_piece(&mut state, 10..30, at, Grads::F32(&grads), None).unwrap();
                assert_ne!(state.to_f32(), before);
                assert_eq!(spec.validate(&mut state, actual.as_ref()), Verdict::RolledBack);
                assert_eq!(state.to_f32(), before, "{dtype}: restored after {actual:?}");
            }
            // The last rollback was for the gradients' scale (the clip): one step sits out.
            spec.begin(&mut state, Some(assumed));
            assert_eq!((spec.active(), spec.reserve(20)), (false, None));
            assert_eq!(spec.validate(&mut state, Some(&assumed.step)), Verdict::Nothing);
            spec.begin(&mut state, Some(assumed));
            let at = spec.reserve(20).unwrap();
            spec.step_piece(&mut state, 10..30, at, Grads::F32(&grads), None).unwrap();
            assert_eq!(spec.validate(&mut state, Some(&assumed.step)), Verdict::Stands);
            let mut direct = host_optimizer(dtype);
            let [master, exp_avg, exp_avg_sq] = &before;
            direct.master.copy_from_slice(master);
            direct.moments.write(&direct.adam, 0..100, [exp_avg, exp_avg_sq]);
            let mut out = vec![0.0f32; 20];
            direct.step_range(&assumed.step, 10..30, Grads::F32(&grads), &mut out).unwrap();
            assert_eq!(state.to_f32(), direct.to_f32(), "{dtype}");
            let weights = &spec.weights().unwrap()[..20];
            assert_eq!(weights, &direct.master[10..30], "the weights awaiting upload");
            assert_eq!(spec.stats().redone_steps, 2);
            assert_eq!(spec.stats().speculated_steps, 3);
            assert_eq!(spec.stats().paused_steps, 1);
        }
    }

    /// After a step redone for its clip coefficient the speculation sits out 1, 2, 4, … steps,
    /// at most MAX_PAUSE, while the clip goes on firing on the steps it speculates on; a step that
    /// stands ends the pauses. A step skipped (`None`) or redone for another reason (the same
    /// gradient scale: a changed learning rate) does not pause it; nor do backwards that end no
    /// step.
    #[test]
    fn the_clip_firing_pauses_the_speculation_longer_each_time() {
        let mut state = host_optimizer(OptimizerStateDtype::Fp32);
        let mut spec = speculation(usize::MAX).unwrap();
        let assumed = assumed(None);
        let clipped = AdamW::new(AdamWConfig::default()).unwrap().next_step(0.5);
        let other_lr = AdamW::new(AdamWConfig { lr: 0.5, ..AdamWConfig::default() })
            .unwrap()
            .next_step(assumed.step.grad_scale());
        let grads = [1.0f32; 4];
        // One step: true if it was speculated on.
        let mut step = |spec: &mut Speculation<f32>, actual: Option<&AdamWStep>| {
            spec.begin(&mut state, None);
            spec.begin(&mut state, Some(assumed));
            let speculated = spec.active();
            if speculated {
                let at = spec.reserve(4).unwrap();
                spec.step_piece(&mut state, 0..4, at, Grads::F32(&grads), None).unwrap();
            }
            spec.validate(&mut state, actual);
            speculated
        };
        let mut pattern = String::new();
        for _ in 0..80 {
            pattern.push(if step(&mut spec, Some(&clipped)) { 's' } else { '.' });
        }
        let gaps: Vec<usize> = pattern.split('s').skip(1).map(str::len).collect();
        let expected: Vec<usize> = [1, 2, 4, 8, 16, 32].into_iter().collect();
        assert_eq!(&gaps[..6], &expected[..], "{pattern}");
        assert!(gaps[6..gaps.len() - 1].iter().all(|&g| g == 32), "{pattern}");
        let paused = spec.stats().paused_steps;
        assert_eq!(paused, pattern.matches('.').count() as u64);
        // Sit out what is left of the pause, then a step stands: no more pauses.
        while !step(&mut spec, Some(&assumed.step)) {}
        for actual in [Some(&assumed.step), None, Some(&other_lr), Some(&assumed.step)] {
            assert!(step(&mut spec, actual), "speculated on after {actual:?}");
        }
    }

    fn host_optimizer(moments: OptimizerStateDtype) -> HostOptimizer {
        let device = CpuDevice::new().unwrap();
        let adam = CpuAdam::new(1, SimdLevel::detect()).unwrap();
        let fill = |master: &mut [f32]| master.fill(0.0);
        HostOptimizer::new(&device, 100, fill, HostMemory::Pageable, adam, moments).unwrap()
    }
}
