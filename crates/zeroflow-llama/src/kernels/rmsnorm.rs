//! RMSNorm over the last dimension (`transformers`' `LlamaRMSNorm`): `out = x · rstd · weight`
//! with `rstd = 1 / sqrt(mean(x²) + eps)` per row. The same kernel is the final and per-layer
//! norm (rows of `hidden_size`) and Qwen3's per-head q/k norm (rows of `head_dim`: the
//! `[tokens, heads, head_dim]` queries or keys are `tokens · heads` rows).

use rayon::prelude::*;
use zeroflow_nn::Float;

/// Columns per task when summing the weight gradient over rows.
const COLUMNS_PER_TASK: usize = 64;

/// `out = inp · rstd · weight` per row of width `c`; saves `rstd` (one per row) for backward.
pub fn rmsnorm_forward<F: Float>(
    out: &mut [F],
    rstd: &mut [F],
    inp: &[F],
    weight: &[F],
    c: usize,
    eps: f64,
) {
    let width = F::of(c as f64);
    out.par_chunks_mut(c).zip(rstd.par_iter_mut()).zip(inp.par_chunks(c)).for_each(
        |((out, rstd), x)| {
            let mean_square = x.iter().map(|&v| v * v).sum::<F>() / width;
            let s = F::one() / (mean_square + F::of(eps)).sqrt();
            for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
                *o = v * s * w;
            }
            *rstd = s;
        },
    );
}

/// Adds the gradients of [`rmsnorm_forward`]: `dinp += rstd · (w·dout − x · rstd² · mean(w·dout·x))`
/// per row, `dweight += Σ_rows x · rstd · dout`.
pub fn rmsnorm_backward<F: Float>(
    dinp: &mut [F],
    dweight: &mut [F],
    dout: &[F],
    inp: &[F],
    weight: &[F],
    rstd: &[F],
    c: usize,
) {
    let width = F::of(c as f64);
    dinp.par_chunks_mut(c)
        .zip(dout.par_chunks(c).zip(inp.par_chunks(c)))
        .zip(rstd.par_iter())
        .for_each(|((dinp, (dy, x)), &s)| {
            let weighted: F = (0..c).map(|i| weight[i] * dy[i] * x[i]).sum::<F>() / width;
            for i in 0..c {
                dinp[i] += s * (weight[i] * dy[i] - x[i] * s * s * weighted);
            }
        });
    // Column blocks: each task owns a block of the weight gradient and sums all rows.
    dweight.par_chunks_mut(COLUMNS_PER_TASK).enumerate().for_each(|(block, dw)| {
        let first = block * COLUMNS_PER_TASK;
        for (row, &s) in rstd.iter().enumerate() {
            let x = &inp[row * c + first..][..dw.len()];
            let dy = &dout[row * c + first..][..dw.len()];
            for j in 0..dw.len() {
                dw[j] += x[j] * s * dy[j];
            }
        }
    });
}
