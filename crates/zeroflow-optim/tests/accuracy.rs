//! AdamW against an f64 reference written from torch's formulas.

use zeroflow_optim::{
    AdamW, AdamWStep, CpuAdam, NoDecay, Output, SimdLevel, WeightDecayMode, bf16,
};

use crate::support::{
    GradType, State, StepGrads, normwise_relative_error, reference_step, rng, test_config,
};

/// Odd, so that every kernel also runs its tail.
const LEN: usize = 4099;
const STEPS: u64 = 100;
const TOLERANCE: f64 = 1e-6;
const GRAD_SCALE: f32 = 0.37;

/// One combination of the kernel's forms.
#[derive(Clone, Copy, Debug)]
struct Case {
    level: SimdLevel,
    grads: GradType,
    bf16_copy: bool,
    mode: WeightDecayMode,
    bias_correction: bool,
}

/// Every combination, for every SIMD level this CPU has.
fn cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for level in SimdLevel::available() {
        for grads in [GradType::F32, GradType::Bf16] {
            for bf16_copy in [false, true] {
                for mode in [WeightDecayMode::Decoupled, WeightDecayMode::L2] {
                    for bias_correction in [true, false] {
                        cases.push(Case { level, grads, bf16_copy, mode, bias_correction });
                    }
                }
            }
        }
    }
    cases
}

/// Runs one kernel step of `case` on `state` and returns the bf16 copy it wrote (empty without).
fn kernel_step(
    adam: &CpuAdam,
    case: Case,
    step: &AdamWStep,
    state: &mut State,
    grads: &StepGrads,
) -> Vec<bf16> {
    let mut copy = vec![bf16::ZERO; if case.bf16_copy { LEN } else { 0 }];
    let out = if case.bf16_copy { Output::AlsoBf16(&mut copy) } else { Output::MasterOnly };
    adam.step(step, state.view(), grads.as_grads(), out).expect("lengths match");
    copy
}

/// The bf16 copy written in the pass is `bf16::from_f32` of the updated fp32 weights.
fn check_copy(case: Case, step: u64, copy: &[bf16], params: &[f32], failures: &mut Vec<String>) {
    if !case.bf16_copy {
        return;
    }
    let wrong =
        copy.iter().zip(params).filter(|(c, p)| c.to_bits() != bf16::from_f32(**p).to_bits());
    let wrong = wrong.count();
    if wrong > 0 {
        failures.push(format!("{case:?} step {step}: {wrong} bf16 copies differ from from_f32"));
    }
}

/// Over 100 steps on random non-zero data, the weights and both moments stay within 1e-6
/// (normwise relative error) of an f64 AdamW run from the same start, and the bf16 copy equals
/// `bf16::from_f32` of the weights, for every SIMD level the CPU has, f32 and bf16 gradients,
/// with and without the bf16 copy, decoupled and L2 weight decay, with and without bias
/// correction.
#[test]
fn hundred_steps_stay_within_1e_6_of_the_f64_reference_in_every_form() {
    let mut failures = Vec::new();
    for (index, case) in cases().into_iter().enumerate() {
        let adam = CpuAdam::new(2, case.level).expect("an available level");
        let config = test_config(case.mode, case.bias_correction);
        let mut optimizer = AdamW::new(config).expect("a valid config");
        let mut rng = rng(index as u64);
        let mut state = State::random(&mut rng, LEN);
        let mut reference = state.to_f64();
        let mut worst = [0.0f64; 3];
        for _ in 0..STEPS {
            let grads = StepGrads::random(&mut rng, LEN, case.grads);
            let step = optimizer.next_step(GRAD_SCALE);
            let copy = kernel_step(&adam, case, &step, &mut state, &grads);
            let grad_scale = f64::from(GRAD_SCALE);
            reference_step(&config, step.step(), grad_scale, &grads.f32, &mut reference);
            check_copy(case, step.step(), &copy, &state.params, &mut failures);
            let errors = [
                normwise_relative_error(&state.params, &reference.params),
                normwise_relative_error(&state.exp_avg, &reference.exp_avg),
                normwise_relative_error(&state.exp_avg_sq, &reference.exp_avg_sq),
            ];
            for (worst, error) in worst.iter_mut().zip(errors) {
                *worst = worst.max(error);
            }
        }
        if worst.iter().any(|&error| error.is_nan() || error > TOLERANCE) {
            let [p, m, v] = worst;
            failures.push(format!("{case:?}: worst relative errors p {p:.2e} m {m:.2e} v {v:.2e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each single step, applied to the kernel's own f32 state, matches the f64 step from that same
/// state element by element to 1e-6: the weights relative to themselves, the moments relative to
/// the size of the terms summed into them (in L2 mode `g + wd p` may cancel, and f32 cannot do
/// better than its inputs' rounding there).
#[test]
fn each_step_matches_the_f64_step_element_by_element() {
    let mut failures = Vec::new();
    for (index, case) in cases().into_iter().enumerate() {
        let adam = CpuAdam::new(1, case.level).expect("an available level");
        let config = test_config(case.mode, case.bias_correction);
        let (beta1, beta2) = config.betas;
        let mut optimizer = AdamW::new(config).expect("a valid config");
        let mut rng = rng(1000 + index as u64);
        let mut state = State::random(&mut rng, LEN);
        for _ in 0..STEPS {
            let grads = StepGrads::random(&mut rng, LEN, case.grads);
            let before = state.clone();
            let mut reference = before.to_f64();
            let step = optimizer.next_step(GRAD_SCALE);
            kernel_step(&adam, case, &step, &mut state, &grads);
            reference_step(&config, step.step(), f64::from(GRAD_SCALE), &grads.f32, &mut reference);
            for i in 0..LEN {
                // The magnitude of the terms summed into m (they may cancel).
                let mut g_terms = (f64::from(grads.f32[i]) * f64::from(GRAD_SCALE)).abs();
                if case.mode == WeightDecayMode::L2 {
                    g_terms += config.weight_decay * f64::from(before.params[i]).abs();
                }
                let m_terms = beta1 * f64::from(before.exp_avg[i]).abs() + (1.0 - beta1) * g_terms;
                let v_terms =
                    beta2 * f64::from(before.exp_avg_sq[i]) + (1.0 - beta2) * g_terms.powi(2);
                let p_error = (f64::from(state.params[i]) - reference.params[i]).abs();
                let m_error = (f64::from(state.exp_avg[i]) - reference.exp_avg[i]).abs();
                let v_error = (f64::from(state.exp_avg_sq[i]) - reference.exp_avg_sq[i]).abs();
                let ok = p_error <= TOLERANCE * reference.params[i].abs()
                    && m_error <= TOLERANCE * m_terms
                    && v_error <= TOLERANCE * v_terms;
                if !ok {
                    failures.push(format!(
                        "{case:?} step {} element {i}: errors p {p_error:.1e} m {m_error:.1e} \
                         v {v_error:.1e} (expected p {:e} m {:e} v {:e})",
                        step.step(),
                        reference.params[i],
                        reference.exp_avg[i],
                        reference.exp_avg_sq[i]
                    ));
                    break;
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The weight decay modes are different computations: with the same data, decoupled decay and
/// L2 decay give different weights (so the reference comparisons above tell them apart).
#[test]
fn decoupled_and_l2_decay_give_different_weights() {
    let level = SimdLevel::detect();
    let adam = CpuAdam::new(1, level).expect("the detected level");
    let mut rng = rng(7);
    let start = State::random(&mut rng, LEN);
    let grads = StepGrads::random(&mut rng, LEN, GradType::F32);
    let mut results = Vec::new();
    for mode in [WeightDecayMode::Decoupled, WeightDecayMode::L2] {
        let mut state = start.clone();
        let step = AdamWStep::new(&test_config(mode, true), 3, 1.0).expect("valid");
        adam.step(&step, state.view(), grads.as_grads(), Output::MasterOnly).expect("lengths");
        results.push(state.params);
    }
    let differing = results[0].iter().zip(&results[1]).filter(|(a, b)| a != b).count();
    assert!(differing > LEN / 2, "only {differing} of {LEN} weights differ");
}

/// The elements of [`NoDecay`] are stepped as a configuration without weight decay steps them,
/// the others with it — bit for bit, in both modes, over a whole partition and over ranges that
/// cut through the runs, on several threads (the chunks then fall across the runs too).
#[test]
#[allow(clippy::single_range_in_vec_init, reason = "lists of ranges, one of them a single one")]
fn elements_without_decay_step_as_a_configuration_without_decay() {
    let level = SimdLevel::detect();
    let mut rng = rng(11);
    let start = State::random(&mut rng, LEN);
    let grads = StepGrads::random(&mut rng, LEN, GradType::Bf16);
    let no_decay = NoDecay::new(vec![0..3, 700..1000, 1001..1002, 4000..LEN]);
    for mode in [WeightDecayMode::Decoupled, WeightDecayMode::L2] {
        let config = test_config(mode, true);
        let without = zeroflow_optim::AdamWConfig { weight_decay: 0.0, ..config };
        let stepped = |config, adam: &CpuAdam, ranges: &[std::ops::Range<usize>]| {
            let mut state = start.clone();
            let step = AdamWStep::new(&config, 4, 1.0).expect("valid");
            for range in ranges {
                let grads = grads.range(range.clone());
                adam.step_range(&step, state.view(), range.clone(), grads, Output::MasterOnly)
                    .expect("lengths");
            }
            state
        };
        let decays = |config| AdamWStep::new(&config, 4, 1.0).expect("valid").decays();
        assert!(decays(config) && !decays(without));
        let step = AdamWStep::new(&config, 4, 1.0).expect("valid");
        assert_eq!(step.without_weight_decay(), AdamWStep::new(&without, 4, 1.0).expect("valid"));
        let plain = CpuAdam::new(1, level).expect("the detected level");
        let (decayed, undecayed) =
            (stepped(config, &plain, &[0..LEN]), stepped(without, &plain, &[0..LEN]));
        for (threads, ranges) in [(1, vec![0..LEN]), (3, vec![0..701, 701..1001, 1001..LEN])] {
            let adam = CpuAdam::new(threads, level)
                .expect("the detected level")
                .with_tasks_per_thread(64)
                .with_no_decay(no_decay.clone());
            let got = stepped(config, &adam, &ranges);
            for i in 0..LEN {
                let in_no_decay = no_decay.ranges().iter().any(|r| r.contains(&i));
                let want = if in_no_decay { &undecayed } else { &decayed };
                let got = (got.params[i], got.exp_avg[i], got.exp_avg_sq[i]);
                let want = (want.params[i], want.exp_avg[i], want.exp_avg_sq[i]);
                assert_eq!(got.0.to_bits(), want.0.to_bits(), "{mode:?} element {i}");
                assert_eq!((got.1, got.2), (want.1, want.2), "{mode:?} element {i}");
            }
        }
        let differing = (0..LEN).filter(|&i| decayed.params[i] != undecayed.params[i]).count();
        assert!(differing > LEN / 2, "{mode:?}: decay changed only {differing} weights");
    }
}
