//! A model's weights as a Hugging Face model directory that `transformers`' `from_pretrained`
//! loads, for every family alike ([`write_hf_dir`]): the family's `config.json`
//! ([`Family::hf_config`]), the tensors of its checkpoint (Hugging Face's names and shapes over
//! the flat weights, [`Family::tensors`]) in the weights' own type, sharded above 5 GB as
//! `save_pretrained` shards them, and the tokenizer files of the run's `--init-from` directory
//! where it had one, with the run's `--chat-template` where it gave one ([`ExportTokenizer`]). The
//! weights are fetched a piece at a time as they are written, from wherever they are:
//!
//! - `zeroflow export` ([`export`]): from a checkpoint's `model.safetensors` (or, saved while a
//!   delayed update's weights were on their way, its master weights rounded to the weights' type);
//! - `zeroflow train --export` (the trainer, at the end of the run): from the device.

use std::path::{Path, PathBuf};

use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{DType, Float, bf16, f16};
use zeroflow_engine::checkpoint::{self, CheckpointError, Elements, NamedTensor, Stored};
use zeroflow_hf::{DEFAULT_MAX_SHARD_BYTES, DirLayout, HfError, Saved, TokenizerSource};

use crate::error::{Result, TrainError, input};
use crate::weight_files::FileParams;
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
    /// The chat template file the run trained with (`--chat-template`), where it gave one.
    pub chat_template: Option<PathBuf>,
    /// The template's variables the run trained with (`--chat-template-kwargs`).
    pub chat_template_kwargs: zeroflow_data::TemplateVariables,
    /// The sequence length the run trained on (`--seq`; absent in checkpoints from before it
    /// was kept).
    pub seq: Option<usize>,
    /// Whether the run packed its rows (`--pack`): its evaluations attended within documents.
    pub packed: bool,
}

/// Writes the checkpoint `dir` as a Hugging Face model directory `out` (which must not exist,
/// or be empty), in the type of its weights.
pub fn export(dir: &Path, out: &Path) -> Result<Saved> {
    let from = read_checkpoint(dir)?;
    check_dir(out, 0).map_err(|reason| input(format!("{}: {reason}", out.display())))?;
    let template = (from.chat_template.as_deref(), &from.chat_template_kwargs);
    let tokenizer = ExportTokenizer::of_run(from.init_from.as_deref(), template);
    let tokenizer_from = tokenizer.source();
    with_family!(&from.model, family => {
        let layout = family.flat_layout(1)?;
        let tensors = family.tensors(&layout)?;
        let config = family.hf_config();
        let out = (out, &config, &tensors[..], tokenizer_from);
        match from.weights_dtype {
            DType::Bf16 => from.write_hf_dir::<bf16>(&layout, out),
            DType::F16 => from.write_hf_dir::<f16>(&layout, out),
            _ => from.write_hf_dir::<f32>(&layout, out),
        }
    })
}

/// The checkpoint `dir` names: itself where it has `state.json`, else its newest checkpoint where
/// it is a run directory (`checkpoints/step-N`); an input error saying what it may be otherwise.
pub fn checkpoint_in(dir: &Path) -> Result<PathBuf> {
    if dir.join("state.json").is_file() {
        return Ok(dir.to_path_buf());
    }
    match crate::checkpoints::list(dir).map_err(TrainError::model)?.pop() {
        Some((_, newest)) => Ok(newest),
        None => Err(input(format!(
            "{}: {}; give a checkpoint (<run>/checkpoints/step-N, with state.json) or a run \
             directory (its newest checkpoint)",
            dir.display(),
            if dir.is_dir() { "holds no checkpoint" } else { "no such directory" }
        ))),
    }
}

/// Why `dir` cannot take a new Hugging Face directory whose weights take `bytes`: it holds
/// anything, or its file system has fewer bytes free (said before anything is written).
pub fn check_dir(dir: &Path, bytes: u64) -> std::result::Result<(), String> {
    let empty = !dir.exists() || dir.read_dir().map(|mut d| d.next().is_none()).unwrap_or(false);
    if !empty {
        return Err("exists and is not empty; choose a new directory".into());
    }
    match checkpoint::free_bytes(dir) {
        Some(free) if free < bytes => Err(format!(
            "not enough disk space for the Hugging Face directory: its weights take {} and {} \
             are free there (nothing was written); free some space or choose a directory on a \
             larger disk",
            checkpoint::disk_size(bytes),
            checkpoint::disk_size(free)
        )),
        _ => Ok(()),
    }
}

/// The tokenizer files an export writes: those of the run's `--init-from` directory, where it
/// still is, and the chat template the run trained with (`--chat-template`), where it gave one
/// and the file is still there — so that the exported model is prompted as it was trained — with
/// the token that ends a reply in that template (or the directory's own) among the generation
/// config's end-of-text ids, so that it stops where it was trained to.
#[derive(Debug, Default)]
pub struct ExportTokenizer {
    dir: Option<PathBuf>,
    chat_template: Option<String>,
    turn_end: Option<u32>,
}

impl ExportTokenizer {
    /// What the export of a run that started from `init_from` and trained with the template
    /// file `chat_template` (else the tokenizer's own) and its variables writes; a warning for
    /// either file where it cannot be read now.
    pub fn of_run(
        init_from: Option<&Path>,
        (chat_template, variables): (Option<&Path>, &zeroflow_data::TemplateVariables),
    ) -> ExportTokenizer {
        if let Some(dir) = init_from.filter(|dir| !dir.is_dir()) {
            tracing::warn!(
                "the run's --init-from {} is gone: exporting without its tokenizer files",
                dir.display()
            );
        }
        let dir = init_from.filter(|dir| dir.is_dir()).map(Path::to_path_buf);
        let chat_template = chat_template.and_then(|file| match std::fs::read_to_string(file) {
            Ok(text) => Some(text),
            Err(error) => {
                tracing::warn!(
                    "the run's --chat-template {} cannot be read ({error}): the exported \
                     directory has its tokenizer's own chat template, not the one the run \
                     trained with; copy that template into it as {}",
                    file.display(),
                    zeroflow_hf::CHAT_TEMPLATE_FILE
                );
                None
            }
        });
        let turn_end =
            dir.as_deref().and_then(|dir| turn_end(dir, chat_template.as_deref(), variables));
        ExportTokenizer { dir, chat_template, turn_end }
    }

    /// As [`write_hf_dir`] takes it.
    pub fn source(&self) -> TokenizerSource<'_> {
        TokenizerSource {
            dir: self.dir.as_deref(),
            chat_template: self.chat_template.as_deref(),
            turn_end: self.turn_end,
        }
    }
}

/// The token that ends a reply in `template` (else the chat template of the tokenizer of `dir`)
/// with the run's `variables` where it has one ([`zeroflow_data::ChatTemplate::turn_end`]), said.
fn turn_end(
    dir: &Path,
    template: Option<&str>,
    variables: &zeroflow_data::TemplateVariables,
) -> Option<u32> {
    let tokenizer = zeroflow_data::Tokenizer::of_dir(dir).ok().flatten()?;
    let template = match template {
        Some(text) => zeroflow_data::ChatTemplate::new(text, "--chat-template").ok()?,
        None => zeroflow_data::ChatTemplate::from_config(tokenizer.config())?.ok()?,
    };
    let template = template.with_variables(variables.clone()).ok()?;
    let id = template.turn_end(&tokenizer)?;
    let token = tokenizer.decode(&[id]).unwrap_or_default();
    tracing::info!(
        "the chat template ends a reply with {token} ({id}): among the end-of-text ids of the \
         exported {}, so that generation stops there",
        zeroflow_hf::GENERATION_CONFIG_FILE
    );
    Some(id)
}

/// Writes the flat weights `weights` (`P`: the run's type) of a model whose `config.json` is
/// `config` and whose tensors are `tensors` as the Hugging Face directory `out` (which must not
/// exist or be empty; it appears whole or not at all), with the tokenizer files of
/// `tokenizer_from` ([`ExportTokenizer`]); the weights are fetched a piece at a time as they are
/// written.
pub fn write_hf_dir<P: Stored>(
    out: &Path,
    config: &serde_json::Value,
    weights: &Elements<'_, P>,
    tensors: &[NamedTensor],
    tokenizer_from: TokenizerSource<'_>,
) -> Result<Saved> {
    let torch_dtype = P::DTYPE.torch_name().expect("weights are floating-point");
    let layout = DirLayout {
        torch_dtype,
        max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        tokenizer: tokenizer_from,
    };
    let sizes: Vec<(&str, u64)> =
        tensors.iter().map(|t| (t.name.as_str(), (t.flat.len() * size_of::<P>()) as u64)).collect();
    let needed = sizes.iter().map(|&(_, bytes)| bytes).sum();
    check_dir(out, needed).map_err(|reason| input(format!("{}: {reason}", out.display())))?;
    let saved = zeroflow_hf::save_with(out, config, &sizes, &layout, |path, shard| {
        checkpoint::write_hf_weights(path, weights, &tensors[shard])
            .map_err(|e| HfError::Serialize { path: path.to_path_buf(), reason: e.to_string() })
    });
    saved.map_err(|e| input(e.to_string()))
}

impl Checkpoint {
    /// [`write_hf_dir`] of the checkpoint's weights as `P` (its own type) in `layout`: read from
    /// its file a piece at a time as they are written (where an update was pending: its master
    /// weights, rounded).
    fn write_hf_dir<P: Stored + Float>(
        &self,
        layout: &FlatLayout,
        (out, config, tensors, tokenizer_from): (
            &Path,
            &serde_json::Value,
            &[NamedTensor],
            TokenizerSource<'_>,
        ),
    ) -> Result<Saved> {
        if self.upload_pending {
            // The master weights rounded, in one copy: each tensor written from its place there.
            let (master, saved) = checkpoint::weights_from_master::<P>(&self.open()?)
                .map_err(|e| input(e.to_string()))?;
            let placed = self.placed(tensors, &saved)?;
            return write_hf_dir(out, config, &Elements::lent(&master), &placed, tokenizer_from);
        }
        let files = self.weight_files(tensors, layout.padded_len())?;
        let weights = Elements::fetched(layout.padded_len(), |range| {
            let mut values = vec![P::default(); range.len()];
            files.read(range, &mut values).map_err(|e| e.to_string())?;
            Ok(values)
        });
        write_hf_dir(out, config, &weights, tensors, tokenizer_from)
    }

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
        for (tensor, found) in tensors.iter().zip(self.placed(tensors, &saved)?) {
            flat[tensor.flat.clone()].copy_from_slice(&master[found.flat]);
        }
        Ok(flat)
    }

    /// `tensors` (the model's) where the checkpoint's `saved` tensors lie: each found by name
    /// with the model's shape, else an input error naming it.
    fn placed(&self, tensors: &[NamedTensor], saved: &[NamedTensor]) -> Result<Vec<NamedTensor>> {
        let path = self.dir.join("model.safetensors");
        tensors
            .iter()
            .map(|tensor| {
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
                Ok(found.clone())
            })
            .collect()
    }

    /// The checkpoint's weights left in its `model.safetensors` ([`FileParams`]), its tensors
    /// (the model's `tensors` in a flat buffer of `len`) checked there.
    pub(crate) fn weight_files(&self, tensors: &[NamedTensor], len: usize) -> Result<FileParams> {
        let opened = self.open()?;
        opened.check_tensors(tensors).map_err(|e| input(e.to_string()))?;
        let stored = tensors.iter().map(|t| (t.name.clone(), t.flat.clone())).collect();
        Ok(FileParams::of_file(opened.model, stored, len))
    }

    /// The checkpoint, opened.
    fn open(&self) -> Result<checkpoint::Opened> {
        checkpoint::open(&self.dir).map_err(|e| input(e.to_string()))
    }
}

/// Checks the checkpoint (`checkpoint::open`: every file's header against the file, dtypes
/// agree) and reads its model (a bare
/// shape, from before the family was recorded, is GPT-2's), whether a delayed update's weights
/// were pending when it was saved, and the run's `--init-from` and `--chat-template`.
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
    let path_at = |pointer| meta.extra.pointer(pointer).and_then(|v| v.as_str()).map(PathBuf::from);
    let (init_from, chat_template) = (path_at("/run/init_from"), path_at("/chat_template"));
    let kwargs = meta.extra.get("chat_template_kwargs").cloned();
    let chat_template_kwargs = kwargs.and_then(|k| serde_json::from_value(k).ok());
    Ok(Checkpoint {
        dir: dir.to_path_buf(),
        model,
        upload_pending: meta.upload_pending,
        weights_dtype,
        init_from,
        chat_template,
        chat_template_kwargs: chat_template_kwargs.unwrap_or_default(),
        seq: meta.extra.get("seq").and_then(serde_json::Value::as_u64).map(|seq| seq as usize),
        packed: meta.extra.get("settings").is_some_and(crate::settings::packed_in),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::{Path, PathBuf};

    use zeroflow_core::{Float, bf16};
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

    /// A checkpoint of a GPU run holds its weights as bf16 (or f16), and exports them in that
    /// type, bit for bit, in both families; one saved while a delayed update's weights were on
    /// their way exports its master weights rounded to it (as the device would have had them).
    #[test]
    fn a_16_bit_checkpoint_exports_its_weights_or_its_rounded_master_in_their_type() {
        exports_in_their_type::<bf16>("bfloat16", zeroflow_hf::Dtype::BF16);
        exports_in_their_type::<zeroflow_core::f16>("float16", zeroflow_hf::Dtype::F16);
    }

    /// An export to a disk with less room than the weights take is refused before anything is
    /// written, saying both sizes.
    #[test]
    fn an_export_that_does_not_fit_the_disk_is_refused_whole() {
        let spec = ModelSpec::Llama(crate::llama::LlamaSpec(tiny_llama()));
        let layout = spec.flat_layout(1).unwrap();
        let weights = vec![bf16::from_f32(0.5); layout.padded_len()];
        let root = scratch("no-room");
        let dir = save_checkpoint(&root.join("run"), 1, &spec, &weights, None, None);
        zeroflow_engine::checkpoint::pretend_free(Some(1000));
        let refused = export(&dir, &root.join("hf"));
        zeroflow_engine::checkpoint::pretend_free(None);
        let message = refused.unwrap_err().to_string();
        for said in ["not enough disk space for the Hugging Face directory", "1.0 kB are free"] {
            assert!(message.contains(said), "{said:?} not in: {message}");
        }
        assert!(!root.join("hf").exists());
        let _ = std::fs::remove_dir_all(&root);
    }

    fn exports_in_their_type<P: Stored + Float>(torch: &str, dtype: zeroflow_hf::Dtype) {
        let specs = [
            ModelSpec::Gpt2(GptConfig { vocab_size: 61, ..GptConfig::TINY }),
            ModelSpec::Llama(crate::llama::LlamaSpec(tiny_llama())),
        ];
        for spec in specs {
            let layout = spec.flat_layout(1).unwrap();
            let tensors = spec.tensors(&layout).unwrap();
            let mut init = vec![0.0f32; layout.padded_len()];
            with_family!(&spec, family => family.init(&layout, 5, &mut init)).unwrap();
            let weights: Vec<P> = init.iter().map(|&w| P::from_f32(w)).collect();
            // Master weights between 16-bit values: the pending weights are their rounding.
            let master: Vec<f32> = init.iter().map(|&w| w * 1.001 + 1e-4).collect();
            for pending in [false, true] {
                let family = with_family!(&spec, family => family.family_name());
                let root = scratch(&format!("{family}-{torch}-{pending}"));
                let pending_master = pending.then_some(&master[..]);
                let dir =
                    save_checkpoint(&root.join("run"), 3, &spec, &weights, pending_master, None);
                export(&dir, &root.join("hf")).unwrap();
                let hf = HfCheckpoint::open(&root.join("hf")).unwrap();
                let torch_dtype = hf.config().and_then(|c| c["torch_dtype"].as_str());
                assert_eq!(torch_dtype, Some(torch), "{family}");
                for tensor in &tensors {
                    let entry = hf.tensor(&tensor.name).unwrap();
                    assert_eq!(entry.dtype, dtype, "{}", tensor.name);
                    let want: Vec<f32> = match pending {
                        false => weights[tensor.flat.clone()].iter().map(|w| w.to_f32()).collect(),
                        true => master[tensor.flat.clone()]
                            .iter()
                            .map(|&m| P::from_f32(m).to_f32())
                            .collect(),
                    };
                    assert_eq!(hf.read_f32(&tensor.name).unwrap(), want, "{}", tensor.name);
                }
                let _ = std::fs::remove_dir_all(&root);
            }
        }
    }
}
