//! Element-wise kernels: the residual sum, zero-fill.

use rayon::prelude::*;

use crate::float::Float;

const CHUNK: usize = 4096;
/// `out = a + b`.
pub fn residual_forward<F: Float>(out: &mut [F], a: &[F], b: &[F]) {
    out.par_chunks_mut(CHUNK).zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK))).for_each(
        |(out, (a, b))| {
            for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
                *o = x + y;
            }
        },
    );
}

/// `da += dout`, `db += dout`.
pub fn residual_backward<F: Float>(da: &mut [F], db: &mut [F], dout: &[F]) {
    da.par_chunks_mut(CHUNK).zip(db.par_chunks_mut(CHUNK).zip(dout.par_chunks(CHUNK))).for_each(
        |(da, (db, dout))| {
            for ((a, b), &d) in da.iter_mut().zip(db.iter_mut()).zip(dout) {
                *a += d;
                *b += d;
            }
        },
    );
}

/// `out = 0`.
pub fn zero<F: Float>(out: &mut [F]) {
    out.par_chunks_mut(CHUNK).for_each(|chunk| chunk.fill(F::zero()));
}
