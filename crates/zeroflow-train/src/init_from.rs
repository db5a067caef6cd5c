//! `--init-from`: the initial weights from a Hugging Face directory, its family chosen by
//! `config.json`'s `architectures`: `GPT2LMHeadModel` (or no `config.json`) reads an F32
//! `model.safetensors` such as `zeroflow export` writes; `LlamaForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` and `MistralForCausalLM` are read by `zeroflow_llama::HfLlama` (one file or
//! the shards of an index, BF16/F16/F32). Every problem is an input error naming the file and
//! the field or tensor.

use std::path::{Path, PathBuf};

use zeroflow_core::Float;
use zeroflow_core::layout::{FlatLayout, ranges_mut};
use zeroflow_engine::checkpoint::NamedTensor;
use zeroflow_gpt::GptConfig;
use zeroflow_hf::{Dtype, SafetensorsFile};
use zeroflow_llama::HfLlama;

use crate::ModelSpec;
use crate::error::{Result, input};
use crate::llama::LlamaSpec;

/// A Hugging Face directory, read.
#[derive(Debug)]
pub struct HfModel {
    pub dir: PathBuf,
    /// The model `config.json` gives, when there is one.
    pub model: Option<ModelSpec>,
    weights: Weights,
}

/// The weights of a directory, by family.
#[derive(Debug)]
enum Weights {
    /// GPT-2's `model.safetensors`, opened (its tensors read when asked, each into its range of
    /// the flat weights, so that the file is never in memory beside them).
    Gpt2(SafetensorsFile),
    /// The Llama family's: the directory opened, its tensors checked (read when asked).
    Llama(Box<HfLlama>),
}

const WHAT_TO_DO: &str = "--init-from needs a Hugging Face model directory: a config.json \
                          whose architectures names LlamaForCausalLM, Qwen2ForCausalLM, \
                          Qwen3ForCausalLM, MistralForCausalLM or GPT2LMHeadModel, and its \
                          safetensors (GPT-2's one model.safetensors in F32, BF16 or F16, such \
                          as `zeroflow export` writes)";

/// Reads `dir`: its `config.json` (where present) says the family, whose weights are checked
/// against the model's names and shapes.
pub fn read(dir: &Path) -> Result<HfModel> {
    if !dir.is_dir() {
        return Err(input(format!(
            "--init-from {}: no such directory; {WHAT_TO_DO}",
            dir.display()
        )));
    }
    let config_path = dir.join("config.json");
    let json = read_json(&config_path)?;
    if json.as_ref().and_then(ModelSpec::names_gpt2) == Some(false) {
        // HfLlama names the file and the field (an architecture zeroflow does not train too).
        let hf = HfLlama::open(dir).map_err(|e| input(format!("--init-from {e}")))?;
        let model = Some(ModelSpec::Llama(LlamaSpec(hf.config.clone())));
        return Ok(HfModel {
            dir: dir.to_path_buf(),
            model,
            weights: Weights::Llama(Box::new(hf)),
        });
    }
    let path = dir.join("model.safetensors");
    let file = SafetensorsFile::open(&path)
        .map_err(|e| input(format!("--init-from {e}; {WHAT_TO_DO}")))?;
    for (name, entry) in file.tensors() {
        if !matches!(entry.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16) {
            let dtype = entry.dtype;
            return Err(input(format!(
                "--init-from {}: tensor {name} is {dtype:?}; zeroflow reads F32, BF16 and F16 \
                 weights",
                path.display()
            )));
        }
    }
    let model = match json {
        Some(json) => Some(ModelSpec::Gpt2(gpt2_config(&config_path, &json)?)),
        None => None,
    };
    Ok(HfModel { dir: dir.to_path_buf(), model, weights: Weights::Gpt2(file) })
}

/// `path` as JSON, `None` where the file does not exist.
fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(None) };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| input(format!("--init-from {}: not JSON ({e}); fix the file", path.display())))
}

/// The GPT-2 shape of `path`'s `json` (transformers' `GPT2Config` keys).
fn gpt2_config(path: &Path, json: &serde_json::Value) -> Result<GptConfig> {
    GptConfig::from_hf_config(json).map_err(|e| {
        input(format!(
            "--init-from {}: {e}; fix the file, or give the shape with --model",
            path.display()
        ))
    })
}

impl HfModel {
    /// Checks that the directory holds `model`'s weights, whose tensors are `tensors`: GPT-2's
    /// names are looked up as given and without the `transformer.` prefix (the original OpenAI
    /// GPT-2 files omit it), every tensor with the model's shape; a Llama directory gives the
    /// weights of its own `config.json`'s model only (its tensors were checked when it was
    /// opened). What [`HfModel::flat_weights`] reads, said before anything else is.
    pub fn check(&self, model: &ModelSpec, tensors: &[NamedTensor]) -> Result<()> {
        match &self.weights {
            Weights::Gpt2(file) => self.gpt2_names(file, tensors).map(drop),
            Weights::Llama(_) if self.model.as_ref() != Some(model) => Err(input(format!(
                "--init-from {}: --model differs from the directory's config.json; drop --model \
                 to train the directory's model",
                self.dir.display()
            ))),
            Weights::Llama(_) => Ok(()),
        }
    }

    /// The flat weights (padding zero) of the model [`HfModel::check`] accepted, whose tensors
    /// are `tensors` in `layout`, as `P` (through f32: rounded where `P` is narrower than the
    /// stored type), read straight into their buffer.
    pub fn flat_weights<P: Float>(
        &self,
        layout: &FlatLayout,
        tensors: &[NamedTensor],
    ) -> Result<Vec<P>> {
        let mut flat = vec![P::default(); layout.padded_len()];
        match &self.weights {
            Weights::Gpt2(file) => {
                let names = self.gpt2_names(file, tensors)?;
                let ranges: Vec<_> = tensors.iter().map(|t| t.flat.clone()).collect();
                let outs =
                    ranges_mut(&mut flat, &ranges).expect("a layout's parameters do not overlap");
                let read = file.read_tensors(names.into_iter().zip(outs).collect());
                read.map_err(|e| input(format!("--init-from {e}")))?;
            }
            Weights::Llama(hf) => {
                hf.read_params(layout, &mut flat).map_err(|e| input(format!("--init-from {e}")))?
            }
        }
        Ok(flat)
    }

    /// The name each of `tensors` has in GPT-2's `file`, checked to have the model's shape.
    fn gpt2_names<'t>(
        &self,
        file: &SafetensorsFile,
        tensors: &'t [NamedTensor],
    ) -> Result<Vec<&'t str>> {
        let path = file.path();
        let mut names = Vec::with_capacity(tensors.len());
        for tensor in tensors {
            let short = tensor.name.strip_prefix("transformer.").unwrap_or(&tensor.name);
            let (name, entry) = [tensor.name.as_str(), short]
                .into_iter()
                .find_map(|name| file.tensor(name).map(|entry| (name, entry)))
                .ok_or_else(|| {
                    input(format!(
                        "--init-from {}: it has no tensor {}; {WHAT_TO_DO}",
                        path.display(),
                        tensor.name
                    ))
                })?;
            if entry.shape != tensor.shape {
                return Err(input(format!(
                    "--init-from {}: {} has shape {:?}, the model needs {:?}; pass the \
                     --model it was trained with, or drop --model to use its config.json",
                    path.display(),
                    tensor.name,
                    entry.shape,
                    tensor.shape
                )));
            }
            names.push(name);
        }
        Ok(names)
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_engine::LossScaler;
    use zeroflow_engine::checkpoint::{self, Meta, NamedTensor};
    use zeroflow_gpt::{GptConfig, flat_layout, hf_tensors, init_params};

    /// The weights of the directory `dir` as f32, checked for `spec` first.
    fn read_checked(
        dir: &std::path::Path,
        spec: &crate::ModelSpec,
        layout: &zeroflow_core::layout::FlatLayout,
        named: &[NamedTensor],
    ) -> Vec<f32> {
        let hf = super::read(dir).unwrap();
        hf.check(spec, named).unwrap();
        hf.flat_weights(layout, named).unwrap()
    }

    /// Importing a checkpoint's `model.safetensors` (what `zeroflow export` copies) and saving the
    /// imported weights again gives the same bytes.
    #[test]
    fn import_then_export_is_bit_identical() {
        let model = GptConfig { n_layer: 1, n_head: 2, d_model: 16, vocab_size: 50, context: 8 };
        let layout = flat_layout(&model, 1).unwrap();
        let mut weights = vec![0.0f32; layout.padded_len()];
        init_params(&model, &layout, 7, &mut weights).unwrap();
        let hf = hf_tensors(&model, &layout).unwrap();
        let named: Vec<NamedTensor> = hf
            .iter()
            .map(|t| NamedTensor {
                name: t.name.clone(),
                shape: t.shape.clone(),
                flat: t.flat_range.clone(),
            })
            .collect();
        let meta = Meta {
            format: checkpoint::FORMAT.into(),
            version: checkpoint::VERSION,
            optimizer_steps: 0,
            micro_steps: 0,
            world_size: 0,
            scaler: LossScaler::None,
            upload_pending: false,
            weights_dtype: "F32".into(),
            optimizer_state_dtype: "fp32".into(),
            params: Vec::new(),
            extra: serde_json::Value::Null,
        };
        let root = std::env::temp_dir().join(format!("zeroflow-init-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let (first, second) = (root.join("first"), root.join("second"));
        checkpoint::save(&first, &meta, &weights, &named, &[]).unwrap();
        let spec = crate::ModelSpec::Gpt2(model);
        let imported: Vec<f32> = read_checked(&first, &spec, &layout, &named);
        checkpoint::save(&second, &meta, &imported, &named, &[]).unwrap();
        let bytes = |dir: &std::path::Path| std::fs::read(dir.join("model.safetensors")).unwrap();
        assert_eq!(bytes(&first), bytes(&second));
        // The same weights in BF16 (as `save_pretrained` in bfloat16 writes them) are read
        // rounded to bf16; a tensor of integers is refused, naming it.
        let third = root.join("third");
        let out: Vec<zeroflow_hf::OutTensor<'_>> = named
            .iter()
            .map(|t| zeroflow_hf::OutTensor {
                name: &t.name,
                shape: &t.shape,
                values: &weights[t.flat.clone()],
            })
            .collect();
        let options = zeroflow_hf::SaveOptions {
            dtype: zeroflow_hf::SaveDtype::Bf16,
            max_shard_bytes: u64::MAX,
            tokenizer_from: None,
        };
        zeroflow_hf::save(&third, &serde_json::json!({}), &out, &options).unwrap();
        std::fs::remove_file(third.join("config.json")).unwrap();
        let imported: Vec<f32> = read_checked(&third, &spec, &layout, &named);
        for t in &named {
            for i in t.flat.clone() {
                assert_eq!(imported[i], zeroflow_core::bf16::from_f32(weights[i]).to_f32(), "{i}");
            }
        }
        let fourth = root.join("fourth");
        std::fs::create_dir_all(&fourth).unwrap();
        // A safetensors file by hand: the header's length, the header, eight bytes of data.
        let header =
            r#"{"transformer.wte.weight":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#;
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(header.bytes().chain([0u8; 8]));
        std::fs::write(fourth.join("model.safetensors"), file).unwrap();
        let error = super::read(&fourth).unwrap_err().to_string();
        assert!(error.contains("transformer.wte.weight is I32"), "{error}");
        std::fs::remove_dir_all(&root).unwrap();
    }
}
