//! The loss and perplexity of a model over a token stream: the stream cut into windows of
//! `window` inputs (stride `window`, so that every token is predicted once), each window's
//! targets the inputs shifted by one, the mean loss weighted by each window's tokens.

use std::ops::Range;

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
/// targets)`, a model's mean loss over one window (any family's training forward serves).
pub fn eval_windows<E>(
    stream: &[u32],
    window: usize,
    mut mean_loss: impl FnMut(&[u32], &[u32]) -> Result<f64, E>,
) -> Result<EvalResult, E> {
    let (mut sum, mut tokens) = (0.0, 0);
    for range in windows(stream.len(), window) {
        let inputs = &stream[range.clone()];
        let targets = &stream[range.start + 1..range.end + 1];
        sum += mean_loss(inputs, targets)? * inputs.len() as f64;
        tokens += inputs.len();
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
        let result = eval_windows::<()>(&stream, 4, |inputs, targets| {
            assert_eq!(targets[0], inputs[0] + 1, "targets are the inputs shifted by one");
            Ok(f64::from(inputs[0]))
        })
        .unwrap();
        assert_eq!(result.tokens, 9);
        assert!((result.loss - 24.0 / 9.0).abs() < 1e-12, "{}", result.loss);
        assert!((result.perplexity() - (24.0f64 / 9.0).exp()).abs() < 1e-9);
    }
}
