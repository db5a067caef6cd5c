//! A Llama-family model with a key/value cache, on host vectors in any [`Float`]: zeroflow-nn's
//! [`Decoder`] for generation. A step runs the same kernels as the training plan (the
//! embedding, RMSNorm, the `[out, in]` matmuls with their biases, Qwen3's q/k norm, RoPE at each
//! row's own position, SwiGLU, the residual) over the step's token rows only, and grouped-query
//! attention over the cache ([`KvCache::attend`]); the LM head runs only on the rows whose logits
//! are asked for.

use std::ops::Range;

use zeroflow_core::layout::FlatLayout;
use zeroflow_nn::Float;
use zeroflow_nn::WeightLayout::OutIn;
use zeroflow_nn::infer::{CachedAttention, CachedRow, Decoder, HostDecoder, KvCache, StepRows};
use zeroflow_nn::kernels::matmul::matmul_forward_few_rows;
use zeroflow_nn::kernels::pointwise::residual_forward;

use crate::config::LlamaConfig;
use crate::error::{LlamaConfigError, LlamaError};
use crate::kernels::rope::{Rotary, rope_forward_at};
use crate::kernels::swiglu::swiglu_forward;
use crate::kernels::{embedding::embedding_forward, rmsnorm::rmsnorm_forward};
use crate::ranges::{LayerParams, ParamRanges};
use crate::rope::RopeFreqs;

/// A Llama-family model over the flat parameters `weights` (of the layout it was built with),
/// with the key/value cache of the current batch.
#[derive(Debug)]
pub struct LlamaDecoder<'a, F> {
    config: LlamaConfig,
    params: ParamRanges,
    weights: &'a [F],
    rotary: Rotary,
    cache: KvCache<F>,
}

impl<'a, F: Float> LlamaDecoder<'a, F> {
    pub fn new(
        config: &LlamaConfig,
        layout: &FlatLayout,
        weights: &'a [F],
    ) -> Result<Self, LlamaError> {
        let params = ParamRanges::new(config, layout)?;
        if weights.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), weights.len());
            return Err(LlamaError::Length { what: "parameter buffer", expected, found });
        }
        if !config.head_dim.is_multiple_of(2) {
            return Err(LlamaError::Config(LlamaConfigError::Invalid {
                field: "head_dim".into(),
                reason: format!("{} is odd; rotary embeddings rotate pairs", config.head_dim),
            }));
        }
        let rotary = Rotary {
            t: 1,
            n_head: config.num_attention_heads,
            n_kv_head: config.num_key_value_heads,
            freqs: RopeFreqs {
                head_dim: config.head_dim,
                theta: config.rope_theta,
                scaling: config.rope_scaling.clone(),
            },
        };
        let cache = KvCache::new(config.num_hidden_layers, attention(config), 0, 0);
        Ok(LlamaDecoder { config: config.clone(), params, weights, rotary, cache })
    }

    /// Runs a step's rows (already counted by the cache) and returns the logits
    /// `[logits_of.len(), vocab]` of the rows it asks for.
    fn step(&mut self, step: &StepRows) -> Result<Vec<F>, LlamaError> {
        let StepRows { tokens, rows, logits_of } = step;
        let (c, w) = (&self.config, self.weights);
        let d = c.hidden_size;
        let mut hidden = vec![F::zero(); rows.len() * d];
        embedding_forward(&mut hidden, tokens, &w[self.params.embed.clone()], d, c.vocab_size)
            .map_err(|reason| LlamaError::Kernel { kernel: "embedding_forward", reason })?;
        for (layer, params) in self.params.layers.iter().enumerate() {
            let layer = Layer { config: c, weights: w, rotary: &self.rotary, params, index: layer };
            hidden = layer.forward(&mut self.cache, &hidden, rows);
        }
        let mut picked = Vec::with_capacity(logits_of.len() * d);
        logits_of.iter().for_each(|&row| picked.extend_from_slice(&hidden[row * d..][..d]));
        let normed = rmsnorm(&picked, &w[self.params.norm.clone()], d, c.rms_norm_eps);
        Ok(linear(&normed, w, self.params.head(), None, (d, c.vocab_size)))
    }
}

/// One decoder layer and what it reads.
struct Layer<'a, F> {
    config: &'a LlamaConfig,
    weights: &'a [F],
    rotary: &'a Rotary,
    params: &'a LayerParams,
    index: usize,
}

impl<F: Float> Layer<'_, F> {
    /// The layer on a step's rows: the residual stream leaving it.
    fn forward(&self, cache: &mut KvCache<F>, input: &[F], rows: &[CachedRow]) -> Vec<F> {
        let (c, w, p) = (self.config, self.weights, self.params);
        let (d, ffn, eps) = (c.hidden_size, c.intermediate_size, c.rms_norm_eps);
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let x = rmsnorm(input, &w[p.input_norm.clone()], d, eps);
        let mut q = linear(&x, w, &p.q_weight, p.q_bias.as_ref(), (d, q_dim));
        let mut k = linear(&x, w, &p.k_weight, p.k_bias.as_ref(), (d, kv_dim));
        let v = linear(&x, w, &p.v_weight, p.v_bias.as_ref(), (d, kv_dim));
        if let Some((q_norm, k_norm)) = &p.qk_norm {
            q = rmsnorm(&q, &w[q_norm.clone()], c.head_dim, eps);
            k = rmsnorm(&k, &w[k_norm.clone()], c.head_dim, eps);
        }
        let mut qkv = vec![F::zero(); rows.len() * self.rotary.qkv_width()];
        rope_forward_at(&mut qkv, &q, &k, &v, self.rotary, |row| rows[row].pos);
        let mut atty = vec![F::zero(); rows.len() * q_dim];
        cache.attend(self.index, &qkv, rows, &mut atty);
        let attn_out = linear(&atty, w, &p.o_weight, p.o_bias.as_ref(), (q_dim, d));
        let mut mid = vec![F::zero(); input.len()];
        residual_forward(&mut mid, input, &attn_out);
        let y = rmsnorm(&mid, &w[p.post_norm.clone()], d, eps);
        let gate = linear(&y, w, &p.gate, None, (d, ffn));
        let up = linear(&y, w, &p.up, None, (d, ffn));
        let mut swiglu = vec![F::zero(); gate.len()];
        swiglu_forward(&mut swiglu, &gate, &up);
        let mlp_out = linear(&swiglu, w, &p.down, None, (ffn, d));
        let mut out = vec![F::zero(); input.len()];
        residual_forward(&mut out, &mid, &mlp_out);
        out
    }
}

/// Grouped-query attention over `n_head · head_dim` query channels.
fn attention(config: &LlamaConfig) -> CachedAttention {
    CachedAttention {
        n_head: config.num_attention_heads,
        n_kv_head: config.num_key_value_heads,
        head_dim: config.head_dim,
    }
}

/// RMSNorm of rows of width `c` (the statistics dropped).
fn rmsnorm<F: Float>(inp: &[F], weight: &[F], c: usize, eps: f64) -> Vec<F> {
    let (mut out, mut rstd) = (vec![F::zero(); inp.len()], vec![F::zero(); inp.len() / c]);
    rmsnorm_forward(&mut out, &mut rstd, inp, weight, c, eps);
    out
}

/// `inp @ weightᵀ + bias` of an `[oc, c]` weight.
fn linear<F: Float>(
    inp: &[F],
    w: &[F],
    weight: &Range<usize>,
    bias: Option<&Range<usize>>,
    (c, oc): (usize, usize),
) -> Vec<F> {
    let mut out = vec![F::zero(); inp.len() / c * oc];
    let bias = bias.map(|b| &w[b.clone()]);
    matmul_forward_few_rows(&mut out, inp, &w[weight.clone()], bias, c, oc, OutIn);
    out
}

impl<F: Float> Decoder for LlamaDecoder<'_, F> {
    type Float = F;
    type Error = LlamaError;

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// `max_position_embeddings`, or the sliding window where shorter (the cache attends to every
    /// position, as the training forward does).
    fn max_positions(&self) -> usize {
        let max = self.config.max_position_embeddings;
        self.config.sliding_window.map_or(max, |window| window.min(max))
    }

    fn prefill(&mut self, prompts: &[&[u32]], capacity: usize) -> Result<Vec<F>, LlamaError> {
        let capacity = capacity.min(self.max_positions());
        let layers = self.config.num_hidden_layers;
        self.cache = KvCache::new(layers, attention(&self.config), prompts.len(), capacity);
        let step = self.cache.prefill(prompts).map_err(LlamaError::Batch)?;
        self.step(&step)
    }

    fn decode(&mut self, next: &[(usize, u32)]) -> Result<Vec<F>, LlamaError> {
        let step = self.cache.decode(next).map_err(LlamaError::Batch)?;
        self.step(&step)
    }

    fn extend(
        &mut self,
        keep: usize,
        tokens: &[u32],
        capacity: usize,
    ) -> Result<Vec<F>, LlamaError> {
        let capacity = capacity.min(self.max_positions());
        let step = self.cache.extend(keep, tokens, capacity).map_err(LlamaError::Batch)?;
        self.step(&step)
    }
}

impl<F: Float> HostDecoder for LlamaDecoder<'_, F> {
    fn cache_mut(&mut self) -> &mut KvCache<F> {
        &mut self.cache
    }

    fn cache_shape(&self) -> (usize, CachedAttention) {
        (self.config.num_hidden_layers, attention(&self.config))
    }
}
