//! The grads-ready notices of backward, and gradient accumulation.

use zeroflow_device::{CpuDevice, Device, StreamKind};
use zeroflow_gpt::{CpuGpt, GradGroup};

use crate::support::{ODD, perturbed_params, random_batch};

/// Backward on the device tells of each group once, in backward order (final norm, blocks last to
/// first, embeddings), and a copy of the group's range queued on the compute stream at that moment
/// already equals the final gradient: every kernel that adds to the range was queued before.
#[test]
fn grads_ready_fires_once_per_group_in_backward_order_with_complete_ranges() {
    let (batch, seq) = (2, 5);
    let (layout, params64) = perturbed_params(&ODD, 3);
    let (inputs, targets) = random_batch(ODD.vocab_size, batch * seq, 4);
    let device = CpuDevice::new().unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
    let snapshot = device.alloc::<f32>(layout.padded_len()).unwrap();
    let mut model = CpuGpt::new(&device, &ODD, &layout, batch, seq).unwrap();
    model.set_batch(&inputs, &targets).unwrap();
    model.forward(&params).unwrap();

    let mut seen = Vec::new();
    let compute = device.stream(StreamKind::Compute);
    model
        .backward(&params, &grads, 1.0, |ready| {
            let range = ready.flat_range.clone();
            device.copy_d2d(compute, &grads, range.clone(), &snapshot, range.start).unwrap();
            seen.push(ready.clone());
        })
        .unwrap();

    let groups: Vec<GradGroup> = seen.iter().map(|r| r.group).collect();
    let expected =
        [GradGroup::FinalNorm, GradGroup::Block(1), GradGroup::Block(0), GradGroup::Embeddings];
    assert_eq!(groups, expected);
    let (grads, snapshot) = (device.download(&grads).unwrap(), device.download(&snapshot).unwrap());
    let mut covered = 0;
    for ready in &seen {
        let range = ready.flat_range.clone();
        assert!(grads[range.clone()].iter().any(|&g| g != 0.0), "{:?} has gradients", ready.group);
        assert_eq!(snapshot[range.clone()], grads[range.clone()], "{:?} complete", ready.group);
        covered += range.len();
    }
    // The groups tile every parameter.
    let params_covered: usize = layout.params().iter().map(|p| p.numel()).sum();
    assert!(covered >= params_covered);
    for view in layout.params() {
        let inside = seen.iter().filter(|r| r.flat_range.contains(&view.offset)).count();
        assert_eq!(inside, 1, "{} is in exactly one group", view.name);
    }
}

/// Backward adds to the gradient buffer: two backward passes give twice one pass, and a loss
/// scale scales the gradient.
#[test]
fn backward_accumulates_into_the_gradient_buffer() {
    let (batch, seq) = (2, 5);
    let (layout, params64) = perturbed_params(&ODD, 5);
    let (inputs, targets) = random_batch(ODD.vocab_size, batch * seq, 6);
    let device = CpuDevice::new().unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let once = device.alloc::<f32>(layout.padded_len()).unwrap();
    let twice = device.alloc::<f32>(layout.padded_len()).unwrap();
    let scaled = device.alloc::<f32>(layout.padded_len()).unwrap();
    let mut model = CpuGpt::new(&device, &ODD, &layout, batch, seq).unwrap();
    model.set_batch(&inputs, &targets).unwrap();
    model.forward(&params).unwrap();
    model.backward(&params, &once, 1.0, |_| {}).unwrap();
    model.backward(&params, &twice, 1.0, |_| {}).unwrap();
    model.backward(&params, &twice, 1.0, |_| {}).unwrap();
    model.backward(&params, &scaled, 2.0, |_| {}).unwrap();
    let once = device.download(&once).unwrap();
    let twice = device.download(&twice).unwrap();
    let scaled = device.download(&scaled).unwrap();
    assert!(once.iter().any(|&g| g != 0.0));
    for ((&a, &b), &c) in once.iter().zip(&twice).zip(&scaled) {
        assert!((2.0 * a - b).abs() <= 1e-6 * (1.0 + b.abs()), "{a} {b}");
        assert!((2.0 * a - c).abs() <= 1e-6 * (1.0 + c.abs()), "{a} {c}");
    }
}

/// What the engine does with the notices: record an event on the compute stream, make the D2H
/// stream wait on it, and copy the group's gradients to the host while the rest of backward runs.
/// Under chaos the copies still see complete gradients; without the event the device refuses the
/// copy as a race.
#[test]
fn gradients_copied_out_on_the_d2h_stream_at_each_notice_are_complete() {
    use zeroflow_device::{Chaos, DeviceError, HostMemory};
    let (batch, seq) = (2, 5);
    let (layout, params64) = perturbed_params(&ODD, 13);
    let (inputs, targets) = random_batch(ODD.vocab_size, batch * seq, 14);
    let device = CpuDevice::with_chaos(Chaos::new(3)).unwrap();
    let params32: Vec<f32> = params64.iter().map(|&x| x as f32).collect();
    let params = device.upload(&params32).unwrap();
    let grads = device.alloc::<f32>(layout.padded_len()).unwrap();
    let mut model = CpuGpt::new(&device, &ODD, &layout, batch, seq).unwrap();
    model.set_batch(&inputs, &targets).unwrap();
    model.forward(&params).unwrap();

    let (compute, d2h) = (device.stream(StreamKind::Compute), device.stream(StreamKind::D2h));
    let groups = zeroflow_gpt::ParamRanges::new(&ODD, &layout).unwrap().grad_groups();
    let mut hosts: Vec<_> = groups
        .iter()
        .map(|g| device.alloc_host::<f32>(g.flat_range.len(), HostMemory::Pinned).unwrap())
        .collect();
    let mut free = hosts.iter_mut();
    let mut in_flight = Vec::new();
    model
        .backward(&params, &grads, 1.0, |ready| {
            let mut done = device.new_event().unwrap();
            device.record(&mut done, compute).unwrap();
            device.wait_event(d2h, &done).unwrap();
            let host = free.next().unwrap();
            let range = ready.flat_range.clone();
            in_flight.push(device.copy_d2h(d2h, &grads, range, host, 0).unwrap());
        })
        .unwrap();
    let copied: Vec<Vec<f32>> =
        in_flight.into_iter().map(|token| token.wait().unwrap().to_vec()).collect();
    let grads_host = device.download(&grads).unwrap();
    for (group, copy) in groups.iter().zip(&copied) {
        assert_eq!(copy[..], grads_host[group.flat_range.clone()], "{:?}", group.group);
    }

    // The same copy without the event: the device refuses it.
    model.forward(&params).unwrap();
    let mut refused = None;
    let mut host = device.alloc_host::<f32>(layout.padded_len(), HostMemory::Pinned).unwrap();
    model
        .backward(&params, &grads, 1.0, |ready| {
            if refused.is_none() {
                let range = ready.flat_range.clone();
                refused = Some(device.copy_d2h(d2h, &grads, range, &mut host, 0).map(drop));
            }
        })
        .unwrap();
    assert!(matches!(refused, Some(Err(DeviceError::Race(_)))), "{refused:?}");
}
