//! Matrix multiplication with an optional bias, through ndarray's GEMM (matrixmultiply's
//! sgemm/dgemm), parallelised by rayon over blocks of output rows.

use ndarray::{ArrayView2, ArrayViewMut2, linalg::general_mat_mul, s};
use rayon::prelude::*;

use crate::float::Float;

/// Rows of the output per task.
const ROWS_PER_TASK: usize = 64;

/// How a weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// Hugging Face's Conv1D: `[in, out]`, `out = inp @ weight`.
    InOut,
    /// A linear layer (the tied LM head, `wte`): `[out, in]`, `out = inp @ weight^T`.
    OutIn,
}

/// The weight as an `[in, out]` matrix.
fn weight_view<F: Float>(
    weight: &[F],
    c: usize,
    oc: usize,
    layout: WeightLayout,
) -> ArrayView2<'_, F> {
    match layout {
        WeightLayout::InOut => ArrayView2::from_shape((c, oc), weight),
        WeightLayout::OutIn => ArrayView2::from_shape((oc, c), weight).map(|w| w.reversed_axes()),
    }
    .expect("weight length matches its shape")
}

fn matrix<F: Float>(data: &[F], cols: usize) -> ArrayView2<'_, F> {
    ArrayView2::from_shape((data.len() / cols, cols), data).expect("whole rows")
}

fn matrix_mut<F: Float>(data: &mut [F], cols: usize) -> ArrayViewMut2<'_, F> {
    ArrayViewMut2::from_shape((data.len() / cols, cols), data).expect("whole rows")
}

/// `out[n, oc] = inp[n, c] @ W[c, oc] + bias`.
pub fn matmul_forward<F: Float>(
    out: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: Option<&[F]>,
    c: usize,
    oc: usize,
    layout: WeightLayout,
) {
    let w = weight_view(weight, c, oc, layout);
    out.par_chunks_mut(ROWS_PER_TASK * oc).zip(inp.par_chunks(ROWS_PER_TASK * c)).for_each(
        |(out, x)| {
            let beta = match bias {
                Some(bias) => {
                    out.chunks_mut(oc).for_each(|row| row.copy_from_slice(bias));
                    F::one()
                }
                None => F::zero(),
            };
            general_mat_mul(F::one(), &matrix(x, c), &w, beta, &mut matrix_mut(out, oc));
        },
    );
}

/// Adds the gradients of [`matmul_forward`]: `dinp += dout @ W^T`, `dW += inp^T @ dout` (in the
/// weight's own layout), `dbias += Σ_rows dout`.
#[allow(clippy::too_many_arguments, reason = "the kernel's inputs and outputs, as in llm.c")]
pub fn matmul_backward<F: Float>(
    dinp: &mut [F],
    dweight: &mut [F],
    dbias: Option<&mut [F]>,
    dout: &[F],
    inp: &[F],
    weight: &[F],
    c: usize,
    oc: usize,
    layout: WeightLayout,
) {
    let w = weight_view(weight, c, oc, layout);
    dinp.par_chunks_mut(ROWS_PER_TASK * c).zip(dout.par_chunks(ROWS_PER_TASK * oc)).for_each(
        |(dinp, dy)| {
            general_mat_mul(F::one(), &matrix(dy, oc), &w.t(), F::one(), &mut matrix_mut(dinp, c));
        },
    );
    let (x, dy) = (matrix(inp, c), matrix(dout, oc));
    // Each task owns a block of rows of the weight gradient in its storage layout.
    let (rows_of_dw, cols_of_dw) = match layout {
        WeightLayout::InOut => (x, dy),
        WeightLayout::OutIn => (dy, x),
    };
    let cols = cols_of_dw.ncols();
    dweight.par_chunks_mut(ROWS_PER_TASK * cols).enumerate().for_each(|(block, dw)| {
        let first = block * ROWS_PER_TASK;
        let lhs = rows_of_dw.slice(s![.., first..first + dw.len() / cols]);
        general_mat_mul(F::one(), &lhs.t(), &cols_of_dw, F::one(), &mut matrix_mut(dw, cols));
    });
    if let Some(dbias) = dbias {
        dbias.par_chunks_mut(ROWS_PER_TASK).enumerate().for_each(|(block, db)| {
            let first = block * ROWS_PER_TASK;
            for row in dout.chunks(oc) {
                db.iter_mut().zip(&row[first..]).for_each(|(g, &d)| *g += d);
            }
        });
    }
}

/// Output columns per task in [`matmul_forward_few_rows`].
const COLUMNS_PER_TASK: usize = 256;

/// [`matmul_forward`] for a few rows (a decode step's, one per sequence): the output's columns
/// are split among the threads, each task multiplying every row by its block of the weight's
/// columns, so that one row still runs on every core. With rows enough for every thread, it is
/// [`matmul_forward`].
pub fn matmul_forward_few_rows<F: Float>(
    out: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: Option<&[F]>,
    c: usize,
    oc: usize,
    layout: WeightLayout,
) {
    let n = inp.len() / c;
    if n >= ROWS_PER_TASK * rayon::current_num_threads() {
        return matmul_forward(out, inp, weight, bias, c, oc, layout);
    }
    let (w, x) = (weight_view(weight, c, oc, layout), matrix(inp, c));
    let starts: Vec<usize> = (0..oc).step_by(COLUMNS_PER_TASK).collect();
    let blocks: Vec<Vec<F>> = starts
        .par_iter()
        .map(|&first| {
            let last = (first + COLUMNS_PER_TASK).min(oc);
            let width = last - first;
            let (mut block, beta) = match bias {
                Some(bias) => (bias[first..last].repeat(n), F::one()),
                None => (vec![F::zero(); n * width], F::zero()),
            };
            let columns = w.slice(s![.., first..last]);
            general_mat_mul(F::one(), &x, &columns, beta, &mut matrix_mut(&mut block, width));
            block
        })
        .collect();
    for (&first, block) in starts.iter().zip(&blocks) {
        let width = block.len() / n.max(1);
        for (row, values) in block.chunks(width.max(1)).enumerate() {
            out[row * oc + first..][..width].copy_from_slice(values);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_rows_by_column_blocks_equal_the_row_blocked_product() {
        // 600 output columns: blocks of 256, 256 and 88; both layouts, with and without bias.
        let (n, c, oc) = (3, 7, 600);
        let inp: Vec<f64> = (0..n * c).map(|i| (i as f64 * 0.37).sin()).collect();
        let weight: Vec<f64> = (0..c * oc).map(|i| (i as f64 * 0.11).cos()).collect();
        let bias: Vec<f64> = (0..oc).map(|i| i as f64 * 0.01).collect();
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for bias in [None, Some(&bias[..])] {
                let mut expected = vec![0.0; n * oc];
                let mut found = vec![f64::NAN; n * oc];
                matmul_forward(&mut expected, &inp, &weight, bias, c, oc, layout);
                matmul_forward_few_rows(&mut found, &inp, &weight, bias, c, oc, layout);
                let error =
                    expected.iter().zip(&found).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
                assert!(error < 1e-12, "{layout:?}, bias {}: {error}", bias.is_some());
            }
        }
    }
}
