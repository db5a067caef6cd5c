//! The model on the CpuDevice (f32 kernels on the compute stream) against the f64 host path, its
//! grads-ready notices, and its initialisation.

use zeroflow_device::{CpuDevice, Device, StreamKind};
use zeroflow_llama::{AttentionKind, CpuLlama, HostLlama, flat_layout, init_params};
use zeroflow_llama::{ParamRanges, init_params_on_device};
use zeroflow_nn::GradGroup;

use crate::support::{models, perturbed_params, random_batch, relative_error};

/// For every tiny model and both attention forms, the device's f32 loss equals the f64 loss to
/// 1e-6 relative and every gradient tensor matches to 1e-5 relative (norm-wise).
#[test]
fn device_f32_loss_and_gradients_match_the_f64_path() {
    let (batch, seq) = (3, 7);
    let device = CpuDevice::new().unwrap();
    for (seed, (what, config)) in models().into_iter().enumerate() {
        for attention in [AttentionKind::Gemm, AttentionKind::Flash] {
            let (layout, params64) = perturbed_params(&config, 50 + seed as u64);
            let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 60 + seed as u64);
            let mut host = HostLlama::<f64>::new(&config, &layout, batch, seq, attention).unwrap();
            let loss64 = host.forward(&params64, &inputs, &targets).unwrap();
            let mut grads64 = vec![0.0; layout.padded_len()];
            host.backward(&params64, &mut grads64, 1.0, |_, _| {}).unwrap();

            let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
            let params = device.upload(&params32).unwrap();
            let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
            let mut model =
                CpuLlama::new(&device, &config, &layout, batch, seq, attention).unwrap();
            model.set_batch(&inputs, &targets).unwrap();
            model.forward(&params).unwrap();
            let loss32 = model.loss().unwrap();
            model.backward(&params, &grads, 1.0, |_| {}).unwrap();
            let grads32: Vec<f64> =
                device.download(&grads).unwrap().iter().map(|&g| f64::from(g)).collect();

            let loss_error = (f64::from(loss32) - loss64).abs() / loss64;
            assert!(loss_error <= 1e-6, "{what} {attention:?}: loss {loss32} vs {loss64}");
            for view in layout.params() {
                let error =
                    relative_error(&grads32[view.flat_range()], &grads64[view.flat_range()]);
                assert!(error <= 1e-5, "{what} {attention:?}: {}: {error:e}", view.name);
            }
        }
    }
}

/// Backward on the device tells of each group once, in backward order (final norm with an
/// untied head, layers last to first, the embedding), and a copy of the group's range queued at
/// that moment already equals the final gradient; the groups hold every parameter once.
#[test]
fn grads_ready_fires_once_per_group_in_backward_order_with_complete_ranges() {
    let (batch, seq) = (2, 5);
    let device = CpuDevice::new().unwrap();
    for (seed, (what, config)) in models().into_iter().enumerate() {
        let (layout, params64) = perturbed_params(&config, 70 + seed as u64);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 80 + seed as u64);
        let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
        let params = device.upload(&params32).unwrap();
        let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
        let snapshot = device.alloc::<f32>(layout.padded_len()).unwrap();
        let mut model =
            CpuLlama::new(&device, &config, &layout, batch, seq, AttentionKind::Gemm).unwrap();
        model.set_batch(&inputs, &targets).unwrap();
        model.forward(&params).unwrap();
        let mut seen = Vec::new();
        let compute = device.stream(StreamKind::Compute);
        model
            .backward(&params, &grads, 1.0, |ready| {
                let range = ready.flat_range.clone();
                device.copy_d2d(compute, &grads, range.clone(), &snapshot, range.start).unwrap();
                seen.push(ready.clone());
            })
            .unwrap();
        let groups: Vec<GradGroup> = seen.iter().map(|r| r.group).collect();
        let expected =
            [GradGroup::FinalNorm, GradGroup::Block(1), GradGroup::Block(0), GradGroup::Embeddings];
        assert_eq!(groups, expected, "{what}");
        let (grads, snapshot) =
            (device.download(&grads).unwrap(), device.download(&snapshot).unwrap());
        for ready in &seen {
            let range = ready.flat_range.clone();
            assert_eq!(snapshot[range.clone()], grads[range], "{what}: {:?} complete", ready.group);
        }
        for view in layout.params() {
            let inside = seen.iter().filter(|r| r.flat_range.contains(&view.offset)).count();
            assert_eq!(inside, 1, "{what}: {} is in exactly one group", view.name);
        }
    }
}

/// Initialisation as `transformers`' `_init_weights`: linear weights and the embedding with
/// standard deviation `initializer_range` (0.2 in the tiny configs) and mean 0, biases 0, norm
/// weights 1; the same values on the device as on the host, and none depend on the alignment.
#[test]
fn init_draws_weights_with_initializer_range_biases_zero_and_norms_one() {
    let config = &models()[1].1; // biases, tied
    let layout = flat_layout(config, 1).unwrap();
    let mut params = vec![f32::NAN; layout.padded_len()];
    init_params(config, &layout, 5, &mut params).unwrap();
    let mut weights = Vec::new();
    for view in layout.params() {
        let values = &params[view.flat_range()];
        if view.name.ends_with(".bias") {
            assert!(values.iter().all(|&x| x == 0.0), "{}", view.name);
        } else if view.name.ends_with("norm.weight") {
            assert!(values.iter().all(|&x| x == 1.0), "{}", view.name);
        } else {
            weights.extend(values.iter().map(|&x| f64::from(x)));
        }
    }
    let mean = weights.iter().sum::<f64>() / weights.len() as f64;
    let std =
        (weights.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / weights.len() as f64).sqrt();
    assert!(
        mean.abs() < 0.02 && (std - 0.2).abs() < 0.02,
        "mean {mean} std {std} of {}",
        weights.len()
    );

    let device = CpuDevice::new().unwrap();
    let on_device = device.alloc::<f32>(layout.padded_len()).unwrap();
    init_params_on_device(&device, &on_device, config, &layout, 5).unwrap();
    let on_device = device.download(&on_device).unwrap();
    for view in layout.params() {
        assert_eq!(on_device[view.flat_range()], params[view.flat_range()], "{}", view.name);
    }
    let two_ranks = flat_layout(config, 2).unwrap();
    let mut other = vec![0.0f32; two_ranks.padded_len()];
    init_params(config, &two_ranks, 5, &mut other).unwrap();
    let p = ParamRanges::new(config, &two_ranks).unwrap();
    assert_eq!(other[p.embed.clone()], params[ParamRanges::new(config, &layout).unwrap().embed]);
}

/// A token id outside the vocabulary is a kernel error reported by the device, naming the kernel.
#[test]
fn a_token_outside_the_vocabulary_is_a_kernel_error() {
    let config = &models()[0].1;
    let (layout, params64) = perturbed_params(config, 1);
    let device = CpuDevice::new().unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let mut model = CpuLlama::new(&device, config, &layout, 1, 3, AttentionKind::Gemm).unwrap();
    model.set_batch(&[1, 2, 11], &[1, 2, 3]).unwrap();
    model.forward(&params).unwrap();
    let error = device.synchronize().unwrap_err().to_string();
    assert!(error.contains("embedding_forward") && error.contains("token id 11"), "{error}");
}

/// Shapes the model cannot run are errors naming what is wrong: an odd `head_dim` (rotary
/// embeddings rotate pairs), a sequence longer than a sliding window, an empty batch.
#[test]
fn shapes_the_model_cannot_run_are_errors_naming_the_field() {
    use serde_json::json;
    use zeroflow_llama::{LlamaConfig, LlamaPlan};
    let odd = crate::support::tiny("LlamaForCausalLM", json!({"head_dim": 3}));
    let params = ParamRanges::new(&odd, &flat_layout(&odd, 1).unwrap()).unwrap();
    let error = LlamaPlan::new(&odd, &params, 1, 4, AttentionKind::Gemm).unwrap_err();
    assert!(error.to_string().contains("head_dim: 3 is odd"), "{error}");
    let windowed: LlamaConfig =
        crate::support::tiny("MistralForCausalLM", json!({"sliding_window": 4}));
    let params = ParamRanges::new(&windowed, &flat_layout(&windowed, 1).unwrap()).unwrap();
    assert!(LlamaPlan::new(&windowed, &params, 1, 4, AttentionKind::Gemm).is_ok());
    let error = LlamaPlan::new(&windowed, &params, 1, 5, AttentionKind::Gemm).unwrap_err();
    assert!(error.to_string().contains("sliding_window"), "{error}");
    let error = LlamaPlan::new(&windowed, &params, 0, 4, AttentionKind::Gemm).unwrap_err();
    assert!(error.to_string().contains("batch 0"), "{error}");
}
