//! GPT-2 as a plan of zeroflow-nn: the activation layout for one (batch, sequence length), and the
//! forward and backward launches over the four flat buffers (parameters, gradients, activations,
//! activation gradients) and the two token buffers.
//!
//! zeroflow-nn's executors run the plan ([`zeroflow_nn::host::HostRunner`],
//! [`zeroflow_nn::cpu::CpuRunner`], [`zeroflow_nn::cuda::CudaRunner`]); GPT-2's own kernels
//! (LayerNorm, GELU) are [`GptKernel`]s in it.

use std::ops::Range;

use zeroflow_nn::plan::{
    ActAllocator, Buf, Launch, Step, read, update, write, zero_accumulated_activation_grads,
};
use zeroflow_nn::{AttentionKind, AttentionShape, Checkpointing, WeightLayout, layer_acts};

/// How a [`GptPlan`] is built (zeroflow-nn's options of every family's plan).
pub use zeroflow_nn::PlanOptions;

use crate::GptConfig;
use crate::error::GptError;
use crate::kernels::{GptKernel, Kernel};
use crate::params::{BlockParams, ParamRanges};

/// GPT-2's plan: zeroflow-nn's [`zeroflow_nn::Plan`] of [`GptKernel`]s.
pub type Plan = zeroflow_nn::Plan<GptKernel>;

/// What a block's attention keeps from forward for backward, as a range of the activation buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttentionActs {
    /// The weights `att [batch, n_head, seq, seq]` ([`AttentionKind::Gemm`]); at the same range of
    /// the activation-gradient buffer, backward keeps the gradient of the scores (scratch).
    Weights(Range<usize>),
    /// The log-sum-exp `lse [batch, n_head, seq]` ([`AttentionKind::Flash`]); the CUDA model keeps
    /// it in f32 with the other statistics.
    LogSumExp(Range<usize>),
}

/// The activations of one block, as ranges of the activation buffer. With activation
/// checkpointing every block has the same ranges, but for `residual3` (its output).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockActs {
    pub ln_1: Range<usize>,
    pub ln_1_mean: Range<usize>,
    pub ln_1_rstd: Range<usize>,
    pub qkv: Range<usize>,
    pub atty: Range<usize>,
    /// The weights or the log-sum-exp, by [`AttentionKind`].
    pub attention: AttentionActs,
    pub attproj: Range<usize>,
    pub residual2: Range<usize>,
    pub ln_2: Range<usize>,
    pub ln_2_mean: Range<usize>,
    pub ln_2_rstd: Range<usize>,
    pub fch: Range<usize>,
    pub fch_gelu: Range<usize>,
    pub fcproj: Range<usize>,
    pub residual3: Range<usize>,
}

/// Where every activation lives in the activation buffer, allocated once per (batch, seq).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActLayout {
    pub batch: usize,
    pub seq: usize,
    pub attention: AttentionKind,
    /// Whether the blocks' internals share one region, recomputed in backward.
    pub checkpointing: Checkpointing,
    pub encoded: Range<usize>,
    pub blocks: Vec<BlockActs>,
    pub ln_f: Range<usize>,
    pub ln_f_mean: Range<usize>,
    pub ln_f_rstd: Range<usize>,
    /// `[batch, seq, padded_vocab]`.
    pub logits: Range<usize>,
    pub probs: Range<usize>,
    /// Per-position losses `[batch, seq]`.
    pub losses: Range<usize>,
    /// The mean loss (one element).
    pub loss: Range<usize>,
    /// Length of the buffer.
    pub len: usize,
}

impl ActLayout {
    /// The layout of the plain plan (every block's activations its own) with `attention`.
    pub fn new(config: &GptConfig, batch: usize, seq: usize, attention: AttentionKind) -> Self {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(config, batch, seq, options)
    }

    /// The layout of the plan `options` say (with activation checkpointing, the blocks'
    /// internals in one shared region).
    pub fn with_options(
        config: &GptConfig,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Self {
        let (n, c, nh) = (batch * seq, config.d_model, config.n_head);
        let attention = options.attention;
        let mut bump = ActAllocator::default();
        let encoded = bump.take(n * c);
        let blocks =
            layer_acts(&mut bump, config.n_layer, options.activation_checkpointing, |acts| {
                BlockActs {
                    ln_1: acts.internal(n * c),
                    ln_1_mean: acts.internal(n),
                    ln_1_rstd: acts.internal(n),
                    qkv: acts.internal(n * 3 * c),
                    atty: acts.internal(n * c),
                    attention: match attention {
                        AttentionKind::Gemm => {
                            AttentionActs::Weights(acts.internal(batch * nh * seq * seq))
                        }
                        AttentionKind::Flash => {
                            AttentionActs::LogSumExp(acts.internal(batch * nh * seq))
                        }
                    },
                    attproj: acts.internal(n * c),
                    residual2: acts.internal(n * c),
                    ln_2: acts.internal(n * c),
                    ln_2_mean: acts.internal(n),
                    ln_2_rstd: acts.internal(n),
                    fch: acts.internal(n * 4 * c),
                    fch_gelu: acts.internal(n * 4 * c),
                    fcproj: acts.internal(n * c),
                    residual3: acts.kept(n * c),
                }
            });
        let (checkpointing, blocks) = (blocks.checkpointing, blocks.layers);
        let ln_f = bump.take(n * c);
        let ln_f_mean = bump.take(n);
        let ln_f_rstd = bump.take(n);
        let logits = bump.take(n * config.padded_vocab_size());
        let probs = bump.take(n * config.padded_vocab_size());
        let losses = bump.take(n);
        let loss = bump.take(1);
        let len = bump.len();
        ActLayout {
            batch,
            seq,
            attention,
            checkpointing,
            encoded,
            blocks,
            ln_f,
            ln_f_mean,
            ln_f_rstd,
            logits,
            probs,
            losses,
            loss,
            len,
        }
    }

    /// The residual stream entering block `layer`.
    fn residual_in(&self, layer: usize) -> Range<usize> {
        match layer {
            0 => self.encoded.clone(),
            _ => self.blocks[layer - 1].residual3.clone(),
        }
    }

    /// The activations kept in f32 on the GPU, in the order of its f32 buffer: each block's
    /// LayerNorm statistics (and flash attention's log-sum-exp; with checkpointing every block
    /// lists the same ranges, placed once), the final LayerNorm's, the losses and the mean loss.
    fn f32_acts(&self) -> Vec<Range<usize>> {
        let mut ranges = Vec::new();
        for block in &self.blocks {
            ranges.extend([&block.ln_1_mean, &block.ln_1_rstd, &block.ln_2_mean, &block.ln_2_rstd]);
            if let AttentionActs::LogSumExp(lse) = &block.attention {
                ranges.push(lse);
            }
        }
        ranges.extend([&self.ln_f_mean, &self.ln_f_rstd, &self.losses, &self.loss]);
        ranges.into_iter().cloned().collect()
    }
}

/// GPT-2's plan for one (batch, seq) and where its activations lie.
#[derive(Clone, Debug, PartialEq)]
pub struct GptPlan {
    pub acts: ActLayout,
    pub plan: Plan,
}

use Buf::{ActGrads as AG, Acts as A, Grads as G, Params as P};

impl GptPlan {
    /// The plan for micro-batches of `batch` sequences of `seq` tokens, with
    /// [`AttentionKind::Gemm`].
    pub fn new(
        config: &GptConfig,
        params: &ParamRanges,
        batch: usize,
        seq: usize,
    ) -> Result<GptPlan, GptError> {
        Self::with_attention(config, params, batch, seq, AttentionKind::Gemm)
    }

    /// The plan for micro-batches of `batch` sequences of `seq` tokens whose attention keeps what
    /// `attention` says.
    pub fn with_attention(
        config: &GptConfig,
        params: &ParamRanges,
        batch: usize,
        seq: usize,
        attention: AttentionKind,
    ) -> Result<GptPlan, GptError> {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(config, params, batch, seq, options)
    }

    /// The plan for micro-batches of `batch` sequences of `seq` tokens, built as `options` say.
    pub fn with_options(
        config: &GptConfig,
        params: &ParamRanges,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Result<GptPlan, GptError> {
        if batch == 0 || seq == 0 || seq > config.context {
            return Err(GptError::Batch(format!(
                "batch {batch} × seq {seq}: both must be at least 1 and seq at most the context {}",
                config.context
            )));
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
        Ok(GptPlan { acts, plan })
    }
}

/// Builds the launches. Each layer's forward and backward take the same arguments (the ranges of
/// the forward's activations and parameters); backward reads and adds to the gradients at the same
/// ranges of the activation-gradient and gradient buffers, as in llm.c.
struct Builder<'a> {
    config: &'a GptConfig,
    acts: &'a ActLayout,
    /// Whether the rows are packed: the encoder and the attention read the tokens' positions.
    packed: bool,
    steps: Vec<Step<GptKernel>>,
}

impl<'a> Builder<'a> {
    fn new(config: &'a GptConfig, acts: &'a ActLayout, packed: bool) -> Self {
        Builder { config, acts, packed, steps: Vec::new() }
    }

    /// A builder of the same model with no steps yet.
    fn sub(&self) -> Self {
        Builder::new(self.config, self.acts, self.packed)
    }

    /// `args` and, in a packed plan, the tokens' positions last.
    fn with_positions(&self, mut args: Vec<zeroflow_nn::Arg>) -> Vec<zeroflow_nn::Arg> {
        if self.packed {
            args.push(read(Buf::Positions, &self.tokens()));
        }
        args
    }

    fn launch(&mut self, kernel: Kernel, args: Vec<zeroflow_nn::Arg>) {
        self.steps.push(Step::Launch(Launch { kernel, args }));
    }

    fn tokens(&self) -> Range<usize> {
        0..self.acts.batch * self.acts.seq
    }

    /// The rows of the position embedding that a sequence uses.
    fn wpe_rows(&self, p: &ParamRanges) -> Range<usize> {
        p.wpe.start..p.wpe.start + self.acts.seq * self.config.d_model
    }

    fn forward(&mut self, p: &ParamRanges) {
        let (a, c) = (self.acts, self.config.d_model);
        let (wpe, tokens) = (self.wpe_rows(p), self.tokens());
        let (t, vocab) = (a.seq, self.config.vocab_size);
        let args =
            vec![write(A, &a.encoded), read(Buf::Inputs, &tokens), read(P, &p.wte), read(P, &wpe)];
        self.launch(Kernel::Encoder { t, c, vocab }, self.with_positions(args));
        for (layer, (bp, ba)) in p.blocks.iter().zip(&a.blocks).enumerate() {
            self.block_forward(&a.residual_in(layer), bp, ba);
        }
        let last = a.residual_in(self.config.n_layer);
        self.layernorm(&a.ln_f, &a.ln_f_mean, &a.ln_f_rstd, &last, &p.ln_f_weight, &p.ln_f_bias);
        let padded_vocab = self.config.padded_vocab_size();
        self.matmul(&a.logits, &a.ln_f, &p.wte, None, (c, padded_vocab), WeightLayout::OutIn);
        self.launch(
            Kernel::SoftmaxXent { vocab, padded_vocab },
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
        let (a, c) = (self.acts, self.config.d_model);
        let (wpe, tokens) = (self.wpe_rows(p), self.tokens());
        let mut groups = p.grad_groups().into_iter().map(Step::GradsReady);
        let mut ready = |steps: &mut Vec<Step<GptKernel>>| steps.extend(groups.next());
        let (vocab, padded_vocab) = (self.config.vocab_size, self.config.padded_vocab_size());
        self.launch(
            Kernel::SoftmaxXentBackward { vocab, padded_vocab, dloss: 1.0 / tokens.len() as f64 },
            vec![update(AG, &a.logits), read(A, &a.probs), read(Buf::Targets, &tokens)],
        );
        self.matmul_backward(
            &a.logits,
            &a.ln_f,
            &p.wte,
            None,
            (c, padded_vocab),
            WeightLayout::OutIn,
        );
        let last = a.residual_in(self.config.n_layer);
        let (w, b) = (&p.ln_f_weight, &p.ln_f_bias);
        self.layernorm_backward(&a.ln_f, &a.ln_f_mean, &a.ln_f_rstd, &last, w, b);
        ready(&mut self.steps);
        for (layer, (bp, ba)) in p.blocks.iter().zip(&a.blocks).enumerate().rev() {
            let residual = a.residual_in(layer);
            let (mut forward, mut backward) = (self.sub(), self.sub());
            forward.block_forward(&residual, bp, ba);
            backward.block_backward(&residual, bp, ba);
            let forward: Vec<_> = forward.steps.into_iter().filter_map(Step::into_launch).collect();
            // The last block's internals are still in place: its forward wrote them last.
            let recompute = layer + 1 != self.config.n_layer;
            let steps = a.checkpointing.layer_backward(&forward, backward.steps, recompute);
            self.steps.extend(steps);
            ready(&mut self.steps);
        }
        let args = vec![
            update(G, &p.wte),
            update(G, &wpe),
            read(AG, &a.encoded),
            read(Buf::Inputs, &tokens),
        ];
        self.launch(Kernel::EncoderBackward { t: a.seq, c }, self.with_positions(args));
        ready(&mut self.steps);
        self.zero_accumulated_activation_grads();
    }

    /// Puts first a launch that zeroes every activation gradient that backward adds to (and no
    /// other: the gradients of the softmax output, the attention weights, the log-sum-exp and the
    /// LayerNorm statistics are never formed).
    fn zero_accumulated_activation_grads(&mut self) {
        let zero: Launch<GptKernel> = zero_accumulated_activation_grads(&self.steps);
        self.steps.insert(0, Step::Launch(zero));
    }

    fn block_forward(&mut self, residual: &Range<usize>, p: &BlockParams, a: &BlockActs) {
        let c = self.config.d_model;
        let conv = WeightLayout::InOut;
        self.layernorm(&a.ln_1, &a.ln_1_mean, &a.ln_1_rstd, residual, &p.ln_1_weight, &p.ln_1_bias);
        self.matmul(&a.qkv, &a.ln_1, &p.c_attn_weight, Some(&p.c_attn_bias), (c, 3 * c), conv);
        match &a.attention {
            AttentionActs::Weights(att) => self.attention(&a.atty, att, &a.qkv),
            AttentionActs::LogSumExp(lse) => self.flash_attention(&a.atty, lse, &a.qkv),
        }
        let (w, b) = (&p.attn_c_proj_weight, &p.attn_c_proj_bias);
        self.matmul(&a.attproj, &a.atty, w, Some(b), (c, c), conv);
        self.residual(&a.residual2, residual, &a.attproj);
        self.layernorm(
            &a.ln_2,
            &a.ln_2_mean,
            &a.ln_2_rstd,
            &a.residual2,
            &p.ln_2_weight,
            &p.ln_2_bias,
        );
        self.matmul(&a.fch, &a.ln_2, &p.c_fc_weight, Some(&p.c_fc_bias), (c, 4 * c), conv);
        self.gelu(&a.fch_gelu, &a.fch);
        let (w, b) = (&p.mlp_c_proj_weight, &p.mlp_c_proj_bias);
        self.matmul(&a.fcproj, &a.fch_gelu, w, Some(b), (4 * c, c), conv);
        self.residual(&a.residual3, &a.residual2, &a.fcproj);
    }

    /// [`Builder::block_forward`] in reverse, with the same arguments.
    fn block_backward(&mut self, residual: &Range<usize>, p: &BlockParams, a: &BlockActs) {
        let c = self.config.d_model;
        let conv = WeightLayout::InOut;
        self.residual_backward(&a.residual3, &a.residual2, &a.fcproj);
        let (w, b) = (&p.mlp_c_proj_weight, &p.mlp_c_proj_bias);
        self.matmul_backward(&a.fcproj, &a.fch_gelu, w, Some(b), (4 * c, c), conv);
        self.gelu_backward(&a.fch_gelu, &a.fch);
        self.matmul_backward(&a.fch, &a.ln_2, &p.c_fc_weight, Some(&p.c_fc_bias), (c, 4 * c), conv);
        let (w, b) = (&p.ln_2_weight, &p.ln_2_bias);
        self.layernorm_backward(&a.ln_2, &a.ln_2_mean, &a.ln_2_rstd, &a.residual2, w, b);
        self.residual_backward(&a.residual2, residual, &a.attproj);
        let (w, b) = (&p.attn_c_proj_weight, &p.attn_c_proj_bias);
        self.matmul_backward(&a.attproj, &a.atty, w, Some(b), (c, c), conv);
        match &a.attention {
            AttentionActs::Weights(att) => self.attention_backward(&a.atty, att, &a.qkv),
            AttentionActs::LogSumExp(lse) => self.flash_attention_backward(&a.atty, lse, &a.qkv),
        }
        let (w, b) = (&p.c_attn_weight, &p.c_attn_bias);
        self.matmul_backward(&a.qkv, &a.ln_1, w, Some(b), (c, 3 * c), conv);
        let (w, b) = (&p.ln_1_weight, &p.ln_1_bias);
        self.layernorm_backward(&a.ln_1, &a.ln_1_mean, &a.ln_1_rstd, residual, w, b);
    }

    fn layernorm(
        &mut self,
        out: &Range<usize>,
        mean: &Range<usize>,
        rstd: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        bias: &Range<usize>,
    ) {
        let args = vec![
            write(A, out),
            write(A, mean),
            write(A, rstd),
            read(A, inp),
            read(P, weight),
            read(P, bias),
        ];
        self.launch(Kernel::Layer(GptKernel::LayerNorm { c: self.config.d_model }), args);
    }

    fn layernorm_backward(
        &mut self,
        out: &Range<usize>,
        mean: &Range<usize>,
        rstd: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        bias: &Range<usize>,
    ) {
        let args = vec![
            update(AG, inp),
            update(G, weight),
            update(G, bias),
            read(AG, out),
            read(A, inp),
            read(P, weight),
            read(A, mean),
            read(A, rstd),
        ];
        self.launch(Kernel::Layer(GptKernel::LayerNormBackward { c: self.config.d_model }), args);
    }

    /// `out = inp @ weight + bias` with `inp` of width `c` and `out` of width `oc`.
    fn matmul(
        &mut self,
        out: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        bias: Option<&Range<usize>>,
        (c, oc): (usize, usize),
        layout: WeightLayout,
    ) {
        let mut args = vec![write(A, out), read(A, inp), read(P, weight)];
        args.extend(bias.map(|b| read(P, b)));
        self.launch(Kernel::Matmul { c, oc, layout, bias: bias.is_some() }, args);
    }

    fn matmul_backward(
        &mut self,
        out: &Range<usize>,
        inp: &Range<usize>,
        weight: &Range<usize>,
        bias: Option<&Range<usize>>,
        (c, oc): (usize, usize),
        layout: WeightLayout,
    ) {
        let mut args = vec![update(AG, inp), update(G, weight)];
        args.extend(bias.map(|b| update(G, b)));
        args.extend([read(AG, out), read(A, inp), read(P, weight)]);
        self.launch(Kernel::MatmulBackward { c, oc, layout, bias: bias.is_some() }, args);
    }

    /// GPT-2's attention: multi-head, as many key/value heads as query heads.
    fn attention_shape(&self) -> AttentionShape {
        AttentionShape::multi_head(self.acts.seq, self.config.d_model, self.config.n_head)
    }

    fn attention(&mut self, out: &Range<usize>, att: &Range<usize>, qkv: &Range<usize>) {
        let args = self.with_positions(vec![write(A, out), write(A, att), read(A, qkv)]);
        self.launch(Kernel::Attention(self.attention_shape()), args);
    }

    fn attention_backward(&mut self, out: &Range<usize>, att: &Range<usize>, qkv: &Range<usize>) {
        let args = vec![update(AG, qkv), write(AG, att), read(AG, out), read(A, qkv), read(A, att)];
        let args = self.with_positions(args);
        self.launch(Kernel::AttentionBackward(self.attention_shape()), args);
    }

    fn flash_attention(&mut self, out: &Range<usize>, lse: &Range<usize>, qkv: &Range<usize>) {
        let args = self.with_positions(vec![write(A, out), write(A, lse), read(A, qkv)]);
        self.launch(Kernel::FlashAttention(self.attention_shape()), args);
    }

    fn flash_attention_backward(
        &mut self,
        out: &Range<usize>,
        lse: &Range<usize>,
        qkv: &Range<usize>,
    ) {
        let args = vec![update(AG, qkv), read(AG, out), read(A, qkv), read(A, out), read(A, lse)];
        let args = self.with_positions(args);
        self.launch(Kernel::FlashAttentionBackward(self.attention_shape()), args);
    }

    fn gelu(&mut self, out: &Range<usize>, inp: &Range<usize>) {
        self.launch(Kernel::Layer(GptKernel::Gelu), vec![write(A, out), read(A, inp)]);
    }

    fn gelu_backward(&mut self, out: &Range<usize>, inp: &Range<usize>) {
        let args = vec![update(AG, inp), read(A, inp), read(AG, out)];
        self.launch(Kernel::Layer(GptKernel::GeluBackward), args);
    }

    fn residual(&mut self, out: &Range<usize>, a: &Range<usize>, b: &Range<usize>) {
        self.launch(Kernel::Residual, vec![write(A, out), read(A, a), read(A, b)]);
    }

    fn residual_backward(&mut self, out: &Range<usize>, a: &Range<usize>, b: &Range<usize>) {
        self.launch(Kernel::ResidualBackward, vec![update(AG, a), update(AG, b), read(AG, out)]);
    }
}
