//! Softmax + cross-entropy over the real vocabulary; the padded logits are masked out. A target
//! of [`IGNORE`] is a position whose loss does not count: it loses 0, gets no gradient, and is
//! left out of the mean.

use rayon::prelude::*;

use crate::float::Float;

/// The target of a position whose prediction is not trained (a loss-masked token): no loss, no
/// gradient, not counted in the mean.
pub const IGNORE: u32 = u32::MAX;

/// Checks that every target is below `vocab` or is [`IGNORE`].
pub fn check_targets(targets: &[u32], vocab: usize) -> Result<(), String> {
    match targets.iter().position(|&t| t != IGNORE && t as usize >= vocab) {
        Some(i) => Err(format!(
            "target id {} at position {i} is not below the vocabulary size {vocab} (nor the \
             ignored target {IGNORE})",
            targets[i]
        )),
        None => Ok(()),
    }
}

/// The number of targets that count (are not [`IGNORE`]).
pub fn counted_targets(targets: &[u32]) -> usize {
    targets.iter().filter(|&&t| t != IGNORE).count()
}

/// Per row of `padded_vocab` logits: `probs` = softmax over the first `vocab` columns (the padded
/// columns get probability 0) and `losses = -ln probs[target]`, computed as log-sum-exp minus the
/// target's logit so that it stays finite; 0 where the target is [`IGNORE`].
pub fn softmax_xent_forward<F: Float>(
    probs: &mut [F],
    losses: &mut [F],
    logits: &[F],
    targets: &[u32],
    vocab: usize,
    padded_vocab: usize,
) -> Result<(), String> {
    check_targets(targets, vocab)?;
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
            *loss = match target {
                IGNORE => F::zero(),
                target => sum.ln() + max - real[target as usize],
            };
        });
    Ok(())
}

/// `loss[0]` = the mean of `losses` over the positions whose target counts (summed in f64); 0
/// where none does.
pub fn mean_loss<F: Float>(loss: &mut [F], losses: &[F], targets: &[u32]) {
    let sum: f64 =
        losses.iter().zip(targets).filter(|&(_, &t)| t != IGNORE).map(|(&l, _)| l.to_f64()).sum();
    let counted = counted_targets(targets);
    loss[0] = F::of(if counted == 0 { 0.0 } else { sum / counted as f64 });
}

/// `dlogits += (probs - onehot(target)) * dloss` over the real vocabulary (the padded columns get
/// no gradient, nor do the rows whose target is [`IGNORE`]). `dloss` is the gradient of the
/// objective with respect to each counted position's loss.
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
        .filter(|(_, (_, target))| **target != IGNORE)
        .for_each(|(dlogits, (probs, &target))| {
            for (i, (g, &p)) in dlogits[..vocab].iter_mut().zip(probs).enumerate() {
                let indicator = if i == target as usize { F::one() } else { F::zero() };
                *g += (p - indicator) * dloss;
            }
        });
}
