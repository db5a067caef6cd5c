//! LayerNorm over the last dimension, eps 1e-5.

use rayon::prelude::*;

use zeroflow_nn::Float;

const EPS: f64 = 1e-5;
/// Columns per task when summing the weight and bias gradients over rows.
const COLUMNS_PER_TASK: usize = 64;

/// `out = (inp - mean) * rstd * weight + bias` per row of width `c`; saves `mean` and `rstd`.
pub fn layernorm_forward<F: Float>(
    out: &mut [F],
    mean: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    bias: &[F],
    c: usize,
) {
    let width = F::of(c as f64);
    out.par_chunks_mut(c)
        .zip(mean.par_iter_mut().zip(rstd.par_iter_mut()))
        .zip(inp.par_chunks(c))
        .for_each(|((out, (mean, rstd)), x)| {
            let mu = x.iter().copied().sum::<F>() / width;
            let var = x.iter().map(|&v| (v - mu) * (v - mu)).sum::<F>() / width;
            let s = F::one() / (var + F::of(EPS)).sqrt();
            for (i, o) in out.iter_mut().enumerate() {
                *o = (x[i] - mu) * s * weight[i] + bias[i];
            }
            *mean = mu;
            *rstd = s;
        });
}

/// Adds the gradients of [`layernorm_forward`] to `dinp`, `dweight` and `dbias`.
#[allow(clippy::too_many_arguments, reason = "the kernel's inputs and outputs, as in llm.c")]
pub fn layernorm_backward<F: Float>(
    dinp: &mut [F],
    dweight: &mut [F],
    dbias: &mut [F],
    dout: &[F],
    inp: &[F],
    weight: &[F],
    mean: &[F],
    rstd: &[F],
    c: usize,
) {
    let width = F::of(c as f64);
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(mean.par_iter().zip(rstd.par_iter()))
        .for_each(|((dinp, (dy, x)), (&mu, &s))| {
            let (mut dnorm_mean, mut dnorm_norm_mean) = (F::zero(), F::zero());
            for i in 0..c {
                let dnorm = weight[i] * dy[i];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * (x[i] - mu) * s;
            }
            dnorm_mean = dnorm_mean / width;
            dnorm_norm_mean = dnorm_norm_mean / width;
            for i in 0..c {
                let norm = (x[i] - mu) * s;
                dinp[i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * s;
            }
        });
    // Column blocks: each task owns a block of the weight and bias gradients and sums all rows.
    dweight
        .par_chunks_mut(COLUMNS_PER_TASK)
        .zip(dbias.par_chunks_mut(COLUMNS_PER_TASK))
        .enumerate()
        .for_each(|(block, (dw, db))| {
            let first = block * COLUMNS_PER_TASK;
            for (row, (&mu, &s)) in mean.iter().zip(rstd).enumerate() {
                let x = &inp[row * c + first..][..dw.len()];
                let dy = &dout[row * c + first..][..dw.len()];
                for j in 0..dw.len() {
                    dw[j] += (x[j] - mu) * s * dy[j];
                    db[j] += dy[j];
                }
            }
        });
}
