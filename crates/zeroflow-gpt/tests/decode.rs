//! The key/value-cached decoder against the training forward: at every step, each sequence's
//! logits equal those of the whole prefix recomputed by `HostGpt` (f64), with prompts of
//! different lengths in one batch and sequences that stop early; and `generate` on top of it.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_gpt::{GptConfig, GptDecoder, HostGpt};
use zeroflow_nn::infer::{Decoder, EvalStream, GenerateOptions, Sampling, generate};

use crate::support::{perturbed_params, relative_error};

/// Head width 3 over 3 heads, vocabulary 70 padded to 128, a context of 12.
const ODD: GptConfig = GptConfig { n_layer: 2, n_head: 3, d_model: 9, vocab_size: 70, context: 12 };

/// The logits of the last position of `prefix`, by the training forward over the whole prefix.
fn recomputed(config: &GptConfig, params: &[f64], prefix: &[u32]) -> Vec<f64> {
    let layout = zeroflow_gpt::flat_layout(config, 1).unwrap();
    let mut model = HostGpt::<f64>::new(config, &layout, 1, prefix.len()).unwrap();
    model.forward(params, prefix, prefix).unwrap();
    let logits = &model.activations()[model.acts().logits.clone()];
    let padded = config.padded_vocab_size();
    logits[(prefix.len() - 1) * padded..][..config.vocab_size].to_vec()
}

#[test]
fn cached_logits_equal_the_recomputed_prefix_at_every_step() {
    let (layout, params) = perturbed_params(&ODD, 5);
    let mut decoder = GptDecoder::new(&ODD, &layout, &params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut seqs: Vec<Vec<u32>> = [3usize, 1, 6]
        .iter()
        .map(|&len| (0..len).map(|_| rng.random_range(0..70)).collect())
        .collect();
    let views: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
    let vocab = ODD.vocab_size;
    let logits = decoder.prefill(&views, ODD.context).unwrap();
    for (b, seq) in seqs.iter().enumerate() {
        let error = relative_error(&logits[b * vocab..][..vocab], &recomputed(&ODD, &params, seq));
        assert!(error < 1e-12, "prefill, sequence {b}: relative error {error}");
    }
    // Sequence 2 stops after 3 steps; the others run to the context.
    for step in 0..ODD.context - 3 {
        let next: Vec<(usize, u32)> = (0..3)
            .filter(|&b| seqs[b].len() < ODD.context && (b != 2 || step < 3))
            .map(|b| (b, rng.random_range(0..70)))
            .collect();
        let logits = decoder.decode(&next).unwrap();
        for (row, &(b, token)) in next.iter().enumerate() {
            seqs[b].push(token);
            let expected = recomputed(&ODD, &params, &seqs[b]);
            let error = relative_error(&logits[row * vocab..][..vocab], &expected);
            assert!(error < 1e-12, "step {step}, sequence {b}: relative error {error}");
        }
    }
    assert_eq!(seqs[0].len(), ODD.context, "sequence 0 filled the context");
    assert!(decoder.decode(&[(0, 1)]).is_err(), "a step past the context is refused");
}

#[test]
fn greedy_generation_equals_argmax_of_the_recomputed_prefix() {
    let (layout, params) = perturbed_params(&ODD, 6);
    let mut decoder = GptDecoder::new(&ODD, &layout, &params).unwrap();
    let prompts = vec![vec![4, 8, 15], vec![16]];
    let options = GenerateOptions {
        max_new_tokens: 6,
        sampling: Sampling::GREEDY,
        seed: 0,
        stop_tokens: Vec::new(),
    };
    let generated = generate(&mut decoder, &prompts, &options).unwrap();
    for (prompt, new) in prompts.iter().zip(&generated) {
        assert_eq!(new.len(), 6);
        let mut prefix = prompt.clone();
        for &token in new {
            let logits = recomputed(&ODD, &params, &prefix);
            let argmax = (0..logits.len())
                .fold(0, |best, i| if logits[i] > logits[best] { i } else { best });
            assert_eq!(token as usize, argmax, "after {prefix:?}");
            prefix.push(token);
        }
    }
}

#[test]
fn seeded_sampling_is_reproducible_and_a_stop_token_ends_a_sequence() {
    let (layout, params) = perturbed_params(&ODD, 7);
    let params: Vec<f32> = params.iter().map(|&x| x as f32).collect();
    let mut decoder = GptDecoder::new(&ODD, &layout, &params).unwrap();
    let prompts = vec![vec![1, 2, 3], vec![5], vec![9, 9]];
    let sampling = Sampling { temperature: 1.5, top_k: Some(20), top_p: Some(0.95) };
    let options =
        GenerateOptions { max_new_tokens: 8, sampling, seed: 42, stop_tokens: Vec::new() };
    let first = generate(&mut decoder, &prompts, &options).unwrap();
    let again = generate(&mut decoder, &prompts, &options).unwrap();
    assert_eq!(first, again, "the same seed gives the same tokens");
    let alone = generate(&mut decoder, &prompts[..1], &options).unwrap();
    assert_eq!(alone[0], first[0], "a sequence's tokens do not depend on the rest of the batch");
    let other = GenerateOptions { seed: 43, ..options.clone() };
    assert_ne!(generate(&mut decoder, &prompts, &other).unwrap(), first, "another seed differs");
    // Stopping at the third token sequence 0 drew: it ends there, the stop token kept.
    let stop = first[0][2];
    let stopped = generate(
        &mut decoder,
        &prompts,
        &GenerateOptions { stop_tokens: vec![stop], ..options.clone() },
    )
    .unwrap();
    let end = first[0].iter().position(|&t| t == stop).unwrap();
    assert_eq!(stopped[0], first[0][..=end].to_vec());
}

/// A conversation's turns on one decoder ([`Decoder::extend`]), each keeping a prefix of what
/// the cache holds (all of it, less of it while growing it, none), with the whole sequence's
/// recomputed logits after each turn and after a decode step, positions counted on.
#[test]
fn extending_a_kept_prefix_gives_the_recomputed_logits() {
    let (layout, params) = perturbed_params(&ODD, 6);
    let mut decoder = GptDecoder::new(&ODD, &layout, &params).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut sequence: Vec<u32> = Vec::new();
    for (turn, (keep, new, capacity)) in
        [(0, 4, 6), (5, 2, 8), (3, 3, 12), (0, 2, 12)].into_iter().enumerate()
    {
        sequence.truncate(keep);
        let tokens: Vec<u32> = (0..new).map(|_| rng.random_range(0..70)).collect();
        sequence.extend(&tokens);
        let logits = decoder.extend(keep, &tokens, capacity).unwrap();
        let error = relative_error(&logits, &recomputed(&ODD, &params, &sequence));
        assert!(error < 1e-12, "turn {turn}: relative error {error}");
        let token = rng.random_range(0..70);
        sequence.push(token);
        let logits = decoder.decode(&[(0, token)]).unwrap();
        let error = relative_error(&logits, &recomputed(&ODD, &params, &sequence));
        assert!(error < 1e-12, "turn {turn}'s decode step: relative error {error}");
    }
    assert!(
        decoder.extend(3, &[1; 10], 40).unwrap_err().to_string().contains("capacity of 12"),
        "past the context"
    );
}

#[test]
fn the_stream_loss_is_the_token_weighted_mean_of_the_windows_training_losses() {
    let (layout, params) = perturbed_params(&ODD, 8);
    let stream: Vec<u32> = (0..21).map(|i| (i * 17 % 70) as u32).collect();
    let loss_of = |inputs: &[u32], targets: &[u32]| {
        let mut model = HostGpt::<f64>::new(&ODD, &layout, 1, inputs.len()).unwrap();
        model.forward(&params, inputs, targets).unwrap()
    };
    // Windows of 8 inputs: [0, 8), [8, 16), [16, 20).
    let result =
        zeroflow_gpt::eval_stream(&ODD, &layout, &params, EvalStream::of(&stream), 8).unwrap();
    let expected = (8.0 * loss_of(&stream[0..8], &stream[1..9])
        + 8.0 * loss_of(&stream[8..16], &stream[9..17])
        + 4.0 * loss_of(&stream[16..20], &stream[17..21]))
        / 20.0;
    assert_eq!(result.tokens, 20);
    assert!((result.loss - expected).abs() < 1e-12, "{} against {expected}", result.loss);
    assert!(
        zeroflow_gpt::eval_stream(&ODD, &layout, &params, EvalStream::of(&stream), 13).is_err(),
        "13 > context"
    );
    // Packed, documents starting at 0, 5 and 12: each document's part of a window is a sequence
    // of its own (positions from 0, no attention across).
    let positions = [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3];
    let packed = EvalStream { positions: Some(&positions), ..EvalStream::of(&stream) };
    let result = zeroflow_gpt::eval_stream(&ODD, &layout, &params, packed, 8).unwrap();
    let segments = [0..5, 5..8, 8..12, 12..16, 16..20];
    let expected = segments
        .into_iter()
        .map(|s| s.len() as f64 * loss_of(&stream[s.clone()], &stream[s.start + 1..s.end + 1]))
        .sum::<f64>()
        / 20.0;
    assert_eq!(result.tokens, 20);
    assert!((result.loss - expected).abs() < 1e-12, "packed {} against {expected}", result.loss);
}
