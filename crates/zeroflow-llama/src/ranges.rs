//! Where every parameter of a Llama-family model lives in a flat layout, and the groups whose
//! gradients complete together during backward.
//!
//! The flat layout places the parameters in [`crate::hf_params`]' order (`transformers`'
//! `state_dict`): the embedding, each layer's parameters together, the final norm, then
//! `lm_head.weight` unless it is tied.

use std::ops::Range;

use zeroflow_core::layout::{Alignment, FlatLayout, ParamSpec};
use zeroflow_nn::plan::{GradGroup, GradsReady};

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::params::{HfParam, hf_params};

/// The parameters of one decoder layer, as flat ranges. Linear weights are `[out, in]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerParams {
    /// `input_layernorm.weight`, `[hidden]`.
    pub input_norm: Range<usize>,
    pub q_weight: Range<usize>,
    pub q_bias: Option<Range<usize>>,
    pub k_weight: Range<usize>,
    pub k_bias: Option<Range<usize>>,
    pub v_weight: Range<usize>,
    pub v_bias: Option<Range<usize>>,
    pub o_weight: Range<usize>,
    pub o_bias: Option<Range<usize>>,
    /// Qwen3's `self_attn.q_norm.weight` and `self_attn.k_norm.weight`, `[head_dim]` each.
    pub qk_norm: Option<(Range<usize>, Range<usize>)>,
    pub gate: Range<usize>,
    pub up: Range<usize>,
    pub down: Range<usize>,
    /// `post_attention_layernorm.weight`, `[hidden]`.
    pub post_norm: Range<usize>,
    /// From the layer's first parameter's first element to its last's last.
    pub span: Range<usize>,
}

/// Where every parameter lives in a flat layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamRanges {
    /// `model.embed_tokens.weight`, `[vocab, hidden]`.
    pub embed: Range<usize>,
    pub layers: Vec<LayerParams>,
    /// `model.norm.weight`.
    pub norm: Range<usize>,
    /// `lm_head.weight` when it is not tied to the embedding.
    pub lm_head: Option<Range<usize>>,
}

/// The parameters of `config` in flat layout order, as the layout's specs.
pub fn param_specs(config: &LlamaConfig) -> Vec<ParamSpec> {
    let spec = |p: HfParam| ParamSpec::new(p.name, p.shape).with_split_axis(p.split_axis);
    hf_params(config).into_iter().map(spec).collect()
}

/// The flat layout of `config`'s parameters for `world_size` ranks with the default alignment.
pub fn flat_layout(config: &LlamaConfig, world_size: usize) -> Result<FlatLayout, LlamaError> {
    FlatLayout::new(&param_specs(config), world_size, Alignment::default())
        .map_err(|e| LlamaError::Layout { name: "(layout)".into(), reason: e.to_string() })
}

impl ParamRanges {
    /// Finds every parameter of `config` in `layout`, checking its shape.
    pub fn new(config: &LlamaConfig, layout: &FlatLayout) -> Result<Self, LlamaError> {
        let find = |name: &str, shape: &[usize]| -> Result<Range<usize>, LlamaError> {
            let view = layout.param(name).ok_or_else(|| LlamaError::Layout {
                name: name.to_string(),
                reason: "missing from the flat layout".into(),
            })?;
            if view.shape != shape {
                return Err(LlamaError::Layout {
                    name: name.to_string(),
                    reason: format!(
                        "shape {:?} in the layout, the model needs {:?}",
                        view.shape, shape
                    ),
                });
            }
            Ok(view.flat_range())
        };
        let specs = hf_params(config);
        let shape_of = |name: &str| -> &[usize] {
            &specs.iter().find(|p| p.name == name).expect("hf_params lists it").shape
        };
        let get = |name: &str| find(name, shape_of(name));
        let maybe = |name: &str| -> Result<Option<Range<usize>>, LlamaError> {
            match specs.iter().find(|p| p.name == name) {
                Some(p) => find(name, &p.shape).map(Some),
                None => Ok(None),
            }
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for layer in 0..config.num_hidden_layers {
            let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
            let attn = |module: &str, part: &str| name(&format!("self_attn.{module}.{part}"));
            let qk_norm = match config.qk_norm {
                true => Some((get(&attn("q_norm", "weight"))?, get(&attn("k_norm", "weight"))?)),
                false => None,
            };
            let mut params = LayerParams {
                input_norm: get(&name("input_layernorm.weight"))?,
                q_weight: get(&attn("q_proj", "weight"))?,
                q_bias: maybe(&attn("q_proj", "bias"))?,
                k_weight: get(&attn("k_proj", "weight"))?,
                k_bias: maybe(&attn("k_proj", "bias"))?,
                v_weight: get(&attn("v_proj", "weight"))?,
                v_bias: maybe(&attn("v_proj", "bias"))?,
                o_weight: get(&attn("o_proj", "weight"))?,
                o_bias: maybe(&attn("o_proj", "bias"))?,
                qk_norm,
                gate: get(&name("mlp.gate_proj.weight"))?,
                up: get(&name("mlp.up_proj.weight"))?,
                down: get(&name("mlp.down_proj.weight"))?,
                post_norm: get(&name("post_attention_layernorm.weight"))?,
                span: 0..0,
            };
            let start = params.ranges().map(|r| r.start).min().expect("a layer has parameters");
            let end = params.ranges().map(|r| r.end).max().expect("a layer has parameters");
            params.span = start..end;
            layers.push(params);
        }
        Ok(ParamRanges {
            embed: get("model.embed_tokens.weight")?,
            layers,
            norm: get("model.norm.weight")?,
            lm_head: maybe("lm_head.weight")?,
        })
    }

    /// The LM head's weight `[vocab, hidden]`: `lm_head.weight`, or the embedding when tied.
    pub fn head(&self) -> &Range<usize> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// The groups in backward order, with their flat ranges: the final norm (with an untied
    /// `lm_head`, whose gradient is complete before it), the layers from last to first, the
    /// embedding (complete only at the end when tied: the head also adds to it).
    pub fn grad_groups(&self) -> Vec<GradsReady> {
        let final_norm = match &self.lm_head {
            Some(head) => self.norm.start.min(head.start)..self.norm.end.max(head.end),
            None => self.norm.clone(),
        };
        let mut groups = vec![GradsReady { group: GradGroup::FinalNorm, flat_range: final_norm }];
        for (i, layer) in self.layers.iter().enumerate().rev() {
            groups.push(GradsReady { group: GradGroup::Block(i), flat_range: layer.span.clone() });
        }
        groups.push(GradsReady { group: GradGroup::Embeddings, flat_range: self.embed.clone() });
        groups
    }
}

impl LayerParams {
    /// Every range of the layer.
    fn ranges(&self) -> impl Iterator<Item = &Range<usize>> {
        let biases = [&self.q_bias, &self.k_bias, &self.v_bias, &self.o_bias];
        let norms = self.qk_norm.iter().flat_map(|(q, k)| [q, k]);
        [
            &self.input_norm,
            &self.q_weight,
            &self.k_weight,
            &self.v_weight,
            &self.o_weight,
            &self.gate,
            &self.up,
            &self.down,
            &self.post_norm,
        ]
        .into_iter()
        .chain(biases.into_iter().flatten())
        .chain(norms)
    }
}
