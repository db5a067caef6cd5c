//! Forward + backward speed of the CPU model: tokens per second on the CpuDevice (the path the
//! engine uses), and a per-kernel breakdown from the host path.
//!
//! `cargo bench -p zeroflow-gpt --bench gpt_speed -- [size batch seq]...` (default: tiny 16 64,
//! gpt2-124m 4 64).

use std::time::{Duration, Instant};

use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::{CpuGpt, GptConfig, HostGpt, flat_layout, init_params};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let runs: Vec<(String, usize, usize)> = if args.len() >= 3 {
        args.chunks(3)
            .map(|c| Ok((c[0].clone(), c[1].parse()?, c[2].parse()?)))
            .collect::<Result<_, std::num::ParseIntError>>()?
    } else {
        vec![("tiny".into(), 16, 64), ("gpt2-124m".into(), 4, 64)]
    };
    for (name, batch, seq) in runs {
        bench(&name, batch, seq)?;
    }
    Ok(())
}

fn bench(name: &str, batch: usize, seq: usize) -> Result<(), Box<dyn std::error::Error>> {
    let config: GptConfig = name.parse()?;
    let layout = flat_layout(&config, 1)?;
    let mut host = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 1, &mut host)?;
    let n = batch * seq;
    let inputs: Vec<u32> = (0..n).map(|i| (i * 7919 % config.vocab_size) as u32).collect();
    let targets: Vec<u32> = (0..n).map(|i| (i * 104_729 % config.vocab_size) as u32).collect();

    let device = CpuDevice::new()?;
    let params = device.upload(&host)?;
    let grads = device.alloc::<f32>(layout.padded_len())?;
    let mut model = CpuGpt::new(&device, &config, &layout, batch, seq)?;
    model.set_batch(&inputs, &targets)?;
    let mut step = || -> Result<(), Box<dyn std::error::Error>> {
        model.forward(&params)?;
        model.backward(&params, &grads, 1.0, |_| {})?;
        device.synchronize()?;
        Ok(())
    };
    step()?;
    let (mut steps, start) = (0, Instant::now());
    while start.elapsed() < Duration::from_secs(5) || steps < 3 {
        step()?;
        steps += 1;
    }
    let per_step = start.elapsed().as_secs_f64() / f64::from(steps);
    println!(
        "{name} B={batch} T={seq}: forward+backward {:.1} ms/step, {:.0} tokens/s ({} threads)",
        per_step * 1e3,
        n as f64 / per_step,
        rayon::current_num_threads()
    );

    let mut reference = HostGpt::<f32>::new(&config, &layout, batch, seq)?;
    reference.forward(&host, &inputs, &targets)?;
    let mut host_grads = vec![0.0f32; layout.padded_len()];
    // Once untimed, so that first-touch page faults are not counted.
    reference.profile(&host, &mut host_grads)?;
    // The sum of three runs, which evens out other load on the machine.
    let mut times = reference.profile(&host, &mut host_grads)?;
    for _ in 0..2 {
        for ((_, total), (_, time)) in
            times.iter_mut().zip(reference.profile(&host, &mut host_grads)?)
        {
            *total += time;
        }
    }
    let total: Duration = times.iter().map(|(_, t)| *t).sum();
    for (kernel, time) in times {
        println!(
            "  {kernel:24} {:7.2} ms {:5.1}%",
            time.as_secs_f64() * 1e3 / 3.0,
            100.0 * time.as_secs_f64() / total.as_secs_f64()
        );
    }
    Ok(())
}
