//! Packed rows on the CPU twin: several documents per row, each query attending only its own
//! document's keys (`positions`, each token's position in its document), in both forms of the
//! attention. A packed row must compute what each document computes alone.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_nn::kernels::attention::{
    AttentionShape, attention_backward, attention_backward_packed, attention_forward,
    attention_forward_packed, flash_attention_backward_packed, flash_attention_forward_packed,
};

fn random(len: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
}

/// Each token's position in its document, for a row cut into documents of `lengths`.
fn positions_of(lengths: &[usize]) -> Vec<u32> {
    lengths.iter().flat_map(|&len| 0..len as u32).collect()
}

fn max_difference(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// Two rows: three documents (the first cut short as if it began in an earlier row), and one
/// document of the whole row (so an unpacked row sits beside packed ones).
const ROWS: [&[usize]; 2] = [&[3, 1, 5], &[9]];

/// Grouped-query heads of odd sizes.
const SHAPE: AttentionShape = AttentionShape { t: 9, c: 12, n_head: 4, n_kv_head: 2 };

/// What the unpacked attention gives for each document of each row run alone (a batch of one
/// sequence of the document's length): `(out, dqkv)` laid out as the packed rows.
fn each_document_alone(qkv: &[f64], dout: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let AttentionShape { t, c, n_head, n_kv_head } = SHAPE;
    let width = SHAPE.qkv_width();
    let (mut out, mut dqkv) = (vec![0.0; dout.len()], vec![0.0; qkv.len()]);
    for (b, lengths) in ROWS.iter().enumerate() {
        let mut start = b * t;
        for &len in lengths.iter() {
            let shape = AttentionShape { t: len, c, n_head, n_kv_head };
            let rows = start..start + len;
            let qkv = &qkv[rows.start * width..rows.end * width];
            let dout = &dout[rows.start * c..rows.end * c];
            let (mut o, mut att) = (vec![0.0; len * c], vec![0.0; n_head * len * len]);
            attention_forward(&mut o, &mut att, qkv, shape);
            let (mut d, mut dscores) = (vec![0.0; qkv.len()], vec![0.0; att.len()]);
            attention_backward(&mut d, &mut dscores, dout, qkv, &att, shape);
            out[rows.start * c..rows.end * c].copy_from_slice(&o);
            dqkv[rows.start * width..rows.end * width].copy_from_slice(&d);
            start += len;
        }
    }
    (out, dqkv)
}

/// Both forms, forward and backward, give on the packed rows what each document gives alone;
/// the gemm form's weights are zero across documents.
#[test]
fn packed_attention_equals_each_document_run_alone() {
    let AttentionShape { t, c, n_head, .. } = SHAPE;
    let batch = ROWS.len();
    let positions: Vec<u32> = ROWS.iter().flat_map(|lengths| positions_of(lengths)).collect();
    let qkv = random(batch * t * SHAPE.qkv_width(), 1);
    let dout = random(batch * t * c, 2);
    let (out_alone, dqkv_alone) = each_document_alone(&qkv, &dout);

    let (mut out, mut att) =
        (vec![f64::NAN; batch * t * c], vec![f64::NAN; batch * n_head * t * t]);
    attention_forward_packed(&mut out, &mut att, &qkv, &positions, SHAPE);
    assert!(max_difference(&out, &out_alone) < 1e-12, "gemm out");
    for (bh, block) in att.chunks(t * t).enumerate() {
        let b = bh / n_head;
        for t1 in 0..t {
            let first = t1 - positions[b * t + t1] as usize;
            for t2 in (0..t).filter(|&t2| t2 < first || t2 > t1) {
                assert_eq!(block[t1 * t + t2], 0.0, "row {b} query {t1} key {t2}");
            }
        }
    }
    let (mut dqkv, mut dscores) = (vec![0.0; qkv.len()], vec![f64::NAN; att.len()]);
    attention_backward_packed(&mut dqkv, &mut dscores, &dout, &qkv, &att, &positions, SHAPE);
    assert!(max_difference(&dqkv, &dqkv_alone) < 1e-12, "gemm dqkv");

    let (mut out, mut lse) = (vec![f64::NAN; batch * t * c], vec![f64::NAN; batch * n_head * t]);
    flash_attention_forward_packed(&mut out, &mut lse, &qkv, &positions, SHAPE);
    assert!(max_difference(&out, &out_alone) < 1e-12, "flash out");
    let mut dqkv = vec![0.0; qkv.len()];
    flash_attention_backward_packed(&mut dqkv, &dout, &qkv, &out, &lse, &positions, SHAPE);
    assert!(max_difference(&dqkv, &dqkv_alone) < 1e-12, "flash dqkv");
}

/// With every position its index in the row (one document per row), the packed forms compute
/// the plain causal attention bit for bit.
#[test]
fn packed_attention_of_one_document_per_row_is_the_plain_attention_bit_for_bit() {
    let AttentionShape { t, c, n_head, .. } = SHAPE;
    let positions: Vec<u32> = (0..2).flat_map(|_| 0..t as u32).collect();
    let qkv: Vec<f32> = random(2 * t * SHAPE.qkv_width(), 3).iter().map(|&x| x as f32).collect();
    let dout: Vec<f32> = random(2 * t * c, 4).iter().map(|&x| x as f32).collect();
    let (mut out, mut att) = (vec![0f32; 2 * t * c], vec![0f32; 2 * n_head * t * t]);
    attention_forward(&mut out, &mut att, &qkv, SHAPE);
    let (mut packed_out, mut packed_att) = (vec![0f32; out.len()], vec![0f32; att.len()]);
    attention_forward_packed(&mut packed_out, &mut packed_att, &qkv, &positions, SHAPE);
    assert_eq!(out, packed_out);
    assert_eq!(att, packed_att);
    let (mut dqkv, mut dscores) = (vec![0f32; qkv.len()], vec![0f32; att.len()]);
    attention_backward(&mut dqkv, &mut dscores, &dout, &qkv, &att, SHAPE);
    let mut packed_dqkv = vec![0f32; qkv.len()];
    attention_backward_packed(&mut packed_dqkv, &mut dscores, &dout, &qkv, &att, &positions, SHAPE);
    assert_eq!(dqkv, packed_dqkv);
}

/// The packed gradient of `loss = Σ dout · out` against central finite differences at every
/// element of `qkv`, in f64, for both forms: no gradient leaks across a document boundary, and
/// none is missing.
#[test]
fn packed_attention_gradients_match_finite_differences() {
    let shape = AttentionShape { t: 6, c: 8, n_head: 2, n_kv_head: 1 };
    let AttentionShape { t, c, n_head, .. } = shape;
    let positions = positions_of(&[2, 3, 1]);
    let qkv = random(t * shape.qkv_width(), 5);
    let dout = random(t * c, 6);
    let loss = |qkv: &[f64]| -> f64 {
        let (mut out, mut att) = (vec![0.0; t * c], vec![0.0; n_head * t * t]);
        attention_forward_packed(&mut out, &mut att, qkv, &positions, shape);
        out.iter().zip(&dout).map(|(o, d)| o * d).sum()
    };
    let (mut out, mut att) = (vec![0.0; t * c], vec![0.0; n_head * t * t]);
    attention_forward_packed(&mut out, &mut att, &qkv, &positions, shape);
    let (mut dqkv, mut dscores) = (vec![0.0; qkv.len()], vec![0.0; att.len()]);
    attention_backward_packed(&mut dqkv, &mut dscores, &dout, &qkv, &att, &positions, shape);
    let mut lse = vec![0.0; n_head * t];
    flash_attention_forward_packed(&mut out, &mut lse, &qkv, &positions, shape);
    let mut flash_dqkv = vec![0.0; qkv.len()];
    flash_attention_backward_packed(&mut flash_dqkv, &dout, &qkv, &out, &lse, &positions, shape);
    let eps = 1e-6;
    for i in 0..qkv.len() {
        let (mut plus, mut minus) = (qkv.clone(), qkv.clone());
        plus[i] += eps;
        minus[i] -= eps;
        let numeric = (loss(&plus) - loss(&minus)) / (2.0 * eps);
        assert!((numeric - dqkv[i]).abs() < 1e-7, "element {i}: {numeric} vs {}", dqkv[i]);
        let flash = flash_dqkv[i];
        assert!((numeric - flash).abs() < 1e-7, "flash element {i}: {numeric} vs {flash}");
    }
}
