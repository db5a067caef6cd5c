//! The resolved config written back as DeepSpeed JSON: every default filled in, the batch sizes
//! derived, every `"auto"` replaced. Reading the output again gives the same [`Config`].

use serde_json::{Map, Value, json};

use super::Config;
use super::optimizer::{AdamConfig, WeightDecayMode};
use super::precision::{LossScaling, MixedPrecision};
use super::scheduler::{Scheduler, Warmup};
use super::zenflow::{Selection, UpdateInterval, ZenFlowConfig};
use super::zero::ZeroConfig;

impl Config {
    /// The resolved config as a JSON object under DeepSpeed's key names.
    pub fn to_json(&self) -> Value {
        let mut object = Map::new();
        let mut put = |key: &str, value: Value| {
            object.insert(key.to_owned(), value);
        };
        put("train_batch_size", json!(self.batch.train_batch_size));
        put("train_micro_batch_size_per_gpu", json!(self.batch.micro_batch_size_per_gpu));
        put("gradient_accumulation_steps", json!(self.batch.gradient_accumulation_steps));
        put("gradient_clipping", json!(self.gradient_clipping));
        put("steps_per_print", json!(self.steps_per_print));
        put("wall_clock_breakdown", json!(self.wall_clock_breakdown));
        put("bf16", bf16_json(&self.precision));
        put("fp16", fp16_json(&self.precision));
        put("optimizer", optimizer_json(&self.optimizer));
        if let Some(scheduler) = &self.scheduler {
            put("scheduler", scheduler_json(scheduler));
        }
        put("zero_optimization", zero_json(&self.zero));
        put("zeroflow", self.zeroflow.to_json());
        Value::Object(object)
    }

    /// [`Config::to_json`], pretty-printed.
    pub fn to_resolved_json(&self) -> String {
        format!("{:#}", self.to_json())
    }
}

fn bf16_json(precision: &MixedPrecision) -> Value {
    match precision {
        MixedPrecision::Bf16 { check_grad_overflow } => {
            json!({ "enabled": true, "check_grad_overflow": check_grad_overflow })
        }
        MixedPrecision::Fp32 | MixedPrecision::Fp16(_) => json!({ "enabled": false }),
    }
}

fn fp16_json(precision: &MixedPrecision) -> Value {
    match precision {
        MixedPrecision::Fp16(LossScaling::Static(loss_scale)) => {
            json!({ "enabled": true, "loss_scale": loss_scale })
        }
        MixedPrecision::Fp16(LossScaling::Dynamic(dynamic)) => json!({
            "enabled": true,
            "loss_scale": 0,
            "initial_scale_power": dynamic.initial_scale_power,
            "loss_scale_window": dynamic.loss_scale_window,
            "hysteresis": dynamic.hysteresis,
            "consecutive_hysteresis": dynamic.consecutive_hysteresis,
            "min_loss_scale": dynamic.min_loss_scale,
        }),
        MixedPrecision::Fp32 | MixedPrecision::Bf16 { .. } => json!({ "enabled": false }),
    }
}

fn optimizer_json(adam: &AdamConfig) -> Value {
    json!({
        "type": adam.type_name(),
        "params": {
            "lr": adam.lr,
            "betas": [adam.betas.0, adam.betas.1],
            "eps": adam.eps,
            "weight_decay": adam.weight_decay,
            "bias_correction": adam.bias_correction,
            "adam_w_mode": adam.mode == WeightDecayMode::Decoupled,
        },
    })
}

fn scheduler_json(scheduler: &Scheduler) -> Value {
    let params = match scheduler {
        Scheduler::WarmupLr(warmup) => warmup_json(warmup),
        Scheduler::WarmupDecayLr { warmup, total_num_steps } => {
            let mut params = warmup_json(warmup);
            if let Some(entries) = params.as_object_mut() {
                entries.insert("total_num_steps".to_owned(), json!(total_num_steps));
            }
            params
        }
        Scheduler::WarmupCosineLr(cosine) => json!({
            "warmup_min_ratio": cosine.warmup_min_ratio,
            "warmup_num_steps": cosine.warmup_num_steps,
            "cos_min_ratio": cosine.cos_min_ratio,
            "warmup_type": cosine.warmup_curve.name(),
            "total_num_steps": cosine.total_num_steps,
        }),
    };
    json!({ "type": scheduler.type_name(), "params": params })
}

fn warmup_json(warmup: &Warmup) -> Value {
    json!({
        "warmup_min_lr": warmup.min_lr,
        "warmup_max_lr": warmup.max_lr,
        "warmup_num_steps": warmup.num_steps,
        "warmup_type": warmup.curve.name(),
    })
}

fn zero_json(zero: &ZeroConfig) -> Value {
    let offload = match zero.offload_optimizer {
        Some(cpu) => json!({ "device": "cpu", "pin_memory": cpu.pin_memory }),
        None => json!({ "device": "none" }),
    };
    let mut object = json!({
        "stage": zero.stage.number(),
        "contiguous_gradients": zero.contiguous_gradients,
        "overlap_comm": zero.overlap_comm,
        "reduce_scatter": zero.reduce_scatter,
        "reduce_bucket_size": zero.reduce_bucket_size,
        "allgather_partitions": zero.allgather_partitions,
        "allgather_bucket_size": zero.allgather_bucket_size,
        "offload_optimizer": offload,
    });
    if let (Some(zenflow), Some(entries)) = (&zero.zenflow, object.as_object_mut()) {
        entries.insert("zenflow".to_owned(), zenflow_json(zenflow));
    }
    object
}

fn zenflow_json(zenflow: &ZenFlowConfig) -> Value {
    let (strategy, select_interval) = match zenflow.selection {
        Selection::Auto => ("auto", json!("auto")),
        Selection::Step { interval } => ("step", json!(interval)),
        Selection::Epoch { interval } => ("epoch", json!(interval)),
    };
    let update_interval = match zenflow.update_interval {
        UpdateInterval::Auto => json!("auto"),
        UpdateInterval::Every(steps) => json!(steps),
    };
    json!({
        "topk_ratio": zenflow.topk_ratio,
        "select_strategy": strategy,
        "select_interval": select_interval,
        "update_interval": update_interval,
        "overlap_step": zenflow.overlap_step,
        "offload": zenflow.offload,
        "auto_ratio": zenflow.auto_ratio,
        "full_warm_up_rounds": zenflow.full_warm_up_rounds,
        "pt_reserved_cores_perc": zenflow.pt_reserved_cores_perc,
    })
}
