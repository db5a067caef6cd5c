//! The whole model's backward against central finite differences, in f64, for every parameter
//! tensor of every tiny model (GQA 3:1 untied, llama3 rope scaling with biases and tied
//! embeddings, Qwen2's q/k/v biases, Qwen3's q/k norm with head_dim ≠ hidden / heads, Mistral
//! tied, multi-query), and the flash form of attention against the kept-weights form.

use zeroflow_llama::{AttentionKind, HostLlama};

use crate::support::{models, perturbed_params, random_batch, relative_error};

/// Every element of every parameter tensor matches (L(θ + h) − L(θ − h)) / 2h with h = 1e-5:
/// relative error per tensor at most 1e-6, and every tensor has a gradient.
#[test]
fn backward_matches_central_finite_differences_for_every_parameter_of_every_model() {
    let (batch, seq) = (2, 5);
    for (seed, (what, config)) in models().into_iter().enumerate() {
        let (layout, mut params) = perturbed_params(&config, 10 + seed as u64);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 20 + seed as u64);
        let mut model =
            HostLlama::<f64>::new(&config, &layout, batch, seq, AttentionKind::Gemm).unwrap();
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
            assert!(error <= 1e-6, "{what}: {}: relative error {error:e}", view.name);
            assert!(analytic.iter().any(|&g| g != 0.0), "{what}: {} has no gradient", view.name);
            if error > worst.1 {
                worst = (view.name.clone(), error);
            }
        }
        println!("{what}: worst finite-difference relative error {:e} ({})", worst.1, worst.0);
    }
}

/// Flash attention (only the log-sum-exp kept) gives the loss, logits and gradients of the
/// kept-weights attention, to 1e-12, for every model.
#[test]
fn flash_attention_gives_the_loss_and_gradients_of_gemm_attention() {
    let (batch, seq) = (3, 6);
    for (seed, (what, config)) in models().into_iter().enumerate() {
        let (layout, params) = perturbed_params(&config, 30 + seed as u64);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 40 + seed as u64);
        let run = |attention| {
            let mut model = HostLlama::<f64>::new(&config, &layout, batch, seq, attention).unwrap();
            let loss = model.forward(&params, &inputs, &targets).unwrap();
            let mut grads = vec![0.0; layout.padded_len()];
            model.backward(&params, &mut grads, 1.0, |_, _| {}).unwrap();
            (loss, model.logits().to_vec(), grads)
        };
        let (gemm, flash) = (run(AttentionKind::Gemm), run(AttentionKind::Flash));
        assert!((gemm.0 - flash.0).abs() < 1e-12, "{what}: loss {} vs {}", gemm.0, flash.0);
        assert!(relative_error(&gemm.1, &flash.1) < 1e-12, "{what}: logits");
        assert!(relative_error(&gemm.2, &flash.2) < 1e-12, "{what}: gradients");
    }
}
