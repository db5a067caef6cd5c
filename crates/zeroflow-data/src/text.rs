//! Text files as tokens: bytes (vocabulary 256), or GPT-2's byte-pair encoding
//! ([`crate::tokenizer`]).

use std::path::Path;

use crate::tokenizer::gpt2_encode;
use crate::{DataError, DataErrorKind};

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
