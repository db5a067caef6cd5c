//! Random state, the f64 reference AdamW and error measures shared by the tests.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_optim::{AdamState, AdamWConfig, Grads, WeightDecayMode, bf16};

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// A non-zero value with a random sign and a magnitude spread log-uniformly over `[lo, hi)`.
pub fn signed_log_uniform(rng: &mut ChaCha8Rng, lo: f64, hi: f64) -> f32 {
    let magnitude = (rng.random_range(lo.ln()..hi.ln())).exp();
    let sign = if rng.random::<bool>() { 1.0 } else { -1.0 };
    (sign * magnitude) as f32
}

/// The gradient element types the tests run over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradType {
    F32,
    Bf16,
}

/// One step's gradients in both the kernel's type and f64.
#[derive(Debug)]
pub struct StepGrads {
    pub f32: Vec<f32>,
    pub bf16: Vec<bf16>,
    pub kind: GradType,
}

impl StepGrads {
    /// Random non-zero gradients spanning four decades, so that `eps` and the gradient scale
    /// both matter; rounded to bf16 first when the kernel reads bf16.
    pub fn random(rng: &mut ChaCha8Rng, len: usize, kind: GradType) -> Self {
        let raw: Vec<f32> = (0..len).map(|_| signed_log_uniform(rng, 1e-4, 1.0)).collect();
        let bf16: Vec<bf16> = raw.iter().map(|&g| bf16::from_f32(g)).collect();
        let f32 = match kind {
            GradType::F32 => raw,
            GradType::Bf16 => bf16.iter().map(|g| g.to_f32()).collect(),
        };
        StepGrads { f32, bf16, kind }
    }

    /// The gradients of elements `range`.
    pub fn range(&self, range: std::ops::Range<usize>) -> Grads<'_> {
        match self.kind {
            GradType::F32 => Grads::F32(&self.f32[range]),
            GradType::Bf16 => Grads::Bf16(&self.bf16[range]),
        }
    }

    pub fn as_grads(&self) -> Grads<'_> {
        match self.kind {
            GradType::F32 => Grads::F32(&self.f32),
            GradType::Bf16 => Grads::Bf16(&self.bf16),
        }
    }
}

/// fp32 optimizer state owned by a test.
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub params: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
}

impl State {
    /// Weights of magnitude 0.5..2 and first moments of 1e-4..0.1, either sign, and second
    /// moments 1 to 100 times the first moment's square, as after some training (all non-zero).
    pub fn random(rng: &mut ChaCha8Rng, len: usize) -> Self {
        let params = (0..len).map(|_| signed_log_uniform(rng, 0.5, 2.0)).collect();
        let exp_avg: Vec<f32> = (0..len).map(|_| signed_log_uniform(rng, 1e-4, 0.1)).collect();
        let exp_avg_sq =
            exp_avg.iter().map(|&m| (m * rng.random_range(1.0f32..10.0)).powi(2)).collect();
        State { params, exp_avg, exp_avg_sq }
    }

    pub fn view(&mut self) -> AdamState<'_> {
        AdamState {
            params: &mut self.params,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
        }
    }

    pub fn to_f64(&self) -> State64 {
        let widen = |x: &[f32]| x.iter().map(|&x| f64::from(x)).collect();
        State64 {
            params: widen(&self.params),
            exp_avg: widen(&self.exp_avg),
            exp_avg_sq: widen(&self.exp_avg_sq),
        }
    }

    /// The bit patterns, for exact comparisons that also tell NaNs and signed zeros apart.
    pub fn bits(&self) -> Vec<[u32; 3]> {
        (0..self.params.len())
            .map(|i| {
                [self.params[i].to_bits(), self.exp_avg[i].to_bits(), self.exp_avg_sq[i].to_bits()]
            })
            .collect()
    }
}

/// The f64 reference state.
#[derive(Clone, Debug)]
pub struct State64 {
    pub params: Vec<f64>,
    pub exp_avg: Vec<f64>,
    pub exp_avg_sq: Vec<f64>,
}

/// One AdamW step in f64, written from the formulas of torch's `_single_tensor_adamw` (and its
/// Adam with `weight_decay` for L2 mode), independently of the crate's kernels.
pub fn reference_step(
    config: &AdamWConfig,
    step: u64,
    grad_scale: f64,
    grads: &[f32],
    state: &mut State64,
) {
    let (beta1, beta2) = config.betas;
    let (bias_correction1, bias_correction2) = if config.bias_correction {
        (1.0 - beta1.powi(step as i32), 1.0 - beta2.powi(step as i32))
    } else {
        (1.0, 1.0)
    };
    for (i, &grad) in grads.iter().enumerate() {
        let p = &mut state.params[i];
        let m = &mut state.exp_avg[i];
        let v = &mut state.exp_avg_sq[i];
        let mut g = f64::from(grad) * grad_scale;
        if config.mode == WeightDecayMode::L2 {
            g += config.weight_decay * *p;
        }
        *m = beta1 * *m + (1.0 - beta1) * g;
        *v = beta2 * *v + (1.0 - beta2) * g * g;
        if config.mode == WeightDecayMode::Decoupled {
            *p *= 1.0 - config.lr * config.weight_decay;
        }
        let denom = v.sqrt() / bias_correction2.sqrt() + config.eps;
        *p -= config.lr / bias_correction1 * *m / denom;
    }
}

/// `‖actual − expected‖₂ / ‖expected‖₂`.
pub fn normwise_relative_error(actual: &[f32], expected: &[f64]) -> f64 {
    let (mut diff, mut norm) = (0.0, 0.0);
    for (&a, &e) in actual.iter().zip(expected) {
        diff += (f64::from(a) - e).powi(2);
        norm += e * e;
    }
    (diff / norm).sqrt()
}

/// Hyper-parameters under which every term matters: a large enough step that the update moves
/// the weights, `eps` comparable to the root of small second moments, visible weight decay.
pub fn test_config(mode: WeightDecayMode, bias_correction: bool) -> AdamWConfig {
    AdamWConfig {
        lr: 1e-3,
        betas: (0.9, 0.999),
        eps: 1e-3,
        weight_decay: 0.1,
        mode,
        bias_correction,
    }
}
