//! The memory-bound ceiling of an AdamW pass.
//!
//! [`pass`] reads and writes exactly what an AdamW step does (reads the weights, gradients and
//! both moments, writes the weights and both moments) with the same threads and chunking, but does
//! a single multiply-add per stream instead of AdamW's arithmetic: `t = c g; p += t; m += t;
//! v += t`. Its throughput is what the optimizer could reach if arithmetic were free. It always
//! uses the widest SIMD level the CPU has, whatever the executor's level, so that it measures the
//! memory and not the instruction set.

pub use crate::Stores;
use crate::executor::{Piece, whole_piece};
use crate::kernels::{self, SupportedLevel};
use crate::piece::MomentElem;
use crate::{AdamState, CpuAdam, Grads, OptimError, Output};

/// Bytes moved per element by an AdamW step, and by the roofline pass: read the fp32 weight, the
/// gradient (`grad_bytes`) and both moments (`moment_bytes` each), write the weight and both
/// moments, plus the bf16 weight copy when one is written. f32 gradients and moments: 28 bytes
/// (30 with the copy); bf16 gradients, f32 moments: 26 (28); bf16 gradients and moments: 18 (20).
pub const fn bytes_per_param(grad_bytes: usize, moment_bytes: usize, bf16_copy: bool) -> usize {
    let reads = 4 + grad_bytes + 2 * moment_bytes;
    let writes = 4 + 2 * moment_bytes + if bf16_copy { 2 } else { 0 };
    reads + writes
}

/// One way of streaming through memory: how the roofline pass writes the fp32 state and the
/// bf16 copy, and whether it prefetches ahead as the AdamW kernels do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RooflineVariant {
    pub state: Stores,
    pub copy: Stores,
    pub prefetch: bool,
}

impl RooflineVariant {
    /// The variants worth measuring, the best of which is the ceiling: with prefetch, all
    /// ordinary stores, all streaming stores and (for a pass with a copy) ordinary stores for the
    /// state, which was just read, with a streamed copy, which is only written; and ordinary
    /// stores without prefetch.
    pub fn candidates(with_copy: bool) -> Vec<RooflineVariant> {
        let variant = |state, copy, prefetch| RooflineVariant { state, copy, prefetch };
        let mut candidates = vec![
            variant(Stores::Normal, Stores::Normal, true),
            variant(Stores::NonTemporal, Stores::NonTemporal, true),
            variant(Stores::Normal, Stores::Normal, false),
        ];
        if with_copy {
            candidates.push(variant(Stores::Normal, Stores::NonTemporal, true));
        }
        candidates
    }

    /// For example `normal`, `non-temporal`, `normal+non-temporal copy`, `normal, no prefetch`.
    pub fn name(self) -> String {
        let stores = if self.state == self.copy {
            self.state.name().to_owned()
        } else {
            format!("{}+{} copy", self.state.name(), self.copy.name())
        };
        if self.prefetch { stores } else { format!("{stores}, no prefetch") }
    }
}

/// One roofline pass over a whole partition with `adam`'s threads and chunking: adds
/// `c × grads` to the weights and both moments, and writes the new weights' upper halves to the
/// bf16 copy if `out` asks for one (the traffic of [`CpuAdam::step`] with the same arguments).
/// `c = 0` leaves the values unchanged across many passes.
pub fn pass<M: MomentElem>(
    adam: &CpuAdam,
    state: AdamState<'_, M>,
    grads: Grads<'_>,
    out: Output<'_>,
    c: f32,
    variant: RooflineVariant,
) -> Result<(), OptimError> {
    let level = SupportedLevel::detect();
    match grads {
        Grads::F32(grads) => {
            let piece: Piece<'_, f32, M> = whole_piece(state, grads, out)?;
            adam.run(piece, 0, &|piece, _| kernels::stream(level, c, variant, piece));
        }
        Grads::Bf16(grads) => {
            let piece = whole_piece(state, grads, out)?;
            adam.run(piece, 0, &|piece, _| kernels::stream(level, c, variant, piece));
        }
    }
    Ok(())
}
