//! The per-step scalars of AdamW: computed by zeroflow-optim, read by its CPU kernels and by the
//! GPU kernel in zeroflow-device, which both depend on this crate and not on each other.

/// The scalars of one optimizer step, computed once in f64 and rounded to f32 for the kernels
/// (zeroflow-optim's CPU kernels and zeroflow-device's GPU kernel, which compute the same
/// expressions).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepScalars {
    /// Multiplies every gradient: 1 / loss scale × clip coefficient.
    pub grad_scale: f32,
    /// `wd` in L2 mode, 0 otherwise: `g = fma(p, l2, g)`.
    pub l2: f32,
    /// `1 - β1`: `m = fma(1 - β1, g - m, m)`, torch's `lerp`. (Multiplying by β1 rounded to f32
    /// would decay the moments by a slightly wrong factor, an error that accumulates.)
    pub one_minus_beta1: f32,
    /// `1 - β2`: `v = fma(1 - β2, g² - v, v)`.
    pub one_minus_beta2: f32,
    /// `1 / sqrt(1 - β2^t)`, or 1 without bias correction.
    pub inv_sqrt_bias_correction2: f32,
    pub eps: f32,
    /// `-lr wd` in decoupled mode, 0 otherwise: `p = fma(p, -lr wd, p)`. (Rounding `1 - lr wd`
    /// to f32 instead would shrink every weight by a slightly wrong factor, an error of up to
    /// 3e-8 per step that accumulates in one direction.)
    pub neg_lr_weight_decay: f32,
    /// `-lr / (1 - β1^t)`, or `-lr` without bias correction.
    pub neg_step_size: f32,
}

/// The element type of the CPU optimizer's Adam moments (`exp_avg`, `exp_avg_sq`) in host
/// memory (`zeroflow.optimizer_state_dtype`). The master weights stay fp32 either way.
///
/// bf16 halves the moments' bytes (12 to 8 bytes of optimizer state per parameter). fp16 is not
/// offered: `exp_avg_sq` holds squared gradients, routinely below fp16's smallest normal
/// (6.1e-5) and often below its smallest subnormal (6e-8), where it would flush to zero and
/// turn the update into `m / eps`; bf16 has fp32's exponent range.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OptimizerStateDtype {
    /// fp32 moments, as torch and DeepSpeed keep them.
    #[default]
    Fp32,
    /// bf16 moments, computed in f32 and stored with stochastic rounding (zeroflow-optim).
    Bf16,
}

impl OptimizerStateDtype {
    pub const ALL: [OptimizerStateDtype; 2] =
        [OptimizerStateDtype::Fp32, OptimizerStateDtype::Bf16];

    /// Bytes of one element of one moment.
    pub const fn bytes(self) -> usize {
        match self {
            OptimizerStateDtype::Fp32 => 4,
            OptimizerStateDtype::Bf16 => 2,
        }
    }

    /// Bytes of host optimizer state per parameter: the fp32 master weight and both moments.
    pub const fn state_bytes_per_param(self) -> usize {
        4 + 2 * self.bytes()
    }

    /// The name in the config, flags and checkpoints: `fp32`, `bf16`.
    pub const fn name(self) -> &'static str {
        match self {
            OptimizerStateDtype::Fp32 => "fp32",
            OptimizerStateDtype::Bf16 => "bf16",
        }
    }

    /// The dtype `name` names (`fp32`/`f32`, `bf16`), if any.
    pub fn from_name(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "fp32" | "f32" | "float32" => Some(OptimizerStateDtype::Fp32),
            "bf16" | "bfloat16" => Some(OptimizerStateDtype::Bf16),
            _ => None,
        }
    }
}

impl std::fmt::Display for OptimizerStateDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
