//! Speed of a decode step's matrix products (`matmul_forward_few_rows`, f32): for each weight
//! shape and layout and each row count, the median time of a product and the rates it makes —
//! the weight's bytes read per second (what bounds a step at one row) and the multiply-adds per
//! second (what bounds it at many).
//!
//! `cargo bench -p zeroflow-nn --bench few_rows -- [--rows 1,2,4,8,16] [--shapes 768x2304,...]
//! [--iters N]` (default: GPT-2 small's and Llama-3.2-1B's shapes, rows 1 to 16).

use std::time::Instant;

use zeroflow_nn::WeightLayout;
use zeroflow_nn::kernels::matmul::matmul_forward_few_rows;

/// `in x out` of a linear layer.
const SHAPES: &[(usize, usize)] =
    &[(768, 2304), (768, 3072), (3072, 768), (2048, 8192), (8192, 2048)];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    let rows: Vec<usize> = match value("--rows") {
        Some(list) => list.split(',').map(str::parse).collect::<Result<_, _>>()?,
        None => vec![1, 2, 3, 4, 6, 8, 12, 16],
    };
    let shapes: Vec<(usize, usize)> = match value("--shapes") {
        Some(list) => list
            .split(',')
            .map(|s| {
                let (c, oc) = s.split_once('x').ok_or("a shape is IN x OUT, as 768x2304")?;
                Ok::<_, Box<dyn std::error::Error>>((c.parse()?, oc.parse()?))
            })
            .collect::<Result<_, _>>()?,
        None => SHAPES.to_vec(),
    };
    let iters: usize = value("--iters").map(|s| s.parse()).transpose()?.unwrap_or(30);
    println!("{} threads; median of {iters} products", rayon::current_num_threads());
    println!(
        "{:>11} {:>7} {:>5} {:>10} {:>8} {:>10}",
        "in x out", "layout", "rows", "ms", "GB/s", "GFLOP/s"
    );
    for &(c, oc) in &shapes {
        let weight: Vec<f32> = (0..c * oc).map(|i| ((i % 251) as f32 - 125.0) * 1e-3).collect();
        let bias: Vec<f32> = (0..oc).map(|i| i as f32 * 1e-4).collect();
        for layout in [WeightLayout::InOut, WeightLayout::OutIn] {
            for &n in &rows {
                let inp: Vec<f32> = (0..n * c).map(|i| ((i % 97) as f32 - 48.0) * 1e-2).collect();
                let mut out = vec![0.0f32; n * oc];
                let mut times: Vec<f64> = (0..iters + 3)
                    .map(|_| {
                        let start = Instant::now();
                        matmul_forward_few_rows(
                            &mut out,
                            &inp,
                            &weight,
                            Some(&bias),
                            c,
                            oc,
                            layout,
                        );
                        start.elapsed().as_secs_f64()
                    })
                    .skip(3)
                    .collect();
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                let gb_s = (c * oc * 4) as f64 / median / 1e9;
                let gflop_s = (2 * n * c * oc) as f64 / median / 1e9;
                let name = format!("{c}x{oc}");
                println!(
                    "{name:>11} {:>7} {n:>5} {:>10.3} {gb_s:>8.1} {gflop_s:>10.1}",
                    format!("{layout:?}"),
                    median * 1e3
                );
                std::hint::black_box(&out);
            }
        }
    }
    Ok(())
}
