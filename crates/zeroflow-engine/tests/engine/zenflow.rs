//! ZenFlow's split update (DESIGN.md §6): the selected columns on the device every step, the
//! rest on the CPU once per window, on CPU-device ranks with the synthetic model.

use zeroflow_core::config::{Selection, UpdateInterval};
use zeroflow_engine::synthetic::{self, Reference, adamw_config, initial};
use zeroflow_engine::{LossScaler, Stage, ZenFlowAside, ZenFlowOptions};

use crate::harness::{Bf16, Resume, Setup, layout, max_rel_diff, reference, train, train_from};

fn zenflow(topk_ratio: f64, select: u64, update: u64, overlap_step: bool) -> ZenFlowOptions {
    ZenFlowOptions {
        topk_ratio,
        selection: Selection::Step { interval: select },
        update_interval: UpdateInterval::Every(update),
        auto_ratio: 0.99,
        overlap_step,
        full_warm_up_rounds: 0,
    }
}

/// Zen-auto (`update_interval: "auto"`) with reselection every `select` steps.
fn zen_auto(topk_ratio: f64, select: u64, auto_ratio: f64, overlap_step: bool) -> ZenFlowOptions {
    ZenFlowOptions {
        update_interval: UpdateInterval::Auto,
        auto_ratio,
        ..zenflow(topk_ratio, select, 1, overlap_step)
    }
}

/// A ZenFlow run: offload, one micro-step per step.
fn setup(stage: Stage, world: usize, steps: u32, options: ZenFlowOptions) -> Setup {
    Setup { steps, zenflow: Some(options), ..Setup::new(stage, world, 1, true) }
}

const LAYOUTS: [(Stage, usize); 5] =
    [(Stage::Zero2, 1), (Stage::Zero1, 2), (Stage::Zero2, 2), (Stage::Zero0, 2), (Stage::Zero2, 3)];

/// `topk_ratio: 1` selects every column: the whole model is updated by the device AdamW every
/// step, and the CPU's results are all discarded, so the run equals the engine without offload
/// (bit for bit), with and without overlap, whatever the intervals.
#[test]
fn topk_ratio_one_reproduces_the_device_adamw() {
    for (stage, world) in LAYOUTS {
        for overlap in [false, true] {
            let zenflow_run = setup(stage, world, 12, zenflow(1.0, 4, 2, overlap));
            let device_run = Setup::new(stage, world, 1, false);
            let device_run = Setup { steps: 12, ..device_run };
            let got = train::<f32>(&zenflow_run, LossScaler::None, None);
            let want = train::<f32>(&device_run, LossScaler::None, None);
            assert_eq!(got.weights, want.weights, "{zenflow_run:?}");
            assert_eq!(got.reports, want.reports, "{zenflow_run:?}");
        }
    }
    // bf16 weights and gradients: the compact gradients are cast to f32 like the accumulator's.
    let zenflow_run = setup(Stage::Zero2, 2, 12, zenflow(1.0, 4, 2, true));
    let device_run = Setup { steps: 12, ..Setup::new(Stage::Zero2, 2, 1, false) };
    let got = train::<Bf16>(&zenflow_run, LossScaler::None, None);
    let want = train::<Bf16>(&device_run, LossScaler::None, None);
    assert_eq!(got.weights, want.weights, "bf16 {zenflow_run:?}");
}

/// `topk_ratio: 0` selects nothing: with `update_interval: 1` and no overlap the run is
/// ZeRO-Offload, bit for bit.
#[test]
fn topk_ratio_zero_with_a_window_of_one_reproduces_zero_offload() {
    for (stage, world) in LAYOUTS {
        let zenflow_run = setup(stage, world, 12, zenflow(0.0, 1, 1, false));
        let offload_run = Setup { steps: 12, ..Setup::new(stage, world, 1, true) };
        let got = train::<f32>(&zenflow_run, LossScaler::None, None);
        let want = train::<f32>(&offload_run, LossScaler::None, None);
        assert_eq!(got.weights, want.weights, "{zenflow_run:?}");
        assert_eq!(got.reports, want.reports, "{zenflow_run:?}");
    }
}

/// With nothing selected the weights stay fixed within a window, so a window of `U` steps is
/// gradient accumulation over `U` micro-steps: ZenFlow equals plain AdamW with accumulation `U`
/// (the window's mean gradient, clipped by its own norm), and with `overlap_step` plain AdamW
/// whose gradients are one window stale (the delayed update without warm-up).
#[test]
fn the_host_window_is_gradient_accumulation_with_an_explicit_scale() {
    for (stage, world) in [(Stage::Zero2, 1), (Stage::Zero1, 2), (Stage::Zero2, 2)] {
        for overlap in [false, true] {
            let run = setup(stage, world, 4 * 6, zenflow(0.0, 4, 4, overlap));
            let got = train::<f32>(&run, LossScaler::None, None);
            let accumulating = Setup {
                steps: 6,
                delayed: overlap.then_some(0),
                ..Setup::new(stage, world, 4, true)
            };
            let (want, _) = reference::<f32>(&accumulating);
            for (rank, weights) in got.weights.iter().enumerate() {
                let diff = max_rel_diff(&layout(1), &weights[..want.len()], &want);
                // The window sums each step's rank-summed gradients in f32 (the reference sums
                // in f64; plain accumulation sums micro-steps before ranks): rounding, 1e-6 scale.
                assert!(diff <= 1e-5, "{run:?} rank {rank}: max relative difference {diff:e}");
            }
        }
    }
}

/// The first step selects, per weight, the `round(ratio × cols)` columns with the largest L1
/// norm of the rank-summed gradient, and every 1-D parameter; within the first window only those
/// change.
#[test]
fn the_first_step_updates_exactly_the_top_columns_and_the_vectors() {
    let ratio = 0.4;
    for (stage, world) in LAYOUTS {
        let run = setup(stage, world, 1, zenflow(ratio, 4, 4, false));
        let got = train::<f32>(&run, LossScaler::None, None);
        let single = layout(1);
        let start = initial::<f32>(&single);
        let reference = Reference::new::<f32>(world, 1, None, adamw_config());
        for param in single.params() {
            let range = param.flat_range();
            let grads = reference.window_sum::<f32>(range.clone(), 1);
            let cols = if param.shape.len() >= 2 { param.shape[param.shape.len() - 1] } else { 1 };
            let selected: Vec<bool> = if param.shape.len() < 2 {
                vec![true]
            } else {
                let mut importance = vec![0f64; cols];
                grads.iter().enumerate().for_each(|(i, g)| importance[i % cols] += g.abs());
                let mut order: Vec<usize> = (0..cols).collect();
                order.sort_by(|&a, &b| importance[b].total_cmp(&importance[a]));
                let k = ((ratio * cols as f64).round() as usize).max(1);
                (0..cols).map(|c| order[..k].contains(&c)).collect()
            };
            for (rank, weights) in got.weights.iter().enumerate() {
                for i in range.clone() {
                    let changed = weights[i] != start[i];
                    let want = selected[(i - range.start) % cols];
                    assert_eq!(changed, want, "{run:?} rank {rank} `{}` element {i}", param.name);
                }
            }
        }
    }
}

/// Under chaos (random delays before every device operation) ZenFlow's runs, the overlapped CPU
/// step and reselections included, are bit-identical to the calm run.
#[test]
fn zenflow_chaos_runs_are_bit_identical_to_the_calm_run() {
    for (stage, world) in [(Stage::Zero2, 2), (Stage::Zero1, 2), (Stage::Zero2, 1)] {
        for overlap in [true, false] {
            let options = [zenflow(0.3, 4, 2, overlap), zen_auto(0.3, 4, 0.5, overlap)];
            let run = setup(stage, world, 24, options[usize::from(overlap) ^ (world & 1)]);
            let calm = train::<f32>(&run, LossScaler::None, None);
            for seed in 1..=3 {
                let chaotic = Setup { chaos: Some(seed), ..run.clone() };
                let chaotic = train::<f32>(&chaotic, LossScaler::None, None);
                assert_eq!(chaotic.weights, calm.weights, "{run:?} chaos seed {seed}");
            }
        }
    }
}

/// The selection uses the reduced gradients, so ranks agree on it: stages 1 and 2, whose ranks
/// each own part of the weights (partitions cut through rows and columns), train the same model
/// as stage 0, whose ranks own everything, and every rank ends with the same weights.
#[test]
fn partitioned_stages_agree_with_stage_zero_and_ranks_agree() {
    for world in [2, 3] {
        for (overlap, auto) in [(false, false), (true, false), (false, true), (true, true)] {
            let options =
                if auto { zen_auto(0.4, 4, 0.5, overlap) } else { zenflow(0.4, 4, 2, overlap) };
            let whole =
                train::<f32>(&setup(Stage::Zero0, world, 16, options), LossScaler::None, None);
            let want = &whole.weights[0];
            for stage in [Stage::Zero1, Stage::Zero2] {
                let run = setup(stage, world, 16, options);
                let got = train::<f32>(&run, LossScaler::None, None);
                assert!(got.weights.windows(2).all(|w| w[0] == w[1]), "{run:?}: ranks disagree");
                let n = layout(1).padded_len().min(want.len());
                let diff = max_rel_diff(&layout(1), &got.weights[0][..n], &want[..n]);
                // All-reduce and reduce add the ranks' f32 gradients in different orders, and the
                // importances of a partitioned column are partial sums: rounding, 1e-6 scale.
                assert!(diff <= 1e-5, "{run:?}: max relative difference {diff:e} to stage 0");
            }
        }
    }
}

/// DeepSpeed's `"auto"` and `"epoch"` strategies reselect at epoch ends; without the trainer
/// reporting any, the columns are selected at the first step and kept, as DeepSpeed does without a
/// dataloader of its own, while a step interval reselects.
#[test]
fn auto_selection_without_epochs_keeps_the_first_columns() {
    for selection in [Selection::Auto, Selection::Epoch { interval: 2 }] {
        let options = ZenFlowOptions { selection, ..zenflow(0.25, 2, 1, false) };
        let out = train::<f32>(&setup(Stage::Zero2, 1, 9, options), LossScaler::None, None);
        let state = out.snapshots[0].zenflow.as_ref().expect("a ZenFlow run has ZenFlow state");
        assert_eq!(
            state.since_selection,
            Some(9),
            "{selection:?}: selected at the first of 9 steps only"
        );
    }
    let out = train::<f32>(
        &setup(Stage::Zero2, 1, 9, zenflow(0.25, 2, 1, false)),
        LossScaler::None,
        None,
    );
    let state = out.snapshots[0].zenflow.as_ref().expect("ZenFlow state");
    assert!(state.since_selection.unwrap() <= 2, "a step interval of 2 reselects: {state:?}");
}

/// `full_warm_up_rounds`: the first steps each end a window. With every step in the warm-up the
/// run is plain offload (nothing selected, a CPU step every step) bit for bit; with 4 warm-up steps
/// of 12 its first four steps are plain offload's, and the run as a whole equals neither plain
/// offload nor windows of 4 from the start.
#[test]
fn warm_up_rounds_end_a_window_every_step() {
    let windows =
        |warm_up| ZenFlowOptions { full_warm_up_rounds: warm_up, ..zenflow(0.0, 4, 4, false) };
    let plain = train::<f32>(
        &Setup { steps: 12, ..Setup::new(Stage::Zero2, 2, 1, true) },
        LossScaler::None,
        None,
    );
    let all_warm = train::<f32>(&setup(Stage::Zero2, 2, 12, windows(12)), LossScaler::None, None);
    assert_eq!(all_warm.weights, plain.weights, "all warm-up = plain offload");
    let some_warm = train::<f32>(&setup(Stage::Zero2, 2, 12, windows(4)), LossScaler::None, None);
    let no_warm = train::<f32>(&setup(Stage::Zero2, 2, 12, windows(0)), LossScaler::None, None);
    assert_ne!(some_warm.weights, plain.weights);
    assert_ne!(some_warm.weights, no_warm.weights);
    // Steps 1..=4 are windows of one, exactly plain offload's first four steps.
    assert_eq!(some_warm.reports[0][..4], plain.reports[0][..4], "the warm-up steps");
    assert_eq!(some_warm.weights[0], some_warm.weights[1], "ranks agree");
}

#[test]
fn unsupported_zenflow_settings_are_refused() {
    use zeroflow_device::CpuDevice;
    use zeroflow_device::cpu::CpuComm;
    use zeroflow_engine::{
        DynamicScaler, Engine, EngineError, EngineOptions, OffloadUpdate, ZenFlowOptions,
    };

    let device = CpuDevice::new().unwrap();
    let layout = layout(1);
    let init = initial::<f32>(&layout);
    let base = crate::harness::options(
        &setup(Stage::Zero2, 1, 1, zenflow(0.1, 2, 1, false)),
        LossScaler::None,
    );
    let with = |zenflow: ZenFlowOptions| {
        let mut options = base.clone();
        let offload = options.offload_mut().expect("ZenFlow offloads");
        offload.update = OffloadUpdate::ZenFlow(zenflow);
        options
    };
    // ZenFlow without offload, or with the delayed update, cannot be written as options (the
    // config's refusal of them is `options::tests`).
    let cases = [
        EngineOptions { grad_accum: 2, ..base.clone() },
        EngineOptions {
            scaler: LossScaler::Dynamic(DynamicScaler::new(8, 10, 1.0, 2, false)),
            ..base.clone()
        },
        with(zen_auto(0.1, 2, 1.5, false)),
        with(zenflow(1.5, 2, 1, false)),
        with(zenflow(0.1, 1, 2, false)),
    ];
    for options in cases {
        let comm = CpuComm::group(std::slice::from_ref(&device), std::time::Duration::from_secs(5))
            .remove(0);
        let result = Engine::<CpuDevice, CpuComm, f32>::new(
            device.clone(),
            comm,
            layout.clone(),
            options.clone(),
            &init,
        );
        assert!(matches!(result, Err(EngineError::Config(_))), "{options:?} was accepted");
    }
}

/// N steps, checkpoint (written and read back), restore into fresh engines, N more steps:
/// bit-identical to 2N steps straight, with the checkpoint in the middle of a window (the device
/// window holds part of it), after a reselection, with and without an overlapped CPU step in
/// flight, and resumed at the other partitioned stage.
#[test]
fn resuming_from_a_zenflow_checkpoint_is_bit_exact() {
    for (stage, resumed_stage, world, overlap) in [
        (Stage::Zero2, Stage::Zero2, 2, true),
        (Stage::Zero1, Stage::Zero1, 2, false),
        (Stage::Zero2, Stage::Zero2, 1, true),
        (Stage::Zero2, Stage::Zero1, 3, true),
    ] {
        // Selections at steps 1, 5 and 9 (window starts); the checkpoint after step 10.
        let run = setup(stage, world, 10, zenflow(0.4, 4, 4, overlap));
        let resume = check_resume(&run, resumed_stage);
        let state = &resume.zenflow[0];
        assert_eq!((state.steps_in_window, state.since_selection), (2, Some(2)), "{run:?}");
    }
    // Zen-auto: its window state (the masses so far) is part of the checkpoint.
    for (world, overlap) in [(2, true), (1, false)] {
        let run = setup(Stage::Zero2, world, 10, zen_auto(0.3, 6, 0.99, overlap));
        let resume = check_resume(&run, Stage::Zero2);
        assert!(!resume.zenflow[0].auto.is_empty(), "{run:?}: no Zen-auto state saved");
    }
    // Both host sides, the path before (the window in the host accumulator) included.
    for zenflow_aside in [ZenFlowAside::Device, ZenFlowAside::Host] {
        let run = Setup { zenflow_aside, ..setup(Stage::Zero2, 2, 10, zenflow(0.4, 4, 4, true)) };
        check_resume(&run, Stage::Zero2);
    }
}

/// Trains `run`, checkpoints, resumes at `resumed_stage` for as many steps again and checks the
/// result bit-identical to the straight run of twice the steps; returns the checkpoint.
fn check_resume(run: &Setup, resumed_stage: Stage) -> Resume<f32> {
    let world = run.world;
    let straight = Setup { steps: 2 * run.steps, ..run.clone() };
    let straight = train_from::<f32>(&straight, LossScaler::None, None, None);
    let first = train_from::<f32>(run, LossScaler::None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("checkpoint");
    crate::checkpoint::save(&path, run, &first);
    let resume = crate::checkpoint::load(&path, world);
    assert_eq!(resume.zenflow.len(), world, "{run:?}");
    let resumed = Setup { stage: resumed_stage, ..run.clone() };
    // Restored as `zeroflow train --resume` does: the optimizer state read from the files.
    let from_files = crate::checkpoint::open(&path, world);
    let second = train_from(&resumed, LossScaler::None, None, Some(&from_files));
    assert_eq!(second.weights, straight.weights, "{run:?}: weights");
    if resumed_stage == run.stage {
        assert_eq!(second.snapshots, straight.snapshots, "{run:?}: optimizer and ZenFlow state");
    }
    resume
}

/// ZenFlow on the host, one rank, written from DESIGN.md §6 and `zenflow.rs`'s rules, element by
/// element: the oracle for the engine's mixed runs.
struct ZenFlowReference {
    ratio: f64,
    select_interval: u64,
    update_interval: u64,
    overlap: bool,
    clip: f64,
    /// The weights the model reads.
    weights: Vec<f32>,
    /// The CPU optimizer's state and the device's (meaningful where selected).
    host: [Vec<f32>; 3],
    device: [Vec<f32>; 3],
    selected: Vec<bool>,
    acc: Vec<f32>,
    steps_in_window: u64,
    since_selection: Option<u64>,
    /// With overlap: the last window's weights, not yet applied.
    pending: Option<Vec<f32>>,
    device_adamw: zeroflow_optim::AdamW,
    cpu_adamw: zeroflow_optim::AdamW,
    adam: zeroflow_optim::CpuAdam,
}

impl ZenFlowReference {
    fn new(options: ZenFlowOptions, clip: f64) -> Self {
        let (Selection::Step { interval: select }, UpdateInterval::Every(update)) =
            (options.selection, options.update_interval)
        else {
            panic!("fixed intervals only")
        };
        let weights = initial::<f32>(&layout(1));
        let n = weights.len();
        let zeros = || [weights.clone(), vec![0.0; n], vec![0.0; n]];
        ZenFlowReference {
            ratio: options.topk_ratio,
            select_interval: select,
            update_interval: update,
            overlap: options.overlap_step,
            clip,
            host: zeros(),
            device: zeros(),
            weights,
            selected: vec![false; n],
            acc: vec![0.0; n],
            steps_in_window: 0,
            since_selection: None,
            pending: None,
            device_adamw: zeroflow_optim::AdamW::new(adamw_config()).unwrap(),
            cpu_adamw: zeroflow_optim::AdamW::new(adamw_config()).unwrap(),
            adam: zeroflow_optim::CpuAdam::new(1, zeroflow_optim::SimdLevel::detect()).unwrap(),
        }
    }

    fn clip_scale(&self, sum_squares: f64, summed: f64) -> f32 {
        let norm = f64::from(sum_squares as f32).sqrt() / summed;
        let coef = if norm + 1e-6 > self.clip { self.clip / (norm + 1e-6) } else { 1.0 };
        (coef / summed) as f32
    }

    /// The CPU's weights reach the model where the device does not update.
    fn apply(&mut self, weights: &[f32]) {
        for (i, w) in weights.iter().enumerate() {
            if !self.selected[i] {
                self.weights[i] = *w;
            }
        }
    }

    fn select(&mut self) {
        if let Some(pending) = self.pending.take() {
            self.apply(&pending);
        }
        for (i, _) in self.selected.iter().enumerate().filter(|(_, s)| **s) {
            (0..3).for_each(|s| self.host[s][i] = self.device[s][i]);
        }
        let single = layout(1);
        for p in single.params() {
            let range = p.flat_range();
            let two_d = p.shape.len() >= 2;
            let cols = if two_d { p.shape[p.shape.len() - 1] } else { 1 };
            let mut importance = vec![0f64; cols];
            range
                .clone()
                .for_each(|i| importance[(i - range.start) % cols] += f64::from(self.acc[i].abs()));
            let importance: Vec<f32> = importance.iter().map(|x| *x as f32).collect();
            let mut order: Vec<usize> = (0..cols).collect();
            order.sort_by(|&a, &b| importance[b].total_cmp(&importance[a]).then(a.cmp(&b)));
            let k = if two_d {
                ((self.ratio * cols as f64).round() as usize).clamp(1, cols)
            } else {
                1
            };
            for i in range.clone() {
                self.selected[i] = order[..k].contains(&((i - range.start) % cols));
            }
        }
        for (i, _) in self.selected.iter().enumerate().filter(|(_, s)| **s) {
            (0..3).for_each(|s| self.device[s][i] = self.host[s][i]);
        }
        self.since_selection = Some(0);
    }

    fn step(&mut self, k: u64) {
        let single = layout(1);
        let mut grads = vec![0f32; self.weights.len()];
        for p in single.params() {
            for i in p.flat_range() {
                grads[i] = zeroflow_engine::synthetic::grad(i, self.weights[i], 0, k);
            }
        }
        self.acc.iter_mut().zip(&grads).for_each(|(a, g)| *a += g);
        let due = self.since_selection.is_none_or(|s| s >= self.select_interval);
        if self.ratio > 0.0 && self.steps_in_window == 0 && due {
            self.select();
        }
        let sum: f64 = grads.iter().map(|g| f64::from(*g).powi(2)).sum();
        let scale = self.clip_scale(sum, 1.0);
        let step = self.device_adamw.next_step(scale);
        let chosen: Vec<usize> = (0..grads.len()).filter(|&i| self.selected[i]).collect();
        let mut compact: [Vec<f32>; 3] =
            std::array::from_fn(|s| chosen.iter().map(|&i| self.device[s][i]).collect());
        let compact_grads: Vec<f32> = chosen.iter().map(|&i| grads[i]).collect();
        let one_d = synthetic::one_d_elements(&layout(1));
        let compact_one_d: Vec<bool> = chosen.iter().map(|&i| one_d[i]).collect();
        let [params, exp_avg, exp_avg_sq] = &mut compact;
        let state = [params, exp_avg, exp_avg_sq];
        synthetic::adamw_each(&self.adam, &step, state, &compact_grads, &compact_one_d);
        for (j, &i) in chosen.iter().enumerate() {
            (0..3).for_each(|s| self.device[s][i] = compact[s][j]);
            self.weights[i] = self.device[0][i];
        }
        self.steps_in_window += 1;
        self.since_selection = self.since_selection.map(|s| s + 1);
        if self.steps_in_window < self.update_interval {
            return;
        }
        self.steps_in_window = 0;
        let cpu_scale = if self.update_interval == 1 {
            scale
        } else {
            let sum: f64 = self.acc.iter().map(|g| f64::from(*g).powi(2)).sum();
            self.clip_scale(sum, self.update_interval as f64)
        };
        let cpu_step = self.cpu_adamw.next_step(cpu_scale);
        let [params, exp_avg, exp_avg_sq] = &mut self.host;
        let state = [params, exp_avg, exp_avg_sq];
        synthetic::adamw_each(&self.adam, &cpu_step, state, &self.acc, &one_d);
        let result = self.host[0].clone();
        match self.overlap {
            true => {
                if let Some(last) = self.pending.replace(result) {
                    self.apply(&last);
                }
            }
            false => self.apply(&result),
        }
        self.acc.fill(0.0);
    }

    /// The weights after `steps` steps, any pending CPU result applied.
    fn train(mut self, steps: u64) -> Vec<f32> {
        (0..steps).for_each(|k| self.step(k));
        if let Some(pending) = self.pending.take() {
            self.apply(&pending);
        }
        self.weights
    }
}

/// A mixed run (some columns on the device, the rest in host windows, reselections, with and
/// without overlap) equals the element-by-element host reference of ZenFlow's rules.
#[test]
fn a_mixed_run_equals_the_host_reference() {
    for (ratio, select, update, overlap) in
        [(0.4, 4, 2, false), (0.4, 4, 2, true), (0.3, 3, 1, false), (0.5, 6, 3, true)]
    {
        let options = zenflow(ratio, select, update, overlap);
        let run = setup(Stage::Zero2, 1, 18, options);
        let got = train::<f32>(&run, LossScaler::None, None);
        let want = ZenFlowReference::new(options, 0.8).train(18);
        let diff = max_rel_diff(&layout(1), &got.weights[0], &want);
        assert!(diff <= 1e-6, "{run:?}: max relative difference {diff:e}");
    }
}

/// Zen-auto with `auto_ratio: 0` ends every window at once (no weight needs to be ready), so it
/// equals `update_interval: 1` bit for bit, with and without overlap and at every layout.
#[test]
fn zen_auto_with_auto_ratio_zero_is_a_window_of_one() {
    for (stage, world) in LAYOUTS {
        for overlap in [false, true] {
            let auto = train::<f32>(
                &setup(stage, world, 10, zen_auto(0.3, 4, 0.0, overlap)),
                LossScaler::None,
                None,
            );
            let every = train::<f32>(
                &setup(stage, world, 10, zenflow(0.3, 4, 1, overlap)),
                LossScaler::None,
                None,
            );
            assert_eq!(auto.weights, every.weights, "{stage:?} world {world} overlap {overlap}");
        }
    }
}

/// Zen-auto's windows are longer than one step on the synthetic model (its unselected columns
/// carry less mass than the selected ones), so the CPU steps fewer times than the device, and the
/// windows it chose are the same on every rank.
#[test]
fn zen_auto_windows_span_several_steps_and_ranks_agree() {
    let run = setup(Stage::Zero2, 2, 16, zen_auto(0.3, 16, 0.99, false));
    let got = train::<f32>(&run, LossScaler::None, None);
    assert!(got.weights.windows(2).all(|w| w[0] == w[1]), "ranks disagree");
    let windows =
        got.snapshots.iter().map(|s| s.zenflow.as_ref().expect("ZenFlow state").cpu_steps);
    let cpu_steps: Vec<u64> = windows.collect();
    assert!(cpu_steps.windows(2).all(|w| w[0] == w[1]), "ranks disagree on windows: {cpu_steps:?}");
    assert!((1..16).contains(&cpu_steps[0]), "CPU steps over 16 steps: {}", cpu_steps[0]);
}

/// ZenFlow's host link carries one fp32 window out and one partition of weights in per window,
/// plus four bytes per step (the gradient norm) — not every step's gradients: one more window
/// (8 more steps) adds exactly that to the device's copy counters, on every rank. Without overlap
/// the CPU step is the training thread's wait; without offload there is none.
#[test]
fn zenflow_moves_one_window_out_and_one_partition_in_per_window() {
    for world in [1, 2] {
        let short = setup(Stage::Zero2, world, 8, zenflow(0.3, 64, 8, false));
        let long = Setup { steps: 16, ..short.clone() };
        let (short, long) = (
            train::<f32>(&short, LossScaler::None, None),
            train::<f32>(&long, LossScaler::None, None),
        );
        for rank in 0..world {
            let owned = layout(world).partition_range(rank).len() as u64;
            let (a, b) = (short.traffic[rank], long.traffic[rank]);
            let more = b.copied.since(a.copied);
            let (out, into) = (more.device_to_host, more.host_to_device);
            // 8 step norms and the window's norm, 4 bytes each.
            assert_eq!(out, 4 * owned + 9 * 4, "world {world} rank {rank}: bytes out");
            assert_eq!(into, 4 * owned, "world {world} rank {rank}: bytes in");
            assert!(a.cpu_wait > std::time::Duration::ZERO, "the inline CPU step is a wait");
        }
    }
    let device_run = train::<f32>(
        &Setup { steps: 4, ..Setup::new(Stage::Zero2, 1, 1, false) },
        LossScaler::None,
        None,
    );
    assert_eq!(device_run.traffic[0].cpu_wait, std::time::Duration::ZERO);
}

/// With `select_strategy` "epoch" the columns are selected again once `select_interval` reported
/// epochs have ended (at the next window start): epochs of 2 steps and an interval of 2 epochs
/// are a selection every 4 steps, bit for bit, and so is "auto" (every epoch) with epochs of 4;
/// without epoch reports the first selection stays. The epoch count survives a checkpoint.
#[test]
fn epoch_selection_follows_the_reported_epochs() {
    let by_steps = setup(Stage::Zero2, 2, 16, zenflow(0.3, 4, 2, true));
    let want = train::<f32>(&by_steps, LossScaler::None, None);
    let epochs = |selection, epoch_steps| Setup {
        epoch_steps: Some(epoch_steps),
        ..setup(Stage::Zero2, 2, 16, ZenFlowOptions { selection, ..zenflow(0.3, 4, 2, true) })
    };
    let every_two = epochs(Selection::Epoch { interval: 2 }, 2);
    assert_eq!(train::<f32>(&every_two, LossScaler::None, None).weights, want.weights, "epoch");
    let auto = epochs(Selection::Auto, 4);
    assert_eq!(train::<f32>(&auto, LossScaler::None, None).weights, want.weights, "auto");
    let unreported = Setup { epoch_steps: None, ..auto.clone() };
    let once = train::<f32>(&unreported, LossScaler::None, None);
    assert_ne!(once.weights, want.weights, "without epoch reports the selection stays");
    // Checkpointed after 4 steps (one epoch reported, its reselection due at step 5): resumes
    // exactly, the reported epoch included.
    let resume = check_resume(&Setup { steps: 4, ..auto }, Stage::Zero2);
    assert_eq!(resume.zenflow[0].epochs_since_selection, 1, "the epoch reported at step 4");
}

/// ZenFlow's CPU step streams the device window through the host chunk by chunk: small, uneven
/// chunks (7 and 64 elements), calm and under chaos (randomly delayed streams, so every chunk's
/// hand-off must be ordered by its own wait), give the run streamed in one chunk, which is one
/// AdamW step over the whole partition's fp32 window as the host accumulator used to hold it,
/// bit for bit: weights, step reports and snapshots (optimizer and ZenFlow state), inline and
/// overlapped, with reselections and a window of one, on one and two ranks, in f32 and bf16.
/// The path before, kept selectable (`ZenFlowAside::Host`: the window copied into the host
/// accumulator, the whole partition stepped at once), gives the same bits.
#[test]
fn the_streamed_cpu_step_is_bit_identical_whatever_the_chunk() {
    for (world, overlap, update) in [(1, false, 2), (1, true, 3), (2, true, 2), (2, false, 1)] {
        let whole = Setup {
            stream_chunk: 1 << 30,
            zenflow_aside: ZenFlowAside::Device,
            ..setup(Stage::Zero2, world, 16, zenflow(0.3, 4, update, overlap))
        };
        let want = train::<f32>(&whole, LossScaler::None, None);
        let on_host = ZenFlowAside::Host;
        for (stream_chunk, chaos, zenflow_aside) in [
            (7, None, ZenFlowAside::Device),
            (64, Some(3), ZenFlowAside::Device),
            (7, Some(5), ZenFlowAside::Device),
            (1 << 30, None, on_host),
            (7, Some(3), on_host),
        ] {
            let run = Setup { stream_chunk, chaos, zenflow_aside, ..whole.clone() };
            let got = train::<f32>(&run, LossScaler::None, None);
            assert_eq!(got.weights, want.weights, "{run:?}: weights");
            assert_eq!(got.reports, want.reports, "{run:?}: step reports");
            assert_eq!(got.snapshots, want.snapshots, "{run:?}: optimizer and ZenFlow state");
        }
    }
    let whole = Setup {
        stream_chunk: 1 << 30,
        zenflow_aside: ZenFlowAside::Device,
        ..setup(Stage::Zero2, 2, 12, zenflow(0.3, 4, 2, true))
    };
    let want = train::<Bf16>(&whole, LossScaler::None, None);
    let got = train::<Bf16>(&Setup { stream_chunk: 7, ..whole.clone() }, LossScaler::None, None);
    assert_eq!(got.weights, want.weights, "bf16: weights");
    let on_host = Setup { stream_chunk: 7, zenflow_aside: ZenFlowAside::Host, ..whole.clone() };
    let got = train::<Bf16>(&on_host, LossScaler::None, None);
    assert_eq!(got.weights, want.weights, "bf16, the window aside on the host: weights");
}

/// ZenFlow's host path (`ZenFlowAside::Host`) applies its weights in pieces of the stream chunk
/// that the next forward opens as it reaches them (one rank, `overlap_forward`): each of the
/// forward's reads waits for its own piece, and the run is the one whose weights are applied
/// whole before the forward, bit for bit — weights, step reports, optimizer and ZenFlow state —
/// calm and under chaos (randomly delayed streams: a read before its piece's copy and the
/// columns scattered over it would see the last window's weights), inline and overlapped, with
/// chunks that cut the selection's blocks, in f32 and bf16; and on two ranks, where the option
/// leaves the weights applied whole.
#[test]
fn the_forward_opens_the_host_paths_weights_piece_by_piece() {
    let runs = [(1, true, 3, 7), (1, false, 2, 5), (1, true, 1, 64), (2, true, 2, 7)];
    for (world, overlap_step, update, stream_chunk) in runs {
        let whole = Setup {
            stream_chunk,
            zenflow_aside: ZenFlowAside::Host,
            ..setup(Stage::Zero2, world, 14, zenflow(0.3, 4, update, overlap_step))
        };
        let want = train::<f32>(&whole, LossScaler::None, None);
        for chaos in [None, Some(2), Some(5)] {
            let opened = Setup { overlap_forward: true, chaos, ..whole.clone() };
            let got = train::<f32>(&opened, LossScaler::None, None);
            assert_eq!(got.weights, want.weights, "{opened:?}: weights");
            assert_eq!(got.reports, want.reports, "{opened:?}: step reports");
            assert_eq!(got.snapshots, want.snapshots, "{opened:?}: optimizer and ZenFlow state");
        }
    }
    let whole = Setup {
        stream_chunk: 7,
        zenflow_aside: ZenFlowAside::Host,
        ..setup(Stage::Zero2, 1, 12, zenflow(0.3, 4, 2, true))
    };
    let want = train::<Bf16>(&whole, LossScaler::None, None);
    let opened = Setup { overlap_forward: true, chaos: Some(3), ..whole.clone() };
    let got = train::<Bf16>(&opened, LossScaler::None, None);
    assert_eq!(got.weights, want.weights, "bf16, opened piece by piece: weights");
    assert_eq!(got.snapshots, want.snapshots, "bf16, opened piece by piece: state");
}

/// ZenFlow follows each parameter's split axis: a `[9, 6]` weight split by axis 0 has its rows
/// ranked by the L1 norms of their gradients (summed over ranks) and the top rows stepped on the
/// device. Within the first window exactly the top rows (and the vector) change; and the run
/// equals, bit for bit, the run of its transpose `[6, 9]` split by the default last axis, whose
/// columns are those rows, on one rank and on two (whose partitions cut through rows), inline and
/// overlapped.
#[test]
fn a_split_axis_of_zero_selects_rows_as_the_transpose_selects_columns() {
    use zeroflow_core::layout::ParamSpec;
    let (rows, cols) = (9, 6);
    let by_rows = [
        ParamSpec::new("w", vec![rows, cols]).with_split_axis(Some(0)),
        ParamSpec::new("b", vec![5]),
    ];
    let transposed = [ParamSpec::new("w", vec![cols, rows]), ParamSpec::new("b", vec![5])];
    // Element [r, c] of w is flat r × cols + c by rows, and c × rows + r transposed.
    let row_major = |flat: usize| flat;
    let from_transposed = |flat: usize| match flat < rows * cols {
        true => (flat % rows) * cols + flat / rows,
        false => flat,
    };
    // One step of a window of four: only the device has stepped.
    let first = split_run(&by_rows, 1, 1, zenflow(0.34, 8, 4, false), row_major);
    let initial = split_initial(&by_rows, 1, row_major);
    let l1 = |r: usize| -> f64 {
        let g = |c: usize| synthetic::grad(r * cols + c, initial[r * cols + c], 0, 0);
        (0..cols).map(|c| f64::from(g(c).abs())).sum()
    };
    let mut order: Vec<usize> = (0..rows).collect();
    order.sort_by(|&a, &b| l1(b).total_cmp(&l1(a)));
    let top = &order[..3];
    for r in 0..rows {
        let changed = (0..cols).filter(|&c| first[0][r * cols + c] != initial[r * cols + c]);
        let want = if top.contains(&r) { cols } else { 0 };
        assert_eq!(changed.count(), want, "row {r} (top rows {top:?})");
    }
    let b = 56..61;
    assert!(b.clone().all(|i| first[0][i] != initial[i]), "the vector is always selected");
    for (world, overlap) in [(1, false), (2, true), (2, false)] {
        let options = zenflow(0.34, 4, 2, overlap);
        let got = split_run(&by_rows, world, 10, options, row_major);
        let want = split_run(&transposed, world, 10, options, from_transposed);
        for (rank, (got, want)) in got.iter().zip(&want).enumerate() {
            // The weight's elements, then the vector's (54 and 55 are padding).
            for flat in (0..rows * cols).chain(b.clone()) {
                let at = if flat < rows * cols { (flat % cols) * rows + flat / cols } else { flat };
                let (g, w) = (got[flat], want[at]);
                assert_eq!(g.to_bits(), w.to_bits(), "world {world} rank {rank} element {flat}");
            }
        }
    }
}

/// The initial weights of the split-axis test's layout: element `logical(flat)` of the weight as
/// the row-major `[9, 6]` sees it, so that both layouts start alike (padding zero).
fn split_initial(
    specs: &[zeroflow_core::layout::ParamSpec],
    world: usize,
    logical: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let layout = split_layout(specs, world);
    let mut flat = vec![0.0; layout.padded_len()];
    for p in layout.params() {
        for i in p.flat_range() {
            flat[i] = 0.2 * (((logical(i) * 37) % 101) as f32 / 101.0 - 0.5);
        }
    }
    flat
}

fn split_layout(
    specs: &[zeroflow_core::layout::ParamSpec],
    world: usize,
) -> zeroflow_core::layout::FlatLayout {
    use zeroflow_core::layout::{Alignment, FlatLayout};
    FlatLayout::new(specs, world, Alignment { param: 4, partition: 2 }).expect("a layout")
}

/// Trains the split-axis test's layout with ZenFlow for `steps` steps on `world` CPU ranks, the
/// gradient of flat element `i` being the synthetic gradient of `logical(i)` (without clipping,
/// so that the two layouts' norms, summed in different orders, do not enter); every rank's
/// flushed weights.
fn split_run(
    specs: &[zeroflow_core::layout::ParamSpec],
    world: usize,
    steps: u64,
    options: ZenFlowOptions,
    logical: impl Fn(usize) -> usize + Sync,
) -> Vec<Vec<f32>> {
    use zeroflow_device::cpu::{CpuComm, KernelArgs};
    use zeroflow_device::{CpuDevice, Device, StreamKind};
    use zeroflow_engine::Engine;
    let run =
        Setup { zenflow: Some(options), clip: None, ..Setup::new(Stage::Zero2, world, 1, true) };
    let devices: Vec<CpuDevice> = (0..world).map(|_| CpuDevice::new().unwrap()).collect();
    let comms = CpuComm::group(&devices, std::time::Duration::from_secs(30));
    let (logical, run) = (&logical, &run);
    std::thread::scope(|s| {
        let handles: Vec<_> = (devices.into_iter().zip(comms).enumerate())
            .map(|(rank, (device, comm))| {
                s.spawn(move || {
                    let layout = split_layout(specs, world);
                    let init = split_initial(specs, world, logical);
                    let options = crate::harness::options(run, LossScaler::None);
                    let mut engine: Engine<CpuDevice, CpuComm, f32> =
                        Engine::new(device.clone(), comm, layout.clone(), options, &init).unwrap();
                    for k in 0..steps {
                        engine
                            .backward(|io, ready| {
                                let compute = device.stream(StreamKind::Compute);
                                for p in layout.params().iter().rev() {
                                    let range = p.flat_range();
                                    let at: Vec<usize> = range.clone().map(logical).collect();
                                    let args = KernelArgs::new()
                                        .input(io.params, range.clone())
                                        .in_out(io.grads, range.clone());
                                    let scale = io.loss_scale;
                                    device.launch(compute, "split_backward", args, move |ctx| {
                                        let (w, g) = (ctx.input::<f32>(0), ctx.output::<f32>(1));
                                        for ((g, w), &i) in g.iter_mut().zip(w).zip(&at) {
                                            *g += scale * synthetic::grad(i, *w, rank, k);
                                        }
                                        Ok(())
                                    })?;
                                    ready(range)?;
                                }
                                Ok::<(), zeroflow_engine::EngineError>(())
                            })
                            .unwrap();
                        engine.step().unwrap();
                    }
                    engine.flush().unwrap();
                    device.download(engine.params()).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
