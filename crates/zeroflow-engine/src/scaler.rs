//! Loss scaling for fp16, with DeepSpeed's rules (`DynamicLossScaler` of
//! `deepspeed/runtime/fp16/loss_scaler.py`).
//!
//! On overflow the step is skipped; the scale is divided by 2 once `hysteresis` overflows have
//! been absorbed (never below the minimum). After `window` iterations without overflow it doubles.
//! The iteration counter advances on skipped steps too.

/// The loss scale and its update rule.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum LossScaler {
    /// bf16 and fp32: no scaling.
    None,
    /// A fixed scale.
    Static(f32),
    Dynamic(DynamicScaler),
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct DynamicScaler {
    pub scale: f32,
    pub window: u64,
    pub min_scale: f32,
    /// How many overflows are absorbed before the scale drops (DeepSpeed's `delayed_shift`).
    pub hysteresis: u32,
    /// Whether a good iteration restores the hysteresis budget at once.
    pub consecutive_hysteresis: bool,
    hysteresis_left: u32,
    iteration: u64,
    /// The iteration of the last overflow, if any.
    last_overflow: Option<u64>,
}

impl DynamicScaler {
    pub fn new(
        initial_scale_power: u32,
        window: u64,
        min_scale: f32,
        hysteresis: u32,
        consecutive_hysteresis: bool,
    ) -> Self {
        DynamicScaler {
            scale: 2f32.powi(initial_scale_power as i32),
            window: window.max(1),
            min_scale,
            hysteresis,
            consecutive_hysteresis,
            hysteresis_left: hysteresis,
            iteration: 0,
            last_overflow: None,
        }
    }

    fn update(&mut self, overflow: bool) {
        if overflow {
            if self.hysteresis <= 1 || self.hysteresis_left <= 1 {
                self.scale = (self.scale / 2.0).max(self.min_scale);
            } else {
                self.hysteresis_left -= 1;
            }
            self.last_overflow = Some(self.iteration);
        } else {
            if self.consecutive_hysteresis {
                self.hysteresis_left = self.hysteresis;
            }
            // DeepSpeed starts `last_overflow_iter` at -1.
            let since = match self.last_overflow {
                Some(at) => self.iteration - at,
                None => self.iteration + 1,
            };
            if since % self.window == 0 {
                if !self.consecutive_hysteresis {
                    self.hysteresis_left = self.hysteresis;
                }
                self.scale *= 2.0;
            }
        }
        self.iteration += 1;
    }
}

impl LossScaler {
    /// Why this scaler (read from a checkpoint, say) cannot be used: a scale that is not a
    /// positive finite number, a zero window, or counters that the next update would overflow.
    pub fn check(&self) -> Result<(), String> {
        let positive = |what: &str, x: f32| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(format!("the loss scaler's {what} {x} is not a positive finite number"))
            }
        };
        match self {
            LossScaler::None => Ok(()),
            LossScaler::Static(scale) => positive("scale", *scale),
            LossScaler::Dynamic(d) => {
                positive("scale", d.scale)?;
                if !(d.min_scale.is_finite() && d.min_scale >= 0.0) {
                    return Err(format!("the loss scaler's min_scale {} is invalid", d.min_scale));
                }
                if d.window == 0 {
                    return Err("the loss scaler's window is 0".into());
                }
                if d.iteration == u64::MAX || d.last_overflow.is_some_and(|at| at > d.iteration) {
                    return Err(format!(
                        "the loss scaler's iteration {} and last overflow {:?} are inconsistent",
                        d.iteration, d.last_overflow
                    ));
                }
                Ok(())
            }
        }
    }

    /// The factor the loss (and so every gradient) is multiplied by.
    pub fn scale(&self) -> f32 {
        match self {
            LossScaler::None => 1.0,
            LossScaler::Static(s) => *s,
            LossScaler::Dynamic(d) => d.scale,
        }
    }

    /// Called once per optimizer step with whether its gradients overflowed.
    pub fn update(&mut self, overflow: bool) {
        if let LossScaler::Dynamic(d) = self {
            d.update(overflow);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_hysteresis_an_overflow_halves_the_scale_at_once() {
        let mut s = LossScaler::Dynamic(DynamicScaler::new(16, 1000, 1.0, 1, false));
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
    }

    #[test]
    fn with_deepspeeds_default_hysteresis_of_two_the_second_overflow_halves() {
        let mut s = LossScaler::Dynamic(DynamicScaler::new(16, 1000, 1.0, 2, false));
        s.update(true);
        assert_eq!(s.scale(), 65536.0, "the first overflow is absorbed");
        s.update(true);
        assert_eq!(s.scale(), 32768.0);
    }

    #[test]
    fn the_scale_doubles_after_a_window_of_good_iterations_and_never_drops_below_the_minimum() {
        let mut s = LossScaler::Dynamic(DynamicScaler::new(2, 3, 2.0, 1, false));
        s.update(true); // iteration 0 overflows: 4 → 2
        assert_eq!(s.scale(), 2.0);
        s.update(true); // at the minimum
        assert_eq!(s.scale(), 2.0);
        s.update(false); // iterations since overflow: 1
        s.update(false); // 2
        assert_eq!(s.scale(), 2.0);
        s.update(false); // 3: a whole window
        assert_eq!(s.scale(), 4.0);
    }

    #[test]
    fn check_refuses_scalers_whose_next_update_would_fail_or_that_scale_by_nonsense() {
        let good = DynamicScaler::new(16, 1000, 1.0, 2, false);
        assert_eq!(LossScaler::Dynamic(good.clone()).check(), Ok(()));
        assert_eq!(LossScaler::None.check(), Ok(()));
        assert_eq!(LossScaler::Static(128.0).check(), Ok(()));
        let bad = [
            LossScaler::Static(0.0),
            LossScaler::Static(f32::INFINITY),
            LossScaler::Dynamic(DynamicScaler { window: 0, ..good.clone() }),
            LossScaler::Dynamic(DynamicScaler { scale: -2.0, ..good.clone() }),
            LossScaler::Dynamic(DynamicScaler { min_scale: f32::NAN, ..good.clone() }),
            LossScaler::Dynamic(DynamicScaler { iteration: u64::MAX, ..good.clone() }),
            LossScaler::Dynamic(DynamicScaler { iteration: 3, last_overflow: Some(4), ..good }),
        ];
        for scaler in bad {
            assert!(scaler.check().is_err(), "{scaler:?}");
        }
    }

    #[test]
    fn like_deepspeed_the_first_window_counts_from_iteration_minus_one() {
        let mut s = LossScaler::Dynamic(DynamicScaler::new(0, 2, 1.0, 2, false));
        s.update(false); // (0 - -1) % 2 = 1
        assert_eq!(s.scale(), 1.0);
        s.update(false); // (1 - -1) % 2 = 0
        assert_eq!(s.scale(), 2.0);
    }
}
