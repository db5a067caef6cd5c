//! Causal self-attention over a fused `qkv` row `[q | k | v]`: `n_head` query heads and
//! `n_kv_head` key/value heads of the same size `hs`, so a row is `(n_head + 2 n_kv_head) hs`
//! wide (`3c` with as many key/value heads as query heads). Query head `h` attends with key/value
//! head `h / (n_head / n_kv_head)` (grouped-query attention; multi-head where the counts are
//! equal, multi-query where there is one key/value head).
//!
//! Each kernel works in parallel phases so that every task owns what it writes: one task per
//! (sequence, head) over that head's `t × t` block of attention weights (or its `t` log-sum-exps),
//! one task per token row over its output row (and the gradients of its q, k and v).
//!
//! Two forms, which the plan picks by [`crate::plan::AttentionKind`]: [`attention_forward`] keeps
//! the softmax output `att` for [`attention_backward`]; [`flash_attention_forward`] keeps only the
//! log-sum-exp of each query row, from which [`flash_attention_backward`] recomputes the weights,
//! as FlashAttention does on the GPU. Both give the same gradients (up to rounding).
//!
//! Packed rows (several documents per row, [`crate::plan::PlanOptions::packed`]) go through the
//! `_packed` forms, which take each token's position in its document, `positions [b, t]`: query
//! `t1` attends only the keys `t1 − positions[t1] ..= t1`, its own document's, so no attention
//! crosses a document boundary. Without positions every query's first key is 0 and the
//! arithmetic is exactly that of the plain forms (which call the same code).

use rayon::prelude::*;

use crate::float::Float;

/// Token rows per task at least, in the per-row phases (each row is little work).
const ROWS_PER_TASK: usize = 8;

/// The sizes of one attention: `t` tokens per sequence, `c = n_head · hs` channels of queries (and
/// of the output), `n_kv_head` key/value heads, which must divide `n_head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    pub t: usize,
    pub c: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
}

impl AttentionShape {
    /// Multi-head attention: as many key/value heads as query heads (GPT-2's).
    pub fn multi_head(t: usize, c: usize, n_head: usize) -> Self {
        AttentionShape { t, c, n_head, n_kv_head: n_head }
    }

    /// The size of every head.
    pub fn head_size(&self) -> usize {
        self.c / self.n_head
    }

    /// The width of the keys (and of the values) of a token row: `n_kv_head · hs`.
    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_size()
    }

    /// The width of a `qkv` row: `c + 2 · n_kv_head · hs`.
    pub fn qkv_width(&self) -> usize {
        self.c + 2 * self.kv_width()
    }

    /// Whether every query head has a key/value head of its own.
    pub fn is_multi_head(&self) -> bool {
        self.n_kv_head == self.n_head
    }

    /// The key/value head query head `h` attends with.
    fn kv_head(&self, h: usize) -> usize {
        h / (self.n_head / self.n_kv_head)
    }

    /// The columns of a `qkv` row where head `h`'s query starts, and where its key/value head's
    /// key and value start.
    fn columns(&self, h: usize) -> (usize, usize, usize) {
        let (hs, kv) = (self.head_size(), self.kv_head(h));
        (h * hs, self.c + kv * hs, self.c + self.kv_width() + kv * hs)
    }
}

/// Shapes: `out [b, t, c]`, `att [b, n_head, t, t]` (the attention weights; the masked entries
/// above the diagonal are zero), `qkv [b, t, qkv_width]`.
pub fn attention_forward<F: Float>(out: &mut [F], att: &mut [F], qkv: &[F], shape: AttentionShape) {
    attention_forward_within(out, att, qkv, None, shape);
}

/// [`attention_forward`] of packed rows: each query attends its own document's keys only
/// (`positions [b, t]`, each token's position in its document); the weights outside that range
/// are zero.
pub fn attention_forward_packed<F: Float>(
    out: &mut [F],
    att: &mut [F],
    qkv: &[F],
    positions: &[u32],
    shape: AttentionShape,
) {
    attention_forward_within(out, att, qkv, Some(positions), shape);
}

fn attention_forward_within<F: Float>(
    out: &mut [F],
    att: &mut [F],
    qkv: &[F],
    positions: Option<&[u32]>,
    shape: AttentionShape,
) {
    let AttentionShape { t, c, n_head, .. } = shape;
    let first_key = FirstKey { positions, t };
    let (hs, width) = (shape.head_size(), shape.qkv_width());
    let scale = F::one() / F::of(hs as f64).sqrt();
    let at = |b: usize, row: usize, column: usize| b * t * width + row * width + column;
    att.par_chunks_mut(t * t).enumerate().for_each(|(bh, att)| {
        let (b, h) = (bh / n_head, bh % n_head);
        let (q_column, k_column, _) = shape.columns(h);
        for t1 in 0..t {
            let first = first_key.of(b, t1);
            let query = &qkv[at(b, t1, q_column)..][..hs];
            let (row, masked) = att[t1 * t..][..t].split_at_mut(t1 + 1);
            let (other_documents, row) = row.split_at_mut(first);
            let mut max = F::neg_infinity();
            for (t2, score) in (first..).zip(row.iter_mut()) {
                *score = dot(query, &qkv[at(b, t2, k_column)..][..hs]) * scale;
                max = max.max(*score);
            }
            let mut sum = F::zero();
            for a in row.iter_mut() {
                *a = (*a - max).exp();
                sum += *a;
            }
            row.iter_mut().for_each(|a| *a = *a / sum);
            other_documents.fill(F::zero());
            masked.fill(F::zero());
        }
    });
    let att = &*att;
    out.par_chunks_mut(c).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, out)| {
        let (b, t1) = (bt / t, bt % t);
        out.fill(F::zero());
        let first = first_key.of(b, t1);
        for h in 0..n_head {
            let weights = &att[((b * n_head + h) * t + t1) * t..][first..=t1];
            let out = &mut out[h * hs..][..hs];
            let (_, _, v_column) = shape.columns(h);
            for (t2, &a) in (first..).zip(weights) {
                let value = &qkv[at(b, t2, v_column)..][..hs];
                out.iter_mut().zip(value).for_each(|(o, &v)| *o += a * v);
            }
        }
    });
}

/// Adds the gradients of [`attention_forward`] to `dqkv`. `dscores [b, n_head, t, t]` is scratch:
/// it is overwritten with the gradient of the pre-softmax scores. A key/value head's gradients
/// sum over the query heads of its group, in head order.
pub fn attention_backward<F: Float>(
    dqkv: &mut [F],
    dscores: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    shape: AttentionShape,
) {
    attention_backward_within(dqkv, dscores, dout, qkv, att, None, shape);
}

/// [`attention_backward`] of [`attention_forward_packed`], with the same `positions`.
pub fn attention_backward_packed<F: Float>(
    dqkv: &mut [F],
    dscores: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    positions: &[u32],
    shape: AttentionShape,
) {
    attention_backward_within(dqkv, dscores, dout, qkv, att, Some(positions), shape);
}

fn attention_backward_within<F: Float>(
    dqkv: &mut [F],
    dscores: &mut [F],
    dout: &[F],
    qkv: &[F],
    att: &[F],
    positions: Option<&[u32]>,
    shape: AttentionShape,
) {
    let AttentionShape { t, c, n_head, .. } = shape;
    let first_key = FirstKey { positions, t };
    let (hs, width, kv_width) = (shape.head_size(), shape.qkv_width(), shape.kv_width());
    let scale = F::one() / F::of(hs as f64).sqrt();
    let at = |b: usize, row: usize, column: usize| b * t * width + row * width + column;
    let dout_at = |b: usize, row: usize, h: usize| &dout[b * t * c + row * c + h * hs..][..hs];
    // The gradient of the scores: through `out = att @ v`, then the softmax.
    dscores.par_chunks_mut(t * t).enumerate().for_each(|(bh, dscores)| {
        let (b, h) = (bh / n_head, bh % n_head);
        let (_, _, v_column) = shape.columns(h);
        for t1 in 0..t {
            let first = first_key.of(b, t1);
            let weights = &att[(bh * t + t1) * t..][first..=t1];
            let (row, masked) = dscores[t1 * t..][..t].split_at_mut(t1 + 1);
            let (other_documents, row) = row.split_at_mut(first);
            let dout_row = dout_at(b, t1, h);
            for (t2, datt) in (first..).zip(row.iter_mut()) {
                *datt = dot(&qkv[at(b, t2, v_column)..][..hs], dout_row);
            }
            let weighted: F = weights.iter().zip(row.iter()).map(|(&a, &d)| a * d).sum();
            row.iter_mut().zip(weights).for_each(|(g, &a)| *g = a * (*g - weighted));
            other_documents.fill(F::zero());
            masked.fill(F::zero());
        }
    });
    let dscores = &*dscores;
    // Each token row: dq from its own scores row, dk and dv from its column of every later row.
    dqkv.par_chunks_mut(width).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, drow)| {
        let (b, t0) = (bt / t, bt % t);
        let (dq_row, rest) = drow.split_at_mut(c);
        let (dk_row, dv_row) = rest.split_at_mut(kv_width);
        for h in 0..n_head {
            let block = (b * n_head + h) * t * t;
            let (q_column, k_column, _) = shape.columns(h);
            let kv = shape.kv_head(h) * hs;
            let (dq, dk, dv) =
                (&mut dq_row[h * hs..][..hs], &mut dk_row[kv..][..hs], &mut dv_row[kv..][..hs]);
            for t2 in first_key.of(b, t0)..=t0 {
                let g = dscores[block + t0 * t + t2] * scale;
                let key = &qkv[at(b, t2, k_column)..][..hs];
                dq.iter_mut().zip(key).for_each(|(d, &k)| *d += g * k);
            }
            for t1 in first_key.queries_of(b, t0) {
                let g = dscores[block + t1 * t + t0] * scale;
                let query = &qkv[at(b, t1, q_column)..][..hs];
                dk.iter_mut().zip(query).for_each(|(d, &q)| *d += g * q);
                let a = att[block + t1 * t + t0];
                dv.iter_mut().zip(dout_at(b, t1, h)).for_each(|(d, &o)| *d += a * o);
            }
        }
    });
}

/// [`attention_forward`] keeping, instead of the weights, `lse [b, n_head, t]`: the log-sum-exp
/// `log Σ_{t2 ≤ t1} exp(scale · q_t1·k_t2)` of each query row, so that a weight is
/// `exp(scale · q·k − lse)`. `out [b, t, c]` and `qkv [b, t, qkv_width]` as there.
pub fn flash_attention_forward<F: Float>(
    out: &mut [F],
    lse: &mut [F],
    qkv: &[F],
    shape: AttentionShape,
) {
    flash_attention_forward_within(out, lse, qkv, None, shape);
}

/// [`flash_attention_forward`] of packed rows: each query attends its own document's keys only
/// (`positions [b, t]`, each token's position in its document), its log-sum-exp over them.
pub fn flash_attention_forward_packed<F: Float>(
    out: &mut [F],
    lse: &mut [F],
    qkv: &[F],
    positions: &[u32],
    shape: AttentionShape,
) {
    flash_attention_forward_within(out, lse, qkv, Some(positions), shape);
}

fn flash_attention_forward_within<F: Float>(
    out: &mut [F],
    lse: &mut [F],
    qkv: &[F],
    positions: Option<&[u32]>,
    shape: AttentionShape,
) {
    let AttentionShape { t, c, n_head, .. } = shape;
    let first_key = FirstKey { positions, t };
    let hs = shape.head_size();
    let heads = Heads { qkv, shape, hs, scale: F::one() / F::of(hs as f64).sqrt() };
    // The log-sum-exp of each row in one pass over its scores (the running max and sum).
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse)| {
        let (b, h) = (bh / n_head, bh % n_head);
        for (t1, lse) in lse.iter_mut().enumerate() {
            let (mut max, mut sum) = (F::neg_infinity(), F::zero());
            for t2 in first_key.of(b, t1)..=t1 {
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
            for t2 in first_key.of(b, t1)..=t1 {
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
pub fn flash_attention_backward<F: Float>(
    dqkv: &mut [F],
    dout: &[F],
    qkv: &[F],
    out: &[F],
    lse: &[F],
    shape: AttentionShape,
) {
    flash_attention_backward_within(dqkv, dout, qkv, out, lse, None, shape);
}

/// [`flash_attention_backward`] of [`flash_attention_forward_packed`], with the same
/// `positions`.
pub fn flash_attention_backward_packed<F: Float>(
    dqkv: &mut [F],
    dout: &[F],
    qkv: &[F],
    out: &[F],
    lse: &[F],
    positions: &[u32],
    shape: AttentionShape,
) {
    flash_attention_backward_within(dqkv, dout, qkv, out, lse, Some(positions), shape);
}

fn flash_attention_backward_within<F: Float>(
    dqkv: &mut [F],
    dout: &[F],
    qkv: &[F],
    out: &[F],
    lse: &[F],
    positions: Option<&[u32]>,
    shape: AttentionShape,
) {
    let AttentionShape { t, c, n_head, .. } = shape;
    let first_key = FirstKey { positions, t };
    let (hs, width, kv_width) = (shape.head_size(), shape.qkv_width(), shape.kv_width());
    let heads = Heads { qkv, shape, hs, scale: F::one() / F::of(hs as f64).sqrt() };
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
    dqkv.par_chunks_mut(width).enumerate().with_min_len(ROWS_PER_TASK).for_each(|(bt, drow)| {
        let (b, t0) = (bt / t, bt % t);
        let (dq_row, rest) = drow.split_at_mut(c);
        let (dk_row, dv_row) = rest.split_at_mut(kv_width);
        for h in 0..n_head {
            let kv = shape.kv_head(h) * hs;
            let (dq, dk, dv) =
                (&mut dq_row[h * hs..][..hs], &mut dk_row[kv..][..hs], &mut dv_row[kv..][..hs]);
            let delta_t0 = delta(b, h, t0);
            for t2 in first_key.of(b, t0)..=t0 {
                let (_, g) = weight_and_grad(b, h, t0, t2, delta_t0);
                dq.iter_mut().zip(heads.k(b, t2, h)).for_each(|(d, &k)| *d += g * k);
            }
            for t1 in first_key.queries_of(b, t0) {
                let (p, g) = weight_and_grad(b, h, t1, t0, delta(b, h, t1));
                dk.iter_mut().zip(heads.q(b, t1, h)).for_each(|(d, &q)| *d += g * q);
                dv.iter_mut().zip(dout_at(b, t1, h)).for_each(|(d, &o)| *d += p * o);
            }
        }
    });
}

/// Where each query's keys start: at 0 (causal attention over the whole row), or with packed
/// rows at its document's first token, `t1 − positions[b, t1]`.
#[derive(Clone, Copy)]
struct FirstKey<'a> {
    positions: Option<&'a [u32]>,
    t: usize,
}

impl FirstKey<'_> {
    /// The first key query `t1` of row `b` attends.
    fn of(&self, b: usize, t1: usize) -> usize {
        // The executors check that no position exceeds its index in the row; saturating keeps
        // a bad one from panicking here all the same.
        self.positions.map_or(0, |positions| t1.saturating_sub(positions[b * self.t + t1] as usize))
    }

    /// The queries of row `b` that attend key `t0`: `t0` and the later ones of its document.
    fn queries_of(self, b: usize, t0: usize) -> impl Iterator<Item = usize> {
        (t0..self.t).filter(move |&t1| self.of(b, t1) <= t0)
    }
}

/// The heads of a `qkv [b, t, qkv_width]` tensor and the scale of their scores.
struct Heads<'a, F> {
    qkv: &'a [F],
    shape: AttentionShape,
    hs: usize,
    scale: F,
}

impl<F: Float> Heads<'_, F> {
    /// The `hs` elements at `column` of token `t1` of sequence `b`.
    fn head(&self, b: usize, t1: usize, column: usize) -> &[F] {
        let (t, width) = (self.shape.t, self.shape.qkv_width());
        &self.qkv[(b * t + t1) * width + column..][..self.hs]
    }

    /// The query of head `h`.
    fn q(&self, b: usize, t1: usize, h: usize) -> &[F] {
        self.head(b, t1, self.shape.columns(h).0)
    }

    /// The key query head `h` attends with.
    fn k(&self, b: usize, t1: usize, h: usize) -> &[F] {
        self.head(b, t1, self.shape.columns(h).1)
    }

    /// The value query head `h` attends with.
    fn v(&self, b: usize, t1: usize, h: usize) -> &[F] {
        self.head(b, t1, self.shape.columns(h).2)
    }

    /// `scale · q_t1·k_t2` of head `h` of sequence `b`.
    fn score(&self, b: usize, h: usize, t1: usize, t2: usize) -> F {
        dot(self.q(b, t1, h), self.k(b, t2, h)) * self.scale
    }
}

fn dot<F: Float>(a: &[F], b: &[F]) -> F {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}
