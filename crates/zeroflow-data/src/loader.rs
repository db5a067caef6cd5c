//! The data loader: a list of token shards read in order, cut into one micro-batch per rank and
//! step, with a position that can be saved and restored.
//!
//! Step `s` of all ranks together reads `world_size × batch × seq + 1` consecutive tokens of the
//! current shard; rank `r` takes the `batch × seq + 1` of them that start at `r × batch × seq`, so
//! the ranks' inputs are disjoint and together cover the step's tokens (llm.c's scheme). When the
//! rest of a shard is too short for a step the loader moves to the next shard, and after the last
//! shard back to the first (a new epoch).
//!
//! A shard with a loss mask beside it (`tokens_NNNNNN.mask`, [`crate::read_loss_mask`]) gives
//! [`IGNORE_TARGET`] as the target of every position whose mask byte is 0. The last
//! [`DataLoader::hold_out_tail`] tokens of the last shard are never read (the held-out evaluation
//! set).
//!
//! A packing loader ([`DataLoader::packed`]) cuts the same rows from the same stream and gives
//! each token its position in its document as well ([`Batch::positions`]), from the document
//! index beside each shard (`tokens_NNNNNN.idx`, [`crate::read_document_index`]): 0 at every
//! document start (its end-of-text token) and at the start of every row (a document that began
//! in an earlier row continues from position 0), one more at each token after. The model bounds
//! attention and the position embedding by them, so a row's documents do not see each other.
//!
//! A shuffling loader ([`DataLoader::shuffled`]) reads the same rows in another order: in each
//! epoch the shards in an order of their own, and each shard's rows (`seq + 1` tokens from every
//! `seq`-th, as the stream cuts them) in an order of their own, both drawn from the seed, the
//! epoch and the shard, so that a saved position resumes the same order. A step still takes
//! `world_size × batch` rows, rank `r` the `batch` of them from `r × batch`, and a shard's rows
//! too few for a whole step are left out of that epoch (other ones in each epoch).

use std::path::PathBuf;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::shard::{ShardTokens, read_document_index, read_loss_mask, read_shard};
use crate::text::read_bytes;
use crate::{DataError, DataErrorKind, SyntheticCorpus};

/// Where the tokens come from.
#[derive(Clone, Debug)]
pub enum Source {
    /// llm.c `.bin` token shards (u16 or u32 tokens), read in this order.
    Shards(Vec<PathBuf>),
    /// Plain text files read as bytes (vocabulary 256).
    Text(Vec<PathBuf>),
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

/// The target of a position whose loss does not count (masked out, or padding): the models'
/// cross-entropy gives it no loss and no gradient, and leaves it out of the mean.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// One rank's micro-batch: `[batch, seq]` inputs and the targets (the inputs shifted by one;
/// [`IGNORE_TARGET`] where the loss mask or padding says the position does not count), and for
/// packed rows each input's position in its document (empty otherwise).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    /// `[batch, seq]` for packed rows ([`DataLoader::packed`]); empty for unpacked ones.
    pub positions: Vec<u32>,
}

impl Batch {
    /// Each input's position in its document, for packed rows; `None` for unpacked ones.
    pub fn positions(&self) -> Option<&[u32]> {
        (!self.positions.is_empty()).then_some(&self.positions[..])
    }

    /// The targets whose loss counts.
    pub fn counted(&self) -> usize {
        self.targets.iter().filter(|&&t| t != IGNORE_TARGET).count()
    }
}

/// A shard's tokens and, where a `.mask` lies beside it, its loss mask.
#[derive(Debug)]
pub struct Unit {
    pub tokens: ShardTokens,
    pub mask: Option<Vec<u8>>,
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
    loaded: Option<(usize, Unit)>,
    window: Vec<u32>,
    /// Tokens at the end of the last shard that are never read (held out for evaluation).
    held_out: usize,
    /// Whether batches carry their tokens' positions in their documents, and the document
    /// starts of the shard in memory (its `.idx` less the shard's length) where they do.
    packing: Option<Vec<u64>>,
    /// Where rows are read in a shuffled order ([`DataLoader::shuffled`]): its seed, and the
    /// order of the rows of the shard in memory, for the epoch and shard it was drawn for.
    shuffle: Option<Shuffle>,
}

/// The shuffled order of a loader's shards and rows ([`DataLoader::shuffled`]).
#[derive(Debug)]
struct Shuffle {
    seed: u64,
    /// `(epoch, order)`: the shards in `epoch`, in the order they are read (drawn once an epoch,
    /// not at every step).
    shards: Option<(u64, Vec<u32>)>,
    /// `(epoch, shard, order)`: the rows of `shard` in `epoch`, in the order they are read.
    rows: Option<(u64, usize, Vec<u32>)>,
}

/// A stateless 64-bit mix (splitmix64's finaliser): the seeds of the shuffles.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// `0..len` in the order a Fisher–Yates shuffle driven by ChaCha8 from `seed` gives, with the
/// RNG's raw output alone (no library sampling that a new version could change): the same order
/// for the same seed in every release.
fn permutation(len: usize, seed: u64) -> Vec<u32> {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut order: Vec<u32> = (0..len as u32).collect();
    for i in (1..len).rev() {
        // The modulo's bias is below len / 2^64: nothing a training run can see.
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
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
            window: vec![0; seq + 1],
            held_out: 0,
            packing: None,
            shuffle: None,
        };
        loader.load(0)?;
        Ok(loader)
    }

    /// Never reads the last `tokens` tokens of the last shard (the held-out evaluation set):
    /// the last target a step reads is the token before them.
    pub fn hold_out_tail(mut self, tokens: usize) -> Result<Self, DataError> {
        self.held_out = tokens;
        self.loaded = None;
        self.load_current()?;
        Ok(self)
    }

    /// Reads the rows in a shuffled order drawn from `seed` (see the module documentation): the
    /// same rows as without it, each epoch in another order.
    pub fn shuffled(mut self, seed: u64) -> Result<Self, DataError> {
        let seed = mix(seed ^ 0x5348_5546_464c_4521);
        self.shuffle = Some(Shuffle { seed, shards: None, rows: None });
        self.loaded = None;
        self.load_current()?;
        Ok(self)
    }

    /// Whether rows are read in a shuffled order ([`DataLoader::shuffled`]).
    pub fn is_shuffled(&self) -> bool {
        self.shuffle.is_some()
    }

    /// The steps (of every rank together) one pass over the source takes: each shard's
    /// `(len − 1) / (world_size × batch × seq)`, its length less the held-out tail of the last,
    /// from the shards' headers and the text files' sizes. `None` for the synthetic corpus,
    /// whose stream is made for the run.
    pub fn epoch_steps(&self) -> Result<Option<u64>, DataError> {
        let paths = match &self.source {
            Source::Shards(paths) | Source::Text(paths) => paths,
            Source::Synthetic { .. } => return Ok(None),
        };
        let mut steps = 0;
        for (index, path) in paths.iter().enumerate() {
            let mut len = match &self.source {
                Source::Shards(_) => crate::shard::shard_token_count(path)?,
                _ => std::fs::metadata(path)
                    .map_err(|e| DataError::new(path, DataErrorKind::Io(e.to_string())))?
                    .len() as usize,
            };
            if index + 1 == paths.len() {
                len = len.saturating_sub(self.held_out);
            }
            steps += (len.saturating_sub(1) / (self.step_tokens() - 1)) as u64;
        }
        Ok(Some(steps))
    }

    /// Makes the position's shard the one in memory ([`DataLoader::load`]); returns its length.
    fn load_current(&mut self) -> Result<usize, DataError> {
        let shard = self.current();
        self.load(shard)
    }

    /// The shard the position's (`shard`-th of its epoch) is.
    fn current(&mut self) -> usize {
        let count = shard_count(&self.source);
        let (logical, epoch) = (self.position.shard % count, self.position.epoch);
        match &mut self.shuffle {
            Some(shuffle) if count > 1 => {
                if shuffle.shards.as_ref().is_none_or(|(drawn, _)| *drawn != epoch) {
                    let seed = mix(shuffle.seed ^ mix(epoch)) ^ u64::MAX;
                    shuffle.shards = Some((epoch, permutation(count, seed)));
                }
                shuffle.shards.as_ref().expect("drawn above").1[logical] as usize
            }
            _ => logical,
        }
    }

    /// The shard in memory's `row`-th row in this epoch's order (its first token's offset is
    /// `seq` times it).
    fn row(&mut self, row: usize, rows: usize) -> usize {
        let Some(shuffle) = &mut self.shuffle else { return row };
        let (epoch, shard) = (self.position.epoch, self.loaded.as_ref().expect("loaded").0);
        let this =
            |(e, s, order): &(u64, usize, Vec<u32>)| (*e, *s, order.len()) == (epoch, shard, rows);
        if !shuffle.rows.as_ref().is_some_and(this) {
            let seed = mix(shuffle.seed ^ mix(epoch) ^ mix(shard as u64).rotate_left(17));
            shuffle.rows = Some((epoch, shard, permutation(rows, seed)));
        }
        shuffle.rows.as_ref().expect("drawn above").2[row] as usize
    }

    /// Packs rows: every batch carries its tokens' positions in their documents, read from the
    /// document index beside each shard. The rows are the same as without packing. Every shard
    /// must have its index (`zeroflow tokenize` writes one): the error names the first that has
    /// none (text files and the synthetic corpus have no documents).
    pub fn packed(mut self) -> Result<Self, DataError> {
        for index in 0..shard_count(&self.source) {
            let path = unit_path(&self.source, index);
            let indexed = matches!(self.source, Source::Shards(_)) && index_path(&path).exists();
            if !indexed {
                return Err(DataError::new(path, DataErrorKind::NoDocumentIndex));
            }
        }
        self.packing = Some(Vec::new());
        self.loaded = None;
        self.load_current()?;
        Ok(self)
    }

    /// Whether batches carry their tokens' positions ([`DataLoader::packed`]).
    pub fn is_packed(&self) -> bool {
        self.packing.is_some()
    }

    /// Whether the shards carry loss masks (the first one does).
    pub fn masked(&self) -> bool {
        match &self.source {
            Source::Shards(paths) => paths.iter().any(|p| mask_path(p).exists()),
            _ => false,
        }
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
        self.position = position;
        self.load_current()?;
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
        let mut shard_len = self.load_current()?;
        if self.position.offset + self.step_tokens() > shard_len {
            shard_len = self.advance_shard()?;
        }
        let (seq, rows) = (self.seq, (shard_len - 1) / self.seq);
        // The step's rows start at `offset` (a whole number of rows); this rank's at its part.
        let first = self.position.offset / seq + self.rank * self.batch;
        out.inputs.clear();
        out.targets.clear();
        out.positions.clear();
        for b in 0..self.batch {
            let start = self.row(first + b, rows) * seq;
            let (_, unit) = self.loaded.as_ref().expect("loaded above");
            unit.tokens.copy_to(start, &mut self.window);
            out.inputs.extend_from_slice(&self.window[..seq]);
            out.targets.extend_from_slice(&self.window[1..]);
            if let Some(mask) = &unit.mask {
                let targets = out.targets.len() - seq;
                apply_mask(&mut out.targets[targets..], &mask[start + 1..start + 1 + seq]);
            }
            if let Some(starts) = &self.packing {
                document_positions(starts, start, seq, seq, &mut out.positions);
            }
        }
        self.position.offset += self.step_tokens() - 1;
        Ok(())
    }

    /// Moves to the next shard of the epoch (the first of the next epoch after the last);
    /// returns its length.
    fn advance_shard(&mut self) -> Result<usize, DataError> {
        let count = shard_count(&self.source);
        let next = (self.position.shard + 1) % count;
        if next == 0 {
            self.position.epoch += 1;
        }
        self.position.shard = next;
        self.position.offset = 0;
        self.load_current()
    }

    /// Makes shard `index` the one in memory; returns its length (less the held-out tail in
    /// the last shard).
    fn load(&mut self, index: usize) -> Result<usize, DataError> {
        if let Some((loaded, unit)) = &self.loaded
            && *loaded == index
        {
            return Ok(unit.tokens.len());
        }
        let mut unit = read_unit(&self.source, index, self.vocab)?;
        if index + 1 == shard_count(&self.source) && self.held_out > 0 {
            let keep = unit.tokens.len().saturating_sub(self.held_out);
            unit.tokens.truncate(keep);
            if let Some(mask) = &mut unit.mask {
                mask.truncate(keep);
            }
        }
        let needed = self.step_tokens();
        if unit.tokens.len() < needed {
            let tokens = unit.tokens.len();
            return Err(DataError::new(
                unit_path(&self.source, index),
                DataErrorKind::TooShort { tokens, needed },
            ));
        }
        if let Some(starts) = &mut self.packing {
            *starts = read_document_starts(&self.source, index)?;
        }
        let len = unit.tokens.len();
        self.loaded = Some((index, unit));
        Ok(len)
    }
}

/// The positions of `len` tokens from token `first` of a stream cut into rows of `seq` from
/// `first`, whose documents start at `starts` (ascending): 0 at every row's start and every
/// document start, one more than the previous token's otherwise. Appended to `out`.
pub fn document_positions(
    starts: &[u64],
    first: usize,
    seq: usize,
    len: usize,
    out: &mut Vec<u32>,
) {
    // The next document start at or after the token being placed.
    let mut next = starts.partition_point(|&start| start < first as u64);
    let mut position = 0;
    for (i, token) in (first..first + len).enumerate() {
        while next < starts.len() && starts[next] < token as u64 {
            next += 1;
        }
        if i % seq == 0 || starts.get(next) == Some(&(token as u64)) {
            position = 0;
        }
        out.push(position);
        position += 1;
    }
}

/// Sets the targets whose mask byte is 0 to [`IGNORE_TARGET`].
pub fn apply_mask(targets: &mut [u32], mask: &[u8]) {
    for (target, &keep) in targets.iter_mut().zip(mask) {
        if keep == 0 {
            *target = IGNORE_TARGET;
        }
    }
}

/// Where each document of shard `index` of `source` starts (its document index, less the
/// shard's length at its end); an error naming the shard where it has no index (text files and
/// the synthetic corpus have none).
pub fn read_document_starts(source: &Source, index: usize) -> Result<Vec<u64>, DataError> {
    let path = unit_path(source, index);
    let index_file = index_path(&path);
    if !matches!(source, Source::Shards(_)) || !index_file.exists() {
        return Err(DataError::new(path, DataErrorKind::NoDocumentIndex));
    }
    let mut starts = read_document_index(&index_file)?;
    starts.pop();
    Ok(starts)
}

/// The document index that lies beside a shard.
pub fn index_path(shard: &std::path::Path) -> PathBuf {
    shard.with_extension("idx")
}

/// The loss mask that lies beside a shard.
pub fn mask_path(shard: &std::path::Path) -> PathBuf {
    shard.with_extension("mask")
}

fn unit_path(source: &Source, index: usize) -> PathBuf {
    match source {
        Source::Shards(paths) | Source::Text(paths) => paths[index].clone(),
        Source::Synthetic { .. } => "<synthetic>".into(),
    }
}

/// Shard `index` of `source`, checked against `vocab`, with its loss mask where there is one.
pub fn read_unit(source: &Source, index: usize, vocab: usize) -> Result<Unit, DataError> {
    let tokens = match source {
        Source::Shards(paths) => read_shard(&paths[index], vocab)?,
        Source::Text(paths) => ShardTokens::U8(read_bytes(&paths[index], vocab)?),
        Source::Synthetic { corpus, stream_seed, len } => {
            let tokens = corpus.sample(*stream_seed, *len);
            if let Some(index) = tokens.iter().position(|&t| t as usize >= vocab) {
                let token = tokens[index];
                let kind = DataErrorKind::TokenOutOfRange { token, index, vocab };
                return Err(DataError::new("<synthetic>", kind));
            }
            ShardTokens::U32(tokens)
        }
    };
    let mask = match source {
        Source::Shards(paths) if mask_path(&paths[index]).exists() => {
            let path = mask_path(&paths[index]);
            let mask = read_loss_mask(&path)?;
            if mask.len() != tokens.len() {
                let kind = DataErrorKind::Corrupt(format!(
                    "{} mask bytes for a shard of {} tokens",
                    mask.len(),
                    tokens.len()
                ));
                return Err(DataError::new(path, kind));
            }
            Some(mask)
        }
        _ => None,
    };
    Ok(Unit { tokens, mask })
}

fn shard_count(source: &Source) -> usize {
    match source {
        Source::Shards(paths) | Source::Text(paths) => paths.len(),
        Source::Synthetic { .. } => 1,
    }
}
