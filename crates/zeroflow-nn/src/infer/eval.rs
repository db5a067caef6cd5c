//! The loss and perplexity of a model over a token stream: the stream cut into windows of
//! `window` inputs (stride `window`, so that every token is predicted once), each window's
//! targets the inputs shifted by one, the mean loss weighted by each window's tokens.

use std::ops::Range;

use crate::error::NnError;
use crate::float::Float;
use crate::host::HostRunner;
use crate::kernels::LayerKernel;
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

/// A token stream to evaluate ([`eval_windows`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct EvalStream<'a> {
    /// The tokens: each window's inputs, and shifted by one, its targets.
    pub tokens: &'a [u32],
    /// A byte per token, where given (a chat's loss mask): a target whose byte is 0 is
    /// [`IGNORE`] and does not count, as in training.
    pub mask: Option<&'a [u8]>,
    /// Where the stream's documents are packed (attention never crosses them, as a packed run
    /// trains and evaluates), each input token's position in its document, 0 at every window's
    /// start: a window's inputs take theirs.
    pub positions: Option<&'a [u32]>,
}

impl<'a> EvalStream<'a> {
    /// `tokens` alone: every target counts, every window one sequence.
    pub fn of(tokens: &'a [u32]) -> Self {
        EvalStream { tokens, ..EvalStream::default() }
    }

    /// The stream with `mask` ([`EvalStream::mask`]).
    pub fn masked(self, mask: Option<&'a [u8]>) -> Self {
        EvalStream { mask, ..self }
    }
}

/// The loss of `stream` in windows of `window` inputs ([`windows`]), given `mean_loss(inputs,
/// targets, positions)`, a model's mean loss over one window's counted targets (any family's
/// training forward serves; `positions` are the window's where the stream is packed). With a
/// mask, windows are weighted by the targets they count, and one that counts none is not run.
pub fn eval_windows<E>(
    stream: EvalStream<'_>,
    window: usize,
    mut mean_loss: impl FnMut(&[u32], &[u32], Option<&[u32]>) -> Result<f64, E>,
) -> Result<EvalResult, E> {
    let EvalStream { tokens: stream, mask, positions } = stream;
    if let Some(positions) = positions {
        assert!(positions.len() + 1 >= stream.len(), "a position for every input token");
    }
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
        let positions = positions.map(|positions| &positions[range.clone()]);
        debug_assert!(positions.is_none_or(|p| p[0] == 0), "a window starts at position 0");
        sum += mean_loss(inputs, targets, positions)? * counted as f64;
        tokens += counted;
    }
    let loss = if tokens == 0 { f64::NAN } else { sum / tokens as f64 };
    Ok(EvalResult { loss, tokens })
}

/// [`eval_windows`] by the training forward on host vectors: `runner(seq, packed)` makes a
/// family's [`HostRunner`] for one sequence of `seq` tokens, of packed rows where the stream is
/// packed; one is made for each window length (the full windows' and the last one's) and runs
/// every window of that length over `params`.
pub fn eval_on_host<F: Float, X: LayerKernel, E: From<NnError>>(
    params: &[F],
    stream: EvalStream<'_>,
    window: usize,
    mut runner: impl FnMut(usize, bool) -> Result<HostRunner<F, X>, E>,
) -> Result<EvalResult, E> {
    let packed = stream.positions.is_some();
    let mut runners: Vec<HostRunner<F, X>> = Vec::new();
    eval_windows(stream, window, |inputs, targets, positions| {
        let runner = match runners.iter().position(|r| r.plan().seq == inputs.len()) {
            Some(i) => &mut runners[i],
            None => {
                runners.push(runner(inputs.len(), packed)?);
                runners.last_mut().expect("just pushed")
            }
        };
        let loss = match positions {
            Some(positions) => runner.forward_packed(params, inputs, targets, positions)?,
            None => runner.forward(params, inputs, targets)?,
        };
        Ok(loss.to_f64())
    })
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
        let result = eval_windows::<()>(EvalStream::of(&stream), 4, |inputs, targets, _| {
            assert_eq!(targets[0], inputs[0] + 1, "targets are the inputs shifted by one");
            Ok(f64::from(inputs[0]))
        })
        .unwrap();
        assert_eq!(result.tokens, 9);
        assert!((result.loss - 24.0 / 9.0).abs() < 1e-12, "{}", result.loss);
        assert!((result.perplexity() - (24.0f64 / 9.0).exp()).abs() < 1e-9);
    }

    /// A packed stream's windows each take their inputs' positions.
    #[test]
    fn a_packed_stream_gives_each_window_its_positions() {
        let stream: Vec<u32> = (0..10).collect();
        let positions = [0, 1, 0, 1, 0, 0, 1, 2, 0, 1];
        let packed = EvalStream { positions: Some(&positions), ..EvalStream::of(&stream) };
        let mut seen = Vec::new();
        eval_windows::<()>(packed, 4, |inputs, _, positions| {
            seen.push((inputs[0], positions.expect("packed").to_vec()));
            Ok(0.0)
        })
        .unwrap();
        assert_eq!(seen, [(0, vec![0, 1, 0, 1]), (4, vec![0, 0, 1, 2]), (8, vec![0])]);
        let mut unpacked = 0;
        eval_windows::<()>(EvalStream::of(&stream), 4, |_, _, positions| {
            unpacked += usize::from(positions.is_none());
            Ok(0.0)
        })
        .unwrap();
        assert_eq!(unpacked, 3, "no positions where the stream is not packed");
    }

    /// With a mask, the targets whose byte is 0 are ignored, each window weighs by the targets
    /// it counts, and a window that counts none is not run.
    #[test]
    fn a_mask_leaves_out_its_targets_and_windows_without_any() {
        let stream: Vec<u32> = (0..10).collect();
        // Targets 1..=9; counted: 2, 3 (window 0..4) and 9 (window 8..9); none in 4..8.
        let mask = [0, 0, 1, 1, 0, 0, 0, 0, 0, 1];
        let mut runs = Vec::new();
        let masked = EvalStream::of(&stream).masked(Some(&mask));
        let result = eval_windows::<()>(masked, 4, |inputs, targets, _| {
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
