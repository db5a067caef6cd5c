//! Hyper-parameters, the step counter and the per-step scalars of AdamW.

use crate::OptimError;

/// How weight decay enters the update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightDecayMode {
    /// AdamW (Loshchilov & Hutter): the weight is shrunk before the update, `p *= 1 - lr * wd`,
    /// and the moments never see the decay. torch's `AdamW`, DeepSpeed's `adamw_mode=True`.
    Decoupled,
    /// Adam with an L2 penalty: `g += wd * p` before the moments. torch's `Adam(weight_decay=…)`,
    /// DeepSpeed's `adamw_mode=False`.
    L2,
}

/// AdamW's hyper-parameters, with torch's meaning.
///
/// Per step, with `g` the gradient times the step's gradient scale:
///
/// ```text
/// L2 mode:        g  = g + wd * p
/// moments:        m  = β1 m + (1 - β1) g
///                 v  = β2 v + (1 - β2) g²
/// decoupled mode: p  = p (1 - lr wd)
/// update:         p  = p - lr / (1 - β1^t) * m / (sqrt(v) / sqrt(1 - β2^t) + eps)
/// ```
///
/// Without bias correction both `1 - β^t` factors are 1 (DeepSpeed's `bias_correction=False`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate; a schedule changes it between steps with [`AdamW::set_lr`].
    pub lr: f64,
    /// (β1, β2), the decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the bias-corrected root of the second moment.
    pub eps: f64,
    /// Weight decay coefficient; its meaning depends on `mode`.
    pub weight_decay: f64,
    pub mode: WeightDecayMode,
    /// Divide the moments by `1 - β^t` (torch always does; DeepSpeed makes it optional).
    pub bias_correction: bool,
}

impl Default for AdamWConfig {
    /// torch's `AdamW` defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 1e-2.
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
            mode: WeightDecayMode::Decoupled,
            bias_correction: true,
        }
    }
}

impl AdamWConfig {
    /// Checks the ranges torch checks: lr, eps and weight decay non-negative and finite, both betas
    /// in `[0, 1)`.
    pub fn validate(&self) -> Result<(), OptimError> {
        let checks: [(&'static str, f64, bool, &'static str); 5] = [
            ("lr", self.lr, self.lr >= 0.0 && self.lr.is_finite(), "must be finite and >= 0"),
            ("betas[0]", self.betas.0, (0.0..1.0).contains(&self.betas.0), "must be in [0, 1)"),
            ("betas[1]", self.betas.1, (0.0..1.0).contains(&self.betas.1), "must be in [0, 1)"),
            ("eps", self.eps, self.eps >= 0.0 && self.eps.is_finite(), "must be finite and >= 0"),
            (
                "weight_decay",
                self.weight_decay,
                self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
                "must be finite and >= 0",
            ),
        ];
        match checks.into_iter().find(|(_, _, ok, _)| !ok) {
            Some((name, value, _, expected)) => {
                Err(OptimError::InvalidHyperParameter { name, value, expected })
            }
            None => Ok(()),
        }
    }
}

pub use zeroflow_core::adamw::StepScalars;

/// Everything the kernels need for optimizer step `t`: the configuration at that step, the step
/// number and the gradient scale, with the per-step scalars precomputed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    step: u64,
    pub(crate) scalars: StepScalars,
}

impl AdamWStep {
    /// The scalars of step `step` (counting from 1) with gradients multiplied by `grad_scale`
    /// (1 / loss scale × clip coefficient; 1.0 for none).
    pub fn new(config: &AdamWConfig, step: u64, grad_scale: f32) -> Result<Self, OptimError> {
        config.validate()?;
        if step == 0 {
            return Err(OptimError::StepZero);
        }
        Ok(Self::from_valid(config, step, grad_scale))
    }

    /// [`AdamWStep::new`] for a validated configuration and a step of at least 1.
    fn from_valid(config: &AdamWConfig, step: u64, grad_scale: f32) -> Self {
        debug_assert!(step >= 1);
        let (beta1, beta2) = config.betas;
        let (bias_correction1, bias_correction2) = if config.bias_correction {
            let t = step as f64;
            (1.0 - beta1.powf(t), 1.0 - beta2.powf(t))
        } else {
            (1.0, 1.0)
        };
        let (l2, neg_lr_weight_decay) = match config.mode {
            // `0 - x` rather than `-x`: without decay the factor is +0, and fma(p, +0, p) keeps
            // the sign of a zero weight (-0 would turn -0 into +0).
            WeightDecayMode::Decoupled => (0.0, 0.0 - config.lr * config.weight_decay),
            WeightDecayMode::L2 => (config.weight_decay, 0.0),
        };
        let scalars = StepScalars {
            grad_scale,
            l2: l2 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            inv_sqrt_bias_correction2: (1.0 / bias_correction2.sqrt()) as f32,
            eps: config.eps as f32,
            neg_lr_weight_decay: neg_lr_weight_decay as f32,
            neg_step_size: (-config.lr / bias_correction1) as f32,
        };
        AdamWStep { step, scalars }
    }

    /// This step without weight decay (neither decoupled nor L2), everything else the same:
    /// how the parameters that do not decay ([`NoDecay`]) are stepped.
    pub fn without_weight_decay(&self) -> AdamWStep {
        // +0 as a configuration without decay has it (see `from_valid`).
        let scalars = StepScalars { l2: 0.0, neg_lr_weight_decay: 0.0, ..self.scalars };
        AdamWStep { step: self.step, scalars }
    }

    /// Whether this step decays the weights at all (a weight decay of 0 does not): where it
    /// does not, the elements of [`NoDecay`] need no run of their own.
    pub fn decays(&self) -> bool {
        self.scalars.l2 != 0.0 || self.scalars.neg_lr_weight_decay != 0.0
    }

    /// The step number `t`, counting from 1.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The factor every gradient is multiplied by.
    pub fn grad_scale(&self) -> f32 {
        self.scalars.grad_scale
    }

    /// The per-step scalars the kernels use (for kernels outside this crate, such as the GPU's).
    pub fn scalars(&self) -> StepScalars {
        self.scalars
    }
}

/// AdamW's step counter: the configuration (whose learning rate a schedule may change) and the
/// number of steps taken. Skipped steps (overflow) simply do not call [`AdamW::next_step`].
#[derive(Clone, Debug, PartialEq)]
pub struct AdamW {
    config: AdamWConfig,
    steps_taken: u64,
}

impl AdamW {
    /// A fresh optimizer that has taken no step.
    pub fn new(config: AdamWConfig) -> Result<Self, OptimError> {
        config.validate()?;
        Ok(AdamW { config, steps_taken: 0 })
    }

    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Sets the learning rate of the following steps (for schedules).
    pub fn set_lr(&mut self, lr: f64) -> Result<(), OptimError> {
        let config = AdamWConfig { lr, ..self.config };
        config.validate()?;
        self.config = config;
        Ok(())
    }

    /// How many steps have been taken (the `step` of torch's optimizer state).
    pub fn steps_taken(&self) -> u64 {
        self.steps_taken
    }

    /// Continues counting after `steps_taken` steps (resuming from a checkpoint).
    pub fn resume_at(&mut self, steps_taken: u64) {
        self.steps_taken = steps_taken;
    }

    /// Counts one more step and returns its scalars.
    pub fn next_step(&mut self, grad_scale: f32) -> AdamWStep {
        self.steps_taken += 1;
        AdamWStep::from_valid(&self.config, self.steps_taken, grad_scale)
    }
}

/// The elements that take no weight decay — a model's 1-D parameters: its norms' weights and
/// its biases, as `transformers`' `Trainer`, nanoGPT, llm.c and Megatron-LM leave them out —
/// as sorted, disjoint ranges of a state's elements.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NoDecay(std::sync::Arc<[std::ops::Range<usize>]>);

impl NoDecay {
    /// The ranges `ranges` (in any order; empty ones dropped, touching ones joined).
    pub fn new(mut ranges: Vec<std::ops::Range<usize>>) -> NoDecay {
        ranges.retain(|r| !r.is_empty());
        ranges.sort_by_key(|r| r.start);
        let mut joined: Vec<std::ops::Range<usize>> = Vec::with_capacity(ranges.len());
        for range in ranges {
            match joined.last_mut() {
                Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
                _ => joined.push(range),
            }
        }
        NoDecay(joined.into())
    }

    /// True where every element decays.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The ranges.
    pub fn ranges(&self) -> &[std::ops::Range<usize>] {
        &self.0
    }

    /// These ranges within `window`, counted from its start (a part of a state kept elsewhere).
    pub fn within(&self, window: std::ops::Range<usize>) -> NoDecay {
        let shifted = self.0.iter().map(|r| {
            let (start, end) = (r.start.max(window.start), r.end.min(window.end));
            start.saturating_sub(window.start)..end.saturating_sub(window.start)
        });
        NoDecay::new(shifted.filter(|r| r.start < r.end).collect())
    }

    /// `range` cut into consecutive runs, each with whether its elements decay.
    pub fn runs(
        &self,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (std::ops::Range<usize>, bool)> + '_ {
        runs(&self.0, range)
    }

    /// `range` cut into consecutive runs, each with the step its elements take: `step`, or
    /// [`AdamWStep::without_weight_decay`] for these ranges — one run where `step` does not decay.
    pub fn steps(
        &self,
        step: &AdamWStep,
        range: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (std::ops::Range<usize>, AdamWStep)> + '_ {
        let (with, without) = (*step, step.without_weight_decay());
        let ranges = if step.decays() { &self.0[..] } else { &[] };
        runs(ranges, range).map(move |(run, decays)| (run, if decays { with } else { without }))
    }
}

/// `range` cut into consecutive runs by the sorted, disjoint `ranges`: each run with whether it
/// lies outside them.
fn runs(
    ranges: &[std::ops::Range<usize>],
    range: std::ops::Range<usize>,
) -> impl Iterator<Item = (std::ops::Range<usize>, bool)> + '_ {
    let first = ranges.partition_point(|r| r.end <= range.start);
    let mut inside = ranges[first..].iter().take_while(move |r| r.start < range.end).peekable();
    let mut at = range.start;
    std::iter::from_fn(move || {
        if at >= range.end {
            return None;
        }
        let run = match inside.peek() {
            Some(r) if r.start > at => (at..r.start, true),
            Some(r) => {
                let end = r.end.min(range.end);
                inside.next();
                (at..end, false)
            }
            None => (at..range.end, true),
        };
        at = run.0.end;
        Some(run)
    })
}

#[cfg(test)]
mod no_decay_tests {
    use super::NoDecay;

    #[test]
    fn runs_cover_a_range_in_order_and_ranges_join() {
        let no_decay = NoDecay::new(vec![20..25, 5..8, 8..10, 3..3, 30..40]);
        assert_eq!(no_decay.ranges(), [5..10, 20..25, 30..40]);
        assert_eq!(
            no_decay.runs(0..35).collect::<Vec<_>>(),
            [
                (0..5, true),
                (5..10, false),
                (10..20, true),
                (20..25, false),
                (25..30, true),
                (30..35, false)
            ]
        );
        assert_eq!(no_decay.runs(6..7).collect::<Vec<_>>(), [(6..7, false)]);
        assert_eq!(no_decay.runs(11..19).collect::<Vec<_>>(), [(11..19, true)]);
        assert_eq!(no_decay.runs(22..22).collect::<Vec<_>>(), []);
        assert_eq!(NoDecay::default().runs(3..9).collect::<Vec<_>>(), [(3..9, true)]);
        assert_eq!(no_decay.within(8..32).ranges(), [0..2, 12..17, 22..24]);
    }
}
