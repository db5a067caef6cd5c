//! llm.c token shards: a header of 256 little-endian i32 (magic 20240520, version 1, token count),
//! then the tokens as little-endian u16.

use std::path::Path;

use crate::{DataError, DataErrorKind};

pub const SHARD_MAGIC: i32 = 20240520;
pub const SHARD_VERSION: i32 = 1;
const HEADER_BYTES: u64 = 256 * 4;

/// Reads and validates a shard: header, exact size, and every token below `vocab`.
pub fn read_shard(path: &Path, vocab: usize) -> Result<Vec<u16>, DataError> {
    let fail = |kind| DataError::new(path, kind);
    let bytes = std::fs::read(path).map_err(|e| fail(DataErrorKind::Io(e.to_string())))?;
    let found_bytes = bytes.len() as u64;
    if bytes.is_empty() {
        return Err(fail(DataErrorKind::Empty));
    }
    if found_bytes < HEADER_BYTES {
        return Err(fail(DataErrorKind::Truncated { expected_bytes: HEADER_BYTES, found_bytes }));
    }
    let header =
        |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    if header(0) != SHARD_MAGIC {
        return Err(fail(DataErrorKind::WrongMagic { found: header(0) }));
    }
    if header(1) != SHARD_VERSION {
        return Err(fail(DataErrorKind::WrongVersion { found: header(1) }));
    }
    let count = u64::try_from(header(2)).unwrap_or(0);
    if count == 0 {
        return Err(fail(DataErrorKind::Empty));
    }
    let expected_bytes = HEADER_BYTES + 2 * count;
    if found_bytes < expected_bytes {
        return Err(fail(DataErrorKind::Truncated { expected_bytes, found_bytes }));
    }
    if found_bytes > expected_bytes {
        return Err(fail(DataErrorKind::TrailingBytes { expected_bytes, found_bytes }));
    }
    let tokens: Vec<u16> = bytes[HEADER_BYTES as usize..]
        .chunks_exact(2)
        .map(|pair| u16::from_le_bytes([pair[0], pair[1]]))
        .collect();
    if let Some(index) = tokens.iter().position(|&t| usize::from(t) >= vocab) {
        let token = u32::from(tokens[index]);
        return Err(fail(DataErrorKind::TokenOutOfRange { token, index, vocab }));
    }
    Ok(tokens)
}

/// Writes `tokens` as an llm.c shard (for tests and data preparation).
pub fn write_shard(path: &Path, tokens: &[u16]) -> std::io::Result<()> {
    let count = i32::try_from(tokens.len())
        .map_err(|_| std::io::Error::other("more tokens than an llm.c shard can hold"))?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES as usize + 2 * tokens.len());
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[SHARD_MAGIC, SHARD_VERSION, count]);
    header.iter().for_each(|h| bytes.extend_from_slice(&h.to_le_bytes()));
    tokens.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
    std::fs::write(path, bytes)
}
