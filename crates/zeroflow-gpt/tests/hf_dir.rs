//! A GPT-2 written as a Hugging Face directory (`GPT2LMHeadModel`'s names, or `GPT2Model`'s
//! without the prefix) reads back into the flat buffer by `HfGpt`; what zeroflow's GPT-2 does
//! not compute is refused, naming the field, and a missing tensor is named.

use std::path::PathBuf;

use zeroflow_gpt::{GptConfig, HfGpt, flat_layout, hf_tensors};
use zeroflow_hf::{OutTensor, SaveDtype, SaveOptions};

const ODD: GptConfig = GptConfig { n_layer: 2, n_head: 3, d_model: 9, vocab_size: 70, context: 12 };

/// Writes `ODD` with distinct values under `dir`, its names with `prefix` replaced (the model
/// names' `transformer.`), `config` edited by `edit`, leaving out tensor `skip`.
fn write(
    dir: &PathBuf,
    prefix: &str,
    edit: impl Fn(&mut serde_json::Value),
    skip: &str,
) -> Vec<f32> {
    let layout = flat_layout(&ODD, 1).unwrap();
    let mut flat = vec![0.0f32; layout.padded_len()];
    let tensors = hf_tensors(&ODD, &layout).unwrap();
    for (t, tensor) in tensors.iter().enumerate() {
        for (j, x) in flat[tensor.flat_range.clone()].iter_mut().enumerate() {
            *x = ((t * 37 + j) as f32 * 0.01).sin();
        }
    }
    let names: Vec<String> =
        tensors.iter().map(|t| t.name.replacen("transformer.", prefix, 1)).collect();
    let out: Vec<OutTensor<'_>> = tensors
        .iter()
        .zip(&names)
        .filter(|(t, _)| t.name != skip)
        .map(|(t, name)| OutTensor { name, shape: &t.shape, values: &flat[t.flat_range.clone()] })
        .collect();
    let mut config = ODD.to_hf_config();
    edit(&mut config);
    let _ = std::fs::remove_dir_all(dir);
    let options = SaveOptions { dtype: SaveDtype::F32, ..SaveOptions::default() };
    zeroflow_hf::save(dir, &config, &out, &options).unwrap();
    flat
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("zeroflow-gpt-hf-{name}-{}", std::process::id()))
}

#[test]
fn a_gpt2_directory_reads_back_into_the_flat_buffer_with_either_naming() {
    for (name, prefix) in [("lm-head-model", "transformer."), ("bare-model", "")] {
        let dir = temp(name);
        let flat = write(&dir, prefix, |_| {}, "");
        let hf = HfGpt::open(&dir).unwrap();
        assert_eq!(hf.config, ODD);
        let layout = flat_layout(&ODD, 1).unwrap();
        let mut read = vec![0.0f32; layout.padded_len()];
        hf.read_params(&layout, &mut read).unwrap();
        assert_eq!(read, flat, "{name}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn what_gpt2_does_not_compute_is_refused_by_field_and_a_missing_tensor_by_name() {
    let dir = temp("relu");
    write(&dir, "transformer.", |c| c["activation_function"] = "relu".into(), "");
    let error = HfGpt::open(&dir).unwrap_err().to_string();
    assert!(error.contains("activation_function") && error.contains("relu"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = temp("untied");
    write(&dir, "transformer.", |c| c["tie_word_embeddings"] = false.into(), "");
    let error = HfGpt::open(&dir).unwrap_err().to_string();
    assert!(error.contains("tie_word_embeddings"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
    let dir = temp("missing");
    write(&dir, "transformer.", |_| {}, "transformer.h.1.mlp.c_fc.bias");
    let error = HfGpt::open(&dir).unwrap_err().to_string();
    assert!(error.contains("transformer.h.1.mlp.c_fc.bias"), "{error}");
    std::fs::remove_dir_all(&dir).unwrap();
}
