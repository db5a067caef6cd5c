//! Pinned host buffers while another stream runs large GEMMs: the tokens make every host access
//! wait for its copy's event, so no read is stale and no overwrite reaches the GPU; reading
//! without waiting for the event is stale at least once (the hazard the tokens exist for).

use std::time::Instant;

use zeroflow_device::{Device, HostMemory, StreamKind};

use crate::{Load, env_usize, gpu};

/// Elements per copy (1 MiB of u32).
const LEN: usize = 1 << 18;

#[test]
fn pinned_round_trips_under_concurrent_load_are_never_stale() {
    let Some(device) = gpu() else { return };
    let iterations = env_usize("ZEROFLOW_PINNED_ITERS", 200);
    let load = Load::new(&device);
    let source = device.alloc::<u32>(LEN).unwrap();
    let uploaded = device.alloc::<u32>(LEN).unwrap();
    let mut down = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let mut up = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let mut check = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let compute = device.stream(StreamKind::Compute);
    let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
    let (mut stale_down, mut stale_up) = (0usize, 0usize);
    let started = Instant::now();
    for i in 0..iterations {
        let value = (i as u32).wrapping_mul(2).wrapping_add(1);
        // The copies of this iteration start after the first load GEMM (so they are late: a read
        // that did not wait would see the previous value) and run next to the other two.
        let gate = load.run(&device, 1);
        let _concurrent = load.run(&device, 2);

        // Device to host, then read on the host.
        device.fill(compute, &source, 0..LEN, value).unwrap();
        let mut filled = device.new_event().unwrap();
        device.record(&mut filled, compute).unwrap();
        device.wait_event(d2h, &filled).unwrap();
        device.wait_event(d2h, &gate).unwrap();
        let received = device.copy_d2h(d2h, &source, 0..LEN, &mut down, 0).unwrap();
        let received = received.wait().unwrap();
        stale_down += usize::from(received.iter().any(|&x| x != value));

        // Host to device, then overwrite on the host at once: the GPU must get the old values.
        let sent = !value;
        up.fill(sent);
        device.wait_event(h2d, &gate).unwrap();
        device.copy_h2d(h2d, &up, 0..LEN, &uploaded, 0).unwrap().wait().unwrap();
        up.fill(0xdead_beef);
        let echoed = device.copy_d2h(d2h, &uploaded, 0..LEN, &mut check, 0).unwrap();
        let echoed = echoed.wait().unwrap();
        stale_up += usize::from(echoed.iter().any(|&x| x != sent));
    }
    device.synchronize().unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let load = load.name();
    println!(
        "pinned round trips under {load} load: {iterations} iterations in {seconds:.2} s, stale \
         D2H reads {stale_down}, overwritten H2D sources {stale_up}"
    );
    println!(
        "RESULT pinned_round_trip load={load} iterations={iterations} stale_d2h={stale_down} \
         stale_h2d={stale_up}"
    );
    assert_eq!((stale_down, stale_up), (0, 0), "iterations with a stale value (d2h, h2d)");
}

#[test]
fn reading_pinned_memory_without_waiting_for_the_copy_event_is_stale() {
    let Some(device) = gpu() else { return };
    let iterations = env_usize("ZEROFLOW_HAZARD_ITERS", 200);
    let load = Load::new(&device);
    let source = device.alloc::<u32>(LEN).unwrap();
    let mut down = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let (compute, d2h) = (device.stream(StreamKind::Compute), device.stream(StreamKind::D2h));
    let mut stale = 0;
    for i in 0..iterations {
        let value = i as u32 + 1;
        let busy = load.run(&device, 2);
        device.fill(compute, &source, 0..LEN, value).unwrap();
        let mut filled = device.new_event().unwrap();
        device.record(&mut filled, compute).unwrap();
        device.wait_event(d2h, &filled).unwrap();
        device.wait_event(d2h, &busy).unwrap();
        let filling = device.copy_d2h(d2h, &source, 0..LEN, &mut down, 0).unwrap();
        // SAFETY: deliberately racy (that is the demonstration): the copy may be writing while
        // this reads; u32 has no invalid values, and the result is only compared.
        let racy = unsafe { filling.buffer_for_race_demo().read_unsynchronized() };
        stale += usize::from(racy.iter().any(|&x| x != value));
        let filled = filling.wait().unwrap();
        assert!(filled.iter().all(|&x| x == value), "iteration {i}: wrong after waiting");
    }
    device.synchronize().unwrap();
    let load = load.name();
    println!(
        "hazard under {load} load: {stale} of {iterations} reads made right after enqueuing the \
         D2H copy (without waiting for its event) were stale; after waiting, 0"
    );
    println!("RESULT hazard load={load} iterations={iterations} stale_unsynchronized={stale}");
    assert!(
        stale > 0,
        "no read of {iterations} was stale without waiting: the copy did not queue behind the \
         load, so this test no longer shows the hazard"
    );
}

#[test]
fn a_leaked_copy_token_still_makes_the_next_read_wait() {
    let Some(device) = gpu() else { return };
    let load = Load::new(&device);
    let source = device.alloc::<u32>(LEN).unwrap();
    let mut down = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let (compute, d2h) = (device.stream(StreamKind::Compute), device.stream(StreamKind::D2h));
    for value in 1..=50u32 {
        let busy = load.run(&device, 2);
        device.fill(compute, &source, 0..LEN, value).unwrap();
        let mut filled = device.new_event().unwrap();
        device.record(&mut filled, compute).unwrap();
        device.wait_event(d2h, &filled).unwrap();
        device.wait_event(d2h, &busy).unwrap();
        std::mem::forget(device.copy_d2h(d2h, &source, 0..LEN, &mut down, 0).unwrap());
        let wrong = down.iter().filter(|&&x| x != value).count();
        assert_eq!(wrong, 0, "round {value}: the read after a leaked token did not wait");
    }
    device.synchronize().unwrap();
}

/// Buffers asked for as pinned past the device's pinned budget are pageable (the driver stages
/// their copies itself): the round trips of `pinned_round_trips_under_concurrent_load_are_never_
/// stale` through them, under the same load, with the ZenFlow path's detached copy into the
/// host accumulator among them, are never stale either. Prints the two memories' copy times
/// (for the cost the fallback warning estimates; nothing is asserted about them).
#[test]
fn buffers_past_the_pinned_budget_are_pageable_and_their_copies_are_never_stale() {
    let Some(device) = gpu() else { return };
    let iterations = env_usize("ZEROFLOW_PINNED_ITERS", 200);
    device.pinned_budget().set_limit(Some(LEN * 4));
    let pinned = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let mut down = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    let mut up = device.alloc_host::<u32>(LEN, HostMemory::Pinned).unwrap();
    assert!(pinned.pinned() && !down.pinned() && !up.pinned(), "one buffer fits the budget");
    let usage = device.pinned_budget().usage();
    assert_eq!((usage.held, usage.fell_back, usage.refused), (LEN * 4, 2 * LEN * 4, 0));
    let load = Load::new(&device);
    let source = device.alloc::<u32>(LEN).unwrap();
    let uploaded = device.alloc::<u32>(LEN).unwrap();
    let compute = device.stream(StreamKind::Compute);
    let (d2h, h2d) = (device.stream(StreamKind::D2h), device.stream(StreamKind::H2d));
    let (mut stale_down, mut stale_detached, mut stale_up) = (0usize, 0usize, 0usize);
    for i in 0..iterations {
        let value = (i as u32).wrapping_mul(2).wrapping_add(1);
        let gate = load.run(&device, 1);
        let _concurrent = load.run(&device, 2);
        device.fill(compute, &source, 0..LEN, value).unwrap();
        let mut filled = device.new_event().unwrap();
        device.record(&mut filled, compute).unwrap();
        device.wait_event(d2h, &filled).unwrap();
        device.wait_event(d2h, &gate).unwrap();
        let received = device.copy_d2h(d2h, &source, 0..LEN, &mut down, 0).unwrap();
        stale_down += usize::from(received.wait().unwrap().iter().any(|&x| x != value));
        // Detached, as ZenFlow's window copy: the next read waits for it.
        device.fill(compute, &source, 0..LEN, !value).unwrap();
        device.record(&mut filled, compute).unwrap();
        device.wait_event(d2h, &filled).unwrap();
        device.copy_d2h(d2h, &source, 0..LEN, &mut down, 0).unwrap().detach();
        stale_detached += usize::from(down.iter().any(|&x| x != !value));

        let sent = value ^ 0x5555_5555;
        up.fill(sent);
        device.wait_event(h2d, &gate).unwrap();
        device.copy_h2d(h2d, &up, 0..LEN, &uploaded, 0).unwrap().wait().unwrap();
        up.fill(0xdead_beef);
        let echoed = device.copy_d2h(d2h, &uploaded, 0..LEN, &mut down, 0).unwrap();
        stale_up += usize::from(echoed.wait().unwrap().iter().any(|&x| x != sent));
    }
    device.synchronize().unwrap();
    let time = |buffer: &mut zeroflow_device::HostBuffer<u32>| {
        let started = Instant::now();
        for _ in 0..20 {
            device.copy_d2h(d2h, &source, 0..LEN, buffer, 0).unwrap().wait().unwrap();
        }
        started.elapsed().as_secs_f64() / 20.0
    };
    let mut pinned = pinned;
    let (pinned_s, pageable_s) = (time(&mut pinned), time(&mut down));
    println!(
        "pageable fallback: {iterations} round trips, stale d2h {stale_down}, detached \
         {stale_detached}, h2d {stale_up}; a 1 MiB d2h copy takes {:.1} us pinned, {:.1} us \
         pageable",
        pinned_s * 1e6,
        pageable_s * 1e6
    );
    println!(
        "RESULT pinned_fallback iterations={iterations} stale_d2h={stale_down} \
         stale_detached={stale_detached} stale_h2d={stale_up} d2h_pinned_us={:.1} \
         d2h_pageable_us={:.1}",
        pinned_s * 1e6,
        pageable_s * 1e6
    );
    assert_eq!((stale_down, stale_detached, stale_up), (0, 0, 0), "stale (d2h, detached, h2d)");
    device.pinned_budget().set_limit(None);
}
