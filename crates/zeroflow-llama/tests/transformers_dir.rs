//! A directory that `transformers` 5.17 wrote (`save_pretrained`, a tiny random Qwen3 in
//! bfloat16, `max_shard_size="40KB"`: four shards; config.json in transformers 5's form with
//! `rope_parameters`, `dtype` and `layer_types`), read by zeroflow and written back. Its
//! `reference-stats.json` holds each tensor's sum and absolute sum, computed by PyTorch in f64
//! from the stored bfloat16 values.

use std::path::PathBuf;

use zeroflow_hf::{Dtype, HfCheckpoint, OutTensor, SaveDtype, SaveOptions};
use zeroflow_llama::{Architecture, LlamaConfig, hf_params};

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/transformers-5.17-qwen3-bf16")
}

#[test]
fn a_directory_transformers_wrote_reads_with_its_names_shapes_and_values() {
    let read = HfCheckpoint::open(&dir()).unwrap();
    let config = LlamaConfig::from_hf_config(read.config().unwrap()).unwrap();
    assert_eq!(config.architecture, Architecture::Qwen3);
    assert_eq!((config.head_dim, config.hidden_size, config.num_attention_heads), (12, 48, 6));
    assert_eq!((config.rope_theta, config.torch_dtype.as_deref()), (1e6, Some("bfloat16")));
    let params = hf_params(&config);
    read.check(params.iter().map(|p| (p.name.as_str(), p.shape.as_slice())), |_| false).unwrap();
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("reference-stats.json")).unwrap())
            .unwrap();
    assert_eq!(reference.as_object().unwrap().len(), params.len());
    for p in &params {
        assert_eq!(read.tensor(&p.name).unwrap().dtype, Dtype::BF16);
        let values = read.read_f32(&p.name).unwrap();
        let sum: f64 = values.iter().map(|&v| f64::from(v)).sum();
        let abs: f64 = values.iter().map(|&v| f64::from(v).abs()).sum();
        let expected = &reference[p.name.as_str()];
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
        assert!(close(sum, expected["sum"].as_f64().unwrap()), "{}: sum {sum}", p.name);
        assert!(close(abs, expected["abs_sum"].as_f64().unwrap()), "{}: |sum| {abs}", p.name);
        assert!(abs > 0.0, "{}: the fixture's values are random, not zero", p.name);
    }
}

#[test]
fn a_directory_transformers_wrote_is_written_back_bit_for_bit_in_bfloat16() {
    let read = HfCheckpoint::open(&dir()).unwrap();
    let config = LlamaConfig::from_hf_config(read.config().unwrap()).unwrap();
    let params = hf_params(&config);
    let values: Vec<Vec<f32>> = params.iter().map(|p| read.read_f32(&p.name).unwrap()).collect();
    let tensors: Vec<OutTensor<'_>> = params
        .iter()
        .zip(&values)
        .map(|(p, v)| OutTensor { name: &p.name, shape: &p.shape, values: v })
        .collect();
    let out = std::env::temp_dir()
        .join(format!("zeroflow-llama-from-transformers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let options = SaveOptions {
        dtype: SaveDtype::Bf16,
        max_shard_bytes: 50_000,
        tokenizer_from: Some(dir()),
    };
    let saved = zeroflow_hf::save(&out, &config.to_hf_config(), &tensors, &options).unwrap();
    assert_eq!(saved.tokenizer_files, ["generation_config.json"]);
    let back = HfCheckpoint::open(&out).unwrap();
    assert_eq!(LlamaConfig::from_hf_config(back.config().unwrap()).unwrap(), config);
    for (p, v) in params.iter().zip(&values) {
        assert_eq!(&back.read_f32(&p.name).unwrap(), v, "{}", p.name);
    }
    std::fs::remove_dir_all(&out).unwrap();
}
