//! The portable kernel: plain Rust over groups of 8 lanes, which the compiler vectorizes with the
//! target's baseline instructions. Products and sums are rounded separately (no FMA), so its bits
//! differ from the AVX2/AVX-512 kernels' in the last place; within this level they are exact.

use half::bf16;

use crate::config::StepScalars;
use crate::piece::{GradElem, Piece, for_each_lanes};

const LANES: usize = 8;

pub(super) fn adamw<G: GradElem>(s: &StepScalars, piece: Piece<'_, G>) {
    for_each_lanes::<G, LANES>(piece, |p, g, m, v, out| {
        for i in 0..LANES {
            let grad = p[i] * s.l2 + g[i].to_f32() * s.grad_scale;
            m[i] += s.one_minus_beta1 * (grad - m[i]);
            v[i] += s.one_minus_beta2 * (grad * grad - v[i]);
            let denom = v[i].sqrt() * s.inv_sqrt_bias_correction2 + s.eps;
            let decayed = p[i] * s.neg_lr_weight_decay + p[i];
            p[i] = (m[i] / denom) * s.neg_step_size + decayed;
        }
        if let Some(out) = out {
            for i in 0..LANES {
                out[i] = bf16::from_f32(p[i]);
            }
        }
    });
}

pub(super) fn stream<G: GradElem>(c: f32, piece: Piece<'_, G>) {
    for_each_lanes::<G, LANES>(piece, |p, g, m, v, out| {
        for i in 0..LANES {
            let t = g[i].to_f32() * c;
            p[i] += t;
            m[i] += t;
            v[i] += t;
        }
        if let Some(out) = out {
            for i in 0..LANES {
                out[i] = bf16::from_bits((p[i].to_bits() >> 16) as u16);
            }
        }
    });
}
