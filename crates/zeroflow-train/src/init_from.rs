//! `--init-from`: the initial weights from a Hugging Face GPT-2 directory (`model.safetensors`,
//! and `config.json` for the model's shape), such as `zeroflow export` writes.

use std::path::{Path, PathBuf};

use zeroflow_engine::checkpoint::{self, NamedTensor, Tensors};
use zeroflow_gpt::GptConfig;

use crate::error::{Result, input};

/// A Hugging Face GPT-2 directory, read.
#[derive(Debug)]
pub struct HfModel {
    pub dir: PathBuf,
    /// The shape `config.json` gives, when there is one.
    pub config: Option<GptConfig>,
    /// Shape and elements by tensor name.
    tensors: Tensors<f32>,
}

const WHAT_TO_DO: &str = "--init-from needs a Hugging Face GPT-2 directory with an F32 \
                          model.safetensors (such as `zeroflow export` writes)";

/// Reads `dir/model.safetensors` (F32 tensors) and, where present, `dir/config.json`.
pub fn read(dir: &Path) -> Result<HfModel> {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path)
        .map_err(|e| input(format!("--init-from {}: {e}; {WHAT_TO_DO}", path.display())))?;
    let tensors = checkpoint::read_tensors::<f32>(&bytes, &path)
        .map_err(|e| input(format!("--init-from {e}; {WHAT_TO_DO}")))?;
    let config = read_config(dir)?;
    Ok(HfModel { dir: dir.to_path_buf(), config, tensors })
}

/// The model shape in `dir/config.json` (transformers' `GPT2Config` keys), if the file exists.
fn read_config(dir: &Path) -> Result<Option<GptConfig>> {
    let path = dir.join("config.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Ok(None) };
    let bad = |what: String| {
        input(format!(
            "--init-from {}: {what}; fix the file, or give the shape with --model",
            path.display()
        ))
    };
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON ({e})")))?;
    GptConfig::from_hf_config(&json).map(Some).map_err(|e| bad(e.to_string()))
}

impl HfModel {
    /// The flat weights (padding zero) of a model whose tensors are `tensors`. Names are looked up
    /// as given and without the `transformer.` prefix (the original OpenAI GPT-2 files omit it);
    /// every tensor must be there with the model's shape.
    pub fn flat_weights(&self, tensors: &[NamedTensor], padded_len: usize) -> Result<Vec<f32>> {
        let path = self.dir.join("model.safetensors");
        let mut flat = vec![0.0; padded_len];
        for tensor in tensors {
            let short = tensor.name.strip_prefix("transformer.").unwrap_or(&tensor.name);
            let (shape, values) =
                self.tensors.get(&tensor.name).or_else(|| self.tensors.get(short)).ok_or_else(
                    || {
                        input(format!(
                            "--init-from {}: it has no tensor {}; {WHAT_TO_DO}",
                            path.display(),
                            tensor.name
                        ))
                    },
                )?;
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
            params: Vec::new(),
            extra: serde_json::Value::Null,
        };
        let root = std::env::temp_dir().join(format!("zeroflow-init-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let (first, second) = (root.join("first"), root.join("second"));
        checkpoint::save(&first, &meta, &weights, &named, &[]).unwrap();
        let imported =
            super::read(&first).unwrap().flat_weights(&named, layout.padded_len()).unwrap();
        checkpoint::save(&second, &meta, &imported, &named, &[]).unwrap();
        let bytes = |dir: &std::path::Path| std::fs::read(dir.join("model.safetensors")).unwrap();
        assert_eq!(bytes(&first), bytes(&second));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
