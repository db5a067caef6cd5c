//! Where every activation of a Llama-family model lives in the activation buffer, for one
//! (batch, sequence length). With activation checkpointing ([`PlanOptions`]) every layer's
//! activations but its output are *internal* and share one region ([`zeroflow_nn::checkpoint`]).

use std::ops::Range;

use zeroflow_nn::plan::ActAllocator;
use zeroflow_nn::{AttentionKind, Checkpointing, LayerAllocator, layer_acts};

use crate::config::LlamaConfig;
use crate::plan::PlanOptions;

/// What a layer's attention keeps from forward for backward, as a range of the activation buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttentionActs {
    /// The weights `att [batch, n_head, seq, seq]` ([`AttentionKind::Gemm`]); at the same range of
    /// the activation-gradient buffer, backward keeps the gradient of the scores (scratch).
    Weights(Range<usize>),
    /// The log-sum-exp `lse [batch, n_head, seq]` ([`AttentionKind::Flash`]).
    LogSumExp(Range<usize>),
}

/// Qwen3's per-head norms of the queries and keys: the normed heads and one `rstd` per head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QkNormActs {
    /// `[n, n_head · head_dim]`.
    pub q: Range<usize>,
    /// `[n · n_head]`.
    pub q_rstd: Range<usize>,
    /// `[n, n_kv_head · head_dim]`.
    pub k: Range<usize>,
    /// `[n · n_kv_head]`.
    pub k_rstd: Range<usize>,
}

/// The activations of one decoder layer (`n = batch · seq` token rows). With activation
/// checkpointing every layer has the same ranges, but for `residual_out` (its output).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerActs {
    /// `input_layernorm`'s output `[n, hidden]` and `rstd [n]`.
    pub input_norm: Range<usize>,
    pub input_rstd: Range<usize>,
    /// The projections `[n, n_head · head_dim]`, `[n, kv]`, `[n, kv]` (biases added).
    pub q: Range<usize>,
    pub k: Range<usize>,
    pub v: Range<usize>,
    pub qk_norm: Option<QkNormActs>,
    /// Attention's input `[n, (n_head + 2 n_kv_head) · head_dim]`: rotated q and k, and v.
    pub qkv: Range<usize>,
    pub attention: AttentionActs,
    /// Attention's output `[n, n_head · head_dim]`.
    pub atty: Range<usize>,
    /// `o_proj`'s output `[n, hidden]`.
    pub attn_out: Range<usize>,
    /// The residual stream after attention `[n, hidden]`.
    pub residual_mid: Range<usize>,
    pub post_norm: Range<usize>,
    pub post_rstd: Range<usize>,
    /// `[n, intermediate]` each.
    pub gate: Range<usize>,
    pub up: Range<usize>,
    pub swiglu: Range<usize>,
    /// `down_proj`'s output `[n, hidden]`.
    pub mlp_out: Range<usize>,
    /// The residual stream leaving the layer `[n, hidden]`.
    pub residual_out: Range<usize>,
}

/// Where every activation lives, allocated once per (batch, seq).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ActLayout {
    pub batch: usize,
    pub seq: usize,
    pub attention: AttentionKind,
    /// Whether the layers' internals share one region, recomputed in backward.
    pub checkpointing: Checkpointing,
    /// The token embeddings `[n, hidden]`.
    pub embedded: Range<usize>,
    pub layers: Vec<LayerActs>,
    pub norm: Range<usize>,
    pub norm_rstd: Range<usize>,
    /// `[batch, seq, vocab]`.
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
    /// The layout of the plain plan (every layer's activations its own) with `attention`.
    pub fn new(config: &LlamaConfig, batch: usize, seq: usize, attention: AttentionKind) -> Self {
        let options = PlanOptions { attention, ..PlanOptions::default() };
        Self::with_options(config, batch, seq, options)
    }

    /// The layout of the plan `options` say (with activation checkpointing, the layers'
    /// internals in one shared region).
    pub fn with_options(
        config: &LlamaConfig,
        batch: usize,
        seq: usize,
        options: PlanOptions,
    ) -> Self {
        let (n, attention) = (batch * seq, options.attention);
        let mut bump = ActAllocator::default();
        let embedded = bump.take(n * config.hidden_size);
        let layers = layer_acts(
            &mut bump,
            config.num_hidden_layers,
            options.activation_checkpointing,
            |acts| layer(config, acts, batch, seq, attention),
        );
        let (checkpointing, layers) = (layers.checkpointing, layers.layers);
        let norm = bump.take(n * config.hidden_size);
        let norm_rstd = bump.take(n);
        let logits = bump.take(n * config.vocab_size);
        let probs = bump.take(n * config.vocab_size);
        let losses = bump.take(n);
        let loss = bump.take(1);
        let len = bump.len();
        ActLayout {
            batch,
            seq,
            attention,
            checkpointing,
            embedded,
            layers,
            norm,
            norm_rstd,
            logits,
            probs,
            losses,
            loss,
            len,
        }
    }

    /// The residual stream entering layer `layer` (the embeddings for the first; the last
    /// layer's output for `layer == num_hidden_layers`).
    pub fn residual_in(&self, layer: usize) -> &Range<usize> {
        match layer {
            0 => &self.embedded,
            _ => &self.layers[layer - 1].residual_out,
        }
    }

    /// The activations kept in f32 on the GPU, in the order of its f32 buffer: each layer's
    /// norm statistics (and flash attention's log-sum-exp; with checkpointing every layer lists
    /// the same ranges, placed once), the final norm's, the losses and the mean loss.
    pub fn f32_acts(&self) -> Vec<Range<usize>> {
        let mut ranges = Vec::new();
        for layer in &self.layers {
            ranges.push(&layer.input_rstd);
            if let Some(norm) = &layer.qk_norm {
                ranges.extend([&norm.q_rstd, &norm.k_rstd]);
            }
            if let AttentionActs::LogSumExp(lse) = &layer.attention {
                ranges.push(lse);
            }
            ranges.push(&layer.post_rstd);
        }
        ranges.extend([&self.norm_rstd, &self.losses, &self.loss]);
        ranges.into_iter().cloned().collect()
    }
}

/// One layer's activations: its output kept, the rest internal (in the order of its forward).
fn layer(
    config: &LlamaConfig,
    acts: &mut LayerAllocator<'_>,
    batch: usize,
    seq: usize,
    attention: AttentionKind,
) -> LayerActs {
    let (n, d, ffn) = (batch * seq, config.hidden_size, config.intermediate_size);
    let (heads, kv_heads) = (config.num_attention_heads, config.num_key_value_heads);
    let (q_dim, kv_dim) = (config.q_dim(), config.kv_dim());
    let input_norm = acts.internal(n * d);
    let input_rstd = acts.internal(n);
    let (q, k, v) =
        (acts.internal(n * q_dim), acts.internal(n * kv_dim), acts.internal(n * kv_dim));
    let qk_norm = config.qk_norm.then(|| QkNormActs {
        q: acts.internal(n * q_dim),
        q_rstd: acts.internal(n * heads),
        k: acts.internal(n * kv_dim),
        k_rstd: acts.internal(n * kv_heads),
    });
    LayerActs {
        input_norm,
        input_rstd,
        q,
        k,
        v,
        qk_norm,
        qkv: acts.internal(n * (q_dim + 2 * kv_dim)),
        attention: match attention {
            AttentionKind::Gemm => AttentionActs::Weights(acts.internal(batch * heads * seq * seq)),
            AttentionKind::Flash => AttentionActs::LogSumExp(acts.internal(batch * heads * seq)),
        },
        atty: acts.internal(n * q_dim),
        attn_out: acts.internal(n * d),
        residual_mid: acts.internal(n * d),
        post_norm: acts.internal(n * d),
        post_rstd: acts.internal(n),
        gate: acts.internal(n * ffn),
        up: acts.internal(n * ffn),
        swiglu: acts.internal(n * ffn),
        mlp_out: acts.internal(n * d),
        residual_out: acts.kept(n * d),
    }
}
