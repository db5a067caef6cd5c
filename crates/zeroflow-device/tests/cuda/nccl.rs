//! NCCL collectives against the CPU expectation, for every element type: a world of one rank on
//! GPU 0, and a world of every visible GPU (skipped, saying so, where there is only one).
//!
//! Inputs are random halves in -8..=8 (0..=16 for `u32`), so that sums over up to eight ranks are
//! exact in every type, whatever order NCCL adds in; averages (NCCL multiplies each input by
//! 1/world before summing) are compared with a tolerance of the type. Outputs start poisoned, and
//! every element outside the range a collective may write must still hold the poison afterwards.

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::dtype::{bf16, f16};
use zeroflow_core::{DType, Element};
use zeroflow_device::cuda::info::is_library_missing;
use zeroflow_device::cuda::nccl::{self, NcclComm, NcclId};
use zeroflow_device::cuda::{info, short_reason};
use zeroflow_device::{Comm, CudaDevice, Device, DeviceError, ReduceOp, StreamKind};

use crate::gpu;

/// A value no collective of the test produces.
const POISON: f64 = 4096.0;
/// Elements around every written range that must keep the poison.
const PAD: usize = 3;

/// The communicator(s), or `None` (after printing why) where libnccl is missing and no GPU is
/// required.
fn or_skip<T>(made: Result<T, DeviceError>) -> Option<T> {
    match made {
        Ok(made) => Some(made),
        Err(error @ DeviceError::Library { .. })
            if std::env::var_os("ZEROFLOW_REQUIRE_GPU").is_none() && is_library_missing(&error) =>
        {
            println!("skipped: NCCL unavailable ({})", short_reason(&error));
            None
        }
        Err(error) => panic!("creating the NCCL communicator(s) failed: {error}"),
    }
}

fn comm_stream(comm: &NcclComm) -> &zeroflow_device::cuda::CudaStream {
    comm.device().stream(StreamKind::Comm)
}

/// Runs `call` for every rank inside one NCCL group (one thread drives every GPU).
fn on_every_rank(comms: &[NcclComm], call: impl Fn(usize, &NcclComm) -> Result<(), DeviceError>) {
    nccl::group(|| comms.iter().enumerate().try_for_each(|(rank, comm)| call(rank, comm)))
        .unwrap_or_else(|e| panic!("collective failed: {e}"));
}

/// Random inputs, one vector per rank, of halves in -8..=8 (0..=16 for unsigned types).
fn inputs<T: Element>(rng: &mut ChaCha8Rng, world: usize, len: usize) -> Vec<Vec<T>> {
    let unsigned = T::DTYPE == DType::U32;
    (0..world)
        .map(|_| {
            (0..len)
                .map(|_| {
                    let half = f64::from(rng.random_range(-16i32..=16)) / 2.0;
                    let value = if unsigned { half.abs().round() * 2.0 } else { half };
                    let value = if is_float(T::DTYPE) { value } else { value.trunc() };
                    T::from_f64(value)
                })
                .collect()
        })
        .collect()
}

/// The reduction of element `index` over the ranks' inputs, rounded to `T`.
fn reduced<T: Element>(inputs: &[Vec<T>], index: usize, op: ReduceOp) -> f64 {
    let values = inputs.iter().map(|input| input[index].to_f64());
    let value = match op {
        ReduceOp::Sum => values.sum(),
        ReduceOp::Avg => values.sum::<f64>() / inputs.len() as f64,
        ReduceOp::Max => values.fold(f64::NEG_INFINITY, f64::max),
    };
    T::from_f64(value).to_f64()
}

fn is_float(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::Bf16 | DType::F16)
}

/// How far a result may be from the expectation: exact, except averages of floats, which may be
/// off by a few roundings at the inputs' magnitude (8).
fn tolerance(dtype: DType, op: ReduceOp) -> f64 {
    let epsilon = match dtype {
        DType::Bf16 => 2.0f64.powi(-8),
        DType::F16 => 2.0f64.powi(-11),
        _ => 2.0f64.powi(-24),
    };
    if op == ReduceOp::Avg && is_float(dtype) { 32.0 * epsilon } else { 0.0 }
}

/// Collects mismatches of one collective on one rank as readable lines.
#[derive(Default)]
struct Mismatches {
    lines: Vec<String>,
    count: usize,
}

impl Mismatches {
    fn compare<T: Element>(
        &mut self,
        what: &str,
        rank: usize,
        got: &[T],
        expected: &[f64],
        tolerance: impl Fn(f64) -> f64,
    ) {
        assert_eq!(got.len(), expected.len(), "{what}: lengths");
        for (i, (&got, &expected)) in got.iter().zip(expected).enumerate() {
            if (got.to_f64() - expected).abs() > tolerance(expected) {
                self.count += 1;
                if self.lines.len() < 8 {
                    self.lines.push(format!(
                        "{what}<{}> rank {rank} element {i}: got {}, expected {expected}",
                        T::DTYPE,
                        got.to_f64()
                    ));
                }
            }
        }
    }
}

/// Every collective of the contract in every shape ZeRO uses, for element type `T`.
fn check_collectives<T: Element>(comms: &[NcclComm], rng: &mut ChaCha8Rng, found: &mut Mismatches) {
    let world = comms.len();
    let poison = T::from_f64(POISON).to_f64();
    let ops: &[ReduceOp] = if is_float(T::DTYPE) {
        &[ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
    } else {
        &[ReduceOp::Sum, ReduceOp::Max]
    };
    let n = 1000 + rng.random_range(0..100usize);
    let exact = |_: f64| 0.0;
    for &op in ops {
        let tol = |_: f64| tolerance(T::DTYPE, op);

        // all_reduce of the middle of a buffer: the ends keep their own values.
        let data = inputs::<T>(rng, world, n + 2 * PAD);
        let bufs: Vec<_> =
            comms.iter().zip(&data).map(|(c, d)| c.device().upload(d).unwrap()).collect();
        on_every_rank(comms, |r, c| c.all_reduce(comm_stream(c), &bufs[r], PAD..PAD + n, op));
        for (r, c) in comms.iter().enumerate() {
            let got = c.device().download(&bufs[r]).unwrap();
            let expected: Vec<f64> = (0..n + 2 * PAD)
                .map(|i| {
                    if (PAD..PAD + n).contains(&i) {
                        reduced(&data, i, op)
                    } else {
                        data[r][i].to_f64()
                    }
                })
                .collect();
            found.compare(&format!("all_reduce {op:?}"), r, &got, &expected, tol);
        }

        // reduce_scatter into a separate, poisoned buffer.
        let data = inputs::<T>(rng, world, world * n + 2 * PAD);
        let src: Vec<_> =
            comms.iter().zip(&data).map(|(c, d)| c.device().upload(d).unwrap()).collect();
        let dst: Vec<_> = comms.iter().map(|c| poisoned::<T>(c, n + 2 * PAD)).collect();
        on_every_rank(comms, |r, c| {
            c.reduce_scatter(comm_stream(c), &src[r], PAD..PAD + world * n, &dst[r], PAD, op)
        });
        for (r, c) in comms.iter().enumerate() {
            let got = c.device().download(&dst[r]).unwrap();
            let expected: Vec<f64> = (0..n + 2 * PAD)
                .map(|i| match i.checked_sub(PAD).filter(|&j| j < n) {
                    Some(j) => reduced(&data, PAD + r * n + j, op),
                    None => poison,
                })
                .collect();
            found.compare(&format!("reduce_scatter {op:?}"), r, &got, &expected, tol);
        }

        // reduce_scatter in place: the output is this rank's chunk of the input.
        let data = inputs::<T>(rng, world, world * n);
        let bufs: Vec<_> =
            comms.iter().zip(&data).map(|(c, d)| c.device().upload(d).unwrap()).collect();
        on_every_rank(comms, |r, c| {
            c.reduce_scatter(comm_stream(c), &bufs[r], 0..world * n, &bufs[r], r * n, op)
        });
        for (r, c) in comms.iter().enumerate() {
            let got = c.device().download(&bufs[r]).unwrap();
            let expected: Vec<f64> = (r * n..(r + 1) * n).map(|i| reduced(&data, i, op)).collect();
            found.compare(
                &format!("reduce_scatter in place {op:?}"),
                r,
                &got[r * n..(r + 1) * n],
                &expected,
                tol,
            );
        }

        // reduce to the last rank; the others' outputs keep the poison.
        let root = world - 1;
        let data = inputs::<T>(rng, world, n);
        let src: Vec<_> =
            comms.iter().zip(&data).map(|(c, d)| c.device().upload(d).unwrap()).collect();
        let dst: Vec<_> = comms.iter().map(|c| poisoned::<T>(c, n + 2 * PAD)).collect();
        on_every_rank(comms, |r, c| {
            c.reduce(comm_stream(c), &src[r], 0..n, &dst[r], PAD, root, op)
        });
        for (r, c) in comms.iter().enumerate() {
            let got = c.device().download(&dst[r]).unwrap();
            let expected: Vec<f64> = (0..n + 2 * PAD)
                .map(|i| match i.checked_sub(PAD).filter(|&j| j < n && r == root) {
                    Some(j) => reduced(&data, j, op),
                    None => poison,
                })
                .collect();
            found.compare(&format!("reduce {op:?}"), r, &got, &expected, tol);
        }
    }

    // all_gather into a separate, poisoned buffer.
    let data = inputs::<T>(rng, world, n);
    let src: Vec<_> = comms.iter().zip(&data).map(|(c, d)| c.device().upload(d).unwrap()).collect();
    let dst: Vec<_> = comms.iter().map(|c| poisoned::<T>(c, world * n + 2 * PAD)).collect();
    on_every_rank(comms, |r, c| {
        c.all_gather(comm_stream(c), &src[r], 0..n, &dst[r], PAD..PAD + world * n)
    });
    let expected = gathered(&data, PAD, poison);
    for (r, c) in comms.iter().enumerate() {
        let got = c.device().download(&dst[r]).unwrap();
        found.compare("all_gather", r, &got, &expected, exact);
    }

    // all_gather in place, as ZeRO's engine gathers its partitions (`all_gather(params,
    // own_partition, params, 0..padded_len)`), and the same inside a larger buffer.
    for pad in [0, PAD] {
        check_all_gather_in_place::<T>(comms, rng, found, n, pad);
    }

    // broadcast from rank 0 of the middle of a buffer: the ends keep their own values.
    let data = inputs::<T>(rng, world, n + 2 * PAD);
    let bufs: Vec<_> =
        comms.iter().zip(&data).map(|(c, d)| c.device().upload(d).unwrap()).collect();
    on_every_rank(comms, |r, c| c.broadcast(comm_stream(c), &bufs[r], PAD..PAD + n, 0));
    for (r, c) in comms.iter().enumerate() {
        let got = c.device().download(&bufs[r]).unwrap();
        let expected: Vec<f64> = (0..n + 2 * PAD)
            .map(|i| {
                if (PAD..PAD + n).contains(&i) { data[0][i].to_f64() } else { data[r][i].to_f64() }
            })
            .collect();
        found.compare("broadcast", r, &got, &expected, exact);
    }
}

/// What every rank's all-gather output holds: the ranks' inputs `data` one after the other, with
/// `pad` poisoned elements on each side.
fn gathered<T: Element>(data: &[Vec<T>], pad: usize, poison: f64) -> Vec<f64> {
    let padding = std::iter::repeat_n(poison, pad);
    let chunks = data.iter().flatten().map(|x| x.to_f64());
    padding.clone().chain(chunks).chain(padding).collect()
}

/// The in-place all-gather: each rank's input is its own chunk of the output
/// (`dst[pad..pad + world·n]`, NCCL's `sendbuff == recvbuff + rank·n`), every other element
/// starts poisoned. The expectation is built from this call's inputs: it once came from the
/// out-of-place case's (a closure still borrowing the shadowed `data`), which failed on the H200
/// as "got -1.5, expected -5" with NCCL doing the right thing.
fn check_all_gather_in_place<T: Element>(
    comms: &[NcclComm],
    rng: &mut ChaCha8Rng,
    found: &mut Mismatches,
    n: usize,
    pad: usize,
) {
    let world = comms.len();
    let data = inputs::<T>(rng, world, n);
    let chunk = |r: usize| pad + r * n..pad + (r + 1) * n;
    let bufs: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let mut host = vec![T::from_f64(POISON); world * n + 2 * pad];
            host[chunk(r)].copy_from_slice(&data[r]);
            c.device().upload(&host).unwrap()
        })
        .collect();
    on_every_rank(comms, |r, c| {
        c.all_gather(comm_stream(c), &bufs[r], chunk(r), &bufs[r], pad..pad + world * n)
    });
    let expected = gathered(&data, pad, T::from_f64(POISON).to_f64());
    for (r, c) in comms.iter().enumerate() {
        let got = c.device().download(&bufs[r]).unwrap();
        found.compare(&format!("all_gather in place (pad {pad})"), r, &got, &expected, |_| 0.0);
    }
}

/// A device buffer of `len` poisoned elements on the rank's GPU.
fn poisoned<T: Element>(comm: &NcclComm, len: usize) -> zeroflow_device::cuda::CudaBuffer<T> {
    comm.device().upload(&vec![T::from_f64(POISON); len]).unwrap()
}

/// Every collective for every element type; returns the number of collectives checked.
fn check_every_type(comms: &[NcclComm], seed: u64) -> (usize, Mismatches) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut found = Mismatches::default();
    check_collectives::<f32>(comms, &mut rng, &mut found);
    check_collectives::<bf16>(comms, &mut rng, &mut found);
    check_collectives::<f16>(comms, &mut rng, &mut found);
    check_collectives::<i32>(comms, &mut rng, &mut found);
    check_collectives::<u32>(comms, &mut rng, &mut found);
    // Floats: 3 ops × 4 reductions + 4 others; integers: 2 ops × 4 + 4.
    (3 * 16 + 2 * 12, found)
}

#[test]
fn every_collective_on_one_gpu_matches_the_cpu_expectation() {
    let Some(device) = gpu() else { return };
    let Some(comm) = or_skip(NcclId::new().and_then(|id| NcclComm::new(&device, &id, 0, 1))) else {
        return;
    };
    assert_eq!((comm.rank(), comm.world_size()), (0, 1));
    let comms = [comm];
    let (checked, found) = check_every_type(&comms, 1);
    comms[0].async_error().unwrap();
    device.synchronize().unwrap();
    println!("RESULT nccl_world1 collectives={checked} dtypes=5 mismatches={}", found.count);
    assert!(found.lines.is_empty(), "mismatches:\n{}", found.lines.join("\n"));
}

#[test]
fn collectives_refuse_bad_ranges_roots_and_misplaced_in_place_buffers() {
    let Some(device) = gpu() else { return };
    let Some(comm) = or_skip(NcclComm::group(std::slice::from_ref(&device))) else { return };
    let comm = &comm[0];
    let stream = comm_stream(comm);
    let buf = device.alloc::<f32>(100).unwrap();
    let other = device.alloc::<f32>(100).unwrap();
    let refused = comm.all_reduce(stream, &buf, 50..101, ReduceOp::Sum);
    assert!(matches!(refused, Err(DeviceError::OutOfBounds { .. })), "{refused:?}");
    let refused = comm.reduce_scatter(stream, &buf, 0..10, &other, 95, ReduceOp::Sum);
    assert!(matches!(refused, Err(DeviceError::OutOfBounds { .. })), "{refused:?}");
    let refused = comm.all_gather(stream, &buf, 0..10, &other, 0..20);
    assert!(matches!(refused, Err(DeviceError::LengthMismatch { .. })), "{refused:?}");
    // In place, rank 0's input must be chunk 0 of the output; here it overlaps it elsewhere.
    let refused = comm.all_gather(stream, &buf, 5..15, &buf, 0..10);
    assert!(matches!(refused, Err(DeviceError::Collective { .. })), "{refused:?}");
    let refused = comm.reduce_scatter(stream, &buf, 0..10, &buf, 5, ReduceOp::Sum);
    assert!(matches!(refused, Err(DeviceError::Collective { .. })), "{refused:?}");
    let refused = comm.reduce(stream, &buf, 0..10, &buf, 3, 0, ReduceOp::Sum);
    assert!(matches!(refused, Err(DeviceError::Collective { .. })), "{refused:?}");
    let refused = comm.broadcast(stream, &buf, 0..10, 1);
    assert!(matches!(refused, Err(DeviceError::Collective { .. })), "{refused:?}");
    // Nothing was enqueued by the refused calls; the communicator still works.
    comm.all_reduce(stream, &buf, 0..100, ReduceOp::Sum).unwrap();
    device.synchronize().unwrap();
    comm.async_error().unwrap();
}

/// Every visible GPU, or `None` (after printing why) where there are fewer than two.
fn all_gpus() -> Option<Vec<CudaDevice>> {
    gpu()?;
    let count = info::list_gpus().unwrap().len();
    if count < 2 {
        println!("skipped: a multi-GPU NCCL world needs at least 2 GPUs, this machine has {count}");
        return None;
    }
    Some((0..count).map(|ordinal| CudaDevice::new(ordinal).unwrap()).collect())
}

#[test]
fn every_collective_across_every_gpu_matches_the_cpu_expectation() {
    let Some(devices) = all_gpus() else { return };
    let world = devices.len();
    let Some(comms) = or_skip(NcclComm::group(&devices)) else { return };
    let (checked, found) = check_every_type(&comms, 2);
    for comm in &comms {
        comm.async_error().unwrap();
    }
    println!("RESULT nccl_world{world} collectives={checked} dtypes=5 mismatches={}", found.count);
    assert!(found.lines.is_empty(), "mismatches:\n{}", found.lines.join("\n"));

    // A buffer or stream of another GPU is refused before anything reaches NCCL.
    let (mine, foreign) =
        (devices[0].alloc::<f32>(16).unwrap(), devices[1].alloc::<f32>(16).unwrap());
    let refused = comms[0].all_reduce(comm_stream(&comms[0]), &foreign, 0..16, ReduceOp::Sum);
    assert!(matches!(refused, Err(DeviceError::Collective { .. })), "{refused:?}");
    let refused = comms[0].broadcast(comm_stream(&comms[1]), &mine, 0..16, 0);
    assert!(matches!(refused, Err(DeviceError::Collective { .. })), "{refused:?}");

    // A figure, not a check: all-reduce of 256 MiB of f32 (bus bandwidth as nccl-tests counts it).
    let len = 64 << 20;
    let bufs: Vec<_> = devices.iter().map(|d| d.alloc::<f32>(len).unwrap()).collect();
    let run = || {
        on_every_rank(&comms, |r, c| c.all_reduce(comm_stream(c), &bufs[r], 0..len, ReduceOp::Sum))
    };
    run();
    devices.iter().for_each(|d| d.synchronize().unwrap());
    let repeats = 5;
    let started = Instant::now();
    (0..repeats).for_each(|_| run());
    devices.iter().for_each(|d| d.synchronize().unwrap());
    let seconds = started.elapsed().as_secs_f64() / f64::from(repeats);
    let algbw = (len * 4) as f64 / seconds / 1e9;
    let busbw = algbw * 2.0 * (world - 1) as f64 / world as f64;
    println!(
        "nccl all_reduce 256 MiB f32 over {world} GPUs: {:.2} ms, algbw {algbw:.1} GB/s, busbw \
         {busbw:.1} GB/s",
        seconds * 1e3
    );
    println!(
        "RESULT nccl_allreduce_256mib world={world} algbw_gbps={algbw:.1} busbw_gbps={busbw:.1}"
    );
}

#[test]
fn ranks_on_their_own_threads_join_through_one_id_and_all_reduce() {
    let Some(devices) = all_gpus() else { return };
    let world = devices.len();
    let Some(id) = or_skip(NcclId::new()) else { return };
    // The id travels as bytes, as it will between processes.
    let bytes = id.to_bytes();
    let len = 1 << 20;
    let sums: Vec<Vec<f32>> = std::thread::scope(|scope| {
        let ranks: Vec<_> = devices
            .iter()
            .enumerate()
            .map(|(rank, device)| {
                scope.spawn(move || {
                    let id = NcclId::from_bytes(&bytes).unwrap();
                    let comm = NcclComm::new(device, &id, rank, world).unwrap();
                    let buf = device.upload(&vec![rank as f32 + 1.0; len]).unwrap();
                    let half = device.alloc::<f32>(len / world).unwrap();
                    let stream = device.stream(StreamKind::Comm);
                    comm.all_reduce(stream, &buf, 0..len, ReduceOp::Sum).unwrap();
                    comm.reduce_scatter(
                        stream,
                        &buf,
                        0..len / world * world,
                        &half,
                        0,
                        ReduceOp::Avg,
                    )
                    .unwrap();
                    let mut out = device.download(&buf).unwrap();
                    out.extend(device.download(&half).unwrap());
                    comm.async_error().unwrap();
                    out
                })
            })
            .collect();
        ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
    });
    let total = (world * (world + 1) / 2) as f32;
    for (rank, out) in sums.iter().enumerate() {
        let (reduced, scattered) = out.split_at(len);
        assert!(reduced.iter().all(|&x| x == total), "rank {rank}: all_reduce is not {total}");
        // The average over ranks of the all-reduced sums is the sum itself.
        assert!(
            scattered.iter().all(|&x| (x - total).abs() <= total * 1e-6),
            "rank {rank}: reduce_scatter"
        );
    }
    println!("RESULT nccl_threads world={world} all_reduce=ok reduce_scatter=ok");
}
