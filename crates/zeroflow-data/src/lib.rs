//! Training data for zeroflow's models, whatever the family: token streams from the built-in
//! synthetic corpus, llm.c token shards, or plain text (bytes, or GPT-2 BPE), cut into
//! micro-batches of `[batch, seq + 1]` tokens per rank by a deterministic, resumable
//! [`DataLoader`]; and the making of shards: [`Tokenizer`] (bytes, GPT-2, Hugging Face
//! `tokenizer.json`), [`ChatTemplate`] (chat templates and assistant-only loss masks) and
//! [`tokenize_corpus`] (`zeroflow tokenize`, each input read as its [`input_kind`]).

mod chat;
mod corpus;
mod eval;
mod input;
mod loader;
mod shard;
mod synthetic;
mod text;
pub mod tokenizer;

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

pub use chat::{
    ChatOptions, ChatTemplate, ChatTemplateError, Conversation, ConversationError, Encoded,
    Rendered, TemplateVariables,
};
pub use corpus::{
    BATCH_BYTES, DEFAULT_SHARD_TOKENS, HELD_OUT_DIR, HoldOut, TEXT_PIECE_BYTES, TokenizeError,
    TokenizeOptions, TokenizeSummary, count, describe_setup, encode_text_file,
    first_record_is_conversation, manifest_tokenizer, tokenize_corpus,
};
pub use eval::{eval_batches, eval_windows};
pub use input::{InputKind, held_out_refusal, input_kind, json_lines_in, json_lines_of};
pub use loader::{
    Batch, DataLoader, DataPosition, IGNORE_TARGET, Source, Unit, apply_mask, document_positions,
    index_path, mask_path, read_document_starts, read_unit,
};
pub use shard::{
    DOCUMENT_INDEX_MAGIC, LOSS_MASK_MAGIC, SHARD_MAGIC, SHARD_MAGIC_U32, SHARD_VERSION,
    SHARD_VERSION_U32, SIDECAR_VERSION, ShardTokens, TokenWidth, read_document_index,
    read_loss_mask, read_shard, write_document_index, write_loss_mask, write_shard, write_shard_as,
};
pub use synthetic::SyntheticCorpus;
pub use tokenizer::{
    GPT2_EOT, GPT2_VOCAB, TokenOffsets, Tokenizer, TokenizerConfig, TokenizerError,
    TokenizerErrorKind, gpt2_decode, gpt2_encode,
};

/// What was wrong with a data file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DataErrorKind {
    /// The file could not be read.
    Io(String),
    /// The file (or its token count) is empty.
    Empty,
    /// The header's magic number is not one this kind of file has.
    WrongMagic { found: i32 },
    /// The header's version is not the one its magic number goes with.
    WrongVersion { found: i32, expected: i32 },
    /// The file is shorter than its header says.
    Truncated { expected_bytes: u64, found_bytes: u64 },
    /// The file is longer than its header says.
    TrailingBytes { expected_bytes: u64, found_bytes: u64 },
    /// A token id does not fit the model's vocabulary.
    TokenOutOfRange { token: u32, index: usize, vocab: usize },
    /// The GPT-2 tokenizer could not be set up.
    Tokenizer(String),
    /// The file's contents break its format's rules.
    Corrupt(String),
    /// The file holds fewer tokens than one step of all ranks needs.
    TooShort { tokens: usize, needed: usize },
    /// Packing needs the documents, and the shard has no document index beside it.
    NoDocumentIndex,
}

impl fmt::Display for DataErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataErrorKind::Io(e) => write!(f, "cannot read: {e}"),
            DataErrorKind::Empty => write!(f, "empty: no tokens"),
            DataErrorKind::WrongMagic { found } => write!(
                f,
                "not a file of this kind: magic {found} (llm.c token shards have \
                 {SHARD_MAGIC} or {SHARD_MAGIC_U32})"
            ),
            DataErrorKind::WrongVersion { found, expected } => {
                write!(f, "unsupported version {found}, expected {expected}")
            }
            DataErrorKind::Truncated { expected_bytes, found_bytes } => write!(
                f,
                "truncated: the header promises {expected_bytes} bytes, the file has {found_bytes}"
            ),
            DataErrorKind::TrailingBytes { expected_bytes, found_bytes } => write!(
                f,
                "the header promises {expected_bytes} bytes but the file has {found_bytes}"
            ),
            DataErrorKind::TokenOutOfRange { token, index, vocab } => write!(
                f,
                "token id {token} at index {index} is not below the model's vocabulary size {vocab}"
            ),
            DataErrorKind::Tokenizer(e) => write!(f, "GPT-2 tokenizer: {e}"),
            DataErrorKind::Corrupt(e) => write!(f, "corrupt: {e}"),
            DataErrorKind::TooShort { tokens, needed } => write!(
                f,
                "{tokens} tokens to train on (a part is held out for evaluation unless \
                 --eval-data is given), but one step of all ranks needs {needed} \
                 (micro-batch × seq × ranks + 1); give more data, or a smaller --micro-batch or \
                 --seq"
            ),
            DataErrorKind::NoDocumentIndex => write!(
                f,
                "no document index (.idx) beside it, and packing (--pack) needs to know where \
                 each document starts; make the shards with `zeroflow tokenize`, which writes \
                 one, or train without --pack"
            ),
        }
    }
}

/// A data error, naming the file (or `<synthetic>` for the built-in corpus).
#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("{}: {kind}", path.display())]
pub struct DataError {
    pub path: PathBuf,
    pub kind: DataErrorKind,
}

impl DataError {
    pub(crate) fn new(path: impl Into<PathBuf>, kind: DataErrorKind) -> Self {
        DataError { path: path.into(), kind }
    }
}
