//! What the training data loader costs a micro-batch: rows read in file order, in the order
//! shuffled each epoch (`train --shuffle`, the default), and shuffled and packed (each token's
//! position in its document, from the document index).
//!
//! `cargo bench -p zeroflow-data --bench loader -- [TOKENS]` writes a u16 shard of TOKENS tokens
//! (default 1e8, llm.c's and `zeroflow tokenize`'s shard size; 200 MB) with documents of 1,000
//! tokens into a temporary directory, then prints, for each way, the median and the slowest
//! micro-batch of `BATCH` rows of `SEQ` tokens (default 8 × 2048) over `ITERS` batches (default
//! 2000), and the tokens a second that is. The first batch (the shard read) is left out.

use std::time::{Duration, Instant};

use zeroflow_data::{Batch, DataLoader, Source, write_document_index, write_shard};

fn main() {
    let tokens = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with('-')) // cargo bench passes --bench
        .map_or(100_000_000, |arg| arg.parse::<f64>().expect("a count such as 1e8") as usize);
    let batch = env_or("BATCH", 8);
    let seq = env_or("SEQ", 2048);
    let iters = env_or("ITERS", 2000);
    let dir = std::env::temp_dir().join(format!("zeroflow-loader-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shard = dir.join("tokens_000000.bin");
    let data: Vec<u16> = (0..tokens).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u16).collect();
    write_shard(&shard, &data).unwrap();
    let starts: Vec<u64> = (0..tokens as u64).step_by(1000).chain([tokens as u64]).collect();
    write_document_index(&shard.with_extension("idx"), &starts).unwrap();
    println!("a shard of {tokens} u16 tokens, micro-batches of {batch} × {seq}, {iters} batches");
    for way in ["in file order", "shuffled", "shuffled and packed"] {
        let source = Source::Shards(vec![shard.clone()]);
        let mut loader = DataLoader::new(source, 65_536, batch, seq, 0, 1).unwrap();
        if way != "in file order" {
            loader = loader.shuffled(7).unwrap();
        }
        if way == "shuffled and packed" {
            loader = loader.packed().unwrap();
        }
        let mut out = Batch::default();
        loader.next_into(&mut out).unwrap();
        let mut times: Vec<Duration> = (0..iters)
            .map(|_| {
                let start = Instant::now();
                loader.next_into(&mut out).unwrap();
                start.elapsed()
            })
            .collect();
        times.sort();
        let median = times[times.len() / 2];
        let per_second = (batch * seq) as f64 / median.as_secs_f64();
        println!(
            "{way:>20}: median {:>8.1} µs, slowest {:>8.1} µs a micro-batch ({:.2e} tokens/s)",
            median.as_secs_f64() * 1e6,
            times[times.len() - 1].as_secs_f64() * 1e6,
            per_second
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).map_or(default, |v| v.parse().expect("a whole number"))
}
