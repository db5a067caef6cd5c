//! Tokenizers: bytes, GPT-2's byte-pair encoding (through `tiktoken-rs`, whose `r50k_base` ranks
//! are bundled in the crate: no download), and a Hugging Face `tokenizer.json` (through the
//! `tokenizers` crate, with its pure-Rust regex), behind one [`Tokenizer`] type.
//!
//! A Hugging Face model directory has `tokenizer.json` and usually `tokenizer_config.json`, whose
//! `eos_token` names the end-of-text token and whose `chat_template` (or a `chat_template.jinja`
//! beside it) is the chat template.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use serde_json::Value;
use thiserror::Error;
use tiktoken_rs::CoreBPE;

use crate::DataErrorKind;

/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: usize = 50257;
/// GPT-2's `<|endoftext|>`.
pub const GPT2_EOT: u32 = 50256;

/// Special tokens of a tokenizer that no `tokenizer_config.json` names are taken as its
/// end-of-text token, in this order.
const EOT_CANDIDATES: [&str; 4] = ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"];

fn gpt2_bpe() -> Result<&'static CoreBPE, DataErrorKind> {
    static BPE: OnceLock<Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataErrorKind::Tokenizer(e.clone()))
}

/// GPT-2 BPE token ids of `text` (`<|endoftext|>` in the text is ordinary text).
pub fn gpt2_encode(text: &str) -> Result<Vec<u32>, DataErrorKind> {
    Ok(gpt2_bpe()?.encode_ordinary(text))
}

/// The text of GPT-2 BPE token ids.
pub fn gpt2_decode(tokens: &[u32]) -> Result<String, DataErrorKind> {
    gpt2_bpe()?.decode(tokens.to_vec()).map_err(|e| DataErrorKind::Tokenizer(e.to_string()))
}

/// What was wrong with a tokenizer's files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TokenizerErrorKind {
    /// The file could not be read.
    Io(String),
    /// A directory without `tokenizer.json`.
    NoTokenizerJson,
    /// Neither `gpt2`, `bytes`, nor an existing file or directory.
    NotFound,
    /// The `tokenizers` crate could not load the file (the message names the JSON position).
    Load(String),
    /// A field of `tokenizer_config.json` has the wrong type.
    Field { field: String, message: String },
    /// A token that the config names is not in the vocabulary.
    UnknownToken { field: String, token: String },
}

impl fmt::Display for TokenizerErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenizerErrorKind::Io(e) => write!(f, "cannot read: {e}"),
            TokenizerErrorKind::NoTokenizerJson => write!(
                f,
                "no tokenizer.json in this directory (give a tokenizer.json, a model directory \
                 that has one, `gpt2` or `bytes`)"
            ),
            TokenizerErrorKind::NotFound => write!(
                f,
                "no such file or directory (give `gpt2`, `bytes`, a tokenizer.json or a model \
                 directory)"
            ),
            TokenizerErrorKind::Load(e) => write!(f, "not a tokenizer.json: {e}"),
            TokenizerErrorKind::Field { field, message } => write!(f, "{field}: {message}"),
            TokenizerErrorKind::UnknownToken { field, token } => {
                write!(f, "{field}: {token:?} is not a token of the tokenizer")
            }
        }
    }
}

/// A tokenizer error, naming the file.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{}: {kind}", path.display())]
pub struct TokenizerError {
    pub path: PathBuf,
    pub kind: TokenizerErrorKind,
}

impl TokenizerError {
    fn new(path: impl Into<PathBuf>, kind: TokenizerErrorKind) -> Self {
        TokenizerError { path: path.into(), kind }
    }
}

/// What `tokenizer_config.json` (and `chat_template.jinja`) say, where the tokenizer has them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The file these came from.
    pub path: Option<PathBuf>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    /// The chat template, and the file it came from.
    pub chat_template: Option<(String, PathBuf)>,
}

impl TokenizerConfig {
    /// Reads `tokenizer_config.json`; `chat_template.jinja` beside it, if present, is the chat
    /// template (as in transformers, where it takes precedence).
    pub fn read(path: &Path) -> Result<TokenizerConfig, TokenizerError> {
        let io =
            |e: std::io::Error| TokenizerError::new(path, TokenizerErrorKind::Io(e.to_string()));
        let json: Value = serde_json::from_str(&std::fs::read_to_string(path).map_err(io)?)
            .map_err(|e| TokenizerError::new(path, TokenizerErrorKind::Load(e.to_string())))?;
        let token = |field: &str| token_field(path, &json, field);
        let mut config = TokenizerConfig {
            path: Some(path.to_path_buf()),
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            unk_token: token("unk_token")?,
            pad_token: token("pad_token")?,
            chat_template: chat_template_field(path, &json)?.map(|t| (t, path.to_path_buf())),
        };
        let jinja = path.with_file_name("chat_template.jinja");
        if jinja.is_file() {
            let text = std::fs::read_to_string(&jinja)
                .map_err(|e| TokenizerError::new(&jinja, TokenizerErrorKind::Io(e.to_string())))?;
            config.chat_template = Some((text, jinja));
        }
        Ok(config)
    }
}

fn field_error(path: &Path, field: &str, message: &str) -> TokenizerError {
    let kind = TokenizerErrorKind::Field { field: field.into(), message: message.into() };
    TokenizerError::new(path, kind)
}

/// A special-token field: a string, `{"content": string, ...}` (an AddedToken), or null.
fn token_field(path: &Path, json: &Value, field: &str) -> Result<Option<String>, TokenizerError> {
    match json.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => match o.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(path, &format!("{field}.content"), "expected a string")),
        },
        Some(_) => Err(field_error(path, field, "expected a string or {\"content\": string}")),
    }
}

/// `chat_template`: a string, or a list of `{"name", "template"}` of which "default" is used.
fn chat_template_field(path: &Path, json: &Value) -> Result<Option<String>, TokenizerError> {
    match json.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(list)) => {
            let named = |name: &str| {
                list.iter().find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            let Some(entry) = named("default").or(list.first()) else { return Ok(None) };
            match entry.get("template") {
                Some(Value::String(s)) => Ok(Some(s.clone())),
                _ => Err(field_error(path, "chat_template[].template", "expected a string")),
            }
        }
        Some(_) => Err(field_error(path, "chat_template", "expected a string or a list")),
    }
}

#[derive(Clone, Debug)]
enum Kind {
    Bytes,
    Gpt2,
    HuggingFace(Box<Hf>),
}

/// A `tokenizer.json`'s pipeline, and where its normalizer or pre-tokenizer puts a prefix before
/// a text (Llama-2's `Prepend("▁")`, Mistral's `Metaspace` that prepends, a `ByteLevel` that
/// adds a space), the same pipeline without that prefix, for text that goes on from text already
/// encoded ([`Tokenizer::encode_more`]).
#[derive(Clone, Debug)]
struct Hf {
    text: HfTokenizer,
    more: Option<HfTokenizer>,
}

impl Hf {
    fn new(text: HfTokenizer) -> Hf {
        let more = without_prefix(&text);
        Hf { text, more }
    }

    fn more(&self) -> &HfTokenizer {
        self.more.as_ref().unwrap_or(&self.text)
    }
}

/// A `tokenizer.json`'s pipeline around its model shared by every copy (`SharedModel`).
type HfTokenizer = tokenizers::TokenizerImpl<
    SharedModel,
    tokenizers::NormalizerWrapper,
    tokenizers::PreTokenizerWrapper,
    tokenizers::PostProcessorWrapper,
    tokenizers::DecoderWrapper,
>;

/// A `tokenizer.json`'s model — its vocabulary and merges, some 10 MB for GPT-2's 50,257 tokens
/// and more for larger vocabularies — held once for all copies of the tokenizer
/// ([`Tokenizer::per_thread`]): it is only read while encoding (the `tokenizers` crate's BPE
/// keeps its cache of words per thread), so the copies share it and a copy costs its
/// normalizer's and pre-tokenizer's compiled patterns only.
#[derive(Clone, Debug)]
struct SharedModel(Arc<tokenizers::ModelWrapper>);

/// Read from `tokenizer.json` as its model is.
impl<'de> serde::Deserialize<'de> for SharedModel {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        tokenizers::ModelWrapper::deserialize(deserializer)
            .map(|model| SharedModel(Arc::new(model)))
    }
}

impl tokenizers::Model for SharedModel {
    type Trainer = <tokenizers::ModelWrapper as tokenizers::Model>::Trainer;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<tokenizers::Token>> {
        self.0.tokenize(sequence)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.0.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.0.id_to_token(id)
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        self.0.get_vocab()
    }

    fn get_vocab_size(&self) -> usize {
        self.0.get_vocab_size()
    }

    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        self.0.save(folder, prefix)
    }

    fn get_trainer(&self) -> Self::Trainer {
        self.0.get_trainer()
    }

    fn tokenize_in_pretokenized(
        &self,
        pretokenized: &mut tokenizers::PreTokenizedString,
        truncation: Option<(usize, tokenizers::TruncationDirection)>,
    ) -> tokenizers::Result<()> {
        self.0.tokenize_in_pretokenized(pretokenized, truncation)
    }
}

/// GPT-2's pre-tokenizer pattern, which the `tokenizers` crate's `ByteLevel` pre-tokenizer with
/// `use_regex` splits by (isolating each match) from one compiled copy for the whole process.
const GPT2_SPLIT: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// `tokenizer` with a `ByteLevel` pre-tokenizer that splits by GPT-2's pattern (`use_regex`,
/// without `add_prefix_space`) replaced by the same split as a `Split` of its own (isolated
/// matches of the same pattern) followed by `ByteLevel` without the split: the same ids (the
/// tokenizer oracle checks GPT-2's `tokenizer.json`), with a compiled pattern that each copy of the
/// tokenizer has for itself ([`Tokenizer::per_thread`]). Other pre-tokenizers are left as they
/// are.
fn own_split_regex(mut tokenizer: HfTokenizer) -> HfTokenizer {
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    let Some(PreTokenizerWrapper::ByteLevel(byte_level)) = tokenizer.get_pre_tokenizer() else {
        return tokenizer;
    };
    if !byte_level.use_regex || byte_level.add_prefix_space {
        return tokenizer;
    }
    let pattern = SplitPattern::Regex(GPT2_SPLIT.into());
    let isolated = tokenizers::SplitDelimiterBehavior::Isolated;
    let Ok(split) = Split::new(pattern, isolated, false) else { return tokenizer };
    let bytes = (*byte_level).use_regex(false);
    let sequence = Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(bytes),
    ]);
    tokenizer.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(sequence)));
    tokenizer
}

/// `tokenizer` without what puts a prefix before its text: a `Prepend` normalizer (Llama-2's
/// `"▁"`) is dropped, a `Metaspace` pre-tokenizer prepends `Never`, a `ByteLevel` one does not
/// add a space — `None` where it has none of these. A text cut into pieces then encodes, piece
/// after piece, to the ids of the text whole where the cut is at a boundary of its words: the
/// prefix marks the start of a text, which a later piece is not.
fn without_prefix(tokenizer: &HfTokenizer) -> Option<HfTokenizer> {
    use tokenizers::normalizers::NormalizerWrapper;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::metaspace::PrependScheme;

    /// The normalizer without its `Prepend`s (`None`: nothing left), and whether it had one.
    fn normalizer(n: NormalizerWrapper) -> (Option<NormalizerWrapper>, bool) {
        match n {
            NormalizerWrapper::Prepend(_) => (None, true),
            NormalizerWrapper::Sequence(sequence) => {
                let mut changed = false;
                let rest: Vec<_> = sequence
                    .into_iter()
                    .filter_map(|n| {
                        let (n, c) = normalizer(n);
                        changed |= c;
                        n
                    })
                    .collect();
                let sequence = tokenizers::normalizers::Sequence::new(rest);
                (Some(NormalizerWrapper::Sequence(sequence)), changed)
            }
            other => (Some(other), false),
        }
    }

    /// Whether the pre-tokenizer had a prefix, which it no longer puts.
    fn pre_tokenizer(p: &mut PreTokenizerWrapper) -> bool {
        match p {
            PreTokenizerWrapper::Metaspace(m) if m.get_prepend_scheme() != PrependScheme::Never => {
                m.set_prepend_scheme(PrependScheme::Never);
                true
            }
            PreTokenizerWrapper::ByteLevel(b) if b.add_prefix_space => {
                b.add_prefix_space = false;
                true
            }
            PreTokenizerWrapper::Sequence(sequence) => {
                sequence.as_mut().iter_mut().fold(false, |changed, p| pre_tokenizer(p) | changed)
            }
            _ => false,
        }
    }

    let mut more = tokenizer.clone();
    let mut changed = false;
    if let Some(n) = tokenizer.get_normalizer() {
        let (n, c) = normalizer(n.clone());
        changed |= c;
        more.with_normalizer(n).ok()?;
    }
    if let Some(p) = tokenizer.get_pre_tokenizer() {
        let mut p = p.clone();
        changed |= pre_tokenizer(&mut p);
        more.with_pre_tokenizer(Some(p));
    }
    changed.then_some(more)
}

/// A tokenizer: its kind, vocabulary size, end-of-text token and config.
#[derive(Clone, Debug)]
pub struct Tokenizer {
    kind: Kind,
    name: String,
    vocab_size: usize,
    eot: Option<u32>,
    config: TokenizerConfig,
}

impl Tokenizer {
    /// Bytes as tokens: vocabulary 256, no end-of-text token.
    pub fn bytes() -> Tokenizer {
        let config = TokenizerConfig::default();
        Tokenizer { kind: Kind::Bytes, name: "bytes".into(), vocab_size: 256, eot: None, config }
    }

    /// GPT-2's BPE (bundled, offline): vocabulary 50257, end-of-text `<|endoftext|>` (50256).
    pub fn gpt2() -> Result<Tokenizer, TokenizerError> {
        gpt2_bpe()
            .map_err(|e| TokenizerError::new("gpt2", TokenizerErrorKind::Load(e.to_string())))?;
        let config = TokenizerConfig {
            bos_token: Some("<|endoftext|>".into()),
            eos_token: Some("<|endoftext|>".into()),
            ..TokenizerConfig::default()
        };
        Ok(Tokenizer {
            kind: Kind::Gpt2,
            name: "gpt2".into(),
            vocab_size: GPT2_VOCAB,
            eot: Some(GPT2_EOT),
            config,
        })
    }

    /// `gpt2`, `bytes`, a `tokenizer.json`, or a directory with `tokenizer.json` (and, if there,
    /// `tokenizer_config.json`).
    pub fn load(spec: &str) -> Result<Tokenizer, TokenizerError> {
        match spec {
            "gpt2" => Tokenizer::gpt2(),
            "bytes" => Ok(Tokenizer::bytes()),
            _ if Path::new(spec).is_dir() => Tokenizer::from_dir(Path::new(spec)),
            _ if !Path::new(spec).exists() => {
                Err(TokenizerError::new(spec, TokenizerErrorKind::NotFound))
            }
            _ => Tokenizer::from_file(Path::new(spec), TokenizerConfig::default()),
        }
    }

    /// A model directory's tokenizer where it has a `tokenizer.json` ([`Tokenizer::from_dir`]),
    /// `None` where it has none (a model read as token ids).
    pub fn of_dir(dir: &Path) -> Result<Option<Tokenizer>, TokenizerError> {
        match dir.join("tokenizer.json").is_file() {
            true => Tokenizer::from_dir(dir).map(Some),
            false => Ok(None),
        }
    }

    /// A model directory's tokenizer: `tokenizer.json` with `tokenizer_config.json` if present.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let json = dir.join("tokenizer.json");
        if !json.is_file() {
            return Err(TokenizerError::new(dir, TokenizerErrorKind::NoTokenizerJson));
        }
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            TokenizerConfig::read(&config_path)?
        } else {
            TokenizerConfig::default()
        };
        Tokenizer::from_file(&json, config)
    }

    /// A `tokenizer.json` with the given config. The end-of-text token is the config's
    /// `eos_token`, else the first of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>` that
    /// the tokenizer has.
    pub fn from_file(path: &Path, config: TokenizerConfig) -> Result<Tokenizer, TokenizerError> {
        let bytes = std::fs::read(path)
            .map_err(|e| TokenizerError::new(path, TokenizerErrorKind::Io(e.to_string())))?;
        let hf = HfTokenizer::from_bytes(&bytes)
            .map_err(|e| TokenizerError::new(path, TokenizerErrorKind::Load(e.to_string())))?;
        let vocab_size = hf.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
        let eot = match &config.eos_token {
            Some(token) => Some(hf.token_to_id(token).ok_or_else(|| {
                let config_path = config.path.clone().unwrap_or_else(|| path.to_path_buf());
                let kind = TokenizerErrorKind::UnknownToken {
                    field: "eos_token".into(),
                    token: token.clone(),
                };
                TokenizerError::new(config_path, kind)
            })?),
            None => EOT_CANDIDATES.iter().find_map(|t| hf.token_to_id(t)),
        };
        let name = path.display().to_string();
        let kind = Kind::HuggingFace(Box::new(Hf::new(own_split_regex(hf))));
        Ok(Tokenizer { kind, name, vocab_size, eot, config })
    }

    /// Copies of this tokenizer for the threads of rayon's pool, one each (made in parallel), to
    /// tokenize with on many threads at once: the `tokenizers` crate's pure-Rust regex keeps a
    /// compiled pattern's matching state in a pool that every thread using that pattern takes
    /// from, so threads sharing one tokenizer contend where copies do not — GPT-2's own BPE here
    /// (`tiktoken-rs`) keeps a pattern per thread for the same reason. The copies share the
    /// model (`SharedModel`): each holds its own compiled patterns only. One copy (this one)
    /// for the other kinds.
    pub fn per_thread(&self) -> Vec<Tokenizer> {
        use rayon::prelude::*;
        match self.kind {
            Kind::HuggingFace(_) => {
                (0..rayon::current_num_threads()).into_par_iter().map(|_| self.clone()).collect()
            }
            Kind::Bytes | Kind::Gpt2 => vec![self.clone()],
        }
    }

    /// `bytes`, `gpt2`, or the path of the `tokenizer.json`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// One more than the largest token id (added tokens included): the embedding rows a model
    /// needs.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether this is the bytes tokenizer (which has no end-of-text token).
    pub fn is_bytes(&self) -> bool {
        matches!(self.kind, Kind::Bytes)
    }

    /// The token that ends a document, if the tokenizer has one.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }

    /// Whether `id` is a special token: an added token marked special (`<|im_end|>`,
    /// `<|eot_id|>`, `</s>`; not Qwen3's `<think>`), GPT-2's `<|endoftext|>`; none of the bytes.
    pub fn is_special(&self, id: u32) -> bool {
        match &self.kind {
            Kind::Bytes => false,
            Kind::Gpt2 => id == GPT2_EOT,
            Kind::HuggingFace(hf) => hf
                .text
                .get_added_vocabulary()
                .simple_id_to_token(id)
                .is_some_and(|token| hf.text.get_added_vocabulary().is_special_token(&token)),
        }
    }

    /// What `tokenizer_config.json` said (empty where there was none).
    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// The ids of a document's text, as `tokenizer(text)` gives them in Python: with the special
    /// tokens the tokenizer's post-processor adds (Llama's BOS, for instance), and the added
    /// tokens in the text recognised as such. GPT-2's bundled BPE reads all text as text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        match &self.kind {
            Kind::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Kind::Gpt2 => gpt2_encode(text).map_err(|e| e.to_string()),
            Kind::HuggingFace(hf) => hf
                .text
                .encode_fast(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string()),
        }
    }

    /// The ids of `text` that goes on from text already encoded (the next piece of a file):
    /// [`Tokenizer::encode`] without the special tokens the tokenizer puts around a text (a BOS).
    pub fn encode_more(&self, text: &str) -> Result<Vec<u32>, String> {
        match &self.kind {
            Kind::HuggingFace(hf) => hf
                .more()
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| e.to_string()),
            Kind::Bytes | Kind::Gpt2 => self.encode(text),
        }
    }

    /// The ids of a rendered chat and each token's byte range in `text`, as
    /// `apply_chat_template` tokenizes: no special tokens added (the template writes them), and
    /// special tokens in the text recognised, GPT-2's `<|endoftext|>` too.
    pub fn encode_with_offsets(&self, text: &str) -> Result<TokenOffsets, String> {
        match &self.kind {
            Kind::Bytes => {
                let ids = text.bytes().map(u32::from).collect();
                Ok(TokenOffsets { ids, offsets: (0..text.len()).map(|i| (i, i + 1)).collect() })
            }
            Kind::Gpt2 => {
                let bpe = gpt2_bpe().map_err(|e| e.to_string())?;
                let ids = bpe.encode_with_special_tokens(text);
                let mut start = 0;
                let offsets = bpe
                    ._decode_native_and_split(ids.clone())
                    .map(|bytes| {
                        let range = (start, start + bytes.len());
                        start += bytes.len();
                        range
                    })
                    .collect();
                Ok(TokenOffsets { ids, offsets })
            }
            Kind::HuggingFace(hf) => {
                let encoding = hf.text.encode(text, false).map_err(|e| e.to_string())?;
                let ids = encoding.get_ids().to_vec();
                Ok(TokenOffsets { ids, offsets: encoding.get_offsets().to_vec() })
            }
        }
    }

    /// The text of `ids` (special tokens included).
    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        match &self.kind {
            Kind::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&t| t as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Kind::Gpt2 => gpt2_decode(ids).map_err(|e| e.to_string()),
            Kind::HuggingFace(hf) => hf.text.decode(ids, false).map_err(|e| e.to_string()),
        }
    }
}

/// Token ids and each token's byte range in the text they were made from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenOffsets {
    pub ids: Vec<u32>,
    pub offsets: Vec<(usize, usize)>,
}

impl TokenOffsets {
    /// The first token whose range holds byte `pos` (transformers' `char_to_token`).
    pub fn token_at(&self, pos: usize) -> Option<usize> {
        self.offsets.iter().position(|&(start, end)| start <= pos && pos < end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The copies for the pool's threads hold one model between them and the tokenizer they
    /// were made from, and give its ids.
    #[test]
    fn the_copies_for_the_threads_share_one_model() {
        use tokenizers::models::bpe::BPE;
        let vocab = [("a", 0), ("b", 1), ("ab", 2), ("Ġ", 3), ("Ġab", 4), ("<|endoftext|>", 5)];
        let vocab = vocab
            .iter()
            .map(|&(t, id)| (t.to_string(), id))
            .collect::<tokenizers::models::bpe::Vocab>();
        let merges = vec![("a".to_string(), "b".to_string()), ("Ġ".into(), "ab".into())];
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().unwrap();
        let mut hf = tokenizers::Tokenizer::new(bpe);
        hf.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::byte_level::ByteLevel::new(
            false, true, true,
        )));
        let path =
            std::env::temp_dir().join(format!("zeroflow-shared-{}.json", std::process::id()));
        hf.save(&path, false).unwrap();
        let tokenizer = Tokenizer::from_file(&path, TokenizerConfig::default()).unwrap();
        std::fs::remove_file(&path).unwrap();
        let model = |t: &Tokenizer| match &t.kind {
            Kind::HuggingFace(hf) => Arc::clone(&hf.text.get_model().0),
            Kind::Bytes | Kind::Gpt2 => panic!("a tokenizer.json"),
        };
        let copies = tokenizer.per_thread();
        assert!(copies.iter().all(|copy| Arc::ptr_eq(&model(copy), &model(&tokenizer))));
        // The tokenizer, its copies and the one `model` just made.
        assert_eq!(Arc::strong_count(&model(&tokenizer)), copies.len() + 2);
        assert_eq!(tokenizer.eot(), Some(5));
        let expected = hf.encode_fast("ab ab", true).unwrap().get_ids().to_vec();
        assert_eq!(expected, [2, 4]);
        assert!(copies.iter().all(|copy| copy.encode("ab ab").unwrap() == expected));
    }
}
