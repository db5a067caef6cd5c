//! The Llama family through the binary: `--init-from` a Hugging Face directory (written here, a
//! tiny random Llama with grouped-query attention and untied embeddings), training on the CPU,
//! `export` back to a directory `zeroflow_llama::HfLlama` reads, exact resume, and directories
//! zeroflow cannot read (exit 2, the file named).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use zeroflow_hf::{SaveDtype, SaveOptions};
use zeroflow_llama::{HfLlama, LlamaConfig, flat_layout, hf_params, init_params, save_hf_dir};

use super::{read_lines, scratch, text, train};

/// A constant learning rate after 2 warm-up steps (the schedule does not depend on `--steps`,
/// so a run cut short is the first part of a longer one).
const CONSTANT: &str = r#"{
  "train_micro_batch_size_per_gpu": 2,
  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
  "scheduler": {"type": "WarmupLR",
                "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 2}}
}"#;

/// Two layers of width 16, 4 query heads over 2 key/value heads, untied, over the synthetic
/// corpus' 64 symbols.
fn tiny_llama() -> LlamaConfig {
    LlamaConfig::from_hf_config(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32, "tie_word_embeddings": false,
        "rope_theta": 10000.0,
    }))
    .unwrap()
}

/// Writes `config`'s random weights (seed 5) as a Hugging Face directory `dir` in f32, in shards
/// of at most `max_shard_bytes`, with a tokenizer file; returns the flat weights.
fn write_hf_dir(dir: &Path, config: &LlamaConfig, max_shard_bytes: u64) -> Vec<f32> {
    let layout = flat_layout(config, 1).unwrap();
    let mut weights = vec![0.0f32; layout.padded_len()];
    init_params(config, &layout, 5, &mut weights).unwrap();
    let source = dir.with_extension("tokenizer");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("tokenizer.json"), r#"{"model": "test"}"#).unwrap();
    let options =
        SaveOptions { dtype: SaveDtype::F32, max_shard_bytes, tokenizer_from: Some(source) };
    save_hf_dir(dir, config, &layout, &weights, &options).unwrap();
    weights
}

/// Every parameter of `config` read from the Hugging Face directory `dir`, by name.
fn read_hf_dir(dir: &Path) -> (LlamaConfig, Vec<(String, Vec<f32>)>) {
    let hf = HfLlama::open(dir).unwrap();
    let layout = flat_layout(&hf.config, 1).unwrap();
    let mut flat = vec![0.0f32; layout.padded_len()];
    hf.read_params(&layout, &mut flat).unwrap();
    let by_name = hf_params(&hf.config)
        .into_iter()
        .map(|p| {
            let range = layout.param(&p.name).unwrap().flat_range();
            (p.name, flat[range].to_vec())
        })
        .collect();
    (hf.config, by_name)
}

/// The tensors of a checkpoint's `model.safetensors` (f32 on the CPU device), by name.
fn checkpoint_tensors(checkpoint: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(checkpoint.join("model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<f32>)> = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (name, values)
        })
        .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors
}

fn step_losses(run: &Path) -> Vec<(u64, f64)> {
    read_lines(&run.join("metrics.jsonl"))
        .iter()
        .filter_map(|l| Some((l["step"].as_u64()?, l.get("loss")?.as_f64()?)))
        .collect()
}

fn checkpoint(run: &Path, step: u64) -> PathBuf {
    run.join("checkpoints").join(format!("step-{step:08}"))
}

fn zeroflow(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_zeroflow"))
        .args(args)
        .env("ZEROFLOW_LOG", "warn")
        .output()
        .expect("run zeroflow")
}

/// `train --init-from` a Llama directory trains the family on the CPU (the loss falls), records
/// the family in the checkpoint, and `export` writes a directory of the same architecture, with
/// the tokenizer files of the source, whose weights are the checkpoint's exactly; `train
/// --export` writes the same directory at the end of the run, byte for byte.
#[test]
fn a_llama_directory_trains_on_the_cpu_and_exports_its_weights() {
    let dir = scratch("llama_init_export");
    let (source, run, at_end) = (dir.join("source"), dir.join("run"), dir.join("at-end"));
    let config = tiny_llama();
    write_hf_dir(&source, &config, u64::MAX);
    let file = dir.join("ds.json");
    std::fs::write(&file, CONSTANT).unwrap();
    let (file, source_arg, run_arg) =
        (file.to_str().unwrap(), source.to_str().unwrap(), run.to_str().unwrap());
    let args = ["--config", file, "--init-from", source_arg, "--steps", "12", "--out", run_arg];
    let more = ["--seq", "16", "--eval-every", "0", "--export", at_end.to_str().unwrap()];
    let trained = train(&[&args[..], &more].concat());
    assert!(trained.status.success(), "{}", text(&trained.stderr));
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["exported"].as_str(), at_end.to_str());
    let losses = step_losses(&run);
    assert_eq!(losses.len(), 12, "{losses:?}");
    let (first, last) = (losses[0].1, losses[11].1);
    assert!(last < first - 0.3, "the loss falls: {losses:?}");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(checkpoint(&run, 12).join("state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["extra"]["model"]["family"], "llama");
    assert_eq!(state["extra"]["model"]["num_key_value_heads"], 2);

    let exported = dir.join("exported");
    let export = zeroflow(&[
        "export",
        checkpoint(&run, 12).to_str().unwrap(),
        "--out",
        exported.to_str().unwrap(),
    ]);
    assert!(export.status.success(), "{}", text(&export.stderr));
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(exported.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(written["architectures"], serde_json::json!(["LlamaForCausalLM"]));
    let tokenizer = std::fs::read_to_string(exported.join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer, r#"{"model": "test"}"#, "the source's tokenizer file is copied");
    let (read_config, mut read) = read_hf_dir(&exported);
    assert_eq!(read_config, LlamaConfig { torch_dtype: Some("float32".into()), ..config });
    read.sort_by(|a, b| a.0.cmp(&b.0));
    let saved = checkpoint_tensors(&checkpoint(&run, 12));
    assert_eq!(read, saved, "the exported weights are the checkpoint's");
    let (_, initial) = read_hf_dir(&source);
    assert_ne!(
        initial.iter().find(|t| t.0 == "lm_head.weight"),
        saved.iter().find(|t| t.0 == "lm_head.weight")
    );
    let files = |dir: &Path| {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    };
    // The run directory exports its newest checkpoint.
    let of_run = dir.join("of-run");
    let export = zeroflow(&["export", run.to_str().unwrap(), "--out", of_run.to_str().unwrap()]);
    assert!(export.status.success(), "{}", text(&export.stderr));
    assert!(text(&export.stdout).contains("step-00000012"), "{}", text(&export.stdout));
    assert_eq!(files(&at_end), ["config.json", "model.safetensors", "tokenizer.json"]);
    for other in [&at_end, &of_run] {
        assert_eq!(files(other), files(&exported));
        for name in files(&exported) {
            let (a, b) = (std::fs::read(other.join(&name)), std::fs::read(exported.join(&name)));
            assert!(a.unwrap() == b.unwrap(), "{name}: {} holds other bytes", other.display());
        }
    }
}

/// A Llama run stopped at step 3 and resumed to step 6 takes the steps of a straight run to 6:
/// the same losses and the same final weights.
#[test]
fn a_llama_run_resumes_exactly() {
    let dir = scratch("llama_resume");
    let source = dir.join("source");
    write_hf_dir(&source, &tiny_llama(), u64::MAX);
    let file = dir.join("ds.json");
    std::fs::write(&file, CONSTANT).unwrap();
    let run_to = |out: &Path, steps: &str, resume: bool| {
        let (file, source) = (file.to_str().unwrap(), source.to_str().unwrap());
        let start: &[&str] =
            if resume { &["--resume", "latest"] } else { &["--init-from", source] };
        let args = ["--config", file, "--steps", steps, "--seq", "8", "--eval-every", "0"];
        let out = ["--out", out.to_str().unwrap()];
        let run = train(&[&args[..], start, &out[..]].concat());
        assert!(run.status.success(), "{}", text(&run.stderr));
    };
    let (straight, resumed) = (dir.join("straight"), dir.join("resumed"));
    run_to(&straight, "6", false);
    run_to(&resumed, "3", false);
    run_to(&resumed, "6", true);
    assert_eq!(step_losses(&resumed), step_losses(&straight));
    assert_eq!(
        checkpoint_tensors(&checkpoint(&resumed, 6)),
        checkpoint_tensors(&checkpoint(&straight, 6))
    );
}

/// A directory with a field zeroflow does not implement, or with a shard missing, is refused
/// before training: exit 2, the file and the field (or the shard) named; a directory that is not
/// there is named as such, with the families a directory may hold (it said "a Hugging Face GPT-2
/// directory with an F32 model.safetensors").
#[test]
fn bad_llama_directories_exit_2_naming_the_file() {
    let dir = scratch("llama_bad_dirs");
    let moe = dir.join("moe");
    write_hf_dir(&moe, &tiny_llama(), u64::MAX);
    let path = moe.join("config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["num_local_experts"] = 8.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let sharded = dir.join("sharded");
    write_hf_dir(&sharded, &tiny_llama(), 4096);
    let mut shards: Vec<String> = std::fs::read_dir(&sharded)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.starts_with("model-"))
        .collect();
    shards.sort();
    assert!(shards.len() > 2, "the weights were written in shards: {shards:?}");
    std::fs::remove_file(sharded.join(&shards[1])).unwrap();
    for (bad, named) in [(&moe, "num_local_experts"), (&sharded, shards[1].as_str())] {
        let out = dir.join("out");
        let run = train(&["--init-from", bad.to_str().unwrap(), "--out", out.to_str().unwrap()]);
        let stderr = text(&run.stderr);
        assert_eq!(run.status.code(), Some(2), "{stderr}");
        let file = if named.starts_with("model-") {
            "model.safetensors.index.json"
        } else {
            "config.json"
        };
        assert!(stderr.contains(file) && stderr.contains(named), "{stderr}");
        assert!(!out.exists(), "nothing written for {}", bad.display());
    }
    let missing = dir.join("Llama-3-8B-typo");
    let out = dir.join("out");
    let run = train(&["--init-from", missing.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    let stderr = text(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("Llama-3-8B-typo: no such directory"), "{stderr}");
    assert!(stderr.contains("LlamaForCausalLM, Qwen2ForCausalLM"), "{stderr}");
    assert!(!out.exists(), "nothing written for {}", missing.display());
}

/// The Llama family's named shapes are `--model`'s: listed by `models` with their parameter
/// counts, named in `bench step --help`, and taken by `train` (whose sequence check reports the
/// shape's 131,072-token context).
#[test]
fn llama_named_shapes_are_listed_and_parsed() {
    let table = text(&zeroflow(&["models"]).stdout);
    for (name, count) in
        [("llama-1b", "1235814400"), ("llama-3b", "3212749824"), ("llama-8b", "8030261248")]
    {
        let line = table
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} in {table}"));
        assert!(line.contains(count), "{line}");
    }
    assert!(text(&zeroflow(&["bench", "step", "--help"]).stdout).contains("llama-1b"));
    let run = train(&["--model", "llama-1b", "--seq", "200000"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains("context of 131072 tokens"), "{}", text(&run.stderr));
}
