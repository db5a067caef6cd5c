//! Activation checkpointing (zeroflow-nn's `checkpoint`, the family's `PlanOptions`): on every
//! tiny model of the family's checks, the checkpointed plan gives the loss and gradients of the
//! plain one, bit for bit, on the f64 host executor and on the CPU device; it keeps every layer's
//! output and one layer's internals; its backward recomputes what each layer's backward reads;
//! and the planned GPU memory at the named sizes, printed.

use zeroflow_device::{CpuDevice, Device};
use zeroflow_llama::kernels::Kernel;
use zeroflow_llama::{
    AttentionKind, CpuLlama, HostLlama, LlamaConfig, LlamaKernel, LlamaPlan, ParamRanges,
    PlanOptions, flat_layout, named_shape,
};
use zeroflow_nn::cuda::schedule::Schedule;
use zeroflow_nn::{Access, Buf, GradsReady, Step};

use crate::support::{models, perturbed_params, random_batch};

const ATTENTIONS: [AttentionKind; 2] = [AttentionKind::Gemm, AttentionKind::Flash];

/// The family's tiny models (GQA 3:1 untied, llama3 scaling with biases and tied embeddings,
/// Qwen2 biases, Qwen3 q/k norm with `head_dim ≠ hidden / heads`, Mistral tied, MQA), each with
/// three layers, so that two of them are recomputed.
fn three_layer_models() -> Vec<(&'static str, LlamaConfig)> {
    let mut models = models();
    for (_, config) in &mut models {
        config.num_hidden_layers = 3;
    }
    models
}

fn options(attention: AttentionKind, activation_checkpointing: bool) -> PlanOptions {
    PlanOptions { attention, activation_checkpointing, ..PlanOptions::default() }
}

fn plan(config: &LlamaConfig, (batch, seq): (usize, usize), options: PlanOptions) -> LlamaPlan {
    let layout = flat_layout(config, 1).unwrap();
    let params = ParamRanges::new(config, &layout).unwrap();
    LlamaPlan::with_options(config, &params, batch, seq, options).unwrap()
}

/// The f64 host executor: for every model and both attentions, the loss, every gradient and the
/// gradient notices of the checkpointed plan equal the plain plan's exactly (recomputation runs
/// the same kernels on the same inputs), and its activation buffer is shorter.
#[test]
fn checkpointing_changes_no_bit_of_the_f64_loss_and_gradients() {
    let (batch, seq) = (2, 7);
    for (seed, (what, config)) in three_layer_models().into_iter().enumerate() {
        let (layout, params) = perturbed_params(&config, 110 + seed as u64);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 120 + seed as u64);
        for attention in ATTENTIONS {
            let run = |checkpointing| {
                let options = options(attention, checkpointing);
                let mut model =
                    HostLlama::<f64>::with_options(&config, &layout, batch, seq, options).unwrap();
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
            assert_eq!(plain.0, checkpointed.0, "{what} {attention:?}: the loss differs");
            assert!(plain.1 == checkpointed.1, "{what} {attention:?}: the gradients differ");
            assert!(plain.1.iter().any(|&g| g != 0), "{what} {attention:?}: no gradient at all");
            assert_eq!(plain.2, checkpointed.2, "{what} {attention:?}: the notices differ");
            assert!(checkpointed.3 < plain.3, "{what} {attention:?}: {checkpointed:?}");
        }
    }
}

/// The CPU device in f32: for every model and both attentions, the checkpointed model's losses
/// and gradients are the plain model's, bit for bit, over two rounds (the second backward adds
/// to the first's gradients, so nothing the recomputation or the re-zeroing leaves behind may
/// leak into it).
#[test]
fn checkpointing_changes_no_bit_of_the_f32_loss_and_gradients_on_the_cpu_device() {
    let (batch, seq) = (3, 7);
    let device = CpuDevice::new().unwrap();
    for (seed, (what, config)) in three_layer_models().into_iter().enumerate() {
        let (layout, params64) = perturbed_params(&config, 130 + seed as u64);
        let (inputs, targets) = random_batch(config.vocab_size, batch * seq, 140 + seed as u64);
        let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
        let params = device.upload(&params32).unwrap();
        for attention in ATTENTIONS {
            let run = |checkpointing| {
                let options = options(attention, checkpointing);
                let mut model =
                    CpuLlama::with_options(&device, &config, &layout, batch, seq, options).unwrap();
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
            assert_eq!(plain.0, checkpointed.0, "{what} {attention:?}: the losses differ");
            assert!(plain.1 == checkpointed.1, "{what} {attention:?}: the gradients differ");
            assert!(plain.1.iter().any(|&g| g != 0), "{what} {attention:?}: no gradient at all");
        }
    }
}

/// The checkpointed plan keeps every layer's output and one layer's internals, for every model
/// and both attentions: every layer has the same internal ranges, inside the shared region, and
/// its own output outside it; the activation buffer is shorter by all but one layer's internals.
#[test]
fn every_layer_shares_its_internals_and_keeps_its_output() {
    for (what, config) in three_layer_models() {
        for attention in ATTENTIONS {
            let plain = plan(&config, (2, 7), options(attention, false));
            let checkpointed = plan(&config, (2, 7), options(attention, true));
            assert!(!plain.acts.checkpointing.is_on(), "{what}");
            let layers = &checkpointed.acts.layers;
            let shared = checkpointed.acts.checkpointing.shared().unwrap().clone();
            for layer in layers {
                let internal = |l: &zeroflow_llama::acts::LayerActs| {
                    let mut l = l.clone();
                    l.residual_out = 0..0;
                    l
                };
                assert_eq!(internal(layer), internal(&layers[0]), "{what} {attention:?}");
                assert!(layer.input_norm.start >= shared.start, "{what} {attention:?}");
                assert!(layer.mlp_out.end <= shared.end, "{what} {attention:?}");
                let out = &layer.residual_out;
                assert!(out.end <= shared.start || out.start >= shared.end, "{what} {attention:?}");
            }
            let outputs: std::collections::HashSet<_> =
                layers.iter().map(|l| l.residual_out.start).collect();
            assert_eq!(outputs.len(), config.num_hidden_layers, "{what} {attention:?}");
            if let Some(norm) = &layers[2].qk_norm {
                assert!(norm.k_rstd.end <= shared.end, "{what} {attention:?}");
            }
            let saved = plain.plan.acts_len - checkpointed.plan.acts_len;
            let expected = (config.num_hidden_layers - 1) * shared.len();
            // Up to the alignment of each range to 16 elements.
            let slack = 16 * config.num_hidden_layers;
            assert!(saved.abs_diff(expected) <= slack, "{what} {attention:?}: {saved} saved");
        }
    }
}

/// Backward recomputes every layer but the last, and only the launches whose outputs the
/// layer's backward reads: not the MLP's down projection nor the residual sum after it.
#[test]
fn backward_recomputes_what_each_layer_needs() {
    for (what, config) in three_layer_models() {
        for attention in ATTENTIONS {
            let checkpointed = plan(&config, (2, 7), options(attention, true)).plan;
            let count = |pred: &dyn Fn(&Kernel) -> bool| {
                let launches = checkpointed.backward.iter().filter_map(|step| match step {
                    Step::Launch(launch) => Some(launch),
                    Step::GradsReady(_) => None,
                });
                launches.filter(|launch| pred(&launch.kernel)).count()
            };
            let recomputed = config.num_hidden_layers - 1;
            // q, k, v, o, gate and up; not down.
            let matmuls = count(&|k| matches!(k, Kernel::Matmul { .. }));
            assert_eq!(matmuls, 6 * recomputed, "{what} {attention:?}");
            let norms_per_layer = if config.qk_norm { 4 } else { 2 };
            let norms = count(&|k| matches!(k, Kernel::Layer(LlamaKernel::RmsNorm { .. })));
            assert_eq!(norms, norms_per_layer * recomputed, "{what} {attention:?}");
            let attentions =
                count(&|k| matches!(k, Kernel::Attention(_) | Kernel::FlashAttention(_)));
            assert_eq!(attentions, recomputed, "{what} {attention:?}");
            let ropes = count(&|k| matches!(k, Kernel::Layer(LlamaKernel::Rope(_))));
            assert_eq!(ropes, recomputed, "{what} {attention:?}");
            let swiglus = count(&|k| matches!(k, Kernel::Layer(LlamaKernel::SwiGlu)));
            assert_eq!(swiglus, recomputed, "{what} {attention:?}");
            // The residual sum after attention; not the one after the MLP.
            assert_eq!(count(&|k| matches!(k, Kernel::Residual)), recomputed, "{what}");
            // The first zeroing launch, and one per layer.
            let zeros = count(&|k| matches!(k, Kernel::Zero { .. }));
            assert_eq!(zeros, 1 + config.num_hidden_layers, "{what} {attention:?}");
        }
    }
}

/// In the checkpointed CUDA schedule, the first write of each layer's internal activation
/// gradients overwrites (the re-zeroing launches are dropped, so no layer adds to the one
/// before's): attention's backward adds to `dqkv` first in every layer.
#[test]
fn each_layer_overwrites_its_internal_gradients_first() {
    let (what, config) = three_layer_models().swap_remove(3);
    for attention in ATTENTIONS {
        let checkpointed = plan(&config, (2, 7), options(attention, true));
        let flags = Schedule::<LlamaKernel>::accumulate_flags(&checkpointed.plan).unwrap();
        let qkv = checkpointed.acts.layers[0].qkv.clone();
        let mut firsts = Vec::new();
        for (step, flags) in checkpointed.plan.backward.iter().zip(&flags) {
            let Step::Launch(launch) = step else { continue };
            for (arg, &accumulate) in launch.args.iter().zip(flags) {
                if arg.buf == Buf::ActGrads && arg.range == qkv && arg.access != Access::Read {
                    firsts.push(accumulate);
                }
            }
        }
        let expected = vec![false; config.num_hidden_layers];
        assert_eq!(firsts, expected, "{what} {attention:?}: {firsts:?}");
    }
}

/// GiB of `bytes`.
fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// The GPU buffers of a Llama plan that activation checkpointing changes, in bytes, as
/// `zeroflow_nn::cuda::ActivationMemory::planned` counts them from the CUDA schedule: the bf16
/// activations, the packed bf16 activation gradients and the f32 statistics. (Its scratch —
/// attention's, the column-sum partials, the token ids — is the same with and without
/// checkpointing: the same shapes.)
fn planned_buffers(config: &LlamaConfig, batch_seq: (usize, usize), options: PlanOptions) -> Sizes {
    let plan = plan(config, batch_seq, options).plan;
    let schedule = Schedule::new(&plan, false).unwrap();
    Sizes {
        activations: schedule.acts_len * 2,
        activation_grads: schedule.act_grads_len * 2,
        stats: schedule.stats_len * 4,
    }
}

#[derive(Debug)]
struct Sizes {
    activations: usize,
    activation_grads: usize,
    stats: usize,
}

impl Sizes {
    fn total(&self) -> usize {
        self.activations + self.activation_grads + self.stats
    }
}

/// The GPU activation memory of llama-1b at micro-batch 4 × 2048 and llama-8b at 4 × 2048 and
/// 2 × 4096, with and without checkpointing, with either attention (printed for the record):
/// the checkpointed the smaller.
#[test]
fn planned_gpu_memory_with_and_without_checkpointing_at_the_named_sizes() {
    for (name, batch_seq) in
        [("llama-1b", (4, 2048)), ("llama-8b", (4, 2048)), ("llama-8b", (2, 4096))]
    {
        let config = named_shape(name).unwrap();
        for attention in [AttentionKind::Flash, AttentionKind::Gemm] {
            let sizes = |checkpointing| {
                planned_buffers(&config, batch_seq, options(attention, checkpointing))
            };
            let (plain, checkpointed) = (sizes(false), sizes(true));
            println!(
                "RESULT planned_memory {name} {} {}x{}: plain {:.2} GiB (acts {:.2}, act grads \
                 {:.2}, stats {:.2}); checkpointed {:.2} GiB (acts {:.2}, act grads {:.2}, stats \
                 {:.2})",
                attention.name(),
                batch_seq.0,
                batch_seq.1,
                gib(plain.total()),
                gib(plain.activations),
                gib(plain.activation_grads),
                gib(plain.stats),
                gib(checkpointed.total()),
                gib(checkpointed.activations),
                gib(checkpointed.activation_grads),
                gib(checkpointed.stats),
            );
            assert!(checkpointed.total() < plain.total(), "{name} {attention:?}: {checkpointed:?}");
        }
    }
}
