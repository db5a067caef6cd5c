//! `CudaGpt` against the CPU model: logits, loss and every parameter gradient against the f64
//! host path on the same bf16-rounded weights, at sizes with tails everywhere, with either
//! attention (`gemm`, `flash`); the two attentions against each other, and each run twice for the
//! same bits; the loss at initialisation; the kernels compiled by NVRTC without a GPU; and the
//! forward + backward benchmark at gpt-1.3b's size (ignored).

use std::sync::Arc;
use std::time::Instant;

use zeroflow_core::bf16;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::module::compile_for_tests;
use zeroflow_device::{CudaDevice, Device};
use zeroflow_gpt::cuda::kernels::sources;
use zeroflow_gpt::cuda::{ActivationMemory, CudaGptOptions, planned_memory};
use zeroflow_gpt::{
    AttentionKind, CudaGpt, GptConfig, GradGroup, GradsReady, HostGpt, flat_layout, init_params,
};
use zeroflow_nn::kernels::loss::IGNORE;

use crate::gpu;

/// Width 200 (25 vectors of 8) in 4 heads of 50, vocabulary 301 padded to 320, a context of 40
/// used at 37 tokens, two layers, batch 3: 111 rows, a multiple of nothing.
pub(crate) const TAILS: GptConfig =
    GptConfig { n_layer: 2, n_head: 4, d_model: 200, vocab_size: 301, context: 40 };

/// Shapes flash attention takes: three heads of 64 and two of 128, with a context of 80 used at
/// 70 and 65 tokens (sequences that end inside a second 64-row tile).
pub(crate) const FLASH_64: GptConfig =
    GptConfig { n_layer: 2, n_head: 3, d_model: 192, vocab_size: 301, context: 80 };
pub(crate) const FLASH_128: GptConfig =
    GptConfig { n_layer: 2, n_head: 2, d_model: 256, vocab_size: 301, context: 80 };
const FLASH_SHAPES: [(GptConfig, usize, usize); 2] = [(FLASH_64, 3, 70), (FLASH_128, 2, 65)];

/// The largest relative error (‖gpu − cpu‖ / max(‖gpu‖, ‖cpu‖)) allowed per tensor: the GPU keeps
/// every activation and gradient in bf16.
pub(crate) const TOLERANCE: f64 = 2e-2;

pub(crate) fn relative_error(gpu: &[f64], cpu: &[f64]) -> f64 {
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let diff: Vec<f64> = gpu.iter().zip(cpu).map(|(x, y)| x - y).collect();
    norm(&diff) / norm(gpu).max(norm(cpu)).max(1e-30)
}

/// Random parameters (GPT-2's initialisation, then every element moved by up to ±0.05 so that
/// LayerNorm weights and biases are not at their special values), rounded to bf16.
pub(crate) fn random_params(config: &GptConfig, seed: u64) -> Vec<bf16> {
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

pub(crate) fn random_tokens(vocab: usize, n: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut draw = || (0..n).map(|_| rng.random_range(0..vocab as u32)).collect::<Vec<_>>();
    (draw(), draw())
}

fn upload(device: &CudaDevice, values: &[bf16]) -> CudaBuffer<bf16> {
    device.upload(values).unwrap()
}

/// A model of `config` with `attention` (not the one that fits it best: each test
/// says which it checks), its own cuBLASLt handle and the default options.
pub(crate) fn model_with(
    device: &CudaDevice,
    config: &GptConfig,
    (batch, seq): (usize, usize),
    options: CudaGptOptions,
    attention: AttentionKind,
) -> CudaGpt {
    let layout = flat_layout(config, 1).unwrap();
    let blas = Arc::new(Blas::new(device).unwrap());
    let options = CudaGptOptions { attention, ..options };
    CudaGpt::with_options(device, blas, config, &layout, batch, seq, options).unwrap()
}

/// The bits of a gradient buffer (bf16 `==` would equate +0 and −0 and never NaN).
fn bits(values: &[bf16]) -> Vec<u16> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// Forward and backward run twice on the same batch, with loss scales 1 and 3: the second run must
/// find nothing left over from the first in the activation gradients (their first write
/// overwrites) and must add to the parameter gradients, which end at 4 times the reference's.
/// The host runs the plan of the same attention (whose maths is the same either way).
fn check_against_cpu(
    device: &CudaDevice,
    config: &GptConfig,
    shape: (usize, usize),
    options: CudaGptOptions,
    attention: AttentionKind,
) {
    check_against_cpu_masked(device, config, shape, options, attention, false);
}

/// [`check_against_cpu`], with `masked`: every third target and the whole first sequence's
/// targets [`IGNORE`] (the loss-masked positions, which lose nothing and get no gradient).
fn check_against_cpu_masked(
    device: &CudaDevice,
    config: &GptConfig,
    (batch, seq): (usize, usize),
    options: CudaGptOptions,
    attention: AttentionKind,
    masked: bool,
) {
    let layout = flat_layout(config, 1).unwrap();
    let params = random_params(config, 5);
    let params64: Vec<f64> = params.iter().map(|x| x.to_f64()).collect();
    let (inputs, mut targets) = random_tokens(config.vocab_size, batch * seq, 6);
    if masked {
        for (i, target) in targets.iter_mut().enumerate() {
            if i % 3 == 0 || i < seq {
                *target = IGNORE;
            }
        }
    }

    let mut host = HostGpt::<f64>::with_attention(config, &layout, batch, seq, attention).unwrap();
    let loss_ref = host.forward(&params64, &inputs, &targets).unwrap();
    let logits_ref = host.activations()[host.acts().logits.clone()].to_vec();
    let mut grads_ref = vec![0.0; layout.padded_len()];
    let mut groups_ref = Vec::new();
    host.backward(&params64, &mut grads_ref, 1.0, |ready, _| groups_ref.push(ready.clone()))
        .unwrap();

    let params_gpu = upload(device, &params);
    let grads_gpu = device.alloc::<bf16>(layout.padded_len()).unwrap();
    let mut model = model_with(device, config, (batch, seq), options, attention);
    assert_eq!(model.attention(), attention);
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

    let d = format!(
        "d{}{}{}{}",
        config.d_model,
        if options.fuse_gelu { "" } else { "_unfused" },
        if attention == AttentionKind::Flash { "_flash" } else { "" },
        if masked { "_masked" } else { "" }
    );
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
    check_against_cpu(&device, &TAILS, (3, 37), CudaGptOptions::default(), AttentionKind::Gemm);
}

/// The same without the GELU fusions: the GELU kernels and plain cuBLASLt epilogues (a failure
/// only with the fusions points at them).
#[test]
fn without_the_gelu_fusions_too() {
    let Some(device) = gpu() else { return };
    let options = CudaGptOptions { fuse_gelu: false, ..CudaGptOptions::default() };
    check_against_cpu(&device, &TAILS, (3, 37), options, AttentionKind::Gemm);
}

/// Width 15 in 3 heads of 5: the scalar paths of every kernel and the unfused GELU kernels (the
/// fc width 60 is no multiple of 8, which cuBLASLt's GELU epilogues need).
#[test]
fn logits_loss_and_every_gradient_match_the_cpu_model_at_a_width_of_15() {
    let Some(device) = gpu() else { return };
    let narrow = GptConfig { n_layer: 2, n_head: 3, d_model: 15, vocab_size: 70, context: 11 };
    check_against_cpu(&device, &narrow, (2, 9), CudaGptOptions::default(), AttentionKind::Gemm);
}

/// Loss-masked targets ([`IGNORE`]): the CUDA loss kernels (forward, mean over the counted
/// positions, backward) against their CPU twins, through the whole model at odd sizes and at the
/// scalar width, and with flash attention.
#[test]
fn with_ignored_targets_loss_and_every_gradient_match_the_cpu_model() {
    let Some(device) = gpu() else { return };
    let options = CudaGptOptions::default();
    check_against_cpu_masked(&device, &TAILS, (3, 37), options, AttentionKind::Gemm, true);
    let narrow = GptConfig { n_layer: 2, n_head: 3, d_model: 15, vocab_size: 70, context: 11 };
    check_against_cpu_masked(&device, &narrow, (2, 9), options, AttentionKind::Gemm, true);
    let (config, batch, seq) = FLASH_SHAPES[0];
    check_against_cpu_masked(&device, &config, (batch, seq), options, AttentionKind::Flash, true);
}

/// With flash attention, at head sizes 64 and 128.
#[test]
fn with_flash_attention_logits_loss_and_every_gradient_match_the_cpu_model() {
    let Some(device) = gpu() else { return };
    for (config, batch, seq) in FLASH_SHAPES {
        check_against_cpu(
            &device,
            &config,
            (batch, seq),
            CudaGptOptions::default(),
            AttentionKind::Flash,
        );
    }
}

/// One forward and backward of a fresh model with `attention` on the weights and batch of seeds 7
/// and 8: the loss, the gradients (bf16) and the memory the model reports.
fn loss_and_grads(
    device: &CudaDevice,
    config: &GptConfig,
    (batch, seq): (usize, usize),
    attention: AttentionKind,
) -> (f32, Vec<bf16>, ActivationMemory) {
    loss_and_grads_with(device, config, (batch, seq), CudaGptOptions::default(), attention)
}

/// [`loss_and_grads`] of a model with `options` (and `attention`).
fn loss_and_grads_with(
    device: &CudaDevice,
    config: &GptConfig,
    (batch, seq): (usize, usize),
    options: CudaGptOptions,
    attention: AttentionKind,
) -> (f32, Vec<bf16>, ActivationMemory) {
    let layout = flat_layout(config, 1).unwrap();
    let params = upload(device, &random_params(config, 7));
    let (inputs, targets) = random_tokens(config.vocab_size, batch * seq, 8);
    let mut model = model_with(device, config, (batch, seq), options, attention);
    model.set_batch(&inputs, &targets).unwrap();
    let grads = device.alloc::<bf16>(layout.padded_len()).unwrap();
    model.forward(&params).unwrap();
    model.backward(&params, &grads, 1.0, |_| {}).unwrap();
    (model.loss().unwrap(), device.download(&grads).unwrap(), model.activation_memory())
}

/// The same weights and batch through a gemm and a flash model: the loss and every parameter
/// gradient agree within the tolerance both meet against the CPU model, and each model holds the
/// memory `planned_memory` computes without a GPU (flash the less).
#[test]
fn flash_and_gemm_models_agree_on_the_loss_and_every_gradient() {
    let Some(device) = gpu() else { return };
    for (config, batch, seq) in FLASH_SHAPES {
        let layout = flat_layout(&config, 1).unwrap();
        let run = |attention| {
            let (loss, grads, memory) = loss_and_grads(&device, &config, (batch, seq), attention);
            let options = CudaGptOptions { attention, ..CudaGptOptions::default() };
            let planned = planned_memory(&config, &layout, (batch, seq), options);
            assert_eq!(memory, planned.unwrap(), "{attention:?}: the planned memory is off");
            let grads: Vec<f64> = grads.iter().map(|g| g.to_f64()).collect();
            (f64::from(loss), grads, memory)
        };
        let (gemm, flash) = (run(AttentionKind::Gemm), run(AttentionKind::Flash));
        let d = config.d_model;
        let loss_error = (flash.0 - gemm.0).abs() / gemm.0;
        println!(
            "RESULT gpt_flash_vs_gemm d{d} loss flash={:.5} gemm={:.5} rel={loss_error:.3e}",
            flash.0, gemm.0
        );
        assert!(loss_error <= 1e-2, "d{d}: loss {} (flash) vs {} (gemm)", flash.0, gemm.0);
        let mut failures = Vec::new();
        for view in layout.params() {
            let range = view.flat_range();
            let rel = relative_error(&flash.1[range.clone()], &gemm.1[range]);
            println!("RESULT gpt_flash_vs_gemm d{d} {} rel={rel:.3e}", view.name);
            if rel.is_nan() || rel > TOLERANCE {
                failures.push(format!("{} {rel:.3e}", view.name));
            }
        }
        assert!(failures.is_empty(), "d{d}: gradients of flash and gemm differ: {failures:?}");
        assert!(flash.2.total() < gemm.2.total(), "{:?} vs {:?}", flash.2, gemm.2);
    }
}

/// Activation checkpointing on the GPU: the same weights and batch through a checkpointed and a
/// plain model, with either attention, give the same loss and every gradient within the
/// tolerance both meet against the CPU model (printed: whether the bits are the same, which they
/// are where cuBLASLt picks the same algorithms for both layouts: the recomputed forward is the
/// same kernels on the same inputs), and the checkpointed model holds the memory planned for it,
/// less than the plain one's.
#[test]
fn activation_checkpointing_gives_the_plain_gradients_in_less_memory() {
    let Some(device) = gpu() else { return };
    let shapes = [(TAILS, 3, 37, AttentionKind::Gemm)]
        .into_iter()
        .chain(FLASH_SHAPES.map(|(config, batch, seq)| (config, batch, seq, AttentionKind::Flash)));
    for (config, batch, seq, attention) in shapes {
        let layout = flat_layout(&config, 1).unwrap();
        let run = |activation_checkpointing| {
            let options = CudaGptOptions { activation_checkpointing, ..CudaGptOptions::default() };
            let (loss, grads, memory) =
                loss_and_grads_with(&device, &config, (batch, seq), options, attention);
            let options = CudaGptOptions { attention, ..options };
            let planned = planned_memory(&config, &layout, (batch, seq), options).unwrap();
            assert_eq!(memory, planned, "checkpointing {activation_checkpointing}: memory");
            (loss, grads, memory)
        };
        let (plain, checkpointed) = (run(false), run(true));
        let d = config.d_model;
        let same_bits = plain.0.to_bits() == checkpointed.0.to_bits()
            && bits(&plain.1) == bits(&checkpointed.1);
        println!(
            "RESULT gpt_checkpointing d{d} {attention:?} loss plain={:.6} checkpointed={:.6} \
             same_bits={same_bits} memory plain={} checkpointed={}",
            plain.0,
            checkpointed.0,
            plain.2.total(),
            checkpointed.2.total()
        );
        let loss_error =
            (f64::from(checkpointed.0) - f64::from(plain.0)).abs() / f64::from(plain.0);
        assert!(loss_error <= 1e-2, "d{d}: loss {} vs {}", checkpointed.0, plain.0);
        let widen = |grads: &[bf16]| grads.iter().map(|g| g.to_f64()).collect::<Vec<f64>>();
        let (plain_grads, checkpointed_grads) = (widen(&plain.1), widen(&checkpointed.1));
        for view in layout.params() {
            let range = view.flat_range();
            let rel = relative_error(&checkpointed_grads[range.clone()], &plain_grads[range]);
            assert!(rel <= TOLERANCE, "d{d} {attention:?} {}: relative error {rel:e}", view.name);
        }
        assert!(checkpointed.2.total() < plain.2.total(), "{:?} vs {:?}", checkpointed.2, plain.2);
    }
}

/// The same batch on the same weights gives the same bits twice (no atomics in the kernels), a
/// second model's run included.
fn check_same_bits(
    device: &CudaDevice,
    config: &GptConfig,
    (batch, seq): (usize, usize),
    attention: AttentionKind,
) {
    let layout = flat_layout(config, 1).unwrap();
    let params = upload(device, &random_params(config, 7));
    let (inputs, targets) = random_tokens(config.vocab_size, batch * seq, 8);
    let mut model = model_with(device, config, (batch, seq), CudaGptOptions::default(), attention);
    model.set_batch(&inputs, &targets).unwrap();
    let mut run = || {
        let grads = device.alloc::<bf16>(layout.padded_len()).unwrap();
        model.forward(&params).unwrap();
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        (model.loss().unwrap(), bits(&device.download(&grads).unwrap()))
    };
    let (first, second) = (run(), run());
    assert_eq!(first.0.to_bits(), second.0.to_bits(), "{attention:?}: the loss differs");
    assert!(first.1 == second.1, "{attention:?}: the gradients differ between two identical runs");
    let (loss, grads, _) = loss_and_grads(device, config, (batch, seq), attention);
    assert_eq!(first.0.to_bits(), loss.to_bits(), "{attention:?}: another model's loss differs");
    assert!(first.1 == bits(&grads), "{attention:?}: another model's gradients differ");
}

#[test]
fn the_same_batch_gives_the_same_bits() {
    let Some(device) = gpu() else { return };
    check_same_bits(&device, &TAILS, (3, 37), AttentionKind::Gemm);
}

/// FlashAttention's backward sums dq in registers, in a fixed order: no atomics either.
#[test]
fn with_flash_attention_the_same_batch_gives_the_same_bits() {
    let Some(device) = gpu() else { return };
    for (config, batch, seq) in FLASH_SHAPES {
        check_same_bits(&device, &config, (batch, seq), AttentionKind::Flash);
    }
}

/// Flash attention refuses a head size it has no kernels for, saying what to do.
#[test]
fn flash_attention_refuses_other_head_sizes() {
    let Some(device) = gpu() else { return };
    let layout = flat_layout(&TAILS, 1).unwrap();
    let blas = Arc::new(Blas::new(&device).unwrap());
    let options = CudaGptOptions { attention: AttentionKind::Flash, ..CudaGptOptions::default() };
    let error = CudaGpt::with_options(&device, blas, &TAILS, &layout, 3, 37, options)
        .unwrap_err()
        .to_string();
    for needed in ["attention flash", "head sizes [64, 128]", "is 50", "gemm"] {
        assert!(error.contains(needed), "{error}");
    }
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
/// elsewhere): every module of the model (zeroflow-nn's shared ones and GPT-2's own) compiles for
/// sm_80 and sm_90.
#[test]
fn model_kernels_compile_with_nvrtc() {
    let shared = zeroflow_nn::cuda::kernels::SOURCES.map(|(name, source)| (name, source.into()));
    for (name, source) in shared.into_iter().chain(sources()) {
        let compiled = compile_for_tests(name, &source, &[], "");
        if compiled.unwrap_or_else(|e| panic!("{e}")).is_none() {
            return;
        }
    }
}

/// Forward + backward of gpt-1.3b (24 layers, width 2048, 16 heads, vocabulary 50304) at
/// micro-batch 8 × 1024 tokens, timed with device synchronisation: the median of 10 after 3
/// warm-up steps, with the attention that fits it best (flash). Prints
/// `RESULT gpt_bench ...`; asserts nothing. Also `zeroflow bench gpt`.
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
    let attention = model.attention().name();
    let in_use = zeroflow_gpt::cuda::device_memory_in_use(&device).unwrap();
    println!(
        "RESULT gpt_bench model=gpt-1.3b attention={attention} micro_batch={batch} seq={seq} \
         s_per_step={median:.4} tokens_per_s={:.0} activations_gib={:.2} act_grads_gib={:.2} \
         model_total_gib={:.2} device_used_gib={:.2} loss={loss:.3}",
        (batch * seq) as f64 / median,
        gib(memory.activations),
        gib(memory.activation_grads),
        gib(memory.total() + 2 * layout.padded_len() * 2),
        gib(in_use),
    );
}
