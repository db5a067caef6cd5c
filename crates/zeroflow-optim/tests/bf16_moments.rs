//! bf16 Adam moments: the kernels compute in f32 and store the moments rounded stochastically,
//! bit for bit as a scalar reference does, whatever the threads and ranges; the rounding keeps
//! `exp_avg_sq` moving where round-to-nearest would stall it.

use zeroflow_optim::roofline::{self, RooflineVariant, bytes_per_param};
use zeroflow_optim::rounding::{MomentSeeds, random_bits, stochastic_bf16};
use zeroflow_optim::{
    AdamState, AdamW, AdamWConfig, AdamWStep, CpuAdam, Grads, Output, SimdLevel, StepScalars,
    WeightDecayMode, bf16,
};

use crate::support::{
    GradType, State, StepGrads, normwise_relative_error, reference_step, rng, test_config,
};

/// Weights as f32 and moments as bf16, owned by a test.
#[derive(Clone, Debug, PartialEq)]
struct Bf16State {
    params: Vec<f32>,
    exp_avg: Vec<bf16>,
    exp_avg_sq: Vec<bf16>,
}

impl Bf16State {
    fn from_f32(state: &State) -> Self {
        let round = |x: &[f32]| x.iter().map(|&x| bf16::from_f32(x)).collect();
        Bf16State {
            params: state.params.clone(),
            exp_avg: round(&state.exp_avg),
            exp_avg_sq: round(&state.exp_avg_sq),
        }
    }

    fn view(&mut self) -> AdamState<'_, bf16> {
        AdamState {
            params: &mut self.params,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
        }
    }

    fn bits(&self) -> Vec<(u32, u16, u16)> {
        (0..self.params.len())
            .map(|i| {
                let (m, v) = (self.exp_avg[i].to_bits(), self.exp_avg_sq[i].to_bits());
                (self.params[i].to_bits(), m, v)
            })
            .collect()
    }
}

/// One step of elements `range` of `state` written element by element from the kernels' formulas
/// (module `kernels`): with fused multiply-adds for the AVX levels, separate products and sums
/// for the portable one, then the moments rounded with `rounding::stochastic_bf16` and the bits
/// of (step, element index).
fn reference(level: SimdLevel, step: &AdamWStep, state: &mut Bf16State, start: usize, g: &[f32]) {
    let s: StepScalars = step.scalars();
    let seeds = MomentSeeds::of_step(step.step());
    let fma = level != SimdLevel::Scalar;
    let mul_add = |a: f32, b: f32, c: f32| if fma { a.mul_add(b, c) } else { a * b + c };
    for (k, &grad) in g.iter().enumerate() {
        let i = start + k;
        let (p, m0, v0) =
            (state.params[i], state.exp_avg[i].to_f32(), state.exp_avg_sq[i].to_f32());
        let grad = mul_add(p, s.l2, grad * s.grad_scale);
        let m1 = mul_add(s.one_minus_beta1, grad - m0, m0);
        let square_minus_v = if fma { grad.mul_add(grad, -v0) } else { grad * grad - v0 };
        let v1 = mul_add(s.one_minus_beta2, square_minus_v, v0);
        let denom = mul_add(v1.sqrt(), s.inv_sqrt_bias_correction2, s.eps);
        let decayed = mul_add(p, s.neg_lr_weight_decay, p);
        state.params[i] = mul_add(m1 / denom, s.neg_step_size, decayed);
        state.exp_avg[i] = stochastic_bf16(m1, random_bits(seeds.exp_avg, i));
        state.exp_avg_sq[i] = stochastic_bf16(v1, random_bits(seeds.exp_avg_sq, i));
    }
}

/// At every SIMD level, three steps of the kernel over ranges that start off the SIMD widths
/// (f32 and bf16 gradients, L2 and decoupled decay) give exactly the reference's bits: weights,
/// and moments rounded with the draws of their own element index.
#[test]
fn bf16_moments_match_the_scalar_reference_bit_for_bit_at_every_level() {
    let len = 1000;
    let ranges = [0..1, 1..18, 18..19, 19..500, 500..1000];
    for level in SimdLevel::available() {
        let adam = CpuAdam::new(2, level).unwrap();
        for (kind, mode) in
            [(GradType::F32, WeightDecayMode::Decoupled), (GradType::Bf16, WeightDecayMode::L2)]
        {
            let mut rng = rng(11);
            let mut kernel = Bf16State::from_f32(&State::random(&mut rng, len));
            let mut expected = kernel.clone();
            let config = test_config(mode, true);
            for t in 1..=3 {
                let grads = StepGrads::random(&mut rng, len, kind);
                let step = AdamWStep::new(&config, t, 0.25).unwrap();
                for range in ranges.clone() {
                    let g = match kind {
                        GradType::F32 => Grads::F32(&grads.f32[range.clone()]),
                        GradType::Bf16 => Grads::Bf16(&grads.bf16[range.clone()]),
                    };
                    let out = Output::MasterOnly;
                    adam.step_range(&step, kernel.view(), range.clone(), g, out).unwrap();
                    reference(level, &step, &mut expected, range.start, &grads.f32[range]);
                }
                let mismatches = (0..len).filter(|&i| kernel.bits()[i] != expected.bits()[i]);
                let first: Vec<usize> = mismatches.take(5).collect();
                assert!(first.is_empty(), "{level} {kind:?} step {t}: elements {first:?} differ");
            }
        }
    }
}

/// bf16 moments give the same bits with 1 thread over the whole partition as with 3 threads
/// stepping it in uneven ranges: the draws depend on the element, not on who steps it.
#[test]
fn bf16_moment_results_do_not_depend_on_threads_or_ranges() {
    let len = 3 * 65536 + 77;
    for level in SimdLevel::available() {
        let (one, three) = (CpuAdam::new(1, level).unwrap(), CpuAdam::new(3, level).unwrap());
        let mut rng = rng(5);
        let mut whole = Bf16State::from_f32(&State::random(&mut rng, len));
        let mut ranged = whole.clone();
        let config = test_config(WeightDecayMode::Decoupled, true);
        for t in 1..=2 {
            let grads = StepGrads::random(&mut rng, len, GradType::Bf16);
            let step = AdamWStep::new(&config, t, 1.0).unwrap();
            one.step(&step, whole.view(), grads.as_grads(), Output::MasterOnly).unwrap();
            let cuts = [0, 3, 70_001, 70_002, len];
            for range in cuts.windows(2).map(|w| w[0]..w[1]) {
                let g = Grads::Bf16(&grads.bf16[range.clone()]);
                three.step_range(&step, ranged.view(), range, g, Output::MasterOnly).unwrap();
            }
        }
        assert!(whole == ranged, "{level}: ranges on 3 threads differ from one whole step");
    }
}

/// With no gradient, fp32 `exp_avg_sq` decays as 0.999^t. In bf16 with round-to-nearest it
/// would never move (each decrement is below half an ulp); with the kernels' stochastic rounding
/// its mean over 2¹⁶ elements follows 0.999^t within 1% after 300 steps.
#[test]
fn exp_avg_sq_decays_in_bf16_where_round_to_nearest_would_stall() {
    let len = 1 << 16;
    let config = AdamWConfig { weight_decay: 0.0, ..AdamWConfig::default() };
    let nearest_after_one = bf16::from_f32(1.0 + 0.001 * (0.0 - 1.0));
    assert_eq!(nearest_after_one, bf16::ONE, "round-to-nearest stalls at 1");
    for level in SimdLevel::available() {
        let adam = CpuAdam::new(2, level).unwrap();
        let mut optimizer = AdamW::new(config).unwrap();
        let mut state = Bf16State {
            params: vec![1.0; len],
            exp_avg: vec![bf16::ZERO; len],
            exp_avg_sq: vec![bf16::ONE; len],
        };
        let grads = vec![0.0f32; len];
        let steps = 300;
        for _ in 0..steps {
            let step = optimizer.next_step(1.0);
            adam.step(&step, state.view(), Grads::F32(&grads), Output::MasterOnly).unwrap();
        }
        let mean = state.exp_avg_sq.iter().map(|v| f64::from(v.to_f32())).sum::<f64>() / len as f64;
        let expected = 0.999f64.powi(steps);
        assert!((mean / expected - 1.0).abs() < 0.01, "{level}: mean {mean}, fp32 {expected}");
    }
}

/// A hundred steps with bf16 moments keep the weights within 1e-4 (normwise) of the f64
/// reference with exact moments: the rounding noise averages out rather than accumulating.
#[test]
fn a_hundred_steps_with_bf16_moments_stay_near_the_f64_reference() {
    let len = 4096;
    let adam = CpuAdam::new(2, SimdLevel::detect()).unwrap();
    let mut rng = rng(3);
    let start = State::random(&mut rng, len);
    let mut kernel = Bf16State::from_f32(&start);
    let mut exact = start.to_f64();
    // The reference starts from the same (bf16-rounded) moments.
    exact.exp_avg = kernel.exp_avg.iter().map(|m| f64::from(m.to_f32())).collect();
    exact.exp_avg_sq = kernel.exp_avg_sq.iter().map(|v| f64::from(v.to_f32())).collect();
    let config = test_config(WeightDecayMode::Decoupled, true);
    for t in 1..=100 {
        let grads = StepGrads::random(&mut rng, len, GradType::F32);
        let step = AdamWStep::new(&config, t, 0.5).unwrap();
        adam.step(&step, kernel.view(), grads.as_grads(), Output::MasterOnly).unwrap();
        reference_step(&config, t, 0.5, &grads.f32, &mut exact);
    }
    let error = normwise_relative_error(&kernel.params, &exact.params);
    assert!(error < 1e-4, "weights' normwise error {error:e}");
    let moved = normwise_relative_error(&start.params, &exact.params);
    assert!(moved > 1e-2, "the test moves the weights ({moved:e}) far more than its tolerance");
}

/// The roofline pass over bf16 moments adds `c g` to each, truncated, with every kind of store
/// and misaligned starts; its byte count is that of a bf16-moment step.
#[test]
fn a_roofline_pass_over_bf16_moments_updates_every_element() {
    let adam = CpuAdam::new(3, SimdLevel::detect()).unwrap();
    let len = 150_001;
    for stores in RooflineVariant::candidates(false) {
        for (offset_p, offset_m) in [(0, 0), (3, 5), (16, 16)] {
            let mut p = vec![1.0f32; len + 16];
            let mut m = vec![bf16::from_f32(2.0); len + 16];
            let mut v = vec![bf16::from_f32(3.0); len + 16];
            let grads: Vec<f32> = (0..len).map(|i| (i % 5) as f32).collect();
            let state = AdamState {
                params: &mut p[offset_p..offset_p + len],
                exp_avg: &mut m[offset_m..offset_m + len],
                exp_avg_sq: &mut v[offset_m..offset_m + len],
            };
            roofline::pass(&adam, state, Grads::F32(&grads), Output::MasterOnly, 0.5, stores)
                .unwrap();
            for i in 0..len {
                let t = 0.5 * (i % 5) as f32;
                assert_eq!(p[offset_p + i], 1.0 + t, "{stores:?} weight {i}");
                assert_eq!(m[offset_m + i].to_f32(), 2.0 + t, "{stores:?} exp_avg {i}");
                assert_eq!(v[offset_m + i].to_f32(), 3.0 + t, "{stores:?} exp_avg_sq {i}");
            }
        }
    }
    assert_eq!(bytes_per_param(2, 2, false), 18);
    assert_eq!(bytes_per_param(4, 2, true), 22);
}

/// Two executors keyed by their partition's start (`with_rounding_offset`) stepping the two
/// halves of a model give the bits of one executor stepping it whole: bf16 moments round the
/// same at any world size.
#[test]
fn rounding_keyed_by_the_partition_start_is_independent_of_the_partitioning() {
    let (len, cut) = (10_007, 4_099);
    let mut rng = rng(9);
    let mut whole = Bf16State::from_f32(&State::random(&mut rng, len));
    let mut halves = whole.clone();
    let grads = StepGrads::random(&mut rng, len, GradType::F32);
    let step = AdamWStep::new(&test_config(WeightDecayMode::Decoupled, true), 4, 1.0).unwrap();
    let one = CpuAdam::new(1, SimdLevel::detect()).unwrap();
    one.step(&step, whole.view(), Grads::F32(&grads.f32), Output::MasterOnly).unwrap();
    let Bf16State { params, exp_avg, exp_avg_sq } = &mut halves;
    let (p0, p1) = params.split_at_mut(cut);
    let (m0, m1) = exp_avg.split_at_mut(cut);
    let (v0, v1) = exp_avg_sq.split_at_mut(cut);
    for (start, state) in [
        (0, AdamState { params: p0, exp_avg: m0, exp_avg_sq: v0 }),
        (cut, AdamState { params: p1, exp_avg: m1, exp_avg_sq: v1 }),
    ] {
        let rank = CpuAdam::new(2, SimdLevel::detect()).unwrap().with_rounding_offset(start);
        let g = Grads::F32(&grads.f32[start..start + state.params.len()]);
        rank.step(&step, state, g, Output::MasterOnly).unwrap();
    }
    assert!(whole == halves, "two partitions keyed by their start differ from the whole");
    let unkeyed = CpuAdam::new(1, SimdLevel::detect()).unwrap();
    let mut second = Bf16State::from_f32(&State::random(&mut rng, len - cut));
    let mut keyed = second.clone();
    let g = Grads::F32(&grads.f32[cut..]);
    unkeyed.step(&step, second.view(), g, Output::MasterOnly).unwrap();
    one.with_rounding_offset(cut).step(&step, keyed.view(), g, Output::MasterOnly).unwrap();
    assert_ne!(second, keyed, "the offset changes the draws");
}
