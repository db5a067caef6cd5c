//! Sequence packing (`PlanOptions::packed`) on every tiny model of the family's checks (GQA
//! 3:1 untied, llama3 rope scaling with biases and tied embeddings, Qwen2 biases, Qwen3 q/k
//! norm, Mistral tied, MQA): a row of several documents, with no attention across their
//! boundaries and each token rotated by its position in its document, computes what its
//! documents compute run one by one — its loss is their token-weighted mean loss and its
//! gradients the same weighting of theirs — on the f64 host executor and on the CPU device in
//! f32. A plan built without packing is the plan of before, and so is its CUDA schedule; the
//! packed plan's schedule adds the positions' places to the launches that read them. (The CUDA
//! model on packed rows is tested on the GPU: `tests/cuda/packing.rs`.)

use zeroflow_device::{CpuDevice, Device};
use zeroflow_llama::cuda::{CudaLlamaOptions, planned_memory};
use zeroflow_llama::{
    AttentionKind, CpuLlama, HostLlama, LlamaConfig, LlamaKernel, LlamaPlan, ParamRanges, Plan,
    PlanOptions, flat_layout,
};
use zeroflow_nn::cuda::schedule::{Op, OpKind, Place, Schedule, Space};
use zeroflow_nn::kernels::LayerKernel;
use zeroflow_nn::{Buf, Launch};

use crate::support::{models, perturbed_params, random_batch, relative_error};

/// Two rows of 9 tokens: three documents of different lengths, and two.
const ROWS: [&[usize]; 2] = [&[2, 4, 3], &[5, 4]];
const SEQ: usize = 9;

const ATTENTIONS: [AttentionKind; 2] = [AttentionKind::Gemm, AttentionKind::Flash];

fn packed(attention: AttentionKind) -> PlanOptions {
    PlanOptions { attention, packed: true, ..PlanOptions::default() }
}

/// Each token's position in its document, row by row.
fn positions() -> Vec<u32> {
    ROWS.iter().flat_map(|lengths| lengths.iter().flat_map(|&len| 0..len as u32)).collect()
}

/// The documents as (first token in the batch, length).
fn documents() -> Vec<(usize, usize)> {
    let mut documents = Vec::new();
    for (b, lengths) in ROWS.iter().enumerate() {
        let mut start = b * SEQ;
        for &len in lengths.iter() {
            documents.push((start, len));
            start += len;
        }
    }
    documents
}

/// The packed batch's loss and gradients, and the token-weighted mean of the documents' losses
/// (each run alone by the plain model as a batch of one sequence of its length) with the same
/// weighting of their gradients; in f64 on the host.
fn packed_and_alone(
    config: &LlamaConfig,
    params: &[f64],
    (inputs, targets): (&[u32], &[u32]),
    attention: AttentionKind,
) -> ((f64, Vec<f64>), (f64, Vec<f64>)) {
    let layout = flat_layout(config, 1).unwrap();
    let options = packed(attention);
    let mut model = HostLlama::<f64>::with_options(config, &layout, 2, SEQ, options).unwrap();
    let loss = model.forward_packed(params, inputs, targets, &positions()).unwrap();
    let mut grads = vec![0.0; layout.padded_len()];
    model.backward(params, &mut grads, 1.0, |_, _| {}).unwrap();

    let tokens = (ROWS.len() * SEQ) as f64;
    let (mut alone_loss, mut alone_grads) = (0.0, vec![0.0; layout.padded_len()]);
    for (start, len) in documents() {
        let mut model = HostLlama::<f64>::new(config, &layout, 1, len, attention).unwrap();
        let cells = start..start + len;
        let loss = model.forward(params, &inputs[cells.clone()], &targets[cells]).unwrap();
        let weight = len as f64 / tokens;
        alone_loss += weight * loss;
        model.backward(params, &mut alone_grads, weight, |_, _| {}).unwrap();
    }
    ((loss, grads), (alone_loss, alone_grads))
}

/// f64 on the host, every model, either attention: the packed loss is the token-weighted mean
/// of the documents' losses and its gradients theirs, to rounding (1e-12 relative, well inside
/// the 1e-6); an unpacked run of the same rows differs (the check can fail).
#[test]
fn a_packed_row_has_the_token_weighted_loss_and_gradients_of_its_documents_run_alone() {
    for (seed, (what, config)) in models().into_iter().enumerate() {
        let (layout, params) = perturbed_params(&config, 200 + seed as u64);
        let (inputs, targets) =
            random_batch(config.vocab_size, ROWS.len() * SEQ, 210 + seed as u64);
        let batch = (&inputs[..], &targets[..]);
        for attention in ATTENTIONS {
            let ((loss, grads), (expected_loss, expected_grads)) =
                packed_and_alone(&config, &params, batch, attention);
            let loss_error = (loss - expected_loss).abs() / expected_loss.abs();
            assert!(loss_error < 1e-12, "{what} {attention:?}: loss {loss} vs {expected_loss}");
            let grads_error = relative_error(&grads, &expected_grads);
            assert!(grads_error < 1e-12, "{what} {attention:?}: gradients {grads_error:e}");
            assert!(grads.iter().any(|&g| g != 0.0), "{what}: no gradient at all");

            let mut unpacked = HostLlama::<f64>::new(&config, &layout, 2, SEQ, attention).unwrap();
            let whole_rows = unpacked.forward(&params, &inputs, &targets).unwrap();
            let changed = (whole_rows - expected_loss).abs() > 1e-6;
            assert!(changed, "{what} {attention:?}: packing changed nothing");
        }
    }
}

/// The CPU device in f32, every model: the packed loss is the token-weighted mean of the
/// documents' losses within 1e-6 relative (the bound), and the gradients within 1e-6 of
/// their norm.
#[test]
fn a_packed_row_on_the_cpu_device_matches_its_documents_within_f32_rounding() {
    let device = CpuDevice::new().unwrap();
    for (seed, (what, config)) in models().into_iter().enumerate() {
        let (layout, params64) = perturbed_params(&config, 300 + seed as u64);
        let (inputs, targets) =
            random_batch(config.vocab_size, ROWS.len() * SEQ, 310 + seed as u64);
        let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
        let params = device.upload(&params32).unwrap();
        let options = packed(AttentionKind::Gemm);
        let mut model = CpuLlama::with_options(&device, &config, &layout, 2, SEQ, options).unwrap();
        let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
        model.set_packed_batch(&inputs, &targets, &positions()).unwrap();
        model.forward(&params).unwrap();
        let loss = f64::from(model.loss().unwrap());
        model.backward(&params, &grads, 1.0, |_| {}).unwrap();

        let tokens = (ROWS.len() * SEQ) as f64;
        let mut expected_loss = 0.0;
        let expected_grads = device.alloc::<f32>(layout.padded_len()).unwrap();
        for (start, len) in documents() {
            let gemm = AttentionKind::Gemm;
            let mut model = CpuLlama::new(&device, &config, &layout, 1, len, gemm).unwrap();
            let cells = start..start + len;
            model.set_batch(&inputs[cells.clone()], &targets[cells]).unwrap();
            model.forward(&params).unwrap();
            let weight = len as f64 / tokens;
            expected_loss += weight * f64::from(model.loss().unwrap());
            model.backward(&params, &expected_grads, weight, |_| {}).unwrap();
        }
        let download = |buffer| -> Vec<f64> {
            device.download(buffer).unwrap().iter().map(|&g| f64::from(g)).collect()
        };
        let (grads, expected_grads) = (download(&grads), download(&expected_grads));
        let loss_error = (loss - expected_loss).abs() / expected_loss.abs();
        let grads_error = relative_error(&grads, &expected_grads);
        eprintln!("{what}: f32 loss {loss_error:e} relative, gradients {grads_error:e}");
        assert!(loss_error <= 1e-6, "{what}: loss {loss} vs {expected_loss}");
        assert!(grads_error <= 1e-6, "{what}: gradients differ by {grads_error:e}");
    }
}

/// `launches` without their positions arguments.
fn without_positions(launches: Vec<Launch<LlamaKernel>>) -> Vec<Launch<LlamaKernel>> {
    let strip = |launch: Launch<LlamaKernel>| Launch {
        args: launch.args.into_iter().filter(|arg| arg.buf != Buf::Positions).collect(),
        ..launch
    };
    launches.into_iter().map(strip).collect()
}

/// A plan built without packing reads no positions (it is the plan of before packing), and the
/// packed plan is the same launches with the positions added last to those of the rotation and
/// the attention, forward and backward (recomputed ones included), and to no other.
#[test]
fn packing_only_adds_the_positions_to_the_rotary_and_attention_launches() {
    let (_, config) = models().remove(0);
    let layout = flat_layout(&config, 1).unwrap();
    let params = ParamRanges::new(&config, &layout).unwrap();
    for attention in ATTENTIONS {
        for activation_checkpointing in [false, true] {
            let options = PlanOptions { attention, activation_checkpointing, packed: false };
            let plain = LlamaPlan::with_options(&config, &params, 2, SEQ, options).unwrap().plan;
            let options = PlanOptions { packed: true, ..options };
            let packed = LlamaPlan::with_options(&config, &params, 2, SEQ, options).unwrap().plan;
            assert!(!plain.is_packed() && packed.is_packed());
            let launches = |plan: &Plan| plan.launches().cloned().collect::<Vec<_>>();
            assert_eq!(without_positions(launches(&packed)), launches(&plain));
            for launch in packed.launches() {
                let reads_positions = launch.args.iter().any(|arg| arg.buf == Buf::Positions);
                let name = launch.kernel.name();
                let should = name.starts_with("rope") || name.contains("attention");
                assert_eq!(reads_positions, should, "{name}");
                if should {
                    assert_eq!(launch.args.last().map(|arg| arg.buf), Some(Buf::Positions));
                }
            }
        }
    }
}

/// Without a GPU: the CUDA schedule of a packed plan is that of the plain plan (the same
/// operations, places and buffers, so the unpacked path runs what it ran before) with the
/// positions placed after the targets in the token buffer, last among the arguments of the
/// rotary and attention operations that read them; the model holds the positions and their
/// buckets (`4·B·T + 1` u32) beyond the plain model's memory.
#[test]
fn the_cuda_schedule_places_the_positions_after_the_targets() {
    let (_, config) = models().remove(0);
    let layout = flat_layout(&config, 1).unwrap();
    let params = ParamRanges::new(&config, &layout).unwrap();
    let tokens = ROWS.len() * SEQ;
    for attention in ATTENTIONS {
        for activation_checkpointing in [false, true] {
            let options = PlanOptions { attention, activation_checkpointing, packed: false };
            let plain = LlamaPlan::with_options(&config, &params, 2, SEQ, options).unwrap().plan;
            let options = PlanOptions { packed: true, ..options };
            let packed = LlamaPlan::with_options(&config, &params, 2, SEQ, options).unwrap().plan;
            let (plain, packed) =
                (Schedule::new(&plain, false).unwrap(), Schedule::new(&packed, false).unwrap());
            assert_eq!(without_position_places(&packed), without_position_places(&plain));
            assert_eq!(without_position_places(&plain).len(), plain.ops().count());
            let sizes = |s: &Schedule<LlamaKernel>| (s.acts_len, s.act_grads_len, s.stats_len);
            assert_eq!(sizes(&packed), sizes(&plain));
            assert_eq!((plain.tokens_len, packed.tokens_len), (2 * tokens, 3 * tokens));
            let mut readers = 0;
            for op in packed.ops() {
                let at = |place: &Place| place.space == Space::Tokens && place.offset >= 2 * tokens;
                let Some(index) = op.args.iter().position(at) else { continue };
                assert_eq!(index, op.args.len() - 1, "{}: positions last", op.name());
                assert_eq!(op.args[index].offset, 2 * tokens);
                assert_eq!(op.args[index].len, tokens);
                let name = op.name();
                assert!(name.starts_with("rope") || name.contains("attention"), "{name}");
                readers += 1;
            }
            // Each layer's rotation and attention, forward and backward, and a checkpointed
            // plan's recomputed forward ones of every layer but the last.
            let layers = config.num_hidden_layers;
            let recomputed = if activation_checkpointing { 2 * (layers - 1) } else { 0 };
            let expected = 4 * layers + recomputed;
            assert_eq!(readers, expected, "{attention:?} {activation_checkpointing}");

            let memory = |packed| {
                let options = CudaLlamaOptions { attention, packed, ..CudaLlamaOptions::default() };
                planned_memory(&config, &layout, (ROWS.len(), SEQ), options).unwrap()
            };
            let (plain, packed) = (memory(false), memory(true));
            assert_eq!(packed.scratch - plain.scratch, (4 * tokens + 1) * size_of::<u32>());
            assert_eq!(packed.total() - plain.total(), packed.scratch - plain.scratch);
        }
    }
}

/// `schedule`'s operations without the places of a packed plan's positions (those of the token
/// buffer from `2 · tokens` on).
fn without_position_places<X: LayerKernel>(schedule: &Schedule<X>) -> Vec<(OpKind<X>, Vec<Place>)> {
    let positions = schedule.positions_offset();
    let strip = |op: &Op<X>| {
        let kept = op
            .args
            .iter()
            .filter(|place| !(place.space == Space::Tokens && place.offset >= positions));
        (op.kind.clone(), kept.copied().collect())
    };
    schedule.ops().map(strip).collect()
}
