//! The SwiGLU of the MLP (`transformers`' `act_fn(gate_proj(x)) * up_proj(x)` with `act_fn` SiLU):
//! `out = silu(gate) · up`, `silu(g) = g · σ(g)`.

use rayon::prelude::*;
use zeroflow_nn::Float;

const CHUNK: usize = 4096;

/// The logistic function `1 / (1 + e^−g)` (0 where `e^−g` overflows, never NaN).
fn sigmoid<F: Float>(g: F) -> F {
    F::one() / (F::one() + (-g).exp())
}

/// `out = gate · σ(gate) · up`, element-wise.
pub fn swiglu_forward<F: Float>(out: &mut [F], gate: &[F], up: &[F]) {
    out.par_chunks_mut(CHUNK).zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK))).for_each(
        |(out, (gate, up))| {
            for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
                *o = g * sigmoid(g) * u;
            }
        },
    );
}

/// Adds the gradients of [`swiglu_forward`]: `dgate += dout · up · σ(g) · (1 + g · (1 − σ(g)))`,
/// `dup += dout · silu(g)`.
pub fn swiglu_backward<F: Float>(dgate: &mut [F], dup: &mut [F], dout: &[F], gate: &[F], up: &[F]) {
    let grads = dgate.par_chunks_mut(CHUNK).zip(dup.par_chunks_mut(CHUNK));
    let inputs = dout.par_chunks(CHUNK).zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)));
    grads.zip(inputs).for_each(|((dgate, dup), (dout, (gate, up)))| {
        for i in 0..dgate.len() {
            let (g, u, d) = (gate[i], up[i], dout[i]);
            let s = sigmoid(g);
            dgate[i] += d * u * s * (F::one() + g * (F::one() - s));
            dup[i] += d * g * s;
        }
    });
}
