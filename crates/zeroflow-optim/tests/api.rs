//! The API's contracts: validation, errors, the step counter, SIMD level selection.

use zeroflow_optim::{
    AdamState, AdamW, AdamWConfig, AdamWStep, CpuAdam, Grads, OptimError, Output, SimdLevel,
    WeightDecayMode, bf16,
};

fn step1() -> AdamWStep {
    AdamWStep::new(&AdamWConfig::default(), 1, 1.0).unwrap()
}

/// A level can be forced exactly when the CPU supports it; `detect` is the widest supported
/// level and prints as the name the command line accepts.
#[test]
fn forcing_a_level_succeeds_exactly_when_the_cpu_supports_it() {
    for level in SimdLevel::ALL {
        let result = CpuAdam::new(2, level);
        assert_eq!(result.is_ok(), level.is_available(), "{level}");
        if let Err(err) = result {
            assert!(matches!(err, OptimError::SimdUnavailable { .. }), "{err}");
        }
        assert_eq!(level.to_string().parse::<SimdLevel>(), Ok(level));
    }
    let detected = SimdLevel::detect();
    assert!(detected.is_available());
    assert!(SimdLevel::available().all(|level| level <= detected));
    assert!("sse9".parse::<SimdLevel>().is_err());
}

/// Slices of the wrong length and ranges outside the partition are errors naming the problem,
/// and leave the state untouched.
#[test]
fn mismatched_lengths_and_bad_ranges_are_errors_that_change_nothing() {
    let adam = CpuAdam::new(1, SimdLevel::Scalar).unwrap();
    let (mut p, mut m, mut v) = (vec![1.0f32; 10], vec![0.5f32; 10], vec![0.25f32; 10]);
    let mut short = vec![0.5f32; 9];
    let grads = vec![0.1f32; 10];
    let mut out = [bf16::ZERO; 10];

    let err = adam
        .step(
            &step1(),
            AdamState { params: &mut p, exp_avg: &mut short, exp_avg_sq: &mut v },
            Grads::F32(&grads),
            Output::MasterOnly,
        )
        .unwrap_err();
    assert!(matches!(err, OptimError::LengthMismatch { what: "exp_avg", actual: 9, expected: 10 }));

    let err = adam
        .step(
            &step1(),
            AdamState { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v },
            Grads::F32(&grads[..9]),
            Output::MasterOnly,
        )
        .unwrap_err();
    assert!(matches!(err, OptimError::LengthMismatch { what: "grads", .. }), "{err}");

    let err = adam
        .step(
            &step1(),
            AdamState { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v },
            Grads::F32(&grads),
            Output::AlsoBf16(&mut out[..3]),
        )
        .unwrap_err();
    assert!(matches!(err, OptimError::LengthMismatch { what: "bf16 output", .. }), "{err}");

    #[allow(clippy::reversed_empty_ranges)]
    for range in [4..11, 7..5] {
        let err = adam
            .step_range(
                &step1(),
                AdamState { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v },
                range.clone(),
                Grads::F32(&grads[..range.len().min(10)]),
                Output::MasterOnly,
            )
            .unwrap_err();
        assert!(matches!(err, OptimError::RangeOutOfBounds { .. }), "{range:?}: {err}");
    }
    assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&x| x == 0.5));
    assert!(v.iter().all(|&x| x == 0.25));
}

/// Hyper-parameters outside torch's ranges, step 0 and zero threads are rejected.
#[test]
fn invalid_hyper_parameters_step_zero_and_zero_threads_are_rejected() {
    let bad = [
        AdamWConfig { lr: -1e-3, ..AdamWConfig::default() },
        AdamWConfig { lr: f64::NAN, ..AdamWConfig::default() },
        AdamWConfig { betas: (1.0, 0.999), ..AdamWConfig::default() },
        AdamWConfig { betas: (0.9, -0.1), ..AdamWConfig::default() },
        AdamWConfig { eps: -1.0, ..AdamWConfig::default() },
        AdamWConfig { weight_decay: f64::INFINITY, ..AdamWConfig::default() },
    ];
    for config in bad {
        assert!(
            matches!(config.validate(), Err(OptimError::InvalidHyperParameter { .. })),
            "{config:?}"
        );
        assert!(AdamW::new(config).is_err());
        assert!(AdamWStep::new(&config, 1, 1.0).is_err());
    }
    assert!(matches!(AdamWStep::new(&AdamWConfig::default(), 0, 1.0), Err(OptimError::StepZero)));
    assert!(matches!(CpuAdam::new(0, SimdLevel::Scalar), Err(OptimError::ZeroThreads)));
    let mut optimizer = AdamW::new(AdamWConfig::default()).unwrap();
    assert!(optimizer.set_lr(-1.0).is_err());
    assert_eq!(optimizer.config().lr, 1e-3, "a rejected lr leaves the old one");
}

/// The counter numbers steps from 1, resumes where a checkpoint left it, and applies a new
/// learning rate from the next step on: its steps equal `AdamWStep::new` at the same t and lr.
#[test]
fn the_step_counter_counts_from_one_resumes_and_follows_the_schedule() {
    let config = AdamWConfig { mode: WeightDecayMode::L2, ..AdamWConfig::default() };
    let mut optimizer = AdamW::new(config).unwrap();
    assert_eq!(optimizer.steps_taken(), 0);
    assert_eq!(optimizer.next_step(0.5), AdamWStep::new(&config, 1, 0.5).unwrap());
    assert_eq!(optimizer.next_step(0.5).step(), 2);
    optimizer.resume_at(41);
    optimizer.set_lr(3e-4).unwrap();
    let step = optimizer.next_step(0.25);
    let expected = AdamWStep::new(&AdamWConfig { lr: 3e-4, ..config }, 42, 0.25).unwrap();
    assert_eq!(step, expected);
    assert_eq!(step.grad_scale(), 0.25);
    assert_eq!(optimizer.steps_taken(), 42);
}

/// The gradient scale multiplies the gradients: scaling the gradients by 4 and the scale by 1/4
/// gives the same bits (powers of two are exact).
#[test]
fn the_gradient_scale_multiplies_the_gradients() {
    let adam = CpuAdam::new(1, SimdLevel::detect()).unwrap();
    let grads: Vec<f32> = (0..100).map(|i| (i as f32 - 49.5) * 0.013).collect();
    let scaled: Vec<f32> = grads.iter().map(|g| g * 4.0).collect();
    let mut results = Vec::new();
    for (grads, scale) in [(&grads, 1.0), (&scaled, 0.25)] {
        let (mut p, mut m, mut v) = (vec![1.0f32; 100], vec![0.01f32; 100], vec![0.001f32; 100]);
        let step = AdamWStep::new(&AdamWConfig::default(), 5, scale).unwrap();
        let state = AdamState { params: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v };
        adam.step(&step, state, Grads::F32(grads), Output::MasterOnly).unwrap();
        results.push((p, m, v));
    }
    assert_eq!(results[0], results[1]);
    assert_ne!(results[0].0, vec![1.0f32; 100], "the step moved the weights");
}
