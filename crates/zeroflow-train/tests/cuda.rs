//! Generation and evaluation on a GPU (`--device cuda`: bf16, the families' key/value-cached
//! `CudaGptDecoder` and `CudaLlamaDecoder`; eval through the CUDA training forward) against the
//! CPU's key/value-cached decoder (f32) on the same weights,
//! rounded to bf16 first so that only the GPU's bf16 activations differ: small random models of
//! both families at odd shapes (GPT-2 with a padded vocabulary and heads of 12; a Llama with
//! grouped-query attention, an untied head and heads of 8); and each cached GPU decoder against
//! recomputing the whole prefix on the GPU (`CudaPrefixDecoder`), step by step.
//!
//! Where there is no CUDA driver or no GPU each test prints `skipped: no CUDA device (<reason>)`
//! and passes; with `ZEROFLOW_REQUIRE_GPU=1` a missing GPU fails instead. Run with
//! `--test-threads=1 --nocapture` (the tests print the first divergence and the logit gaps).

use rand::{Rng, SeedableRng};
use zeroflow_core::bf16;
use zeroflow_gpt::GptConfig;
use zeroflow_llama::LlamaConfig;
use zeroflow_nn::infer::Decoder;
use zeroflow_train::infer::{EvalStream, GenerateOptions, HostModel, InferDevice, Sampling};
use zeroflow_train::llama::LlamaSpec;
use zeroflow_train::{Family, ModelSpec, with_family};

const NEW_TOKENS: usize = 32;
/// The largest relative difference (‖gpu − cpu‖ / ‖cpu‖) of the prompts' next-token logits.
const LOGITS_TOLERANCE: f64 = 2e-2;

fn gpu() -> bool {
    zeroflow_device::cuda::info::gpu_or_skip(0).is_some()
}

fn gpt_odd() -> ModelSpec {
    ModelSpec::Gpt2(GptConfig { n_layer: 3, n_head: 3, d_model: 36, vocab_size: 97, context: 64 })
}

fn llama_gqa_untied() -> ModelSpec {
    let base = zeroflow_llama::named_shape("llama-1b").expect("a named shape");
    ModelSpec::Llama(LlamaSpec(LlamaConfig {
        vocab_size: 101,
        hidden_size: 48,
        intermediate_size: 72,
        num_hidden_layers: 2,
        num_attention_heads: 6,
        num_key_value_heads: 2,
        head_dim: 8,
        max_position_embeddings: 64,
        rope_scaling: None,
        tie_word_embeddings: false,
        ..base
    }))
}

/// The family's initialisation moved by up to ±`spread` per element (so that greedy choices are
/// not near-ties, as in scripts/generate-oracle.py), rounded to bf16.
fn wide_random(spec: &ModelSpec, spread: f32, seed: u64) -> HostModel {
    let layout = spec.flat_layout(1).unwrap();
    let mut params = vec![0.0f32; layout.padded_len()];
    with_family!(spec, family => family.init(&layout, seed, &mut params)).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 1);
    for x in &mut params {
        *x = bf16::from_f32(*x + rng.random_range(-spread..spread)).to_f32();
    }
    HostModel::from_params(spec, params).unwrap()
}

fn relative_difference(gpu: &[f32], cpu: &[f32]) -> f64 {
    let norm = |v: &mut dyn Iterator<Item = f64>| v.map(|x| x * x).sum::<f64>().sqrt();
    let diff = norm(&mut gpu.iter().zip(cpu).map(|(&g, &c)| f64::from(g - c)));
    diff / norm(&mut cpu.iter().map(|&c| f64::from(c)))
}

/// The gap between the two largest of `logits`.
fn top2_gap(logits: &[f32]) -> f32 {
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    sorted[0] - sorted[1]
}

/// Greedy tokens on the GPU against the CPU for three prompts as one batch: the first
/// The first divergence (if any) is reported with the CPU's top-2 gap there, which must be within
/// what bf16 explains (a tenth of the largest logit's magnitude bounds it loosely; an exact match
/// is what is expected of well-separated logits). Where it comes does not matter: a near-tie at
/// the third token is as much bf16's as one at the thirtieth.
fn check_generation(name: &str, model: &HostModel) {
    let prompts = vec![vec![5, 17, 2, 9, 33], vec![1], vec![40, 3, 3, 8, 61, 12, 7, 0, 2]];
    let logits_cpu = model.next_logits(&prompts, InferDevice::Cpu).unwrap();
    let logits_gpu = model.next_logits(&prompts, InferDevice::Cuda(0)).unwrap();
    let difference = relative_difference(&logits_gpu, &logits_cpu);
    println!("{name}: next-token logits of the prompts differ by {difference:.2e} (relative)");
    assert!(difference < LOGITS_TOLERANCE, "{name}: logits {difference}");
    let options = GenerateOptions {
        max_new_tokens: NEW_TOKENS,
        sampling: Sampling::GREEDY,
        seed: 0,
        stop_tokens: Vec::new(),
    };
    let cpu = model.generate_on(&prompts, &options, InferDevice::Cpu).unwrap();
    let gpu = model.generate_on(&prompts, &options, InferDevice::Cuda(0)).unwrap();
    for (b, (cpu, gpu)) in cpu.iter().zip(&gpu).enumerate() {
        assert_eq!((cpu.len(), gpu.len()), (NEW_TOKENS, NEW_TOKENS));
        let Some(at) = cpu.iter().zip(gpu).position(|(c, g)| c != g) else {
            println!("{name}: prompt {b}: the same {NEW_TOKENS} greedy tokens");
            continue;
        };
        let prefix = [prompts[b].clone(), cpu[..at].to_vec()].concat();
        let there = model.next_logits(&[prefix], InferDevice::Cpu).unwrap();
        let (gap, largest) = (top2_gap(&there), there.iter().fold(0.0f32, |m, x| m.max(x.abs())));
        println!(
            "{name}: prompt {b}: first divergence at new token {at} (cpu {}, gpu {}); the CPU's \
             top-2 logit gap there {gap:.4} of logits up to {largest:.2}",
            cpu[at], gpu[at]
        );
        assert!(gap <= 0.1 * largest, "{name}: prompt {b}: a gap of {gap} is not bf16 rounding");
    }
}

#[test]
fn cuda_generation_follows_the_cpu_decoder_on_gpt2_at_an_odd_shape() {
    if !gpu() {
        return;
    }
    check_generation("gpt2-odd", &wide_random(&gpt_odd(), 0.5, 3));
}

#[test]
fn cuda_generation_follows_the_cpu_decoder_on_an_untied_grouped_query_llama() {
    if !gpu() {
        return;
    }
    check_generation("llama-gqa-untied", &wide_random(&llama_gqa_untied(), 0.25, 4));
}

/// The GPU's windowed loss (the CUDA training forward, a model per window length) equals the
/// CPU's within bf16 rounding, with a shorter last window, with a loss mask, and packed.
#[test]
fn cuda_eval_matches_the_cpu_loss_in_both_families() {
    if !gpu() {
        return;
    }
    for (name, spec, spread) in [("gpt2", gpt_odd(), 0.5), ("llama", llama_gqa_untied(), 0.25)] {
        let model = wide_random(&spec, spread, 9);
        let stream: Vec<u32> = (0..150u32).map(|i| (i * 37 + 11) % 97).collect();
        let cpu = model.eval(EvalStream::of(&stream), 64).unwrap();
        let gpu = model.eval_cuda(EvalStream::of(&stream), 64, 0).unwrap();
        let difference = (gpu.loss - cpu.loss).abs() / cpu.loss;
        println!("{name}: loss cpu {:.6} gpu {:.6} ({difference:.2e})", cpu.loss, gpu.loss);
        assert_eq!((gpu.tokens, cpu.tokens), (149, 149));
        assert!(difference < 1e-2, "{name}: {difference}");
        // With a loss mask (a chat's): the targets it leaves out are not counted on either, and
        // the masked loss differs from the whole stream's.
        let mask: Vec<u8> = (0..150).map(|i| u8::from(i % 5 >= 2)).collect();
        let counted = mask[1..].iter().filter(|&&m| m == 1).count();
        let masked = EvalStream::of(&stream).masked(Some(&mask));
        let cpu_masked = model.eval(masked, 64).unwrap();
        let gpu_masked = model.eval_cuda(masked, 64, 0).unwrap();
        let masked_difference = (gpu_masked.loss - cpu_masked.loss).abs() / cpu_masked.loss;
        println!("{name} masked: cpu {:.6} gpu {:.6}", cpu_masked.loss, gpu_masked.loss);
        assert_eq!((gpu_masked.tokens, cpu_masked.tokens), (counted, counted));
        assert!(masked_difference < 1e-2, "{name} masked: {masked_difference}");
        assert_ne!(cpu_masked.loss, cpu.loss, "{name}");
        // Packed (documents of 1 to 40 tokens, positions from 0 at each and at every window's
        // start): no attention across documents on either, and another loss than unpacked.
        let mut positions = Vec::new();
        let mut position = 0;
        for i in 0..150u32 {
            position = if i % 64 == 0 || (i * 7) % 41 == 0 { 0 } else { position + 1 };
            positions.push(position);
        }
        let packed = EvalStream { positions: Some(&positions), ..EvalStream::of(&stream) };
        let (cpu_packed, gpu_packed) =
            (model.eval(packed, 64).unwrap(), model.eval_cuda(packed, 64, 0).unwrap());
        let packed_difference = (gpu_packed.loss - cpu_packed.loss).abs() / cpu_packed.loss;
        println!("{name} packed: cpu {:.6} gpu {:.6}", cpu_packed.loss, gpu_packed.loss);
        assert_eq!((gpu_packed.tokens, cpu_packed.tokens), (149, 149));
        assert!(packed_difference < 1e-2, "{name} packed: {packed_difference}");
        assert_ne!(cpu_packed.loss, cpu.loss, "{name}");
    }
}

/// The key/value-cached GPU decoder gives the logits of recomputing every sequence's whole
/// prefix on the GPU (`CudaPrefixDecoder`), within bf16 rounding, at the prefill and at each of
/// 12 decode steps fed the same tokens (one sequence left out of every third step).
fn check_cached_against_prefix(name: &str, model: &HostModel, vocab: usize) {
    let mut cached = model.cuda_decoder(0).unwrap();
    let mut prefix = model.cuda_prefix_decoder(0).unwrap();
    let prompts: [&[u32]; 3] = [&[5, 17, 2, 9, 33], &[1], &[40, 3, 3, 8, 61, 12, 7, 0, 2]];
    let compare = |what: &str, a: &[f32], b: &[f32]| {
        let difference = relative_difference(a, b);
        println!("{name} {what}: cached against prefix {difference:.2e}");
        assert!(difference < LOGITS_TOLERANCE, "{name} {what}: {difference}");
    };
    let (a, b) = (cached.prefill(&prompts, 32).unwrap(), prefix.prefill(&prompts, 32).unwrap());
    assert_eq!(a.len(), 3 * vocab);
    compare("prefill", &a, &b);
    for step in 0..12u32 {
        let next: Vec<(usize, u32)> = (0..3)
            .filter(|&seq| step % 3 != 2 || seq != 1)
            .map(|seq| (seq, (step * 7 + seq as u32 * 13) % 97))
            .collect();
        let (a, b) = (cached.decode(&next).unwrap(), prefix.decode(&next).unwrap());
        assert_eq!(a.len(), next.len() * vocab);
        compare(&format!("decode step {step}"), &a, &b);
    }
}

#[test]
fn the_cached_gpu_decoders_match_recomputing_the_prefix_on_the_gpu() {
    if !gpu() {
        return;
    }
    check_cached_against_prefix("gpt2-odd", &wide_random(&gpt_odd(), 0.5, 5), 97);
    check_cached_against_prefix(
        "llama-gqa-untied",
        &wide_random(&llama_gqa_untied(), 0.25, 6),
        101,
    );
}

/// A session's decoder, made once, gives on the GPU what a decoder made for each completion
/// gives (`generate --chat`'s conversation uploads the weights once): three completions one
/// after another, greedy and sampled, of prompts of other lengths.
#[test]
fn a_gpu_session_completes_as_a_decoder_made_each_time() {
    if !gpu() {
        return;
    }
    use zeroflow_train::infer::Completion;
    for (name, model) in [
        ("gpt2-odd", wide_random(&gpt_odd(), 0.5, 5)),
        ("llama-gqa-untied", wide_random(&llama_gqa_untied(), 0.25, 6)),
    ] {
        let mut session = model.session(InferDevice::Cuda(0)).unwrap();
        let prompts: [&[u32]; 3] = [&[5, 17, 2, 9, 33], &[1], &[40, 3, 3, 8, 61, 12, 7, 0, 2]];
        for (turn, prompt) in prompts.iter().enumerate() {
            let sampling = match turn {
                1 => Sampling { temperature: 0.8, top_k: Some(20), top_p: None },
                _ => Sampling::GREEDY,
            };
            let completion =
                Completion { max_new_tokens: 12, sampling, seed: turn as u64, stop: false };
            let each =
                model.complete_batch_on(&[prompt.to_vec()], &completion, InferDevice::Cuda(0));
            let said = session.complete(prompt, &completion).unwrap();
            assert_eq!(said, each.unwrap()[0], "{name}, completion {turn}");
            println!("{name} completion {turn}: {said:?}");
        }
    }
}

/// The largest relative difference of a conversation's turns' logits: bf16 activations through
/// decode steps on these wide random weights differ from the CPU's and from each other by up to
/// 2.0e-2 (measured on an H100); a cache copied or kept wrong gives other logits
/// altogether (a control, one earlier token changed, is printed beside).
const TURN_TOLERANCE: f64 = 5e-2;

/// A conversation's turns on the GPU's cached decoders (`Decoder::extend`): the logits of each
/// turn and of two decode steps after it are the whole sequence's, within bf16 rounding, as the
/// CPU's decoder (f32), a fresh GPU prefill and the prefix decoder's turns (`CudaPrefixDecoder`,
/// which recomputes the kept prefix) compute them. The turns: a first; one keeping
/// all the cache holds and passing its capacity (its keys and values copied into a larger
/// cache); one keeping less than it holds; one starting over, larger again.
#[test]
fn a_gpu_decoders_turns_keep_their_cache_and_follow_the_cpu() {
    if !gpu() {
        return;
    }
    for (name, model) in [
        ("gpt2-odd", wide_random(&gpt_odd(), 0.5, 7)),
        ("llama-gqa-untied", wide_random(&llama_gqa_untied(), 0.25, 8)),
    ] {
        let mut decoder = model.cuda_decoder(0).unwrap();
        let mut prefix = model.cuda_prefix_decoder(0).unwrap();
        let mut sequence: Vec<u32> = Vec::new();
        let compare =
            |what: &str, gpu: &[f32], reference: &[f32], sequence: &[u32], fresh: bool| {
                let difference = relative_difference(gpu, reference);
                println!("{name} {what}: against the prefix decoder {difference:.2e}");
                assert!(difference < TURN_TOLERANCE, "{name} {what}: {difference}");
                let cpu = model.next_logits(&[sequence.to_vec()], InferDevice::Cpu).unwrap();
                let difference = relative_difference(gpu, &cpu);
                println!("{name} {what}: against the CPU {difference:.2e}");
                assert!(difference < TURN_TOLERANCE, "{name} {what}: {difference}");
                if fresh {
                    let fresh =
                        model.next_logits(&[sequence.to_vec()], InferDevice::Cuda(0)).unwrap();
                    let difference = relative_difference(gpu, &fresh);
                    println!("{name} {what}: against a fresh GPU prefill {difference:.2e}");
                    assert!(difference < TURN_TOLERANCE, "{name} {what}: {difference}");
                }
            };
        let turns = [(0, 9, 12), (11, 6, 20), (7, 4, 20), (0, 5, 40)];
        for (turn, (keep, new, capacity)) in turns.into_iter().enumerate() {
            sequence.truncate(keep);
            let tokens: Vec<u32> = (0..new).map(|i| (i * 29 + turn as u32 * 11 + 3) % 97).collect();
            sequence.extend(&tokens);
            let logits = decoder.extend(keep, &tokens, capacity).unwrap();
            let reference = prefix.extend(keep, &tokens, capacity).unwrap();
            compare(&format!("turn {turn}"), &logits, &reference, &sequence, true);
            if keep > 2 {
                let mut other = sequence.clone();
                other[1] = (other[1] + 1) % 97;
                let control = model.next_logits(&[other], InferDevice::Cpu).unwrap();
                let difference = relative_difference(&logits, &control);
                println!("{name} turn {turn}: control, kept token 1 changed: {difference:.2e}");
            }
            for step in 0..2u32 {
                let token = (step * 41 + turn as u32 * 5 + 1) % 97;
                sequence.push(token);
                let logits = decoder.decode(&[(0, token)]).unwrap();
                let reference = prefix.decode(&[(0, token)]).unwrap();
                let what = format!("turn {turn}, decode step {step}");
                compare(&what, &logits, &reference, &sequence, false);
            }
        }
    }
}
