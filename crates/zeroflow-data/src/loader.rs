//! The data loader: a list of token shards read in order, cut into one micro-batch per rank and
//! step, with a position that can be saved and restored.
//!
//! Step `s` of all ranks together reads `world_size × batch × seq + 1` consecutive tokens of the
//! current shard; rank `r` takes the `batch × seq + 1` of them that start at `r × batch × seq`, so
//! the ranks' inputs are disjoint and together cover the step's tokens (llm.c's scheme). When the
//! rest of a shard is too short for a step the loader moves to the next shard, and after the last
//! shard back to the first (a new epoch).

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::shard::{ShardTokens, read_shard};
use crate::text::{read_bytes, read_gpt2_text};
use crate::{DataError, DataErrorKind, SyntheticCorpus};

/// Where the tokens come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// llm.c `.bin` token shards (u16 or u32 tokens), read in this order.
    Shards(Vec<PathBuf>),
    /// Plain text files read as bytes (vocabulary 256).
    Text(Vec<PathBuf>),
    /// UTF-8 text files tokenized with GPT-2's BPE (vocabulary 50257).
    Gpt2Text(Vec<PathBuf>),
    /// `len` tokens of the synthetic corpus from stream `stream_seed`.
    Synthetic { corpus: Arc<SyntheticCorpus>, stream_seed: u64, len: usize },
}

/// Where the next step starts; the same on every rank. Save it with a checkpoint to resume the
/// exact stream.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataPosition {
    /// Completed passes over all shards.
    pub epoch: u64,
    /// Index of the current shard.
    pub shard: usize,
    /// Token offset of the next step within the shard.
    pub offset: usize,
}

/// One rank's micro-batch: `[batch, seq]` inputs and the targets (the inputs shifted by one).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

/// Cuts a token source into micro-batches for one rank.
#[derive(Debug)]
pub struct DataLoader {
    source: Source,
    vocab: usize,
    batch: usize,
    seq: usize,
    rank: usize,
    world_size: usize,
    position: DataPosition,
    /// The shard in memory and its index.
    loaded: Option<(usize, ShardTokens)>,
    window: Vec<u32>,
}

impl DataLoader {
    /// A loader for `rank` of `world_size`, for a model of vocabulary `vocab`. Opens (and checks)
    /// the first shard; the others are checked as they are reached.
    ///
    /// # Panics
    /// If `batch` or `seq` is 0, `rank` is not below `world_size`, or the source has no shard.
    pub fn new(
        source: Source,
        vocab: usize,
        batch: usize,
        seq: usize,
        rank: usize,
        world_size: usize,
    ) -> Result<Self, DataError> {
        assert!(batch > 0 && seq > 0 && rank < world_size, "bad loader shape");
        assert!(shard_count(&source) > 0, "a data source needs at least one shard");
        let mut loader = DataLoader {
            source,
            vocab,
            batch,
            seq,
            rank,
            world_size,
            position: DataPosition::default(),
            loaded: None,
            window: vec![0; batch * seq + 1],
        };
        loader.load(0)?;
        Ok(loader)
    }

    /// Tokens one step of all ranks reads.
    fn step_tokens(&self) -> usize {
        self.world_size * self.batch * self.seq + 1
    }

    /// Where the next step starts.
    pub fn position(&self) -> DataPosition {
        self.position
    }

    /// Continues from a saved position (of a loader with the same source, batch, seq and world).
    pub fn seek(&mut self, position: DataPosition) -> Result<(), DataError> {
        self.load(position.shard % shard_count(&self.source))?;
        self.position = position;
        Ok(())
    }

    /// The next micro-batch of this rank.
    pub fn next_batch(&mut self) -> Result<Batch, DataError> {
        let mut batch = Batch::default();
        self.next_into(&mut batch)?;
        Ok(batch)
    }

    /// The next micro-batch of this rank, into `out` (reusing its allocations).
    pub fn next_into(&mut self, out: &mut Batch) -> Result<(), DataError> {
        let shard_len = self.load(self.position.shard)?;
        if self.position.offset + self.step_tokens() > shard_len {
            self.advance_shard()?;
        }
        let start = self.position.offset + self.rank * self.batch * self.seq;
        let (_, tokens) = self.loaded.as_ref().expect("loaded above");
        tokens.copy_to(start, &mut self.window);
        let n = self.batch * self.seq;
        out.inputs.clear();
        out.inputs.extend_from_slice(&self.window[..n]);
        out.targets.clear();
        out.targets.extend_from_slice(&self.window[1..]);
        self.position.offset += self.step_tokens() - 1;
        Ok(())
    }

    fn advance_shard(&mut self) -> Result<(), DataError> {
        let count = shard_count(&self.source);
        let next = (self.position.shard + 1) % count;
        if next == 0 {
            self.position.epoch += 1;
        }
        self.position.shard = next;
        self.position.offset = 0;
        self.load(next)?;
        Ok(())
    }

    /// Makes shard `index` the one in memory; returns its length.
    fn load(&mut self, index: usize) -> Result<usize, DataError> {
        if let Some((loaded, tokens)) = &self.loaded
            && *loaded == index
        {
            return Ok(tokens.len());
        }
        let (path, tokens) = match &self.source {
            Source::Shards(paths) => (paths[index].clone(), read_shard(&paths[index], self.vocab)?),
            Source::Text(paths) => {
                (paths[index].clone(), ShardTokens::U32(read_bytes(&paths[index], self.vocab)?))
            }
            Source::Gpt2Text(paths) => {
                (paths[index].clone(), ShardTokens::U32(read_gpt2_text(&paths[index], self.vocab)?))
            }
            Source::Synthetic { corpus, stream_seed, len } => {
                let tokens = corpus.sample(*stream_seed, *len);
                if let Some(index) = tokens.iter().position(|&t| t as usize >= self.vocab) {
                    let (token, vocab) = (tokens[index], self.vocab);
                    let kind = DataErrorKind::TokenOutOfRange { token, index, vocab };
                    return Err(DataError::new("<synthetic>", kind));
                }
                ("<synthetic>".into(), ShardTokens::U32(tokens))
            }
        };
        let needed = self.step_tokens();
        if tokens.len() < needed {
            return Err(DataError::new(
                path,
                DataErrorKind::TooShort { tokens: tokens.len(), needed },
            ));
        }
        let len = tokens.len();
        self.loaded = Some((index, tokens));
        Ok(len)
    }
}

fn shard_count(source: &Source) -> usize {
    match source {
        Source::Shards(paths) | Source::Text(paths) | Source::Gpt2Text(paths) => paths.len(),
        Source::Synthetic { .. } => 1,
    }
}
