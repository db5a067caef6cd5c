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
