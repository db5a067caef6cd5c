//! Real DeepSpeed keys that have no meaning in zeroflow, section by section, each with the reason
//! it is ignored. A key in these tables draws an "ignored key" warning; any other key that zeroflow
//! does not read draws an "unknown key" warning, with a suggestion when one is spelled alike.
//!
//! The tables follow DeepSpeed's `runtime/config.py`, `runtime/constants.py`, `runtime/zero/
//! config.py`, `runtime/zero/offload_config.py` and `runtime/precision_config.py`.

/// A key and why zeroflow ignores it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct IgnoredKey {
    pub key: &'static str,
    pub reason: &'static str,
}

const fn ignored(key: &'static str, reason: &'static str) -> IgnoredKey {
    IgnoredKey { key, reason }
}

const NOT_USED: &str = "a DeepSpeed setting that zeroflow does not use";
const MONITORING: &str = "DeepSpeed monitoring or profiling; zeroflow does not use it";
const PARALLELISM: &str = "model, pipeline or expert parallelism; zeroflow is data-parallel only";
const STAGE3: &str = "a ZeRO stage 3 setting; zeroflow implements stages 0 to 2";
const ZERO_PLUS_PLUS: &str = "a ZeRO++ setting; zeroflow does not implement ZeRO++";
const NVME: &str = "an NVMe offload setting; zeroflow offloads to CPU memory only";
const FP32_MASTER: &str = "zeroflow always keeps fp32 master weights and optimizer states";
const STATE_DTYPE: &str = "zeroflow keeps fp32 master weights; its CPU optimizer's bf16 moments are asked for with \
     zeroflow.optimizer_state_dtype";

pub(crate) const TOP_LEVEL: &[IgnoredKey] = &[
    ignored("activation_checkpointing", NOT_USED),
    ignored("aio", NVME),
    ignored("allgather_size", "read by DeepSpeed only with the legacy \"zero_optimization\": true"),
    ignored("amp", "NVIDIA Apex AMP; zeroflow's mixed precision is set by bf16 and fp16"),
    ignored("autotuning", NOT_USED),
    ignored("bfloat16", "the legacy name of bf16; DeepSpeed reads bf16 when both are present"),
    ignored("checkpoint", "DeepSpeed's checkpoint engine; zeroflow writes its own checkpoints"),
    ignored("comet", MONITORING),
    ignored("comms_logger", MONITORING),
    ignored("communication_data_type", NOT_USED),
    ignored("compile", NOT_USED),
    ignored("compression_training", NOT_USED),
    ignored("csv_monitor", MONITORING),
    ignored("curriculum_learning", NOT_USED),
    ignored("data_efficiency", NOT_USED),
    ignored("data_types", NOT_USED),
    ignored("dataloader_drop_last", NOT_USED),
    ignored("datastates", NOT_USED),
    ignored("disable_allgather", NOT_USED),
    ignored("dump_state", NOT_USED),
    ignored("eigenvalue", NOT_USED),
    ignored("elasticity", NOT_USED),
    ignored("expert_parallel", PARALLELISM),
    ignored("flops_profiler", MONITORING),
    ignored("gradient_allreduce_op", NOT_USED),
    ignored("gradient_predivide_factor", NOT_USED),
    ignored("graph_harvesting", NOT_USED),
    ignored("hybrid_engine", NOT_USED),
    ignored("log_level", NOT_USED),
    ignored("managed_gradient_accumulation", NOT_USED),
    ignored("memory_breakdown", MONITORING),
    ignored("model_info", NOT_USED),
    ignored("nebula", NOT_USED),
    ignored("pipeline", PARALLELISM),
    ignored("prescale_gradients", NOT_USED),
    ignored("progressive_layer_drop", NOT_USED),
    ignored("quantize_training", NOT_USED),
    ignored("seq_parallel_communication_data_type", PARALLELISM),
    ignored("sequence_parallel_size", PARALLELISM),
    ignored("sparse_attention", NOT_USED),
    ignored("sparse_gradients", NOT_USED),
    ignored("tensor_parallel", PARALLELISM),
    ignored("tensorboard", MONITORING),
    ignored("timers", MONITORING),
    ignored("torch_autocast", NOT_USED),
    ignored("use_data_before_expert_parallelism", PARALLELISM),
    ignored("vocabulary_size", NOT_USED),
    ignored("wandb", MONITORING),
    ignored("weight_quantization", NOT_USED),
    ignored(
        "zero_allow_untested_optimizer",
        "lets DeepSpeed wrap untested optimizers; zeroflow runs only its own Adam and AdamW",
    ),
    ignored("zero_force_ds_cpu_optimizer", "zeroflow always runs its own CPU Adam when offloading"),
];

pub(crate) const ZERO_OPTIMIZATION: &[IgnoredKey] = &[
    ignored("use_multi_rank_bucket_allreduce", NOT_USED),
    ignored("load_from_fp32_weights", NOT_USED),
    ignored("elastic_checkpoint", NOT_USED),
    ignored("ignore_unused_parameters", NOT_USED),
    ignored("legacy_stage1", NOT_USED),
    ignored("round_robin_gradients", NOT_USED),
    ignored("enable_sanity_checks", NOT_USED),
    ignored(
        "cpu_offload_use_pin_memory",
        "deprecated, and DeepSpeed ignores it too; use offload_optimizer.pin_memory",
    ),
    ignored("offload_param", STAGE3),
    ignored("cpu_offload_param", STAGE3),
    ignored("sub_group_size", STAGE3),
    ignored("stage3_prefetch_bucket_size", STAGE3),
    ignored("prefetch_bucket_size", STAGE3),
    ignored("stage3_param_persistence_threshold", STAGE3),
    ignored("param_persistence_threshold", STAGE3),
    ignored("stage3_model_persistence_threshold", STAGE3),
    ignored("model_persistence_threshold", STAGE3),
    ignored("stage3_max_live_parameters", STAGE3),
    ignored("max_live_parameters", STAGE3),
    ignored("stage3_max_reuse_distance", STAGE3),
    ignored("max_reuse_distance", STAGE3),
    ignored("stage3_gather_16bit_weights_on_model_save", STAGE3),
    ignored("gather_16bit_weights_on_model_save", STAGE3),
    ignored("stage3_gather_fp16_weights_on_model_save", STAGE3),
    ignored("stage3_module_granularity_threshold", STAGE3),
    ignored("module_granularity_threshold", STAGE3),
    ignored("stage3_use_all_reduce_for_fetch_params", STAGE3),
    ignored("use_all_reduce_for_fetch_params", STAGE3),
    ignored("stage3_allgather_sequential", STAGE3),
    ignored("allgather_sequential", STAGE3),
    ignored("mics_shard_size", STAGE3),
    ignored("mics_hierarchical_params_gather", STAGE3),
    ignored("memory_efficient_linear", STAGE3),
    ignored("pipeline_loading_checkpoint", STAGE3),
    ignored("override_module_apply", STAGE3),
    ignored("log_trace_cache_warnings", STAGE3),
    ignored("save_muon_momentum_buffer_in_memory", STAGE3),
    ignored("leaf_module", STAGE3),
    ignored("zero_hpz_partition_size", ZERO_PLUS_PLUS),
    ignored("zero_quantized_weights", ZERO_PLUS_PLUS),
    ignored("zero_quantized_nontrainable_weights", ZERO_PLUS_PLUS),
    ignored("zero_quantized_gradients", ZERO_PLUS_PLUS),
    ignored("zeropp_loco_param", ZERO_PLUS_PLUS),
];

pub(crate) const OFFLOAD_OPTIMIZER: &[IgnoredKey] = &[
    ignored("nvme_path", NVME),
    ignored("buffer_count", NVME),
    ignored("pipeline_read", NVME),
    ignored("pipeline_write", NVME),
    ignored("fast_init", NVME),
    ignored("super_offload", STAGE3),
    ignored("cpuadam_cores_perc", STAGE3),
];

pub(crate) const BF16: &[IgnoredKey] = &[
    ignored("immediate_grad_update", NOT_USED),
    ignored("bf16_master_weights_and_grads", FP32_MASTER),
    ignored("bf16_optimizer_states", STATE_DTYPE),
];

pub(crate) const FP16: &[IgnoredKey] =
    &[ignored("auto_cast", NOT_USED), ignored("fp16_master_weights_and_grads", FP32_MASTER)];

pub(crate) const OPTIMIZER: &[IgnoredKey] = &[ignored("legacy_fusion", NOT_USED)];

pub(crate) const OPTIMIZER_PARAMS: &[IgnoredKey] = &[ignored("fp32_optimizer_states", FP32_MASTER)];

const NOT_FOR_COSINE: &str =
    "a WarmupLR and WarmupDecayLR parameter; WarmupCosineLR takes none (DeepSpeed would reject it)";
const ONLY_FOR_COSINE: &str =
    "a WarmupCosineLR parameter; this scheduler does not take it (DeepSpeed would reject it)";
const POSITION: &str = "zeroflow restores the schedule's position from its checkpoints";

pub(crate) const WARMUP_LR_PARAMS: &[IgnoredKey] = &[
    ignored("last_batch_iteration", POSITION),
    ignored(
        "total_num_steps",
        "a WarmupDecayLR and WarmupCosineLR parameter; WarmupLR does not take it (DeepSpeed would \
         reject it)",
    ),
    ignored("warmup_min_ratio", ONLY_FOR_COSINE),
    ignored("cos_min_ratio", ONLY_FOR_COSINE),
];

pub(crate) const WARMUP_DECAY_LR_PARAMS: &[IgnoredKey] = &[
    ignored("last_batch_iteration", POSITION),
    ignored("warmup_min_ratio", ONLY_FOR_COSINE),
    ignored("cos_min_ratio", ONLY_FOR_COSINE),
];

pub(crate) const WARMUP_COSINE_LR_PARAMS: &[IgnoredKey] = &[
    ignored("last_batch_iteration", POSITION),
    ignored("warmup_min_lr", NOT_FOR_COSINE),
    ignored("warmup_max_lr", NOT_FOR_COSINE),
];

pub(crate) const ZENFLOW: &[IgnoredKey] =
    &[ignored("steps_per_epoch", "set by DeepSpeed while training, not by users")];

/// The known key most like `unknown`: the same but for letter case, or at most a few edits away.
pub(crate) fn suggest(
    unknown: &str,
    known: impl Iterator<Item = &'static str>,
) -> Option<&'static str> {
    let unknown = unknown.to_ascii_lowercase();
    let allowed = (unknown.len() / 4).clamp(1, 3);
    known
        .map(|candidate| (edit_distance(&unknown, candidate), candidate))
        .filter(|&(distance, _)| distance <= allowed)
        .min_by_key(|&(distance, _)| distance)
        .map(|(_, candidate)| candidate)
}

/// Levenshtein distance over bytes (keys are ASCII).
fn edit_distance(a: &str, b: &str) -> usize {
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, a_byte) in a.bytes().enumerate() {
        let mut current = vec![i + 1];
        for (j, b_byte) in b.bytes().enumerate() {
            let substitution = previous[j] + usize::from(a_byte != b_byte);
            current.push(substitution.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions_catch_typos_and_case_but_not_unrelated_words() {
        let known = || ["reduce_bucket_size", "stage", "overlap_comm"].into_iter();
        assert_eq!(suggest("reduce_bucket_sise", known()), Some("reduce_bucket_size"));
        assert_eq!(suggest("Stage", known()), Some("stage"));
        assert_eq!(suggest("overlapcomm", known()), Some("overlap_comm"));
        assert_eq!(suggest("flux_capacitor", known()), None);
    }

    #[test]
    fn no_table_lists_a_key_twice() {
        let tables = [
            TOP_LEVEL,
            ZERO_OPTIMIZATION,
            OFFLOAD_OPTIMIZER,
            BF16,
            FP16,
            OPTIMIZER,
            OPTIMIZER_PARAMS,
            WARMUP_LR_PARAMS,
            WARMUP_DECAY_LR_PARAMS,
            WARMUP_COSINE_LR_PARAMS,
            ZENFLOW,
        ];
        for table in tables {
            for (index, entry) in table.iter().enumerate() {
                assert!(
                    table[index + 1..].iter().all(|later| later.key != entry.key),
                    "{} is listed twice",
                    entry.key
                );
            }
        }
    }
}
