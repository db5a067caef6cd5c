//! The Llama family's own kernels, beside zeroflow-nn's shared ones (matmul, attention with
//! `n_kv_head`, cross-entropy, residual): RMSNorm, rotary embeddings, SwiGLU and the token
//! embedding without positions, pure functions over slices generic over [`Float`], and
//! [`LlamaKernel`], their launches in the plan.
//!
//! Qwen3's per-head q/k norm is [`LlamaKernel::RmsNorm`] with `c = head_dim` over the queries
//! (or keys) as `tokens · heads` rows; the q, k and v projections are three matmuls whose outputs
//! [`LlamaKernel::Rope`] rotates and packs into attention's `qkv` row.

pub mod embedding;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;

use zeroflow_nn::{ArgSlices, Float, LayerKernel};

pub use rope::Rotary;

/// A launch of the plan: a shared kernel of zeroflow-nn or one of the Llama family's.
pub type Kernel = zeroflow_nn::Kernel<LlamaKernel>;

/// One launch of a Llama kernel and its sizes. The comment lists the arguments in order (W:
/// written, or for backward added to; R: read; T: token ids). Every backward kernel adds (`+=`)
/// to the gradients it writes.
#[derive(Clone, Debug, PartialEq)]
pub enum LlamaKernel {
    /// W out, T tokens, R wte: `out[row] = wte[tokens[row]]`, rows of width `c`, tokens below
    /// `vocab` ([`embedding::embedding_forward`]).
    Embedding { c: usize, vocab: usize },
    /// W dwte, R dout, T tokens ([`embedding::embedding_backward`]).
    EmbeddingBackward { c: usize },
    /// W out, W rstd, R inp, R weight: rows of width `c`, one `rstd` per row
    /// ([`rmsnorm::rmsnorm_forward`]).
    RmsNorm { c: usize, eps: f64 },
    /// W dinp, W dweight, R dout, R inp, R weight, R rstd ([`rmsnorm::rmsnorm_backward`]).
    RmsNormBackward { c: usize },
    /// W qkv, R q, R k, R v, [T positions]: `qkv = [rope(q) | rope(k) | v]` per token row
    /// ([`rope::rope_forward`]), each rotated by its position in its sequence, or with the
    /// positions of packed rows by its position in its document.
    Rope(Rotary),
    /// W dq, W dk, W dv, R dqkv, [T positions] ([`rope::rope_backward`]).
    RopeBackward(Rotary),
    /// W out, R gate, R up: `out = silu(gate) · up` ([`swiglu::swiglu_forward`]).
    SwiGlu,
    /// W dgate, W dup, R dout, R gate, R up ([`swiglu::swiglu_backward`]).
    SwiGluBackward,
}

impl LayerKernel for LlamaKernel {
    fn name(&self) -> &'static str {
        match self {
            LlamaKernel::Embedding { .. } => "embedding_forward",
            LlamaKernel::EmbeddingBackward { .. } => "embedding_backward",
            LlamaKernel::RmsNorm { .. } => "rmsnorm_forward",
            LlamaKernel::RmsNormBackward { .. } => "rmsnorm_backward",
            LlamaKernel::Rope(_) => "rope_forward",
            LlamaKernel::RopeBackward(_) => "rope_backward",
            LlamaKernel::SwiGlu => "swiglu_forward",
            LlamaKernel::SwiGluBackward => "swiglu_backward",
        }
    }

    fn run<F: Float>(&self, a: &mut ArgSlices<'_, F>) -> Result<(), String> {
        match *self {
            LlamaKernel::Embedding { c, vocab } => {
                let out = a.write(0);
                embedding::embedding_forward(out, a.tokens(1), a.read(2), c, vocab)?;
            }
            LlamaKernel::EmbeddingBackward { c } => {
                let dwte = a.write(0);
                embedding::embedding_backward(dwte, a.read(1), a.tokens(2), c);
            }
            LlamaKernel::RmsNorm { c, eps } => {
                let (out, rstd) = (a.write(0), a.write(1));
                rmsnorm::rmsnorm_forward(out, rstd, a.read(2), a.read(3), c, eps);
            }
            LlamaKernel::RmsNormBackward { c } => {
                let (dinp, dweight) = (a.write(0), a.write(1));
                let (dout, inp, weight, rstd) = (a.read(2), a.read(3), a.read(4), a.read(5));
                rmsnorm::rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, c);
            }
            LlamaKernel::Rope(ref shape) => {
                let qkv = a.write(0);
                let (q, k, v) = (a.read(1), a.read(2), a.read(3));
                match a.optional_tokens(4) {
                    None => rope::rope_forward(qkv, q, k, v, shape),
                    Some(positions) => {
                        let position = |row: usize| positions[row] as usize;
                        rope::rope_forward_at(qkv, q, k, v, shape, position);
                    }
                }
            }
            LlamaKernel::RopeBackward(ref shape) => {
                let (dq, dk, dv) = (a.write(0), a.write(1), a.write(2));
                match a.optional_tokens(4) {
                    None => rope::rope_backward(dq, dk, dv, a.read(3), shape),
                    Some(positions) => {
                        let position = |row: usize| positions[row] as usize;
                        rope::rope_backward_at(dq, dk, dv, a.read(3), shape, position);
                    }
                }
            }
            LlamaKernel::SwiGlu => swiglu::swiglu_forward(a.write(0), a.read(1), a.read(2)),
            LlamaKernel::SwiGluBackward => {
                let (dgate, dup) = (a.write(0), a.write(1));
                swiglu::swiglu_backward(dgate, dup, a.read(2), a.read(3), a.read(4));
            }
        }
        Ok(())
    }
}
