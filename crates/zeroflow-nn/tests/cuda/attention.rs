//! `CudaAttention` against the CPU reference (`kernels::attention`, in f64 on the same bf16
//! inputs), at sizes that exercise every tail: a sequence of 37 (rows not a multiple of 8, so the
//! scalar softmax), a head size of 50 (2-element packs), a sequence of one token, sizes where the
//! 16-byte paths run, tensors at odd offsets, and grouped-query attention (6 query heads on 2
//! key/value heads at head size 48, 8 on 1 at head size 80, 4 on 2 at odd offsets). Every tensor of the caller sits between NaN
//! guards, and the outputs start as NaN: an element not written, a write outside a tensor or a
//! read outside one shows up.

use std::sync::Arc;
use std::time::Instant;

use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::module::compile_for_tests;
use zeroflow_device::{Device, StreamKind};
use zeroflow_nn::cuda::attention::{CudaAttention, SOURCE, kernel_names};
use zeroflow_nn::kernels::attention::{AttentionShape, attention_backward, attention_forward};

use crate::gpu;
use crate::support::{Placed, random_bf16, relative_error, widen};

/// The largest relative error (‖gpu − cpu‖ / ‖cpu‖) allowed: the GPU rounds the scores, the
/// weights and every intermediate to bf16.
const TOLERANCE: f64 = 2e-2;

#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    seq: usize,
    c: usize,
    n_head: usize,
    /// Key/value heads: `n_head` for multi-head attention, a divisor of it for grouped-query.
    n_kv_head: usize,
    /// Elements before each of the caller's tensors in its buffer (3 makes every address only
    /// 2-byte aligned, so every kernel takes its one-element path).
    offset: usize,
}

impl Shape {
    const fn mha(batch: usize, seq: usize, c: usize, n_head: usize, offset: usize) -> Self {
        Shape { batch, seq, c, n_head, n_kv_head: n_head, offset }
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    fn att_len(&self) -> usize {
        self.batch * self.n_head * self.seq * self.seq
    }

    fn attention(&self) -> AttentionShape {
        let Shape { seq, c, n_head, n_kv_head, .. } = *self;
        AttentionShape { t: seq, c, n_head, n_kv_head }
    }

    /// Elements of `qkv [B, T, C + 2·n_kv_head·hs]`.
    fn qkv_len(&self) -> usize {
        self.rows() * self.attention().qkv_width()
    }
}

const SHAPES: [Shape; 8] = [
    Shape::mha(2, 37, 200, 4, 0),
    Shape::mha(2, 1, 200, 4, 0),
    Shape::mha(3, 64, 256, 2, 0),
    Shape::mha(3, 20, 96, 3, 0),
    Shape::mha(3, 24, 128, 4, 3),
    Shape { batch: 2, seq: 37, c: 288, n_head: 6, n_kv_head: 2, offset: 0 },
    Shape { batch: 2, seq: 45, c: 640, n_head: 8, n_kv_head: 1, offset: 0 },
    Shape { batch: 3, seq: 24, c: 128, n_head: 4, n_kv_head: 2, offset: 3 },
];

#[test]
fn forward_and_backward_match_the_cpu_reference_at_odd_sizes() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    let stream = device.stream(StreamKind::Compute);
    for (index, &shape) in SHAPES.iter().enumerate() {
        let Shape { batch, seq, c, n_head, n_kv_head, offset } = shape;
        let at = offset * size_of::<bf16>();
        let seed = 100 * index as u64;
        let qkv = random_bf16(shape.qkv_len(), 2.0, seed);
        let dout = random_bf16(shape.rows() * c, 1.0, seed + 1);

        let mut out_ref = vec![0.0; shape.rows() * c];
        let mut att_ref = vec![0.0; shape.att_len()];
        let heads = shape.attention();
        attention_forward(&mut out_ref, &mut att_ref, &widen(&qkv), heads);
        let mut dqkv_ref = vec![0.0; qkv.len()];
        let mut dscores_ref = vec![0.0; shape.att_len()];
        let (dout_wide, qkv_wide) = (widen(&dout), widen(&qkv));
        attention_backward(&mut dqkv_ref, &mut dscores_ref, &dout_wide, &qkv_wide, &att_ref, heads);

        let attention = CudaAttention::new(&device, blas.clone(), batch, heads).unwrap();
        let qkv_gpu = Placed::holding(&device, &qkv, at);
        let dout_gpu = Placed::holding(&device, &dout, at);
        let out = Placed::<bf16>::poisoned(&device, shape.rows() * c, at);
        let att = Placed::<bf16>::poisoned(&device, shape.att_len(), at);
        let dqkv = Placed::<bf16>::poisoned(&device, qkv.len(), at);
        let dscores = Placed::<bf16>::poisoned(&device, shape.att_len(), at);
        attention.forward(stream, qkv_gpu.slice(), out.slice_mut(), att.slice_mut()).unwrap();
        let (dout_in, qkv_in, att_in) = (dout_gpu.slice(), qkv_gpu.slice(), att.slice());
        let (dqkv_out, dscores_out) = (dqkv.slice_mut(), dscores.slice_mut());
        attention.backward(stream, dout_in, qkv_in, att_in, dqkv_out, dscores_out).unwrap();
        device.synchronize().unwrap();

        let att_gpu = att.read(&device, "att");
        let errors = [
            ("out", relative_error(&out.read(&device, "out"), &out_ref)),
            ("att", relative_error(&att_gpu, &att_ref)),
            ("dqkv", relative_error(&dqkv.read(&device, "dqkv"), &dqkv_ref)),
        ];
        for (what, rel) in errors {
            println!(
                "RESULT attention {what} B{batch} T{seq} C{c} NH{n_head} NKV{n_kv_head} \
                 offset{offset} rel={rel:.3e}"
            );
            assert!(rel <= TOLERANCE, "{shape:?}: {what} is off by {rel:.3e} (relative)");
        }
        // The masked weights are exactly zero, not merely small.
        let masked_nonzero = (0..shape.att_len())
            .filter(|&i| i % seq > (i / seq) % seq && att_gpu[i] != 0.0)
            .count();
        assert_eq!(masked_nonzero, 0, "{shape:?}: weights above the diagonal are not zero");
    }
}

/// Runs forward and backward twice on the same inputs: the second run sees the scratch and the
/// outputs the first left behind, and must give the same results (up to the matmuls' choice of
/// reduction order), so nothing depends on what the scratch held and nothing accumulates.
#[test]
fn a_second_run_on_the_same_inputs_gives_the_same_results() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    let stream = device.stream(StreamKind::Compute);
    for shape in [SHAPES[0], SHAPES[5]] {
        let Shape { batch, c, .. } = shape;
        let attention = CudaAttention::new(&device, blas.clone(), batch, shape.attention());
        let attention = attention.unwrap();
        let qkv = Placed::holding(&device, &random_bf16(shape.qkv_len(), 2.0, 7), 0);
        let dout = Placed::holding(&device, &random_bf16(shape.rows() * c, 1.0, 8), 0);
        let out = Placed::<bf16>::poisoned(&device, shape.rows() * c, 0);
        let att = Placed::<bf16>::poisoned(&device, shape.att_len(), 0);
        let dqkv = Placed::<bf16>::poisoned(&device, shape.qkv_len(), 0);
        let dscores = Placed::<bf16>::poisoned(&device, shape.att_len(), 0);
        let mut runs = Vec::new();
        for _ in 0..2 {
            attention.forward(stream, qkv.slice(), out.slice_mut(), att.slice_mut()).unwrap();
            let (a, d, dqkv_out) = (att.slice(), dscores.slice_mut(), dqkv.slice_mut());
            attention.backward(stream, dout.slice(), qkv.slice(), a, dqkv_out, d).unwrap();
            device.synchronize().unwrap();
            runs.push([out.read(&device, "out"), dqkv.read(&device, "dqkv")]);
        }
        for (what, (first, second)) in ["out", "dqkv"].iter().zip(runs[0].iter().zip(&runs[1])) {
            let rel = relative_error(second, first);
            assert!(rel <= 1e-3, "{shape:?}: {what}: the second run differs by {rel:.3e}");
        }
    }
}

/// Times forward and backward of one layer's attention at gpt-1.3b's shapes (B 8, T 1024,
/// C 2048, 16 heads). Prints `RESULT attention_bench fwd_ms=.. bwd_ms=..`; asserts nothing.
#[test]
#[ignore = "a benchmark: run with --ignored on a GPU"]
fn bench_attention_at_gpt_1_3b_shapes() {
    let Some(device) = gpu() else { return };
    let (batch, seq, c, n_head) = (8, 1024, 2048, 16);
    let shape = Shape::mha(batch, seq, c, n_head, 0);
    let blas = Arc::new(Blas::new(&device).unwrap());
    let stream = device.stream(StreamKind::Compute);
    let attention = CudaAttention::new(&device, blas, batch, shape.attention()).unwrap();
    let qkv = device.upload(&random_bf16(shape.rows() * 3 * c, 2.0, 1)).unwrap();
    let dout = device.upload(&random_bf16(shape.rows() * c, 1.0, 2)).unwrap();
    let out = device.alloc::<bf16>(shape.rows() * c).unwrap();
    let att = device.alloc::<bf16>(shape.att_len()).unwrap();
    let dqkv = device.alloc::<bf16>(shape.rows() * 3 * c).unwrap();
    let dscores = device.alloc::<bf16>(shape.att_len()).unwrap();
    let forward = || {
        attention.forward(stream, qkv.as_slice(), out.as_slice_mut(), att.as_slice_mut()).unwrap();
    };
    let backward = || {
        let (a, d) = (att.as_slice(), dscores.as_slice_mut());
        attention
            .backward(stream, dout.as_slice(), qkv.as_slice(), a, dqkv.as_slice_mut(), d)
            .unwrap();
    };
    let time_ms = |run: &dyn Fn(), iterations: u32| {
        run();
        device.synchronize().unwrap();
        let started = Instant::now();
        for _ in 0..iterations {
            run();
        }
        device.synchronize().unwrap();
        started.elapsed().as_secs_f64() * 1e3 / f64::from(iterations)
    };
    let fwd_ms = time_ms(&forward, 20);
    let bwd_ms = time_ms(&backward, 20);
    let flops = 2.0 * (batch * n_head * seq * seq * (c / n_head)) as f64;
    println!(
        "RESULT attention_bench fwd_ms={fwd_ms:.3} bwd_ms={bwd_ms:.3} (matmul TFLOP/s fwd {:.0}, \
         bwd {:.0}; scratch {} MiB)",
        2.0 * flops / fwd_ms / 1e9,
        4.0 * flops / bwd_ms / 1e9,
        attention.scratch_bytes() >> 20
    );
}

/// Runs without a GPU wherever libnvrtc loads (and prints `skipped: libnvrtc not found`
/// elsewhere).
#[test]
fn attention_kernels_compile_for_sm80_and_sm90_and_export_every_kernel_the_model_loads() {
    let compiled = compile_for_tests("attention", SOURCE, &kernel_names(), "rows_to_heads_3");
    compiled.unwrap_or_else(|e| panic!("{e}"));
}
