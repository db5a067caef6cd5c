//! Hugging Face directories of the Llama family in and out, through `zeroflow-hf`: a directory's
//! `config.json` and weights (one `model.safetensors` or the shards of its index; BF16, F16 or
//! F32) read by name into the flat parameter buffer, and the flat buffer written back as a
//! directory that `transformers` loads (the same architecture's `config.json`, the weights, the
//! tokenizer files of a source directory).

use std::path::Path;

use zeroflow_core::Float;
use zeroflow_core::layout::{FlatLayout, ranges_mut};
use zeroflow_hf::{CONFIG_FILE, HfCheckpoint, OutTensor, SaveOptions, Saved};

use crate::config::LlamaConfig;
use crate::error::LlamaError;
use crate::params::hf_params;
use crate::ranges::ParamRanges;

/// A Hugging Face directory of the Llama family, opened: its configuration, and its weights
/// checked against the family's names and shapes (only the headers are read).
#[derive(Debug)]
pub struct HfLlama {
    pub config: LlamaConfig,
    pub checkpoint: HfCheckpoint,
}

/// Tensors a directory may hold that the model does not read: old files' rotary buffers, and a
/// tied model's `lm_head.weight` (`transformers` ties it to the embedding on load).
fn ignored(config: &LlamaConfig, name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
        || (config.tie_word_embeddings && name == "lm_head.weight")
}

impl HfLlama {
    /// Opens `dir`: its `config.json` (an error names the file and the field) and its weights
    /// (every parameter there with its shape and a dtype zeroflow reads, no tensor the model does
    /// not know; an error names the file and the tensor).
    pub fn open(dir: &Path) -> Result<HfLlama, LlamaError> {
        let checkpoint = HfCheckpoint::open(dir)?;
        let json =
            checkpoint.config().ok_or_else(|| LlamaError::NoConfig { dir: dir.to_path_buf() })?;
        let config = LlamaConfig::from_hf_config(json)
            .map_err(|error| LlamaError::ConfigFile { path: dir.join(CONFIG_FILE), error })?;
        let params = hf_params(&config);
        let expected = params.iter().map(|p| (p.name.as_str(), p.shape.as_slice()));
        checkpoint.check(expected, |name| ignored(&config, name))?;
        Ok(HfLlama { config, checkpoint })
    }

    /// Reads every parameter into its range of the flat buffer `params` of `layout` (converted
    /// to `T` through f32); the padding is left as it is.
    pub fn read_params<T: Float>(
        &self,
        layout: &FlatLayout,
        params: &mut [T],
    ) -> Result<(), LlamaError> {
        check_buffer(layout, params.len())?;
        let ranges = self.stored_ranges(layout)?;
        let spans: Vec<_> = ranges.iter().map(|(_, _, range)| range.clone()).collect();
        let outs = ranges_mut(params, &spans).expect("a layout's parameters do not overlap");
        let wanted =
            ranges.iter().zip(outs).map(|((name, shape, _), out)| (&name[..], &shape[..], out));
        self.checkpoint.read_tensors_into(wanted.collect())?;
        Ok(())
    }

    /// Each tensor's name in this directory's files, its shape and its range of the flat buffer
    /// of `layout`, to read a piece at a time (`zeroflow_hf::SafetensorsFile::read_range`).
    pub fn stored_ranges(
        &self,
        layout: &FlatLayout,
    ) -> Result<Vec<zeroflow_hf::StoredRange>, LlamaError> {
        ParamRanges::new(&self.config, layout)?;
        Ok(hf_params(&self.config)
            .into_iter()
            .map(|p| {
                let range =
                    layout.param(&p.name).expect("checked by ParamRanges::new").flat_range();
                (p.name, p.shape, range)
            })
            .collect())
    }
}

/// Writes the model `config` whose flat parameters `params` lie in `layout` as the Hugging Face
/// directory `dir` (which must not exist or be empty): `config.json` of the same architecture,
/// the weights in `options`' dtype, and `options`' tokenizer files.
pub fn save_hf_dir<T: Float>(
    dir: &Path,
    config: &LlamaConfig,
    layout: &FlatLayout,
    params: &[T],
    options: &SaveOptions,
) -> Result<Saved, LlamaError> {
    check_buffer(layout, params.len())?;
    ParamRanges::new(config, layout)?;
    let specs = hf_params(config);
    let tensors: Vec<OutTensor<'_, T>> = specs
        .iter()
        .map(|p| {
            let range = layout.param(&p.name).expect("checked by ParamRanges::new").flat_range();
            OutTensor { name: &p.name, shape: &p.shape, values: &params[range] }
        })
        .collect();
    Ok(zeroflow_hf::save(dir, &config.to_hf_config(), &tensors, options)?)
}

fn check_buffer(layout: &FlatLayout, found: usize) -> Result<(), LlamaError> {
    if found != layout.padded_len() {
        let expected = layout.padded_len();
        return Err(LlamaError::Length { what: "flat parameter buffer", expected, found });
    }
    Ok(())
}
