//! What the inference examples share: the model of either family, from a Hugging Face directory
//! or a named shape with random weights (`zeroflow_train::infer::HostModel`), and token ids.

pub use zeroflow_train::infer::HostModel as Model;

pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Token ids written `1,2,3`.
pub fn ids(text: &str) -> Result<Vec<u32>, Error> {
    Ok(zeroflow_train::infer::parse_ids(text)?)
}
