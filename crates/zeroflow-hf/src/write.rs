//! Writing a Hugging Face model directory that `transformers` loads: `config.json`, the weights
//! as one `model.safetensors` or, above a size, as `model-0000N-of-0000M.safetensors` shards with
//! `model.safetensors.index.json`, in BF16 or F32, and the tokenizer files of a source directory
//! (with the chat template the model was trained with, where that was another).
//!
//! The directory appears whole or not at all: everything is written (and fsynced) into a
//! temporary sibling directory that is then renamed.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File};
use std::ops::Range;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::View;
use serde_json::Value;
use zeroflow_core::Float;

use crate::error::{HfError, io};
use crate::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE};

/// `transformers`' default `max_shard_size` ("5GB", decimal).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The tokenizer and generation files copied from the source directory, when present, with
/// every file of its [`CHAT_TEMPLATES_DIR`].
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    CHAT_TEMPLATE_FILE,
    "chat_template.json",
    GENERATION_CONFIG_FILE,
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
];

/// The chat template as a file of its own, as `transformers` 5 saves it (and nowhere else):
/// read before `tokenizer_config.json`'s `chat_template`.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The folder of a tokenizer's named chat templates besides the default (`tool_use.jinja`, …).
pub const CHAT_TEMPLATES_DIR: &str = "additional_chat_templates";

/// Where a written directory's tokenizer files come from: the [`TOKENIZER_FILES`] of a model
/// directory, and the chat template the model was trained with where that was not the
/// directory's own. The template is written as [`CHAT_TEMPLATE_FILE`] and replaces the default
/// one of a copied `tokenizer_config.json` (and `chat_template.json`), so that a reader of
/// either finds it. `turn_end`, the token that ends a reply in that template, is added to
/// `generation_config.json`'s `eos_token_id` where it is not among them (the file made from
/// `config.json`'s token ids where the source has none), so that generation stops there.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenizerSource<'a> {
    pub dir: Option<&'a Path>,
    pub chat_template: Option<&'a str>,
    pub turn_end: Option<u32>,
}

/// The dtype the weights are written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SaveDtype {
    Bf16,
    F32,
}

impl SaveDtype {
    /// The name `config.json`'s `torch_dtype` gives it.
    pub fn torch_name(self) -> &'static str {
        match self {
            SaveDtype::Bf16 => "bfloat16",
            SaveDtype::F32 => "float32",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            SaveDtype::Bf16 => Dtype::BF16,
            SaveDtype::F32 => Dtype::F32,
        }
    }

    fn bytes(self) -> usize {
        match self {
            SaveDtype::Bf16 => 2,
            SaveDtype::F32 => 4,
        }
    }
}

/// How [`save`] writes a directory.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    pub dtype: SaveDtype,
    /// Shards hold at most this many bytes of tensor data (a tensor larger than that is a shard
    /// of its own); one shard is written as `model.safetensors` without an index.
    pub max_shard_bytes: u64,
    /// The directory whose [`TOKENIZER_FILES`] are copied.
    pub tokenizer_from: Option<PathBuf>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            dtype: SaveDtype::Bf16,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            tokenizer_from: None,
        }
    }
}

/// One tensor to write: HF name, shape, and its row-major elements (f32, or a run's own bf16 or
/// f16: each written through f32, so a bf16 tensor written as BF16 keeps its bits).
#[derive(Clone, Copy, Debug)]
pub struct OutTensor<'a, T = f32> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub values: &'a [T],
}

/// What [`save`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Saved {
    /// The weight files, in order.
    pub weight_files: Vec<String>,
    /// Bytes of tensor data in all of them (the index's `metadata.total_size`).
    pub total_size: u64,
    /// The tokenizer files copied.
    pub tokenizer_files: Vec<String>,
}

/// Writes `tensors` and `config` (its `torch_dtype`, and `dtype` where it has one, set to the
/// written dtype) as the Hugging Face model directory `dir`, which must not exist or be empty.
pub fn save<T: Float>(
    dir: &Path,
    config: &Value,
    tensors: &[OutTensor<'_, T>],
    options: &SaveOptions,
) -> Result<Saved, HfError> {
    check_tensors(tensors)?;
    let dtype = options.dtype;
    let sizes: Vec<(&str, u64)> =
        tensors.iter().map(|t| (t.name, (t.values.len() * dtype.bytes()) as u64)).collect();
    let layout = DirLayout {
        torch_dtype: dtype.torch_name(),
        max_shard_bytes: options.max_shard_bytes,
        tokenizer: TokenizerSource { dir: options.tokenizer_from.as_deref(), ..Default::default() },
    };
    save_with(dir, config, &sizes, &layout, |path, shard| {
        let views = tensors[shard].iter().map(|t| (t.name, Encoded { dtype, tensor: *t }));
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(metadata), path)
            .map_err(|e| HfError::Serialize { path: path.to_path_buf(), reason: e.to_string() })
    })
}

/// How [`save_with`] lays out a directory: the weights' type as `config.json`'s `torch_dtype`
/// names it, the most bytes of a shard ([`SaveOptions::max_shard_bytes`]), and the directory
/// and chat template the directory gets.
#[derive(Clone, Copy, Debug)]
pub struct DirLayout<'a> {
    pub torch_dtype: &'a str,
    pub max_shard_bytes: u64,
    pub tokenizer: TokenizerSource<'a>,
}

/// Writes the Hugging Face model directory `dir` (which must not exist or be empty) of tensors
/// of the names and byte sizes `sizes`, in their order, `write` writing each weight file: a
/// path and the range of `sizes` whose tensors it holds (in safetensors, `"format": "pt"` in
/// its metadata). [`save`] writes tensors held in memory; a caller may write them from wherever
/// they are (a device, another file), a piece at a time. `config` gets `layout`'s
/// `torch_dtype`; shards of at most `layout.max_shard_bytes` get the index; the tokenizer files
/// are copied. The directory appears whole or not at all: everything is written (and fsynced)
/// into a temporary sibling directory that is then renamed.
pub fn save_with(
    dir: &Path,
    config: &Value,
    sizes: &[(&str, u64)],
    layout: &DirLayout<'_>,
    write: impl FnMut(&Path, Range<usize>) -> Result<(), HfError>,
) -> Result<Saved, HfError> {
    if dir.exists() && fs::read_dir(dir).map_err(io(dir))?.next().is_some() {
        return Err(HfError::OutputExists { dir: dir.to_path_buf() });
    }
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("model");
    let temp = dir.with_file_name(format!(".{name}.partial-{}", std::process::id()));
    if temp.exists() {
        fs::remove_dir_all(&temp).map_err(io(&temp))?;
    }
    fs::create_dir_all(&temp).map_err(io(&temp))?;
    let saved = write_into(&temp, config, sizes, layout, write);
    if saved.is_err() {
        // A half-written directory only takes space: the error says what went wrong.
        let _ = fs::remove_dir_all(&temp);
    }
    let saved = saved?;
    sync(&temp)?;
    if dir.exists() {
        fs::remove_dir(dir).map_err(io(dir))?;
    }
    fs::rename(&temp, dir).map_err(io(dir))?;
    let parent = dir.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    sync(parent)?;
    Ok(saved)
}

fn check_tensors<T>(tensors: &[OutTensor<'_, T>]) -> Result<(), HfError> {
    let mut seen = HashSet::new();
    for t in tensors {
        let expected: usize = t.shape.iter().product();
        if t.values.len() != expected {
            return Err(HfError::DataLength {
                tensor: t.name.to_string(),
                shape: t.shape.to_vec(),
                expected,
                found: t.values.len(),
            });
        }
        if !seen.insert(t.name) {
            return Err(HfError::DuplicateOutput { tensor: t.name.to_string() });
        }
    }
    Ok(())
}

fn write_into(
    dir: &Path,
    config: &Value,
    sizes: &[(&str, u64)],
    layout: &DirLayout<'_>,
    mut write: impl FnMut(&Path, Range<usize>) -> Result<(), HfError>,
) -> Result<Saved, HfError> {
    let bytes: Vec<u64> = sizes.iter().map(|&(_, size)| size).collect();
    let shards = plan_shards(&bytes, layout.max_shard_bytes);
    let files: Vec<String> = if shards.len() == 1 {
        vec![SINGLE_FILE.to_string()]
    } else {
        (1..=shards.len())
            .map(|i| format!("model-{i:05}-of-{:05}.safetensors", shards.len()))
            .collect()
    };
    let config_path = dir.join(CONFIG_FILE);
    write_json(&config_path, &with_torch_dtype(config, layout.torch_dtype))?;
    // Weight files may be created readable by the owner only (safetensors' writer: a temporary
    // file renamed); they get the permissions an ordinary new file gets, config.json's.
    let permissions = fs::metadata(&config_path).map_err(io(&config_path))?.permissions();
    let mut weight_map = BTreeMap::new();
    for (file, range) in files.iter().zip(&shards) {
        let path = dir.join(file);
        write(&path, range.clone())?;
        for &(name, _) in &sizes[range.clone()] {
            weight_map.insert(name.to_string(), file.clone());
        }
        fs::set_permissions(&path, permissions.clone()).map_err(io(&path))?;
        sync(&path)?;
    }
    let total_size = bytes.iter().sum();
    if files.len() > 1 {
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        write_json(&dir.join(INDEX_FILE), &index)?;
    }
    let tokenizer_files = write_tokenizer_files(&layout.tokenizer, config, dir)?;
    Ok(Saved { weight_files: files, total_size, tokenizer_files })
}

/// Consecutive tensors into shards of at most `max` bytes, as `huggingface_hub` splits a state
/// dict: a tensor that does not fit in the current shard starts the next one.
pub fn plan_shards(sizes: &[u64], max: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &size) in sizes.iter().enumerate() {
        if i > start && bytes + size > max {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    shards.push(start..sizes.len());
    shards
}

/// `config` with its `torch_dtype` (and `dtype`, where it has one) set to `name`, as
/// `save_pretrained` writes the type of the weights beside it.
pub fn with_torch_dtype(config: &Value, name: &str) -> Value {
    let mut config = config.clone();
    if let Some(map) = config.as_object_mut() {
        map.insert("torch_dtype".into(), name.into());
        if map.contains_key("dtype") {
            map.insert("dtype".into(), name.into());
        }
    }
    config
}

/// Copies `source`'s tokenizer files into `to` and writes its chat template and turn end there
/// (beside `config`): the names written (a named template's as `additional_chat_templates/NAME`).
fn write_tokenizer_files(
    source: &TokenizerSource<'_>,
    config: &Value,
    to: &Path,
) -> Result<Vec<String>, HfError> {
    let mut written = Vec::new();
    let mut copy = |from: &Path, name: String| -> Result<(), HfError> {
        let target = to.join(&name);
        fs::copy(from, &target).map_err(io(from))?;
        sync(&target)?;
        written.push(name);
        Ok(())
    };
    if let Some(from) = source.dir {
        for name in TOKENIZER_FILES {
            let file = from.join(name);
            if file.is_file() {
                copy(&file, name.to_string())?;
            }
        }
        let templates = from.join(CHAT_TEMPLATES_DIR);
        if templates.is_dir() {
            fs::create_dir(to.join(CHAT_TEMPLATES_DIR)).map_err(io(to))?;
            let mut names: Vec<_> = fs::read_dir(&templates)
                .map_err(io(&templates))?
                .map(|entry| entry.map(|e| e.path()))
                .collect::<Result<_, _>>()
                .map_err(io(&templates))?;
            names.sort();
            for file in names.iter().filter(|file| file.is_file()) {
                let name = file.file_name().expect("a listed file has a name").to_string_lossy();
                copy(file, format!("{CHAT_TEMPLATES_DIR}/{name}"))?;
            }
            sync(&to.join(CHAT_TEMPLATES_DIR))?;
        }
    }
    if let Some(template) = source.chat_template {
        let file = to.join(CHAT_TEMPLATE_FILE);
        fs::write(&file, template).map_err(io(&file))?;
        sync(&file)?;
        if !written.iter().any(|name| name == CHAT_TEMPLATE_FILE) {
            written.push(CHAT_TEMPLATE_FILE.to_string());
        }
        for name in ["tokenizer_config.json", "chat_template.json"] {
            if written.iter().any(|written| written == name) {
                replace_default_template(&to.join(name), template)?;
            }
        }
    }
    if let Some(id) = source.turn_end {
        let copied = written.iter().any(|name| name == GENERATION_CONFIG_FILE);
        if stop_at(&to.join(GENERATION_CONFIG_FILE), copied, config, id)? && !copied {
            written.push(GENERATION_CONFIG_FILE.to_string());
        }
    }
    Ok(written)
}

/// `transformers`' generation settings beside a model: its `eos_token_id`, one id or a list,
/// ends generation at any of them.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";

/// Adds `id` to the end-of-text ids of the generation config `path` (`copied`: there already,
/// else made from `config`'s token ids); whether it was written.
fn stop_at(path: &Path, copied: bool, config: &Value, id: u32) -> Result<bool, HfError> {
    let mut generation = if copied {
        let text = fs::read_to_string(path).map_err(io(path))?;
        serde_json::from_str(&text)
            .map_err(|e| HfError::Json { path: path.to_path_buf(), reason: e.to_string() })?
    } else {
        let fields = ["bos_token_id", "eos_token_id", "pad_token_id"];
        let ids = fields.iter().filter_map(|&f| Some((f.to_string(), config.get(f)?.clone())));
        Value::Object(ids.filter(|(_, v)| !v.is_null()).collect())
    };
    let mut ids = crate::eos_token_ids(&generation);
    if ids.contains(&id) || !generation.is_object() {
        return Ok(false);
    }
    ids.push(id);
    generation["eos_token_id"] = ids.into();
    write_json(path, &generation)?;
    Ok(true)
}

/// Sets the default chat template of the JSON file `path` (`tokenizer_config.json`, or a
/// processor's `chat_template.json`) to `template`, where it has one: its `chat_template`, or
/// the entry named `default` of a list of named ones.
fn replace_default_template(path: &Path, template: &str) -> Result<(), HfError> {
    let text = fs::read_to_string(path).map_err(io(path))?;
    let mut json: Value = serde_json::from_str(&text)
        .map_err(|e| HfError::Json { path: path.to_path_buf(), reason: e.to_string() })?;
    let replaced = match json.get_mut("chat_template") {
        Some(Value::String(old)) => {
            *old = template.to_string();
            true
        }
        Some(Value::Array(named)) => {
            let default = named.iter_mut().find(|entry| entry["name"] == "default");
            default.map(|entry| entry["template"] = template.into()).is_some()
        }
        _ => false,
    };
    if replaced { write_json(path, &json) } else { Ok(()) }
}

fn write_json(path: &Path, json: &Value) -> Result<(), HfError> {
    let text = serde_json::to_string_pretty(json).expect("JSON values serialize") + "\n";
    fs::write(path, text).map_err(io(path))?;
    sync(path)
}

/// fsyncs a file or a directory.
fn sync(path: &Path) -> Result<(), HfError> {
    File::open(path).and_then(|f| f.sync_all()).map_err(io(path))
}

/// A tensor's elements, encoded in the written dtype (through f32) when the file is written (one
/// tensor's bytes at a time).
struct Encoded<'a, T> {
    dtype: SaveDtype,
    tensor: OutTensor<'a, T>,
}

impl<T: Float> View for Encoded<'_, T> {
    fn dtype(&self) -> Dtype {
        self.dtype.safetensors()
    }

    fn shape(&self) -> &[usize] {
        self.tensor.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let values = self.tensor.values;
        let bytes: Vec<u8> = match self.dtype {
            SaveDtype::F32 => values.iter().flat_map(|v| v.to_f32().to_le_bytes()).collect(),
            SaveDtype::Bf16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v.to_f32()).to_le_bytes())
                .collect(),
        };
        Cow::Owned(bytes)
    }

    fn data_len(&self) -> usize {
        self.tensor.values.len() * self.dtype.bytes()
    }
}
