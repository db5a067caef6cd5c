//! The family-neutral half of a GPU decoder ([`CachedDecoder`]): the positions each sequence
//! holds, the batch's buffers and how a conversation's turn keeps or grows them; a family gives
//! the other half, its forward over a step's rows ([`CachedForward`]: the weights, the kernels
//! and the buffers of a batch, the [`CudaKvCache`] among them).

use std::fmt;

use zeroflow_device::DeviceError;
use zeroflow_device::cuda::CudaStream;

use super::decode::CudaKvCache;
use crate::infer::{CachedAttention, Decoder, KvCache, StepRows};

/// A family's forward with a key/value cache on the GPU: what [`CachedDecoder`] runs each step.
pub trait CachedForward {
    /// The GPU buffers of one batch, its cache among them.
    type Batch: fmt::Debug;
    type Error: std::error::Error + Send + Sync + 'static + From<DeviceError>;

    /// The attention the cache holds keys and values of.
    fn attention(&self) -> CachedAttention;

    /// The real vocabulary: the width of the logits [`CachedForward::run`] returns.
    fn vocab_size(&self) -> usize;

    /// The longest sequence the model takes.
    fn max_positions(&self) -> usize;

    /// The stream every step runs on.
    fn stream(&self) -> &CudaStream;

    /// The error of a batch's positions: a prompt too long, a sequence that is not there, a step
    /// before any prefill.
    fn batch_error(reason: String) -> Self::Error;

    /// The buffers of a batch of `batch` sequences of `capacity` positions, for steps of at
    /// most `max_rows` rows.
    fn allocate(
        &self,
        batch: usize,
        capacity: usize,
        max_rows: usize,
    ) -> Result<Self::Batch, Self::Error>;

    /// A batch's cache and the most rows its steps take.
    fn cache(batch: &Self::Batch) -> (&CudaKvCache, usize);

    /// Runs a step's rows (already counted in the positions) and returns the logits
    /// `[logits_of.len(), vocab]` of the rows it asks for.
    fn run(&self, batch: &mut Self::Batch, step: &StepRows) -> Result<Vec<f32>, Self::Error>;
}

/// A family's [`CachedForward`] as a [`Decoder`] over the cache of the current batch.
#[derive(Debug)]
pub struct CachedDecoder<F: CachedForward> {
    forward: F,
    /// The positions each sequence holds (a cache of no layers: the host's count).
    positions: KvCache<f32>,
    batch: Option<F::Batch>,
}

impl<F: CachedForward> CachedDecoder<F> {
    /// A decoder of `forward`, with no batch until the first prefill.
    pub fn new(forward: F) -> Self {
        let positions = KvCache::new(0, forward.attention(), 0, 0);
        CachedDecoder { forward, positions, batch: None }
    }

    fn step(&mut self, step: &StepRows) -> Result<Vec<f32>, F::Error> {
        let no_batch = || F::batch_error("no prefill yet".into());
        let mut batch = self.batch.take().ok_or_else(no_batch)?;
        let result = self.forward.run(&mut batch, step);
        self.batch = Some(batch);
        result
    }
}

impl<F: CachedForward> Decoder for CachedDecoder<F> {
    type Float = f32;
    type Error = F::Error;

    fn vocab_size(&self) -> usize {
        self.forward.vocab_size()
    }

    fn max_positions(&self) -> usize {
        self.forward.max_positions()
    }

    fn prefill(&mut self, prompts: &[&[u32]], capacity: usize) -> Result<Vec<f32>, F::Error> {
        let capacity = capacity.min(self.max_positions());
        self.positions = KvCache::new(0, self.forward.attention(), prompts.len(), capacity);
        let step = self.positions.prefill(prompts).map_err(F::batch_error)?;
        let max_rows = step.rows.len().max(prompts.len());
        // The last batch's buffers freed before the new ones are allocated.
        self.batch = None;
        self.batch = Some(self.forward.allocate(prompts.len(), capacity, max_rows)?);
        self.step(&step)
    }

    fn decode(&mut self, next: &[(usize, u32)]) -> Result<Vec<f32>, F::Error> {
        let step = self.positions.decode(next).map_err(F::batch_error)?;
        self.step(&step)
    }

    /// The batch's buffers are kept where they hold one sequence with room for the turn; else
    /// made anew, larger (`turn_capacity`), the kept positions' keys and values copied over.
    fn extend(
        &mut self,
        keep: usize,
        tokens: &[u32],
        capacity: usize,
    ) -> Result<Vec<f32>, F::Error> {
        let one = self.batch.as_ref().map(|b| *F::cache(b).0.layout()).filter(|l| l.batch == 1);
        let capacity = turn_capacity(one.map(|l| l.capacity), capacity, self.max_positions());
        let step = self.positions.extend(keep, tokens, capacity).map_err(F::batch_error)?;
        let (held, turn) = (self.batch.take(), (keep, step.rows.len(), capacity));
        let forward = &self.forward;
        let allocate = |max_rows| forward.allocate(1, capacity, max_rows);
        self.batch = Some(turn_batch(held, F::cache, turn, forward.stream(), allocate)?);
        self.step(&step)
    }
}

/// The capacity of a GPU decoder's cache for a turn of a conversation that asks for `asked`
/// positions (the model takes `max`), where it holds a cache of one sequence of `held`
/// positions: that one where it has room, else at least twice as many (up to `max`), so that a
/// growing conversation's cache is made larger, and copied, seldom.
fn turn_capacity(held: Option<usize>, asked: usize, max: usize) -> usize {
    let asked = asked.min(max);
    match held {
        Some(held) if held >= asked => held,
        Some(held) => asked.max(2 * held).min(max),
        None => asked,
    }
}

/// The batch a GPU decoder runs a conversation's turn on ([`Decoder::extend`]), keeping `keep`
/// positions and running `rows` rows with room for `capacity` positions: `held`, where it holds
/// one sequence of that capacity and steps of as many rows (`cache` gives a batch's cache and
/// the rows of its steps); else what `allocate(max_rows)` makes for steps of as many rows as
/// before at least, the kept positions' keys and values copied over.
fn turn_batch<B, E: From<DeviceError>>(
    held: Option<B>,
    cache: impl Fn(&B) -> (&CudaKvCache, usize),
    (keep, rows, capacity): (usize, usize, usize),
    stream: &CudaStream,
    allocate: impl FnOnce(usize) -> Result<B, E>,
) -> Result<B, E> {
    let fits = |b: &B| {
        let (kv, max_rows) = cache(b);
        let layout = kv.layout();
        (layout.batch, layout.capacity) == (1, capacity) && max_rows >= rows
    };
    match held {
        Some(batch) if fits(&batch) => Ok(batch),
        held => {
            let batch = allocate(rows.max(held.as_ref().map_or(1, |b| cache(b).1)))?;
            if let Some(old) = held.filter(|_| keep > 0) {
                cache(&batch).0.copy_prefix(stream, cache(&old).0, keep)?;
            }
            Ok(batch)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_turns_cache_is_kept_where_it_has_room_and_at_least_doubled_where_not() {
        assert_eq!(turn_capacity(None, 300, 1024), 300, "a first turn: what it asks");
        assert_eq!(turn_capacity(None, 3000, 1024), 1024, "at most the model's positions");
        assert_eq!(turn_capacity(Some(512), 400, 1024), 512, "room enough: kept");
        assert_eq!(turn_capacity(Some(300), 400, 1024), 600, "twice as many");
        assert_eq!(turn_capacity(Some(300), 700, 1024), 700, "what it asks, where more than twice");
        assert_eq!(turn_capacity(Some(600), 700, 1024), 1024, "twice, up to the model's");
    }
}
