//! Collectives between in-process ranks on CPU devices.

use std::time::Duration;

use zeroflow_device::cpu::CpuComm;
use zeroflow_device::{Chaos, Comm, CpuDevice, Device, DeviceError, ReduceOp, StreamKind};

/// Runs `body(rank, device, comm)` on one thread per rank and returns the results in rank order.
fn on_ranks<R: Send>(
    world: usize,
    chaos: bool,
    body: impl Fn(usize, &CpuDevice, &CpuComm) -> R + Sync,
) -> Vec<R> {
    let devices: Vec<CpuDevice> = (0..world)
        .map(|r| {
            if chaos { CpuDevice::with_chaos(Chaos::new(r as u64 * 7)) } else { CpuDevice::new() }
                .unwrap()
        })
        .collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(10));
    std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .zip(&comms)
            .enumerate()
            .map(|(rank, (dev, comm))| {
                let body = &body;
                s.spawn(move || body(rank, dev, comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn rank_data(rank: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (rank * 1000 + i) as f32 * 0.25).collect()
}

#[test]
fn all_reduce_sums_and_averages_over_ranks() {
    for world in 1..=4 {
        let out = on_ranks(world, true, |rank, dev, comm| {
            let buf = dev.upload(&rank_data(rank, 37)).unwrap();
            comm.all_reduce(dev.stream(StreamKind::Comm), &buf, 0..37, ReduceOp::Sum).unwrap();
            let avg = dev.upload(&rank_data(rank, 37)).unwrap();
            comm.all_reduce(dev.stream(StreamKind::Comm), &avg, 3..30, ReduceOp::Avg).unwrap();
            (dev.download(&buf).unwrap(), dev.download(&avg).unwrap())
        });
        let sum: Vec<f32> =
            (0..37).map(|i| (0..world).map(|r| rank_data(r, 37)[i]).sum()).collect();
        for (rank, (s, a)) in out.iter().enumerate() {
            assert_eq!(s, &sum, "world {world} rank {rank}");
            assert_eq!(a[..3], rank_data(rank, 37)[..3], "outside the range nothing changes");
            for i in 3..30 {
                assert!((a[i] - sum[i] / world as f32).abs() <= 1e-6 * sum[i].abs());
            }
        }
    }
}

#[test]
fn reduce_scatter_gives_each_rank_the_sum_of_its_chunk() {
    let world = 3;
    let out = on_ranks(world, true, |rank, dev, comm| {
        let src = dev.upload(&rank_data(rank, 3 * 5)).unwrap();
        let dst = dev.alloc::<f32>(5).unwrap();
        comm.reduce_scatter(dev.stream(StreamKind::Comm), &src, 0..15, &dst, 0, ReduceOp::Sum)
            .unwrap();
        dev.download(&dst).unwrap()
    });
    for (rank, chunk) in out.iter().enumerate() {
        let expect: Vec<f32> =
            (0..5).map(|i| (0..world).map(|r| rank_data(r, 15)[rank * 5 + i]).sum()).collect();
        assert_eq!(chunk, &expect);
    }
}

#[test]
fn in_place_all_gather_assembles_every_partition_on_every_rank() {
    // As the engine gathers: `all_gather(params, own_partition, params, 0..padded_len)`, then the
    // same inside a larger buffer whose ends must keep their values. World 1 included: its input
    // is the whole output.
    for world in 1..=4 {
        for pad in [0, 3] {
            let n = 6;
            let out = on_ranks(world, true, |rank, dev, comm| {
                let mine = pad + rank * n..pad + (rank + 1) * n;
                let mut full = vec![-1.0f32; world * n + 2 * pad];
                full[mine.clone()].copy_from_slice(&rank_data(rank, n));
                let buf = dev.upload(&full).unwrap();
                let everything = pad..pad + world * n;
                comm.all_gather(dev.stream(StreamKind::Comm), &buf, mine, &buf, everything)
                    .unwrap();
                dev.download(&buf).unwrap()
            });
            let padding = vec![-1.0f32; pad];
            let gathered = (0..world).flat_map(|r| rank_data(r, n));
            let expect: Vec<f32> =
                padding.iter().copied().chain(gathered).chain(padding.iter().copied()).collect();
            for (rank, got) in out.iter().enumerate() {
                assert_eq!(got, &expect, "world {world} pad {pad} rank {rank}");
            }
        }
    }
}

#[test]
fn overlaps_that_are_not_the_in_place_form_are_refused_as_nccl_refuses_them() {
    let out = on_ranks(2, false, |rank, dev, comm| {
        let stream = dev.stream(StreamKind::Comm);
        let buf = dev.upload(&rank_data(rank, 40)).unwrap();
        // all_gather: the input must be this rank's chunk (rank × 5) of the output.
        let gather = comm.all_gather(stream, &buf, 1..6, &buf, 0..10);
        // reduce_scatter: the output must be this rank's chunk of the input.
        let scatter = comm.reduce_scatter(stream, &buf, 0..10, &buf, 1, ReduceOp::Sum);
        // The in-place forms themselves, and inputs and outputs that only share the buffer, are
        // accepted; a non-root's `reduce` output is empty, so it overlaps nothing wherever it is.
        let n = 5;
        comm.all_gather(stream, &buf, rank * n..(rank + 1) * n, &buf, 0..2 * n).unwrap();
        comm.reduce_scatter(stream, &buf, 10..20, &buf, 10 + rank * n, ReduceOp::Sum).unwrap();
        let reduce_at = if rank == 0 { 20 } else { 23 };
        comm.reduce(stream, &buf, 20..30, &buf, reduce_at, 0, ReduceOp::Sum).unwrap();
        comm.all_gather(stream, &buf, 30 + rank..31 + rank, &buf, 38..40).unwrap();
        dev.synchronize().unwrap();
        [gather, scatter]
    });
    for (rank, refusals) in out.into_iter().enumerate() {
        for (op, refused) in ["all_gather", "reduce_scatter"].into_iter().zip(refusals) {
            assert!(
                matches!(&refused, Err(DeviceError::Collective { op: o, reason, .. })
                    if *o == op && reason.contains("in place")),
                "rank {rank}: {refused:?}"
            );
        }
    }
    // reduce: on the root, the output must start where the input does.
    let refused = on_ranks(1, false, |_, dev, comm| {
        let buf = dev.upload(&rank_data(0, 20)).unwrap();
        comm.reduce(dev.stream(StreamKind::Comm), &buf, 0..10, &buf, 3, 0, ReduceOp::Sum)
    });
    assert!(
        matches!(&refused[0], Err(DeviceError::Collective { op: "reduce", reason, .. })
            if reason.contains("in place")),
        "{refused:?}"
    );
}

#[test]
fn reduce_writes_the_sum_on_the_root_only() {
    let out = on_ranks(3, true, |rank, dev, comm| {
        let src = dev.upload(&rank_data(rank, 10)).unwrap();
        let dst = dev.upload(&[-1.0f32; 12]).unwrap();
        comm.reduce(dev.stream(StreamKind::Comm), &src, 2..9, &dst, 1, 1, ReduceOp::Sum).unwrap();
        dev.download(&dst).unwrap()
    });
    let sum: Vec<f32> = (2..9).map(|i| (0..3).map(|r| rank_data(r, 10)[i]).sum()).collect();
    assert_eq!(out[1][1..8], sum[..]);
    assert_eq!(out[1][0], -1.0);
    assert!(out[0].iter().chain(&out[2]).all(|&x| x == -1.0), "non-roots are untouched");
}

#[test]
fn broadcast_copies_the_root_everywhere() {
    let out = on_ranks(3, false, |rank, dev, comm| {
        let buf = dev.upload(&rank_data(rank, 9)).unwrap();
        comm.broadcast(dev.stream(StreamKind::Comm), &buf, 0..9, 2).unwrap();
        dev.download(&buf).unwrap()
    });
    assert!(out.iter().all(|o| o == &rank_data(2, 9)));
}

#[test]
fn ranks_calling_different_collectives_get_an_error_naming_them() {
    let out = on_ranks(2, false, |rank, dev, comm| {
        let buf = dev.upload(&rank_data(rank, 8)).unwrap();
        let stream = dev.stream(StreamKind::Comm);
        if rank == 0 {
            comm.all_reduce(stream, &buf, 0..8, ReduceOp::Sum).unwrap();
        } else {
            comm.broadcast(stream, &buf, 0..8, 0).unwrap();
        }
        dev.synchronize()
    });
    for result in out {
        assert!(
            matches!(&result, Err(DeviceError::Collective { reason, .. }) if reason.contains("different")),
            "{result:?}"
        );
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_instead_of_hanging() {
    let devices = vec![CpuDevice::new().unwrap(), CpuDevice::new().unwrap()];
    let comms = CpuComm::group(&devices, Duration::from_millis(200));
    let buf = devices[0].upload(&[1.0f32; 4]).unwrap();
    comms[0].all_reduce(devices[0].stream(StreamKind::Comm), &buf, 0..4, ReduceOp::Sum).unwrap();
    let err = devices[0].synchronize().unwrap_err();
    assert!(
        matches!(&err, DeviceError::Collective { op: "all_reduce", rank: 0, reason } if reason.contains("did not arrive")),
        "{err}"
    );
}

/// A rank that arrives after another gave up waiting does not complete the barrier with it: the
/// one that gave up has left the collective, and its input (published at its arrival) may be
/// freed by then (here it is: its buffer and device are dropped). The late rank fails at once with
/// the first failure's reason; before, it completed the first barrier and read the stale input.
#[test]
fn a_rank_arriving_after_another_timed_out_fails_without_reading_its_input() {
    let devices = vec![CpuDevice::new().unwrap(), CpuDevice::new().unwrap()];
    let mut comms = CpuComm::group(&devices, Duration::from_millis(200));
    let [first, late] = <[CpuDevice; 2]>::try_from(devices).unwrap();
    let late_comm = comms.pop().unwrap();
    let first_comm = comms.pop().unwrap();
    let buf = first.upload(&[1.0f32; 4]).unwrap();
    first_comm.all_reduce(first.stream(StreamKind::Comm), &buf, 0..4, ReduceOp::Sum).unwrap();
    let err = first.synchronize().unwrap_err();
    assert!(err.to_string().contains("did not arrive"), "{err}");
    drop((buf, first_comm, first));
    let buf = late.upload(&[2.0f32; 4]).unwrap();
    let started = std::time::Instant::now();
    late_comm.all_reduce(late.stream(StreamKind::Comm), &buf, 0..4, ReduceOp::Sum).unwrap();
    let err = late.synchronize().unwrap_err();
    assert!(
        matches!(&err, DeviceError::Collective { op: "all_reduce", rank: 1, reason }
            if reason.contains("broke in an earlier collective") && reason.contains("did not arrive")),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_millis(150), "it waited: {:?}", started.elapsed());
    // Its own buffer is untouched.
    assert_eq!(late.download(&buf).unwrap(), vec![2.0f32; 4]);
}

/// Three ranks; rank 2 fails (its thread ends, dropping its communicator) before its second
/// all-reduce. Ranks 0 and 1 wait in that collective; they fail at once, naming rank 2, instead of
/// waiting out the group's timeout (an hour here, so a pass cannot come from the timeout, whose
/// error says "did not arrive").
#[test]
fn a_rank_that_leaves_the_group_fails_the_others_collectives_at_once() {
    let devices: Vec<CpuDevice> = (0..3).map(|_| CpuDevice::new().unwrap()).collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(3600));
    let results: Vec<Result<(), DeviceError>> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (dev, comm))| {
                s.spawn(move || {
                    let stream = dev.stream(StreamKind::Comm);
                    let buf = dev.upload(&[1.0f32; 4])?;
                    comm.all_reduce(stream, &buf, 0..4, ReduceOp::Sum)?;
                    dev.synchronize()?;
                    if rank == 2 {
                        drop(comm);
                        return Ok(());
                    }
                    comm.all_reduce(stream, &buf, 0..4, ReduceOp::Sum)?;
                    dev.synchronize()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(results[2].is_ok());
    for (rank, result) in results.iter().enumerate().take(2) {
        assert!(
            matches!(result, Err(DeviceError::Collective { op: "all_reduce", rank: r, reason })
                if *r == rank && reason.contains("rank 2 left the group")),
            "rank {rank}: {result:?}"
        );
    }
}

/// A rank may drop its communicator while a collective it queued is still waiting for the others
/// (the normal end of a thread that does not synchronize): that collective still completes, on
/// every rank, with the right result.
#[test]
fn a_dropped_communicator_still_runs_the_collectives_it_queued() {
    let devices: Vec<CpuDevice> = (0..2).map(|_| CpuDevice::new().unwrap()).collect();
    let comms = CpuComm::group(&devices, Duration::from_secs(3600));
    let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .iter()
            .zip(comms)
            .enumerate()
            .map(|(rank, (dev, comm))| {
                s.spawn(move || {
                    let buf = dev.upload(&[rank as f32 + 1.0; 4]).unwrap();
                    if rank == 1 {
                        // Rank 1 arrives late: rank 0's collective waits for it when rank 0's
                        // communicator is dropped.
                        std::thread::sleep(Duration::from_millis(50));
                    }
                    let stream = dev.stream(StreamKind::Comm);
                    comm.all_reduce(stream, &buf, 0..4, ReduceOp::Sum).unwrap();
                    if rank == 0 {
                        drop(comm);
                    }
                    dev.synchronize().unwrap();
                    dev.download(&buf).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, [vec![3.0f32; 4], vec![3.0f32; 4]]);
}
