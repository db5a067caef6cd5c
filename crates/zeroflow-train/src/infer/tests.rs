use std::path::{Path, PathBuf};

use zeroflow_hf::{SaveDtype, SaveOptions};
use zeroflow_llama::LlamaDecoder;

use super::*;
use crate::export::tests::tiny_llama;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeroflow-infer-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `tiny_llama` with random weights written as a Hugging Face directory `dir` (f32), its
/// `config.json`'s `eos_token_id` set to `eos`; the weights.
fn write_llama(dir: &Path, eos: Option<u32>) -> (FlatLayout, Vec<f32>) {
    let config = tiny_llama();
    let layout = zeroflow_llama::flat_layout(&config, 1).unwrap();
    let mut params = vec![0.0f32; layout.padded_len()];
    zeroflow_llama::init_params(&config, &layout, 7, &mut params).unwrap();
    let options = SaveOptions { dtype: SaveDtype::F32, ..SaveOptions::default() };
    zeroflow_llama::save_hf_dir(dir, &config, &layout, &params, &options).unwrap();
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["eos_token_id"] = eos.into();
    std::fs::write(&path, json.to_string()).unwrap();
    (layout, params)
}

const GREEDY: Completion =
    Completion { max_new_tokens: 6, sampling: Sampling::GREEDY, seed: 0, stop: false };

/// A Llama directory opens as the Llama family with its weights: greedy completion equals the
/// family's decoder run directly on the weights that were written.
#[test]
fn a_llama_directory_completes_as_its_decoder_generates() {
    let dir = scratch("llama");
    let (layout, params) = write_llama(&dir, None);
    let model = HostModel::open(&dir).unwrap();
    assert_eq!((model.family(), model.vocab_size(), model.context()), ("llama", 50, 32));
    let prompt = [3, 1, 4, 1, 5];
    let options = GenerateOptions {
        max_new_tokens: 6,
        sampling: Sampling::GREEDY,
        seed: 0,
        stop_tokens: Vec::new(),
    };
    let config = tiny_llama();
    let mut decoder = LlamaDecoder::new(&config, &layout, &params).unwrap();
    let direct = generate(&mut decoder, &[prompt.to_vec()], &options).unwrap();
    let completed = model.complete(&prompt, &GREEDY).unwrap();
    assert_eq!(completed.len(), 6);
    assert_eq!(completed, direct[0]);
    std::fs::remove_dir_all(dir).unwrap();
}

/// With `stop`, the completion ends at the model's end-of-text token (kept; `config.json`'s,
/// or `generation_config.json`'s); without, it runs to `max_new_tokens`.
#[test]
fn a_completion_stops_at_the_end_of_text_token_unless_told_not_to() {
    let probe = scratch("llama-probe");
    write_llama(&probe, None);
    let prompt = [2, 7, 1];
    let free = HostModel::open(&probe).unwrap().complete(&prompt, &GREEDY).unwrap();
    // The greedy tokens do not depend on eos_token_id: make the second one the end of text.
    let eos = free[1];
    let dir = scratch("llama-eos");
    write_llama(&dir, Some(eos));
    let model = HostModel::open(&dir).unwrap();
    assert_eq!(model.end_of_text(), [eos]);
    let stopped = model.complete(&prompt, &Completion { stop: true, ..GREEDY }).unwrap();
    let first_eos = free.iter().position(|&t| t == eos).unwrap();
    assert_eq!(stopped, free[..=first_eos]);
    assert_eq!(model.complete(&prompt, &GREEDY).unwrap(), free);
    // generation_config.json's end-of-text ids stop it too (as transformers' generate): the
    // third token added there ends the completion where config.json's is not produced.
    let unused = (0..50).find(|t| !free.contains(t)).unwrap();
    let generated = scratch("llama-generation-config");
    write_llama(&generated, Some(unused));
    let generation = serde_json::json!({"eos_token_id": [unused, free[2]], "temperature": 0.6});
    std::fs::write(generated.join("generation_config.json"), generation.to_string()).unwrap();
    let model = HostModel::open(&generated).unwrap();
    assert_eq!(model.end_of_text(), [unused, free[2]]);
    let stopped = model.complete(&prompt, &Completion { stop: true, ..GREEDY }).unwrap();
    let first = free.iter().position(|&t| t == free[2]).unwrap();
    assert_eq!(stopped, free[..=first]);
    for dir in [probe, dir, generated] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// A token added with `also_stop_at` (a chat template's end of a turn) ends a completion as
/// `config.json`'s end of text does, once, and only where `stop` asks.
#[test]
fn a_completion_also_stops_at_a_token_added_to_the_model() {
    let dir = scratch("llama-also-stop");
    write_llama(&dir, None);
    let prompt = [2, 7, 1];
    let mut model = HostModel::open(&dir).unwrap();
    let free = model.complete(&prompt, &GREEDY).unwrap();
    let turn_end = free[2];
    model.also_stop_at(turn_end);
    model.also_stop_at(turn_end);
    assert_eq!(model.end_of_text(), [turn_end]);
    let stopped = model.complete(&prompt, &Completion { stop: true, ..GREEDY }).unwrap();
    let first = free.iter().position(|&t| t == turn_end).unwrap();
    assert_eq!(stopped, free[..=first]);
    assert_eq!(model.complete(&prompt, &GREEDY).unwrap(), free);
    std::fs::remove_dir_all(dir).unwrap();
}

/// Two shards are two streams: the loss is their losses weighted by their predicted tokens,
/// each the model's `eval` of that stream.
#[test]
fn the_loss_over_shards_weights_each_shard_by_its_tokens() {
    let dir = scratch("llama-eval");
    write_llama(&dir.join("model"), None);
    let model = HostModel::open(&dir.join("model")).unwrap();
    let (a, b): (Vec<u16>, Vec<u16>) = ((0..40).map(|i| i % 50).collect(), vec![9, 8, 7, 6]);
    zeroflow_data::write_shard(&dir.join("a.bin"), &a).unwrap();
    zeroflow_data::write_shard(&dir.join("b.bin"), &b).unwrap();
    let spec = Spec::parse(&format!("{}/*.bin", dir.display())).unwrap();
    let result = model.eval_data(&spec, Some(8)).unwrap();
    let stream = |s: &[u16]| s.iter().map(|&t| u32::from(t)).collect::<Vec<u32>>();
    let eval = |tokens: &[u32]| model.eval(EvalStream::of(tokens), 8).unwrap();
    let (ea, eb) = (eval(&stream(&a)), eval(&stream(&b)));
    assert_eq!((ea.tokens, eb.tokens, result.tokens), (39, 3, 42));
    let weighted = (ea.loss * 39.0 + eb.loss * 3.0) / 42.0;
    assert!((result.loss - weighted).abs() < 1e-12, "{} vs {weighted}", result.loss);
    // The default window is the context (32, shorter than 2,048): one window of 32 and one of
    // 7 in shard a.
    let by_context = model.eval_data(&spec, None).unwrap();
    assert_eq!(by_context.tokens, 42);
    let refused = |window| model.eval_data(&spec, Some(window)).unwrap_err().to_string();
    assert!(refused(33).contains("--window 33"), "{}", refused(33));
    assert!(refused(0).contains("--window 0"), "{}", refused(0));
    let synthetic = model.eval_data(&Spec::Synthetic, None).unwrap_err().to_string();
    assert!(synthetic.contains("--data synthetic"), "{synthetic}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A long context is not the default window: a Llama of 131,072 positions (Llama 3.1's) reads
/// in windows of 2,048, as `train` would train it, and a window whose activations the CPU cannot
/// hold is an input error naming --window before anything is allocated (the default window of
/// the long context was an allocation of 375 GB that aborted the process).
#[test]
fn a_long_context_reads_in_the_training_windows_and_the_cpu_refuses_what_it_cannot_hold() {
    let dir = scratch("long-context");
    write_llama(&dir, None);
    let path = dir.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["max_position_embeddings"] = 131_072.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let model = HostModel::open(&dir).unwrap();
    assert_eq!((model.context(), model.default_window()), (131_072, 2048));
    assert_eq!(HostModel::named("tiny", 0).unwrap().default_window(), 64, "GPT-2: its context");
    let gib = 1u64 << 30;
    assert!(model.check_cpu_window(2048, 2048, Some(gib)).is_ok());
    let error = model.check_cpu_window(131_072, 131_072, Some(gib)).unwrap_err();
    assert!(error.is_input(), "{error}");
    let said = error.to_string();
    assert!(said.starts_with("--window 131072: a window's"), "{said}");
    assert!(said.contains("the default is 2048"), "{said}");
    let shorter = model.check_cpu_window(131_072, 100_000, Some(gib)).unwrap_err().to_string();
    let of_100000 = "--window 131072: the activations of a window of 100000 inputs (the data's \
                     longest) on the CPU need";
    assert!(shorter.starts_with(of_100000), "{shorter}");
    assert!(model.check_cpu_window(131_072, 131_072, None).is_ok(), "no figure, no refusal");
    // Data shorter than the window is read in one window of its length: 1,000 tokens fit.
    let stream: Vec<u16> = (0..1000).map(|i| (i % 50) as u16).collect();
    zeroflow_data::write_shard(&dir.join("short.bin"), &stream).unwrap();
    let spec = Spec::parse(&dir.join("short.bin").display().to_string()).unwrap();
    assert_eq!(model.eval_data(&spec, Some(131_072)).unwrap().tokens, 999);
    std::fs::remove_dir_all(dir).unwrap();
}

/// What a model cannot continue or draw from is an input error saying which value is wrong.
#[test]
fn bad_prompts_and_samplings_are_input_errors_naming_the_value() {
    let model = HostModel::named("tiny", 0).unwrap();
    let error = |prompt: &[u32], sampling: Sampling| {
        let completion = Completion { sampling, ..GREEDY };
        let error = model.complete(prompt, &completion).unwrap_err();
        assert!(error.is_input(), "{error}");
        error.to_string()
    };
    let greedy = Sampling::GREEDY;
    assert!(error(&[], greedy).contains("no tokens"));
    assert!(error(&[1, 64], greedy).contains("token 64 is outside the vocabulary (64)"));
    assert!(error(&[1], Sampling { temperature: -1.0, ..greedy }).contains("--temperature -1"));
    assert!(error(&[1], Sampling { temperature: f64::NAN, ..greedy }).contains("--temperature"));
    assert!(error(&[1], Sampling { top_k: Some(0), ..greedy }).contains("--top-k 0"));
    assert!(error(&[1], Sampling { top_p: Some(1.5), ..greedy }).contains("--top-p 1.5"));
    assert!(error(&[1], Sampling { top_p: Some(0.0), ..greedy }).contains("--top-p 0"));
    let sampled = Sampling { temperature: 0.8, top_k: Some(10), top_p: Some(0.9) };
    let once = Completion { sampling: sampled, seed: 3, ..GREEDY };
    let first = model.complete(&[1, 2], &once).unwrap();
    assert_eq!(model.complete(&[1, 2], &once).unwrap(), first, "a seed repeats its draw");
    assert!(first.iter().all(|&t| t < 64));
}

#[test]
fn token_ids_are_read_from_a_comma_separated_list() {
    assert_eq!(parse_ids("1,2, 3"), Ok(vec![1, 2, 3]));
    assert_eq!(parse_ids("50256"), Ok(vec![50256]));
    for bad in ["", "1,,2", "a", "-1", "1.5", "4294967296"] {
        let reason = parse_ids(bad).unwrap_err();
        assert!(reason.contains(&format!("{bad:?}")), "{reason}");
    }
}

/// `tiny_llama` with the weights `params` saved as checkpoint `step` of the run directory `run`
/// (as `zeroflow train` writes one: HF names in `model.safetensors`, the family-tagged shape in
/// `state.json`), its `--init-from` the directory `init_from`; the checkpoint's directory.
fn save_llama_checkpoint(run: &Path, step: u64, params: &[f32], init_from: &Path) -> PathBuf {
    let spec = crate::ModelSpec::Llama(crate::llama::LlamaSpec(tiny_llama()));
    crate::export::tests::save_checkpoint(run, step, &spec, params, None, Some(init_from))
}

/// A checkpoint opens as the model it holds: the checkpoint directory, and the run directory
/// (its newest checkpoint), complete as the family's decoder on the saved weights does, with
/// the end-of-text tokens of the run's `--init-from` directory.
#[test]
fn a_checkpoint_or_its_run_directory_opens_as_the_weights_it_holds() {
    let root = scratch("llama-checkpoint");
    let (layout, params) = write_llama(&root.join("init"), Some(11));
    let older: Vec<f32> = params.iter().map(|x| -x).collect();
    save_llama_checkpoint(&root.join("run"), 2, &older, &root.join("init"));
    let newest = save_llama_checkpoint(&root.join("run"), 3, &params, &root.join("init"));
    assert_eq!(ModelDir::find(&newest).unwrap(), ModelDir::Checkpoint(newest.clone()));
    assert_eq!(ModelDir::find(&root.join("run")).unwrap(), ModelDir::Checkpoint(newest.clone()));
    assert_eq!(
        ModelDir::find(&root.join("init")).unwrap(),
        ModelDir::HuggingFace(root.join("init"))
    );
    let options = GenerateOptions {
        max_new_tokens: 6,
        sampling: Sampling::GREEDY,
        seed: 0,
        stop_tokens: Vec::new(),
    };
    let prompt = [4, 9, 2];
    let mut decoder = LlamaDecoder::new(&tiny_llama(), &layout, &params).unwrap();
    let direct = generate(&mut decoder, &[prompt.to_vec()], &options).unwrap();
    for dir in [newest, root.join("run")] {
        let model = HostModel::open(&dir).unwrap();
        assert_eq!((model.family(), model.vocab_size()), ("llama", 50));
        assert_eq!(model.end_of_text(), [11], "the --init-from directory's eos_token_id");
        assert_eq!(model.complete(&prompt, &GREEDY).unwrap(), direct[0], "{}", dir.display());
    }
    let missing = HostModel::open(&root.join("nothing")).unwrap_err().to_string();
    assert!(missing.contains("config.json"), "{missing}");
    std::fs::remove_dir_all(root).unwrap();
}

/// Generating a batch of prompts of different lengths greedily gives each prompt the tokens it
/// gets alone, in both families, with and without stopping at an end-of-text token.
#[test]
fn a_batch_of_prompts_generates_as_each_prompt_alone() {
    let dir = scratch("llama-batch");
    write_llama(&dir, None);
    let prompts = vec![vec![7], vec![3, 1, 4, 1, 5], vec![2, 7, 1], vec![40, 41]];
    for mut model in [HostModel::open(&dir).unwrap(), HostModel::named("tiny", 3).unwrap()] {
        let alone: Vec<Vec<u32>> =
            prompts.iter().map(|p| model.complete(p, &GREEDY).unwrap()).collect();
        assert!(alone.iter().all(|tokens| tokens.len() == 6));
        assert_eq!(model.complete_batch(&prompts, &GREEDY).unwrap(), alone, "{model:?}");
        // A stop token that ends one sequence early: the others go on as before.
        let eos = alone[1][2];
        model.end_of_text = vec![eos];
        let stop = Completion { stop: true, ..GREEDY };
        let batch = model.complete_batch(&prompts, &stop).unwrap();
        let one_by_one: Vec<Vec<u32>> =
            prompts.iter().map(|p| model.complete(p, &stop).unwrap()).collect();
        assert_eq!(batch, one_by_one);
        let first_eos = alone[1].iter().position(|&t| t == eos).unwrap();
        assert_eq!(batch[1], alone[1][..=first_eos], "sequence 1 ends at its stop token");
    }
    let error = HostModel::named("tiny", 0).unwrap().complete_batch(&[vec![1], vec![]], &GREEDY);
    assert!(error.unwrap_err().to_string().contains("prompt 2 has no tokens"));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A session's turns, each prompt the last one with its reply and a new message (as
/// `generate --chat` renders a conversation), complete as each prompt alone does, in both
/// families, greedy and sampled, and run only the tokens the session's cache does not hold; the
/// second turn is stopped after two tokens (a reply stopped by Ctrl-C), which the next continues.
#[test]
fn a_session_continues_its_cache_and_completes_as_each_prompt_alone() {
    let dir = scratch("llama-session");
    write_llama(&dir, None);
    for model in [HostModel::open(&dir).unwrap(), HostModel::named("tiny", 3).unwrap()] {
        let mut session = model.session(InferDevice::Cpu).unwrap();
        let sampled = Completion {
            sampling: Sampling { temperature: 0.9, top_k: Some(10), top_p: None },
            seed: 5,
            ..GREEDY
        };
        let mut prompt = vec![3, 1, 4, 1, 5];
        for (turn, completion) in [GREEDY, sampled, GREEDY].iter().enumerate() {
            let mut told = Vec::new();
            let stop_after = if turn == 1 { 2 } else { usize::MAX };
            let reply = session
                .complete_with(&prompt, completion, |t| {
                    told.push(t);
                    if told.len() == stop_after {
                        std::ops::ControlFlow::Break(())
                    } else {
                        std::ops::ControlFlow::Continue(())
                    }
                })
                .unwrap();
            let alone = model.complete(&prompt, completion).unwrap();
            assert_eq!(reply, alone[..alone.len().min(stop_after)], "{model:?}: {turn}");
            assert_eq!(told, reply, "{model:?}: turn {turn}'s tokens told as they come");
            // The first turn runs the whole prompt; a later one the last reply's last token
            // (sampled, never run) and the new message.
            let ran = if turn == 0 { prompt.len() } else { 3 };
            assert_eq!(session.last_ran(), ran, "{model:?}: turn {turn}");
            prompt.extend(reply);
            prompt.extend([2, 7]);
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn devices_are_cpu_cuda_or_a_numbered_gpu() {
    assert_eq!("cpu".parse(), Ok(InferDevice::Cpu));
    assert_eq!("cuda".parse(), Ok(InferDevice::Cuda(0)));
    assert_eq!("cuda:3".parse(), Ok(InferDevice::Cuda(3)));
    for bad in ["gpu", "cuda:", "cuda:x", "CPU"] {
        let error = bad.parse::<InferDevice>().unwrap_err();
        assert!(error.contains(&format!("{bad:?}")), "{error}");
    }
}

/// Opened for a GPU, a model leaves its parameters in their files, read as bf16 a range at a
/// time as they are uploaded: the f32 ones rounded (what the GPU ran before, uploaded from an f32
/// copy), from a Hugging Face directory (sharded or not, Llama and GPT-2) and from a checkpoint,
/// in pieces of any size (7 elements here: pieces that cut tensors and the padding). The CPU's
/// decoder reads them whole and completes as the rounded f32 weights do; opened for the CPU, the
/// same directory holds f32.
#[test]
fn a_model_opened_for_a_gpu_reads_its_weights_from_their_files_in_bf16_rounded() {
    let dir = scratch("bf16-held");
    let (layout, params) = write_llama(&dir, None);
    let rounded: Vec<f32> = params.iter().map(|&p| bf16::from_f32(p).to_f32()).collect();
    let spec = crate::ModelSpec::Llama(crate::llama::LlamaSpec(tiny_llama()));
    let checkpoint =
        crate::export::tests::save_checkpoint(&dir.join("run"), 2, &spec, &params, None, None);
    let sharded = dir.join("sharded");
    let options =
        SaveOptions { dtype: SaveDtype::F32, max_shard_bytes: 4000, ..Default::default() };
    let saved =
        zeroflow_llama::save_hf_dir(&sharded, &tiny_llama(), &layout, &params, &options).unwrap();
    assert!(saved.weight_files.len() > 2, "{saved:?}");
    let want: Vec<u32> = rounded.iter().map(|p| p.to_bits()).collect();
    let from_rounded = HostModel::from_params(&spec, rounded).unwrap();
    let prompt = [3, 1, 4, 1, 5];
    let expected = from_rounded.complete(&prompt, &GREEDY).unwrap();
    for source in [&dir, &sharded, &checkpoint] {
        let model = HostModel::open_for(source, InferDevice::Cuda(0)).unwrap();
        assert_eq!(read_in_pieces(&model, 7), want, "{}", source.display());
        assert_eq!(model.complete(&prompt, &GREEDY).unwrap(), expected, "{}", source.display());
    }
    let on_cpu = HostModel::open_for(&dir, InferDevice::Cpu).unwrap();
    assert!(
        matches!(&on_cpu.weights, Weights::Llama { params: Params::F32(p), .. } if *p == params)
    );

    // GPT-2: a checkpoint exported as a Hugging Face directory (GPT2LMHeadModel's names).
    let gpt = crate::ModelSpec::Gpt2(zeroflow_gpt::GptConfig {
        vocab_size: 61,
        ..zeroflow_gpt::GptConfig::TINY
    });
    let gpt_layout = gpt.flat_layout(1).unwrap();
    let mut gpt_params = vec![0.0f32; gpt_layout.padded_len()];
    init_weights(&gpt, &gpt_layout, &mut gpt_params);
    let gpt_checkpoint = crate::export::tests::save_checkpoint(
        &dir.join("gpt-run"),
        1,
        &gpt,
        &gpt_params,
        None,
        None,
    );
    crate::export::export(&gpt_checkpoint, &dir.join("gpt-hf")).unwrap();
    let model = HostModel::open_for(&dir.join("gpt-hf"), InferDevice::Cuda(0)).unwrap();
    let tensors = gpt.tensors(&gpt_layout).unwrap();
    let held = read_in_pieces(&model, 7);
    for tensor in &tensors {
        let want: Vec<u32> = gpt_params[tensor.flat.clone()]
            .iter()
            .map(|&p| bf16::from_f32(p).to_f32().to_bits())
            .collect();
        assert_eq!(held[tensor.flat.clone()], want[..], "{}", tensor.name);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// Fresh weights of `spec` from seed 5 into `params`.
fn init_weights(spec: &crate::ModelSpec, layout: &FlatLayout, params: &mut [f32]) {
    crate::with_family!(spec, family => crate::Family::init(family, layout, 5, params)).unwrap();
}

/// The parameters of a model opened for a GPU, as the bits of their f32 widening: read from
/// their files `piece` elements at a time in bf16 (or as held), as an upload reads them.
fn read_in_pieces(model: &HostModel, piece: usize) -> Vec<u32> {
    let params = match &model.weights {
        Weights::Gpt { params, .. } | Weights::Llama { params, .. } => params,
    };
    let Params::Files(files) = params else {
        panic!("opened for a GPU, but not left in its files")
    };
    let mut held = vec![bf16::ZERO; files.len()];
    for (i, out) in held.chunks_mut(piece).enumerate() {
        files.read(i * piece..i * piece + out.len(), out).unwrap();
    }
    held.iter().map(|p| p.to_f32().to_bits()).collect()
}
