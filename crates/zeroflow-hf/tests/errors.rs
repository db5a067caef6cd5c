//! Every way a directory can be wrong gives an error that names the file and what is wrong.

use safetensors::Dtype;
use serde_json::json;
use zeroflow_hf::{HfCheckpoint, HfError, SaveDtype, SaveOptions, save};

use crate::roundtrip::write_raw;
use crate::{Scratch, out_tensors, sample_tensors};

fn sharded(scratch: &Scratch) -> std::path::PathBuf {
    let dir = scratch.0.join("model");
    let tensors = sample_tensors();
    let options = SaveOptions { dtype: SaveDtype::F32, max_shard_bytes: 100, tokenizer_from: None };
    save(&dir, &json!({}), &out_tensors(&tensors), &options).unwrap();
    dir
}

#[test]
fn a_missing_shard_names_the_shard_and_the_index() {
    let scratch = Scratch::new("missing-shard");
    let dir = sharded(&scratch);
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let shard = index["weight_map"]["model.norm.weight"].as_str().unwrap().to_string();
    std::fs::remove_file(dir.join(&shard)).unwrap();
    let err = HfCheckpoint::open(&dir).unwrap_err();
    assert!(matches!(&err, HfError::MissingShard { shard: s, .. } if *s == shard), "{err:?}");
    let message = err.to_string();
    assert!(message.contains(&shard), "{message}");
    assert!(message.contains("model.safetensors.index.json"), "{message}");
}

#[test]
fn a_tensor_the_index_puts_in_a_shard_that_lacks_it_is_named() {
    let scratch = Scratch::new("not-in-shard");
    let dir = sharded(&scratch);
    let path = dir.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let shard = index["weight_map"]["model.norm.weight"].clone();
    index["weight_map"]["model.layers.9.ghost.weight"] = shard.clone();
    std::fs::write(&path, index.to_string()).unwrap();
    let message = HfCheckpoint::open(&dir).unwrap_err().to_string();
    assert!(message.contains("model.layers.9.ghost.weight"), "{message}");
    assert!(message.contains(shard.as_str().unwrap()), "{message}");
}

#[test]
fn an_index_without_a_weight_map_is_refused() {
    let scratch = Scratch::new("bad-index");
    std::fs::write(scratch.0.join("model.safetensors.index.json"), "{\"metadata\": {}}").unwrap();
    let message = HfCheckpoint::open(&scratch.0).unwrap_err().to_string();
    assert!(
        message.contains("model.safetensors.index.json") && message.contains("weight_map"),
        "{message}"
    );
}

#[test]
fn a_directory_without_weights_says_which_files_it_looked_for() {
    let scratch = Scratch::new("no-weights");
    let message = HfCheckpoint::open(&scratch.0).unwrap_err().to_string();
    assert!(
        message.contains("model.safetensors.index.json") && message.contains("model.safetensors"),
        "{message}"
    );
}

#[test]
fn a_dtype_zeroflow_cannot_read_names_the_tensor_and_the_dtype() {
    let scratch = Scratch::new("bad-dtype");
    write_raw(&scratch.0, &[("model.embed_tokens.weight", Dtype::I64, vec![2], vec![0u8; 16])]);
    let read = HfCheckpoint::open(&scratch.0).unwrap();
    let err = read.read_f32("model.embed_tokens.weight").unwrap_err();
    assert!(matches!(err, HfError::UnsupportedDtype { .. }), "{err:?}");
    let message = err.to_string();
    assert!(message.contains("model.embed_tokens.weight") && message.contains("I64"), "{message}");
    assert!(message.contains("model.safetensors"), "{message}");
    let expected: [(&str, &[usize]); 1] = [("model.embed_tokens.weight", &[2])];
    let checked = read.check(expected, |_| false).unwrap_err().to_string();
    assert!(checked.contains("I64"), "check reports the dtype too: {checked}");
}

#[test]
fn missing_and_unexpected_names_are_all_listed() {
    let scratch = Scratch::new("names");
    let f32 = |n: usize| vec![0u8; 4 * n];
    write_raw(
        &scratch.0,
        &[
            ("model.norm.weight", Dtype::F32, vec![4], f32(4)),
            ("transformer.h.0.attn.c_attn.weight", Dtype::F32, vec![4], f32(4)),
            ("lm_head.extra", Dtype::F32, vec![4], f32(4)),
        ],
    );
    let read = HfCheckpoint::open(&scratch.0).unwrap();
    let expected: [(&str, &[usize]); 3] = [
        ("model.norm.weight", &[4]),
        ("model.embed_tokens.weight", &[8, 4]),
        ("lm_head.weight", &[8, 4]),
    ];
    let err = read.check(expected, |_| false).unwrap_err();
    let HfError::Names { missing, unexpected, .. } = &err else { panic!("{err:?}") };
    assert_eq!(missing, &["lm_head.weight", "model.embed_tokens.weight"]);
    assert_eq!(unexpected, &["lm_head.extra", "transformer.h.0.attn.c_attn.weight"]);
    let message = err.to_string();
    for name in missing.iter().chain(unexpected) {
        assert!(message.contains(name.as_str()), "{message}");
    }
    assert!(message.contains("missing") && message.contains("unexpected"), "{message}");
}

#[test]
fn a_shape_that_disagrees_names_the_tensor_expected_and_found() {
    let scratch = Scratch::new("shape");
    write_raw(&scratch.0, &[("model.norm.weight", Dtype::F32, vec![2, 3], vec![0u8; 24])]);
    let read = HfCheckpoint::open(&scratch.0).unwrap();
    let expected: [(&str, &[usize]); 1] = [("model.norm.weight", &[3, 2])];
    let err = read.check(expected, |_| false).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("model.norm.weight")
            && message.contains("[3, 2]")
            && message.contains("[2, 3]"),
        "{message}"
    );
    let mut out = [0.0; 6];
    assert!(matches!(
        read.read_into("model.norm.weight", &[6], &mut out),
        Err(HfError::ShapeMismatch { .. })
    ));
}

#[test]
fn a_truncated_file_is_refused_naming_it() {
    let scratch = Scratch::new("truncated");
    write_raw(&scratch.0, &[("w", Dtype::F32, vec![4], vec![0u8; 16])]);
    let path = scratch.0.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
    let message = HfCheckpoint::open(&scratch.0).unwrap_err().to_string();
    assert!(message.contains("model.safetensors") && message.contains("bytes"), "{message}");
}

#[test]
fn writing_into_a_non_empty_directory_is_refused_and_leaves_it_alone() {
    let scratch = Scratch::new("exists");
    std::fs::write(scratch.0.join("keep.txt"), "mine").unwrap();
    let tensors = sample_tensors();
    let err =
        save(&scratch.0, &json!({}), &out_tensors(&tensors), &SaveOptions::default()).unwrap_err();
    assert!(matches!(err, HfError::OutputExists { .. }), "{err:?}");
    assert_eq!(std::fs::read_to_string(scratch.0.join("keep.txt")).unwrap(), "mine");
    assert!(!scratch.0.join("model.safetensors").exists());
}

#[test]
fn tensors_whose_data_does_not_fill_their_shape_are_refused() {
    let scratch = Scratch::new("data-length");
    let values = [1.0f32; 5];
    let tensor = zeroflow_hf::OutTensor { name: "w", shape: &[2, 3], values: &values };
    let err =
        save(&scratch.0.join("out"), &json!({}), &[tensor], &SaveOptions::default()).unwrap_err();
    assert!(err.to_string().contains("w") && err.to_string().contains("6"), "{err}");
    let twice = [tensor, tensor].map(|t| zeroflow_hf::OutTensor { values: &[0.0; 6], ..t });
    let err =
        save(&scratch.0.join("out"), &json!({}), &twice, &SaveOptions::default()).unwrap_err();
    assert!(matches!(err, HfError::DuplicateOutput { .. }), "{err:?}");
}

/// A directory without safetensors weights says so; where it has `transformers`' older pickle
/// weights instead, the message names the file and the command that writes safetensors.
#[test]
fn a_directory_of_pickle_weights_names_them_and_the_conversion() {
    let scratch = Scratch::new("pickle-weights");
    let empty = HfCheckpoint::open(&scratch.0).unwrap_err();
    assert!(matches!(&empty, HfError::NoWeights { other: None, .. }), "{empty:?}");
    assert!(!empty.to_string().contains("PyTorch's pickle"), "{empty}");
    std::fs::write(scratch.0.join("pytorch_model.bin"), b"not read").unwrap();
    let message = HfCheckpoint::open(&scratch.0).unwrap_err().to_string();
    assert!(message.contains("its pytorch_model.bin is PyTorch's pickle format"), "{message}");
    let dir = scratch.0.display();
    assert!(message.contains(&format!("save_pretrained('{dir}-safetensors')")), "{message}");
}
