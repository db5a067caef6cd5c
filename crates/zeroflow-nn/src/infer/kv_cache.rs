//! The key/value cache of inference: per layer the keys and values of every position a sequence
//! has seen, so that a new token's attention reads them instead of recomputing the prefix.
//!
//! A step runs any set of token rows at once, each a [`CachedRow`] (its sequence and position):
//! a prompt is many rows of one sequence (prefill), a decode step one row per sequence. Each
//! sequence has its own length (no padding); positions count from 0 in each.

use rayon::prelude::*;

use crate::float::Float;
use crate::kernels::matmul::dot;

/// (Row, query head) pairs of an attention per task at least (each is little work).
const PAIRS_PER_TASK: usize = 4;

/// One token row of a step: sequence `seq` at position `pos` (its index in the sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedRow {
    pub seq: usize,
    pub pos: usize,
}

/// The token rows of one step and which of them the caller wants the logits of.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepRows {
    /// `tokens[i]` is the token of `rows[i]`.
    pub tokens: Vec<u32>,
    pub rows: Vec<CachedRow>,
    /// The indices of the rows whose logits the step returns, in order.
    pub logits_of: Vec<usize>,
}

/// The attention of one layer: `n_head` query heads over `n_kv_head` key/value heads of
/// `head_dim` each, in a `qkv` row `[q | k | v]` of width `(n_head + 2 n_kv_head) · head_dim`
/// (zeroflow-nn's attention row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedAttention {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
}

impl CachedAttention {
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
    }

    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }
}

/// The keys and values of `layers` layers for a batch of sequences, each of at most `capacity`
/// positions.
#[derive(Debug)]
pub struct KvCache<F> {
    shape: CachedAttention,
    capacity: usize,
    /// Per layer, keys and values `[batch, capacity, kv_width]`.
    keys: Vec<Vec<F>>,
    values: Vec<Vec<F>>,
    lens: Vec<usize>,
}

impl<F: Float> KvCache<F> {
    /// An empty cache of `batch` sequences of at most `capacity` positions.
    pub fn new(layers: usize, shape: CachedAttention, batch: usize, capacity: usize) -> Self {
        let len = batch * capacity * shape.kv_width();
        KvCache {
            shape,
            capacity,
            keys: (0..layers).map(|_| vec![F::zero(); len]).collect(),
            values: (0..layers).map(|_| vec![F::zero(); len]).collect(),
            lens: vec![0; batch],
        }
    }

    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    pub fn layers(&self) -> usize {
        self.keys.len()
    }

    pub fn shape(&self) -> CachedAttention {
        self.shape
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The positions sequence `seq` holds.
    pub fn len(&self, seq: usize) -> usize {
        self.lens[seq]
    }

    pub fn is_empty(&self) -> bool {
        self.lens.iter().all(|&len| len == 0)
    }

    /// The rows of a step that appends `tokens` tokens to sequence `seq` for each `(seq, tokens)`
    /// of `appended`, in that order, and counts them as held. An error says which sequence would
    /// pass the capacity.
    pub fn append(&mut self, appended: &[(usize, usize)]) -> Result<Vec<CachedRow>, String> {
        let mut rows = Vec::new();
        for &(seq, tokens) in appended {
            let start = *self.lens.get(seq).ok_or_else(|| {
                format!("sequence {seq} is not in the cache of {} sequences", self.batch())
            })?;
            if start + tokens > self.capacity {
                return Err(format!(
                    "sequence {seq}: {start} + {tokens} positions pass the cache's {}",
                    self.capacity
                ));
            }
            rows.extend((start..start + tokens).map(|pos| CachedRow { seq, pos }));
            self.lens[seq] = start + tokens;
        }
        Ok(rows)
    }

    /// The rows of a prefill of `prompts` (each at least one token, sequence `b` the `b`-th),
    /// counted as held, the logits wanted of each prompt's last position.
    pub fn prefill(&mut self, prompts: &[&[u32]]) -> Result<StepRows, String> {
        if let Some(seq) = prompts.iter().position(|p| p.is_empty()) {
            return Err(format!("prompt {seq} is empty"));
        }
        let appended: Vec<(usize, usize)> =
            prompts.iter().enumerate().map(|(seq, p)| (seq, p.len())).collect();
        let rows = self.append(&appended)?;
        let tokens = prompts.iter().flat_map(|p| p.iter().copied()).collect();
        let logits_of = prompts
            .iter()
            .scan(0, |end, p| {
                *end += p.len();
                Some(*end - 1)
            })
            .collect();
        Ok(StepRows { tokens, rows, logits_of })
    }

    /// The rows of a step that continues a cache of one sequence, as a conversation's next turn
    /// continues the last: keeps the first `keep` positions it holds (a cache of another batch
    /// holds none), makes room for `capacity` positions in all, and appends `tokens` (at least
    /// one), counted as held, the logits wanted of the last. An error, the cache unchanged, where
    /// `keep` passes what it holds or the tokens do not fit the capacity.
    pub fn extend(
        &mut self,
        keep: usize,
        tokens: &[u32],
        capacity: usize,
    ) -> Result<StepRows, String> {
        let held = if self.batch() == 1 { self.lens[0] } else { 0 };
        if tokens.is_empty() {
            return Err("no tokens to append".into());
        }
        if keep > held {
            return Err(format!("keeps {keep} positions of a sequence of {held}"));
        }
        if keep + tokens.len() > capacity {
            let n = tokens.len();
            return Err(format!("{keep} + {n} positions pass the capacity of {capacity}"));
        }
        if self.batch() != 1 {
            *self = KvCache::new(self.layers(), self.shape, 1, capacity);
        } else if capacity != self.capacity {
            // One sequence: its positions are the start of each layer's buffer.
            let len = capacity * self.shape.kv_width();
            self.keys.iter_mut().chain(&mut self.values).for_each(|kv| kv.resize(len, F::zero()));
            self.capacity = capacity;
        }
        self.lens[0] = keep;
        let rows = self.append(&[(0, tokens.len())])?;
        Ok(StepRows { tokens: tokens.to_vec(), logits_of: vec![rows.len() - 1], rows })
    }

    /// The rows of a decode step appending `token` to sequence `seq` for each `(seq, token)` of
    /// `next`, counted as held, the logits wanted of every one.
    pub fn decode(&mut self, next: &[(usize, u32)]) -> Result<StepRows, String> {
        let appended: Vec<(usize, usize)> = next.iter().map(|&(seq, _)| (seq, 1)).collect();
        let rows = self.append(&appended)?;
        let tokens = next.iter().map(|&(_, token)| token).collect();
        Ok(StepRows { tokens, logits_of: (0..rows.len()).collect(), rows })
    }

    /// Layer `layer`'s causal attention of `rows`: stores each row's key and value from `qkv`
    /// (`[rows, qkv_width]`) at its position, then writes to `out` (`[rows, n_head · head_dim]`)
    /// each row's attention over its sequence's positions up to its own (grouped-query: query
    /// head `h` with key/value head `h / (n_head / n_kv_head)`), as
    /// [`crate::kernels::attention::attention_forward`] computes it.
    pub fn attend(&mut self, layer: usize, qkv: &[F], rows: &[CachedRow], out: &mut [F]) {
        let shape = self.shape;
        let (qw, kvw, width) = (shape.q_width(), shape.kv_width(), shape.qkv_width());
        let (keys, values) = (&mut self.keys[layer], &mut self.values[layer]);
        let slot = |row: &CachedRow| (row.seq * self.capacity + row.pos) * kvw;
        for (row, qkv) in rows.iter().zip(qkv.chunks(width)) {
            keys[slot(row)..][..kvw].copy_from_slice(&qkv[qw..][..kvw]);
            values[slot(row)..][..kvw].copy_from_slice(&qkv[qw + kvw..][..kvw]);
        }
        let (keys, values) = (&*keys, &*values);
        let (hs, group) = (shape.head_dim, shape.n_head / shape.n_kv_head);
        let scale = F::one() / F::of(hs as f64).sqrt();
        let capacity = self.capacity;
        // A task per (row, query head): a decode step's one row still runs on every core.
        // Each task's attention weights in one buffer, not one for each pair.
        let pairs = out.par_chunks_mut(hs).enumerate().with_min_len(PAIRS_PER_TASK);
        pairs.for_each_init(Vec::new, |weights, (i, out)| {
            let (r, h) = (i / shape.n_head, i % shape.n_head);
            let (row, query) = (&rows[r], &qkv[r * width + h * hs..][..hs]);
            let (first, kv) = (row.seq * capacity * kvw, (h / group) * hs);
            weights.clear();
            weights.resize(row.pos + 1, F::zero());
            let mut max = F::neg_infinity();
            for (t2, score) in weights.iter_mut().enumerate() {
                let key = &keys[first + t2 * kvw + kv..][..hs];
                *score = dot(query, key) * scale;
                max = max.max(*score);
            }
            let mut sum = F::zero();
            for a in weights.iter_mut() {
                *a = (*a - max).exp();
                sum += *a;
            }
            out.fill(F::zero());
            for (t2, &a) in weights.iter().enumerate() {
                let value = &values[first + t2 * kvw + kv..][..hs];
                let a = a / sum;
                out.iter_mut().zip(value).for_each(|(o, &v)| *o += a * v);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: CachedAttention = CachedAttention { n_head: 4, n_kv_head: 2, head_dim: 2 };

    #[test]
    fn rows_take_each_sequences_next_positions_and_the_capacity_is_kept() {
        let mut cache = KvCache::<f32>::new(1, SHAPE, 2, 4);
        let step = cache.prefill(&[&[5, 6, 7], &[8]]).unwrap();
        let positions: Vec<(usize, usize)> = step.rows.iter().map(|r| (r.seq, r.pos)).collect();
        assert_eq!(positions, vec![(0, 0), (0, 1), (0, 2), (1, 0)]);
        assert_eq!(step.tokens, vec![5, 6, 7, 8]);
        assert_eq!(step.logits_of, vec![2, 3], "each prompt's last row");
        let step = cache.decode(&[(1, 9), (0, 3)]).unwrap();
        assert_eq!(step.rows, vec![CachedRow { seq: 1, pos: 1 }, CachedRow { seq: 0, pos: 3 }]);
        assert_eq!((cache.len(0), cache.len(1)), (4, 2));
        assert!(cache.decode(&[(0, 1)]).unwrap_err().contains("sequence 0"), "past the capacity");
        assert!(cache.decode(&[(2, 1)]).is_err(), "no sequence 2");
        assert_eq!((cache.len(0), cache.len(1)), (4, 2), "a refused step holds nothing more");
        let mut fresh = KvCache::<f32>::new(1, SHAPE, 2, 4);
        assert!(fresh.prefill(&[&[1], &[]]).unwrap_err().contains("prompt 1 is empty"));
    }

    #[test]
    fn extending_keeps_a_prefix_of_the_one_sequence_and_grows_to_the_capacity() {
        let mut cache = KvCache::<f32>::new(2, SHAPE, 2, 4);
        cache.prefill(&[&[1, 2], &[3]]).unwrap();
        // A batch of two holds no sequence to continue: it starts afresh as one.
        assert!(
            cache.extend(1, &[9], 8).unwrap_err().contains("keeps 1 positions of a sequence of 0")
        );
        let step = cache.extend(0, &[5, 6, 7], 8).unwrap();
        assert_eq!((cache.batch(), cache.capacity(), cache.len(0)), (1, 8, 3));
        assert_eq!(
            step.rows.iter().map(|r| (r.seq, r.pos)).collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 2)]
        );
        assert_eq!((step.tokens, step.logits_of), (vec![5, 6, 7], vec![2]));
        // Keys stored at position 1 stay where they are when the capacity grows.
        let qkv: Vec<f32> = (0..3 * SHAPE.qkv_width()).map(|i| i as f32).collect();
        let mut out = vec![0.0; 3 * SHAPE.q_width()];
        cache.attend(1, &qkv, &step.rows, &mut out);
        let key =
            |cache: &KvCache<f32>| cache.keys[1][SHAPE.kv_width()..][..SHAPE.kv_width()].to_vec();
        let before = key(&cache);
        let step = cache.extend(2, &[8], 16).unwrap();
        assert_eq!((cache.capacity(), cache.len(0), key(&cache)), (16, 3, before));
        assert_eq!(step.rows, vec![CachedRow { seq: 0, pos: 2 }], "position 2 taken again");
        assert!(
            cache.extend(4, &[1], 16).unwrap_err().contains("keeps 4 positions of a sequence of 3")
        );
        assert!(
            cache
                .extend(3, &[1, 2], 4)
                .unwrap_err()
                .contains("3 + 2 positions pass the capacity of 4")
        );
        assert!(cache.extend(0, &[], 4).is_err(), "nothing to run");
        assert_eq!((cache.capacity(), cache.len(0)), (16, 3), "a refused step changes nothing");
    }

    #[test]
    fn a_single_position_attends_to_its_own_value_only() {
        // One position: every query head's weights are [1], so its output is its key/value
        // head's value (heads 0, 1 read kv head 0, whose value is [0, 0]; heads 2, 3 kv head 1).
        let mut cache = KvCache::<f64>::new(1, SHAPE, 1, 2);
        let step = cache.prefill(&[&[0]]).unwrap();
        let qkv =
            [0.3, -1.0, 2.0, 0.5, 1.0, 1.0, -2.0, 4.0, 0.1, 0.2, 0.7, 0.9, 0.0, 0.0, 1.5, -0.5];
        let mut out = [0.0; 8];
        cache.attend(0, &qkv, &step.rows, &mut out);
        assert_eq!(out, [0.0, 0.0, 0.0, 0.0, 1.5, -0.5, 1.5, -0.5]);
    }
}
