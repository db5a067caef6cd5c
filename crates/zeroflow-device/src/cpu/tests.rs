//! Unit tests of the CPU device; the randomized and chaos tests are in `tests/`.

use super::*;

#[test]
fn a_copy_round_trip_returns_the_data() {
    let dev = CpuDevice::new().unwrap();
    let data: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
    let buf = dev.upload(&data).unwrap();
    assert_eq!(dev.download(&buf).unwrap(), data);
}

#[test]
fn reading_on_another_stream_without_an_event_is_refused_as_a_race() {
    let dev = CpuDevice::new().unwrap();
    let buf = dev.alloc::<f32>(64).unwrap();
    let mut host = dev.alloc_host::<f32>(64, HostMemory::Pinned).unwrap();
    dev.fill(dev.stream(StreamKind::Compute), &buf, 0..64, 1.0).unwrap();
    let err = dev.copy_d2h(dev.stream(StreamKind::D2h), &buf, 0..64, &mut host, 0).unwrap_err();
    assert!(
        matches!(&err, DeviceError::Race(r) if r.op == "copy_d2h" && r.other_op == "fill"),
        "{err}"
    );
}

#[test]
fn an_event_orders_a_copy_after_a_kernel_on_another_stream() {
    let dev = CpuDevice::new().unwrap();
    let buf = dev.alloc::<f32>(64).unwrap();
    let mut host = dev.alloc_host::<f32>(64, HostMemory::Pinned).unwrap();
    let mut done = dev.new_event().unwrap();
    dev.fill(dev.stream(StreamKind::Compute), &buf, 0..64, 2.5).unwrap();
    dev.record(&mut done, dev.stream(StreamKind::Compute)).unwrap();
    dev.wait_event(dev.stream(StreamKind::D2h), &done).unwrap();
    let filled = dev.copy_d2h(dev.stream(StreamKind::D2h), &buf, 0..64, &mut host, 0).unwrap();
    assert!(filled.wait().unwrap().iter().all(|&x| x == 2.5));
}

#[test]
fn waiting_on_an_event_that_was_never_recorded_is_an_error() {
    let dev = CpuDevice::new().unwrap();
    let event = dev.new_event().unwrap();
    assert_eq!(
        dev.wait_event(dev.stream(StreamKind::Comm), &event),
        Err(DeviceError::EventNotRecorded)
    );
    assert_eq!(dev.sync_event(&event), Err(DeviceError::EventNotRecorded));
}

#[test]
fn kernel_arguments_that_alias_a_written_range_are_refused() {
    let dev = CpuDevice::new().unwrap();
    let buf = dev.alloc::<f32>(16).unwrap();
    let args = KernelArgs::new().input(&buf, 0..8).output(&buf, 4..12);
    let err = dev.launch(dev.stream(StreamKind::Compute), "alias", args, |_| Ok(())).unwrap_err();
    assert_eq!(err, DeviceError::AliasedArguments { kernel: "alias", arg: 1, other: 0 });
}

#[test]
fn a_kernel_sees_its_declared_ranges_and_its_errors_surface_at_synchronize() {
    let dev = CpuDevice::new().unwrap();
    let x = dev.upload(&[1.0f32, 2.0, 3.0, 4.0]).unwrap();
    let y = dev.alloc::<f32>(2).unwrap();
    let compute = dev.stream(StreamKind::Compute);
    let args = KernelArgs::new().input(&x, 1..3).output(&y, 0..2);
    dev.launch(compute, "double", args, |ctx| {
        let (x, y) = (ctx.input::<f32>(0), ctx.output::<f32>(1));
        y.iter_mut().zip(x).for_each(|(y, x)| *y = 2.0 * x);
        Ok(())
    })
    .unwrap();
    assert_eq!(dev.download(&y).unwrap(), [4.0, 6.0]);
    dev.launch(compute, "failing", KernelArgs::new(), |_| Err("bad input".into())).unwrap();
    let err = dev.synchronize().unwrap_err();
    assert_eq!(err, DeviceError::Kernel { kernel: "failing", reason: "bad input".into() });
}

#[test]
fn a_panicking_kernel_is_an_error_and_the_stream_keeps_going() {
    let dev = CpuDevice::new().unwrap();
    let compute = dev.stream(StreamKind::Compute);
    dev.launch(compute, "panics", KernelArgs::new(), |_| panic!("boom")).unwrap();
    assert!(matches!(dev.synchronize(), Err(DeviceError::StreamStopped { .. })));
    let buf = dev.alloc::<u32>(3).unwrap();
    dev.fill(compute, &buf, 0..3, 7).unwrap();
    assert_eq!(dev.download(&buf).unwrap(), [7, 7, 7]);
}

#[test]
fn a_leaked_token_makes_the_next_read_wait_for_the_copy() {
    let dev = CpuDevice::with_chaos(Chaos {
        seed: 3,
        max_delay: std::time::Duration::from_millis(20),
        percent_delayed: 100,
    })
    .unwrap();
    let buf = dev.upload(&[9u32; 256]).unwrap();
    let mut host = dev.alloc_host::<u32>(256, HostMemory::Pinned).unwrap();
    let d2h = dev.stream(StreamKind::D2h);
    std::mem::forget(dev.copy_d2h(d2h, &buf, 0..256, &mut host, 0).unwrap());
    assert!(host.iter().all(|&x| x == 9), "the read waited for the copy");
}

#[test]
fn out_of_bounds_ranges_are_errors() {
    let dev = CpuDevice::new().unwrap();
    let buf = dev.alloc::<f32>(8).unwrap();
    let mut host = dev.alloc_host::<f32>(4, HostMemory::Pinned).unwrap();
    let d2h = dev.stream(StreamKind::D2h);
    assert!(matches!(
        dev.copy_d2h(d2h, &buf, 0..8, &mut host, 0),
        Err(DeviceError::OutOfBounds { .. })
    ));
    assert!(matches!(dev.fill(d2h, &buf, 4..9, 0.0), Err(DeviceError::OutOfBounds { .. })));
}

/// An array uploaded in pieces through the two buffers holds every piece where it belongs,
/// whatever the piece's length against the array's, with the device's operations delayed at
/// random (a buffer refilled before its last copy was done would show); an error of `fill` stops
/// the upload and is returned. `upload` (through such pieces where the data is large) gives the
/// data back, in both kinds of host memory, and `upload_rounded` the data rounded.
#[test]
fn an_upload_in_pieces_puts_every_piece_in_place() {
    let chaos =
        Chaos { seed: 7, max_delay: std::time::Duration::from_micros(300), percent_delayed: 50 };
    let device = CpuDevice::with_chaos(chaos).unwrap();
    for memory in [HostMemory::Pinned, HostMemory::Pageable] {
        for (len, piece) in [(23, 5), (23, 1), (23, 23), (23, 64), (24, 8), (1, 3)] {
            let target = device.alloc::<f32>(len).unwrap();
            let mut ranges = Vec::new();
            let filled = device.upload_in_pieces(&target, piece, memory, |range, out| {
                ranges.push(range.clone());
                out.iter_mut().zip(range).for_each(|(o, i)| *o = i as f32 * 0.5 - 3.0);
                Ok::<_, DeviceError>(())
            });
            filled.unwrap();
            let want: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            assert_eq!(device.download(&target).unwrap(), want, "{len} by {piece}");
            assert_eq!(ranges.len(), len.div_ceil(piece), "{len} by {piece}: {ranges:?}");
        }
        let target = device.alloc::<f32>(10).unwrap();
        let failed = device.upload_in_pieces(&target, 3, memory, |range, _| match range.start {
            6 => Err(DeviceError::Kernel { kernel: "fill", reason: "a read failed".into() }),
            _ => Ok(()),
        });
        let stopped =
            matches!(&failed, Err(DeviceError::Kernel { reason, .. }) if reason == "a read failed");
        assert!(stopped, "{failed:?}");
    }
    // Larger than the staging: three pieces through two page-locked buffers.
    let len = crate::DOWNLOAD_CHUNK_BYTES / 4 + 3;
    let data: Vec<u32> = (0..len as u32).collect();
    let uploaded = device.upload(&data).unwrap();
    assert!(device.download(&uploaded).unwrap() == data, "a large upload reads back");
    // Rounded to bf16 as it goes up (two pieces of 16 Mi elements), and a short one.
    let wide: Vec<f32> = data.iter().map(|&i| i as f32 * 1.0001 - 3.0).collect();
    for wide in [&wide[..], &wide[..5]] {
        let rounded = device.upload_rounded::<zeroflow_core::bf16, f32>(wide).unwrap();
        let want: Vec<_> = wide.iter().map(|&x| zeroflow_core::bf16::from_f32(x)).collect();
        assert!(device.download(&rounded).unwrap() == want, "{} rounded", wide.len());
    }
}

/// Chaos has teeth: a host read that bypasses the token (the seeds' bug, written with the unsafe
/// test-only path) sees stale data, while the token path never does.
#[test]
fn under_chaos_a_read_that_bypasses_the_token_is_observed_stale() {
    let chaos =
        Chaos { seed: 11, max_delay: std::time::Duration::from_micros(300), percent_delayed: 100 };
    let dev = CpuDevice::with_chaos(chaos).unwrap();
    let d2h = dev.stream(StreamKind::D2h);
    let (mut stale_racy, mut stale_token) = (0, 0);
    for round in 1..=200u32 {
        let grads = dev.upload(&[round; 128]).unwrap();
        let mut host = dev.alloc_host::<u32>(128, HostMemory::Pinned).unwrap();
        let filling = dev.copy_d2h(d2h, &grads, 0..128, &mut host, 0).unwrap();
        // SAFETY: deliberately racy, see `read_unsynchronized`; u32 has no invalid values.
        let racy = unsafe { filling_buffer(&filling).read_unsynchronized() };
        stale_racy += usize::from(racy.iter().any(|&x| x != round));
        let filled = filling.wait().unwrap();
        stale_token += usize::from(filled.iter().any(|&x| x != round));
    }
    assert_eq!(stale_token, 0, "the token path never reads stale data");
    assert!(stale_racy > 0, "the racy read was never stale in 200 rounds");
}

/// The buffer a `Filling` token holds, for the race demonstration only.
fn filling_buffer<'a, T: zeroflow_core::Element>(filling: &'a Filling<'_, T>) -> &'a HostBuffer<T> {
    filling.buffer_for_race_demo()
}

#[test]
fn gather_then_scatter_of_columns_moves_exactly_the_indexed_columns() {
    use crate::ops::{Kernels, Matrix};
    let dev = CpuDevice::new().unwrap();
    let stream = dev.stream(StreamKind::Compute);
    // A [3, 4] matrix at offset 2 of its buffer.
    let data: Vec<f32> = (0..14).map(|i| i as f32).collect();
    let full = dev.upload(&data).unwrap();
    let index = dev.upload(&[9u32, 3, 1]).unwrap();
    let compact = dev.alloc::<f32>(6).unwrap();
    let matrix = Matrix { buffer: &full, offset: 2, rows: 3, cols: 4 };
    let selected = Matrix { buffer: &compact, offset: 0, rows: 3, cols: 2 };
    dev.gather_columns(stream, matrix, &index, 1..3, selected).unwrap();
    assert_eq!(dev.download(&compact).unwrap(), [5.0, 3.0, 9.0, 7.0, 13.0, 11.0]);
    dev.fill(stream, &compact, 0..6, -1.0).unwrap();
    dev.scatter_columns(stream, selected, &index, 1..3, matrix).unwrap();
    let got = dev.download(&full).unwrap();
    let want = [0., 1., 2., -1., 4., -1., 6., -1., 8., -1., 10., -1., 12., -1.];
    assert_eq!(got, want);
    let wrong = Matrix { buffer: &compact, offset: 0, rows: 2, cols: 2 };
    assert!(dev.gather_columns(stream, matrix, &index, 1..3, wrong).is_err());
}

#[test]
fn column_abs_sums_add_each_columns_l1_norm_to_out() {
    use zeroflow_core::dtype::bf16;

    use crate::ops::{Kernels, Matrix};
    let dev = CpuDevice::new().unwrap();
    let stream = dev.stream(StreamKind::Compute);
    // A [3, 4] matrix at offset 2 of its buffer; the two elements either side must not count.
    #[rustfmt::skip]
    let data = [
        100.0f32, 100.0,
        1.0, -2.0, 0.5, 0.0,
        -3.0, 4.0, -0.25, 0.0,
        5.0, -6.0, 0.25, -8.0,
        100.0, 100.0,
    ];
    let full = dev.upload(&data).unwrap();
    let matrix = Matrix { buffer: &full, offset: 2, rows: 3, cols: 4 };
    // The sums land at offset 1 of `out` and are added to what it holds.
    let out = dev.upload(&[7.0f32, 10.0, 20.0, 30.0, 40.0, 7.0]).unwrap();
    dev.column_abs_sums(stream, matrix, &out, 1).unwrap();
    assert_eq!(dev.download(&out).unwrap(), [7.0, 19.0, 32.0, 31.0, 48.0, 7.0]);
    dev.column_abs_sums(stream, matrix, &out, 1).unwrap();
    assert_eq!(dev.download(&out).unwrap(), [7.0, 28.0, 44.0, 32.0, 56.0, 7.0]);

    // bf16 sources are summed in f32; a non-finite element makes only its column non-finite.
    let half: Vec<bf16> = [1.5f32, f32::NAN, -2.0, -0.5, 1.0, f32::NEG_INFINITY]
        .into_iter()
        .map(bf16::from_f32)
        .collect();
    let half = dev.upload(&half).unwrap();
    let sums = dev.upload(&[0.0f32; 3]).unwrap();
    let matrix16 = Matrix { buffer: &half, offset: 0, rows: 2, cols: 3 };
    dev.column_abs_sums(stream, matrix16, &sums, 0).unwrap();
    let got = dev.download(&sums).unwrap();
    assert_eq!(got[0], 2.0);
    assert!(got[1].is_nan(), "{got:?}");
    assert_eq!(got[2], f32::INFINITY);

    // Empty shapes change nothing.
    let empty = Matrix { buffer: &full, offset: 2, rows: 0, cols: 4 };
    dev.column_abs_sums(stream, empty, &out, 1).unwrap();
    let no_columns = Matrix { buffer: &full, offset: 2, rows: 3, cols: 0 };
    dev.column_abs_sums(stream, no_columns, &out, 6).unwrap();
    assert_eq!(dev.download(&out).unwrap(), [7.0, 28.0, 44.0, 32.0, 56.0, 7.0]);

    // Refusals, before anything is queued: `out` too short, the matrix beyond its buffer (also
    // with a shape whose element count overflows), and `out` overlapping the matrix.
    let err = dev.column_abs_sums(stream, matrix, &out, 3).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let beyond = Matrix { buffer: &full, offset: 3, rows: 4, cols: 4 };
    let err = dev.column_abs_sums(stream, beyond, &out, 0).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let huge = Matrix { buffer: &full, offset: 0, rows: usize::MAX, cols: 2 };
    let err = dev.column_abs_sums(stream, huge, &out, 0).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let err = dev.column_abs_sums(stream, matrix, &full, 0).unwrap_err();
    assert!(matches!(err, DeviceError::AliasedArguments { .. }), "{err}");
    dev.synchronize().unwrap();
    assert_eq!(dev.download(&out).unwrap(), [7.0, 28.0, 44.0, 32.0, 56.0, 7.0]);
    assert_eq!(dev.download(&full).unwrap(), data);
}

/// The device counts the bytes its host↔device copies move, when they are queued.
#[test]
fn copied_bytes_count_both_directions() {
    let dev = CpuDevice::new().unwrap();
    let before = dev.copied_bytes();
    let buffer = dev.upload(&[1.0f32; 100]).unwrap();
    let mut host = dev.alloc_host::<f32>(10, HostMemory::Pageable).unwrap();
    let stream = dev.stream(StreamKind::D2h);
    dev.copy_d2h(stream, &buffer, 5..15, &mut host, 0).unwrap().wait().unwrap();
    let after = dev.copied_bytes();
    assert_eq!(after.host_to_device - before.host_to_device, 400);
    assert_eq!(after.device_to_host - before.device_to_host, 40);
}

/// A pinned allocation past the budget is pageable memory, counted as a fallback, and copies
/// through it are as correct as through pinned memory; freeing the pinned buffer makes room again.
#[test]
fn pinned_buffers_past_the_budget_are_pageable_and_copies_through_them_still_work() {
    let dev = CpuDevice::new().unwrap();
    dev.pinned_budget().set_limit(Some(400));
    let pinned = dev.alloc_host::<f32>(100, HostMemory::Pinned).unwrap();
    assert!(pinned.pinned(), "400 bytes fit the budget of 400");
    let mut over = dev.alloc_host::<f32>(10, HostMemory::Pinned).unwrap();
    assert!(!over.pinned(), "40 more bytes pass it");
    let pageable = dev.alloc_host::<f32>(1000, HostMemory::Pageable).unwrap();
    assert!(!pageable.pinned());
    let usage = dev.pinned_budget().usage();
    assert_eq!((usage.held, usage.fell_back, usage.refused), (400, 40, 0));

    over.iter_mut().enumerate().for_each(|(i, x)| *x = i as f32 + 0.5);
    let buf = dev.alloc::<f32>(10).unwrap();
    dev.copy_h2d(dev.stream(StreamKind::H2d), &over, 0..10, &buf, 0).unwrap().wait().unwrap();
    over.fill(0.0);
    let mut copied = dev.new_event().unwrap();
    dev.record(&mut copied, dev.stream(StreamKind::H2d)).unwrap();
    dev.wait_event(dev.stream(StreamKind::D2h), &copied).unwrap();
    let back = dev.copy_d2h(dev.stream(StreamKind::D2h), &buf, 0..10, &mut over, 0).unwrap();
    let expected: Vec<f32> = (0..10).map(|i| i as f32 + 0.5).collect();
    assert_eq!(&back.wait().unwrap()[..], &expected[..]);

    drop(pinned);
    assert_eq!(dev.pinned_budget().usage().held, 0);
    assert!(dev.alloc_host::<f32>(100, HostMemory::Pinned).unwrap().pinned());
}

/// A budget of zero refuses every pinned allocation: the test hook for a machine that cannot
/// pin (the engine's and the CLI's tests use it).
#[test]
fn a_zero_budget_makes_every_pinned_buffer_pageable() {
    let dev = CpuDevice::new().unwrap();
    dev.pinned_budget().set_limit(Some(0));
    let buffers: Vec<HostBuffer<u32>> =
        (0..3).map(|_| dev.alloc_host::<u32>(256, HostMemory::Pinned).unwrap()).collect();
    assert!(buffers.iter().all(|b| !b.pinned()));
    assert_eq!(dev.pinned_budget().usage().fell_back, 3 * 1024);
}
