//! The learning rate of each optimizer step, from the resolved config's scheduler, with the
//! formulas of DeepSpeed's `runtime/lr_schedules.py` (WarmupLR, WarmupDecayLR, WarmupCosineLR).
//!
//! DeepSpeed's schedulers count `last_batch_iteration` from 0 at the first optimizer step; so does
//! [`LrSchedule::lr`]'s `iteration` (the number of optimizer steps already taken).

use zeroflow_core::config::{Config, CosineSchedule, Scheduler, Warmup, WarmupCurve};

/// The learning rate as a function of the optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The optimizer's `lr` (what WarmupCosineLR scales).
    base_lr: f64,
    scheduler: Option<Scheduler>,
}

impl LrSchedule {
    pub fn from_config(config: &Config) -> LrSchedule {
        LrSchedule { base_lr: config.optimizer.lr, scheduler: config.scheduler }
    }

    /// The learning rate of the optimizer step that follows `iteration` steps.
    pub fn lr(&self, iteration: u64) -> f64 {
        let Some(scheduler) = self.scheduler else { return self.base_lr };
        match scheduler {
            Scheduler::WarmupLr(warmup) => {
                let gamma = warmup_fraction(&warmup, iteration).unwrap_or(1.0);
                warmup.min_lr + (warmup.max_lr - warmup.min_lr) * gamma
            }
            Scheduler::WarmupDecayLr { warmup, total_num_steps } => {
                let gamma = warmup_fraction(&warmup, iteration).unwrap_or_else(|| {
                    let left = total_num_steps.saturating_sub(iteration) as f64;
                    let decay_steps = total_num_steps.saturating_sub(warmup.num_steps).max(1);
                    left / decay_steps as f64
                });
                warmup.min_lr + (warmup.max_lr - warmup.min_lr) * gamma
            }
            Scheduler::WarmupCosineLr(cosine) => self.base_lr * cosine_ratio(&cosine, iteration),
        }
    }
}

/// How far into the warm-up `iteration` is (0..1), or `None` after it.
fn warmup_fraction(warmup: &Warmup, iteration: u64) -> Option<f64> {
    (iteration < warmup.num_steps).then(|| curve(warmup.curve, iteration, warmup.num_steps))
}

fn curve(curve: WarmupCurve, iteration: u64, num_steps: u64) -> f64 {
    match curve {
        WarmupCurve::Log => ((iteration + 1) as f64).ln() / (num_steps as f64).ln(),
        WarmupCurve::Linear => iteration as f64 / num_steps as f64,
    }
}

/// WarmupCosineLR's factor on the optimizer's lr.
fn cosine_ratio(cosine: &CosineSchedule, iteration: u64) -> f64 {
    if iteration < cosine.warmup_num_steps {
        let ratio = curve(cosine.warmup_curve, iteration, cosine.warmup_num_steps).clamp(0.0, 1.0);
        return cosine.warmup_min_ratio + (1.0 - cosine.warmup_min_ratio) * ratio;
    }
    let decay_steps = cosine.total_num_steps.saturating_sub(cosine.warmup_num_steps).max(1) as f64;
    // Held at the minimum after the total (DeepSpeed's cosine would rise again).
    let since = ((iteration - cosine.warmup_num_steps + 1) as f64).min(decay_steps);
    let ratio = ((1.0 + (std::f64::consts::PI * since / decay_steps).cos()) / 2.0).clamp(0.0, 1.0);
    cosine.cos_min_ratio + (1.0 - cosine.cos_min_ratio) * ratio
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(scheduler: Scheduler) -> LrSchedule {
        LrSchedule { base_lr: 1e-2, scheduler: Some(scheduler) }
    }

    const LINEAR: Warmup =
        Warmup { min_lr: 0.0, max_lr: 1e-3, num_steps: 10, curve: WarmupCurve::Linear };

    #[test]
    fn without_a_scheduler_the_lr_is_the_optimizers() {
        let constant = LrSchedule { base_lr: 3e-3, scheduler: None };
        assert_eq!(constant.lr(0), 3e-3);
        assert_eq!(constant.lr(10_000), 3e-3);
    }

    #[test]
    fn warmup_lr_rises_linearly_then_holds() {
        let s = schedule(Scheduler::WarmupLr(LINEAR));
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(5) - 5e-4).abs() < 1e-12);
        assert_eq!(s.lr(10), 1e-3);
        assert_eq!(s.lr(1000), 1e-3);
    }

    #[test]
    fn warmup_lr_log_curve_matches_deepspeed() {
        let log = Warmup { curve: WarmupCurve::Log, ..LINEAR };
        let s = schedule(Scheduler::WarmupLr(log));
        // DeepSpeed: min + (max - min) * ln(t + 1) / ln(warmup_num_steps).
        assert!((s.lr(4) - 1e-3 * 5f64.ln() / 10f64.ln()).abs() < 1e-12);
    }

    #[test]
    fn warmup_decay_lr_reaches_zero_at_the_total() {
        let s = schedule(Scheduler::WarmupDecayLr { warmup: LINEAR, total_num_steps: 110 });
        assert_eq!(s.lr(10), 1e-3);
        assert!((s.lr(60) - 5e-4).abs() < 1e-12);
        assert_eq!(s.lr(110), 0.0);
        assert_eq!(s.lr(500), 0.0);
    }

    #[test]
    fn warmup_cosine_lr_scales_the_optimizers_lr_down_to_the_min_ratio() {
        let cosine = CosineSchedule {
            warmup_min_ratio: 0.0,
            warmup_num_steps: 10,
            cos_min_ratio: 0.1,
            warmup_curve: WarmupCurve::Linear,
            total_num_steps: 110,
        };
        let s = schedule(Scheduler::WarmupCosineLr(cosine));
        assert_eq!(s.lr(0), 0.0);
        assert!((s.lr(5) - 5e-3).abs() < 1e-12);
        // Half-way through the decay the cosine factor is 1/2.
        assert!((s.lr(59) - 1e-2 * (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert!((s.lr(109) - 1e-3).abs() < 1e-12);
        assert!((s.lr(1000) - 1e-3).abs() < 1e-12);
    }
}
