//! The plan with flash attention (`AttentionKind::Flash`: the log-sum-exp kept, the weights
//! recomputed in backward) against the default plan (the weights kept), both run on the host in
//! f64: the same loss, logits and gradients up to rounding, the same `GradsReady` notices, and a
//! layout without the `[batch, n_head, seq, seq]` weights. The CUDA model runs the same plans.

use zeroflow_gpt::plan::AttentionActs;
use zeroflow_gpt::{AttentionKind, GptPlan, GradsReady, HostGpt};

use crate::support::{ODD, perturbed_params, random_batch, relative_error};

/// Loss, logits and every gradient tensor of the two plans on the same weights and batch, at two
/// sequence lengths (one token: each row's softmax is over one key) and a loss scale of 2.
#[test]
fn flash_and_gemm_plans_give_the_same_loss_and_gradients() {
    let (layout, params) = perturbed_params(&ODD, 11);
    for (batch, seq) in [(3, 9), (2, 1)] {
        let (inputs, targets) = random_batch(ODD.vocab_size, batch * seq, 12);
        let run = |attention| {
            let mut model =
                HostGpt::<f64>::with_attention(&ODD, &layout, batch, seq, attention).unwrap();
            let loss = model.forward(&params, &inputs, &targets).unwrap();
            let logits = model.activations()[model.acts().logits.clone()].to_vec();
            let mut grads = vec![0.0; layout.padded_len()];
            let mut groups: Vec<GradsReady> = Vec::new();
            model
                .backward(&params, &mut grads, 2.0, |ready, _| groups.push(ready.clone()))
                .unwrap();
            (loss, logits, grads, groups)
        };
        let gemm = run(AttentionKind::Gemm);
        let flash = run(AttentionKind::Flash);
        assert!((gemm.0 - flash.0).abs() <= 1e-12 * gemm.0.abs(), "loss {} vs {}", gemm.0, flash.0);
        assert!(relative_error(&gemm.1, &flash.1) <= 1e-12, "logits differ");
        for view in layout.params() {
            let error = relative_error(&gemm.2[view.flat_range()], &flash.2[view.flat_range()]);
            assert!(error <= 1e-10, "T {seq}: {} off by {error:e}", view.name);
        }
        assert_eq!(gemm.3, flash.3, "the GradsReady notices differ");
    }
}

/// The flash layout holds an lse of `[batch, n_head, seq]` where the default one holds the
/// weights, so it is shorter by exactly their difference per layer (both lengths here are
/// multiples of the layout's 16-element alignment).
#[test]
fn the_flash_layout_keeps_the_log_sum_exp_instead_of_the_weights() {
    let (layout, _) = perturbed_params(&ODD, 1);
    let (batch, seq) = (4, 8);
    let plan = |attention| {
        let model = HostGpt::<f64>::with_attention(&ODD, &layout, batch, seq, attention).unwrap();
        GptPlan { acts: model.acts().clone(), plan: model.plan().clone() }
    };
    let (gemm, flash) = (plan(AttentionKind::Gemm), plan(AttentionKind::Flash));
    let rows = batch * ODD.n_head * seq;
    for block in &flash.acts.blocks {
        let AttentionActs::LogSumExp(lse) = &block.attention else { panic!("{block:?}") };
        assert_eq!(lse.len(), rows);
    }
    for block in &gemm.acts.blocks {
        let AttentionActs::Weights(att) = &block.attention else { panic!("{block:?}") };
        assert_eq!(att.len(), rows * seq);
    }
    assert_eq!(gemm.acts.len - flash.acts.len, ODD.n_layer * (rows * seq - rows));
    let names = |plan: &GptPlan| -> Vec<&str> {
        plan.plan.forward.iter().map(|launch| launch.kernel.name()).collect()
    };
    assert!(names(&flash).contains(&"flash_attention_forward"));
    assert!(!names(&flash).contains(&"attention_forward"));
}
