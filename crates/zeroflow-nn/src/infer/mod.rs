//! Inference over any model family: the key/value cache ([`kv_cache`]), the family-neutral
//! [`Decoder`] a family's cached forward implements, sampling and [`generate`] ([`sample`]),
//! and the loss and perplexity over a token stream's windows ([`eval`]).

pub mod decode_attention;
pub mod eval;
pub mod kv_cache;
pub mod sample;

pub use eval::{EvalResult, EvalStream, eval_on_host, eval_windows, windows};
pub use kv_cache::{CachedAttention, CachedRow, KvCache, StepRows};
pub use sample::{Continuation, GenerateOptions, Sampling, generate, generate_with, sample_token};

use crate::float::Float;

/// A model's forward with a key/value cache, over a batch of sequences of their own lengths.
pub trait Decoder {
    type Float: Float;
    type Error: std::error::Error + Send + Sync + 'static;

    /// The real vocabulary: the width of the logits the decoder returns.
    fn vocab_size(&self) -> usize;

    /// The longest sequence the model takes (its position embedding or `max_position_embeddings`).
    fn max_positions(&self) -> usize;

    /// Starts a batch of `prompts.len()` sequences with room for `capacity` positions each (the
    /// cache of an earlier batch is dropped), runs every prompt (at least one token each) in one
    /// pass, and returns the logits `[batch, vocab]` of each prompt's last position.
    fn prefill(
        &mut self,
        prompts: &[&[u32]],
        capacity: usize,
    ) -> Result<Vec<Self::Float>, Self::Error>;

    /// Appends `token` to sequence `seq` for each `(seq, token)` of `next`, in one pass, and
    /// returns the logits `[next.len(), vocab]` of those positions, in `next`'s order.
    fn decode(&mut self, next: &[(usize, u32)]) -> Result<Vec<Self::Float>, Self::Error>;

    /// Continues a batch of one sequence (a conversation's next turn): keeps the first `keep`
    /// positions the cache holds of it (after a batch of several, it holds none), makes room for
    /// `capacity` positions in all, appends `tokens` (at least one) in one pass, and returns the
    /// logits `[vocab]` of the last. An error where `keep` passes what the cache holds.
    fn extend(
        &mut self,
        keep: usize,
        tokens: &[u32],
        capacity: usize,
    ) -> Result<Vec<Self::Float>, Self::Error>;
}
