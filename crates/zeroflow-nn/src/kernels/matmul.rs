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
    if n <= streamed_rows(layout) {
        return matmul_streamed(out, inp, weight, bias, c, oc, layout);
    }
    let (w, x) = (weight_view(weight, c, oc, layout), matrix(inp, c));
    by_column_blocks(out, (n, oc), COLUMNS_PER_TASK, |first, last| {
        let mut block = bias_rows(bias, n, first, last);
        let beta = if bias.is_some() { F::one() } else { F::zero() };
        let columns = w.slice(s![.., first..last]);
        general_mat_mul(F::one(), &x, &columns, beta, &mut matrix_mut(&mut block, last - first));
        block
    });
}

/// `out[n, oc]` from blocks of its columns of `width` (the last one narrower) in parallel,
/// `block(first, last)` giving columns `first..last` of every row, `[n, last − first]`.
fn by_column_blocks<F: Float>(
    out: &mut [F],
    (n, oc): (usize, usize),
    width: usize,
    block: impl Fn(usize, usize) -> Vec<F> + Sync,
) {
    let starts: Vec<usize> = (0..oc).step_by(width.max(1)).collect();
    let blocks: Vec<Vec<F>> =
        starts.par_iter().map(|&first| block(first, (first + width).min(oc))).collect();
    for (&first, block) in starts.iter().zip(&blocks) {
        let width = block.len() / n.max(1);
        for (row, values) in block.chunks(width.max(1)).enumerate() {
            out[row * oc + first..][..width].copy_from_slice(values);
        }
    }
}

/// `n` rows of the bias's columns `first..last` (zeros without one): where a block's sums start.
fn bias_rows<F: Float>(bias: Option<&[F]>, n: usize, first: usize, last: usize) -> Vec<F> {
    match bias {
        Some(bias) => bias[first..last].repeat(n),
        None => vec![F::zero(); n * (last - first)],
    }
}

/// Rows up to which [`matmul_forward_few_rows`] streams the weight ([`matmul_streamed`]): past
/// them the blocked product's vector units (it picks AVX2 and FMA at run time) win over a
/// stream's (measured on 2 cores: an `[out, in]` weight's dot products faster at 4 rows, 1.1×,
/// an `[in, out]` weight's row updates at 2, 1.25×, and slower at 4, 0.9×; BENCHMARKS.md).
fn streamed_rows(layout: WeightLayout) -> usize {
    match layout {
        WeightLayout::OutIn => 4,
        WeightLayout::InOut => 2,
    }
}

/// Independent partial sums of a dot product (the lanes the compiler vectorises).
const LANES: usize = 8;

/// `out[n, oc] = inp[n, c] @ W + bias` for a few rows ([`streamed_rows`]), reading the
/// weight once, in order, as a decode step at batch 1 must (it is bound by the memory's speed,
/// where a blocked product's packing of the weight costs as much again): the output's columns
/// in blocks, about four a thread; within a block, an `[out, in]` weight's rows each a dot
/// product with every input row, an `[in, out]` weight's rows added to every output row scaled
/// by its input.
fn matmul_streamed<F: Float>(
    out: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: Option<&[F]>,
    c: usize,
    oc: usize,
    layout: WeightLayout,
) {
    let n = inp.len() / c;
    let width = oc.div_ceil(4 * rayon::current_num_threads()).next_multiple_of(16);
    by_column_blocks(out, (n, oc), width, |first, last| {
        let (mut block, width) = (bias_rows(bias, n, first, last), last - first);
        match layout {
            WeightLayout::OutIn => {
                for (j, w) in weight[first * c..last * c].chunks_exact(c).enumerate() {
                    for (r, x) in inp.chunks_exact(c).enumerate() {
                        block[r * width + j] += dot(w, x);
                    }
                }
            }
            WeightLayout::InOut => {
                for k in 0..c {
                    let w = &weight[k * oc + first..][..width];
                    for (r, out) in block.chunks_exact_mut(width).enumerate() {
                        let x = inp[r * c + k];
                        out.iter_mut().zip(w).for_each(|(o, &w)| *o += x * w);
                    }
                }
            }
        }
        block
    });
}

/// `Σ a[i] · b[i]`, in [`LANES`] partial sums (which the compiler vectorises).
pub(crate) fn dot<F: Float>(a: &[F], b: &[F]) -> F {
    let mut lanes = [F::zero(); LANES];
    let (whole, tail) = (a.len() / LANES * LANES, a.len() % LANES);
    for (a, b) in a[..whole].chunks_exact(LANES).zip(b[..whole].chunks_exact(LANES)) {
        for l in 0..LANES {
            lanes[l] += a[l] * b[l];
        }
    }
    let mut sum = lanes.iter().fold(F::zero(), |sum, &x| sum + x);
    for i in whole..whole + tail {
        sum += a[i] * b[i];
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_rows_by_column_blocks_equal_the_row_blocked_product() {
        // 600 output columns (the blocked product's blocks of 256, 256 and 88); both layouts,
        // with and without bias; 1 to 4 rows (streamed up to 4 or 2 by the layout; inputs of 7
        // and 21: a dot product's partial sums and its tail), 5 by the blocked product.
        for (n, c) in [(1, 7), (2, 21), (3, 7), (4, 21), (5, 7)] {
            few_rows_equal_the_row_blocked_product(n, c, 600);
        }
        few_rows_equal_the_row_blocked_product(1, 16, 5);
    }

    fn few_rows_equal_the_row_blocked_product(n: usize, c: usize, oc: usize) {
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
                assert!(error < 1e-12, "{n}×{c}, {layout:?}, bias {}: {error}", bias.is_some());
            }
        }
    }
}
