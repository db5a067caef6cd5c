//! A few seconds of training on the device: the loss falls.

use std::sync::Arc;

use zeroflow_data::{DataLoader, Source, SyntheticCorpus};
use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::{CpuGpt, GptConfig, flat_layout, init_params};

/// Thirty Adam steps of a one-layer model on a first-order chain (entropy 1.28 nats) take the
/// loss from ln 64 = 4.16 below 3.0.
#[test]
fn a_short_adam_run_on_the_device_lowers_the_loss() {
    let config = GptConfig { n_layer: 1, n_head: 2, d_model: 32, vocab_size: 64, context: 16 };
    let (batch, seq) = (8, 16);
    let corpus = Arc::new(SyntheticCorpus::new(64, 1, vec![0.4, 0.3, 0.2, 0.1], 5));
    let source = Source::Synthetic { corpus, stream_seed: 0, len: 100_000 };
    let mut data = DataLoader::new(source, config.vocab_size, batch, seq, 0, 1).unwrap();
    let layout = flat_layout(&config, 1).unwrap();
    let mut weights = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 1, &mut weights).unwrap();
    let (mut m, mut v) = (vec![0.0f32; weights.len()], vec![0.0f32; weights.len()]);
    let device = CpuDevice::new().unwrap();
    let mut model = CpuGpt::new(&device, &config, &layout, batch, seq).unwrap();
    let mut losses = Vec::new();
    for step in 1..=30 {
        let params = device.upload(&weights).unwrap();
        let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
        let next = data.next_batch().unwrap();
        model.set_batch(&next.inputs, &next.targets).unwrap();
        model.forward(&params).unwrap();
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        losses.push(model.loss().unwrap());
        let grads = device.download(&grads).unwrap();
        let (lr, b1, b2) = (1e-2f32, 0.9f32, 0.999f32);
        for i in 0..weights.len() {
            m[i] = b1 * m[i] + (1.0 - b1) * grads[i];
            v[i] = b2 * v[i] + (1.0 - b2) * grads[i] * grads[i];
            let m_hat = m[i] / (1.0 - b1.powi(step));
            let v_hat = v[i] / (1.0 - b2.powi(step));
            weights[i] -= lr * m_hat / (v_hat.sqrt() + 1e-8);
        }
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!((first - 64f32.ln()).abs() < 0.1, "{first}");
    assert!(last < 3.0, "loss fell from {first} to only {last}: {losses:?}");
}
