//! A decode step's products in f32 with AVX2 and FMA: [`matmul`](super::matmul)'s streamed block
//! past one row, written in the instructions' own terms (the compiler's vectoriser, given the
//! generic block in passes of rows, spread a row's partial sums across registers and waited on
//! each fused multiply-add's latency). Unlike the generic block, which runs each input row over
//! the weight on its own, each piece of the weight is used by up to four input rows at a time,
//! and each piece of an input row by three rows of an `[out, in]` weight (twelve registers of
//! partial sums for seven loads), each product fused with its sum: results differ from the
//! generic block's in the last bits. The loops load and store through pointers within lengths
//! checked once a call (a bounds check on every load cost 5–25 % of a product at 2–8 rows, on 2
//! cores).

use std::arch::x86_64::*;

/// Input rows that share each load of the weight.
const ROWS_PER_PASS: usize = 4;
/// Floats in a register.
const LANES: usize = 8;
/// Rows of an `[out, in]` weight dotted with the input rows in one pass over them.
const DOT_ROWS_PER_PASS: usize = 3;
/// Rows of an `[in, out]` weight added to the outputs in one pass over them.
const WEIGHT_ROWS_PER_PASS: usize = 4;

/// Adds to `block` (`[n, width]`, holding the bias) every input row (`inp`, `[n, c]`) times the
/// weight's columns `first..first + width`: an `[out, in]` weight's rows `first..` (`dot`), or
/// an `[in, out]` weight's columns (`!dot`, the weight `[c, oc]`). Each piece of the weight
/// (three rows of an `[out, in]` weight, four rows of an `[in, out]` one) is read from memory
/// once and used by every input row, [`ROWS_PER_PASS`] at a time.
#[target_feature(enable = "avx2,fma")]
pub(super) fn streamed_block(
    block: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    (c, oc, first): (usize, usize, usize),
    dot: bool,
) {
    let n = inp.len() / c;
    let width = block.len() / n;
    assert!(block.len() == n * width && inp.len() == n * c && first + width <= oc);
    assert!(weight.len() >= c * oc);
    if dot {
        let rows = &weight[first * c..][..width * c];
        for (g, w) in rows.chunks(DOT_ROWS_PER_PASS * c).enumerate() {
            let at = (g * DOT_ROWS_PER_PASS, width);
            match w.len() / c {
                3 => dots_of_rows::<3>(block, inp, w, at),
                2 => dots_of_rows::<2>(block, inp, w, at),
                _ => dots_of_rows::<1>(block, inp, w, at),
            }
        }
        return;
    }
    let whole = c / WEIGHT_ROWS_PER_PASS * WEIGHT_ROWS_PER_PASS;
    let ks = (0..whole).step_by(WEIGHT_ROWS_PER_PASS).map(|k| (k, WEIGHT_ROWS_PER_PASS));
    for (k, rows) in ks.chain((whole..c).map(|k| (k, 1))) {
        let passes = block.chunks_mut(ROWS_PER_PASS * width).zip(inp.chunks(ROWS_PER_PASS * c));
        for (out, x) in passes {
            let at = (c, oc, first, k);
            match (x.len() / c, rows) {
                (4, 1) => rows_added::<4, 1>(out, x, weight, at),
                (3, 1) => rows_added::<3, 1>(out, x, weight, at),
                (2, 1) => rows_added::<2, 1>(out, x, weight, at),
                (_, 1) => rows_added::<1, 1>(out, x, weight, at),
                (4, _) => rows_added::<4, WEIGHT_ROWS_PER_PASS>(out, x, weight, at),
                (3, _) => rows_added::<3, WEIGHT_ROWS_PER_PASS>(out, x, weight, at),
                (2, _) => rows_added::<2, WEIGHT_ROWS_PER_PASS>(out, x, weight, at),
                (_, _) => rows_added::<1, WEIGHT_ROWS_PER_PASS>(out, x, weight, at),
            }
        }
    }
}

/// Adds to columns `j..j + J` of every output row (`block`, `[n, width]`) the dot products of
/// `J` rows of an `[out, in]` weight (`w`, `[J, c]`) with every input row (`inp`, `[n, c]`),
/// [`ROWS_PER_PASS`] input rows at a time.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn dots_of_rows<const J: usize>(
    block: &mut [f32],
    inp: &[f32],
    w: &[f32],
    (j, width): (usize, usize),
) {
    let c = w.len() / J;
    let w: [&[f32]; J] = std::array::from_fn(|q| &w[q * c..][..c]);
    let passes = block.chunks_mut(ROWS_PER_PASS * width).zip(inp.chunks(ROWS_PER_PASS * c));
    for (out, x) in passes {
        match x.len() / c {
            4 => add_dots::<4, J>(out, w, x, (j, width)),
            3 => add_dots::<3, J>(out, w, x, (j, width)),
            2 => add_dots::<2, J>(out, w, x, (j, width)),
            _ => add_dots::<1, J>(out, w, x, (j, width)),
        }
    }
}

/// Adds to columns `j..j + J` of `R` output rows (`out`, `[R, width]`) the dot products of `J`
/// rows of an `[out, in]` weight (`w`) with the `R` input rows (`x`, `[R, c]`): `R × J` registers
/// of partial sums, each load of a weight row's piece used by the `R` input rows and each load of
/// an input row's piece by the `J` weight rows (so that `R × J` fused multiply-adds are in flight
/// for `R + J` loads).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn add_dots<const R: usize, const J: usize>(
    out: &mut [f32],
    w: [&[f32]; J],
    x: &[f32],
    (j, width): (usize, usize),
) {
    let len = w[0].len();
    let whole = len / LANES * LANES;
    let x: [&[f32]; R] = std::array::from_fn(|r| &x[r * len..][..len]);
    let w: [&[f32]; J] = w.map(|w| &w[..len]);
    let (wp, xp) = (w.map(<[f32]>::as_ptr), x.map(<[f32]>::as_ptr));
    let mut sums = [[_mm256_setzero_ps(); J]; R];
    for i in (0..whole).step_by(LANES) {
        // SAFETY: i + LANES ≤ whole ≤ len, the length of every row of `w` and of `x`; the loads
        // ask no alignment.
        unsafe {
            let w: [__m256; J] = wp.map(|w| _mm256_loadu_ps(w.add(i)));
            for (sums, x) in sums.iter_mut().zip(xp) {
                let x = _mm256_loadu_ps(x.add(i));
                for (sum, &w) in sums.iter_mut().zip(&w) {
                    *sum = _mm256_fmadd_ps(w, x, *sum);
                }
            }
        }
    }
    for (r, sums) in sums.iter().enumerate() {
        for (q, &sum) in sums.iter().enumerate() {
            let mut sum = lane_sum(sum);
            for i in whole..len {
                sum = w[q][i].mul_add(x[r][i], sum);
            }
            out[r * width + j + q] += sum;
        }
    }
}

/// Weight rows `k..k + K` (of an `[in, out]` weight, columns `first..`, as wide as the outputs)
/// added to `R` output rows (`out`, `[R, width]`), scaled by the inputs `k..k + K` of each (`x`,
/// `[R, c]`), in order of `k`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn rows_added<const R: usize, const K: usize>(
    out: &mut [f32],
    x: &[f32],
    weight: &[f32],
    (c, oc, first, k): (usize, usize, usize, usize),
) {
    let width = out.len() / R;
    let whole = width / LANES * LANES;
    let mut rows = out.chunks_exact_mut(width);
    let mut out: [&mut [f32]; R] = std::array::from_fn(|_| rows.next().expect("R rows"));
    let w: [&[f32]; K] = std::array::from_fn(|i| &weight[(k + i) * oc + first..][..width]);
    let scale: [[f32; R]; K] = std::array::from_fn(|i| std::array::from_fn(|r| x[r * c + k + i]));
    let broadcast = scale.map(|row| row.map(|s| _mm256_set1_ps(s)));
    let wp = w.map(<[f32]>::as_ptr);
    let op: [*mut f32; R] = std::array::from_fn(|r| out[r].as_mut_ptr());
    for j in (0..whole).step_by(LANES) {
        // SAFETY: j + LANES ≤ whole ≤ width, the length of every `w[i]` and `out[r]` (distinct
        // rows of the block); the loads and stores ask no alignment.
        unsafe {
            let w: [__m256; K] = wp.map(|w| _mm256_loadu_ps(w.add(j)));
            for (r, out) in op.iter().enumerate() {
                let mut sum = _mm256_loadu_ps(out.add(j));
                for i in 0..K {
                    sum = _mm256_fmadd_ps(broadcast[i][r], w[i], sum);
                }
                _mm256_storeu_ps(out.add(j), sum);
            }
        }
    }
    for j in whole..width {
        for (r, out) in out.iter_mut().enumerate() {
            for i in 0..K {
                out[j] = scale[i][r].mul_add(w[i][j], out[j]);
            }
        }
    }
}

/// The sum of a register's lanes.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn lane_sum(v: __m256) -> f32 {
    let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps::<1>(quarter, quarter)))
}
