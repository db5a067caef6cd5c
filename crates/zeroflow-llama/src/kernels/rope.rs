//! Rotary position embeddings in `transformers`' `rotate_half` convention, fused with the packing
//! of the separate q, k and v projections into attention's `qkv` row `[q | k | v]`.
//!
//! Each head of width `d = head_dim` is rotated pair-wise on `(x[i], x[i + d/2])` for `i < d/2`,
//! by the angle `p · inv_freq[i]` at position `p` of the token in its sequence:
//! `q·cos + rotate_half(q)·sin` with `rotate_half(x) = [−x[d/2..], x[..d/2]]`, i.e.
//! `out[i] = x[i]·cos − x[i + d/2]·sin`, `out[i + d/2] = x[i + d/2]·cos + x[i]·sin`.
//! Queries and keys are rotated, values copied.

use rayon::prelude::*;
use zeroflow_nn::Float;

use crate::rope::RopeFreqs;

/// Token rows per task at least.
const ROWS_PER_TASK: usize = 8;

/// The sizes of one rotary launch: `t` tokens per sequence (a token's position is its row modulo
/// `t`), `n_head` query heads and `n_kv_head` key/value heads of `freqs.head_dim` each.
#[derive(Clone, Debug, PartialEq)]
pub struct Rotary {
    pub t: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub freqs: RopeFreqs,
}

impl Rotary {
    pub fn head_dim(&self) -> usize {
        self.freqs.head_dim
    }

    /// The width of a query row, `n_head · head_dim`.
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim()
    }

    /// The width of a key (or value) row, `n_kv_head · head_dim`.
    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim()
    }

    /// The width of a `qkv` row, `(n_head + 2 n_kv_head) · head_dim`.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// `(cos, sin)` of the angles of position `p`, `head_dim / 2` each, computed in `F` from the
    /// inverse frequencies rounded to `F` (as `transformers` does in f32).
    fn angles<F: Float>(&self, inv_freq: &[f64], p: usize) -> (Vec<F>, Vec<F>) {
        let p = F::of(p as f64);
        inv_freq.iter().map(|&f| F::of(f) * p).map(|angle| (angle.cos(), angle.sin())).unzip()
    }
}

/// `out = [x[i]·cos − x[i+h]·sin | x[i+h]·cos + x[i]·sin]` for each head of `x` (`h = d/2`).
fn rotate<F: Float>(out: &mut [F], x: &[F], cos: &[F], sin: &[F]) {
    let half = cos.len();
    for (out, x) in out.chunks_mut(2 * half).zip(x.chunks(2 * half)) {
        for i in 0..half {
            let (a, b) = (x[i], x[i + half]);
            out[i] = a * cos[i] - b * sin[i];
            out[i + half] = b * cos[i] + a * sin[i];
        }
    }
}

/// `dx += Rᵀ dy` for each head: the transpose of [`rotate`] (a rotation by the opposite angle).
fn rotate_back<F: Float>(dx: &mut [F], dy: &[F], cos: &[F], sin: &[F]) {
    let half = cos.len();
    for (dx, dy) in dx.chunks_mut(2 * half).zip(dy.chunks(2 * half)) {
        for i in 0..half {
            let (a, b) = (dy[i], dy[i + half]);
            dx[i] += a * cos[i] + b * sin[i];
            dx[i + half] += b * cos[i] - a * sin[i];
        }
    }
}

/// Shapes: `qkv [b·t, qkv_width]`, `q [b·t, n_head·d]`, `k` and `v [b·t, n_kv_head·d]`. Writes
/// `qkv = [rope(q) | rope(k) | v]` per token row.
pub fn rope_forward<F: Float>(qkv: &mut [F], q: &[F], k: &[F], v: &[F], shape: &Rotary) {
    rope_forward_at(qkv, q, k, v, shape, |row| row % shape.t);
}

/// [`rope_forward`] with each row's position given (the rows of a key/value-cached step, or of
/// packed rows: each token's position in its document);
/// `shape.t` is not used.
pub fn rope_forward_at<F: Float>(
    qkv: &mut [F],
    q: &[F],
    k: &[F],
    v: &[F],
    shape: &Rotary,
    position: impl Fn(usize) -> usize + Sync,
) {
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let inv_freq = shape.freqs.inv_freq();
    qkv.par_chunks_mut(shape.qkv_width()).enumerate().with_min_len(ROWS_PER_TASK).for_each(
        |(row, out)| {
            let (cos, sin) = shape.angles::<F>(&inv_freq, position(row));
            let (out_q, rest) = out.split_at_mut(qw);
            let (out_k, out_v) = rest.split_at_mut(kw);
            rotate(out_q, &q[row * qw..][..qw], &cos, &sin);
            rotate(out_k, &k[row * kw..][..kw], &cos, &sin);
            out_v.copy_from_slice(&v[row * kw..][..kw]);
        },
    );
}

/// Adds the gradients of [`rope_forward`] to `dq`, `dk` and `dv` from `dqkv`: the queries' and
/// keys' rotated back, the values' as they are.
pub fn rope_backward<F: Float>(
    dq: &mut [F],
    dk: &mut [F],
    dv: &mut [F],
    dqkv: &[F],
    shape: &Rotary,
) {
    rope_backward_at(dq, dk, dv, dqkv, shape, |row| row % shape.t);
}

/// [`rope_backward`] with each row's position given (packed rows: its position in its
/// document); `shape.t` is not used.
pub fn rope_backward_at<F: Float>(
    dq: &mut [F],
    dk: &mut [F],
    dv: &mut [F],
    dqkv: &[F],
    shape: &Rotary,
    position: impl Fn(usize) -> usize + Sync,
) {
    let (qw, kw) = (shape.q_width(), shape.kv_width());
    let inv_freq = shape.freqs.inv_freq();
    let grads = dq.par_chunks_mut(qw).zip(dk.par_chunks_mut(kw)).zip(dv.par_chunks_mut(kw));
    grads.zip(dqkv.par_chunks(shape.qkv_width())).enumerate().with_min_len(ROWS_PER_TASK).for_each(
        |(row, (((dq, dk), dv), dy))| {
            let (cos, sin) = shape.angles::<F>(&inv_freq, position(row));
            let (dy_q, rest) = dy.split_at(qw);
            let (dy_k, dy_v) = rest.split_at(kw);
            rotate_back(dq, dy_q, &cos, &sin);
            rotate_back(dk, dy_k, &cos, &sin);
            dv.iter_mut().zip(dy_v).for_each(|(g, &d)| *g += d);
        },
    );
}
