//! Text as tokens: bytes (vocabulary 256), or GPT-2's byte-pair encoding through `tiktoken-rs`,
//! whose `r50k_base` ranks are bundled in the crate (no download).

use std::path::Path;
use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use super::{DataError, DataErrorKind};

/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: usize = 50257;

/// A text file as byte tokens.
pub fn read_bytes(path: &Path, vocab: usize) -> Result<Vec<u32>, DataError> {
    let bytes = read_nonempty(path)?;
    let tokens: Vec<u32> = bytes.into_iter().map(u32::from).collect();
    check_vocab(path, &tokens, vocab)?;
    Ok(tokens)
}

/// A UTF-8 text file as GPT-2 BPE tokens (`<|endoftext|>` in the text is ordinary text).
pub fn read_gpt2_text(path: &Path, vocab: usize) -> Result<Vec<u32>, DataError> {
    let bytes = read_nonempty(path)?;
    let text = String::from_utf8(bytes).map_err(|e| {
        DataError::new(path, DataErrorKind::NotUtf8 { offset: e.utf8_error().valid_up_to() })
    })?;
    let tokens = gpt2_encode(&text).map_err(|e| DataError::new(path, e))?;
    check_vocab(path, &tokens, vocab)?;
    Ok(tokens)
}

fn gpt2_bpe() -> Result<&'static CoreBPE, DataErrorKind> {
    static BPE: OnceLock<Result<CoreBPE, String>> = OnceLock::new();
    BPE.get_or_init(|| tiktoken_rs::r50k_base().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| DataErrorKind::Tokenizer(e.clone()))
}

/// GPT-2 BPE token ids of `text`.
pub fn gpt2_encode(text: &str) -> Result<Vec<u32>, DataErrorKind> {
    Ok(gpt2_bpe()?.encode_ordinary(text))
}

/// The text of GPT-2 BPE token ids.
pub fn gpt2_decode(tokens: &[u32]) -> Result<String, DataErrorKind> {
    gpt2_bpe()?.decode(tokens.to_vec()).map_err(|e| DataErrorKind::Tokenizer(e.to_string()))
}

fn read_nonempty(path: &Path) -> Result<Vec<u8>, DataError> {
    let bytes =
        std::fs::read(path).map_err(|e| DataError::new(path, DataErrorKind::Io(e.to_string())))?;
    if bytes.is_empty() {
        return Err(DataError::new(path, DataErrorKind::Empty));
    }
    Ok(bytes)
}

fn check_vocab(path: &Path, tokens: &[u32], vocab: usize) -> Result<(), DataError> {
    match tokens.iter().position(|&t| t as usize >= vocab) {
        Some(index) => {
            let kind = DataErrorKind::TokenOutOfRange { token: tokens[index], index, vocab };
            Err(DataError::new(path, kind))
        }
        None => Ok(()),
    }
}
