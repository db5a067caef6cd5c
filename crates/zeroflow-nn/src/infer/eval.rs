//! The loss and perplexity of a model over a token stream: the stream cut into windows of
//! `window` inputs (stride `window`, so that every token is predicted once), each window's
//! targets the inputs shifted by one, the mean loss weighted by each window's tokens.

use std::ops::Range;

use crate::kernels::loss::IGNORE;

/// The mean loss over a stream's predicted tokens, and how many there were.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalResult {
    /// The mean cross-entropy per predicted token (nats).
    pub loss: f64,
    /// The tokens predicted (the stream's length less one, when it has two tokens or more).
    pub tokens: usize,
}

impl EvalResult {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// The input ranges of a stream of `len` tokens in windows of `window` inputs: `[0, w)`,
/// `[w, 2w)`, …, the last one shorter where the stream does not divide; a window's targets are
/// its range shifted by one, so the last window stops one token before the stream's end.
pub fn windows(len: usize, window: usize) -> Vec<Range<usize>> {
    assert!(window > 0, "a window has at least one token");
    let predicted = len.saturating_sub(1);
    (0..predicted).step_by(window).map(|start| start..(start + window).min(predicted)).collect()
}

/// The loss of `stream` in windows of `window` inputs ([`windows`]), given `mean_loss(inputs,
/// targets)`, a model's mean loss over one window's counted targets (any family's training
/// forward serves). With `mask` (a byte per token of the stream, a chat's loss mask), a target
/// whose byte is 0 is [`IGNORE`] and does not count, as in training; windows are weighted by the
/// targets they count, and one that counts none is not run.
pub fn eval_windows<E>(
    stream: &[u32],
    mask: Option<&[u8]>,
    window: usize,
    mut mean_loss: impl FnMut(&[u32], &[u32]) -> Result<f64, E>,
) -> Result<EvalResult, E> {
    let (mut sum, mut tokens) = (0.0, 0);
    let mut masked = Vec::new();
    for range in windows(stream.len(), window) {
        let inputs = &stream[range.clone()];
        let targets = &stream[range.start + 1..range.end + 1];
        let (targets, counted) = match mask {
            Some(mask) => {
                masked.clear();
                let keep = &mask[range.start + 1..range.end + 1];
                masked.extend(
                    targets.iter().zip(keep).map(|(&t, &k)| if k == 0 { IGNORE } else { t }),
                );
                (masked.as_slice(), keep.iter().filter(|&&k| k != 0).count())
            }
            None => (targets, inputs.len()),
        };
        if counted == 0 {
            continue;
        }
        sum += mean_loss(inputs, targets)? * counted as f64;
        tokens += counted;
    }
    let loss = if tokens == 0 { f64::NAN } else { sum / tokens as f64 };
    Ok(EvalResult { loss, tokens })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_predict_every_token_but_the_first_once() {
        assert_eq!(windows(10, 4), vec![0..4, 4..8, 8..9]);
        assert_eq!(windows(9, 4), vec![0..4, 4..8]);
        assert_eq!(windows(1, 4), Vec::<Range<usize>>::new());
        for (len, window) in [(17, 5), (64, 8), (3, 7)] {
            let covered: usize = windows(len, window).iter().map(|r| r.len()).sum();
            assert_eq!(covered, len - 1, "{len} tokens in windows of {window}");
        }
    }

    #[test]
    fn the_loss_is_the_token_weighted_mean_of_the_windows() {
        // Window losses equal to the window's first input: (0·4 + 4·4 + 8·1) / 9.
        let stream: Vec<u32> = (0..10).collect();
        let result = eval_windows::<()>(&stream, None, 4, |inputs, targets| {
            assert_eq!(targets[0], inputs[0] + 1, "targets are the inputs shifted by one");
            Ok(f64::from(inputs[0]))
        })
        .unwrap();
        assert_eq!(result.tokens, 9);
        assert!((result.loss - 24.0 / 9.0).abs() < 1e-12, "{}", result.loss);
        assert!((result.perplexity() - (24.0f64 / 9.0).exp()).abs() < 1e-9);
    }

    /// With a mask, the targets whose byte is 0 are ignored, each window weighs by the targets
    /// it counts, and a window that counts none is not run.
    #[test]
    fn a_mask_leaves_out_its_targets_and_windows_without_any() {
        let stream: Vec<u32> = (0..10).collect();
        // Targets 1..=9; counted: 2, 3 (window 0..4) and 9 (window 8..9); none in 4..8.
        let mask = [0, 0, 1, 1, 0, 0, 0, 0, 0, 1];
        let mut runs = Vec::new();
        let result = eval_windows::<()>(&stream, Some(&mask), 4, |inputs, targets| {
            runs.push(inputs[0]);
            let counted: Vec<u32> = targets.iter().copied().filter(|&t| t != IGNORE).collect();
            Ok(f64::from(counted.iter().sum::<u32>()) / counted.len() as f64)
        })
        .unwrap();
        assert_eq!(runs, [0, 8], "the window 4..8 counts nothing");
        assert_eq!(result.tokens, 3);
        // (2.5 · 2 + 9 · 1) / 3.
        assert!((result.loss - 14.0 / 3.0).abs() < 1e-12, "{}", result.loss);
    }
}
