//! The loss at initialisation is what nearly uniform logits give.
//!
//! The final LayerNorm makes every row of its output have squared norm `d` (weight 1, bias 0), and
//! the tied embedding's rows are normal(0, 0.02²), so each logit is normal with variance
//! σ² = d · 0.02², independent of the target. The expected loss is then E[logsumexp] − E[z_target]
//! ≈ ln(vocab) + σ²/2: 0.03 above ln(vocab) for `tiny`, 0.15 for GPT-2 124M (nanoGPT and llm.c
//! see about 11.0 there), 0.41 for the 2048-wide 1.3B. The tests check the measured loss against
//! that to ±0.1, on enough positions that the sampling spread (σ/√positions) stays below 0.05.

use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::{CpuGpt, GptConfig, flat_layout, init_params, init_params_on_device};

use crate::support::random_batch;

fn initial_loss(config: &GptConfig, batch: usize, seq: usize) -> f32 {
    let layout = flat_layout(config, 1).unwrap();
    let device = CpuDevice::new().unwrap();
    let params = device.alloc::<f32>(layout.padded_len()).unwrap();
    init_params_on_device(&device, &params, config, &layout, 42).unwrap();
    let mut model = CpuGpt::new(&device, config, &layout, batch, seq).unwrap();
    let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 43);
    model.set_batch(&inputs, &targets).unwrap();
    model.forward(&params).unwrap();
    model.loss().unwrap()
}

/// The device initialisation equals the host one.
#[test]
fn initialising_on_the_device_equals_initialising_on_the_host() {
    let config = GptConfig::TINY;
    let layout = flat_layout(&config, 2).unwrap();
    let mut host = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 3, &mut host).unwrap();
    let device = CpuDevice::new().unwrap();
    let params = device.alloc::<f32>(layout.padded_len()).unwrap();
    init_params_on_device(&device, &params, &config, &layout, 3).unwrap();
    assert_eq!(device.download(&params).unwrap(), host);
}

fn check(name: &str, batch: usize, seq: usize) {
    let config = GptConfig::named(name).unwrap();
    let loss = f64::from(initial_loss(&config, batch, seq));
    let variance = config.d_model as f64 * 0.02f64.powi(2);
    let expected = (config.vocab_size as f64).ln() + variance / 2.0;
    assert!((loss - expected).abs() <= 0.1, "{name}: loss {loss}, expected {expected}");
    println!("{name}: initial loss {loss:.4}, ln(vocab) + σ²/2 = {expected:.4}");
}

#[test]
fn tiny_starts_at_ln_vocab() {
    check("tiny", 4, 64);
}

#[test]
fn gpt2_124m_starts_at_ln_vocab() {
    check("gpt2-124m", 4, 64);
}

/// The larger sizes need 1.4 to 6.2 GB of f32 parameters and up to a minute each here; run with
/// `cargo test -p zeroflow-gpt --release -- --ignored`.
#[test]
#[ignore = "several GB of memory and minutes of CPU"]
fn larger_sizes_start_at_ln_vocab() {
    for name in ["gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt-1.3b"] {
        check(name, 1, 256);
    }
}
