//! The model's weights through Hugging Face directories: written by `save_hf_dir`, read back by
//! `HfLlama` into another flat layout (same config, same values, same loss); BF16 and F16
//! weights; and directories that are wrong in one way each, whose errors name the file and the
//! field or tensor.

use std::path::{Path, PathBuf};

use serde_json::Value;
use zeroflow_core::layout::FlatLayout;
use zeroflow_hf::{OutTensor, SaveDtype, SaveOptions};
use zeroflow_llama::{
    AttentionKind, HfLlama, HostLlama, LlamaConfig, flat_layout, hf_params, save_hf_dir,
};

use crate::support::{models, perturbed_params, random_batch};

/// A fresh scratch path (not created) for test `name`.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("zeroflow-llama-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The perturbed f32 parameters of `config` in its one-rank layout.
fn params32(config: &LlamaConfig, seed: u64) -> (FlatLayout, Vec<f32>) {
    let (layout, params) = perturbed_params(config, seed);
    (layout, params.iter().map(|&x| x as f32).collect())
}

fn options(dtype: SaveDtype, max_shard_bytes: u64) -> SaveOptions {
    SaveOptions { dtype, max_shard_bytes, tokenizer_from: None }
}

/// Every tiny model written in F32 as shards of at most 4 kB (with a tokenizer file) and read
/// back into a two-rank layout: the same configuration (torch_dtype now float32), every tensor
/// bit for bit, and so the same loss.
#[test]
fn a_written_model_reads_back_with_its_config_weights_and_loss() {
    let source = scratch("tokenizer-source");
    std::fs::create_dir_all(&source).unwrap();
    std::fs::write(source.join("tokenizer.json"), "{\"version\": \"1.0\"}").unwrap();
    for (i, (what, config)) in models().into_iter().enumerate() {
        let (layout, params) = params32(&config, 200 + i as u64);
        let dir = scratch(&format!("roundtrip-{i}"));
        let options =
            SaveOptions { tokenizer_from: Some(source.clone()), ..options(SaveDtype::F32, 4000) };
        let saved = save_hf_dir(&dir, &config, &layout, &params, &options).unwrap();
        assert!(saved.weight_files.len() > 1, "{what}: sharded");
        assert!(dir.join("model.safetensors.index.json").is_file());
        assert_eq!(saved.tokenizer_files, ["tokenizer.json"]);

        let loaded = HfLlama::open(&dir).unwrap();
        let expected = LlamaConfig { torch_dtype: Some("float32".into()), ..config.clone() };
        assert_eq!(loaded.config, expected, "{what}");
        let two_ranks = flat_layout(&config, 2).unwrap();
        let mut read = vec![0.0f32; two_ranks.padded_len()];
        loaded.read_params(&two_ranks, &mut read).unwrap();
        for param in hf_params(&config) {
            let (a, b) =
                (layout.param(&param.name).unwrap(), two_ranks.param(&param.name).unwrap());
            assert_eq!(params[a.flat_range()], read[b.flat_range()], "{what}: {}", param.name);
        }
        let (batch, seq) = (2, 4);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 7);
        let loss = |layout: &FlatLayout, params: &[f32]| {
            let params: Vec<f64> = params.iter().map(|&x| f64::from(x)).collect();
            let mut model =
                HostLlama::<f64>::new(&config, layout, batch, seq, AttentionKind::Gemm).unwrap();
            model.forward(&params, &inputs, &targets).unwrap()
        };
        assert_eq!(loss(&layout, &params), loss(&two_ranks, &read), "{what}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
    std::fs::remove_dir_all(&source).unwrap();
}

/// Weights written in BF16 read back as the BF16 rounding of the values; a file of F16 tensors
/// (as `transformers` saves a float16 model) reads back as their F16 rounding.
#[test]
fn bf16_and_f16_weights_read_back_rounded_to_their_dtype() {
    let config = &models()[3].1;
    let (layout, params) = params32(config, 9);
    let dir = scratch("bf16");
    save_hf_dir(&dir, config, &layout, &params, &options(SaveDtype::Bf16, u64::MAX)).unwrap();
    let mut read = vec![0.0f32; layout.padded_len()];
    HfLlama::open(&dir).unwrap().read_params(&layout, &mut read).unwrap();
    for view in layout.params() {
        let rounded: Vec<f32> =
            params[view.flat_range()].iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
        assert_eq!(read[view.flat_range()], rounded[..], "bf16 {}", view.name);
    }
    std::fs::remove_dir_all(&dir).unwrap();

    let dir = scratch("f16");
    std::fs::create_dir_all(&dir).unwrap();
    let json = serde_json::to_string(&config.to_hf_config()).unwrap();
    std::fs::write(dir.join("config.json"), json).unwrap();
    let specs = hf_params(config);
    let bytes: Vec<Vec<u8>> = specs
        .iter()
        .map(|p| {
            let values = &params[layout.param(&p.name).unwrap().flat_range()];
            values.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = specs
        .iter()
        .zip(&bytes)
        .map(|(p, b)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::F16, p.shape.clone(), b);
            (p.name.clone(), view.unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let mut read = vec![0.0f32; layout.padded_len()];
    HfLlama::open(&dir).unwrap().read_params(&layout, &mut read).unwrap();
    for view in layout.params() {
        let rounded: Vec<f32> =
            params[view.flat_range()].iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        assert_eq!(read[view.flat_range()], rounded[..], "f16 {}", view.name);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Writes `config`'s tensors as `dir` through zeroflow-hf, after `edit` changes the list (so
/// that a directory can lack a tensor or hold one of a wrong shape), in shards of 4 kB.
fn write_edited(
    dir: &Path,
    config: &LlamaConfig,
    edit: impl FnOnce(&mut Vec<(String, Vec<usize>)>),
) {
    let mut specs: Vec<(String, Vec<usize>)> =
        hf_params(config).into_iter().map(|p| (p.name, p.shape)).collect();
    edit(&mut specs);
    let values: Vec<Vec<f32>> =
        specs.iter().map(|(_, shape)| vec![0.5; shape.iter().product()]).collect();
    let tensors: Vec<OutTensor<'_>> = specs
        .iter()
        .zip(&values)
        .map(|((name, shape), values)| OutTensor { name, shape, values })
        .collect();
    zeroflow_hf::save(dir, &config.to_hf_config(), &tensors, &options(SaveDtype::F32, 4000))
        .unwrap();
}

/// The error of opening `dir`, as text.
fn open_error(dir: &Path) -> String {
    HfLlama::open(dir).unwrap_err().to_string()
}

/// A shard the index lists is gone: the error names the index and the shard.
#[test]
fn a_missing_shard_is_an_error_naming_the_index_and_the_shard() {
    let config = &models()[0].1;
    let dir = scratch("missing-shard");
    write_edited(&dir, config, |_| {});
    let mut shards: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.starts_with("model-"))
        .collect();
    shards.sort();
    assert!(shards.len() >= 2, "{shards:?}");
    std::fs::remove_file(dir.join(&shards[1])).unwrap();
    let error = open_error(&dir);
    assert!(
        error.contains("model.safetensors.index.json") && error.contains(&shards[1]),
        "{error}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A parameter the model needs is not in the directory: the error names the directory and the
/// tensor.
#[test]
fn a_missing_tensor_is_an_error_naming_the_directory_and_the_tensor() {
    let config = &models()[0].1;
    let dir = scratch("missing-tensor");
    let name = "model.layers.1.mlp.up_proj.weight";
    write_edited(&dir, config, |specs| specs.retain(|(n, _)| n != name));
    let error = open_error(&dir);
    assert!(error.contains(dir.to_str().unwrap()) && error.contains(name), "{error}");
    assert!(error.contains("missing tensors"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tensor of another shape than the config gives: the error names the file, the tensor and
/// both shapes.
#[test]
fn a_tensor_of_the_wrong_shape_is_an_error_naming_the_file_and_the_tensor() {
    let config = &models()[0].1;
    let dir = scratch("wrong-shape");
    let name = "model.layers.0.self_attn.k_proj.weight";
    write_edited(&dir, config, |specs| {
        let spec = specs.iter_mut().find(|(n, _)| n == name).unwrap();
        spec.1 = vec![7, 10];
    });
    let error = open_error(&dir);
    assert!(error.contains(".safetensors") && error.contains(name), "{error}");
    assert!(error.contains("[7, 10]") && error.contains("[8, 10]"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A config.json asking for what zeroflow does not implement (experts), or none at all: the
/// error names config.json (and the field).
#[test]
fn an_unsupported_or_missing_config_is_an_error_naming_config_json() {
    let config = &models()[0].1;
    let dir = scratch("unsupported");
    write_edited(&dir, config, |_| {});
    let path = dir.join("config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json["num_experts"] = 4.into();
    std::fs::write(&path, json.to_string()).unwrap();
    let error = open_error(&dir);
    assert!(error.contains(path.to_str().unwrap()) && error.contains("num_experts"), "{error}");
    std::fs::remove_file(&path).unwrap();
    let error = open_error(&dir);
    assert!(error.contains(dir.to_str().unwrap()) && error.contains("no config.json"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}
