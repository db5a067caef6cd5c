//! Activation checkpointing (zeroflow-nn's `checkpoint`, GPT-2's `PlanOptions`): the checkpointed
//! plan gives the loss and gradients of the plain one, bit for bit, on the f64 host executor and
//! on the CPU device; it keeps less; its CUDA schedule still fuses and packs; and the planned GPU
//! memory at the named sizes, printed.

use zeroflow_device::{CpuDevice, Device};
use zeroflow_gpt::cuda::{CudaGptOptions, planned_memory};
use zeroflow_gpt::kernels::Kernel;
use zeroflow_gpt::{
    AttentionKind, CpuGpt, GptConfig, GptKernel, GptPlan, GradsReady, HostGpt, ParamRanges,
    PlanOptions, flat_layout,
};
use zeroflow_nn::cuda::schedule::{OpKind, Schedule};
use zeroflow_nn::{Buf, Step};

use crate::support::{perturbed_params, random_batch};

/// Three blocks (two of them recomputed), width 20 in 4 heads of 5, odd sequence length 7.
const THREE: GptConfig =
    GptConfig { n_layer: 3, n_head: 4, d_model: 20, vocab_size: 37, context: 11 };

/// Head size 64, for flash attention's plan.
const FLASH: GptConfig =
    GptConfig { n_layer: 3, n_head: 2, d_model: 128, vocab_size: 37, context: 11 };

fn options(attention: AttentionKind, activation_checkpointing: bool) -> PlanOptions {
    PlanOptions { attention, activation_checkpointing, ..PlanOptions::default() }
}

fn plan(config: &GptConfig, (batch, seq): (usize, usize), options: PlanOptions) -> GptPlan {
    let layout = flat_layout(config, 1).unwrap();
    let params = ParamRanges::new(config, &layout).unwrap();
    GptPlan::with_options(config, &params, batch, seq, options).unwrap()
}

/// The f64 host executor: loss, every gradient and the gradient notices of the checkpointed plan
/// equal the plain plan's exactly (recomputation runs the same kernels on the same inputs), with
/// either attention.
#[test]
fn checkpointing_changes_no_bit_of_the_f64_loss_and_gradients() {
    for (config, attention) in [(THREE, AttentionKind::Gemm), (FLASH, AttentionKind::Flash)] {
        let (batch, seq) = (2, 7);
        let (layout, params) = perturbed_params(&config, 31);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 32);
        let run = |checkpointing| {
            let options = options(attention, checkpointing);
            let mut model = HostGpt::<f64>::with_options(&config, &layout, batch, seq, options);
            let model = model.as_mut().unwrap();
            let loss = model.forward(&params, &inputs, &targets).unwrap();
            let mut grads = vec![0.0; layout.padded_len()];
            let mut notices: Vec<GradsReady> = Vec::new();
            model
                .backward(&params, &mut grads, 1.0, |ready, _| notices.push(ready.clone()))
                .unwrap();
            let bits: Vec<u64> = grads.iter().map(|g| g.to_bits()).collect();
            (loss.to_bits(), bits, notices, model.plan().acts_len)
        };
        let (plain, checkpointed) = (run(false), run(true));
        assert_eq!(plain.0, checkpointed.0, "{attention:?}: the loss differs");
        assert!(plain.1 == checkpointed.1, "{attention:?}: the gradients differ");
        assert_eq!(plain.2, checkpointed.2, "{attention:?}: the notices differ");
        assert!(checkpointed.3 < plain.3, "{attention:?}: {} vs {}", checkpointed.3, plain.3);
    }
}

/// The CPU device in f32: the checkpointed model's loss and gradients are the plain model's, bit
/// for bit, twice in a row (the second backward adds to the first's gradients, so nothing the
/// recomputation or the re-zeroing leaves behind may leak into it).
#[test]
fn checkpointing_changes_no_bit_of_the_f32_loss_and_gradients_on_the_cpu_device() {
    let (batch, seq) = (3, 7);
    let (layout, params64) = perturbed_params(&THREE, 41);
    let (inputs, targets) = random_batch(THREE.vocab_size, batch * seq, 42);
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let device = CpuDevice::new().unwrap();
    let params = device.upload(&params32).unwrap();
    let run = |checkpointing| {
        let options = options(AttentionKind::Gemm, checkpointing);
        let mut model =
            CpuGpt::with_options(&device, &THREE, &layout, batch, seq, options).unwrap();
        let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
        model.set_batch(&inputs, &targets).unwrap();
        let mut losses = Vec::new();
        for _ in 0..2 {
            model.forward(&params).unwrap();
            losses.push(model.loss().unwrap().to_bits());
            model.backward(&params, &grads, 1.0, |_| {}).unwrap();
        }
        let grads: Vec<u32> =
            device.download(&grads).unwrap().iter().map(|g| g.to_bits()).collect();
        (losses, grads)
    };
    let (plain, checkpointed) = (run(false), run(true));
    assert_eq!(plain.0, checkpointed.0, "the losses differ");
    assert!(plain.1 == checkpointed.1, "the gradients differ");
    assert!(plain.1.iter().any(|&g| g != 0), "no gradient at all");
}

/// The checkpointed plan keeps every block's output and one block's internals: every block has
/// the same internal ranges and its own output, and the activation buffer is shorter by all but
/// one block's internals.
#[test]
fn every_block_shares_its_internals_and_keeps_its_output() {
    let (plain, checkpointed) = (
        plan(&THREE, (2, 7), options(AttentionKind::Gemm, false)),
        plan(&THREE, (2, 7), options(AttentionKind::Gemm, true)),
    );
    let blocks = &checkpointed.acts.blocks;
    let shared = checkpointed.acts.checkpointing.shared().unwrap().clone();
    for block in blocks {
        assert_eq!(block.qkv, blocks[0].qkv);
        assert_eq!(block.fch_gelu, blocks[0].fch_gelu);
        assert!(block.ln_1.start >= shared.start && block.fcproj.end <= shared.end);
        assert!(block.residual3.end <= shared.start || block.residual3.start >= shared.end);
    }
    let outputs: std::collections::HashSet<_> = blocks.iter().map(|b| b.residual3.start).collect();
    assert_eq!(outputs.len(), THREE.n_layer);
    assert!(!plain.acts.checkpointing.is_on());
    let saved = plain.plan.acts_len - checkpointed.plan.acts_len;
    let internals = shared.len();
    // Up to the alignment of each range to 16 elements.
    let expected = (THREE.n_layer - 1) * internals;
    assert!(saved.abs_diff(expected) <= 16 * THREE.n_layer, "{saved} saved, internals {internals}");
}

/// Backward recomputes every block but the last, and only the launches whose outputs the block's
/// backward reads: not the MLP's projection nor the residual sum after it. In the CUDA schedule,
/// the recomputed fc matmul is fused with its GELU as forward's is, every block's backward still
/// gets the fused DGelu, and the zeroing launches are gone.
#[test]
fn backward_recomputes_what_each_block_needs_and_the_schedule_fuses_it() {
    let config = GptConfig { n_layer: 4, n_head: 4, d_model: 32, vocab_size: 37, context: 11 };
    let checkpointed = plan(&config, (2, 7), options(AttentionKind::Gemm, true)).plan;
    let count = |pred: &dyn Fn(&Kernel) -> bool| {
        let launches = checkpointed.backward.iter().filter_map(|step| match step {
            Step::Launch(launch) => Some(launch),
            Step::GradsReady(_) => None,
        });
        launches.filter(|launch| pred(&launch.kernel)).count()
    };
    let recomputed = config.n_layer - 1;
    // qkv, the attention's projection and fc; not the MLP's projection.
    assert_eq!(count(&|k| matches!(k, Kernel::Matmul { .. })), 3 * recomputed);
    assert_eq!(count(&|k| matches!(k, Kernel::Attention(_))), recomputed);
    assert_eq!(count(&|k| matches!(k, Kernel::Residual)), recomputed);
    // The first zeroing launch, and one per block whose backward follows another's.
    assert_eq!(count(&|k| matches!(k, Kernel::Zero { .. })), 1 + config.n_layer);
    let schedule = Schedule::<GptKernel>::new(&checkpointed, true).unwrap();
    let fused = |pred: &dyn Fn(&OpKind<GptKernel>) -> bool| {
        schedule.ops().filter(|op| pred(&op.kind)).count()
    };
    assert_eq!(fused(&|k| matches!(k, OpKind::MatmulBiasGelu { .. })), config.n_layer + recomputed);
    assert_eq!(fused(&|k| matches!(k, OpKind::MatmulBackwardDGelu { .. })), config.n_layer);
    assert_eq!(fused(&|k| matches!(k, OpKind::Kernel(Kernel::Zero { .. }))), 0);
}

/// In the checkpointed schedule, the first write of each block's internal activation gradients
/// overwrites (the re-zeroing launches are dropped, so no block adds to the one before's).
#[test]
fn each_block_overwrites_its_internal_gradients_first() {
    let (batch, seq) = (2, 7);
    let checkpointed = plan(&THREE, (batch, seq), options(AttentionKind::Gemm, true));
    let flags = Schedule::<GptKernel>::accumulate_flags(&checkpointed.plan).unwrap();
    let qkv = checkpointed.acts.blocks[0].qkv.clone();
    let mut firsts = Vec::new();
    for (step, flags) in checkpointed.plan.backward.iter().zip(&flags) {
        let Step::Launch(launch) = step else { continue };
        for (arg, &accumulate) in launch.args.iter().zip(flags) {
            if arg.buf == Buf::ActGrads
                && arg.range == qkv
                && arg.access != zeroflow_nn::Access::Read
            {
                firsts.push(accumulate);
            }
        }
    }
    // Attention backward overwrites dqkv, then the qkv matmul's backward reads it: once a block.
    assert_eq!(firsts, vec![false; THREE.n_layer], "{firsts:?}");
}

/// The GPU memory each model of `bench gpt` would hold at micro-batch 8 × 1024, with and without
/// checkpointing (printed for the record): the checkpointed the smaller, and its activation
/// gradients packed in no more than the plain model's (each block's internal gradients live only
/// through its backward, though every block uses the same ranges).
#[test]
fn planned_gpu_memory_with_and_without_checkpointing_at_the_named_sizes() {
    let gib = |bytes: usize| bytes as f64 / (1u64 << 30) as f64;
    for name in ["gpt2-124m", "gpt-1.3b"] {
        let config = GptConfig::named(name).unwrap();
        let layout = flat_layout(&config, 1).unwrap();
        for attention in [AttentionKind::Flash, AttentionKind::Gemm] {
            let memory = |activation_checkpointing| {
                let options = CudaGptOptions {
                    attention,
                    activation_checkpointing,
                    ..CudaGptOptions::default()
                };
                planned_memory(&config, &layout, (8, 1024), options).unwrap()
            };
            let (plain, checkpointed) = (memory(false), memory(true));
            println!(
                "RESULT planned_memory {name} {} 8x1024: plain {:.2} GiB (acts {:.2}, act grads \
                 {:.2}, stats {:.2}, scratch {:.2}); checkpointed {:.2} GiB (acts {:.2}, act grads \
                 {:.2}, stats {:.2}, scratch {:.2})",
                attention.name(),
                gib(plain.total()),
                gib(plain.activations),
                gib(plain.activation_grads),
                gib(plain.stats),
                gib(plain.scratch),
                gib(checkpointed.total()),
                gib(checkpointed.activations),
                gib(checkpointed.activation_grads),
                gib(checkpointed.stats),
                gib(checkpointed.scratch),
            );
            println!(
                "RESULT planned_memory {name} {} act grads bytes: plain {} checkpointed {}",
                attention.name(),
                plain.activation_grads,
                checkpointed.activation_grads
            );
            assert!(checkpointed.total() < plain.total(), "{name} {attention:?}");
            assert!(
                checkpointed.activation_grads <= plain.activation_grads,
                "{name} {attention:?}"
            );
        }
    }
}
