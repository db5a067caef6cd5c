//! Hugging Face directories written and read back, and every way a directory can be wrong.

mod errors;
mod roundtrip;

use std::path::PathBuf;

/// A fresh, empty scratch directory for one test (removed when dropped).
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(test: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("zeroflow-hf-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A model-like set of tensors: (name, shape, values), values distinct and not representable
/// exactly in 16 bits, so that a conversion shows.
pub fn sample_tensors() -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let shapes: [(&str, &[usize]); 5] = [
        ("model.embed_tokens.weight", &[11, 6]),
        ("model.layers.0.self_attn.q_proj.weight", &[6, 6]),
        ("model.layers.0.self_attn.q_proj.bias", &[6]),
        ("model.layers.0.mlp.down_proj.weight", &[6, 10]),
        ("model.norm.weight", &[6]),
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(t, (name, shape))| {
            let n: usize = shape.iter().product();
            let values = (0..n).map(|i| ((t * 1000 + i) as f32 * 0.37).sin() * 1.0001).collect();
            (name.to_string(), shape.to_vec(), values)
        })
        .collect()
}

pub fn out_tensors(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<zeroflow_hf::OutTensor<'_>> {
    tensors
        .iter()
        .map(|(name, shape, values)| zeroflow_hf::OutTensor { name, shape, values })
        .collect()
}
