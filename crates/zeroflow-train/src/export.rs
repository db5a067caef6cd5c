//! A checkpoint as a Hugging Face model directory that `transformers`' `from_pretrained` loads.
//! The checkpoint's `extra.model` says the family ([`ModelSpec`]), whose
//! [`Family::export`](crate::Family::export) writes the directory:
//!
//! - GPT-2: the checkpoint's `model.safetensors` already holds the weights under Hugging Face's
//!   names and shapes (the vocabulary padding dropped, `lm_head` tied to `wte`), so it is copied
//!   ([`copy_weights`]) beside the model's `config.json`.
//! - The Llama family: the weights ([`Checkpoint::weights`], in the checkpoint's type) written by
//!   `zeroflow_llama::save_hf_dir` (`config.json` of the same architecture, sharded above 5 GB
//!   with `model.safetensors.index.json`, in the checkpoint's dtype), with the tokenizer files of
//!   the run's `--init-from` directory where it had one.

use std::path::{Path, PathBuf};

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{DType, Float};
use zeroflow_engine::checkpoint::{self, CheckpointError, NamedTensor};

use crate::error::{Result, input, io};
use crate::{Family, ModelSpec, with_family};

/// A checkpoint to export, checked: its directory and what its `state.json` says.
#[derive(Debug)]
pub struct Checkpoint {
    pub dir: PathBuf,
    pub model: ModelSpec,
    /// A delayed optimizer step's weights were still on their way to the model when it was saved.
    pub upload_pending: bool,
    /// The element type of its `model.safetensors` (F32, BF16, F16).
    pub weights_dtype: DType,
    /// The Hugging Face directory the run started from (`--init-from`), where it had one.
    pub init_from: Option<PathBuf>,
}

/// Writes the checkpoint `dir` as a Hugging Face model directory `out` (which must not exist,
/// or be empty).
pub fn export(dir: &Path, out: &Path) -> Result<()> {
    let from = read_checkpoint(dir)?;
    if out.exists() && out.read_dir().map(|mut d| d.next().is_some()).unwrap_or(true) {
        return Err(input(format!(
            "{}: exists and is not empty; choose a new --out directory",
            out.display()
        )));
    }
    std::fs::create_dir_all(out).map_err(io(format!("create {}", out.display())))?;
    with_family!(&from.model, family => family.export(&from, out))
}

/// GPT-2's export: the checkpoint's `model.safetensors` copied (or, saved during a delayed
/// update, the optimizer's master weights written in its place) and `config` as `config.json`.
pub fn copy_weights(from: &Checkpoint, out: &Path, config: &serde_json::Value) -> Result<()> {
    let source = from.dir.join("model.safetensors");
    let to = out.join("model.safetensors");
    if from.upload_pending {
        // Export the run's final weights, not the saved model weights: the master weights,
        // rounded to the saved weights' type.
        let opened = from.open()?;
        match from.weights_dtype {
            DType::Bf16 => write_master::<zeroflow_core::bf16>(&opened, &to)?,
            DType::F16 => write_master::<zeroflow_core::f16>(&opened, &to)?,
            _ => write_master::<f32>(&opened, &to)?,
        }
    } else {
        let copying = format!("copy {} to {}", source.display(), to.display());
        std::fs::copy(&source, &to).map_err(io(copying))?;
    }
    let torch_dtype = from.weights_dtype.torch_name().expect("weights are floating-point");
    let config = zeroflow_hf::with_torch_dtype(config, torch_dtype);
    let path = out.join("config.json");
    let text = serde_json::to_string_pretty(&config).expect("JSON values serialise") + "\n";
    std::fs::write(&path, text).map_err(io(format!("write {}", path.display())))
}

/// The master weights of `opened` rounded to `P` (its `weights_dtype`), written as the model
/// file `to`.
fn write_master<P: checkpoint::Stored + zeroflow_core::Float>(
    opened: &checkpoint::Opened,
    to: &Path,
) -> Result<()> {
    let (weights, tensors) =
        checkpoint::weights_from_master::<P>(opened).map_err(|e| input(e.to_string()))?;
    let weights = checkpoint::Elements::lent(&weights);
    Ok(checkpoint::write_model(to, &opened.meta, &weights, &tensors)?)
}

impl Checkpoint {
    /// The checkpoint's weights (the optimizer's master weights when an update was pending,
    /// rounded) as `P` in the flat buffer of `layout`, every tensor of `tensors` there with its
    /// shape, read from the files a tensor (or a piece) at a time: as f32 exactly, or as the
    /// checkpoint's own type with no f32 copy of them.
    pub fn weights<P: checkpoint::Stored + Float>(
        &self,
        layout: &FlatLayout,
        tensors: &[NamedTensor],
    ) -> Result<Vec<P>> {
        let opened = self.open()?;
        let error = |e: CheckpointError| input(e.to_string());
        if !self.upload_pending {
            return opened.flat_weights(tensors, layout.padded_len()).map_err(error);
        }
        let (master, saved) = checkpoint::weights_from_master::<P>(&opened).map_err(error)?;
        let mut flat = vec![P::default(); layout.padded_len()];
        for tensor in tensors {
            let path = self.dir.join("model.safetensors");
            let found = saved.iter().find(|t| t.name == tensor.name).ok_or_else(|| {
                input(format!("{}: it has no tensor {}", path.display(), tensor.name))
            })?;
            if found.shape != tensor.shape {
                return Err(input(format!(
                    "{}: {} has shape {:?}, its model (state.json extra.model) {:?}",
                    path.display(),
                    tensor.name,
                    found.shape,
                    tensor.shape
                )));
            }
            flat[tensor.flat.clone()].copy_from_slice(&master[found.flat.clone()]);
        }
        Ok(flat)
    }

    /// The checkpoint, opened.
    fn open(&self) -> Result<checkpoint::Opened> {
        checkpoint::open(&self.dir).map_err(|e| input(e.to_string()))
    }
}

/// Checks the checkpoint (`checkpoint::open`: every file's header against the file, dtypes
/// agree) and reads its model (a bare
/// shape, from before the family was recorded, is GPT-2's), whether a delayed update's weights
/// were pending when it was saved, and the run's `--init-from`.
pub(crate) fn read_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let checkpoint::Opened { meta, weights_dtype, .. } =
        checkpoint::open(dir).map_err(|e| input(e.to_string()))?;
    let model = meta.extra.get("model").cloned().ok_or_else(|| {
        input(format!(
            "{}: the checkpoint does not record its model's shape (state.json extra.model)",
            dir.display()
        ))
    })?;
    let model = ModelSpec::from_json(model)
        .map_err(|e| input(format!("{}: extra.model in state.json: {e}", dir.display())))?;
    let init_from =
        meta.extra.pointer("/run/init_from").and_then(|v| v.as_str()).map(PathBuf::from);
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        model,
        upload_pending: meta.upload_pending,
        weights_dtype,
        init_from,
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};

    use zeroflow_core::bf16;
    use zeroflow_engine::OptimizerPart;
    use zeroflow_engine::checkpoint::{Meta, ParamEntry, Stored, save};
    use zeroflow_gpt::GptConfig;
    use zeroflow_hf::HfCheckpoint;

    use super::export;
    use crate::{Family, ModelSpec, with_family};

    /// A Llama-family model small enough for a test: 2 layers, grouped-query attention.
    pub(crate) fn tiny_llama() -> zeroflow_llama::LlamaConfig {
        zeroflow_llama::LlamaConfig {
            vocab_size: 50,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            max_position_embeddings: 32,
            rope_scaling: None,
            ..zeroflow_llama::named_shape("llama-1b").expect("a named shape")
        }
    }

    /// Writes checkpoint `step` of `spec` into the run directory `run` as `zeroflow train` does:
    /// `weights` as the run's weights in their own type, and, where `master` is given, one
    /// optimizer part with those master weights (zero moments) and `upload_pending` (a delayed
    /// update's weights not yet on the device); `init_from` recorded as the run's `--init-from`.
    /// The checkpoint's directory.
    pub(crate) fn save_checkpoint<P: Stored>(
        run: &Path,
        step: u64,
        spec: &ModelSpec,
        weights: &[P],
        master: Option<&[f32]>,
        init_from: Option<&Path>,
    ) -> PathBuf {
        let layout = spec.flat_layout(1).unwrap();
        let tensors = spec.tensors(&layout).unwrap();
        let params = tensors
            .iter()
            .map(|t| ParamEntry {
                name: t.name.clone(),
                shape: t.shape.clone(),
                offset: t.flat.start,
            })
            .collect();
        let meta = Meta {
            format: zeroflow_engine::checkpoint::FORMAT.into(),
            version: zeroflow_engine::checkpoint::VERSION,
            optimizer_steps: step,
            micro_steps: step,
            world_size: usize::from(master.is_some()),
            scaler: zeroflow_engine::LossScaler::None,
            upload_pending: master.is_some(),
            weights_dtype: P::DTYPE.name().into(),
            optimizer_state_dtype: "fp32".into(),
            params,
            extra: serde_json::json!({
                "model": serde_json::to_value(spec).unwrap(),
                "run": { "init_from": init_from.map(|d| d.to_str().unwrap()) },
            }),
        };
        let parts: Vec<OptimizerPart> = master
            .map(|master| OptimizerPart {
                flat: 0..master.len(),
                master: master.to_vec(),
                exp_avg: vec![0.0; master.len()],
                exp_avg_sq: vec![0.0; master.len()],
                moments: zeroflow_core::adamw::OptimizerStateDtype::Fp32,
            })
            .into_iter()
            .collect();
        let dir = crate::checkpoints::step_dir(run, step);
        std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
        save(&dir, &meta, weights, &tensors, &parts).unwrap();
        dir
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("zeroflow-export-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// A checkpoint of a GPU run holds its weights as bf16, and exports them as bf16, bit for
    /// bit, in both families; one saved while a delayed update's weights were on their way
    /// exports its master weights rounded to bf16 (as the device would have had them).
    #[test]
    fn a_bf16_checkpoint_exports_bf16_weights_or_its_rounded_master() {
        let specs = [
            ModelSpec::Gpt2(GptConfig { vocab_size: 61, ..GptConfig::TINY }),
            ModelSpec::Llama(crate::llama::LlamaSpec(tiny_llama())),
        ];
        for spec in specs {
            let layout = spec.flat_layout(1).unwrap();
            let tensors = spec.tensors(&layout).unwrap();
            let mut init = vec![0.0f32; layout.padded_len()];
            with_family!(&spec, family => family.init(&layout, 5, &mut init)).unwrap();
            let weights: Vec<bf16> = init.iter().map(|&w| bf16::from_f32(w)).collect();
            // Master weights between bf16 values: the pending weights are their rounding.
            let master: Vec<f32> = init.iter().map(|&w| w * 1.001 + 1e-4).collect();
            for pending in [false, true] {
                let family = with_family!(&spec, family => family.family_name());
                let root = scratch(&format!("{family}-{pending}"));
                let pending_master = pending.then_some(&master[..]);
                let dir =
                    save_checkpoint(&root.join("run"), 3, &spec, &weights, pending_master, None);
                export(&dir, &root.join("hf")).unwrap();
                let hf = HfCheckpoint::open(&root.join("hf")).unwrap();
                let torch_dtype = hf.config().and_then(|c| c["torch_dtype"].as_str());
                assert_eq!(torch_dtype, Some("bfloat16"), "{family}");
                for tensor in &tensors {
                    let entry = hf.tensor(&tensor.name).unwrap();
                    assert_eq!(entry.dtype, zeroflow_hf::Dtype::BF16, "{}", tensor.name);
                    let want: Vec<f32> = match pending {
                        false => weights[tensor.flat.clone()].iter().map(|w| w.to_f32()).collect(),
                        true => master[tensor.flat.clone()]
                            .iter()
                            .map(|&m| bf16::from_f32(m).to_f32())
                            .collect(),
                    };
                    assert_eq!(hf.read_f32(&tensor.name).unwrap(), want, "{}", tensor.name);
                }
                let _ = std::fs::remove_dir_all(&root);
            }
        }
    }
}
