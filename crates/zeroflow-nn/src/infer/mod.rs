//! Inference over any model family: the key/value cache ([`kv_cache`]), the family-neutral
//! [`Decoder`] a family's cached forward implements, sampling and [`generate`] ([`sample`]),
//! and the loss and perplexity over a token stream's windows ([`eval`]).

pub mod decode_attention;
pub mod eval;
pub mod kv_cache;
pub mod sample;

pub use eval::{EvalResult, EvalStream, eval_on_host, eval_windows, windows};
pub use kv_cache::{CachedAttention, CachedRow, KvCache, StepRows};
pub use sample::{Continuation, GenerateOptions, Sampling, generate, sample_token};

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

/// A decoder on host vectors whose key/value cache moves from one decoder of the model to the
/// next: a conversation's decoder, which borrows the weights, is made for each turn around the
/// cache the last turn's left ([`HostDecoder::with_cache`], [`HostDecoder::take_cache`]).
pub trait HostDecoder: Decoder + Sized {
    /// The decoder's cache.
    fn cache_mut(&mut self) -> &mut KvCache<Self::Float>;

    /// The layers and the attention of the model's cache.
    fn cache_shape(&self) -> (usize, CachedAttention);

    /// This decoder holding `cache` (taken from a decoder of the same model); an error where it
    /// is another model's shape.
    fn with_cache(mut self, cache: KvCache<Self::Float>) -> Result<Self, String> {
        let (layers, shape) = self.cache_shape();
        if (cache.layers(), cache.shape()) != (layers, shape) {
            return Err(format!(
                "a cache of {} layers of {:?} for a model of {layers} of {shape:?}",
                cache.layers(),
                cache.shape()
            ));
        }
        *self.cache_mut() = cache;
        Ok(self)
    }

    /// The cache, an empty one left in its place.
    fn take_cache(&mut self) -> KvCache<Self::Float> {
        let (layers, shape) = self.cache_shape();
        std::mem::replace(self.cache_mut(), KvCache::new(layers, shape, 0, 0))
    }
}
