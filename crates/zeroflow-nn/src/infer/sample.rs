//! Choosing the next token from logits (greedy, temperature, top-k, top-p, from a seeded RNG),
//! and [`generate`]: a batch of prompts through a [`Decoder`], the prompts in one pass, then one
//! token per sequence per step.

use std::ops::ControlFlow;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::Decoder;
use crate::float::Float;

/// How the next token is chosen from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 is greedy (the first largest logit, as `argmax`); otherwise the logits are divided by it
    /// before the softmax.
    pub temperature: f64,
    /// Only the `k` most likely tokens are drawn from (`None`: all).
    pub top_k: Option<usize>,
    /// Only the smallest set of most likely tokens whose probabilities sum to at least `p` is
    /// drawn from (`None`: all).
    pub top_p: Option<f64>,
}

impl Sampling {
    pub const GREEDY: Sampling = Sampling { temperature: 0.0, top_k: None, top_p: None };
}

/// What [`generate`] does.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to add to each prompt at most.
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Sequence `b` draws from a ChaCha8 stream `b` of this seed: the same seed gives the same
    /// tokens, whatever else is in the batch.
    pub seed: u64,
    /// A sequence ends after it produces one of these tokens (kept in its output), such as the
    /// model's end-of-text tokens (`zeroflow_hf::eos_token_ids`); empty never ends early.
    pub stop_tokens: Vec<u32>,
}

/// The next token from one row of logits: greedy at temperature 0, else a draw from `rng`.
pub fn sample_token<F: Float>(logits: &[F], sampling: &Sampling, rng: &mut ChaCha8Rng) -> u32 {
    let greedy = || {
        let mut best = 0;
        for (i, &x) in logits.iter().enumerate() {
            if x > logits[best] {
                best = i;
            }
        }
        best as u32
    };
    if sampling.temperature <= 0.0 {
        return greedy();
    }
    let mut candidates: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &x)| (i as u32, x.to_f64() / sampling.temperature))
        .collect();
    // Most likely first; equal logits keep their order.
    candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
    if let Some(k) = sampling.top_k {
        candidates.truncate(k.max(1));
    }
    let max = candidates[0].1;
    let mut probs: Vec<f64> = candidates.iter().map(|&(_, x)| (x - max).exp()).collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if let Some(top_p) = sampling.top_p {
        let mut cumulative = 0.0;
        let keep = probs
            .iter()
            .position(|&p| {
                cumulative += p;
                cumulative >= top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    let total: f64 = probs.iter().sum();
    let mut draw = rng.random::<f64>() * total;
    for (i, &p) in probs.iter().enumerate() {
        if draw < p {
            return candidates[i].0;
        }
        draw -= p;
    }
    candidates[probs.len() - 1].0
}

/// Adds up to `options.max_new_tokens` tokens to each of `prompts` (each at least one token),
/// and returns the new tokens of each (the stop token included where one ended it). The prompts
/// run in one pass of `model`'s prefill, then every unfinished sequence one token per decode
/// step.
pub fn generate<D: Decoder>(
    model: &mut D,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
) -> Result<Vec<Vec<u32>>, D::Error> {
    if prompts.is_empty() || options.max_new_tokens == 0 {
        return Ok(vec![Vec::new(); prompts.len()]);
    }
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let capacity = (longest + options.max_new_tokens).min(model.max_positions());
    let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let logits = model.prefill(&views, capacity)?;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    decode_from(model, logits, &lens, capacity, options, &mut |_, _| ControlFlow::Continue(()))
}

/// The new tokens of sequences `0..lens.len()` (sequence `b` of `lens[b]` positions, in a cache
/// of `capacity`) from their next-token logits `logits`, one decode step per token for the
/// unfinished ones; sequence `b` draws from stream `b` of the seed. `on_token(seq, token)` is
/// told of each as it is chosen, and ends the sequence there where it breaks.
fn decode_from<D: Decoder>(
    model: &mut D,
    mut logits: Vec<D::Float>,
    lens: &[usize],
    capacity: usize,
    options: &GenerateOptions,
    on_token: &mut dyn FnMut(usize, u32) -> ControlFlow<()>,
) -> Result<Vec<Vec<u32>>, D::Error> {
    let vocab = model.vocab_size();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); lens.len()];
    let mut rngs: Vec<ChaCha8Rng> = (0..lens.len())
        .map(|b| {
            let mut rng = ChaCha8Rng::seed_from_u64(options.seed);
            rng.set_stream(b as u64);
            rng
        })
        .collect();
    let mut active: Vec<usize> = (0..lens.len()).collect();
    loop {
        let mut next = Vec::with_capacity(active.len());
        for (row, &seq) in active.iter().enumerate() {
            let token =
                sample_token(&logits[row * vocab..][..vocab], &options.sampling, &mut rngs[seq]);
            out[seq].push(token);
            let done = on_token(seq, token).is_break()
                || out[seq].len() >= options.max_new_tokens
                || options.stop_tokens.contains(&token)
                || lens[seq] + out[seq].len() >= capacity;
            if !done {
                next.push((seq, token));
            }
        }
        if next.is_empty() {
            return Ok(out);
        }
        active = next.iter().map(|&(seq, _)| seq).collect();
        logits = model.decode(&next)?;
    }
}

/// One sequence generated in turns through one decoder, as a conversation is: the tokens the
/// decoder's cache holds of it, so that a turn whose prompt starts with what an earlier turn
/// ran (its prompt and reply) runs only the tokens after them ([`Decoder::extend`]). A turn
/// adds the tokens [`generate`] adds to its prompt alone.
#[derive(Clone, Debug, Default)]
pub struct Continuation {
    /// The tokens whose keys and values the decoder holds, in order.
    held: Vec<u32>,
    /// The prompt's tokens the last turn ran (the others were held).
    ran: usize,
}

impl Continuation {
    /// Adds up to `options.max_new_tokens` tokens to `prompt` (at least one token) through
    /// `model`, the decoder of the earlier turns (used for nothing else since: otherwise start
    /// a new `Continuation`), and returns them (the stop token included where one ended it).
    /// The positions the prompt shares with what the cache holds are kept, the rest run in one
    /// pass; at least the prompt's last token runs, its logits the first token's.
    pub fn generate<D: Decoder>(
        &mut self,
        model: &mut D,
        prompt: &[u32],
        options: &GenerateOptions,
    ) -> Result<Vec<u32>, D::Error> {
        self.generate_with(model, prompt, options, |_| ControlFlow::Continue(()))
    }

    /// [`Continuation::generate`], telling `on_token` of each new token as it is chosen; the turn
    /// ends with the token at which it breaks (a reply the user stopped), the cache holding what
    /// it ran, as after any turn.
    pub fn generate_with<D: Decoder>(
        &mut self,
        model: &mut D,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> ControlFlow<()>,
    ) -> Result<Vec<u32>, D::Error> {
        if options.max_new_tokens == 0 {
            return Ok(Vec::new());
        }
        let shared = self.held.iter().zip(prompt).take_while(|(held, new)| held == new).count();
        let keep = shared.min(prompt.len().saturating_sub(1));
        let capacity = (prompt.len() + options.max_new_tokens).min(model.max_positions());
        // Until the turn ends, what the cache holds is not known.
        self.held.clear();
        self.ran = 0;
        let logits = model.extend(keep, &prompt[keep..], capacity)?;
        let mut told = |_: usize, token: u32| on_token(token);
        let out =
            decode_from(model, logits, &[prompt.len()], capacity, options, &mut told)?.remove(0);
        self.ran = prompt.len() - keep;
        // Every new token but the last went through the decoder.
        self.held = [prompt, &out[..out.len() - 1]].concat();
        Ok(out)
    }

    /// The prompt's tokens the last turn ran; the rest of it the cache held.
    pub fn last_ran(&self) -> usize {
        self.ran
    }

    /// The positions the decoder's cache holds of the sequence.
    pub fn held(&self) -> usize {
        self.held.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: u64) -> ChaCha8Rng {
        ChaCha8Rng::seed_from_u64(seed)
    }

    #[test]
    fn greedy_takes_the_first_largest_logit() {
        let logits = [0.5f32, 2.0, -1.0, 2.0];
        assert_eq!(sample_token(&logits, &Sampling::GREEDY, &mut rng(0)), 1);
    }

    #[test]
    fn draws_follow_the_softmax_of_the_tempered_logits() {
        let logits = [0.0f64, 1.0, 2.0, -1.0];
        let sampling = Sampling { temperature: 2.0, top_k: None, top_p: None };
        let weights: Vec<f64> = logits.iter().map(|x| (x / 2.0f64).exp()).collect();
        let sum: f64 = weights.iter().sum();
        let mut counts = [0usize; 4];
        let mut r = rng(7);
        let draws = 40_000;
        for _ in 0..draws {
            counts[sample_token(&logits, &sampling, &mut r) as usize] += 1;
        }
        for (i, &count) in counts.iter().enumerate() {
            let expected = weights[i] / sum;
            let found = count as f64 / draws as f64;
            // Five standard deviations of a binomial frequency at this many draws.
            let bound = 5.0 * (expected * (1.0 - expected) / draws as f64).sqrt();
            assert!((found - expected).abs() < bound, "token {i}: {found} against {expected}");
        }
    }

    #[test]
    fn top_k_and_top_p_draw_only_from_the_most_likely_tokens() {
        let logits = [3.0f32, 0.0, 2.9, 1.0, 2.8];
        let top_k = Sampling { temperature: 1.0, top_k: Some(2), top_p: None };
        // Softmax: 3.0 → 0.38, 2.9 → 0.34, 2.8 → 0.31: the first two sum to 0.72 < 0.75.
        let top_p = Sampling { temperature: 1.0, top_k: None, top_p: Some(0.75) };
        let mut r = rng(3);
        let mut seen_k = std::collections::BTreeSet::new();
        let mut seen_p = std::collections::BTreeSet::new();
        for _ in 0..2000 {
            seen_k.insert(sample_token(&logits, &top_k, &mut r));
            seen_p.insert(sample_token(&logits, &top_p, &mut r));
        }
        assert_eq!(seen_k.into_iter().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(seen_p.into_iter().collect::<Vec<_>>(), vec![0, 2, 4]);
        let one = Sampling { temperature: 1.0, top_k: Some(1), top_p: None };
        assert!((0..100).all(|_| sample_token(&logits, &one, &mut r) == 0));
    }
}
