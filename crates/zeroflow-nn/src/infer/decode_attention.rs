//! The CPU twins of the GPU's cached attention (`kernels/decode.cu`, launched by
//! [`crate::cuda::decode`]): the same cache layout, the same partition of the work and the same
//! order of the online-softmax updates, in f32, so that the GPU kernels can be checked against
//! them and they against [`KvCache::attend`](super::KvCache::attend).
//!
//! One layer's cache is `keys, values [batch, n_kv_head, capacity, head_dim]` ([`DeviceCacheLayout`]).
//! A step's token rows ([`CachedRow`]) each have a `qkv` row `[q | k | v]` as the training
//! attention lays it out ([`CachedAttention`]); [`kv_write`] stores each row's key and value heads
//! at its position, then [`decode_attention`] attends each row's query heads over its sequence's
//! positions up to its own.

use super::{CachedAttention, CachedRow};

/// Lanes of a warp.
pub const WARP: usize = 32;
/// Warps per block of `decode_attention` (`DECODE_THREADS / WARP` in the kernel).
pub const DECODE_WARPS: usize = 4;
/// The largest head size `decode_attention` takes (`DECODE_MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = 256;

/// The layout of one layer's cache on the GPU: `[batch, n_kv_head, capacity, head_dim]`, each
/// key/value head's positions contiguous.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCacheLayout {
    pub shape: CachedAttention,
    pub batch: usize,
    pub capacity: usize,
}

impl DeviceCacheLayout {
    /// Elements of one layer's keys (and as many values).
    pub fn len(&self) -> usize {
        self.batch * self.shape.n_kv_head * self.capacity * self.shape.head_dim
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where position `pos` of key/value head `kv_head` of sequence `seq` starts.
    pub fn at(&self, seq: usize, kv_head: usize, pos: usize) -> usize {
        ((seq * self.shape.n_kv_head + kv_head) * self.capacity + pos) * self.shape.head_dim
    }
}

/// Stores the key and value heads of each row's `qkv` row (`qkv [rows, qkv_width]`) in `keys` and
/// `values` at its sequence and position (the kernel `kv_write`).
pub fn kv_write(
    keys: &mut [f32],
    values: &mut [f32],
    qkv: &[f32],
    rows: &[CachedRow],
    layout: &DeviceCacheLayout,
) {
    let shape = layout.shape;
    let (qw, kvw, hs) = (shape.q_width(), shape.kv_width(), shape.head_dim);
    for (row, qkv) in rows.iter().zip(qkv.chunks(shape.qkv_width())) {
        for j in 0..shape.n_kv_head {
            let slot = layout.at(row.seq, j, row.pos);
            keys[slot..][..hs].copy_from_slice(&qkv[qw + j * hs..][..hs]);
            values[slot..][..hs].copy_from_slice(&qkv[qw + kvw + j * hs..][..hs]);
        }
    }
}

/// The online softmax of one warp: running max, sum of weights, weighted values per dimension.
struct WarpState {
    max: f32,
    sum: f32,
    acc: Vec<f32>,
}

/// Each row's query heads over its sequence's positions `0..=pos` of the cache, into
/// `out [rows, n_head · head_dim]` (the kernel `decode_attention`: warp `w` takes the positions
/// `t ≡ w (mod DECODE_WARPS)`, the warps merged at the end).
pub fn decode_attention(
    out: &mut [f32],
    qkv: &[f32],
    keys: &[f32],
    values: &[f32],
    rows: &[CachedRow],
    layout: &DeviceCacheLayout,
) {
    let shape = layout.shape;
    let (hs, group) = (shape.head_dim, shape.n_head / shape.n_kv_head);
    let scale = 1.0 / (hs as f32).sqrt();
    for ((row, qkv), out) in
        rows.iter().zip(qkv.chunks(shape.qkv_width())).zip(out.chunks_mut(shape.q_width()))
    {
        for h in 0..shape.n_head {
            let query = &qkv[h * hs..][..hs];
            let head = layout.at(row.seq, h / group, 0);
            let warps: Vec<WarpState> = (0..DECODE_WARPS)
                .map(|warp| {
                    let mut state =
                        WarpState { max: f32::NEG_INFINITY, sum: 0.0, acc: vec![0.0; hs] };
                    for t in (warp..=row.pos).step_by(DECODE_WARPS) {
                        let key = &keys[head + t * hs..][..hs];
                        let value = &values[head + t * hs..][..hs];
                        let score = warp_dot(query, key) * scale;
                        let max = state.max.max(score);
                        let (keep, weight) = ((state.max - max).exp(), (score - max).exp());
                        state.sum = state.sum * keep + weight;
                        state
                            .acc
                            .iter_mut()
                            .zip(value)
                            .for_each(|(a, &v)| *a = *a * keep + weight * v);
                        state.max = max;
                    }
                    state
                })
                .collect();
            merge(&warps, &mut out[h * hs..][..hs]);
        }
    }
}

/// The warps' states merged into one head's output (empty warps, of max −∞, add nothing).
fn merge(warps: &[WarpState], out: &mut [f32]) {
    let max = warps.iter().fold(f32::NEG_INFINITY, |m, w| m.max(w.max));
    let seen = || warps.iter().filter(|w| w.max != f32::NEG_INFINITY);
    let total: f32 = seen().fold(0.0, |total, w| total + w.sum * (w.max - max).exp());
    for (d, o) in out.iter_mut().enumerate() {
        *o = seen().fold(0.0, |o, w| o + w.acc[d] * (w.max - max).exp()) / total;
    }
}

/// `q · k` as a warp computes it: lane `l` adds the products of dimensions `l, l + 32, …` in
/// order, then the lanes are summed by the butterfly of `warp_sum` (offsets 16, 8, 4, 2, 1).
fn warp_dot(q: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0.0f32; WARP];
    for (lane, partial) in lanes.iter_mut().enumerate() {
        for d in (lane..q.len()).step_by(WARP) {
            *partial += q[d] * k[d];
        }
    }
    let mut offset = WARP / 2;
    while offset > 0 {
        let before = lanes;
        lanes.iter_mut().enumerate().for_each(|(l, v)| *v = before[l] + before[l ^ offset]);
        offset /= 2;
    }
    lanes[0]
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::infer::KvCache;

    /// Six query heads over two key/value heads of 40 (a tail past the first 32 lanes).
    const SHAPE: CachedAttention = CachedAttention { n_head: 6, n_kv_head: 2, head_dim: 40 };

    fn random(len: usize, rng: &mut rand_chacha::ChaCha8Rng) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.5f32..1.5)).collect()
    }

    /// A prefill of three prompts (1, 3 and 11 positions: fewer positions than warps, and more),
    /// then two decode steps that skip a sequence: after each step, the twin's kv_write and
    /// decode_attention equal KvCache::attend (the exact softmax, in f64) on the same rows.
    #[test]
    fn the_twins_attend_as_the_exact_cached_attention_does() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let layout = DeviceCacheLayout { shape: SHAPE, batch: 3, capacity: 14 };
        let (mut keys, mut values) = (vec![0.0; layout.len()], vec![0.0; layout.len()]);
        let mut exact = KvCache::<f64>::new(1, SHAPE, 3, 14);
        let prompts: [&[u32]; 3] = [&[1], &[2, 3, 4], &[5; 11]];
        let mut steps = vec![exact.prefill(&prompts).unwrap().rows];
        steps.push(exact.decode(&[(2, 0), (0, 0)]).unwrap().rows);
        steps.push(exact.decode(&[(1, 0), (2, 0), (0, 0)]).unwrap().rows);
        // `attend` stores and reads by each row's position, whatever the cache counts as held.
        for (step, rows) in steps.iter().enumerate() {
            let qkv = random(rows.len() * SHAPE.qkv_width(), &mut rng);
            kv_write(&mut keys, &mut values, &qkv, rows, &layout);
            let mut twin = vec![0.0f32; rows.len() * SHAPE.q_width()];
            decode_attention(&mut twin, &qkv, &keys, &values, rows, &layout);
            let qkv64: Vec<f64> = qkv.iter().map(|&x| f64::from(x)).collect();
            let mut expected = vec![0.0f64; twin.len()];
            exact.attend(0, &qkv64, rows, &mut expected);
            let worst = twin
                .iter()
                .zip(&expected)
                .map(|(&t, &e)| (f64::from(t) - e).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-5, "step {step}: the twin is {worst} from the exact attention");
        }
    }

    /// kv_write puts key head j of a row at (seq, j, pos) and leaves every other slot alone.
    #[test]
    fn kv_write_stores_each_head_at_its_sequence_and_position() {
        let shape = CachedAttention { n_head: 2, n_kv_head: 2, head_dim: 2 };
        let layout = DeviceCacheLayout { shape, batch: 2, capacity: 3 };
        let (mut keys, mut values) = (vec![0.0; layout.len()], vec![0.0; layout.len()]);
        // q (4 values) | k heads [10, 11], [12, 13] | v heads [20, 21], [22, 23].
        let qkv = [0.0, 0.0, 0.0, 0.0, 10.0, 11.0, 12.0, 13.0, 20.0, 21.0, 22.0, 23.0];
        kv_write(&mut keys, &mut values, &qkv, &[CachedRow { seq: 1, pos: 2 }], &layout);
        let mut expected_keys = vec![0.0; layout.len()];
        expected_keys[layout.at(1, 0, 2)..][..2].copy_from_slice(&[10.0, 11.0]);
        expected_keys[layout.at(1, 1, 2)..][..2].copy_from_slice(&[12.0, 13.0]);
        assert_eq!(keys, expected_keys);
        assert_eq!((layout.at(1, 1, 2), values[layout.at(1, 1, 2)]), (22, 22.0));
        assert_eq!(values.iter().filter(|&&v| v != 0.0).count(), 4);
    }
}
