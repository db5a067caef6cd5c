//! Trains a model on the synthetic corpus on the CpuDevice with a plain AdamW loop and prints the
//! loss next to the corpus' floor. The real training loop is the engine's; this checks that the
//! tiny model can learn the corpus in about a minute.
//!
//! `cargo run --release -p zeroflow-gpt --example train_tiny -- [seconds] [batch] [lr] [config]`

use std::sync::Arc;
use std::time::Instant;

use zeroflow_data::{DataLoader, Source, SyntheticCorpus};
use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::{CpuGpt, GptConfig, flat_layout, init_params};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let seconds: f64 = args.get(1).map_or(Ok(60.0), |s| s.parse())?;
    let batch: usize = args.get(2).map_or(Ok(16), |s| s.parse())?;
    let lr: f32 = args.get(3).map_or(Ok(3e-3), |s| s.parse())?;
    let config: GptConfig = args.get(4).map_or(Ok(GptConfig::TINY), |s| s.parse())?;
    let seq = config.context;
    let corpus = Arc::new(SyntheticCorpus::default());
    let floor = corpus.loss_floor(seq);
    let source = Source::Synthetic { corpus: corpus.clone(), stream_seed: 0, len: 1 << 23 };
    let mut data = DataLoader::new(source, config.vocab_size, batch, seq, 0, 1)?;
    let layout = flat_layout(&config, 1)?;
    let mut weights = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 1, &mut weights)?;
    let (mut m, mut v) = (vec![0.0f32; weights.len()], vec![0.0f32; weights.len()]);
    let device = CpuDevice::new()?;
    let mut model = CpuGpt::new(&device, &config, &layout, batch, seq)?;
    println!("{config:?}: {} parameters, floor {floor:.4} nats/token", config.num_params());
    let start = Instant::now();
    let mut step = 0;
    let mut recent = Vec::new();
    while start.elapsed().as_secs_f64() < seconds {
        step += 1;
        let params = device.upload(&weights)?;
        let grads = device.alloc::<f32>(layout.padded_len())?;
        let next = data.next_batch()?;
        model.set_batch(&next.inputs, &next.targets)?;
        model.forward(&params)?;
        model.backward(&params, &grads, 1.0, |_| {})?;
        recent.push(model.loss()?);
        let grads = device.download(&grads)?;
        let progress = start.elapsed().as_secs_f64() / seconds;
        // Linear decay to 10% over the time budget.
        let lr = lr * (1.0 - 0.9 * progress as f32);
        adamw(&mut weights, &grads, &mut m, &mut v, step, lr);
        if step % 50 == 0 {
            let mean = recent.iter().sum::<f32>() / recent.len() as f32;
            println!(
                "step {step:5} {:6.1}s loss {mean:.4} ({:+.1}% over floor) {:.0} tokens/s",
                start.elapsed().as_secs_f64(),
                100.0 * (f64::from(mean) / floor - 1.0),
                (step as usize * batch * seq) as f64 / start.elapsed().as_secs_f64()
            );
            recent.clear();
        }
    }
    Ok(())
}

fn adamw(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], step: i32, lr: f32) {
    let (b1, b2, eps, decay) = (0.9f32, 0.95f32, 1e-8f32, 0.0f32);
    for i in 0..w.len() {
        m[i] = b1 * m[i] + (1.0 - b1) * g[i];
        v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
        let m_hat = m[i] / (1.0 - b1.powi(step));
        let v_hat = v[i] / (1.0 - b2.powi(step));
        w[i] -= lr * (m_hat / (v_hat.sqrt() + eps) + decay * w[i]);
    }
}
