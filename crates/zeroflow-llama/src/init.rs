//! The initialisation of a Llama-family model, as `transformers`' `_init_weights`: every
//! `nn.Linear` weight and the embedding normal(0, `initializer_range`), biases 0, RMSNorm weights
//! 1, and the embedding's `pad_token_id` row 0 where the config names one.

use rayon::prelude::*;
use zeroflow_core::layout::FlatLayout;
use zeroflow_nn::Float;
use zeroflow_nn::init::{NORMAL_BLOCK, fill_normal_blocks};

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::params::{ParamKind, hf_params};
use crate::ranges::ParamRanges;

/// `initializer_range` where `config.json` gives none (every family's config class default).
pub const DEFAULT_INITIALIZER_RANGE: f64 = 0.02;

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
    init_params_as(config, layout, seed, params, F::of)
}

/// [`init_params`] into elements of any type, each value drawn (f64) converted by `of`: a run's
/// weights straight into its own type (`|x| bf16::from_f32(x as f32)`: the f32 values, rounded).
pub fn init_params_as<T: Copy + Send + Sync>(
    config: &LlamaConfig,
    layout: &FlatLayout,
    seed: u64,
    params: &mut [T],
    of: impl Fn(f64) -> T + Sync,
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
        ParamKind::Bias => slice.fill(of(0.0)),
        ParamKind::Norm => slice.fill(of(1.0)),
        ParamKind::Linear | ParamKind::Embedding => {
            fill_normal_blocks(seed, index, std, slice, NORMAL_BLOCK, &of);
            let width = config.hidden_size;
            if let (ParamKind::Embedding, Some(row)) = (specs[index].kind, pad_row)
                && row < config.vocab_size
            {
                slice[row * width..][..width].fill(of(0.0));
            }
        }
    });
    Ok(())
}
