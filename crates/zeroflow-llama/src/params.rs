//! The parameters of a Llama-family model under Hugging Face's names and shapes, in the order of
//! `transformers`' `state_dict`.
//!
//! ## Layout and ZenFlow's columns
//!
//! Weights are in `nn.Linear`'s `[out_features, in_features]` layout, row-major, as the
//! safetensors files hold them; `y = x Wᵀ`. GPT-2's `Conv1D` weights are the transpose,
//! `[in, out]`.
//!
//! ZenFlow ranks a weight's columns by the L1 norm of their gradient and updates the top ones on
//! the device. Which axis is "a column" is what [`HfParam::split_axis`] records, and it is axis 1
//! of the tensor as PyTorch holds it (`W[:, j]`, the last axis in row-major order) for every 2-D
//! parameter. That is DeepSpeed's ZenFlow convention, the peer zeroflow is measured against:
//! `zenflow_stage_1_and_2.py` takes `num_row, num_col = param.shape` and flattens 2-D tensors
//! transposed so that each `W[:, j]` is contiguous, then sums `|g|` over each of them. For GPT-2's
//! `Conv1D [in, out]` that axis is the output features (zeroflow's convention today); for
//! `nn.Linear [out, in]` it is the *input* features: a column `W[:, j]` holds every weight that
//! reads input feature `j`, and its gradient `Σ_t g_t x_t[j]` is large where that input channel
//! is (LLMs' activation outlier channels are such inputs). So the engine's existing rule (columns
//! are the last dimension of the row-major tensor) already agrees with DeepSpeed on `[out, in]`
//! weights stored as HF stores them; [`HfParam::output_axis`] is recorded beside it for a
//! selection by output features instead.

use crate::config::LlamaConfig;

/// What a parameter is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// `model.embed_tokens.weight`, `[vocab, hidden]`.
    Embedding,
    /// An `nn.Linear` weight, `[out, in]` (`lm_head.weight` included).
    Linear,
    /// An `nn.Linear` bias, `[out]`.
    Bias,
    /// An RMSNorm weight (`[hidden]`, or `[head_dim]` for Qwen3's q/k norms).
    Norm,
}

/// One parameter: Hugging Face name, shape, and which axes mean what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HfParam {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    /// The axis of the output features: 0 for a linear `[out, in]` weight (and `lm_head`), 1 for
    /// the embedding `[vocab, hidden]` (each row is a token's hidden vector), 0 for 1-D parameters.
    pub output_axis: usize,
    /// The axis whose indices are ZenFlow's columns (see the module documentation): 1 for every
    /// 2-D parameter, `None` for 1-D parameters (one column, always selected).
    pub split_axis: Option<usize>,
}

impl HfParam {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn new(name: String, shape: Vec<usize>, kind: ParamKind) -> HfParam {
        let two_d = shape.len() == 2;
        let output_axis = match kind {
            ParamKind::Embedding => 1,
            ParamKind::Linear | ParamKind::Bias | ParamKind::Norm => 0,
        };
        HfParam { name, shape, kind, output_axis, split_axis: two_d.then_some(1) }
    }
}

/// Every parameter of `config`, in `transformers`' `state_dict` order: the embedding, each
/// layer's attention (q, k, v, o, then Qwen3's q/k norms), MLP (gate, up, down) and norms, the
/// final norm, and `lm_head.weight` unless the embeddings are tied.
pub fn hf_params(config: &LlamaConfig) -> Vec<HfParam> {
    let (d, ffn, vocab) = (config.hidden_size, config.intermediate_size, config.vocab_size);
    let mut params = vec![HfParam::new(
        "model.embed_tokens.weight".into(),
        vec![vocab, d],
        ParamKind::Embedding,
    )];
    for layer in 0..config.num_hidden_layers {
        let name = |suffix: &str| format!("model.layers.{layer}.{suffix}");
        let bias = config.attention_bias;
        let mut linear = |module: &str, out: usize, input: usize, bias: bool| {
            let weight = HfParam::new(
                name(&format!("{module}.weight")),
                vec![out, input],
                ParamKind::Linear,
            );
            params.push(weight);
            if bias {
                params.push(HfParam::new(
                    name(&format!("{module}.bias")),
                    vec![out],
                    ParamKind::Bias,
                ));
            }
        };
        linear("self_attn.q_proj", config.q_dim(), d, bias.qkv);
        linear("self_attn.k_proj", config.kv_dim(), d, bias.qkv);
        linear("self_attn.v_proj", config.kv_dim(), d, bias.qkv);
        linear("self_attn.o_proj", d, config.q_dim(), bias.o);
        if config.qk_norm {
            for norm in ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] {
                push_norm(&mut params, name(norm), config.head_dim);
            }
        }
        let mut linear = |module: &str, out: usize, input: usize| {
            let weight = HfParam::new(
                name(&format!("{module}.weight")),
                vec![out, input],
                ParamKind::Linear,
            );
            params.push(weight);
        };
        linear("mlp.gate_proj", ffn, d);
        linear("mlp.up_proj", ffn, d);
        linear("mlp.down_proj", d, ffn);
        for norm in ["input_layernorm.weight", "post_attention_layernorm.weight"] {
            push_norm(&mut params, name(norm), d);
        }
    }
    params.push(HfParam::new("model.norm.weight".into(), vec![d], ParamKind::Norm));
    if !config.tie_word_embeddings {
        params.push(HfParam::new("lm_head.weight".into(), vec![vocab, d], ParamKind::Linear));
    }
    params
}

fn push_norm(params: &mut Vec<HfParam>, name: String, width: usize) {
    params.push(HfParam::new(name, vec![width], ParamKind::Norm));
}

/// The number of parameters (a tied `lm_head` counted once, as `transformers` counts them).
pub fn param_count(config: &LlamaConfig) -> u64 {
    hf_params(config).iter().map(|p| p.numel() as u64).sum()
}
