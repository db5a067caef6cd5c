//! GPT-2 with a key/value cache, on host vectors in any [`Float`]: zeroflow-nn's
//! [`Decoder`] for generation. A step runs the same kernels as the training plan
//! (the encoder, LayerNorm, the Conv1D matmuls, GELU, the residual) over the step's token rows
//! only, and attention over the cache ([`KvCache::attend`]); the LM head runs only on the rows
//! whose logits are asked for.

use zeroflow_core::layout::FlatLayout;
use zeroflow_nn::Float;
use zeroflow_nn::WeightLayout::{InOut, OutIn};
use zeroflow_nn::infer::{CachedAttention, CachedRow, Decoder, HostDecoder, KvCache, StepRows};
use zeroflow_nn::kernels::matmul::matmul_forward_few_rows;
use zeroflow_nn::kernels::{encoder, pointwise::residual_forward};

use crate::GptConfig;
use crate::error::GptError;
use crate::kernels::{gelu::gelu_forward, layernorm::layernorm_forward};
use crate::params::{BlockParams, ParamRanges};

/// A GPT-2 model over the flat parameters `weights` (of the layout it was built with), with the
/// key/value cache of the current batch.
#[derive(Debug)]
pub struct GptDecoder<'a, F> {
    config: GptConfig,
    params: ParamRanges,
    weights: &'a [F],
    cache: KvCache<F>,
}

impl<'a, F: Float> GptDecoder<'a, F> {
    pub fn new(
        config: &GptConfig,
        layout: &FlatLayout,
        weights: &'a [F],
    ) -> Result<Self, GptError> {
        let params = ParamRanges::new(config, layout)?;
        if weights.len() != layout.padded_len() {
            let (expected, found) = (layout.padded_len(), weights.len());
            return Err(GptError::Length { what: "parameter buffer", expected, found });
        }
        let cache = KvCache::new(config.n_layer, attention(config), 0, 0);
        Ok(GptDecoder { config: *config, params, weights, cache })
    }

    /// Runs a step's rows (already counted by the cache) and returns the logits
    /// `[logits_of.len(), vocab]` of the rows it asks for.
    fn step(&mut self, step: &StepRows) -> Result<Vec<F>, GptError> {
        let StepRows { tokens, rows, logits_of: last } = step;
        let (n, c, w) = (rows.len(), self.config.d_model, self.weights);
        let p = &self.params;
        let mut residual = vec![F::zero(); n * c];
        encoder::encoder_forward_at(
            &mut residual,
            tokens,
            &w[p.wte.clone()],
            &w[p.wpe.clone()],
            c,
            self.config.vocab_size,
            |row| rows[row].pos,
        )
        .map_err(|reason| GptError::Kernel { kernel: "encoder_forward", reason })?;
        for (layer, block) in p.blocks.iter().enumerate() {
            residual =
                block_forward(&self.config, w, &mut self.cache, (layer, block), &residual, rows);
        }
        let mut picked = Vec::with_capacity(last.len() * c);
        last.iter().for_each(|&row| picked.extend_from_slice(&residual[row * c..][..c]));
        let m = last.len();
        let normed = layernorm(&picked, &w[p.ln_f_weight.clone()], &w[p.ln_f_bias.clone()], c);
        let padded = self.config.padded_vocab_size();
        let mut logits = vec![F::zero(); m * padded];
        matmul_forward_few_rows(&mut logits, &normed, &w[p.wte.clone()], None, c, padded, OutIn);
        let vocab = self.config.vocab_size;
        Ok(logits.chunks(padded).flat_map(|row| row[..vocab].iter().copied()).collect())
    }
}

/// Block `layer` (its parameters `b`) on a step's rows: the residual stream leaving it.
fn block_forward<F: Float>(
    config: &GptConfig,
    w: &[F],
    cache: &mut KvCache<F>,
    (layer, b): (usize, &BlockParams),
    input: &[F],
    rows: &[CachedRow],
) -> Vec<F> {
    let (n, c) = (rows.len(), config.d_model);
    let linear = |inp: &[F], weight: &std::ops::Range<usize>, bias: &std::ops::Range<usize>, oc| {
        let mut out = vec![F::zero(); n * oc];
        matmul_forward_few_rows(
            &mut out,
            inp,
            &w[weight.clone()],
            Some(&w[bias.clone()]),
            inp.len() / n,
            oc,
            InOut,
        );
        out
    };
    let ln_1 = layernorm(input, &w[b.ln_1_weight.clone()], &w[b.ln_1_bias.clone()], c);
    let qkv = linear(&ln_1, &b.c_attn_weight, &b.c_attn_bias, 3 * c);
    let mut atty = vec![F::zero(); n * c];
    cache.attend(layer, &qkv, rows, &mut atty);
    let attproj = linear(&atty, &b.attn_c_proj_weight, &b.attn_c_proj_bias, c);
    let mut residual2 = vec![F::zero(); n * c];
    residual_forward(&mut residual2, input, &attproj);
    let ln_2 = layernorm(&residual2, &w[b.ln_2_weight.clone()], &w[b.ln_2_bias.clone()], c);
    let fch = linear(&ln_2, &b.c_fc_weight, &b.c_fc_bias, 4 * c);
    let mut fch_gelu = vec![F::zero(); n * 4 * c];
    gelu_forward(&mut fch_gelu, &fch);
    let fcproj = linear(&fch_gelu, &b.mlp_c_proj_weight, &b.mlp_c_proj_bias, c);
    let mut residual3 = vec![F::zero(); n * c];
    residual_forward(&mut residual3, &residual2, &fcproj);
    residual3
}

/// GPT-2's attention: multi-head.
fn attention(config: &GptConfig) -> CachedAttention {
    CachedAttention { n_head: config.n_head, n_kv_head: config.n_head, head_dim: config.head_dim() }
}

/// LayerNorm of rows of width `c` (the statistics dropped).
fn layernorm<F: Float>(inp: &[F], weight: &[F], bias: &[F], c: usize) -> Vec<F> {
    let rows = inp.len() / c;
    let (mut out, mut mean, mut rstd) =
        (vec![F::zero(); inp.len()], vec![F::zero(); rows], vec![F::zero(); rows]);
    layernorm_forward(&mut out, &mut mean, &mut rstd, inp, weight, bias, c);
    out
}

impl<F: Float> Decoder for GptDecoder<'_, F> {
    type Float = F;
    type Error = GptError;

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn max_positions(&self) -> usize {
        self.config.context
    }

    fn prefill(&mut self, prompts: &[&[u32]], capacity: usize) -> Result<Vec<F>, GptError> {
        let capacity = capacity.min(self.config.context);
        self.cache =
            KvCache::new(self.config.n_layer, attention(&self.config), prompts.len(), capacity);
        let step = self.cache.prefill(prompts).map_err(GptError::Batch)?;
        self.step(&step)
    }

    fn decode(&mut self, next: &[(usize, u32)]) -> Result<Vec<F>, GptError> {
        let step = self.cache.decode(next).map_err(GptError::Batch)?;
        self.step(&step)
    }

    fn extend(&mut self, keep: usize, tokens: &[u32], capacity: usize) -> Result<Vec<F>, GptError> {
        let capacity = capacity.min(self.config.context);
        let step = self.cache.extend(keep, tokens, capacity).map_err(GptError::Batch)?;
        self.step(&step)
    }
}

impl<F: Float> HostDecoder for GptDecoder<'_, F> {
    fn cache_mut(&mut self) -> &mut KvCache<F> {
        &mut self.cache
    }

    fn cache_shape(&self) -> (usize, CachedAttention) {
        (self.config.n_layer, attention(&self.config))
    }
}
