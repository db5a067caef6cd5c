//! `--init-from`: the initial weights from a Hugging Face directory, its family chosen by
//! `config.json`'s `architectures`: `GPT2LMHeadModel` (or no `config.json`) reads an F32
//! `model.safetensors` such as `zeroflow export` writes; `LlamaForCausalLM`, `Qwen2ForCausalLM`,
//! `Qwen3ForCausalLM` and `MistralForCausalLM` are read by `zeroflow_llama::HfLlama` (one file or
//! the shards of an index, BF16/F16/F32). Every problem is an input error naming the file and
//! the field or tensor.

use std::path::{Path, PathBuf};

use zeroflow_core::layout::FlatLayout;
use zeroflow_engine::checkpoint::{self, NamedTensor, Tensors};
use zeroflow_gpt::GptConfig;
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
    /// GPT-2's: shape and elements by tensor name.
    Gpt2(Tensors<f32>),
    /// The Llama family's: the directory opened, its tensors checked (read when asked).
    Llama(Box<HfLlama>),
}

const WHAT_TO_DO: &str = "--init-from needs a Hugging Face model directory: a config.json \
                          whose architectures names LlamaForCausalLM, Qwen2ForCausalLM, \
                          Qwen3ForCausalLM, MistralForCausalLM or GPT2LMHeadModel, and its \
                          safetensors (GPT-2's an F32 model.safetensors, such as `zeroflow \
                          export` writes)";

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
    let bytes = std::fs::read(&path)
        .map_err(|e| input(format!("--init-from {}: {e}; {WHAT_TO_DO}", path.display())))?;
    let tensors = checkpoint::read_tensors::<f32>(&bytes, &path)
        .map_err(|e| input(format!("--init-from {e}; {WHAT_TO_DO}")))?;
    let model = match json {
        Some(json) => Some(ModelSpec::Gpt2(gpt2_config(&config_path, &json)?)),
        None => None,
    };
    Ok(HfModel { dir: dir.to_path_buf(), model, weights: Weights::Gpt2(tensors) })
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
    /// The flat weights (padding zero) of `model`, whose tensors are `tensors` in `layout`.
    /// GPT-2's names are looked up as given and without the `transformer.` prefix (the original
    /// OpenAI GPT-2 files omit it); every tensor must be there with the model's shape. A Llama
    /// directory gives the weights of its own `config.json`'s model only.
    pub fn flat_weights(
        &self,
        model: &ModelSpec,
        layout: &FlatLayout,
        tensors: &[NamedTensor],
    ) -> Result<Vec<f32>> {
        match &self.weights {
            Weights::Gpt2(by_name) => self.gpt2_weights(by_name, tensors, layout.padded_len()),
            Weights::Llama(hf) => {
                if self.model.as_ref() != Some(model) {
                    return Err(input(format!(
                        "--init-from {}: --model differs from the directory's config.json; drop \
                         --model to train the directory's model",
                        self.dir.display()
                    )));
                }
                let mut flat = vec![0.0; layout.padded_len()];
                hf.read_params(layout, &mut flat).map_err(|e| input(format!("--init-from {e}")))?;
                Ok(flat)
            }
        }
    }

    fn gpt2_weights(
        &self,
        by_name: &Tensors<f32>,
        tensors: &[NamedTensor],
        padded_len: usize,
    ) -> Result<Vec<f32>> {
        let path = self.dir.join("model.safetensors");
        let mut flat = vec![0.0; padded_len];
        for tensor in tensors {
            let short = tensor.name.strip_prefix("transformer.").unwrap_or(&tensor.name);
            let (shape, values) =
                by_name.get(&tensor.name).or_else(|| by_name.get(short)).ok_or_else(|| {
                    input(format!(
                        "--init-from {}: it has no tensor {}; {WHAT_TO_DO}",
                        path.display(),
                        tensor.name
                    ))
                })?;
            if *shape != tensor.shape {
                return Err(input(format!(
                    "--init-from {}: {} has shape {shape:?}, the model needs {:?}; pass the \
                     --model it was trained with, or drop --model to use its config.json",
                    path.display(),
                    tensor.name,
                    tensor.shape
                )));
            }
            flat[tensor.flat.clone()].copy_from_slice(values);
        }
        Ok(flat)
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_engine::LossScaler;
    use zeroflow_engine::checkpoint::{self, Meta, NamedTensor};
    use zeroflow_gpt::{GptConfig, flat_layout, hf_tensors, init_params};

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
        let imported = super::read(&first).unwrap().flat_weights(&spec, &layout, &named).unwrap();
        checkpoint::save(&second, &meta, &imported, &named, &[]).unwrap();
        let bytes = |dir: &std::path::Path| std::fs::read(dir.join("model.safetensors")).unwrap();
        assert_eq!(bytes(&first), bytes(&second));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
