//! A Llama-family model as a plan of zeroflow-nn: the forward and backward launches over the four
//! flat buffers (parameters, gradients, activations, activation gradients) and the two token
//! buffers, for one (batch, sequence length), as `transformers`' `LlamaForCausalLM` (and Qwen2,
//! Qwen3, Mistral) computes it:
//!
//! ```text
//! h = embed(tokens)
//! per layer:  x = rmsnorm(h);  q, k, v = x Wqᵀ + bq, x Wkᵀ + bk, x Wvᵀ + bv
//!             (Qwen3: q, k = rmsnorm per head)
//!             qkv = [rope(q) | rope(k) | v];  a = attention(qkv) (grouped-query, causal)
//!             h = h + a Woᵀ (+ bo);  y = rmsnorm(h);  h = h + (silu(y Wgᵀ) · y Wuᵀ) Wdᵀ
//! logits = rmsnorm(h) Wheadᵀ (Whead = lm_head, or the embedding when tied)
//! ```
//!
//! The builder works layer by layer: [`Builder::layer_forward`] emits one layer's forward from
//! the range of its input (the residual stream entering it), and [`Builder::layer_backward`] its
//! backward from the same ranges. With activation checkpointing ([`PlanOptions`]) each layer's
//! backward steps go through [`zeroflow_nn::Checkpointing::layer_backward`] with that layer's
//! forward launches, which recompute what the backward reads.

use std::ops::Range;

use zeroflow_nn::plan::{
    Buf, Launch, Step, read, update, write, zero_accumulated_activation_grads,
};
use zeroflow_nn::{Arg, AttentionKind, AttentionShape, WeightLayout};

use crate::acts::{ActLayout, AttentionActs, LayerActs};
use crate::config::LlamaConfig;
use crate::error::{LlamaConfigError, LlamaError};
use crate::kernels::{Kernel, LlamaKernel, Rotary};
use crate::ranges::{LayerParams, ParamRanges};
use crate::rope::RopeFreqs;

/// The Llama family's plan: zeroflow-nn's [`zeroflow_nn::Plan`] of [`LlamaKernel`]s.
pub type Plan = zeroflow_nn::Plan<LlamaKernel>;

/// How a [`LlamaPlan`] is built (zeroflow-nn's options of every family's plan).
pub use zeroflow_nn::PlanOptions;

/// A Llama plan for one (batch, seq) and where its activations lie.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaPlan {
    pub acts: ActLayout,
    pub plan: Plan,
}

use Buf::{ActGrads as AG, Acts as A, Grads as G, Params as P};

impl LlamaPlan {
    /// The plan for micro-batches of `batch` sequences of `seq` tokens whose attention keeps what
    /// `attention` says.
    pub fn new(
        config: &LlamaConfig,
        params: &ParamRanges,
        batch: usize,
        seq: usize,
        attention: AttentionKind,
    ) -> Result<LlamaPlan, LlamaError> {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(config, params, batch, seq, options)
    }

    /// The plan for micro-batches of `batch` sequences of `seq` tokens, built as `options` say.
    pub fn with_options(
        config: &LlamaConfig,
        params: &ParamRanges,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Result<LlamaPlan, LlamaError> {
        if batch == 0 || seq == 0 {
            return Err(LlamaError::Batch(format!(
                "batch {batch} × seq {seq}: both must be at least 1"
            )));
        }
        config.check_sequence_len(seq)?;
        if !config.head_dim.is_multiple_of(2) {
            return Err(LlamaError::Config(LlamaConfigError::Invalid {
                field: "head_dim".into(),
                reason: format!(
                    "{} is odd; rotary embeddings rotate pairs of channels",
                    config.head_dim
                ),
            }));
        }
        let acts = ActLayout::with_options(config, batch, seq, options);
        let mut forward = Builder::new(config, &acts, options.packed);
        forward.forward(params);
        let forward = forward.steps.into_iter().filter_map(Step::into_launch);
        let mut backward = Builder::new(config, &acts, options.packed);
        backward.backward(params);
        let plan = Plan {
            batch,
            seq,
            acts_len: acts.len,
            forward: forward.collect(),
            backward: backward.steps,
            loss: acts.loss.clone(),
            f32_acts: acts.f32_acts(),
        };
        Ok(LlamaPlan { acts, plan })
    }
}

/// The sizes of one matmul: `c` input features, `oc` output features.
type Features = (usize, usize);

/// Builds the launches. Each layer's forward and backward take the same arguments (the ranges of
/// the forward's activations and parameters); backward reads and adds to the gradients at the same
/// ranges of the activation-gradient and gradient buffers.
#[derive(Debug)]
pub struct Builder<'a> {
    config: &'a LlamaConfig,
    acts: &'a ActLayout,
    /// Whether the rows are packed: the rotation and the attention read the tokens' positions.
    packed: bool,
    pub steps: Vec<Step<LlamaKernel>>,
}

impl<'a> Builder<'a> {
    /// A builder of the plan over `acts`, for packed rows where `packed` says.
    pub fn new(config: &'a LlamaConfig, acts: &'a ActLayout, packed: bool) -> Self {
        Builder { config, acts, packed, steps: Vec::new() }
    }

    /// A builder of the same model with no steps yet.
    fn sub(&self) -> Self {
        Builder::new(self.config, self.acts, self.packed)
    }

    /// `args` and, in a packed plan, the tokens' positions last.
    fn with_positions(&self, mut args: Vec<Arg>) -> Vec<Arg> {
        if self.packed {
            args.push(read(Buf::Positions, &self.tokens()));
        }
        args
    }

    fn launch(&mut self, kernel: Kernel, args: Vec<Arg>) {
        self.steps.push(Step::Launch(Launch { kernel, args }));
    }

    fn layer_kernel(&mut self, kernel: LlamaKernel, args: Vec<Arg>) {
        self.launch(Kernel::Layer(kernel), args);
    }

    fn tokens(&self) -> Range<usize> {
        0..self.acts.batch * self.acts.seq
    }

    fn forward(&mut self, p: &ParamRanges) {
        let (a, d, vocab) = (self.acts, self.config.hidden_size, self.config.vocab_size);
        let tokens = self.tokens();
        self.layer_kernel(
            LlamaKernel::Embedding { c: d, vocab },
            vec![write(A, &a.embedded), read(Buf::Inputs, &tokens), read(P, &p.embed)],
        );
        for (layer, (lp, la)) in p.layers.iter().zip(&a.layers).enumerate() {
            self.layer_forward(a.residual_in(layer), lp, la);
        }
        let last = a.residual_in(self.config.num_hidden_layers);
        self.rmsnorm(&a.norm, &a.norm_rstd, last, &p.norm, d);
        self.matmul(&a.logits, &a.norm, p.head(), None, (d, vocab));
        self.launch(
            Kernel::SoftmaxXent { vocab, padded_vocab: vocab },
            vec![
                write(A, &a.probs),
                write(A, &a.losses),
                read(A, &a.logits),
                read(Buf::Targets, &tokens),
            ],
        );
        self.launch(
            Kernel::MeanLoss,
            vec![write(A, &a.loss), read(A, &a.losses), read(Buf::Targets, &tokens)],
        );
    }

    fn backward(&mut self, p: &ParamRanges) {
        let (a, d, vocab) = (self.acts, self.config.hidden_size, self.config.vocab_size);
        let tokens = self.tokens();
        let mut groups = p.grad_groups().into_iter().map(Step::GradsReady);
        let mut ready = |steps: &mut Vec<Step<LlamaKernel>>| steps.extend(groups.next());
        self.launch(
            Kernel::SoftmaxXentBackward {
                vocab,
                padded_vocab: vocab,
                dloss: 1.0 / tokens.len() as f64,
            },
            vec![update(AG, &a.logits), read(A, &a.probs), read(Buf::Targets, &tokens)],
        );
        self.matmul_backward(&a.logits, &a.norm, p.head(), None, (d, vocab));
        let last = a.residual_in(self.config.num_hidden_layers);
        self.rmsnorm_backward(&a.norm, &a.norm_rstd, last, &p.norm, d);
        ready(&mut self.steps);
        for (layer, (lp, la)) in p.layers.iter().zip(&a.layers).enumerate().rev() {
            let input = a.residual_in(layer);
            let (mut forward, mut backward) = (self.sub(), self.sub());
            forward.layer_forward(input, lp, la);
            backward.layer_backward(input, lp, la);
            let forward: Vec<_> = forward.steps.into_iter().filter_map(Step::into_launch).collect();
            // The last layer's internals are still in place: its forward wrote them last.
            let recompute = layer + 1 != self.config.num_hidden_layers;
            self.steps.extend(a.checkpointing.layer_backward(&forward, backward.steps, recompute));
            ready(&mut self.steps);
        }
        self.layer_kernel(
            LlamaKernel::EmbeddingBackward { c: d },
            vec![update(G, &p.embed), read(AG, &a.embedded), read(Buf::Inputs, &tokens)],
        );
        ready(&mut self.steps);
        let zero: Launch<LlamaKernel> = zero_accumulated_activation_grads(&self.steps);
        self.steps.insert(0, Step::Launch(zero));
    }

    /// One decoder layer's forward, reading the residual stream at `input`.
    pub fn layer_forward(&mut self, input: &Range<usize>, p: &LayerParams, a: &LayerActs) {
        let c = self.config;
        let (d, ffn, q_dim, kv_dim) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        self.rmsnorm(&a.input_norm, &a.input_rstd, input, &p.input_norm, d);
        self.matmul(&a.q, &a.input_norm, &p.q_weight, p.q_bias.as_ref(), (d, q_dim));
        self.matmul(&a.k, &a.input_norm, &p.k_weight, p.k_bias.as_ref(), (d, kv_dim));
        self.matmul(&a.v, &a.input_norm, &p.v_weight, p.v_bias.as_ref(), (d, kv_dim));
        let (q, k) = match (&a.qk_norm, &p.qk_norm) {
            (Some(norm), Some((q_weight, k_weight))) => {
                self.rmsnorm(&norm.q, &norm.q_rstd, &a.q, q_weight, c.head_dim);
                self.rmsnorm(&norm.k, &norm.k_rstd, &a.k, k_weight, c.head_dim);
                (&norm.q, &norm.k)
            }
            _ => (&a.q, &a.k),
        };
        let args = vec![write(A, &a.qkv), read(A, q), read(A, k), read(A, &a.v)];
        self.layer_kernel(LlamaKernel::Rope(self.rotary()), self.with_positions(args));
        let shape = self.attention_shape();
        match &a.attention {
            AttentionActs::Weights(att) => self.launch(
                Kernel::Attention(shape),
                self.with_positions(vec![write(A, &a.atty), write(A, att), read(A, &a.qkv)]),
            ),
            AttentionActs::LogSumExp(lse) => self.launch(
                Kernel::FlashAttention(shape),
                self.with_positions(vec![write(A, &a.atty), write(A, lse), read(A, &a.qkv)]),
            ),
        }
        self.matmul(&a.attn_out, &a.atty, &p.o_weight, p.o_bias.as_ref(), (q_dim, d));
        self.launch(
            Kernel::Residual,
            vec![write(A, &a.residual_mid), read(A, input), read(A, &a.attn_out)],
        );
        self.rmsnorm(&a.post_norm, &a.post_rstd, &a.residual_mid, &p.post_norm, d);
        self.matmul(&a.gate, &a.post_norm, &p.gate, None, (d, ffn));
        self.matmul(&a.up, &a.post_norm, &p.up, None, (d, ffn));
        let args = vec![write(A, &a.swiglu), read(A, &a.gate), read(A, &a.up)];
        self.layer_kernel(LlamaKernel::SwiGlu, args);
        self.matmul(&a.mlp_out, &a.swiglu, &p.down, None, (ffn, d));
        self.launch(
            Kernel::Residual,
            vec![write(A, &a.residual_out), read(A, &a.residual_mid), read(A, &a.mlp_out)],
        );
    }

    /// [`Builder::layer_forward`] in reverse, with the same arguments.
    pub fn layer_backward(&mut self, input: &Range<usize>, p: &LayerParams, a: &LayerActs) {
        let c = self.config;
        let (d, ffn, q_dim, kv_dim) = (c.hidden_size, c.intermediate_size, c.q_dim(), c.kv_dim());
        self.residual_backward(&a.residual_out, &a.residual_mid, &a.mlp_out);
        self.matmul_backward(&a.mlp_out, &a.swiglu, &p.down, None, (ffn, d));
        let args = vec![
            update(AG, &a.gate),
            update(AG, &a.up),
            read(AG, &a.swiglu),
            read(A, &a.gate),
            read(A, &a.up),
        ];
        self.layer_kernel(LlamaKernel::SwiGluBackward, args);
        self.matmul_backward(&a.up, &a.post_norm, &p.up, None, (d, ffn));
        self.matmul_backward(&a.gate, &a.post_norm, &p.gate, None, (d, ffn));
        self.rmsnorm_backward(&a.post_norm, &a.post_rstd, &a.residual_mid, &p.post_norm, d);
        self.residual_backward(&a.residual_mid, input, &a.attn_out);
        self.matmul_backward(&a.attn_out, &a.atty, &p.o_weight, p.o_bias.as_ref(), (q_dim, d));
        let shape = self.attention_shape();
        match &a.attention {
            AttentionActs::Weights(att) => self.launch(
                Kernel::AttentionBackward(shape),
                self.with_positions(vec![
                    update(AG, &a.qkv),
                    write(AG, att),
                    read(AG, &a.atty),
                    read(A, &a.qkv),
                    read(A, att),
                ]),
            ),
            AttentionActs::LogSumExp(lse) => self.launch(
                Kernel::FlashAttentionBackward(shape),
                self.with_positions(vec![
                    update(AG, &a.qkv),
                    read(AG, &a.atty),
                    read(A, &a.qkv),
                    read(A, &a.atty),
                    read(A, lse),
                ]),
            ),
        }
        let (q, k) = match &a.qk_norm {
            Some(norm) => (&norm.q, &norm.k),
            None => (&a.q, &a.k),
        };
        let args = vec![update(AG, q), update(AG, k), update(AG, &a.v), read(AG, &a.qkv)];
        self.layer_kernel(LlamaKernel::RopeBackward(self.rotary()), self.with_positions(args));
        if let (Some(norm), Some((q_weight, k_weight))) = (&a.qk_norm, &p.qk_norm) {
            self.rmsnorm_backward(&norm.k, &norm.k_rstd, &a.k, k_weight, c.head_dim);
            self.rmsnorm_backward(&norm.q, &norm.q_rstd, &a.q, q_weight, c.head_dim);
        }
        self.matmul_backward(&a.v, &a.input_norm, &p.v_weight, p.v_bias.as_ref(), (d, kv_dim));
        self.matmul_backward(&a.k, &a.input_norm, &p.k_weight, p.k_bias.as_ref(), (d, kv_dim));
        self.matmul_backward(&a.q, &a.input_norm, &p.q_weight, p.q_bias.as_ref(), (d, q_dim));
        self.rmsnorm_backward(&a.input_norm, &a.input_rstd, input, &p.input_norm, d);
    }

    /// Grouped-query attention over `n_head · head_dim` query channels.
    fn attention_shape(&self) -> AttentionShape {
        let c = self.config;
        AttentionShape {
            t: self.acts.seq,
            c: c.q_dim(),
            n_head: c.num_attention_heads,
            n_kv_head: c.num_key_value_heads,
        }
    }

    fn rotary(&self) -> Rotary {
        let c = self.config;
        Rotary {
            t: self.acts.seq,
            n_head: c.num_attention_heads,
            n_kv_head: c.num_key_value_heads,
            freqs: RopeFreqs {
                head_dim: c.head_dim,
                theta: c.rope_theta,
                scaling: c.rope_scaling.clone(),
            },
        }
    }

    /// `out = rmsnorm(inp) · weight` over rows of width `c`.
    fn rmsnorm(
        &mut self,
        out: &Range<usize>,
        rstd: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        c: usize,
    ) {
        let args = vec![write(A, out), write(A, rstd), read(A, inp), read(P, weight)];
        self.layer_kernel(LlamaKernel::RmsNorm { c, eps: self.config.rms_norm_eps }, args);
    }

    fn rmsnorm_backward(
        &mut self,
        out: &Range<usize>,
        rstd: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        c: usize,
    ) {
        let args = vec![
            update(AG, inp),
            update(G, weight),
            read(AG, out),
            read(A, inp),
            read(P, weight),
            read(A, rstd),
        ];
        self.layer_kernel(LlamaKernel::RmsNormBackward { c }, args);
    }

    /// `out = inp @ weightᵀ + bias`, the weight `[oc, c]` as `nn.Linear` holds it.
    fn matmul(
        &mut self,
        out: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        bias: Option<&Range<usize>>,
        (c, oc): Features,
    ) {
        let mut args = vec![write(A, out), read(A, inp), read(P, weight)];
        args.extend(bias.map(|b| read(P, b)));
        let layout = WeightLayout::OutIn;
        self.launch(Kernel::Matmul { c, oc, layout, bias: bias.is_some() }, args);
    }

    fn matmul_backward(
        &mut self,
        out: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        bias: Option<&Range<usize>>,
        (c, oc): Features,
    ) {
        let mut args = vec![update(AG, inp), update(G, weight)];
        args.extend(bias.map(|b| update(G, b)));
        args.extend([read(AG, out), read(A, inp), read(P, weight)]);
        let layout = WeightLayout::OutIn;
        self.launch(Kernel::MatmulBackward { c, oc, layout, bias: bias.is_some() }, args);
    }

    fn residual_backward(&mut self, out: &Range<usize>, a: &Range<usize>, b: &Range<usize>) {
        self.launch(Kernel::ResidualBackward, vec![update(AG, a), update(AG, b), read(AG, out)]);
    }
}
