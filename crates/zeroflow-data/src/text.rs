//! Text files as tokens: their bytes (vocabulary 256), one byte per token in memory.

use std::path::Path;

use crate::{DataError, DataErrorKind};

/// A text file as byte tokens.
pub fn read_bytes(path: &Path, vocab: usize) -> Result<Vec<u8>, DataError> {
    let bytes =
        std::fs::read(path).map_err(|e| DataError::new(path, DataErrorKind::Io(e.to_string())))?;
    if bytes.is_empty() {
        return Err(DataError::new(path, DataErrorKind::Empty));
    }
    if let Some(index) = bytes.iter().position(|&b| usize::from(b) >= vocab) {
        let kind = DataErrorKind::TokenOutOfRange { token: u32::from(bytes[index]), index, vocab };
        return Err(DataError::new(path, kind));
    }
    Ok(bytes)
}
