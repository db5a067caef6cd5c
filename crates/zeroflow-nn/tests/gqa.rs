//! Grouped-query attention on the CPU twin: `n_kv_head` key/value heads shared by groups of
//! `n_head / n_kv_head` query heads, in both forms (the weights kept, or only the log-sum-exp).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_nn::kernels::attention::{
    AttentionShape, attention_backward, attention_forward, flash_attention_backward,
    flash_attention_forward,
};

fn random(len: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// The shapes: several groups, one key/value head for all (multi-query), and odd sizes.
const SHAPES: [(usize, AttentionShape); 3] = [
    (2, AttentionShape { t: 7, c: 24, n_head: 6, n_kv_head: 2 }),
    (1, AttentionShape { t: 5, c: 12, n_head: 4, n_kv_head: 1 }),
    (3, AttentionShape { t: 4, c: 10, n_head: 2, n_kv_head: 1 }),
];

/// The attention written out the slow way, one (sequence, query head, query) at a time, with the
/// key/value head `h / (n_head / n_kv_head)` of every query head: `(out, att)`.
fn naive_forward(qkv: &[f64], batch: usize, shape: AttentionShape) -> (Vec<f64>, Vec<f64>) {
    let AttentionShape { t, c, n_head, n_kv_head } = shape;
    let hs = c / n_head;
    let width = c + 2 * n_kv_head * hs;
    let mut out = vec![0.0; batch * t * c];
    let mut att = vec![0.0; batch * n_head * t * t];
    for b in 0..batch {
        for h in 0..n_head {
            let g = h / (n_head / n_kv_head);
            let (q, k, v) = (h * hs, c + g * hs, c + n_kv_head * hs + g * hs);
            for t1 in 0..t {
                let row = |t2: usize, column: usize| &qkv[(b * t + t2) * width + column..][..hs];
                let scores: Vec<f64> = (0..=t1)
                    .map(|t2| {
                        let dot: f64 = row(t1, q).iter().zip(row(t2, k)).map(|(x, y)| x * y).sum();
                        dot / (hs as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                for (t2, score) in scores.iter().enumerate() {
                    let p = (score - max).exp() / sum;
                    att[((b * n_head + h) * t + t1) * t + t2] = p;
                    for (i, value) in row(t2, v).iter().enumerate() {
                        out[(b * t + t1) * c + h * hs + i] += p * value;
                    }
                }
            }
        }
    }
    (out, att)
}

/// `qkv` of a GQA shape as the multi-head `qkv [b, t, 3c]` in which every query head has its own
/// copy of its group's key and value.
fn expand_to_multi_head(qkv: &[f64], batch: usize, shape: AttentionShape) -> Vec<f64> {
    let AttentionShape { t, c, n_head, n_kv_head } = shape;
    let hs = c / n_head;
    let width = c + 2 * n_kv_head * hs;
    let mut expanded = vec![0.0; batch * t * 3 * c];
    for row in 0..batch * t {
        let (from, to) = (&qkv[row * width..][..width], &mut expanded[row * 3 * c..][..3 * c]);
        to[..c].copy_from_slice(&from[..c]);
        for h in 0..n_head {
            let g = h / (n_head / n_kv_head);
            to[c + h * hs..][..hs].copy_from_slice(&from[c + g * hs..][..hs]);
            let v = c + n_kv_head * hs + g * hs;
            to[2 * c + h * hs..][..hs].copy_from_slice(&from[v..][..hs]);
        }
    }
    expanded
}

/// The gradient of the expanded multi-head `qkv` as the GQA one: a key/value head's gradient is
/// the sum of its copies'.
fn fold_to_groups(dqkv: &[f64], batch: usize, shape: AttentionShape) -> Vec<f64> {
    let AttentionShape { t, c, n_head, n_kv_head } = shape;
    let hs = c / n_head;
    let width = c + 2 * n_kv_head * hs;
    let mut folded = vec![0.0; batch * t * width];
    for row in 0..batch * t {
        let (from, to) = (&dqkv[row * 3 * c..][..3 * c], &mut folded[row * width..][..width]);
        to[..c].copy_from_slice(&from[..c]);
        for h in 0..n_head {
            let g = h / (n_head / n_kv_head);
            for i in 0..hs {
                to[c + g * hs + i] += from[c + h * hs + i];
                to[c + n_kv_head * hs + g * hs + i] += from[2 * c + h * hs + i];
            }
        }
    }
    folded
}

fn max_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Both forms' outputs (and the kept weights) match the naive attention, in f64.
#[test]
fn grouped_query_attention_matches_the_naive_attention() {
    for (seed, &(batch, shape)) in SHAPES.iter().enumerate() {
        let AttentionShape { t, c, n_head, .. } = shape;
        let qkv = random(batch * t * shape.qkv_width(), seed as u64);
        let (out_ref, att_ref) = naive_forward(&qkv, batch, shape);
        let mut out = vec![f64::NAN; batch * t * c];
        let mut att = vec![f64::NAN; batch * n_head * t * t];
        attention_forward(&mut out, &mut att, &qkv, shape);
        assert!(max_difference(&out, &out_ref) < 1e-12, "{shape:?}: out");
        assert!(max_difference(&att, &att_ref) < 1e-12, "{shape:?}: att");
        let mut flash_out = vec![f64::NAN; out.len()];
        let mut lse = vec![f64::NAN; batch * n_head * t];
        flash_attention_forward(&mut flash_out, &mut lse, &qkv, shape);
        assert!(max_difference(&flash_out, &out_ref) < 1e-12, "{shape:?}: flash out");
    }
}

/// The gradients of both forms are those of multi-head attention over the expanded `qkv` (whose
/// gradients are checked against finite differences), each key/value head's summed over its
/// group; and multi-head attention over the expanded `qkv` gives the same output.
#[test]
fn grouped_query_gradients_are_the_multi_head_ones_summed_over_each_group() {
    for (seed, &(batch, shape)) in SHAPES.iter().enumerate() {
        let AttentionShape { t, c, n_head, .. } = shape;
        let mha = AttentionShape::multi_head(t, c, n_head);
        let qkv = random(batch * t * shape.qkv_width(), 10 + seed as u64);
        let dout = random(batch * t * c, 20 + seed as u64);
        let expanded = expand_to_multi_head(&qkv, batch, shape);
        let mut out_mha = vec![0.0; batch * t * c];
        let mut att_mha = vec![0.0; batch * n_head * t * t];
        attention_forward(&mut out_mha, &mut att_mha, &expanded, mha);
        let mut dqkv_mha = vec![0.0; expanded.len()];
        let mut dscores = vec![0.0; att_mha.len()];
        attention_backward(&mut dqkv_mha, &mut dscores, &dout, &expanded, &att_mha, mha);
        let expected = fold_to_groups(&dqkv_mha, batch, shape);

        let (mut out, mut att) = (vec![0.0; out_mha.len()], vec![0.0; att_mha.len()]);
        attention_forward(&mut out, &mut att, &qkv, shape);
        assert!(max_difference(&out, &out_mha) < 1e-12, "{shape:?}: out");
        let mut dqkv = vec![0.0; qkv.len()];
        attention_backward(&mut dqkv, &mut dscores, &dout, &qkv, &att, shape);
        assert!(max_difference(&dqkv, &expected) < 1e-12, "{shape:?}: dqkv");

        let mut lse = vec![0.0; batch * n_head * t];
        flash_attention_forward(&mut out, &mut lse, &qkv, shape);
        let mut flash_dqkv = vec![0.0; qkv.len()];
        flash_attention_backward(&mut flash_dqkv, &dout, &qkv, &out, &lse, shape);
        assert!(max_difference(&flash_dqkv, &expected) < 1e-12, "{shape:?}: flash dqkv");
    }
}

/// The grouped-query gradient of `loss = Σ dout · out` against central finite differences at
/// every element of `qkv` (queries, and the keys and values each group shares), in f64.
#[test]
fn grouped_query_gradients_match_finite_differences() {
    let (batch, shape) = SHAPES[0];
    let AttentionShape { t, c, n_head, .. } = shape;
    let qkv = random(batch * t * shape.qkv_width(), 30);
    let dout = random(batch * t * c, 31);
    let loss = |qkv: &[f64]| -> f64 {
        let (mut out, mut att) = (vec![0.0; batch * t * c], vec![0.0; batch * n_head * t * t]);
        attention_forward(&mut out, &mut att, qkv, shape);
        out.iter().zip(&dout).map(|(o, d)| o * d).sum()
    };
    let (mut out, mut att) = (vec![0.0; batch * t * c], vec![0.0; batch * n_head * t * t]);
    attention_forward(&mut out, &mut att, &qkv, shape);
    let (mut dqkv, mut dscores) = (vec![0.0; qkv.len()], vec![0.0; att.len()]);
    attention_backward(&mut dqkv, &mut dscores, &dout, &qkv, &att, shape);
    let eps = 1e-6;
    for i in 0..qkv.len() {
        let (mut plus, mut minus) = (qkv.clone(), qkv.clone());
        plus[i] += eps;
        minus[i] -= eps;
        let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps);
        assert!((numeric - dqkv[i]).abs() < 1e-7, "element {i}: {numeric} vs {}", dqkv[i]);
    }
}
