//! The key/value-cached decoder against the training forward on every odd model of
//! `support::models` (GQA 3:1 untied, llama3 rope scaling with biases and tied embeddings, Qwen2
//! biases, Qwen3 q/k norm with head_dim ≠ hidden / heads, Mistral tied, MQA): at every step each
//! sequence's logits equal those of the whole prefix recomputed by `HostLlama` (f64), with
//! prompts of different lengths in one batch and a sequence that stops early.

use std::ops::ControlFlow;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_llama::{AttentionKind, HostLlama, LlamaConfig, LlamaDecoder, flat_layout};
use zeroflow_nn::infer::{Continuation, Decoder, EvalStream, GenerateOptions, Sampling, generate};

use crate::support::{models, perturbed_params, relative_error};

/// Greedy generation of up to `max_new_tokens`, without stop tokens.
fn greedy(max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_new_tokens, sampling: Sampling::GREEDY, seed: 0, stop_tokens: Vec::new() }
}

/// The logits of the last position of `prefix`, by the training forward over the whole prefix.
fn recomputed(config: &LlamaConfig, params: &[f64], prefix: &[u32]) -> Vec<f64> {
    let layout = flat_layout(config, 1).unwrap();
    let mut model =
        HostLlama::<f64>::new(config, &layout, 1, prefix.len(), AttentionKind::Gemm).unwrap();
    model.forward(params, prefix, prefix).unwrap();
    let vocab = config.vocab_size;
    model.logits()[(prefix.len() - 1) * vocab..][..vocab].to_vec()
}

#[test]
fn cached_logits_equal_the_recomputed_prefix_at_every_step_for_every_odd_model() {
    const LONGEST: usize = 11;
    for (name, config) in models() {
        let (layout, params) = perturbed_params(&config, 3);
        let mut decoder = LlamaDecoder::new(&config, &layout, &params).unwrap();
        let vocab = config.vocab_size;
        let mut rng = ChaCha8Rng::seed_from_u64(4);
        let mut seqs: Vec<Vec<u32>> = [2usize, 5, 1]
            .iter()
            .map(|&len| (0..len).map(|_| rng.random_range(0..vocab as u32)).collect())
            .collect();
        let views: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let logits = decoder.prefill(&views, LONGEST).unwrap();
        for (b, seq) in seqs.iter().enumerate() {
            let expected = recomputed(&config, &params, seq);
            let error = relative_error(&logits[b * vocab..][..vocab], &expected);
            assert!(error < 1e-12, "{name}: prefill, sequence {b}: relative error {error}");
        }
        for step in 0..LONGEST - 1 {
            // Sequence 0 stops after 4 steps; the others run to LONGEST positions.
            let next: Vec<(usize, u32)> = (0..3)
                .filter(|&b| seqs[b].len() < LONGEST && (b != 0 || step < 4))
                .map(|b| (b, rng.random_range(0..vocab as u32)))
                .collect();
            let logits = decoder.decode(&next).unwrap();
            for (row, &(b, token)) in next.iter().enumerate() {
                seqs[b].push(token);
                let expected = recomputed(&config, &params, &seqs[b]);
                let error = relative_error(&logits[row * vocab..][..vocab], &expected);
                assert!(error < 1e-12, "{name}: step {step}, sequence {b}: relative error {error}");
            }
        }
        assert_eq!(seqs[2].len(), LONGEST, "{name}: sequence 2 filled the cache");
        assert!(decoder.decode(&[(2, 0)]).is_err(), "{name}: a step past the cache is refused");
    }
}

#[test]
fn greedy_generation_equals_argmax_of_the_recomputed_prefix() {
    let (_, config) = models().swap_remove(3);
    let (layout, params) = perturbed_params(&config, 8);
    let mut decoder = LlamaDecoder::new(&config, &layout, &params).unwrap();
    let prompts = vec![vec![1, 7, 3], vec![10]];
    let options = greedy(7);
    let generated = generate(&mut decoder, &prompts, &options).unwrap();
    for (prompt, new) in prompts.iter().zip(&generated) {
        assert_eq!(new.len(), 7);
        let mut prefix = prompt.clone();
        for &token in new {
            let logits = recomputed(&config, &params, &prefix);
            let argmax = (0..logits.len())
                .fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
            assert_eq!(token as usize, argmax, "after {prefix:?}");
            prefix.push(token);
        }
    }
}

/// A conversation's turns on one decoder ([`Decoder::extend`]): each keeps a prefix of what the
/// cache holds and appends tokens, and its logits, and those of a decode step after it, are the
/// whole sequence's recomputed. The turns: a first; one after the last turn's decode step; one
/// that keeps less than the cache holds (a reply rendered back otherwise) and grows it; one
/// that starts over.
#[test]
fn extending_a_kept_prefix_gives_the_recomputed_logits_for_every_odd_model() {
    for (name, config) in models() {
        let (layout, params) = perturbed_params(&config, 6);
        let mut decoder = LlamaDecoder::new(&config, &layout, &params).unwrap();
        let vocab = config.vocab_size as u32;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut sequence: Vec<u32> = Vec::new();
        for (turn, (keep, new, capacity)) in
            [(0, 5, 8), (6, 3, 10), (4, 2, 20), (0, 3, 20)].into_iter().enumerate()
        {
            sequence.truncate(keep);
            let tokens: Vec<u32> = (0..new).map(|_| rng.random_range(0..vocab)).collect();
            sequence.extend(&tokens);
            let logits = decoder.extend(keep, &tokens, capacity).unwrap();
            let error = relative_error(&logits, &recomputed(&config, &params, &sequence));
            assert!(error < 1e-12, "{name}: turn {turn}: relative error {error}");
            let token = rng.random_range(0..vocab);
            sequence.push(token);
            let logits = decoder.decode(&[(0, token)]).unwrap();
            let error = relative_error(&logits, &recomputed(&config, &params, &sequence));
            assert!(error < 1e-12, "{name}: turn {turn}'s decode step: relative error {error}");
        }
        let held = sequence.len();
        let error = decoder.extend(held + 1, &[1], 40).unwrap_err().to_string();
        assert!(
            error.contains(&format!("keeps {} positions of a sequence of {held}", held + 1)),
            "{name}: {error}"
        );
    }
}

/// `Continuation` over one decoder gives each turn the tokens `generate` gives its prompt alone,
/// running only what the cache does not hold: all of a first prompt; after a turn, the reply's
/// last token and the new ones; where the prompt changes the reply's last token, from there;
/// a prompt that shares nothing, all of it; one that the cache holds whole, its last token.
#[test]
fn a_continued_conversation_runs_only_its_new_tokens_and_generates_as_from_scratch() {
    for (name, config) in models() {
        let (layout, params) = perturbed_params(&config, 8);
        let options = greedy(4);
        let mut decoder = LlamaDecoder::new(&config, &layout, &params).unwrap();
        let mut continuation = Continuation::default();
        let mut turn = |prompt: &[u32], ran: usize| {
            let mut fresh = LlamaDecoder::new(&config, &layout, &params).unwrap();
            let alone = generate(&mut fresh, &[prompt.to_vec()], &options).unwrap().remove(0);
            let mut told = Vec::new();
            let reply = continuation.generate_with(&mut decoder, prompt, &options, |t| {
                told.push(t);
                ControlFlow::Continue(())
            });
            let reply = reply.unwrap();
            assert_eq!(reply, alone, "{name}: after {prompt:?}");
            assert_eq!(told, reply, "{name}: each token told as it is chosen");
            assert_eq!(continuation.last_ran(), ran, "{name}: after {prompt:?}");
            assert_eq!(
                continuation.held(),
                prompt.len() + 3,
                "{name}: the last reply token is not run"
            );
            reply
        };
        let first = [3, 1, 4];
        let reply = turn(&first, 3);
        let second = [&first[..], &reply, &[7, 2]].concat();
        let reply = turn(&second, 3);
        let mut third = [&second[..], &reply].concat();
        *third.last_mut().unwrap() = (reply[3] + 1) % config.vocab_size as u32;
        third.push(9);
        turn(&third, 2);
        turn(&[5, 5], 2);
        turn(&[5], 1);
    }
}

/// A turn that `on_token` breaks (a reply the user stopped) ends with that token, its first
/// tokens those of the whole turn; the next turn, whose prompt holds the stopped reply, runs only
/// that reply's last token and the new ones, and generates what a fresh decoder does.
#[test]
fn a_stopped_turn_keeps_what_it_wrote_and_the_next_continues_from_it() {
    for (name, config) in models() {
        let (layout, params) = perturbed_params(&config, 10);
        let options = greedy(6);
        let fresh = || LlamaDecoder::new(&config, &layout, &params).unwrap();
        let alone = |prompt: &[u32]| generate(&mut fresh(), &[prompt.to_vec()], &options).unwrap();
        let first = [2, 7, 1];
        let whole = alone(&first).remove(0);
        let mut decoder = fresh();
        let mut continuation = Continuation::default();
        let mut told = 0;
        let stopped = continuation.generate_with(&mut decoder, &first, &options, |_| {
            told += 1;
            if told == 2 { ControlFlow::Break(()) } else { ControlFlow::Continue(()) }
        });
        assert_eq!(stopped.unwrap(), whole[..2], "{name}: the tokens before the stop");
        assert_eq!(continuation.held(), first.len() + 1, "{name}: its last token not run");
        let next = [&first[..], &whole[..2], &[5, 3]].concat();
        let reply = continuation.generate(&mut decoder, &next, &options).unwrap();
        assert_eq!(continuation.last_ran(), 3, "{name}: the stopped reply's last token and two");
        assert_eq!(reply, alone(&next)[0], "{name}: as from scratch");
    }
}

#[test]
fn the_stream_loss_is_the_token_weighted_mean_of_the_windows_training_losses() {
    let (_, config) = models().swap_remove(0);
    let (layout, params) = perturbed_params(&config, 9);
    let stream: Vec<u32> = (0..15).map(|i| (i * 7 % 11) as u32).collect();
    let loss_of = |inputs: &[u32], targets: &[u32]| {
        let mut model =
            HostLlama::<f64>::new(&config, &layout, 1, inputs.len(), AttentionKind::Gemm).unwrap();
        model.forward(&params, inputs, targets).unwrap()
    };
    // Windows of 6 inputs: [0, 6), [6, 12), [12, 14).
    let result =
        zeroflow_llama::eval_stream(&config, &layout, &params, EvalStream::of(&stream), 6).unwrap();
    let expected = (6.0 * loss_of(&stream[0..6], &stream[1..7])
        + 6.0 * loss_of(&stream[6..12], &stream[7..13])
        + 2.0 * loss_of(&stream[12..14], &stream[13..15]))
        / 14.0;
    assert_eq!(result.tokens, 14);
    assert!((result.loss - expected).abs() < 1e-12, "{} against {expected}", result.loss);
    // Packed, documents starting at 0, 4 and 9: each document's part of a window is a sequence
    // of its own (rotary positions from 0, no attention across).
    let positions = [0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1, 2, 0, 1];
    let packed = EvalStream { positions: Some(&positions), ..EvalStream::of(&stream) };
    let result = zeroflow_llama::eval_stream(&config, &layout, &params, packed, 6).unwrap();
    let segments = [0..4, 4..6, 6..9, 9..12, 12..14];
    let expected = segments
        .into_iter()
        .map(|s| s.len() as f64 * loss_of(&stream[s.clone()], &stream[s.start + 1..s.end + 1]))
        .sum::<f64>()
        / 14.0;
    assert_eq!(result.tokens, 14);
    assert!((result.loss - expected).abs() < 1e-12, "packed {} against {expected}", result.loss);
}
