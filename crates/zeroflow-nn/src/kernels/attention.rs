//! Causal multi-head self-attention over a fused `qkv` row `[q | k | v]` of width `3c`.
//!
//! Each kernel works in parallel phases so that every task owns what it writes: one task per
//! (sequence, head) over that head's `t × t` block of attention weights (or its `t` log-sum-exps),
//! one task per token row over its output row.
//!
//! Two forms, which the plan picks by [`crate::plan::AttentionKind`]: [`attention_forward`] keeps
//! the softmax output `att` for [`attention_backward`]; [`flash_attention_forward`] keeps only the
//! log-sum-exp of each query row, from which [`flash_attention_backward`] recomputes the weights,
//! as FlashAttention does on the GPU. Both give the same gradients (up to rounding).

use rayon::prelude::*;

use crate::float::Float;

/// Token rows per task at least, in the per-row phases (each row is little work).
const ROWS_PER_TASK: usize = 8;

/// Shapes: `out [b, t, c]`, `att [b, n_head, t, t]` (the attention weights; the masked entries
/// above the diagonal are zero), `qkv [b, t, 3c]`.
pub fn attention_forward<F: Float>(
    out: &mut [F],
    att: &mut [F],
    qkv: &[F],
    t: usize,
    c: usize,
    n_head: usize,
) {
    let hs = c / n_head;
    let scale = F::one() / F::of(hs as f64).sqrt();
    let at = |b: usize, row: usize, column: usize| b * t * 3 * c + row * 3 * c + column;
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, att)| {
        let (b, h) = (bh / n_head, bh % n_head);
        for t1 in 0..t {
            let query = &qkv[at(b, t1, h * hs)..][..hs];
            let (row, masked) = att[t1 * t..][..t].split_at_mut(t1 + 1);
            let mut max = F::neg_infinity();
            for (t2, score) in row.iter_mut().enumerate() {
                *score = dot(query, &qkv[at(b, t2, c + h * hs)..][..hs]) * scale;
                max = max.max(*score);
            }
            let mut sum = F::zero();
            for a in row.iter_mut() {
                *a = (*a - max).exp();
                sum += *a;
            }
            row.iter_mut().for_each(|a| *a = *a / sum);
            masked.fill(F::zero());
        }
    });
    let att = &*att;
    out.par_chunks_mut(c).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, out)| {
        let (b, t1) = (bt / t, bt % t);
        out.fill(F::zero());
        for h in 0..n_head {
            let weights = &att[((b * n_head + h) * t + t1) * t..][..=t1];
            let out = &mut out[h * hs..][..hs];
            for (t2, &a) in weights.iter().enumerate() {
                let value = &qkv[at(b, t2, 2 * c + h * hs)..][..hs];
                out.iter_mut().zip(value).for_each(|(o, &v)| *o += a * v);
            }
        }
    });
}

/// Adds the gradients of [`attention_forward`] to `dqkv`. `dscores [b, n_head, t, t]` is scratch:
/// it is overwritten with the gradient of the pre-softmax scores.
#[allow(clippy::too_many_arguments, reason = "the kernel's inputs and outputs, as in llm.c")]
pub fn attention_backward<F: Float>(
    dqkv: &mut [F],
    dscores: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    t: usize,
    c: usize,
    n_head: usize,
) {
    let hs = c / n_head;
    let scale = F::one() / F::of(hs as f64).sqrt();
    let at = |b: usize, row: usize, column: usize| b * t * 3 * c + row * 3 * c + column;
    let dout_at = |b: usize, row: usize, h: usize| &dout[b * t * c + row * c + h * hs..][..hs];
    // The gradient of the scores: through `out = att @ v`, then the softmax.
    dscores.par_chunks_mut(t * t).enumerate().for_each(|(bh, dscores)| {
        let (b, h) = (bh / n_head, bh % n_head);
        for t1 in 0..t {
            let weights = &att[(bh * t + t1) * t..][..=t1];
            let (row, masked) = dscores[t1 * t..][..t].split_at_mut(t1 + 1);
            let dout_row = dout_at(b, t1, h);
            for (t2, datt) in row.iter_mut().enumerate() {
                *datt = dot(&qkv[at(b, t2, 2 * c + h * hs)..][..hs], dout_row);
            }
            let weighted: F = weights.iter().zip(row.iter()).map(|(&a, &d)| a * d).sum();
            row.iter_mut().zip(weights).for_each(|(g, &a)| *g = a * (*g - weighted));
            masked.fill(F::zero());
        }
    });
    let dscores = &*dscores;
    // Each token row: dq from its own scores row, dk and dv from its column of every later row.
    dqkv.par_chunks_mut(3 * c).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, drow)| {
        let (b, t0) = (bt / t, bt % t);
        for h in 0..n_head {
            let block = (b * n_head + h) * t * t;
            let (dq, rest) = drow[h * hs..].split_at_mut(c);
            let (dk, rest) = rest.split_at_mut(c);
            let dv = &mut rest[..hs];
            for t2 in 0..=t0 {
                let g = dscores[block + t0 * t + t2] * scale;
                let key = &qkv[at(b, t2, c + h * hs)..][..hs];
                dq[..hs].iter_mut().zip(key).for_each(|(d, &k)| *d += g * k);
            }
            for t1 in t0..t {
                let g = dscores[block + t1 * t + t0] * scale;
                let query = &qkv[at(b, t1, h * hs)..][..hs];
                dk[..hs].iter_mut().zip(query).for_each(|(d, &q)| *d += g * q);
                let a = att[block + t1 * t + t0];
                dv.iter_mut().zip(dout_at(b, t1, h)).for_each(|(d, &o)| *d += a * o);
            }
        }
    });
}

/// [`attention_forward`] keeping, instead of the weights, `lse [b, n_head, t]`: the log-sum-exp
/// `log Σ_{t2 ≤ t1} exp(scale · q_t1·k_t2)` of each query row, so that a weight is
/// `exp(scale · q·k − lse)`. `out [b, t, c]` and `qkv [b, t, 3c]` as there.
pub fn flash_attention_forward<F: Float>(
    out: &mut [F],
    lse: &mut [F],
    qkv: &[F],
    t: usize,
    c: usize,
    n_head: usize,
) {
    let hs = c / n_head;
    let heads = Heads { qkv, t, c, hs, scale: F::one() / F::of(hs as f64).sqrt() };
    // The log-sum-exp of each row in one pass over its scores (the running max and sum).
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse)| {
        let (b, h) = (bh / n_head, bh % n_head);
        for (t1, lse) in lse.iter_mut().enumerate() {
            let (mut max, mut sum) = (F::neg_infinity(), F::zero());
            for t2 in 0..=t1 {
                let score = heads.score(b, h, t1, t2);
                if score > max {
                    sum *= (max - score).exp();
                    max = score;
                }
                sum += (score - max).exp();
            }
            *lse = max + sum.ln();
        }
    });
    let lse = &*lse;
    out.par_chunks_mut(c).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, out)| {
        let (b, t1) = (bt / t, bt % t);
        out.fill(F::zero());
        for h in 0..n_head {
            let lse = lse[(b * n_head + h) * t + t1];
            let out = &mut out[h * hs..][..hs];
            for t2 in 0..=t1 {
                let weight = (heads.score(b, h, t1, t2) - lse).exp();
                out.iter_mut().zip(heads.v(b, t2, h)).for_each(|(o, &v)| *o += weight * v);
            }
        }
    });
}

/// Adds the gradients of [`flash_attention_forward`] to `dqkv`, given its `out` and `lse`: the
/// weights recomputed as `P = exp(score − lse)`, and the softmax's backward through `delta = Σ_d
/// dout·out` of each query row, as FlashAttention does. The gradients of [`attention_backward`],
/// without its `t × t` scratch.
#[allow(clippy::too_many_arguments, reason = "the kernel's inputs and outputs, as in llm.c")]
pub fn flash_attention_backward<F: Float>(
    dqkv: &mut [F],
    dout: &[F],
    qkv: &[F],
    out: &[F],
    lse: &[F],
    t: usize,
    c: usize,
    n_head: usize,
) {
    let hs = c / n_head;
    let heads = Heads { qkv, t, c, hs, scale: F::one() / F::of(hs as f64).sqrt() };
    let dout_at = |b: usize, t1: usize, h: usize| &dout[b * t * c + t1 * c + h * hs..][..hs];
    let out_at = |b: usize, t1: usize, h: usize| &out[b * t * c + t1 * c + h * hs..][..hs];
    // The weight of (query t1, key t2) and the gradient of its scaled score, given delta of t1.
    let weight_and_grad = |b: usize, h: usize, t1: usize, t2: usize, delta: F| -> (F, F) {
        let p = (heads.score(b, h, t1, t2) - lse[(b * n_head + h) * t + t1]).exp();
        let dp = dot(dout_at(b, t1, h), heads.v(b, t2, h));
        (p, p * (dp - delta) * heads.scale)
    };
    // delta of every query row, `[b, n_head, t]` like lse: each row's is read by every key.
    let mut deltas = vec![F::zero(); lse.len()];
    deltas.par_chunks_mut(t).enumerate().for_each(|(bh, deltas)| {
        let (b, h) = (bh / n_head, bh % n_head);
        for (t1, d) in deltas.iter_mut().enumerate() {
            *d = dot(dout_at(b, t1, h), out_at(b, t1, h));
        }
    });
    let delta = |b: usize, h: usize, t1: usize| deltas[(b * n_head + h) * t + t1];
    // Each token row: dq from its own scores row, dk and dv from its column of every later row.
    dqkv.par_chunks_mut(3 * c).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, drow)| {
        let (b, t0) = (bt / t, bt % t);
        for h in 0..n_head {
            let (dq, rest) = drow[h * hs..].split_at_mut(c);
            let (dk, rest) = rest.split_at_mut(c);
            let dv = &mut rest[..hs];
            let delta_t0 = delta(b, h, t0);
            for t2 in 0..=t0 {
                let (_, g) = weight_and_grad(b, h, t0, t2, delta_t0);
                dq[..hs].iter_mut().zip(heads.k(b, t2, h)).for_each(|(d, &k)| *d += g * k);
            }
            for t1 in t0..t {
                let (p, g) = weight_and_grad(b, h, t1, t0, delta(b, h, t1));
                dk[..hs].iter_mut().zip(heads.q(b, t1, h)).for_each(|(d, &q)| *d += g * q);
                dv.iter_mut().zip(dout_at(b, t1, h)).for_each(|(d, &o)| *d += p * o);
            }
        }
    });
}

/// The heads of a `qkv [b, t, 3c]` tensor and the scale of their scores.
struct Heads<'a, F> {
    qkv: &'a [F],
    t: usize,
    c: usize,
    hs: usize,
    scale: F,
}

impl<F: Float> Heads<'_, F> {
    /// Part `part` (0 q, 1 k, 2 v) of head `h` of token `t1` of sequence `b`.
    fn head(&self, b: usize, t1: usize, part: usize, h: usize) -> &[F] {
        let Heads { t, c, hs, .. } = *self;
        &self.qkv[(b * t + t1) * 3 * c + part * c + h * hs..][..hs]
    }

    fn q(&self, b: usize, t1: usize, h: usize) -> &[F] {
        self.head(b, t1, 0, h)
    }

    fn k(&self, b: usize, t1: usize, h: usize) -> &[F] {
        self.head(b, t1, 1, h)
    }

    fn v(&self, b: usize, t1: usize, h: usize) -> &[F] {
        self.head(b, t1, 2, h)
    }

    /// `scale · q_t1·k_t2` of head `h` of sequence `b`.
    fn score(&self, b: usize, h: usize, t1: usize, t2: usize) -> F {
        dot(self.q(b, t1, h), self.k(b, t2, h)) * self.scale
    }
}

fn dot<F: Float>(a: &[F], b: &[F]) -> F {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}
