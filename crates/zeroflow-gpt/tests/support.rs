//! Shared helpers: small models with awkward sizes, random batches, per-tensor comparisons.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::layout::FlatLayout;
use zeroflow_gpt::{GptConfig, flat_layout, init_params};

/// A model whose sizes exercise every tail: width 10 (not a multiple of 8), head width 5, vocabulary
/// 11 padded to 64 (the padded logits must be masked), two layers.
pub const ODD: GptConfig =
    GptConfig { n_layer: 2, n_head: 2, d_model: 10, vocab_size: 11, context: 9 };

/// Parameters of `config` (for one rank), initialised and then perturbed so that LayerNorm weights
/// and all biases are not at their special initial values.
pub fn perturbed_params(config: &GptConfig, seed: u64) -> (FlatLayout, Vec<f64>) {
    let layout = flat_layout(config, 1).unwrap();
    let mut params = vec![0.0f64; layout.padded_len()];
    init_params(config, &layout, seed, &mut params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed + 1);
    for view in layout.params() {
        let real_rows = if view.name == "transformer.wte.weight" {
            config.vocab_size * config.d_model
        } else {
            view.numel()
        };
        for x in &mut params[view.offset..view.offset + real_rows] {
            *x += rng.random_range(-0.1..0.1);
        }
    }
    (layout, params)
}

/// Random `[batch, seq]` inputs and targets below `vocab`.
pub fn random_batch(vocab: usize, n: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut draw = || (0..n).map(|_| rng.random_range(0..vocab as u32)).collect::<Vec<_>>();
    (draw(), draw())
}

/// ‖a − b‖₂ / max(‖a‖₂, ‖b‖₂, tiny): the relative error of one tensor.
pub fn relative_error(a: &[f64], b: &[f64]) -> f64 {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    norm(&diff) / norm(a).max(norm(b)).max(1e-30)
}
