//! The host Adam moments of a partition in the run's `optimizer_state_dtype`, and their exchange
//! with f32 (snapshots, restores, speculation backups, ZenFlow's device columns).

use std::ops::Range;

use zeroflow_core::adamw::OptimizerStateDtype;
use zeroflow_core::{Float, bf16};
use zeroflow_device::{Device, HostBuffer, HostMemory};
use zeroflow_optim::{CpuAdam, MomentElem};

use crate::EngineError;
use crate::host::convert_into;

/// The host Adam moments of a partition: f32, or bf16 (rounded stochastically by the kernels).
#[derive(Debug)]
pub(crate) enum HostMoments {
    F32 { exp_avg: HostBuffer<f32>, exp_avg_sq: HostBuffer<f32> },
    Bf16 { exp_avg: HostBuffer<bf16>, exp_avg_sq: HostBuffer<bf16> },
}

impl HostMoments {
    /// Zeroed moments of `len` elements as `dtype`.
    pub(crate) fn alloc<D: Device>(
        device: &D,
        len: usize,
        memory: HostMemory,
        dtype: OptimizerStateDtype,
    ) -> Result<Self, EngineError> {
        Ok(match dtype {
            OptimizerStateDtype::Fp32 => HostMoments::F32 {
                exp_avg: device.alloc_host(len, memory)?,
                exp_avg_sq: device.alloc_host(len, memory)?,
            },
            OptimizerStateDtype::Bf16 => HostMoments::Bf16 {
                exp_avg: device.alloc_host(len, memory)?,
                exp_avg_sq: device.alloc_host(len, memory)?,
            },
        })
    }

    /// `[exp_avg, exp_avg_sq]` of `range` as f32 into `to` (bf16 widens exactly).
    pub(crate) fn read(&self, adam: &CpuAdam, range: Range<usize>, to: [&mut [f32]; 2]) {
        match self {
            HostMoments::F32 { exp_avg, exp_avg_sq } => {
                widen_into(adam, to, [&exp_avg[range.clone()], &exp_avg_sq[range]])
            }
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => {
                widen_into(adam, to, [&exp_avg[range.clone()], &exp_avg_sq[range]])
            }
        }
    }

    /// Both moments as f32 vectors (bf16 widens exactly).
    pub(crate) fn to_f32(&self, adam: &CpuAdam) -> [Vec<f32>; 2] {
        let len = self.len();
        let [mut exp_avg, mut exp_avg_sq] = [vec![0.0; len], vec![0.0; len]];
        self.read(adam, 0..len, [&mut exp_avg, &mut exp_avg_sq]);
        [exp_avg, exp_avg_sq]
    }

    /// Overwrites `range` of both moments with `from` (f32): as they are, or rounded to the
    /// nearest bf16, which is exact for values that were bf16 moments (backups, checkpoints of a
    /// bf16 run).
    pub(crate) fn write(&mut self, adam: &CpuAdam, range: Range<usize>, from: [&[f32]; 2]) {
        match self {
            HostMoments::F32 { exp_avg, exp_avg_sq } => {
                let to = [&mut exp_avg[range.clone()], &mut exp_avg_sq[range]];
                narrow_into(adam, to, from)
            }
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => {
                let to = [&mut exp_avg[range.clone()], &mut exp_avg_sq[range]];
                narrow_into(adam, to, from)
            }
        }
    }

    /// Element `i`'s `(exp_avg, exp_avg_sq)` as f32.
    pub(crate) fn get(&self, i: usize) -> (f32, f32) {
        match self {
            HostMoments::F32 { exp_avg, exp_avg_sq } => (exp_avg[i], exp_avg_sq[i]),
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => {
                (exp_avg[i].to_f32(), exp_avg_sq[i].to_f32())
            }
        }
    }

    /// Sets element `i`'s moments (rounded to the nearest bf16 for bf16 moments).
    pub(crate) fn set(&mut self, i: usize, (m, v): (f32, f32)) {
        match self {
            HostMoments::F32 { exp_avg, exp_avg_sq } => (exp_avg[i], exp_avg_sq[i]) = (m, v),
            HostMoments::Bf16 { exp_avg, exp_avg_sq } => {
                (exp_avg[i], exp_avg_sq[i]) = (bf16::from_f32(m), bf16::from_f32(v));
            }
        }
    }

    /// The bytes of host memory the two moments hold.
    pub(crate) fn host_bytes(&self) -> usize {
        let per_element = match self {
            HostMoments::F32 { .. } => 2 * std::mem::size_of::<f32>(),
            HostMoments::Bf16 { .. } => 2 * std::mem::size_of::<bf16>(),
        };
        self.len() * per_element
    }

    fn len(&self) -> usize {
        match self {
            HostMoments::F32 { exp_avg, .. } => exp_avg.len(),
            HostMoments::Bf16 { exp_avg, .. } => exp_avg.len(),
        }
    }
}

/// `to[k][i] = from[k][i]` as f32, on the optimizer's threads.
fn widen_into<M: MomentElem>(adam: &CpuAdam, to: [&mut [f32]; 2], from: [&[M]; 2]) {
    for (to, from) in to.into_iter().zip(from) {
        adam.for_each_chunk_mut(to, |offset, chunk| {
            let from = &from[offset..offset + chunk.len()];
            chunk.iter_mut().zip(from).for_each(|(t, f)| *t = f.to_f32());
        });
    }
}

/// `to[k][i] = from[k][i]` as `M` (to nearest), on the optimizer's threads.
fn narrow_into<M: Float>(adam: &CpuAdam, to: [&mut [M]; 2], from: [&[f32]; 2]) {
    for (to, from) in to.into_iter().zip(from) {
        convert_into(adam, to, from);
    }
}
