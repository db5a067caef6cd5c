//! The Llama family's own kernels in f64: each backward against central finite differences of
//! `loss = Σ r · out` (for a random `r`) at every element of every input, and each forward against
//! the formula `transformers` writes.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_llama::kernels::Rotary;
use zeroflow_llama::kernels::embedding::{embedding_backward, embedding_forward};
use zeroflow_llama::kernels::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use zeroflow_llama::kernels::rope::{rope_backward, rope_forward};
use zeroflow_llama::kernels::swiglu::{swiglu_backward, swiglu_forward};
use zeroflow_llama::{Llama3RopeScaling, RopeFreqs};

fn random(len: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.5..1.5)).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Checks `analytic[j]` against the central difference of `loss` in every element of
/// `inputs[j]` (h = 1e-6): absolute error at most 1e-7 relative to the gradient's scale.
fn check_gradients(
    what: &str,
    inputs: &[Vec<f64>],
    analytic: &[Vec<f64>],
    loss: impl Fn(&[Vec<f64>]) -> f64,
) {
    let h = 1e-6;
    for (j, (input, grad)) in inputs.iter().zip(analytic).enumerate() {
        assert_eq!(input.len(), grad.len(), "{what}: input {j}");
        assert!(grad.iter().any(|&g| g != 0.0), "{what}: input {j} has no gradient");
        let scale = grad.iter().fold(1.0f64, |m, g| m.max(g.abs()));
        for i in 0..input.len() {
            let mut moved = inputs.to_vec();
            moved[j][i] = input[i] + h;
            let plus = loss(&moved);
            moved[j][i] = input[i] - h;
            let minus = loss(&moved);
            let numeric = (plus - minus) / (2.0 * h);
            assert!(
                (numeric - grad[i]).abs() <= 1e-7 * scale,
                "{what}: input {j} element {i}: numeric {numeric} analytic {}",
                grad[i]
            );
        }
    }
}

/// RMSNorm's output is `x / sqrt(mean(x²) + eps) · w` (`LlamaRMSNorm`), and its input and weight
/// gradients match finite differences, at a width that is not a multiple of the column blocks.
#[test]
fn rmsnorm_forward_is_llama_rmsnorm_and_its_gradients_match_finite_differences() {
    let (rows, c, eps) = (5, 70, 1e-5);
    let (x, w, r) = (random(rows * c, 1), random(c, 2), random(rows * c, 3));
    let forward = |x: &[f64], w: &[f64]| {
        let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
        rmsnorm_forward(&mut out, &mut rstd, x, w, c, eps);
        (out, rstd)
    };
    let (out, rstd) = forward(&x, &w);
    for row in 0..rows {
        let xs = &x[row * c..][..c];
        let variance = xs.iter().map(|v| v * v).sum::<f64>() / c as f64;
        assert!((rstd[row] - 1.0 / (variance + eps).sqrt()).abs() < 1e-12);
        for i in 0..c {
            let expected = w[i] * (xs[i] / (variance + eps).sqrt());
            assert!((out[row * c + i] - expected).abs() < 1e-12, "row {row} column {i}");
        }
    }
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; c]);
    rmsnorm_backward(&mut dx, &mut dw, &r, &x, &w, &rstd, c);
    check_gradients("rmsnorm", &[x.clone(), w.clone()], &[dx, dw], |v| {
        dot(&forward(&v[0], &v[1]).0, &r)
    });
}

/// Backward adds to the gradients it is given instead of overwriting them.
#[test]
fn rmsnorm_backward_adds_to_existing_gradients() {
    let (rows, c) = (3, 6);
    let (x, w, r) = (random(rows * c, 4), random(c, 5), random(rows * c, 6));
    let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
    rmsnorm_forward(&mut out, &mut rstd, &x, &w, c, 1e-6);
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; c]);
    rmsnorm_backward(&mut dx, &mut dw, &r, &x, &w, &rstd, c);
    let (mut dx2, mut dw2) = (vec![1.0; x.len()], vec![2.0; c]);
    rmsnorm_backward(&mut dx2, &mut dw2, &r, &x, &w, &rstd, c);
    assert!(dx.iter().zip(&dx2).all(|(a, b)| (a + 1.0 - b).abs() < 1e-12));
    assert!(dw.iter().zip(&dw2).all(|(a, b)| (a + 2.0 - b).abs() < 1e-12));
}

/// SwiGLU is `silu(gate) · up` and its gradients match finite differences (large |gate| included,
/// where the sigmoid saturates).
#[test]
fn swiglu_is_silu_gate_times_up_and_its_gradients_match_finite_differences() {
    let n = 4100;
    let mut gate = random(n, 7);
    gate[0] = 30.0;
    gate[1] = -30.0;
    let (up, r) = (random(n, 8), random(n, 9));
    let forward = |gate: &[f64], up: &[f64]| {
        let mut out = vec![0.0; n];
        swiglu_forward(&mut out, gate, up);
        out
    };
    let out = forward(&gate, &up);
    for i in 0..n {
        let silu = gate[i] / (1.0 + (-gate[i]).exp());
        assert!((out[i] - silu * up[i]).abs() < 1e-12, "element {i}");
    }
    let (mut dgate, mut dup) = (vec![0.0; n], vec![0.0; n]);
    swiglu_backward(&mut dgate, &mut dup, &r, &gate, &up);
    check_gradients("swiglu", &[gate.clone(), up.clone()], &[dgate, dup], |v| {
        dot(&forward(&v[0], &v[1]), &r)
    });
}

/// A rotary shape with grouped keys (3 query heads per key/value head), an odd sequence length
/// and two sequences.
fn rotary(scaling: Option<Llama3RopeScaling>) -> Rotary {
    Rotary {
        t: 5,
        n_head: 6,
        n_kv_head: 2,
        freqs: RopeFreqs { head_dim: 8, theta: 100.0, scaling },
    }
}

fn llama3_scaling() -> Llama3RopeScaling {
    Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    }
}

/// `transformers`' `apply_rotary_pov_emb` on one head: `x·cos + rotate_half(x)·sin` with
/// `cos = cat(cos(p·f), cos(p·f))`.
fn hf_rotate(x: &[f64], p: usize, inv_freq: &[f64]) -> Vec<f64> {
    let half = inv_freq.len();
    let emb: Vec<f64> = inv_freq.iter().chain(inv_freq).map(|f| p as f64 * f).collect();
    let rotated: Vec<f64> = x[half..].iter().map(|v| -v).chain(x[..half].iter().copied()).collect();
    (0..2 * half).map(|i| x[i] * emb[i].cos() + rotated[i] * emb[i].sin()).collect()
}

/// RoPE writes `[rope(q) | rope(k) | v]` with each query and key head rotated as
/// `transformers` rotates it at its position in its sequence, with and without llama3 scaling.
#[test]
fn rope_forward_rotates_each_head_as_transformers_and_packs_q_k_v() {
    for scaling in [None, Some(llama3_scaling())] {
        let shape = rotary(scaling);
        let (rows, d) = (2 * shape.t, shape.head_dim());
        let (q, k, v) = (
            random(rows * shape.q_width(), 10),
            random(rows * shape.kv_width(), 11),
            random(rows * shape.kv_width(), 12),
        );
        let mut qkv = vec![f64::NAN; rows * shape.qkv_width()];
        rope_forward(&mut qkv, &q, &k, &v, &shape);
        let inv_freq = shape.freqs.inv_freq();
        for row in 0..rows {
            let out = &qkv[row * shape.qkv_width()..][..shape.qkv_width()];
            let inputs = q[row * shape.q_width()..][..shape.q_width()]
                .chunks(d)
                .chain(k[row * shape.kv_width()..][..shape.kv_width()].chunks(d));
            for (head, x) in inputs.enumerate() {
                let expected = hf_rotate(x, row % shape.t, &inv_freq);
                let got = &out[head * d..][..d];
                let error =
                    got.iter().zip(&expected).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(error < 1e-12, "row {row} head {head}: {got:?} vs {expected:?}");
            }
            let values = &out[shape.q_width() + shape.kv_width()..];
            assert_eq!(values, &v[row * shape.kv_width()..][..shape.kv_width()]);
        }
    }
}

/// RoPE's gradients (to q, k and v) match finite differences.
#[test]
fn rope_gradients_match_finite_differences() {
    let shape = rotary(Some(llama3_scaling()));
    let rows = 2 * shape.t;
    let q = random(rows * shape.q_width(), 13);
    let (k, v) = (random(rows * shape.kv_width(), 14), random(rows * shape.kv_width(), 15));
    let r = random(rows * shape.qkv_width(), 16);
    let forward = |q: &[f64], k: &[f64], v: &[f64]| {
        let mut qkv = vec![0.0; rows * shape.qkv_width()];
        rope_forward(&mut qkv, q, k, v, &shape);
        qkv
    };
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    rope_backward(&mut dq, &mut dk, &mut dv, &r, &shape);
    check_gradients("rope", &[q, k, v], &[dq, dk, dv], |x| dot(&forward(&x[0], &x[1], &x[2]), &r));
}

/// Rotary's defining property: the score of a query at position m and a key at position n
/// depends on m − n only (checked at the positions of one sequence).
#[test]
fn rope_scores_depend_on_the_relative_position_only() {
    let shape = Rotary {
        t: 6,
        n_head: 1,
        n_kv_head: 1,
        freqs: RopeFreqs { head_dim: 6, theta: 10.0, scaling: None },
    };
    let (q_head, k_head) = (random(6, 17), random(6, 18));
    let q: Vec<f64> = (0..shape.t).flat_map(|_| q_head.clone()).collect();
    let k: Vec<f64> = (0..shape.t).flat_map(|_| k_head.clone()).collect();
    let mut qkv = vec![0.0; shape.t * shape.qkv_width()];
    rope_forward(&mut qkv, &q, &k, &vec![0.0; k.len()], &shape);
    let at = |row: usize, column: usize| &qkv[row * shape.qkv_width() + column..][..6];
    let score = |m: usize, n: usize| dot(at(m, 0), at(n, 6));
    for (m, n) in [(3, 1), (4, 2), (5, 3)] {
        assert!((score(m, n) - score(2, 0)).abs() < 1e-12, "({m}, {n})");
    }
    assert!((score(3, 0) - score(2, 0)).abs() > 1e-6, "another distance gives another score");
}

/// llama3 scaling keeps the high frequencies, divides the low ones by the factor and
/// interpolates between them, as `_compute_llama3_parameters` does (values worked by hand for
/// original context 16, factors 1 and 4: wavelengths below 4 kept, above 16 divided by 8).
#[test]
fn llama3_scaling_keeps_high_divides_low_and_interpolates_between() {
    let scaling = llama3_scaling();
    let two_pi = 2.0 * std::f64::consts::PI;
    let high = two_pi / 2.0; // wavelength 2
    assert_eq!(scaling.scale_inv_freq(high), high);
    let low = two_pi / 32.0; // wavelength 32
    assert!((scaling.scale_inv_freq(low) - low / 8.0).abs() < 1e-15);
    let medium = two_pi / 8.0; // wavelength 8: smooth = (16 / 8 − 1) / 3 = 1/3
    let expected = (2.0 / 3.0) * medium / 8.0 + medium / 3.0;
    assert!((scaling.scale_inv_freq(medium) - expected).abs() < 1e-15);
    let freqs = RopeFreqs { head_dim: 4, theta: 10_000.0, scaling: None };
    assert_eq!(freqs.inv_freq(), vec![1.0, 0.01]);
}

/// The embedding copies each token's row and its backward sums the rows of repeated tokens.
#[test]
fn embedding_copies_rows_and_sums_the_gradients_of_repeated_tokens() {
    let (vocab, c) = (7, 5);
    let wte = random(vocab * c, 19);
    let tokens = [3u32, 0, 3, 6];
    let mut out = vec![0.0; tokens.len() * c];
    embedding_forward(&mut out, &tokens, &wte, c, vocab).unwrap();
    for (row, &token) in tokens.iter().enumerate() {
        assert_eq!(&out[row * c..][..c], &wte[token as usize * c..][..c]);
    }
    let r = random(out.len(), 20);
    let mut dwte = vec![0.0; wte.len()];
    embedding_backward(&mut dwte, &r, &tokens, c);
    check_gradients("embedding", std::slice::from_ref(&wte), &[dwte], |w| {
        let mut out = vec![0.0; tokens.len() * c];
        embedding_forward(&mut out, &tokens, &w[0], c, vocab).unwrap();
        dot(&out, &r)
    });
    let error = embedding_forward(&mut out, &[7], &wte, c, vocab).unwrap_err();
    assert!(error.contains("token id 7"), "{error}");
}
