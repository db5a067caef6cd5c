//! The model's parameters: their Hugging Face names and shapes, in the fixed order the flat layout
//! places them, where each one lives in a given layout, its initialisation, and the groups whose
//! gradients complete together during backward.

use std::ops::Range;

use rayon::prelude::*;
use zeroflow_core::layout::{FlatLayout, ParamSpec};

use crate::GptConfig;
use crate::error::GptError;
use zeroflow_nn::Float;
use zeroflow_nn::init::{NORMAL_BLOCK, fill_normal_blocks};
pub use zeroflow_nn::plan::{GradGroup, GradsReady};

/// The parameters of one transformer block, as flat ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockParams {
    pub ln_1_weight: Range<usize>,
    pub ln_1_bias: Range<usize>,
    /// Conv1D `[d, 3d]`.
    pub c_attn_weight: Range<usize>,
    pub c_attn_bias: Range<usize>,
    /// Conv1D `[d, d]`.
    pub attn_c_proj_weight: Range<usize>,
    pub attn_c_proj_bias: Range<usize>,
    pub ln_2_weight: Range<usize>,
    pub ln_2_bias: Range<usize>,
    /// Conv1D `[d, 4d]`.
    pub c_fc_weight: Range<usize>,
    pub c_fc_bias: Range<usize>,
    /// Conv1D `[4d, d]`.
    pub mlp_c_proj_weight: Range<usize>,
    pub mlp_c_proj_bias: Range<usize>,
}

/// Where every parameter lives in a flat layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamRanges {
    /// `[padded_vocab, d]`; also the LM head (tied).
    pub wte: Range<usize>,
    /// `[context, d]`.
    pub wpe: Range<usize>,
    pub blocks: Vec<BlockParams>,
    pub ln_f_weight: Range<usize>,
    pub ln_f_bias: Range<usize>,
}

/// The block suffixes in layout order, with their shapes for width `c`.
fn block_specs(c: usize) -> [(&'static str, Vec<usize>); 12] {
    [
        ("ln_1.weight", vec![c]),
        ("ln_1.bias", vec![c]),
        ("attn.c_attn.weight", vec![c, 3 * c]),
        ("attn.c_attn.bias", vec![3 * c]),
        ("attn.c_proj.weight", vec![c, c]),
        ("attn.c_proj.bias", vec![c]),
        ("ln_2.weight", vec![c]),
        ("ln_2.bias", vec![c]),
        ("mlp.c_fc.weight", vec![c, 4 * c]),
        ("mlp.c_fc.bias", vec![4 * c]),
        ("mlp.c_proj.weight", vec![4 * c, c]),
        ("mlp.c_proj.bias", vec![c]),
    ]
}

/// The parameters in the order the flat layout must place them: embeddings, the blocks in order,
/// the final LayerNorm. Names are Hugging Face GPT-2's; `transformer.wte.weight` has the padded
/// vocabulary's rows (see [`GptConfig::padded_vocab_size`]).
pub fn param_specs(config: &GptConfig) -> Vec<ParamSpec> {
    let c = config.d_model;
    let mut specs = vec![
        ParamSpec::new("transformer.wte.weight", [config.padded_vocab_size(), c]),
        ParamSpec::new("transformer.wpe.weight", [config.context, c]),
    ];
    for layer in 0..config.n_layer {
        for (suffix, shape) in block_specs(c) {
            specs.push(ParamSpec::new(format!("transformer.h.{layer}.{suffix}"), shape));
        }
    }
    specs.push(ParamSpec::new("transformer.ln_f.weight", [c]));
    specs.push(ParamSpec::new("transformer.ln_f.bias", [c]));
    specs
}

impl ParamRanges {
    /// Finds every parameter of `config` in `layout`, checking its shape.
    pub fn new(config: &GptConfig, layout: &FlatLayout) -> Result<Self, GptError> {
        let mut ranges = param_specs(config).into_iter().map(|spec| {
            let view = layout.param(&spec.name).ok_or_else(|| GptError::Layout {
                name: spec.name.clone(),
                reason: "missing from the flat layout".into(),
            })?;
            if view.shape != spec.shape {
                return Err(GptError::Layout {
                    reason: format!(
                        "shape {:?} in the layout, the model needs {:?}",
                        view.shape, spec.shape
                    ),
                    name: spec.name,
                });
            }
            Ok(view.flat_range())
        });
        let mut next = || ranges.next().expect("param_specs lists every parameter");
        let wte = next()?;
        let wpe = next()?;
        let mut blocks = Vec::with_capacity(config.n_layer);
        for _ in 0..config.n_layer {
            blocks.push(BlockParams {
                ln_1_weight: next()?,
                ln_1_bias: next()?,
                c_attn_weight: next()?,
                c_attn_bias: next()?,
                attn_c_proj_weight: next()?,
                attn_c_proj_bias: next()?,
                ln_2_weight: next()?,
                ln_2_bias: next()?,
                c_fc_weight: next()?,
                c_fc_bias: next()?,
                mlp_c_proj_weight: next()?,
                mlp_c_proj_bias: next()?,
            });
        }
        let ln_f_weight = next()?;
        let ln_f_bias = next()?;
        Ok(ParamRanges { wte, wpe, blocks, ln_f_weight, ln_f_bias })
    }
}

/// How one parameter starts.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Init {
    Zero,
    One,
    /// Normal with this standard deviation; the first `rows` × width elements only (the padded
    /// embedding rows stay zero).
    Normal {
        std: f64,
        real: usize,
    },
}

fn init_of(config: &GptConfig, spec: &ParamSpec) -> Init {
    let name = spec.name.as_str();
    let std = 0.02;
    if name.ends_with(".bias") {
        Init::Zero
    } else if name.contains("ln_") {
        Init::One
    } else if name == "transformer.wte.weight" {
        Init::Normal { std, real: config.vocab_size * config.d_model }
    } else if name.ends_with("c_proj.weight") {
        // Residual projections, scaled as in GPT-2 so that the residual stream's variance does not
        // grow with depth.
        Init::Normal { std: std / (2.0 * config.n_layer as f64).sqrt(), real: spec.numel() }
    } else {
        Init::Normal { std, real: spec.numel() }
    }
}

/// Initialises the parameters like GPT-2 / llm.c: weights normal(0, 0.02), residual projections
/// (`c_proj`) scaled by 1/sqrt(2·n_layer), LayerNorm weights 1, biases 0, padded embedding rows 0.
/// Each parameter draws from its own ChaCha8 stream (seed, parameter index), so the values do not
/// depend on the layout's alignment or world size. Padding of the flat buffer is left untouched.
///
/// Parameters are filled in parallel, and each large one in blocks: a block seeks its parameter's
/// stream to its first pair, so the values are those of one sequential pass over the stream,
/// whatever the number of threads.
pub fn init_params<F: Float>(
    config: &GptConfig,
    layout: &FlatLayout,
    seed: u64,
    params: &mut [F],
) -> Result<(), GptError> {
    init_params_in_blocks(config, layout, seed, params, NORMAL_BLOCK, F::of)
}

/// [`init_params`] into elements of any type, each value drawn (f64) converted by `of`: a run's
/// weights straight into its own type (`|x| bf16::from_f32(x as f32)`: the f32 values, rounded).
pub fn init_params_as<T: Copy + Send + Sync>(
    config: &GptConfig,
    layout: &FlatLayout,
    seed: u64,
    params: &mut [T],
    of: impl Fn(f64) -> T + Sync,
) -> Result<(), GptError> {
    init_params_in_blocks(config, layout, seed, params, NORMAL_BLOCK, of)
}

/// [`init_params_as`] with the normal draws cut into tasks of `block` elements (even, non-zero).
fn init_params_in_blocks<T: Copy + Send + Sync>(
    config: &GptConfig,
    layout: &FlatLayout,
    seed: u64,
    params: &mut [T],
    block: usize,
    of: impl Fn(f64) -> T + Sync,
) -> Result<(), GptError> {
    if params.len() != layout.padded_len() {
        return Err(GptError::Length {
            what: "flat parameter buffer",
            expected: layout.padded_len(),
            found: params.len(),
        });
    }
    ParamRanges::new(config, layout)?;
    let specs = param_specs(config);
    // Split the flat buffer into the parameters' slices, in layout order.
    let mut slices = Vec::with_capacity(specs.len());
    let mut rest = params;
    let mut consumed = 0;
    let mut views: Vec<_> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (i, layout.param(&s.name).expect("checked")))
        .collect();
    views.sort_by_key(|(_, v)| v.offset);
    for (index, view) in views {
        let (_, tail) = rest.split_at_mut(view.offset - consumed);
        let (mine, tail) = tail.split_at_mut(view.numel());
        consumed = view.offset + view.numel();
        rest = tail;
        slices.push((index, mine));
    }
    slices.into_par_iter().for_each(|(index, slice)| match init_of(config, &specs[index]) {
        Init::Zero => slice.fill(of(0.0)),
        Init::One => slice.fill(of(1.0)),
        Init::Normal { std, real } => {
            let (real, pad) = slice.split_at_mut(real);
            fill_normal_blocks(seed, index, std, real, block, &of);
            pad.fill(of(0.0));
        }
    });
    Ok(())
}

impl ParamRanges {
    /// The groups in backward order, with their flat ranges.
    pub fn grad_groups(&self) -> Vec<GradsReady> {
        let span = |a: &Range<usize>, b: &Range<usize>| a.start.min(b.start)..a.end.max(b.end);
        let mut groups = vec![GradsReady {
            group: GradGroup::FinalNorm,
            flat_range: span(&self.ln_f_weight, &self.ln_f_bias),
        }];
        for (i, block) in self.blocks.iter().enumerate().rev() {
            groups.push(GradsReady {
                group: GradGroup::Block(i),
                flat_range: span(&block.ln_1_weight, &block.mlp_c_proj_bias),
            });
        }
        groups.push(GradsReady {
            group: GradGroup::Embeddings,
            flat_range: span(&self.wte, &self.wpe),
        });
        groups
    }
}

/// One tensor of a Hugging Face GPT-2 checkpoint and the flat elements that hold it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfTensor {
    pub name: String,
    pub shape: Vec<usize>,
    /// Row-major elements of the tensor in the flat buffer (the padded embedding rows excluded).
    pub flat_range: Range<usize>,
}

/// The checkpoint tensors of a model in `layout`: import and export are copies between these
/// ranges and the named tensors. `lm_head.weight` is not listed: it is tied to the token embedding.
pub fn hf_tensors(config: &GptConfig, layout: &FlatLayout) -> Result<Vec<HfTensor>, GptError> {
    ParamRanges::new(config, layout)?;
    Ok(param_specs(config)
        .into_iter()
        .map(|spec| {
            let view = layout.param(&spec.name).expect("checked by ParamRanges::new");
            let mut shape = spec.shape;
            if spec.name == "transformer.wte.weight" {
                shape[0] = config.vocab_size;
            }
            let numel: usize = shape.iter().product();
            HfTensor { name: spec.name, shape, flat_range: view.offset..view.offset + numel }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flat_layout;

    /// The values of the first implementation: one sequential pass over each parameter's stream.
    fn sequential_reference(config: &GptConfig, layout: &FlatLayout, seed: u64) -> Vec<f32> {
        let mut params = vec![f32::NAN; layout.padded_len()];
        for (index, spec) in param_specs(config).iter().enumerate() {
            let view = layout.param(&spec.name).expect("every parameter is in the layout");
            let slice = &mut params[view.offset..view.offset + view.numel()];
            match init_of(config, spec) {
                Init::Zero => slice.fill(0.0),
                Init::One => slice.fill(1.0),
                Init::Normal { std, real } => {
                    let mut rng = zeroflow_nn::init::normal_stream(seed, index);
                    let (real, pad) = slice.split_at_mut(real);
                    zeroflow_nn::init::fill_normal(&mut rng, std, real, &|x| x as f32);
                    pad.fill(0.0);
                }
            }
        }
        params
    }

    #[test]
    fn blocked_parallel_init_is_bit_identical_to_one_sequential_pass_for_any_thread_count() {
        // Odd widths and vocabulary make odd-length parameters, so the last block of a parameter
        // ends inside a Box–Muller pair; blocks of 4 and 6 put many block starts in every one.
        let config: GptConfig =
            r#"{"n_layer": 2, "n_head": 3, "d_model": 9, "vocab_size": 7, "context": 5}"#
                .parse()
                .unwrap();
        let layout = flat_layout(&config, 1).unwrap();
        let expected = sequential_reference(&config, &layout, 11);
        for threads in [1, 2, 3, 8] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            for block in [2, 4, 6, NORMAL_BLOCK] {
                let mut params = vec![f32::NAN; layout.padded_len()];
                pool.install(|| {
                    init_params_in_blocks(&config, &layout, 11, &mut params, block, f32::of)
                })
                .unwrap();
                let same = params.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{threads} threads, blocks of {block}: values differ");
            }
        }
    }
}
