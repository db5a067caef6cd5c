//! Sequence packing (`PlanOptions::packed`): a row of several documents, with no attention
//! across their boundaries and positions restarting at each, computes what its documents compute
//! run one by one — its loss is their token-weighted mean loss and its gradients the same
//! weighting of theirs — on the f64 host executor and on the CPU device in f32. A plan built
//! without packing is the plan of before, and so is its CUDA schedule; the packed plan's schedule
//! adds the positions' places to the launches that read them. (The CUDA model on packed rows is
//! tested on the GPU: `tests/cuda/packing.rs`.)

use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::cuda::{CudaGptOptions, planned_memory};
use zeroflow_gpt::{
    AttentionKind, CpuGpt, GptConfig, GptKernel, GptPlan, HostGpt, ParamRanges, Plan, PlanOptions,
    flat_layout,
};
use zeroflow_nn::cuda::schedule::{Op, OpKind, Place, Schedule, Space};
use zeroflow_nn::kernels::LayerKernel;
use zeroflow_nn::{Buf, Launch};

use crate::support::{ODD, perturbed_params, random_batch, relative_error};

/// Two rows of 9 tokens: three documents of different lengths, and two.
const ROWS: [&[usize]; 2] = [&[2, 4, 3], &[5, 4]];
const SEQ: usize = 9;

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

/// The loss and gradients of the packed batch, in f64 on the host.
fn packed_run(
    config: &GptConfig,
    params: &[f64],
    (inputs, targets): (&[u32], &[u32]),
    attention: AttentionKind,
) -> (f64, Vec<f64>) {
    let layout = flat_layout(config, 1).unwrap();
    let mut model =
        HostGpt::<f64>::with_options(config, &layout, ROWS.len(), SEQ, packed(attention)).unwrap();
    let loss = model.forward_packed(params, inputs, targets, &positions()).unwrap();
    let mut grads = vec![0.0; layout.padded_len()];
    model.backward(params, &mut grads, 1.0, |_, _| {}).unwrap();
    (loss, grads)
}

/// The token-weighted mean of the documents' losses, each run alone by the plain (unpacked)
/// model as a batch of one sequence of its length, and the same weighting of their gradients.
fn documents_alone(
    config: &GptConfig,
    params: &[f64],
    (inputs, targets): (&[u32], &[u32]),
    attention: AttentionKind,
) -> (f64, Vec<f64>) {
    let layout = flat_layout(config, 1).unwrap();
    let tokens = (ROWS.len() * SEQ) as f64;
    let (mut loss, mut grads) = (0.0, vec![0.0; layout.padded_len()]);
    for (start, len) in documents() {
        let mut model = HostGpt::<f64>::with_attention(config, &layout, 1, len, attention).unwrap();
        let cells = start..start + len;
        let alone = model.forward(params, &inputs[cells.clone()], &targets[cells]).unwrap();
        let weight = len as f64 / tokens;
        loss += weight * alone;
        model.backward(params, &mut grads, weight, |_, _| {}).unwrap();
    }
    (loss, grads)
}

/// f64 on the host, with either attention: the packed loss is the token-weighted mean of the
/// documents' losses and its gradients theirs, to rounding (1e-12 relative, well inside the
/// issue's 1e-6); an unpacked run of the same rows differs (the check can fail).
#[test]
fn a_packed_row_has_the_token_weighted_loss_and_gradients_of_its_documents_run_alone() {
    let (layout, params) = perturbed_params(&ODD, 7);
    let (inputs, targets) = random_batch(ODD.vocab_size, ROWS.len() * SEQ, 8);
    let batch = (&inputs[..], &targets[..]);
    for attention in [AttentionKind::Gemm, AttentionKind::Flash] {
        let (loss, grads) = packed_run(&ODD, &params, batch, attention);
        let (expected_loss, expected_grads) = documents_alone(&ODD, &params, batch, attention);
        let loss_error = (loss - expected_loss).abs() / expected_loss.abs();
        assert!(loss_error < 1e-12, "{attention:?}: loss {loss} vs {expected_loss}");
        let grads_error = relative_error(&grads, &expected_grads);
        assert!(grads_error < 1e-12, "{attention:?}: gradients differ by {grads_error:e}");
        assert!(grads.iter().any(|&g| g != 0.0), "no gradient at all");

        let mut unpacked =
            HostGpt::<f64>::with_attention(&ODD, &layout, 2, SEQ, attention).unwrap();
        let whole_rows = unpacked.forward(&params, &inputs, &targets).unwrap();
        assert!(
            (whole_rows - expected_loss).abs() > 1e-6,
            "{attention:?}: packing changed nothing"
        );
    }
}

/// The CPU device in f32: the packed loss is the token-weighted mean of the documents' losses
/// within 1e-6 relative (the bound), and the gradients within 1e-6 of their norm.
#[test]
fn a_packed_row_on_the_cpu_device_matches_its_documents_within_f32_rounding() {
    let (layout, params64) = perturbed_params(&ODD, 17);
    let (inputs, targets) = random_batch(ODD.vocab_size, ROWS.len() * SEQ, 18);
    let device = CpuDevice::new().unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let options = packed(AttentionKind::Gemm);
    let mut model = CpuGpt::with_options(&device, &ODD, &layout, ROWS.len(), SEQ, options).unwrap();
    let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
    model.set_packed_batch(&inputs, &targets, &positions()).unwrap();
    model.forward(&params).unwrap();
    let loss = f64::from(model.loss().unwrap());
    model.backward(&params, &grads, 1.0, |_| {}).unwrap();
    let grads: Vec<f64> = device.download(&grads).unwrap().iter().map(|&g| f64::from(g)).collect();

    let tokens = (ROWS.len() * SEQ) as f64;
    let (mut expected_loss, expected_grads) =
        (0.0, device.alloc::<f32>(layout.padded_len()).unwrap());
    for (start, len) in documents() {
        let mut model = CpuGpt::new(&device, &ODD, &layout, 1, len).unwrap();
        let cells = start..start + len;
        model.set_batch(&inputs[cells.clone()], &targets[cells]).unwrap();
        model.forward(&params).unwrap();
        let weight = len as f64 / tokens;
        expected_loss += weight * f64::from(model.loss().unwrap());
        model.backward(&params, &expected_grads, weight, |_| {}).unwrap();
    }
    let expected_grads: Vec<f64> =
        device.download(&expected_grads).unwrap().iter().map(|&g| f64::from(g)).collect();
    let loss_error = (loss - expected_loss).abs() / expected_loss.abs();
    let grads_error = relative_error(&grads, &expected_grads);
    eprintln!("f32 on the CPU device: loss {loss_error:e} relative, gradients {grads_error:e}");
    assert!(loss_error <= 1e-6, "loss {loss} vs {expected_loss}: {loss_error:e}");
    assert!(grads_error <= 1e-6, "gradients differ by {grads_error:e}");
}

/// `launches` without their positions arguments.
fn without_positions(launches: Vec<Launch<GptKernel>>) -> Vec<Launch<GptKernel>> {
    let strip = |launch: Launch<GptKernel>| Launch {
        args: launch.args.into_iter().filter(|arg| arg.buf != Buf::Positions).collect(),
        ..launch
    };
    launches.into_iter().map(strip).collect()
}

/// A plan built without packing reads no positions (it is the plan of before packing), and the
/// packed plan is the same launches with the positions added last to those of the encoder and
/// the attention, forward and backward (recomputed ones included), and to no other.
#[test]
fn packing_only_adds_the_positions_to_the_encoder_and_attention_launches() {
    let layout = flat_layout(&ODD, 1).unwrap();
    let params = ParamRanges::new(&ODD, &layout).unwrap();
    for attention in [AttentionKind::Gemm, AttentionKind::Flash] {
        for activation_checkpointing in [false, true] {
            let options = PlanOptions { attention, activation_checkpointing, packed: false };
            let plain = GptPlan::with_options(&ODD, &params, 2, SEQ, options).unwrap().plan;
            let options = PlanOptions { packed: true, ..options };
            let packed = GptPlan::with_options(&ODD, &params, 2, SEQ, options).unwrap().plan;
            assert!(!plain.is_packed() && packed.is_packed());
            let launches = |plan: &Plan| plan.launches().cloned().collect::<Vec<_>>();
            assert_eq!(without_positions(launches(&packed)), launches(&plain));
            for launch in packed.launches() {
                let reads_positions = launch.args.iter().any(|arg| arg.buf == Buf::Positions);
                let name = launch.kernel.name();
                let should = name.starts_with("encoder") || name.contains("attention");
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
/// encoder and attention operations that read them; the model holds the positions and their
/// buckets (`4·B·T + 1` u32) beyond the plain model's memory.
#[test]
fn the_cuda_schedule_places_the_positions_after_the_targets() {
    let layout = flat_layout(&ODD, 1).unwrap();
    let params = ParamRanges::new(&ODD, &layout).unwrap();
    let tokens = ROWS.len() * SEQ;
    for attention in [AttentionKind::Gemm, AttentionKind::Flash] {
        for activation_checkpointing in [false, true] {
            let options = PlanOptions { attention, activation_checkpointing, packed: false };
            let plain = GptPlan::with_options(&ODD, &params, 2, SEQ, options).unwrap().plan;
            let options = PlanOptions { packed: true, ..options };
            let packed = GptPlan::with_options(&ODD, &params, 2, SEQ, options).unwrap().plan;
            let (plain, packed) =
                (Schedule::new(&plain, true).unwrap(), Schedule::new(&packed, true).unwrap());
            assert_eq!(without_position_places(&packed), without_position_places(&plain));
            assert_eq!(without_position_places(&plain).len(), plain.ops().count());
            let sizes = |s: &Schedule<GptKernel>| (s.acts_len, s.act_grads_len, s.stats_len);
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
                assert!(name.starts_with("encoder") || name.contains("attention"), "{name}");
                readers += 1;
            }
            // The encoder and each layer's attention, forward and backward, and a checkpointed
            // plan's recomputed attention forward of every layer but the last.
            let recomputed = if activation_checkpointing { ODD.n_layer - 1 } else { 0 };
            let expected = 2 + 2 * ODD.n_layer + recomputed;
            assert_eq!(readers, expected, "{attention:?} {activation_checkpointing}");

            let memory = |packed| {
                let options = CudaGptOptions { attention, packed, ..CudaGptOptions::default() };
                planned_memory(&ODD, &layout, (ROWS.len(), SEQ), options).unwrap()
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
