//! `CudaLlama` against the f64 host model: loss, logits and every parameter gradient on the same
//! bf16-rounded weights, at the odd tiny shapes of the CPU tests (grouped-query 3:1 and
//! multi-query, `head_dim` ≠ hidden / heads, q/k/v and o biases, Qwen3's q/k norm, llama3 rope
//! scaling, tied and untied heads) with gemm attention, and at head sizes 64 and 128 with both
//! attentions, each gradient within 2e-2 or twice its bf16 floor (how much the host's f64 gradient
//! moves when the weights move by one bf16 rounding), whichever is larger; each run twice (loss
//! scales 1 and 3) so that leftovers in the activation gradients show and the parameter gradients
//! add up; the grads-ready notices in the host's order; the memory the model holds is what
//! `planned_memory` computes without a GPU; and a benchmark at llama-1b's size (ignored).

use std::sync::Arc;

use serde_json::json;
use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::{CudaDevice, Device};
use zeroflow_llama::cuda::{CudaLlamaOptions, planned_memory};
use zeroflow_llama::{AttentionKind, CudaLlama, HostLlama, LlamaConfig, PlanOptions};
use zeroflow_nn::GradsReady;

use crate::gpu;
use crate::support::{models, perturbed_params, random_batch, relative_error, tiny};

/// The largest relative error (‖gpu − cpu‖ / max(‖gpu‖, ‖cpu‖)) allowed per tensor, at least: the
/// GPU keeps every activation and gradient in bf16. A gradient more sensitive to bf16 rounding
/// than that gets [`FLOOR_FACTOR`] times its [`bf16_floors`] instead.
pub(crate) const TOLERANCE: f64 = 2e-2;

/// How far above its bf16 floor a gradient of the GPU may be: the floor moves the weights alone
/// by one rounding, the GPU also rounds every activation and activation gradient, each at the
/// same scale.
pub(crate) const FLOOR_FACTOR: f64 = 2.0;

/// The largest floor the check takes: past it a tensor's gradient is too ill-conditioned at these
/// sizes for a comparison at bf16 precision to mean anything. The largest of these tests' floors
/// (four draws each) is 6.9e-2, the k bias of the Qwen2 model with q/k/v biases, whose GPU error
/// was 1.6e-2; the next 4.9e-2.
pub(crate) const MAX_FLOOR: f64 = 0.1;

/// Models flash attention takes: 6 query heads of 64 on 2 key/value heads with Qwen3's q/k norm
/// (q width 384 over hidden 96), and 2 heads of 128 on 1 with Qwen2's q/k/v biases; both at
/// sequences that end inside a second 64-row tile.
pub(crate) fn flash_models() -> Vec<(&'static str, LlamaConfig, (usize, usize))> {
    vec![
        (
            "qwen3 gqa 3:1 head_dim 64",
            tiny(
                "Qwen3ForCausalLM",
                json!({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
                       "head_dim": 64, "intermediate_size": 40, "initializer_range": 0.05}),
            ),
            (2, 70),
        ),
        (
            "qwen2 mqa head_dim 128 biases",
            tiny(
                "Qwen2ForCausalLM",
                json!({"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
                       "head_dim": null, "intermediate_size": 72, "initializer_range": 0.05}),
            ),
            (2, 65),
        ),
    ]
}

pub(crate) fn to_bf16(values: &[f64]) -> Vec<bf16> {
    values.iter().map(|&x| bf16::from_f64(x)).collect()
}

/// A model of `config` with `attention`, its own cuBLASLt handle.
fn model_with(
    device: &CudaDevice,
    config: &LlamaConfig,
    (batch, seq): (usize, usize),
    attention: AttentionKind,
) -> CudaLlama {
    let layout = zeroflow_llama::flat_layout(config, 1).unwrap();
    let blas = Arc::new(Blas::new(device).unwrap());
    let options = CudaLlamaOptions { attention, ..CudaLlamaOptions::default() };
    CudaLlama::with_options(device, blas, config, &layout, (batch, seq), options).unwrap()
}

/// The host's gradients of `params` on one batch (of packed rows where `positions` are given),
/// and the grads-ready notices.
pub(crate) fn host_grads(
    config: &LlamaConfig,
    params: &[f64],
    batch: (&[u32], &[u32], usize, usize),
    attention: AttentionKind,
    positions: Option<&[u32]>,
) -> (f64, Vec<f64>, Vec<f64>, Vec<GradsReady>) {
    let (inputs, targets, batch, seq) = batch;
    let layout = zeroflow_llama::flat_layout(config, 1).unwrap();
    let options = PlanOptions { attention, packed: positions.is_some(), ..PlanOptions::default() };
    let mut host = HostLlama::<f64>::with_options(config, &layout, batch, seq, options).unwrap();
    let loss = match positions {
        None => host.forward(params, inputs, targets).unwrap(),
        Some(positions) => host.forward_packed(params, inputs, targets, positions).unwrap(),
    };
    let logits = host.logits().to_vec();
    let mut grads = vec![0.0; layout.padded_len()];
    let mut groups = Vec::new();
    host.backward(params, &mut grads, 1.0, |ready, _| groups.push(ready.clone())).unwrap();
    (loss, logits, grads, groups)
}

/// Each parameter's bf16 floor: the largest relative change of the host's (f64) gradient of that
/// tensor over [`FLOOR_DRAWS`] draws of moving every weight by a random relative amount within
/// ±2⁻⁸, the largest rounding of a value to bf16. One draw is a noisy estimate: for the k bias of
/// the model with attention biases (packed rows, a gradient of norm 0.012 against 0.25 for its
/// weight: a sum of terms that nearly cancel) eight draws gave 6.4e-3 to 2.4e-2. Gradients that
/// sum many terms of both signs over few rows (norm weights and biases of these tiny models: 21
/// to 140 rows) have floors of 1e-2 to 4e-2, as large as the GPU's error; most others sit near
/// 5e-3. Of packed rows where `positions` are given.
pub(crate) fn bf16_floors(
    config: &LlamaConfig,
    params: &[f64],
    batch: (&[u32], &[u32], usize, usize),
    (attention, positions): (AttentionKind, Option<&[u32]>),
    reference: &[f64],
) -> Vec<f64> {
    use rand::{Rng, SeedableRng};
    let layout = zeroflow_llama::flat_layout(config, 1).unwrap();
    let mut floors = vec![0.0f64; layout.params().len()];
    for seed in 9..9 + FLOOR_DRAWS {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let moved: Vec<f64> =
            params.iter().map(|&w| w * (1.0 + rng.random_range(-1.0..1.0) / 256.0)).collect();
        let (_, _, grads, _) = host_grads(config, &moved, batch, attention, positions);
        for (floor, view) in floors.iter_mut().zip(layout.params()) {
            let range = view.flat_range();
            *floor = floor.max(relative_error(&grads[range.clone()], &reference[range]));
        }
    }
    floors
}

/// How many random bf16-sized moves of the weights [`bf16_floors`] takes the largest effect of.
const FLOOR_DRAWS: u64 = 4;

/// Forward and backward twice on the same batch, with loss scales 1 and 3: the second run must
/// find nothing left from the first in the activation gradients (their first write overwrites)
/// and must add to the parameter gradients, which end at 4 times the host's. The host runs the
/// plan of the same attention on the bf16-rounded weights in f64. Each gradient tensor must be
/// within [`TOLERANCE`], or [`FLOOR_FACTOR`] times its bf16 floor where that is larger.
fn check_against_host(
    device: &CudaDevice,
    what: &str,
    config: &LlamaConfig,
    (batch, seq): (usize, usize),
    attention: AttentionKind,
) {
    let (layout, params64) = perturbed_params(config, 5);
    let params = to_bf16(&params64);
    let params64: Vec<f64> = params.iter().map(|x| x.to_f64()).collect();
    let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 6);
    let tokens = (&inputs[..], &targets[..], batch, seq);
    let (loss_ref, logits_ref, grads_ref, groups_ref) =
        host_grads(config, &params64, tokens, attention, None);
    let floors = bf16_floors(config, &params64, tokens, (attention, None), &grads_ref);

    let params_gpu = device.upload(&params).unwrap();
    let grads_gpu = device.alloc::<bf16>(layout.padded_len()).unwrap();
    let mut model = model_with(device, config, (batch, seq), attention);
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

    let label = format!("{what} {attention:?} B{batch} T{seq}").replace(' ', "_");
    let loss_error = (loss - loss_ref).abs() / loss_ref;
    println!("RESULT llama_loss {label} gpu={loss:.5} cpu={loss_ref:.5} rel={loss_error:.3e}");
    assert!(loss_error <= 1e-2, "{what}: loss {loss} vs {loss_ref}");
    let logits_error = relative_error(&logits, &logits_ref);
    println!("RESULT llama_logits {label} rel={logits_error:.3e}");
    assert!(logits_error <= TOLERANCE, "{what}: logits off by {logits_error:.3e}");
    let mut failures = Vec::new();
    for (view, &floor) in layout.params().iter().zip(&floors) {
        let range = view.flat_range();
        let rel = relative_error(&grads[range.clone()], &grads_ref[range]);
        let bound = TOLERANCE.max(FLOOR_FACTOR * floor);
        println!(
            "RESULT llama_grad {label} {} rel={rel:.3e} bf16_floor={floor:.3e} bound={bound:.3e}",
            view.name
        );
        assert!(floor <= MAX_FLOOR, "{what}: {} has a bf16 floor of {floor:.3e}", view.name);
        // A NaN fails too.
        if rel.is_nan() || rel > bound {
            failures.push(format!("{} {rel:.3e} (bound {bound:.3e})", view.name));
        }
    }
    assert!(failures.is_empty(), "{what}: gradients off: {failures:?}");
    let twice: Vec<_> = groups_ref.iter().chain(&groups_ref).cloned().collect();
    assert_eq!(groups, twice, "{what}: GradsReady notices differ from the host model's");

    let options = CudaLlamaOptions { attention, ..CudaLlamaOptions::default() };
    let planned = planned_memory(config, &layout, (batch, seq), options).unwrap();
    assert_eq!(model.activation_memory(), planned, "{what}: the planned memory is off");
}

/// Every tiny model of the CPU tests (head sizes 4 and 6: gemm attention), at 3 sequences of 7.
#[test]
fn loss_logits_and_every_gradient_match_the_host_model_at_odd_shapes() {
    let Some(device) = gpu() else { return };
    for (what, config) in models() {
        check_against_host(&device, what, &config, (3, 7), AttentionKind::Gemm);
    }
}

/// Head sizes 64 and 128, with flash and with gemm attention.
#[test]
fn with_flash_and_gemm_attention_at_head_sizes_64_and_128() {
    let Some(device) = gpu() else { return };
    for (what, config, batch_seq) in flash_models() {
        for attention in [AttentionKind::Flash, AttentionKind::Gemm] {
            check_against_host(&device, what, &config, batch_seq, attention);
        }
    }
}

/// The same weights and batch twice through one flash model give the same bits: no kernel of
/// the family or of the flash attention uses atomics.
#[test]
fn a_second_step_repeats_the_first_bit_for_bit() {
    let Some(device) = gpu() else { return };
    let (what, config, (batch, seq)) = flash_models().remove(0);
    let (layout, params64) = perturbed_params(&config, 7);
    let params = device.upload(&to_bf16(&params64)).unwrap();
    let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 8);
    let mut model = model_with(&device, &config, (batch, seq), AttentionKind::Flash);
    model.set_batch(&inputs, &targets).unwrap();
    let mut runs = Vec::new();
    for _ in 0..2 {
        let grads = device.alloc::<bf16>(layout.padded_len()).unwrap();
        model.forward(&params).unwrap();
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        let bits: Vec<u16> = device.download(&grads).unwrap().iter().map(|g| g.to_bits()).collect();
        runs.push((model.loss().unwrap().to_bits(), bits));
    }
    assert!(runs[0] == runs[1], "{what}: a second step differs from the first");
    println!("RESULT llama_repeat {} bit-identical", what.replace(' ', "_"));
}

/// Without a GPU: the CUDA executor's schedule takes the plan of every model of these tests
/// with either attention (every activation gradient written before it is read, attention's
/// backward the first to write dqkv), and at head sizes 64 and 128 flash attention holds fewer
/// activations than gemm (the log-sum-exp instead of the weights).
#[test]
fn the_cuda_schedule_takes_every_model_of_these_tests() {
    let tiny = models().into_iter().map(|(what, config)| (what, config, (3, 7)));
    for (what, config, batch_seq) in tiny.chain(flash_models()) {
        let layout = zeroflow_llama::flat_layout(&config, 1).unwrap();
        let memory = |attention| {
            let options = CudaLlamaOptions { attention, ..CudaLlamaOptions::default() };
            planned_memory(&config, &layout, batch_seq, options)
                .unwrap_or_else(|e| panic!("{what} {attention:?}: {e}"))
        };
        let gemm = memory(AttentionKind::Gemm);
        assert!(gemm.activations > 0 && gemm.scratch > 0, "{what}: {gemm:?}");
        if config.head_dim == 64 || config.head_dim == 128 {
            let flash = memory(AttentionKind::Flash);
            assert!(flash.activations < gemm.activations, "{what}: {flash:?} vs {gemm:?}");
        }
    }
}

/// Forward + backward of llama-1b (16 layers, hidden 2048, 32 query heads on 8 key/value heads
/// of 64, vocabulary 128256, tied) at micro-batch 4 × 1024 tokens with flash attention: the
/// median of 5 steps after 2, then one profiled step (the five most expensive kinds of
/// operation). Prints `RESULT llama_bench ...`; asserts nothing.
#[test]
#[ignore = "a benchmark: run with --ignored on a GPU"]
fn bench_llama_1b_forward_backward() {
    let Some(device) = gpu() else { return };
    let config = zeroflow_llama::named_shape("llama-1b").unwrap();
    let (batch, seq) = (4, 1024);
    let layout = zeroflow_llama::flat_layout(&config, 1).unwrap();
    let mut params = vec![0.0f32; layout.padded_len()];
    zeroflow_llama::init_params(&config, &layout, 1, &mut params).unwrap();
    let params: Vec<bf16> = params.iter().map(|&x| bf16::from_f32(x)).collect();
    let params = device.upload(&params).unwrap();
    let grads = device.alloc::<bf16>(layout.padded_len()).unwrap();
    let mut model = CudaLlama::new(&device, &config, &layout, batch, seq).unwrap();
    let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 2);
    model.set_batch(&inputs, &targets).unwrap();
    let mut times: Vec<f64> = (0..7)
        .map(|_| {
            let started = std::time::Instant::now();
            model.forward(&params).unwrap();
            model.backward(&params, &grads, 1.0, |_| {}).unwrap();
            device.synchronize().unwrap();
            started.elapsed().as_secs_f64()
        })
        .skip(2)
        .collect();
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let loss = model.loss().unwrap();
    let memory = model.activation_memory();
    println!(
        "RESULT llama_bench model=llama-1b attention={} micro_batch={batch} seq={seq} \
         s_per_step={median:.4} tokens_per_s={:.0} model_total_gib={:.2} loss={loss:.3}",
        model.attention().name(),
        (batch * seq) as f64 / median,
        memory.total() as f64 / f64::from(1u32 << 30),
    );
    let mut profile = model.profile(&params, &grads).unwrap();
    profile.sort_by_key(|(_, time)| std::cmp::Reverse(*time));
    for (name, time) in profile.iter().take(5) {
        println!("RESULT llama_bench_op {name} ms={:.3}", time.as_secs_f64() * 1e3);
    }
}
