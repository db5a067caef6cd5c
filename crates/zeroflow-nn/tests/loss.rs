//! The cross-entropy with ignored targets ([`IGNORE`]): a masked-out position loses nothing, gets
//! no gradient and is left out of the mean; the gradient is that of the mean over the counted
//! positions (against finite differences); and a batch with nothing counted gives 0, not NaN.

use zeroflow_nn::kernels::loss::{
    IGNORE, check_targets, mean_loss, softmax_xent_backward, softmax_xent_forward,
};

const VOCAB: usize = 11;
const PADDED: usize = 16;
const ROWS: usize = 9;

/// Deterministic logits in about [-3, 3] (the padded columns hold junk the kernels must ignore).
fn logits() -> Vec<f64> {
    (0..ROWS * PADDED).map(|i| ((i * 37 % 101) as f64 / 101.0 - 0.5) * 6.0).collect()
}

/// Targets with every third position, and the last, ignored.
fn targets() -> Vec<u32> {
    (0..ROWS)
        .map(|r| if r % 3 == 1 || r == ROWS - 1 { IGNORE } else { (r * 5 % VOCAB) as u32 })
        .collect()
}

fn losses_of(logits: &[f64], targets: &[u32]) -> (Vec<f64>, Vec<f64>, f64) {
    let (mut probs, mut losses, mut loss) =
        (vec![0.0; logits.len()], vec![0.0; targets.len()], [0.0]);
    softmax_xent_forward(&mut probs, &mut losses, logits, targets, VOCAB, PADDED).unwrap();
    mean_loss(&mut loss, &losses, targets);
    (probs, losses, loss[0])
}

/// -ln softmax(row)[target], computed here from scratch.
fn reference_loss(row: &[f64], target: u32) -> f64 {
    let real = &row[..VOCAB];
    let max = real.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = real.iter().map(|x| (x - max).exp()).sum();
    sum.ln() + max - real[target as usize]
}

#[test]
fn the_masked_loss_is_the_mean_of_the_counted_positions_losses() {
    let (logits, targets) = (logits(), targets());
    let (_, losses, loss) = losses_of(&logits, &targets);
    let counted: Vec<f64> = targets
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t != IGNORE)
        .map(|(r, &t)| reference_loss(&logits[r * PADDED..(r + 1) * PADDED], t))
        .collect();
    assert_eq!(counted.len(), 5);
    let expected = counted.iter().sum::<f64>() / counted.len() as f64;
    assert!((loss - expected).abs() < 1e-6, "masked mean {loss} vs {expected}");
    for (r, &t) in targets.iter().enumerate() {
        if t == IGNORE {
            assert_eq!(losses[r], 0.0, "an ignored position loses nothing (row {r})");
        }
    }
    // Not the mean over all positions: the ignored ones are not counted as zeros.
    let all = losses.iter().sum::<f64>() / ROWS as f64;
    assert!((all - expected).abs() > 1e-3);
}

/// The gradient of the masked mean (`dloss` = 1 / counted) against central differences of it in
/// every real logit; the ignored rows' gradients are exactly zero and the padded columns untouched.
#[test]
fn the_gradient_is_that_of_the_mean_over_the_counted_positions() {
    let (logits, targets) = (logits(), targets());
    let (probs, _, _) = losses_of(&logits, &targets);
    let counted = targets.iter().filter(|&&t| t != IGNORE).count();
    let mut dlogits = vec![0.0; logits.len()];
    softmax_xent_backward(&mut dlogits, &probs, &targets, 1.0 / counted as f64, VOCAB, PADDED);
    let h = 1e-5;
    for i in 0..logits.len() {
        let (row, column) = (i / PADDED, i % PADDED);
        if column >= VOCAB {
            assert_eq!(dlogits[i], 0.0, "padded column {i}");
            continue;
        }
        let mut shifted = logits.clone();
        shifted[i] += h;
        let up = losses_of(&shifted, &targets).2;
        shifted[i] -= 2.0 * h;
        let down = losses_of(&shifted, &targets).2;
        let numeric = (up - down) / (2.0 * h);
        assert!((dlogits[i] - numeric).abs() < 1e-7, "logit {i}: {} vs {numeric}", dlogits[i]);
        if targets[row] == IGNORE {
            assert_eq!(dlogits[i], 0.0, "ignored row {row}");
        }
    }
}

/// A micro-batch whose targets are all ignored: loss 0 (not 0/0), and no gradient at all.
#[test]
fn nothing_counted_gives_a_zero_loss_and_no_gradient() {
    let logits = logits();
    let targets = vec![IGNORE; ROWS];
    let (probs, losses, loss) = losses_of(&logits, &targets);
    assert_eq!(loss, 0.0);
    assert!(losses.iter().all(|&l| l == 0.0));
    let mut dlogits = vec![0.25; logits.len()];
    softmax_xent_backward(&mut dlogits, &probs, &targets, 1.0, VOCAB, PADDED);
    assert!(dlogits.iter().all(|&g| g == 0.25), "accumulating adds nothing");
}

#[test]
fn targets_must_be_in_the_vocabulary_or_ignored() {
    assert!(check_targets(&[0, IGNORE, VOCAB as u32 - 1], VOCAB).is_ok());
    let error = check_targets(&[0, VOCAB as u32], VOCAB).unwrap_err();
    assert!(error.contains("position 1"), "{error}");
}
