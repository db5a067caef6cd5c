//! `CudaKvCache` (the cached attention of inference, `kernels/decode.cu`) against its CPU twins
//! (`infer::decode_attention`) on the same bf16 inputs: a prefill of prompts shorter and longer
//! than a block's warps, then decode steps that skip a sequence, at grouped-query shapes with head
//! sizes that leave lanes idle (40, 80) and the largest (256), qkv and out rows wider than their
//! data (strides).

use zeroflow_core::bf16;
use zeroflow_device::cuda::module::compile_for_tests;
use zeroflow_device::{CudaDevice, Device, StreamKind};
use zeroflow_nn::cuda::decode::{CudaKvCache, KERNEL_NAMES, SOURCE};
use zeroflow_nn::infer::decode_attention::{DeviceCacheLayout, decode_attention, kv_write};
use zeroflow_nn::infer::{CachedAttention, CachedRow, KvCache};

use crate::gpu;
use crate::support::{random_bf16, relative_error, widen};

/// The largest relative error of the attention's output: the GPU rounds it to bf16 (2⁻⁹), the
/// rest is f32 on both sides.
const TOLERANCE: f64 = 1e-2;

/// The steps of a batch of three: a prefill of 1, 3 and 11 positions, then two decode steps.
fn steps() -> (usize, Vec<Vec<CachedRow>>) {
    let mut cache =
        KvCache::<f32>::new(0, CachedAttention { n_head: 1, n_kv_head: 1, head_dim: 1 }, 3, 14);
    let mut steps = vec![cache.prefill(&[&[0], &[0; 3], &[0; 11]]).unwrap().rows];
    steps.push(cache.decode(&[(2, 0), (0, 0)]).unwrap().rows);
    steps.push(cache.decode(&[(1, 0), (2, 0), (0, 0)]).unwrap().rows);
    (14, steps)
}

fn check_against_the_twins(device: &CudaDevice, shape: CachedAttention, pad: usize, seed: u64) {
    let stream = device.stream(StreamKind::Compute);
    let (capacity, steps) = steps();
    let layout = DeviceCacheLayout { shape, batch: 3, capacity };
    let max_rows = steps.iter().map(Vec::len).max().unwrap();
    let layers = 2;
    let mut cache = CudaKvCache::new(device, layers, layout, max_rows).unwrap();
    let (qkv_stride, out_stride) = (shape.qkv_width() + pad, shape.q_width() + pad);
    let mut twin_cache = vec![(vec![0.0f32; layout.len()], vec![0.0f32; layout.len()]); layers];
    for (step, rows) in steps.iter().enumerate() {
        cache.set_rows(stream, rows).unwrap();
        for (layer, (keys, values)) in twin_cache.iter_mut().enumerate() {
            let seed = seed + 10 * step as u64 + layer as u64;
            let qkv = random_bf16(rows.len() * qkv_stride, 2.0, seed);
            let qkv_gpu = device.upload(&qkv).unwrap();
            let out_gpu = device.upload(&vec![bf16::NAN; rows.len() * out_stride]).unwrap();
            cache.write(stream, layer, qkv_gpu.slice(0..qkv.len()), qkv_stride).unwrap();
            let out_slice = out_gpu.slice_mut(0..rows.len() * out_stride);
            cache
                .attend(
                    stream,
                    layer,
                    qkv_gpu.slice(0..qkv.len()),
                    qkv_stride,
                    out_slice,
                    out_stride,
                )
                .unwrap();
            // The twins on the rows without their padding.
            let packed: Vec<f32> = qkv
                .chunks(qkv_stride)
                .flat_map(|row| row[..shape.qkv_width()].iter().map(|x| x.to_f32()))
                .collect();
            kv_write(keys, values, &packed, rows, &layout);
            let mut expected = vec![0.0f32; rows.len() * shape.q_width()];
            decode_attention(&mut expected, &packed, keys, values, rows, &layout);
            let out = device.download(&out_gpu).unwrap();
            let (data, padding): (Vec<bf16>, Vec<bf16>) = out
                .chunks(out_stride)
                .map(|row| (row[..shape.q_width()].to_vec(), row[shape.q_width()..].to_vec()))
                .fold((Vec::new(), Vec::new()), |(mut d, mut p), (a, b)| {
                    d.extend(a);
                    p.extend(b);
                    (d, p)
                });
            assert!(padding.iter().all(|x| x.is_nan()), "attend wrote past a row's heads");
            let expected64: Vec<f64> = expected.iter().map(|&x| f64::from(x)).collect();
            let error = relative_error(&widen(&data), &expected64);
            println!(
                "decode_attention {shape:?} step {step} layer {layer}: relative error {error:.2e}"
            );
            assert!(error < TOLERANCE, "{shape:?} step {step} layer {layer}: {error}");
            let (gpu_keys, gpu_values) = cache.download_layer(layer).unwrap();
            let same =
                |gpu: &[bf16], twin: &[f32]| gpu.iter().zip(twin).all(|(g, &t)| g.to_f32() == t);
            assert!(
                same(&gpu_keys, keys) && same(&gpu_values, values),
                "kv_write: step {step} layer {layer}"
            );
        }
    }
}

#[test]
fn cached_attention_matches_the_cpu_twins() {
    let Some(device) = gpu() else { return };
    let shapes = [
        (CachedAttention { n_head: 6, n_kv_head: 2, head_dim: 40 }, 3),
        (CachedAttention { n_head: 8, n_kv_head: 1, head_dim: 80 }, 0),
        (CachedAttention { n_head: 4, n_kv_head: 4, head_dim: 64 }, 8),
        (CachedAttention { n_head: 4, n_kv_head: 2, head_dim: 256 }, 0),
    ];
    for (seed, (shape, pad)) in shapes.into_iter().enumerate() {
        check_against_the_twins(&device, shape, pad, 100 * seed as u64);
    }
}

/// A row outside the cache, or more rows than it was made for, is an error, not a launch.
#[test]
fn rows_outside_the_cache_are_refused() {
    let Some(device) = gpu() else { return };
    let stream = device.stream(StreamKind::Compute);
    let shape = CachedAttention { n_head: 2, n_kv_head: 1, head_dim: 8 };
    let layout = DeviceCacheLayout { shape, batch: 2, capacity: 4 };
    let mut cache = CudaKvCache::new(&device, 1, layout, 2).unwrap();
    let row = |seq, pos| CachedRow { seq, pos };
    assert!(cache.set_rows(stream, &[row(1, 3), row(0, 0)]).is_ok());
    assert!(cache.set_rows(stream, &[row(2, 0)]).is_err(), "no sequence 2");
    assert!(cache.set_rows(stream, &[row(0, 4)]).is_err(), "no position 4");
    assert!(cache.set_rows(stream, &[row(0, 0); 3]).is_err(), "3 rows of at most 2");
}

/// Runs without a GPU wherever libnvrtc loads (and prints `skipped: libnvrtc not found`
/// elsewhere).
#[test]
fn decode_kernels_compile_for_sm80_and_sm90_and_export_both_kernels() {
    let names: Vec<String> = KERNEL_NAMES.iter().map(|k| k.to_string()).collect();
    let compiled = compile_for_tests("nn_decode", SOURCE, &names, "decode_attention_8");
    compiled.unwrap_or_else(|e| panic!("{e}"));
}
