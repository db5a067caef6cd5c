//! GPT-2's byte-pair encoding through `tiktoken-rs`, whose `r50k_base` ranks are bundled in the
//! crate (no download).

use std::sync::OnceLock;

use tiktoken_rs::CoreBPE;

use crate::DataErrorKind;

/// GPT-2's vocabulary size.
pub const GPT2_VOCAB: usize = 50257;

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
