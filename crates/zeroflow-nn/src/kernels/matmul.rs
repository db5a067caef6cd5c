//! Matrix multiplication with an optional bias, through ndarray's GEMM (matrixmultiply's
//! sgemm/dgemm), parallelised by rayon over blocks of output rows.

use ndarray::{ArrayView2, ArrayViewMut2, linalg::general_mat_mul, s};
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::few_rows_avx2;
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

/// [`matmul_forward`] for a few rows (a decode step's, one per sequence): the output's columns
/// are split among the threads, each task multiplying every row by its block of the weight's
/// columns (one row of an `[in, out]` weight: the weight's rows), so that one row still runs on
/// every core. With rows enough for every thread, it is [`matmul_forward`].
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
    if n == 1 && layout == WeightLayout::InOut {
        return one_row_in_out(out, inp, weight, bias, oc);
    }
    if n <= streamed_rows(layout, fused::<F>()) {
        return matmul_streamed(out, inp, weight, bias, c, oc, layout);
    }
    let (w, x) = (weight_view(weight, c, oc, layout), matrix(inp, c));
    let width = blocked_width(oc, rayon::current_num_threads());
    by_column_blocks(out, (n, oc), width, |first, last| {
        let mut block = bias_rows(bias, n, first, last);
        let beta = if bias.is_some() { F::one() } else { F::zero() };
        let columns = w.slice(s![.., first..last]);
        general_mat_mul(F::one(), &x, &columns, beta, &mut matrix_mut(&mut block, last - first));
        block
    });
}

/// Output columns per task of [`matmul_forward_few_rows`]'s blocked product, for `threads`
/// threads: a block a thread, in whole 16s, from 32 to 256. With a fixed 256, a weight of 768
/// outputs ran in three tasks whatever the threads. On the 16 cores of a GPU machine's host
/// (`benches/few_rows.rs`, BENCHMARKS.md), at 16–256 rows, a block a thread ran 1.35–3.0× as
/// fast as 256 columns at weights of 512 to 2,304 outputs; a floor of 32 columns beat one of 64
/// at 512 outputs (1.4–1.8×) and was within the runs' spread at 768; two blocks a thread ran
/// slower.
fn blocked_width(oc: usize, threads: usize) -> usize {
    block_width(oc, threads, 32, 256)
}

/// `oc` columns in about `blocks` blocks, each a whole number of 16 columns from `least` to
/// `most` wide: the few-row products' block widths.
fn block_width(oc: usize, blocks: usize, least: usize, most: usize) -> usize {
    oc.div_ceil(blocks.max(1)).next_multiple_of(16).clamp(least, most)
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
/// them the blocked product's register tiles win over a stream's, which is the AVX2 kernel's
/// where it runs (`fused`), else the generic block's. `benches/few_rows.rs` on the 16 cores of a
/// GPU machine's host and on 2 (BENCHMARKS.md): the AVX2 kernel's `[out, in]` products ran
/// faster than the blocked product's at every shape measured to 48 rows (there 1.4–1.7× on 16
/// cores, 1.1–1.3× on 2), its `[in, out]` ones at 12 rows on 16 cores at five of six shapes
/// (1.3–2.3×; the sixth even) and summed over GPT-2's shapes on 2; the generic block (f64, and
/// CPUs without AVX2) keeps the limits it was measured with, 4 and 2.
fn streamed_rows(layout: WeightLayout, fused: bool) -> usize {
    match (layout, fused) {
        (WeightLayout::OutIn, true) => 48,
        (WeightLayout::InOut, true) => 12,
        (WeightLayout::OutIn, false) => 4,
        (WeightLayout::InOut, false) => 2,
    }
}

/// Whether a product in `F` streams through [`few_rows_avx2`]: `F` is f32 and the CPU has AVX2
/// and FMA.
fn fused<F: Float>() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // An empty slice: whether `F` is f32 is the type's alone.
        F::as_f32(&[]).is_some()
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Independent partial sums of a dot product (the lanes the compiler vectorises).
const LANES: usize = 8;

/// Columns of an `[in, out]` weight that a block of [`matmul_streamed`] takes at least past one
/// row: its rows read 256 bytes at a time (in blocks of 16 columns, as 16 threads take GPT-2's,
/// the few-row kernel ran slower than the one-row stream; BENCHMARKS.md).
const IN_OUT_WIDTH: usize = 64;

/// `out[n, oc] = inp[n, c] @ W + bias` for a few rows ([`streamed_rows`]), reading the
/// weight once, in order, as a decode step at batch 1 must (it is bound by the memory's speed,
/// where a blocked product's packing of the weight costs as much again): the output's columns
/// in blocks, about four a thread; within a block, an `[out, in]` weight's rows each a dot
/// product with every input row, an `[in, out]` weight's rows added to every output row scaled
/// by its input (one row of an `[in, out]` weight is [`one_row_in_out`]'s, not this). In f32 on
/// a CPU with AVX2 and FMA, a block of more than one row is [`few_rows_avx2`]'s: each piece of
/// the weight read once for up to four input rows, with fused multiply-adds (one row of an
/// `[out, in]` weight, bound by the memory's speed, ran slower so on 16 cores; BENCHMARKS.md).
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
    let least = if layout == WeightLayout::InOut { IN_OUT_WIDTH } else { 16 };
    let width = block_width(oc, 4 * rayon::current_num_threads(), least, usize::MAX);
    #[cfg(target_arch = "x86_64")]
    let fused = fused::<F>();
    by_column_blocks(out, (n, oc), width, |first, last| {
        let mut block = bias_rows(bias, n, first, last);
        #[cfg(target_arch = "x86_64")]
        if fused && n > 1 {
            let f32s = "`fused` says F is f32";
            let (inp, weight) = (F::as_f32(inp).expect(f32s), F::as_f32(weight).expect(f32s));
            let dot = layout == WeightLayout::OutIn;
            let out = F::as_f32_mut(&mut block).expect(f32s);
            // SAFETY: `fused` says this CPU has AVX2 and FMA.
            unsafe { few_rows_avx2::streamed_block(out, inp, weight, (c, oc, first), dot) };
            return block;
        }
        streamed_block(&mut block, inp, weight, (c, oc, first), layout);
        block
    });
}

/// Rows of an `[in, out]` weight per task of [`one_row_in_out`].
const IN_ROWS_PER_TASK: usize = 32;

/// `out[oc] = inp[c] @ W[c, oc] + bias` for one row, the weight's rows split among the tasks:
/// each task reads a run of [`IN_ROWS_PER_TASK`] whole rows, one contiguous piece of memory, into
/// its own sums of every output, four rows a pass; then each output is its bias plus the tasks'
/// sums in order (the same bits on any number of threads). Split by columns instead, as more
/// rows are, each task read a few dozen floats of every row, a row's length apart: 1.1–2.9×
/// slower on 2 cores, 1.6–5.4× with 16 threads' blocks (BENCHMARKS.md). Past one row the split
/// lost to the AVX2 kernel's column blocks at 4–12 rows on 2 cores.
fn one_row_in_out<F: Float>(out: &mut [F], inp: &[F], weight: &[F], bias: Option<&[F]>, oc: usize) {
    let runs = inp.par_chunks(IN_ROWS_PER_TASK).zip(weight.par_chunks(IN_ROWS_PER_TASK * oc));
    let sums: Vec<Vec<F>> = runs
        .map(|(x, w)| {
            let mut sums = vec![F::zero(); oc];
            let (in_passes, in_rest) = x.split_at(x.len() / 4 * 4);
            let (passes, rest) = w.split_at(in_passes.len() * oc);
            for (x, w) in in_passes.chunks_exact(4).zip(passes.chunks_exact(4 * oc)) {
                let (w0, w) = w.split_at(oc);
                let (w1, w) = w.split_at(oc);
                let (w2, w3) = w.split_at(oc);
                for ((((s, &a), &b), &c), &d) in sums.iter_mut().zip(w0).zip(w1).zip(w2).zip(w3) {
                    *s += x[0] * a + x[1] * b + x[2] * c + x[3] * d;
                }
            }
            for (&x, w) in in_rest.iter().zip(rest.chunks_exact(oc)) {
                add_scaled(&mut sums, x, w);
            }
            sums
        })
        .collect();
    out.par_chunks_mut(COLUMNS_PER_SUM).enumerate().for_each(|(block, out)| {
        let first = block * COLUMNS_PER_SUM;
        match bias {
            Some(bias) => out.copy_from_slice(&bias[first..][..out.len()]),
            None => out.fill(F::zero()),
        }
        for sums in &sums {
            out.iter_mut().zip(&sums[first..]).for_each(|(o, &s)| *o += s);
        }
    });
}

/// Outputs per task of [`one_row_in_out`]'s last sum.
const COLUMNS_PER_SUM: usize = 256;

/// Adds the products of one block of [`matmul_streamed`] to `block` (`[n, width]`, its bias):
/// every input row (`inp`, `[n, c]`) times the weight's columns from `first` on, as
/// [`few_rows_avx2`]'s `streamed_block`.
fn streamed_block<F: Float>(
    block: &mut [F],
    inp: &[F],
    weight: &[F],
    (c, oc, first): (usize, usize, usize),
    layout: WeightLayout,
) {
    let width = block.len() / (inp.len() / c);
    match layout {
        WeightLayout::OutIn => {
            for (j, w) in weight[first * c..][..width * c].chunks_exact(c).enumerate() {
                for (r, x) in inp.chunks_exact(c).enumerate() {
                    block[r * width + j] += dot(w, x);
                }
            }
        }
        WeightLayout::InOut => {
            for k in 0..c {
                let w = &weight[k * oc + first..][..width];
                for (r, out) in block.chunks_exact_mut(width).enumerate() {
                    add_scaled(out, inp[r * c + k], w);
                }
            }
        }
    }
}

/// `out += x · w`: one input times a row of an `[in, out]` weight, added to the outputs.
fn add_scaled<F: Float>(out: &mut [F], x: F, w: &[F]) {
    out.iter_mut().zip(w).for_each(|(o, &w)| *o += x * w);
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
        // 600 output columns: the blocked product's blocks of 256, 256 and 88 on 2 threads,
        // twelve of 48 and one of 24 on 16 (and the stream's blocks for each); both layouts,
        // with and without bias; 1 to 6 rows, and each layout's last streamed row count and the
        // next (f64 streams in the generic block); inputs of 7 and 21: a dot product's partial
        // sums and its tail.
        let last = [WeightLayout::InOut, WeightLayout::OutIn].map(|l| streamed_rows(l, false));
        for threads in [2, 16] {
            on_threads(threads, || {
                let rows = (1..=6).chain(last.into_iter().flat_map(|n| [n, n + 1]));
                for (i, n) in rows.enumerate() {
                    few_rows_equal_the_row_blocked_product(n, [7, 21][i % 2], 600);
                }
            });
        }
        few_rows_equal_the_row_blocked_product(1, 16, 5);
        // One row of an `[in, out]` weight in runs of 32 of its rows: two whole runs and one of
        // 6 (a pass of 4 and two rows alone), the same bits on 2 threads as on 16.
        few_rows_equal_the_row_blocked_product(1, 70, 37);
        let (c, oc) = (70, 300);
        let inp: Vec<f32> = (0..c).map(|i| (i as f32 * 0.37).sin()).collect();
        let weight: Vec<f32> = (0..c * oc).map(|i| (i as f32 * 0.11).cos()).collect();
        let on = |threads| {
            let mut out = vec![f32::NAN; oc];
            on_threads(threads, || {
                matmul_forward_few_rows(&mut out, &inp, &weight, None, c, oc, WeightLayout::InOut)
            });
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(on(2), on(16));
    }

    /// Runs `f` on a pool of `threads` threads (the few-row products' blocks follow the count).
    fn on_threads(threads: usize, f: impl FnOnce() + Send) {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f);
    }

    #[test]
    fn few_rows_in_f32_equal_the_product_in_f64() {
        // f32 takes the AVX2 and FMA block past one row where the CPU has them (else the generic):
        // inputs of 37 (a register's lanes and the tail; an `[in, out]` weight's rows four at a
        // time and one), 83 and 600 output columns (blocks' registers and their tails; an
        // `[out, in]` weight's rows three, two and one at a time), 1 to 7 rows (passes of 4 and
        // the rest), and each layout's last streamed row count and the next.
        let last =
            [WeightLayout::InOut, WeightLayout::OutIn].map(|l| streamed_rows(l, fused::<f32>()));
        let wide = last.into_iter().flat_map(|n| [(n, 37, 600), (n + 1, 64, 83)]);
        let shapes = [(1, 37, 83), (2, 37, 600), (3, 64, 83), (4, 37, 600), (7, 37, 83)];
        for (n, c, oc) in shapes.into_iter().chain(wide) {
            let inp: Vec<f32> = (0..n * c).map(|i| (i as f32 * 0.37).sin()).collect();
            let weight: Vec<f32> = (0..c * oc).map(|i| (i as f32 * 0.11).cos()).collect();
            let bias: Vec<f32> = (0..oc).map(|i| i as f32 * 0.01).collect();
            let wide = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
            for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
                let mut expected = vec![0.0; n * oc];
                let (inp64, weight64, bias64) = (wide(&inp), wide(&weight), wide(&bias));
                matmul_forward(&mut expected, &inp64, &weight64, Some(&bias64), c, oc, layout);
                let mut found = vec![f32::NAN; n * oc];
                matmul_forward_few_rows(&mut found, &inp, &weight, Some(&bias), c, oc, layout);
                // c terms of size at most 1: far above these sums' rounding in f32, far below
                // what a term lost or counted twice moves an output by.
                let bound = 2.0 * c as f64 * f64::from(f32::EPSILON);
                for (i, (&e, &f)) in expected.iter().zip(&found).enumerate() {
                    let error = (e - f64::from(f)).abs();
                    assert!(
                        error <= bound,
                        "{n}×{c}×{oc} {layout:?}, output {i}: {error} > {bound}"
                    );
                }
            }
        }
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
