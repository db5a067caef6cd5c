//! The CUDA schedule of GPT-2's plans (zeroflow-nn's `cuda::schedule`), checked without a GPU:
//! packing by liveness, fusions, first writes, flash attention's statistics.
use std::collections::HashMap;

use zeroflow_gpt::kernels::Kernel;
use zeroflow_gpt::{
    AttentionKind, GptConfig, GptKernel, GptPlan, ParamRanges, Plan, PlanOptions, flat_layout,
};
use zeroflow_nn::cuda::schedule::{BackwardOp, Op, OpKind, Place, Schedule, Space};
use zeroflow_nn::{Access, Buf, Step};

type GptSchedule = Schedule<GptKernel>;

fn schedule(config: &GptConfig, batch: usize, seq: usize) -> (Plan, GptSchedule) {
    schedule_with(config, batch, seq, AttentionKind::Gemm)
}

fn schedule_with(
    config: &GptConfig,
    batch: usize,
    seq: usize,
    attention: AttentionKind,
) -> (Plan, GptSchedule) {
    let layout = flat_layout(config, 1).unwrap();
    let params = ParamRanges::new(config, &layout).unwrap();
    let plan = GptPlan::with_attention(config, &params, batch, seq, attention).unwrap().plan;
    let schedule = GptSchedule::new(&plan, true).unwrap();
    (plan, schedule)
}

const TAILS: GptConfig =
    GptConfig { n_layer: 3, n_head: 4, d_model: 200, vocab_size: 301, context: 40 };

/// No two activation gradients that are live at the same time share memory: packing the
/// backward of `TAILS` again, each argument is known by its plan offset before packing.
#[test]
fn live_activation_gradients_never_overlap() {
    check_live_activation_gradients_never_overlap(PlanOptions::default());
}

/// The same with activation checkpointing, where every block's internal gradients use the same
/// plan ranges: each life of a range (between the zeroing launches before each block) is packed
/// on its own, and no two live at once share memory.
#[test]
fn with_activation_checkpointing_live_activation_gradients_never_overlap() {
    check_live_activation_gradients_never_overlap(PlanOptions {
        activation_checkpointing: true,
        ..PlanOptions::default()
    });
}

fn check_live_activation_gradients_never_overlap(options: PlanOptions) {
    let layout = flat_layout(&TAILS, 1).unwrap();
    let params = ParamRanges::new(&TAILS, &layout).unwrap();
    let plan = GptPlan::with_options(&TAILS, &params, 3, 37, options).unwrap().plan;
    let s = GptSchedule::new(&plan, true).unwrap();
    let unpacked = Schedule::unpacked_backward(&plan, true).unwrap();
    let ops = |steps: &[BackwardOp<GptKernel>]| -> Vec<Op<GptKernel>> {
        steps
            .iter()
            .filter_map(|step| match step {
                BackwardOp::Op(op) => Some(op.clone()),
                BackwardOp::Ready(_) => None,
            })
            .collect()
    };
    let (unpacked, packed) = (ops(&unpacked), ops(&s.backward));
    // Plan offset → (first op, last op, packed place).
    let mut lives: HashMap<usize, (usize, usize, Place)> = HashMap::new();
    for (i, (before, after)) in unpacked.iter().zip(&packed).enumerate() {
        for (arg, place) in before.args.iter().zip(&after.args) {
            if arg.space != Space::ActGrads {
                continue;
            }
            let life = lives.entry(arg.offset).or_insert((i, i, *place));
            assert_eq!(life.2, Place { accumulate: life.2.accumulate, ..*place });
            life.1 = i;
        }
    }
    assert!(lives.len() > 10);
    for (key_a, a) in &lives {
        assert!(a.2.end() <= s.act_grads_len);
        for (key_b, b) in &lives {
            let same_time = a.0 <= b.1 && b.0 <= a.1;
            let same_memory = a.2.offset < b.2.end() && b.2.offset < a.2.end();
            assert!(key_a == key_b || !(same_time && same_memory), "{a:?} and {b:?}");
        }
    }
}

/// Each block's fc matmul is fused with its GELU forward and backward, the zeroing launch is
/// gone, and the packed activation gradients take far less than one per activation.
#[test]
fn fusions_apply_once_per_block_and_packing_saves_memory() {
    let config = GptConfig { n_layer: 6, ..TAILS };
    let (plan, s) = schedule(&config, 2, 40);
    let count =
        |pred: &dyn Fn(&OpKind<GptKernel>) -> bool| s.ops().filter(|op| pred(&op.kind)).count();
    assert_eq!(count(&|k| matches!(k, OpKind::MatmulBiasGelu { .. })), 6);
    assert_eq!(count(&|k| matches!(k, OpKind::MatmulBackwardDGelu { .. })), 6);
    assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Layer(GptKernel::Gelu)))), 0);
    assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Layer(GptKernel::GeluBackward)))), 0);
    assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Zero { .. }))), 0);
    let unfused = GptSchedule::new(&plan, false).unwrap();
    assert!(unfused.ops().all(|op| matches!(op.kind, OpKind::Kernel(_))));
    assert!(s.act_grads_len * 3 < plan.acts_len, "{} vs {}", s.act_grads_len, plan.acts_len);
    let ready = s.backward.iter().filter(|s| matches!(s, BackwardOp::Ready(_))).count();
    assert_eq!(ready, config.n_layer + 2);
}

/// Where the GELU's width is no multiple of 8, the GELU kernels stay separate.
#[test]
fn odd_widths_keep_the_gelu_kernels() {
    let narrow = GptConfig { n_layer: 2, n_head: 3, d_model: 15, vocab_size: 70, context: 11 };
    let (_, s) = schedule(&narrow, 2, 9);
    let count =
        |pred: &dyn Fn(&OpKind<GptKernel>) -> bool| s.ops().filter(|op| pred(&op.kind)).count();
    assert_eq!(count(&|k| matches!(k, OpKind::MatmulBiasGelu { .. })), 0);
    assert_eq!(count(&|k| matches!(k, OpKind::MatmulBackwardDGelu { .. })), 0);
    assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Layer(GptKernel::Gelu)))), 2);
    assert_eq!(count(&|k| matches!(k, OpKind::Kernel(Kernel::Layer(GptKernel::GeluBackward)))), 2);
}

/// The first write of every activation gradient overwrites, the others add, parameter
/// gradients always add, and every place lies inside its buffer.
#[test]
fn first_writes_overwrite_and_places_fit_their_buffers() {
    let (plan, s) = schedule(&TAILS, 3, 37);
    let mut seen = std::collections::HashSet::new();
    for op in s.ops() {
        for arg in &op.args {
            let len = match arg.space {
                Space::Acts => s.acts_len,
                Space::ActGrads => s.act_grads_len,
                Space::Stats => s.stats_len,
                Space::Tokens => s.tokens_len,
                Space::Params | Space::Grads => usize::MAX,
            };
            assert!(arg.end() <= len, "{arg:?}");
            if arg.space == Space::Grads {
                assert!(arg.accumulate);
            }
        }
    }
    let flags = GptSchedule::accumulate_flags(&plan).unwrap();
    for (step, flags) in plan.backward.iter().zip(&flags) {
        let Step::Launch(launch) = step else { continue };
        for (arg, &accumulate) in launch.args.iter().zip(flags) {
            if arg.buf == Buf::ActGrads && arg.access == Access::Update {
                assert_eq!(accumulate, !seen.insert(arg.range.clone()), "{launch:?}");
            }
        }
    }
    assert!(s.stats_len < plan.acts_len);
}

/// With flash attention, each block's forward writes its lse into the f32 statistics and its
/// backward reads it from the same place, the backward overwrites dqkv (its first write), and
/// no place anywhere has the size of the weights `[batch, n_head, seq, seq]`.
#[test]
fn flash_attention_keeps_its_lse_with_the_statistics() {
    let (batch, seq) = (3, 37);
    let (plan, s) = schedule_with(&TAILS, batch, seq, AttentionKind::Flash);
    let rows = batch * TAILS.n_head * seq;
    let forward: Vec<&Op<GptKernel>> = s
        .forward
        .iter()
        .filter(|op| matches!(op.kind, OpKind::Kernel(Kernel::FlashAttention(_))))
        .collect();
    let backward: Vec<&Op<GptKernel>> = s
        .ops()
        .filter(|op| matches!(op.kind, OpKind::Kernel(Kernel::FlashAttentionBackward(_))))
        .collect();
    assert_eq!((forward.len(), backward.len()), (TAILS.n_layer, TAILS.n_layer));
    for (forward, backward) in forward.iter().zip(backward.iter().rev()) {
        // [out, lse, qkv] and [dqkv, dout, qkv, out, lse]
        let lse = forward.args[1];
        assert_eq!((lse.space, lse.len), (Space::Stats, rows));
        assert!(lse.offset.is_multiple_of(4), "16-byte aligned f32");
        assert_eq!(backward.args[4], lse);
        assert_eq!(backward.args[3], forward.args[0]);
        assert_eq!(backward.args[2], forward.args[2]);
        assert!(!backward.args[0].accumulate, "flash backward overwrites dqkv");
    }
    assert!(s.ops().all(|op| op.args.iter().all(|arg| arg.len != rows * seq)));
    let (_, gemm) = schedule(&TAILS, batch, seq);
    assert_eq!(s.stats_len - gemm.stats_len, TAILS.n_layer * rows.div_ceil(4) * 4);
    assert!(s.act_grads_len <= gemm.act_grads_len);
    assert!(s.acts_len < gemm.acts_len && s.acts_len == plan.acts_len);
}
