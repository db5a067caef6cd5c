//! `CudaGpt` against the CPU model: logits, loss and every parameter gradient against the f64
//! host path on the same bf16-rounded weights, at sizes with tails everywhere; the loss at
//! initialisation; the kernels compiled by NVRTC without a GPU; and the forward + backward
//! benchmark at gpt-1.3b's size (ignored).

use std::sync::Arc;
use std::time::Instant;

use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::module::compile;
use zeroflow_device::cuda::{CudaBuffer, CudaLibrary};
use zeroflow_device::{CudaDevice, Device, DeviceError};
use zeroflow_gpt::cuda::CudaGptOptions;
use zeroflow_gpt::cuda::kernels::SOURCES;
use zeroflow_gpt::{CudaGpt, GptConfig, GradGroup, GradsReady, HostGpt, flat_layout, init_params};

use crate::gpu;

/// Width 200 (25 vectors of 8) in 4 heads of 50, vocabulary 301 padded to 320, a context of 40
/// used at 37 tokens, two layers, batch 3: 111 rows, a multiple of nothing.
const TAILS: GptConfig =
    GptConfig { n_layer: 2, n_head: 4, d_model: 200, vocab_size: 301, context: 40 };

/// The largest relative error (‖gpu − cpu‖ / max(‖gpu‖, ‖cpu‖)) allowed per tensor: the GPU keeps
/// every activation and gradient in bf16.
const TOLERANCE: f64 = 2e-2;

fn relative_error(gpu: &[f64], cpu: &[f64]) -> f64 {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = gpu.iter().zip(cpu).map(|(x, y)| x - y).collect();
    norm(&diff) / norm(gpu).max(norm(cpu)).max(1e-30)
}

/// Random parameters (GPT-2's initialisation, then every element moved by up to ±0.05 so that
/// LayerNorm weights and biases are not at their special values), rounded to bf16.
fn random_params(config: &GptConfig, seed: u64) -> Vec<bf16> {
    use rand::{Rng, SeedableRng};
    let layout = flat_layout(config, 1).unwrap();
    let mut params = vec![0.0f64; layout.padded_len()];
    init_params(config, &layout, seed, &mut params).unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed + 1);
    for view in layout.params() {
        let real = if view.name == "transformer.wte.weight" {
            config.vocab_size * config.d_model
        } else {
            view.numel()
        };
        for x in &mut params[view.offset..view.offset + real] {
            *x += rng.random_range(-0.05..0.05);
        }
    }
    params.iter().map(|&x| bf16::from_f64(x)).collect()
}

fn random_tokens(vocab: usize, n: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut draw = || (0..n).map(|_| rng.random_range(0..vocab as u32)).collect::<Vec<_>>();
    (draw(), draw())
}

fn upload(device: &CudaDevice, values: &[bf16]) -> CudaBuffer<bf16> {
    device.upload(values).unwrap()
}

/// Forward and backward run twice on the same batch, with loss scales 1 and 3: the second run must
/// find nothing left over from the first in the activation gradients (their first write
/// overwrites) and must add to the parameter gradients, which end at 4 times the reference's.
fn check_against_cpu(
    device: &CudaDevice,
    config: &GptConfig,
    (batch, seq): (usize, usize),
    options: CudaGptOptions,
) {
    let layout = flat_layout(config, 1).unwrap();
    let params = random_params(config, 5);
    let params64: Vec<f64> = params.iter().map(|x| x.to_f64()).collect();
    let (inputs, targets) = random_tokens(config.vocab_size, batch * seq, 6);

    let mut host = HostGpt::<f64>::new(config, &layout, batch, seq).unwrap();
    let loss_ref = host.forward(&params64, &inputs, &targets).unwrap();
    let logits_ref = host.activations()[host.plan().acts.logits.clone()].to_vec();
    let mut grads_ref = vec![0.0; layout.padded_len()];
    let mut groups_ref = Vec::new();
    host.backward(&params64, &mut grads_ref, 1.0, |ready, _| groups_ref.push(ready.clone()))
        .unwrap();

    let params_gpu = upload(device, &params);
    let grads_gpu = device.alloc::<bf16>(layout.padded_len()).unwrap();
    let blas = Arc::new(Blas::new(device).unwrap());
    let mut model =
        CudaGpt::with_options(device, blas, config, &layout, batch, seq, options).unwrap();
    model.set_batch(&inputs, &targets).unwrap();
    let mut groups = Vec::new();
    for loss_scale in [1.0, 3.0] {
        model.forward(&params_gpu).unwrap();
        let on_ready = |ready: &GradsReady| groups.push(ready.clone());
        model.backward(&params_gpu, &grads_gpu, loss_scale, on_ready).unwrap();
    }
    let loss = f64::from(model.loss().unwrap());
    let logits: Vec<f64> = model.logits().unwrap().into_iter().map(f64::from).collect();
    let grads: Vec<f64> =
        device.download(&grads_gpu).unwrap().iter().map(|g| g.to_f64() / 4.0).collect();

    let d = format!("d{}{}", config.d_model, if options.fuse_gelu { "" } else { "_unfused" });
    let loss_error = (loss - loss_ref).abs() / loss_ref;
    println!("RESULT gpt_loss {d} gpu={loss:.5} cpu={loss_ref:.5} rel={loss_error:.3e}");
    assert!(loss_error <= 1e-2, "loss {loss} vs {loss_ref}");
    let logits_error = relative_error(&logits, &logits_ref);
    println!("RESULT gpt_logits {d} rel={logits_error:.3e}");
    assert!(logits_error <= TOLERANCE, "logits off by {logits_error:.3e}");
    let mut failures = Vec::new();
    for view in layout.params() {
        let range = view.flat_range();
        let rel = relative_error(&grads[range.clone()], &grads_ref[range]);
        println!("RESULT gpt_grad {d} {} rel={rel:.3e}", view.name);
        // A NaN fails too.
        if rel.is_nan() || rel > TOLERANCE {
            failures.push(format!("{} {rel:.3e}", view.name));
        }
    }
    assert!(failures.is_empty(), "gradients off: {failures:?}");
    let twice: Vec<_> = groups_ref.iter().chain(&groups_ref).cloned().collect();
    assert_eq!(groups, twice, "GradsReady notices differ from the CPU model's");
    assert_eq!(groups[0].group, GradGroup::FinalNorm);
}

/// The 16-byte paths and both GELU fusions (every width a multiple of 8), with tails in the rows
/// (111), the sequence (37) and the vocabulary (301 padded to 320).
#[test]
fn logits_loss_and_every_gradient_match_the_cpu_model_at_odd_sizes() {
    let Some(device) = gpu() else { return };
    check_against_cpu(&device, &TAILS, (3, 37), CudaGptOptions::default());
}

/// The same without the GELU fusions: the GELU kernels and plain cuBLASLt epilogues (a failure
/// only with the fusions points at them).
#[test]
fn without_the_gelu_fusions_too() {
    let Some(device) = gpu() else { return };
    check_against_cpu(&device, &TAILS, (3, 37), CudaGptOptions { fuse_gelu: false });
}

/// Width 15 in 3 heads of 5: the scalar paths of every kernel and the unfused GELU kernels (the
/// fc width 60 is no multiple of 8, which cuBLASLt's GELU epilogues need).
#[test]
fn logits_loss_and_every_gradient_match_the_cpu_model_at_a_width_of_15() {
    let Some(device) = gpu() else { return };
    let narrow = GptConfig { n_layer: 2, n_head: 3, d_model: 15, vocab_size: 70, context: 11 };
    check_against_cpu(&device, &narrow, (2, 9), CudaGptOptions::default());
}

/// The same batch on the same weights gives the same bits twice (no atomics in the kernels).
#[test]
fn the_same_batch_gives_the_same_bits() {
    let Some(device) = gpu() else { return };
    let (batch, seq) = (3, 37);
    let layout = flat_layout(&TAILS, 1).unwrap();
    let params = upload(&device, &random_params(&TAILS, 7));
    let (inputs, targets) = random_tokens(TAILS.vocab_size, batch * seq, 8);
    let mut model = CudaGpt::new(&device, &TAILS, &layout, batch, seq).unwrap();
    model.set_batch(&inputs, &targets).unwrap();
    let mut run = || {
        let grads = device.alloc::<bf16>(layout.padded_len()).unwrap();
        model.forward(&params).unwrap();
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        (model.loss().unwrap(), device.download(&grads).unwrap())
    };
    let (first, second) = (run(), run());
    assert_eq!(first.0.to_bits(), second.0.to_bits());
    assert!(first.1 == second.1, "the gradients differ between two identical runs");
}

/// A token id outside the vocabulary is refused when the batch is set, naming the id.
#[test]
fn a_token_outside_the_vocabulary_is_refused_by_set_batch() {
    let Some(device) = gpu() else { return };
    let layout = flat_layout(&TAILS, 1).unwrap();
    let mut model = CudaGpt::new(&device, &TAILS, &layout, 1, 3).unwrap();
    let error = model.set_batch(&[1, 2, 301], &[1, 2, 3]).unwrap_err().to_string();
    assert!(error.contains("token id 301"), "{error}");
    let error = model.set_batch(&[1, 2, 3], &[1, 2]).unwrap_err().to_string();
    assert!(error.contains("targets"), "{error}");
}

/// The loss at initialisation is ln(vocab) + σ²/2 (see `tests/init_loss.rs`) within 0.1.
#[test]
fn the_loss_at_initialisation_is_ln_vocab() {
    let Some(device) = gpu() else { return };
    for (name, batch, seq) in [("tiny", 4, 64), ("gpt2-124m", 4, 256)] {
        let config = GptConfig::named(name).unwrap();
        let layout = flat_layout(&config, 1).unwrap();
        let mut params = vec![0.0f32; layout.padded_len()];
        init_params(&config, &layout, 42, &mut params).unwrap();
        let params: Vec<bf16> = params.iter().map(|&x| bf16::from_f32(x)).collect();
        let params = upload(&device, &params);
        let mut model = CudaGpt::new(&device, &config, &layout, batch, seq).unwrap();
        let (inputs, targets) = random_tokens(config.vocab_size, batch * seq, 43);
        model.set_batch(&inputs, &targets).unwrap();
        model.forward(&params).unwrap();
        let loss = f64::from(model.loss().unwrap());
        let variance = config.d_model as f64 * 0.02f64.powi(2);
        let expected = (config.vocab_size as f64).ln() + variance / 2.0;
        println!("RESULT gpt_init_loss {name} loss={loss:.4} expected={expected:.4}");
        assert!((loss - expected).abs() <= 0.1, "{name}: loss {loss}, expected {expected}");
    }
}

/// Runs without a GPU wherever libnvrtc loads (and prints `skipped: libnvrtc not found`
/// elsewhere): every module of the model compiles for sm_80 and sm_90.
#[test]
fn model_kernels_compile_with_nvrtc() {
    for arch in [(8, 0), (9, 0)] {
        for (name, source) in SOURCES {
            match compile(name, source, arch, &[]) {
                Ok(cubin) => assert!(!cubin.is_empty()),
                Err(DeviceError::Library { library, reason })
                    if library == CudaLibrary::Nvrtc.name() =>
                {
                    println!("skipped: libnvrtc not found ({reason})");
                    return;
                }
                Err(error) => panic!("{name} for sm_{}{}: {error}", arch.0, arch.1),
            }
        }
    }
}

/// Forward + backward of gpt-1.3b (24 layers, width 2048, 16 heads, vocabulary 50304) at
/// micro-batch 8 × 1024 tokens, timed with device synchronisation: the median of 10 after 3
/// warm-up steps. Prints `RESULT gpt_bench ...`; asserts nothing. Also `zeroflow bench gpt`.
#[test]
#[ignore = "a benchmark: run with --ignored on a GPU"]
fn bench_gpt_1_3b_forward_backward() {
    let Some(device) = gpu() else { return };
    let config = GptConfig::named("gpt-1.3b").unwrap();
    let (batch, seq) = (8, 1024);
    let layout = flat_layout(&config, 1).unwrap();
    let mut params = vec![0.0f32; layout.padded_len()];
    init_params(&config, &layout, 1, &mut params).unwrap();
    let params: Vec<bf16> = params.iter().map(|&x| bf16::from_f32(x)).collect();
    let params = upload(&device, &params);
    let grads = device.alloc::<bf16>(layout.padded_len()).unwrap();
    let mut model = CudaGpt::new(&device, &config, &layout, batch, seq).unwrap();
    let (inputs, targets) = random_tokens(config.vocab_size, batch * seq, 2);
    model.set_batch(&inputs, &targets).unwrap();
    let mut step = || {
        model.forward(&params).unwrap();
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        device.synchronize().unwrap();
    };
    for _ in 0..3 {
        step();
    }
    let mut times: Vec<f64> = (0..10)
        .map(|_| {
            let started = Instant::now();
            step();
            started.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let loss = model.loss().unwrap();
    let gib = |bytes: usize| bytes as f64 / f64::from(1u32 << 30);
    let memory = model.activation_memory();
    let in_use = zeroflow_gpt::cuda::device_memory_in_use(&device).unwrap();
    println!(
        "RESULT gpt_bench model=gpt-1.3b micro_batch={batch} seq={seq} s_per_step={median:.4} \
         tokens_per_s={:.0} activations_gib={:.2} act_grads_gib={:.2} model_total_gib={:.2} \
         device_used_gib={:.2} loss={loss:.3}",
        (batch * seq) as f64 / median,
        gib(memory.activations),
        gib(memory.activation_grads),
        gib(memory.total() + 2 * layout.padded_len() * 2),
        gib(in_use),
    );
}
