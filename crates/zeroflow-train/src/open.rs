//! How each device kind is opened for the trainer and `bench step`: the device, this rank's
//! communicator in the job, the family's model on that device, and the side channel
//! ([`Opened`]).

use std::time::Duration;

use zeroflow_core::layout::FlatLayout;
use zeroflow_device::cpu::CpuComm;
use zeroflow_device::cuda::CudaDeviceOptions;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::nccl::{NcclComm, NcclId};
use zeroflow_device::{CpuDevice, CudaDevice};
use zeroflow_nn::{AttentionKind, PlanOptions};

use crate::dist::{self, DistEnv};
use crate::error::{Result, TrainError, input};
use crate::{Family, Model, Opened};

/// What opens a device kind for the trainer and `bench step`, from the model's shape, the
/// micro-batch (sequences), the sequence length (tokens, at most the model's context), the flat
/// layout (for the job's world size) and this process's rank in the job: [`open_cpu`] or
/// [`CudaOpen::opener`], or (in tests) a closure holding devices made beforehand.
pub trait OpenFn<F: Family, M: Model>:
    FnOnce(&F, usize, usize, &FlatLayout, &DistEnv) -> Result<Opened<M>>
{
}

impl<F: Family, M: Model, O> OpenFn<F, M> for O where
    O: FnOnce(&F, usize, usize, &FlatLayout, &DistEnv) -> Result<Opened<M>>
{
}

/// The CPU device, a communicator of one, and the family's model in f32 (a job of one process).
pub fn open_cpu<F: Family>(
    model: &F,
    micro_batch: usize,
    seq: usize,
    layout: &FlatLayout,
    dist: &DistEnv,
) -> Result<Opened<F::Cpu>> {
    open_cpu_model(model, micro_batch, seq, layout, dist, false)
}

/// [`open_cpu`] whose model packs rows where `packed` says (`--pack`): its batches carry each
/// token's position in its document.
pub fn cpu_opener<F: Family>(packed: bool) -> impl OpenFn<F, F::Cpu> {
    move |model: &F, micro_batch: usize, seq: usize, layout: &FlatLayout, dist: &DistEnv| {
        open_cpu_model(model, micro_batch, seq, layout, dist, packed)
    }
}

fn open_cpu_model<F: Family>(
    model: &F,
    micro_batch: usize,
    seq: usize,
    layout: &FlatLayout,
    dist: &DistEnv,
    packed: bool,
) -> Result<Opened<F::Cpu>> {
    if dist.world_size != 1 {
        return Err(input("the CPU device trains in one process"));
    }
    let device = CpuDevice::new()?;
    let comm = CpuComm::group(std::slice::from_ref(&device), Duration::from_secs(60))
        .pop()
        .expect("a group of one");
    let model = model.cpu_model(&device, layout, micro_batch, seq, packed)?;
    let (_, group) = dist::join(dist, || Ok(Vec::new()))?;
    Ok(Opened { device, comm, model, group })
}

/// How a GPU and the model on it are opened: the settings the binary resolved.
#[derive(Clone, Debug)]
pub struct CudaOpen {
    pub device: CudaDeviceOptions,
    pub attention: AttentionKind,
    pub activation_checkpointing: bool,
}

impl CudaOpen {
    /// [`open_cuda`] with these options, as an [`OpenFn`].
    pub fn opener<F: Family>(self) -> impl OpenFn<F, F::Cuda> {
        self.packed_opener(false)
    }

    /// [`CudaOpen::opener`] whose model packs rows where `packed` says (`--pack`): its batches
    /// carry each token's position in its document.
    pub fn packed_opener<F: Family>(self, packed: bool) -> impl OpenFn<F, F::Cuda> {
        move |model: &F, micro_batch: usize, seq: usize, layout: &FlatLayout, dist: &DistEnv| {
            open_cuda(model, (micro_batch, seq), layout, dist, &self, packed)
        }
    }
}

/// The GPU of this process's local rank (opened as `open` says), its NCCL communicator in the
/// job, and the family's model in bf16 with `open`'s attention, packing rows where `packed`
/// says.
///
/// With several ranks, the processes meet first ([`dist::join`]: rank 0 makes the NCCL id and
/// hands its bytes to the others), then each joins the NCCL group on its GPU.
pub fn open_cuda<F: Family>(
    model: &F,
    (micro_batch, seq): (usize, usize),
    layout: &FlatLayout,
    dist: &DistEnv,
    open: &CudaOpen,
    packed: bool,
) -> Result<Opened<F::Cuda>> {
    let (device, comm, group) = if dist.world_size == 1 {
        let device = CudaDevice::with_options(dist.local_rank, open.device.clone())?;
        let comm = NcclComm::group(std::slice::from_ref(&device))?.pop().expect("a group of one");
        let (_, group) = dist::join(dist, || Ok(Vec::new()))?;
        (device, comm, group)
    } else {
        let (id, group) =
            dist::join(dist, || Ok(NcclId::new().map_err(|e| e.to_string())?.to_bytes().to_vec()))?;
        let id = NcclId::from_bytes(&id)
            .map_err(|e| TrainError::from(e).context("the NCCL id rank 0 sent"))?;
        let (rank, world) = (dist.rank, dist.world_size);
        let device =
            CudaDevice::with_options(dist.local_rank, open.device.clone()).map_err(|e| {
                TrainError::from(e)
                    .context(format!("rank {rank}: cannot open GPU {}", dist.local_rank))
            })?;
        let comm = NcclComm::new(&device, &id, rank, world).map_err(|e| {
            TrainError::from(e)
                .context(format!("rank {rank}: cannot join the NCCL group of {world}"))
        })?;
        tracing::info!("rank {rank} of {world} on GPU {}: NCCL group joined", dist.local_rank);
        (device, comm, group)
    };
    let blas = std::sync::Arc::new(Blas::new(&device)?);
    let options = PlanOptions {
        attention: open.attention,
        activation_checkpointing: open.activation_checkpointing,
        packed,
    };
    let model = model.cuda_model(&device, blas, layout, micro_batch, seq, options)?;
    tracing::info!(
        "GPU model: {:.2} GiB of activations and scratch",
        F::cuda_activation_memory(&model).total() as f64 / f64::from(1u32 << 30)
    );
    Ok(Opened { device, comm, model, group })
}

/// Checks that GPU `ordinal` exists before anything else is done, so that `train` or `bench step`
/// with `--device cuda` on a machine without one says so in a sentence ("no CUDA GPU found" and
/// what to check), as the other benchmarks do, instead of the loader's list of library names
/// tried — and at once, not after a large model's weights are drawn on the host.
pub fn check_cuda_gpu(ordinal: usize) -> Result<()> {
    use zeroflow_device::cuda::{info, is_absent, short_reason};
    let what_to_check = "check `nvidia-smi` and `zeroflow env` (driver, libraries, \
                         CUDA_VISIBLE_DEVICES), or run on the CPU with --device cpu";
    let gpus = match info::list_gpus() {
        Ok(gpus) => gpus,
        Err(error) if is_absent(&error) => {
            return Err(input(format!(
                "no CUDA GPU found ({}); --device cuda runs on an NVIDIA GPU: {what_to_check}",
                short_reason(&error)
            )));
        }
        Err(error) => return Err(TrainError::from(error).context("listing the CUDA GPUs")),
    };
    if gpus.is_empty() {
        return Err(input(format!("no CUDA GPU found (the driver sees none); {what_to_check}")));
    }
    if ordinal >= gpus.len() {
        return Err(input(format!(
            "GPU {ordinal} does not exist: the driver sees {} GPU(s), 0 to {} (numbered among \
             those CUDA_VISIBLE_DEVICES leaves visible)",
            gpus.len(),
            gpus.len() - 1
        )));
    }
    Ok(())
}
