//! Copies, fills and events: the contract's basic operations on the GPU.

use zeroflow_core::dtype::{bf16, f16};
use zeroflow_device::{Device, DeviceError, HostMemory, StreamKind};

use crate::{Load, gpu};

#[test]
fn upload_then_download_returns_the_same_values_for_every_element_type() {
    let Some(device) = gpu() else { return };
    let floats: Vec<f32> = (0..100_003).map(|i| i as f32 * 0.25 - 7.0).collect();
    assert_eq!(device.download(&device.upload(&floats).unwrap()).unwrap(), floats);
    let halves: Vec<bf16> = floats.iter().map(|&x| bf16::from_f32(x)).collect();
    assert_eq!(device.download(&device.upload(&halves).unwrap()).unwrap(), halves);
    let words: Vec<u32> = (0..4097u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    assert_eq!(device.download(&device.upload(&words).unwrap()).unwrap(), words);
    device.synchronize().unwrap();
}

/// A download through a staging buffer the caller keeps: the first call allocates it
/// (page-locked, at most `DOWNLOAD_CHUNK_BYTES`), the later ones reuse it, and every range comes
/// back exact, pieces larger than the staging buffer included.
#[test]
fn downloads_through_a_kept_staging_buffer_return_exactly_the_ranges() {
    let Some(device) = gpu() else { return };
    let chunk = zeroflow_device::DOWNLOAD_CHUNK_BYTES / 4;
    let values: Vec<u32> =
        (0..chunk as u32 + 12_345).map(|i| i.wrapping_mul(2_654_435_761)).collect();
    let buffer = device.upload(&values).unwrap();
    let mut staging = None;
    for range in [0..10, 3..chunk + 7, chunk..values.len(), 0..values.len()] {
        let got = device.download_range_via(&buffer, range.clone(), &mut staging).unwrap();
        assert!(got == values[range.clone()], "{range:?}");
        let kept = staging.as_ref().unwrap();
        assert_eq!((kept.len(), kept.pinned()), (chunk, true), "{range:?}");
    }
}

#[test]
fn pinned_copies_move_exactly_the_ranges_asked_for() {
    let Some(device) = gpu() else { return };
    let buffer = device.alloc::<u32>(1000).unwrap();
    let mut host = device.alloc_host::<u32>(1000, HostMemory::Pinned).unwrap();
    assert!(host.pinned());
    host.iter_mut().enumerate().for_each(|(i, x)| *x = i as u32 + 1);
    let h2d = device.stream(StreamKind::H2d);
    device.copy_h2d(h2d, &host, 100..200, &buffer, 500).unwrap().wait().unwrap();
    let mut back = device.alloc_host::<u32>(300, HostMemory::Pinned).unwrap();
    let d2h = device.stream(StreamKind::D2h);
    let back = device.copy_d2h(d2h, &buffer, 450..650, &mut back, 50).unwrap().wait().unwrap();
    // back[50..250] = buffer[450..650], of which buffer[500..600] = host[100..200].
    let expected: Vec<u32> =
        (0..300).map(|i| if (100..200).contains(&i) { i as u32 + 1 } else { 0 }).collect();
    assert_eq!(&back[..], &expected[..]);
}

#[test]
fn fill_sets_every_element_type_with_the_narrowest_memset() {
    let Some(device) = gpu() else { return };
    let stream = device.stream(StreamKind::Compute);
    let floats = device.alloc::<f32>(1001).unwrap();
    device.fill(stream, &floats, 1..1000, 1.5).unwrap();
    let bf16s = device.alloc::<bf16>(1001).unwrap();
    device.fill(stream, &bf16s, 0..1001, bf16::from_f32(-3.25)).unwrap();
    let f16s = device.alloc::<f16>(77).unwrap();
    device.fill(stream, &f16s, 10..20, f16::from_f32(0.5)).unwrap();
    let ints = device.alloc::<i32>(64).unwrap();
    device.fill(stream, &ints, 0..64, -1).unwrap();
    let floats = device.download(&floats).unwrap();
    assert_eq!((floats[0], floats[1], floats[999], floats[1000]), (0.0, 1.5, 1.5, 0.0));
    assert!(device.download(&bf16s).unwrap().iter().all(|&x| x == bf16::from_f32(-3.25)));
    let f16s = device.download(&f16s).unwrap();
    assert!(f16s[10..20].iter().all(|&x| x == f16::from_f32(0.5)));
    assert!(f16s[..10].iter().chain(&f16s[20..]).all(|&x| x == f16::ZERO));
    assert!(device.download(&ints).unwrap().iter().all(|&x| x == -1));
}

#[test]
fn a_copy_after_a_fill_on_another_stream_sees_the_fill_through_the_event() {
    let Some(device) = gpu() else { return };
    let load = Load::new(&device);
    let len = 16 << 20;
    let buffer = device.alloc::<u32>(len).unwrap();
    let mut host = device.alloc_host::<u32>(len, HostMemory::Pinned).unwrap();
    let (compute, d2h) = (device.stream(StreamKind::Compute), device.stream(StreamKind::D2h));
    for value in 1..=20u32 {
        // The fill waits behind the load, so a copy that did not wait for it would see the
        // previous value.
        let busy = load.run(&device, 2);
        device.wait_event(compute, &busy).unwrap();
        device.fill(compute, &buffer, 0..len, value).unwrap();
        let mut filled = device.new_event().unwrap();
        device.record(&mut filled, compute).unwrap();
        device.wait_event(d2h, &filled).unwrap();
        let host = device.copy_d2h(d2h, &buffer, 0..len, &mut host, 0).unwrap().wait().unwrap();
        let wrong = host.iter().filter(|&&x| x != value).count();
        assert_eq!(wrong, 0, "round {value}: {wrong} elements do not hold the filled value");
    }
    device.synchronize().unwrap();
}

#[test]
fn waiting_on_an_event_that_was_never_recorded_is_an_error() {
    let Some(device) = gpu() else { return };
    let event = device.new_event().unwrap();
    let stream = device.stream(StreamKind::Comm);
    assert_eq!(device.wait_event(stream, &event), Err(DeviceError::EventNotRecorded));
    assert_eq!(device.sync_event(&event), Err(DeviceError::EventNotRecorded));
}

#[test]
fn out_of_range_and_overlapping_copies_are_refused() {
    let Some(device) = gpu() else { return };
    let stream = device.stream(StreamKind::Compute);
    let buffer = device.alloc::<f32>(10).unwrap();
    let other = device.alloc::<f32>(10).unwrap();
    let refused = device.copy_d2d(stream, &buffer, 5..11, &other, 0);
    assert!(matches!(refused, Err(DeviceError::OutOfBounds { .. })), "{refused:?}");
    let refused = device.copy_d2d(stream, &buffer, 0..6, &buffer, 4);
    assert!(matches!(refused, Err(DeviceError::AliasedArguments { .. })), "{refused:?}");
    device.copy_d2d(stream, &buffer, 0..5, &buffer, 5).unwrap();
    device.synchronize().unwrap();
}
