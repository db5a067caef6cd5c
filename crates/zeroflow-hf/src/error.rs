//! What can be wrong with a Hugging Face model directory, read or written.

use std::path::PathBuf;

/// An error reading or writing a Hugging Face model directory. Every variant names the file (and
/// where it applies the tensor) so that a user can find what to fix.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not valid JSON ({reason})")]
    Json { path: PathBuf, reason: String },
    #[error(
        "{dir}: no weights: neither model.safetensors nor model.safetensors.index.json is \
         there{}",
        other_weights_hint(dir, other)
    )]
    NoWeights {
        dir: PathBuf,
        /// A weights file of PyTorch's pickle format found there instead (`pytorch_model.bin`).
        other: Option<String>,
    },
    #[error("{index}: {reason}")]
    BadIndex { index: PathBuf, reason: String },
    #[error("{index} lists the shard {shard}, which cannot be opened ({source})")]
    MissingShard {
        index: PathBuf,
        shard: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a safetensors file ({reason})")]
    BadSafetensors { path: PathBuf, reason: String },
    #[error("{index} puts {tensor} in {shard}, but {shard} has no such tensor")]
    TensorNotInShard { index: PathBuf, shard: String, tensor: String },
    #[error("{path}: tensor {tensor} is {dtype}; zeroflow reads BF16, F16 and F32 weights")]
    UnsupportedDtype { path: PathBuf, tensor: String, dtype: String },
    #[error("{path}: tensor {tensor} has shape {found:?}, the model expects {expected:?}")]
    ShapeMismatch { path: PathBuf, tensor: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{dir}: no tensor {tensor}")]
    NoSuchTensor { dir: PathBuf, tensor: String },
    #[error("{dir}: {}", names_message(missing, unexpected))]
    Names { dir: PathBuf, missing: Vec<String>, unexpected: Vec<String> },
    #[error("{dir}: exists and is not empty; choose a new directory")]
    OutputExists { dir: PathBuf },
    #[error("tensor {tensor}: shape {shape:?} holds {expected} elements, the data has {found}")]
    DataLength { tensor: String, shape: Vec<usize>, expected: usize, found: usize },
    #[error("tensor {tensor} is given twice")]
    DuplicateOutput { tensor: String },
    #[error("{path}: {reason}")]
    Serialize { path: PathBuf, reason: String },
}

/// What to do where a model directory holds its weights in a format zeroflow does not read.
fn other_weights_hint(dir: &std::path::Path, other: &Option<String>) -> String {
    match other {
        Some(file) => format!(
            "; its {file} is PyTorch's pickle format, which zeroflow does not read: write the \
             model as safetensors with `python -c \"from \
             transformers import AutoModelForCausalLM as M; \
             M.from_pretrained('{dir}').save_pretrained('{dir}-safetensors')\"` (and copy its \
             tokenizer files beside it), then use that directory",
            dir = dir.display()
        ),
        None => String::new(),
    }
}

fn names_message(missing: &[String], unexpected: &[String]) -> String {
    let list = |names: &[String]| {
        const SHOWN: usize = 20;
        let mut text = names.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
        if names.len() > SHOWN {
            text.push_str(&format!(" and {} more", names.len() - SHOWN));
        }
        text
    };
    match (missing.is_empty(), unexpected.is_empty()) {
        (false, true) => format!("missing tensors: {}", list(missing)),
        (true, false) => format!("unexpected tensors: {}", list(unexpected)),
        _ => {
            format!("missing tensors: {}; unexpected tensors: {}", list(missing), list(unexpected))
        }
    }
}

/// `map_err` helper: an I/O error at `path`.
pub(crate) fn io(path: &std::path::Path) -> impl Fn(std::io::Error) -> HfError + '_ {
    move |source| HfError::Io { path: path.to_path_buf(), source }
}
