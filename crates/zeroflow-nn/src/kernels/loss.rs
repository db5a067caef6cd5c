//! Softmax + cross-entropy over the real vocabulary; the padded logits are masked out.

use rayon::prelude::*;

use super::encoder::check_tokens;
use crate::float::Float;

/// Per row of `padded_vocab` logits: `probs` = softmax over the first `vocab` columns (the padded
/// columns get probability 0) and `losses = -ln probs[target]`, computed as log-sum-exp minus the
/// target's logit so that it stays finite.
pub fn softmax_xent_forward<F: Float>(
    probs: &mut [F],
    losses: &mut [F],
    logits: &[F],
    targets: &[u32],
    vocab: usize,
    padded_vocab: usize,
) -> Result<(), String> {
    check_tokens(targets, vocab)?;
    probs
        .par_chunks_mut(padded_vocab)
        .zip(losses.par_iter_mut())
        .zip(logits.par_chunks(padded_vocab).zip(targets.par_iter()))
        .for_each(|((probs, loss), (logits, &target))| {
            let real = &logits[..vocab];
            let max = real.iter().fold(F::neg_infinity(), |m, &x| m.max(x));
            let mut sum = F::zero();
            for (p, &x) in probs.iter_mut().zip(real) {
                *p = (x - max).exp();
                sum += *p;
            }
            probs[..vocab].iter_mut().for_each(|p| *p = *p / sum);
            probs[vocab..].fill(F::zero());
            *loss = sum.ln() + max - real[target as usize];
        });
    Ok(())
}

/// `loss[0]` = the mean of `losses` (summed in f64).
pub fn mean_loss<F: Float>(loss: &mut [F], losses: &[F]) {
    let sum: f64 = losses.iter().map(|&l| l.to_f64()).sum();
    loss[0] = F::of(sum / losses.len() as f64);
}

/// `dlogits += (probs - onehot(target)) * dloss` over the real vocabulary (the padded columns get
/// no gradient). `dloss` is the gradient of the objective with respect to each position's loss.
pub fn softmax_xent_backward<F: Float>(
    dlogits: &mut [F],
    probs: &[F],
    targets: &[u32],
    dloss: F,
    vocab: usize,
    padded_vocab: usize,
) {
    dlogits
        .par_chunks_mut(padded_vocab)
        .zip(probs.par_chunks(padded_vocab).zip(targets.par_iter()))
        .for_each(|(dlogits, (probs, &target))| {
            for (i, (g, &p)) in dlogits[..vocab].iter_mut().zip(probs).enumerate() {
                let indicator = if i == target as usize { F::one() } else { F::zero() };
                *g += (p - indicator) * dloss;
            }
        });
}
