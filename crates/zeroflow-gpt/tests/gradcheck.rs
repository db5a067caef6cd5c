//! Backward against central finite differences for every parameter tensor: in f64 (the oracle) and
//! in f32 (what the device's precision allows).

use zeroflow_gpt::HostGpt;

use crate::support::{ODD, perturbed_params, random_batch, relative_error};

/// Every element of every parameter tensor (the padded embedding rows included, whose gradient
/// must be exactly zero) matches (L(θ + h) − L(θ − h)) / 2h with h = 1e-5: relative error per
/// tensor at most 1e-4 (measured: worst 7.3e-9, `transformer.h.1.ln_1.weight`).
#[test]
fn backward_matches_central_finite_differences_for_every_parameter_tensor() {
    let (batch, seq) = (2, 7);
    let (layout, mut params) = perturbed_params(&ODD, 7);
    let (inputs, targets) = random_batch(ODD.vocab_size, batch * seq, 8);
    let mut model = HostGpt::<f64>::new(&ODD, &layout, batch, seq).unwrap();
    model.forward(&params, &inputs, &targets).unwrap();
    let mut grads = vec![0.0; layout.padded_len()];
    model.backward(&params, &mut grads, 1.0, |_, _| {}).unwrap();

    let h = 1e-5;
    let mut worst = (String::new(), 0.0f64);
    for view in layout.params() {
        let mut numeric = Vec::with_capacity(view.numel());
        for i in view.flat_range() {
            let original = params[i];
            params[i] = original + h;
            let plus = model.forward(&params, &inputs, &targets).unwrap();
            params[i] = original - h;
            let minus = model.forward(&params, &inputs, &targets).unwrap();
            params[i] = original;
            numeric.push((plus - minus) / (2.0 * h));
        }
        let analytic = &grads[view.flat_range()];
        let error = relative_error(analytic, &numeric);
        assert!(error <= 1e-4, "{}: relative error {error:e}", view.name);
        assert!(analytic.iter().any(|&g| g != 0.0) || view.name == "transformer.wte.weight");
        if error > worst.1 {
            worst = (view.name.clone(), error);
        }
        if view.name == "transformer.wte.weight" {
            let padded_rows = &analytic[ODD.vocab_size * ODD.d_model..];
            assert!(padded_rows.iter().all(|&g| g == 0.0), "padded rows get no gradient");
        }
    }
    println!("worst finite-difference relative error: {:e} ({})", worst.1, worst.0);
}

/// The same check in f32 (h = 1e-2, the best trade-off between truncation and the rounding of the
/// loss): what finite differences can confirm at the device's precision. Measured: worst tensor
/// 1.7e-3 relative error (h = 3e-3 gives 8.6e-3, h = 3e-2 gives 7.3e-3); the bound is 1e-2.
#[test]
fn f32_backward_matches_central_finite_differences_to_f32_precision() {
    let (batch, seq) = (2, 7);
    let (layout, params64) = perturbed_params(&ODD, 7);
    let mut params: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let (inputs, targets) = random_batch(ODD.vocab_size, batch * seq, 8);
    let mut model = HostGpt::<f32>::new(&ODD, &layout, batch, seq).unwrap();
    model.forward(&params, &inputs, &targets).unwrap();
    let mut grads = vec![0.0f32; layout.padded_len()];
    model.backward(&params, &mut grads, 1.0, |_, _| {}).unwrap();

    let h = 1e-2f32;
    let mut worst = (String::new(), 0.0f64);
    for view in layout.params() {
        let mut numeric = Vec::with_capacity(view.numel());
        for i in view.flat_range() {
            let original = params[i];
            params[i] = original + h;
            let plus = model.forward(&params, &inputs, &targets).unwrap();
            params[i] = original - h;
            let minus = model.forward(&params, &inputs, &targets).unwrap();
            params[i] = original;
            numeric.push(f64::from(plus - minus) / (2.0 * f64::from(h)));
        }
        let analytic: Vec<f64> = grads[view.flat_range()].iter().map(|&g| f64::from(g)).collect();
        let error = relative_error(&analytic, &numeric);
        assert!(error <= 1e-2, "{}: relative error {error:e}", view.name);
        if error > worst.1 {
            worst = (view.name.clone(), error);
        }
    }
    println!("f32 worst finite-difference relative error: {:e} ({})", worst.1, worst.0);
}

/// Loss-masked targets ([`IGNORE`]) through the whole model: the forward's loss is the mean over
/// the counted positions, and backward with `loss_scale = positions / counted` (what the trainer
/// gives a micro-batch that is a whole step) is its gradient, against central finite differences
/// of that loss in every parameter tensor.
#[test]
fn with_ignored_targets_backward_is_the_gradient_of_the_mean_over_the_counted_positions() {
    use zeroflow_nn::kernels::loss::IGNORE;
    let (batch, seq) = (2, 7);
    let (layout, mut params) = perturbed_params(&ODD, 7);
    let (inputs, mut targets) = random_batch(ODD.vocab_size, batch * seq, 8);
    for (i, target) in targets.iter_mut().enumerate() {
        if i % 3 == 0 || i >= seq + 4 {
            *target = IGNORE;
        }
    }
    let counted = targets.iter().filter(|&&t| t != IGNORE).count();
    assert_eq!(counted, 7);
    let mut model = HostGpt::<f64>::new(&ODD, &layout, batch, seq).unwrap();
    model.forward(&params, &inputs, &targets).unwrap();
    let mut grads = vec![0.0; layout.padded_len()];
    let scale = (batch * seq) as f64 / counted as f64;
    model.backward(&params, &mut grads, scale, |_, _| {}).unwrap();
    let h = 1e-5;
    for view in layout.params() {
        let mut numeric = Vec::with_capacity(view.numel());
        for i in view.flat_range() {
            let original = params[i];
            params[i] = original + h;
            let plus = model.forward(&params, &inputs, &targets).unwrap();
            params[i] = original - h;
            let minus = model.forward(&params, &inputs, &targets).unwrap();
            params[i] = original;
            numeric.push((plus - minus) / (2.0 * h));
        }
        let error = relative_error(&grads[view.flat_range()], &numeric);
        assert!(error <= 1e-4, "{}: relative error {error:e}", view.name);
    }
}
