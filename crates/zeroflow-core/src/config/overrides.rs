//! Values the caller knows and the config file may leave to it with `"auto"`.

use std::num::NonZeroU64;

use super::precision::Precision;

/// What the caller (the training command, from its flags and its model) knows, used only to fill
/// `"auto"` entries, in the way Hugging Face's DeepSpeed integration fills them from
/// `TrainingArguments`. A value written in the config file always wins over an override.
///
/// An `"auto"` is filled, in order of preference: derived from other values of the config where
/// DeepSpeed's rules fix it (the third batch size from the other two, a scheduler's
/// `warmup_max_lr` from the optimizer's `lr`); else from the override here; else with the default
/// documented on the field (DeepSpeed's own, except where noted).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overrides {
    /// `train_micro_batch_size_per_gpu`. Default: 1.
    pub micro_batch_size_per_gpu: Option<NonZeroU64>,
    /// `gradient_accumulation_steps`. Default: 1 (DeepSpeed's rule when it is not given).
    pub gradient_accumulation_steps: Option<NonZeroU64>,
    /// `gradient_clipping` (a max gradient norm; 0 disables clipping). Default: 1.0.
    pub gradient_clipping: Option<f64>,
    /// Fills `bf16.enabled` and `fp16.enabled`. Default: both false.
    pub precision: Option<Precision>,
    /// `optimizer.params.lr`. Default: 1e-3.
    pub lr: Option<f64>,
    /// `optimizer.params.betas`. Default: (0.9, 0.999).
    pub betas: Option<(f64, f64)>,
    /// `optimizer.params.eps`. Default: 1e-8.
    pub eps: Option<f64>,
    /// `optimizer.params.weight_decay`. Default: 0.
    pub weight_decay: Option<f64>,
    /// `scheduler.params.warmup_num_steps`. Default: 1000.
    pub warmup_num_steps: Option<NonZeroU64>,
    /// `scheduler.params.total_num_steps`, the number of optimizer steps of the run. No default:
    /// DeepSpeed requires it for WarmupDecayLR and WarmupCosineLR, so an `"auto"` without this
    /// override is an error.
    pub total_num_steps: Option<NonZeroU64>,
    /// The model's hidden size: an `"auto"` `zero_optimization.reduce_bucket_size` becomes its
    /// square, as in Hugging Face's integration. Default: 5e8.
    pub hidden_size: Option<NonZeroU64>,
}
