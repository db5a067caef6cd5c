//! The initialisation of a Llama-family model, as `transformers`' `_init_weights`: every
//! `nn.Linear` weight and the embedding normal(0, `initializer_range`), biases 0, RMSNorm weights
//! 1, and the embedding's `pad_token_id` row 0 where the config names one.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;
use zeroflow_core::layout::FlatLayout;
use zeroflow_nn::Float;

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::params::{ParamKind, hf_params};
use crate::ranges::ParamRanges;

/// `initializer_range` where `config.json` gives none (every family's config class default).
pub const DEFAULT_INITIALIZER_RANGE: f64 = 0.02;

/// Elements of one parameter that one task draws (even: every block starts on a Box–Muller pair).
const NORMAL_BLOCK: usize = 1 << 20;

/// ChaCha8 words (`u32`) one Box–Muller pair consumes: two `f64` draws of one `u64` each.
const WORDS_PER_PAIR: u128 = 4;

/// `initializer_range` of the config (kept in its `extra` fields).
pub fn initializer_range(config: &LlamaConfig) -> f64 {
    config
        .extra
        .get("initializer_range")
        .and_then(|v| v.as_f64())
        .unwrap_or(DEFAULT_INITIALIZER_RANGE)
}

/// Initialises the flat parameter buffer `params` of `layout` (padding left untouched). Each
/// parameter draws from its own ChaCha8 stream (seed, parameter index), in blocks that seek the
/// stream, so the values depend neither on the layout's alignment nor on the number of threads.
pub fn init_params<F: Float>(
    config: &LlamaConfig,
    layout: &FlatLayout,
    seed: u64,
    params: &mut [F],
) -> Result<(), LlamaError> {
    if params.len() != layout.padded_len() {
        let (expected, found) = (layout.padded_len(), params.len());
        return Err(LlamaError::Length { what: "flat parameter buffer", expected, found });
    }
    ParamRanges::new(config, layout)?;
    let std = initializer_range(config);
    let pad_row = config.extra.get("pad_token_id").and_then(|v| v.as_u64()).map(|r| r as usize);
    let specs = hf_params(config);
    let mut views: Vec<(usize, _)> = specs
        .iter()
        .enumerate()
        .map(|(i, p)| (i, layout.param(&p.name).expect("checked by ParamRanges::new")))
        .collect();
    views.sort_by_key(|(_, view)| view.offset);
    let mut slices = Vec::with_capacity(views.len());
    let (mut rest, mut consumed) = (params, 0);
    for (index, view) in views {
        let (_, tail) = rest.split_at_mut(view.offset - consumed);
        let (mine, tail) = tail.split_at_mut(view.numel());
        (rest, consumed) = (tail, view.offset + view.numel());
        slices.push((index, mine));
    }
    slices.into_par_iter().for_each(|(index, slice)| match specs[index].kind {
        ParamKind::Bias => slice.fill(F::zero()),
        ParamKind::Norm => slice.fill(F::one()),
        ParamKind::Linear | ParamKind::Embedding => {
            slice.par_chunks_mut(NORMAL_BLOCK).enumerate().for_each(|(number, part)| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream(index as u64);
                rng.set_word_pos(WORDS_PER_PAIR * (number * NORMAL_BLOCK / 2) as u128);
                fill_normal(&mut rng, std, part);
            });
            let width = config.hidden_size;
            if let (ParamKind::Embedding, Some(row)) = (specs[index].kind, pad_row)
                && row < config.vocab_size
            {
                slice[row * width..][..width].fill(F::zero());
            }
        }
    });
    Ok(())
}

/// Fills `out` with normal(0, std) samples (Box–Muller, both outputs used).
fn fill_normal<F: Float>(rng: &mut ChaCha8Rng, std: f64, out: &mut [F]) {
    for pair in out.chunks_mut(2) {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1: f64 = 1.0 - rng.random::<f64>();
        let u2: f64 = rng.random::<f64>();
        let radius = (-2.0 * u1.ln()).sqrt() * std;
        let angle = std::f64::consts::TAU * u2;
        pair[0] = F::of(radius * angle.cos());
        if let Some(second) = pair.get_mut(1) {
            *second = F::of(radius * angle.sin());
        }
    }
}
