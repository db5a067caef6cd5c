//! Logits of zeroflow's forward (f64, on the host) for a Hugging Face GPT-2 directory, as JSON:
//! the zeroflow side of the check that an exported model means the same thing to `transformers`
//! (`bench/peers/hf_logits_check.py` is the other side).
//!
//! `cargo run --release -p zeroflow-gpt --example hf_logits -- DIR 1,2,3,… > logits.json`

use std::path::PathBuf;

use safetensors::SafeTensors;
use zeroflow_gpt::{GptConfig, HostGpt, flat_layout, hf_tensors};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(dir), Some(tokens)) = (args.next(), args.next()) else {
        return Err("usage: hf_logits DIR TOKEN,TOKEN,…".into());
    };
    let dir = PathBuf::from(dir);
    let tokens: Vec<u32> = tokens.split(',').map(str::parse).collect::<Result<_, _>>()?;
    let hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let config = GptConfig::from_hf_config(&hf)?;
    let layout = flat_layout(&config, 1)?;
    let bytes = std::fs::read(dir.join("model.safetensors"))?;
    let file = SafeTensors::deserialize(&bytes)?;
    let mut weights = vec![0f64; layout.padded_len()];
    for tensor in hf_tensors(&config, &layout)? {
        let view = file.tensor(&tensor.name)?;
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes(b.try_into().unwrap())));
        for (w, v) in weights[tensor.flat_range].iter_mut().zip(values) {
            *w = v;
        }
    }
    let seq = tokens.len();
    let mut model = HostGpt::<f64>::new(&config, &layout, 1, seq)?;
    let targets: Vec<u32> = tokens.iter().skip(1).chain(&tokens[..1]).copied().collect();
    let loss = model.forward(&weights, &tokens, &targets)?;
    let acts = &model.activations()[model.acts().logits.clone()];
    let padded = config.padded_vocab_size();
    let logits: Vec<&[f64]> = acts.chunks(padded).map(|row| &row[..config.vocab_size]).collect();
    println!("{}", serde_json::json!({ "tokens": tokens, "loss": loss, "logits": logits }));
    Ok(())
}
