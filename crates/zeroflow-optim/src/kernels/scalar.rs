//! The portable kernel: plain Rust over groups of 8 lanes, which the compiler vectorizes with the
//! target's baseline instructions. Products and sums are rounded separately (no FMA), so its bits
//! differ from the AVX2/AVX-512 kernels' in the last place; within this level they are exact.

use half::bf16;

use crate::config::StepScalars;
use crate::piece::{GradElem, MomentElem, Piece, for_each_lanes};
use crate::rounding::MomentSeeds;

const LANES: usize = 8;

/// Copies `from` (f32, or bf16 widened exactly) into `into`.
pub(super) fn save<M: MomentElem>(from: &[M], into: &mut [f32]) {
    for (x, y) in from.iter().zip(into) {
        *y = x.to_f32();
    }
}

/// AdamW over one piece whose first element is element `start` of the partition.
pub(super) fn adamw<G: GradElem, M: MomentElem>(
    s: &StepScalars,
    seeds: MomentSeeds,
    start: usize,
    piece: Piece<'_, G, M>,
) {
    for_each_lanes::<G, M, LANES>(piece, |index, p, g, m, v, out| {
        for i in 0..LANES {
            let (m0, v0) = (m[i].to_f32(), v[i].to_f32());
            let grad = p[i] * s.l2 + g[i].to_f32() * s.grad_scale;
            let m1 = m0 + s.one_minus_beta1 * (grad - m0);
            let v1 = v0 + s.one_minus_beta2 * (grad * grad - v0);
            let denom = v1.sqrt() * s.inv_sqrt_bias_correction2 + s.eps;
            let decayed = p[i] * s.neg_lr_weight_decay + p[i];
            p[i] = (m1 / denom) * s.neg_step_size + decayed;
            let element = start + index + i;
            m[i] = M::store_rounded(m1, seeds.exp_avg, element);
            v[i] = M::store_rounded(v1, seeds.exp_avg_sq, element);
        }
        if let Some(out) = out {
            for i in 0..LANES {
                out[i] = bf16::from_f32(p[i]);
            }
        }
    });
}

pub(super) fn stream<G: GradElem, M: MomentElem>(c: f32, piece: Piece<'_, G, M>) {
    for_each_lanes::<G, M, LANES>(piece, |_, p, g, m, v, out| {
        for i in 0..LANES {
            let t = g[i].to_f32() * c;
            p[i] += t;
            m[i] = M::truncated(m[i].to_f32() + t);
            v[i] = M::truncated(v[i].to_f32() + t);
        }
        if let Some(out) = out {
            for i in 0..LANES {
                out[i] = bf16::from_bits((p[i].to_bits() >> 16) as u16);
            }
        }
    });
}
