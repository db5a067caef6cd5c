//! llm.c token shards and the two files `zeroflow tokenize` writes beside them (the format of each
//! is in docs/data-formats.md).
//!
//! Every file starts with a header of 256 little-endian i32: a magic number, a version and a count.
//! - token shard (`.bin`): magic 20240520 / version 1 with u16 tokens, or magic 20240801 / version 7
//!   with u32 tokens (llm.c's GPT-2 and Llama-3 formats); the count is the number of tokens;
//! - document index (`.idx`): magic 20261201 / version 1, the count is the number of documents,
//!   then `count + 1` u64 token offsets (document `i` is the tokens `offsets[i]..offsets[i + 1]`);
//! - loss mask (`.mask`): magic 20261202 / version 1, the count is the number of tokens, then one
//!   byte per token, 1 where the loss of predicting that token counts and 0 where it does not.

use std::path::Path;

use crate::{DataError, DataErrorKind};

/// llm.c's magic number of shards with u16 tokens.
pub const SHARD_MAGIC: i32 = 20240520;
/// The version of shards with u16 tokens.
pub const SHARD_VERSION: i32 = 1;
/// llm.c's magic number of shards with u32 tokens (its Llama-3 format).
pub const SHARD_MAGIC_U32: i32 = 20240801;
/// The version of shards with u32 tokens.
pub const SHARD_VERSION_U32: i32 = 7;
/// The magic number of a document index.
pub const DOCUMENT_INDEX_MAGIC: i32 = 20261201;
/// The magic number of a loss mask.
pub const LOSS_MASK_MAGIC: i32 = 20261202;
/// The version of document indexes and loss masks.
pub const SIDECAR_VERSION: i32 = 1;
const HEADER_BYTES: usize = 256 * 4;

/// How wide a shard's tokens are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenWidth {
    U16,
    U32,
}

impl TokenWidth {
    /// The narrowest width that holds every id below `vocab`.
    pub fn for_vocab(vocab: usize) -> TokenWidth {
        if vocab <= 1 << 16 { TokenWidth::U16 } else { TokenWidth::U32 }
    }

    fn bytes(self) -> usize {
        match self {
            TokenWidth::U16 => 2,
            TokenWidth::U32 => 4,
        }
    }
}

/// The tokens of a shard, as wide as the file stores them (a text file read as bytes: one byte
/// each).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ShardTokens {
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
}

impl ShardTokens {
    pub fn len(&self) -> usize {
        match self {
            ShardTokens::U8(t) => t.len(),
            ShardTokens::U16(t) => t.len(),
            ShardTokens::U32(t) => t.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `index`.
    pub fn get(&self, index: usize) -> u32 {
        match self {
            ShardTokens::U8(t) => u32::from(t[index]),
            ShardTokens::U16(t) => u32::from(t[index]),
            ShardTokens::U32(t) => t[index],
        }
    }

    /// Keeps the first `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        match self {
            ShardTokens::U8(t) => t.truncate(len),
            ShardTokens::U16(t) => t.truncate(len),
            ShardTokens::U32(t) => t.truncate(len),
        }
    }

    /// Copies `out.len()` tokens from `start` into `out`.
    pub fn copy_to(&self, start: usize, out: &mut [u32]) {
        match self {
            ShardTokens::U8(t) => widen_into(&t[start..], out),
            ShardTokens::U16(t) => widen_into(&t[start..], out),
            ShardTokens::U32(t) => out.copy_from_slice(&t[start..start + out.len()]),
        }
    }

    /// All tokens as u32.
    pub fn to_u32(&self) -> Vec<u32> {
        let mut all = vec![0; self.len()];
        self.copy_to(0, &mut all);
        all
    }
}

/// The first `out.len()` of `tokens`, widened, into `out`.
fn widen_into<T: Copy + Into<u32>>(tokens: &[T], out: &mut [u32]) {
    out.iter_mut().zip(tokens).for_each(|(o, &x)| *o = x.into());
}

/// The header's count and the body of a file whose magic is one of `formats` (magic, version),
/// checked to be exactly `body_bytes(magic, count)` long. Returns the magic too.
fn read_checked(
    path: &Path,
    formats: &[(i32, i32)],
    body_bytes: impl Fn(i32, usize) -> usize,
) -> Result<(i32, usize, Vec<u8>), DataError> {
    let fail = |kind| DataError::new(path, kind);
    let mut bytes = std::fs::read(path).map_err(|e| fail(DataErrorKind::Io(e.to_string())))?;
    let found_bytes = bytes.len() as u64;
    if bytes.is_empty() {
        return Err(fail(DataErrorKind::Empty));
    }
    if bytes.len() < HEADER_BYTES {
        let expected_bytes = HEADER_BYTES as u64;
        return Err(fail(DataErrorKind::Truncated { expected_bytes, found_bytes }));
    }
    let header =
        |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    let (magic, version) = (header(0), header(1));
    let Some(&(_, expected)) = formats.iter().find(|(m, _)| *m == magic) else {
        return Err(fail(DataErrorKind::WrongMagic { found: magic }));
    };
    if version != expected {
        return Err(fail(DataErrorKind::WrongVersion { found: version, expected }));
    }
    let count = usize::try_from(header(2)).unwrap_or(0);
    let expected_bytes = (HEADER_BYTES + body_bytes(magic, count)) as u64;
    if found_bytes < expected_bytes {
        return Err(fail(DataErrorKind::Truncated { expected_bytes, found_bytes }));
    }
    if found_bytes > expected_bytes {
        return Err(fail(DataErrorKind::TrailingBytes { expected_bytes, found_bytes }));
    }
    bytes.drain(..HEADER_BYTES);
    Ok((magic, count, bytes))
}

/// The token count a shard's header gives (its 256-int header alone is read; [`read_shard`]
/// checks the rest when the shard is reached).
pub fn shard_token_count(path: &Path) -> Result<usize, DataError> {
    use std::io::Read;
    let fail = |kind| DataError::new(path, kind);
    let mut header = [0u8; 12];
    let mut file = std::fs::File::open(path).map_err(|e| fail(DataErrorKind::Io(e.to_string())))?;
    file.read_exact(&mut header).map_err(|e| fail(DataErrorKind::Io(e.to_string())))?;
    let count = i32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Reads and validates a shard of either width: header, exact size, and every token below `vocab`.
pub fn read_shard(path: &Path, vocab: usize) -> Result<ShardTokens, DataError> {
    let formats = [(SHARD_MAGIC, SHARD_VERSION), (SHARD_MAGIC_U32, SHARD_VERSION_U32)];
    let width = |magic, count| if magic == SHARD_MAGIC { 2 * count } else { 4 * count };
    let (magic, count, body) = read_checked(path, &formats, width)?;
    if count == 0 {
        return Err(DataError::new(path, DataErrorKind::Empty));
    }
    let tokens = if magic == SHARD_MAGIC {
        ShardTokens::U16(body.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect())
    } else {
        ShardTokens::U32(
            body.chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().expect("4"))).collect(),
        )
    };
    if let Some(index) = (0..tokens.len()).find(|&i| tokens.get(i) as usize >= vocab) {
        let token = tokens.get(index);
        return Err(DataError::new(path, DataErrorKind::TokenOutOfRange { token, index, vocab }));
    }
    Ok(tokens)
}

fn write_with_header(
    path: &Path,
    magic: i32,
    version: i32,
    count: usize,
    body: impl FnOnce(&mut Vec<u8>),
    body_bytes: usize,
) -> std::io::Result<()> {
    let count = i32::try_from(count)
        .map_err(|_| std::io::Error::other("more items than an llm.c header can count"))?;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + body_bytes);
    let mut header = [0i32; 256];
    header[..3].copy_from_slice(&[magic, version, count]);
    header.iter().for_each(|h| bytes.extend_from_slice(&h.to_le_bytes()));
    body(&mut bytes);
    std::fs::write(path, bytes)
}

/// Writes `tokens` as an llm.c shard with u16 tokens.
pub fn write_shard(path: &Path, tokens: &[u16]) -> std::io::Result<()> {
    let body = |b: &mut Vec<u8>| tokens.iter().for_each(|t| b.extend_from_slice(&t.to_le_bytes()));
    write_with_header(path, SHARD_MAGIC, SHARD_VERSION, tokens.len(), body, 2 * tokens.len())
}

/// Writes `tokens` as an llm.c shard of the given width (an error if a token does not fit u16).
pub fn write_shard_as(path: &Path, width: TokenWidth, tokens: &[u32]) -> std::io::Result<()> {
    let (magic, version) = match width {
        TokenWidth::U16 => (SHARD_MAGIC, SHARD_VERSION),
        TokenWidth::U32 => (SHARD_MAGIC_U32, SHARD_VERSION_U32),
    };
    if width == TokenWidth::U16
        && let Some(&token) = tokens.iter().find(|&&t| t > u32::from(u16::MAX))
    {
        return Err(std::io::Error::other(format!("token id {token} does not fit a u16 shard")));
    }
    let body = |b: &mut Vec<u8>| match width {
        TokenWidth::U16 => {
            tokens.iter().for_each(|&t| b.extend_from_slice(&(t as u16).to_le_bytes()))
        }
        TokenWidth::U32 => tokens.iter().for_each(|t| b.extend_from_slice(&t.to_le_bytes())),
    };
    write_with_header(path, magic, version, tokens.len(), body, width.bytes() * tokens.len())
}

/// Writes a document index: `offsets` are the token offsets of each document's start, then the
/// shard's length (so one more than there are documents).
pub fn write_document_index(path: &Path, offsets: &[u64]) -> std::io::Result<()> {
    let documents = offsets.len().saturating_sub(1);
    let body = |b: &mut Vec<u8>| offsets.iter().for_each(|o| b.extend_from_slice(&o.to_le_bytes()));
    write_with_header(
        path,
        DOCUMENT_INDEX_MAGIC,
        SIDECAR_VERSION,
        documents,
        body,
        8 * offsets.len(),
    )
}

/// Reads a document index: `documents + 1` offsets, starting at 0 and never decreasing.
pub fn read_document_index(path: &Path) -> Result<Vec<u64>, DataError> {
    let formats = [(DOCUMENT_INDEX_MAGIC, SIDECAR_VERSION)];
    // The header counts documents; the body has one offset more.
    let (_, documents, body) = read_checked(path, &formats, |_, documents| 8 * (documents + 1))?;
    let offsets: Vec<u64> =
        body.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8"))).collect();
    debug_assert_eq!(offsets.len(), documents + 1);
    if offsets[0] != 0 || offsets.windows(2).any(|w| w[0] > w[1]) {
        let kind =
            DataErrorKind::Corrupt("document offsets must start at 0 and not decrease".into());
        return Err(DataError::new(path, kind));
    }
    Ok(offsets)
}

/// Writes a loss mask: one byte per token, 1 where the token's loss counts.
pub fn write_loss_mask(path: &Path, mask: &[u8]) -> std::io::Result<()> {
    let body = |b: &mut Vec<u8>| b.extend_from_slice(mask);
    write_with_header(path, LOSS_MASK_MAGIC, SIDECAR_VERSION, mask.len(), body, mask.len())
}

/// Reads a loss mask; every byte is 0 or 1.
pub fn read_loss_mask(path: &Path) -> Result<Vec<u8>, DataError> {
    let formats = [(LOSS_MASK_MAGIC, SIDECAR_VERSION)];
    let (_, _, mask) = read_checked(path, &formats, |_, tokens| tokens)?;
    if let Some(index) = mask.iter().position(|&m| m > 1) {
        let kind = DataErrorKind::Corrupt(format!("mask byte {} at token {index}", mask[index]));
        return Err(DataError::new(path, kind));
    }
    Ok(mask)
}
