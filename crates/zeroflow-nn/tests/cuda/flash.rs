//! `FlashAttention` against the CPU reference (`kernels::attention`, in f64 on the same bf16
//! inputs) and against `CudaAttention` on the same inputs: at head sizes 64 and 128, sequences
//! that end inside a 64-row tile (1, 37, 65, 200) or on its edge (64, 128), several sequences and
//! heads, multi-head and grouped-query (6 query heads on 2 key/value heads, and 8 on 1:
//! multi-query). Every tensor of the caller sits between NaN guards and the outputs start as NaN, so an
//! element not written, a write outside a tensor or a read outside one (a tile row past `T` not
//! masked) shows up. Also: the module compiles with NVRTC (no GPU needed), a second run repeats
//! the first bit for bit (no atomics), bad shapes and alignments are refused, and an `#[ignore]`d
//! benchmark against `CudaAttention` at gpt-1.3b's and gpt2-350m's shapes.

use std::sync::Arc;
use std::time::Instant;

use zeroflow_core::bf16;
use zeroflow_device::cuda::CudaStream;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::module::compile_for_tests;
use zeroflow_device::{CudaDevice, Device, DeviceBuffer, StreamKind};
use zeroflow_nn::cuda::attention::CudaAttention;
use zeroflow_nn::cuda::flash::{FlashAttention, SOURCE, kernel_names};
use zeroflow_nn::kernels::attention::{AttentionShape, attention_backward, attention_forward};

use crate::gpu;
use crate::support::{Placed, random_bf16, relative_error, widen};

/// Bytes before each of the caller's tensors (the kernels need 16-byte aligned tensors), all NaN.
const OFFSET_BYTES: usize = 16;

/// The largest relative error (‖gpu − cpu‖ / ‖cpu‖) allowed for out and each third of dqkv: the
/// GPU rounds P, dS and the outputs to bf16 (the same bound as `CudaAttention`'s test).
const TOLERANCE: f64 = 2e-2;

/// The largest relative error of the log-sum-exp: f32 sums of exact bf16 products, exp2 and log2.
const LSE_TOLERANCE: f64 = 1e-4;

#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    seq: usize,
    c: usize,
    n_head: usize,
    /// Key/value heads: `n_head` for multi-head attention, a divisor of it for grouped-query.
    n_kv_head: usize,
}

impl Shape {
    const fn mha(batch: usize, seq: usize, c: usize, n_head: usize) -> Self {
        Shape { batch, seq, c, n_head, n_kv_head: n_head }
    }

    fn rows(&self) -> usize {
        self.batch * self.seq
    }

    fn head_size(&self) -> usize {
        self.c / self.n_head
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

const SHAPES: [Shape; 12] = [
    Shape::mha(2, 1, 192, 3),
    Shape::mha(2, 37, 128, 2),
    Shape::mha(3, 37, 256, 2),
    Shape::mha(2, 64, 256, 2),
    Shape::mha(2, 65, 192, 3),
    Shape::mha(2, 128, 128, 2),
    Shape::mha(2, 200, 256, 2),
    Shape::mha(1, 200, 256, 4),
    // Grouped-query: groups of 3 and of 8 (multi-query), at both head sizes, the sequences
    // ending inside a tile.
    Shape { batch: 2, seq: 65, c: 384, n_head: 6, n_kv_head: 2 },
    Shape { batch: 2, seq: 37, c: 512, n_head: 8, n_kv_head: 1 },
    Shape { batch: 2, seq: 130, c: 768, n_head: 6, n_kv_head: 2 },
    Shape { batch: 1, seq: 200, c: 1024, n_head: 8, n_kv_head: 1 },
];

/// Part `part` (0 q, 1 k, 2 v) of every row of a `qkv`-shaped tensor of `shape`.
fn part<T: Copy>(rows: &[T], shape: Shape, part: usize) -> Vec<T> {
    let (c, kv) = (shape.c, shape.attention().kv_width());
    let columns = [0..c, c..c + kv, c + kv..c + 2 * kv][part].clone();
    rows.chunks(c + 2 * kv).flat_map(|row| &row[columns.clone()]).copied().collect()
}

/// `log Σ_{k ≤ t} exp(scale · q_t·k)` of every query row, `[B, NH, T]`, in f64, each query head
/// with the keys of its key/value head.
fn reference_lse(qkv: &[f64], shape: Shape) -> Vec<f64> {
    let Shape { batch, seq, c, n_head, n_kv_head } = shape;
    let hs = shape.head_size();
    let (width, group) = (shape.attention().qkv_width(), n_head / n_kv_head);
    let scale = 1.0 / (hs as f64).sqrt();
    let query = |b: usize, t: usize, h: usize| &qkv[(b * seq + t) * width + h * hs..][..hs];
    let key =
        |b: usize, t: usize, h: usize| &qkv[(b * seq + t) * width + c + h / group * hs..][..hs];
    let mut lse = Vec::with_capacity(batch * n_head * seq);
    for b in 0..batch {
        for h in 0..n_head {
            for t in 0..seq {
                let scores: Vec<f64> = (0..=t)
                    .map(|t2| {
                        let dot: f64 =
                            query(b, t, h).iter().zip(key(b, t2, h)).map(|(q, k)| q * k).sum();
                        dot * scale
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                lse.push(max + scores.iter().map(|s| (s - max).exp()).sum::<f64>().ln());
            }
        }
    }
    lse
}

/// The inputs of one shape: `qkv` and `dout`, random, on the host and placed on the GPU.
struct Inputs {
    qkv: Vec<bf16>,
    dout: Vec<bf16>,
    qkv_gpu: Placed<bf16>,
    dout_gpu: Placed<bf16>,
}

impl Inputs {
    fn new(device: &CudaDevice, shape: Shape, seed: u64) -> Self {
        let qkv = random_bf16(shape.qkv_len(), 2.0, seed);
        let dout = random_bf16(shape.rows() * shape.c, 1.0, seed + 1);
        let (qkv_gpu, dout_gpu) = (
            Placed::holding(device, &qkv, OFFSET_BYTES),
            Placed::holding(device, &dout, OFFSET_BYTES),
        );
        Inputs { qkv, dout, qkv_gpu, dout_gpu }
    }
}

/// `out` and `dqkv` of one forward and backward, widened to f64 (exactly).
struct Outputs {
    out: Vec<f64>,
    dqkv: Vec<f64>,
}

/// Forward then backward of `flash` on `inputs`, into fresh NaN-filled outputs and lse; returns
/// the outputs and the lse.
fn run_flash(
    device: &CudaDevice,
    flash: &FlashAttention,
    shape: Shape,
    inputs: &Inputs,
) -> (Outputs, Vec<f64>) {
    let stream = device.stream(StreamKind::Compute);
    let out = Placed::<bf16>::poisoned(device, shape.rows() * shape.c, OFFSET_BYTES);
    let lse = Placed::<f32>::poisoned(device, flash.lse_len(), OFFSET_BYTES);
    let dqkv = Placed::<bf16>::poisoned(device, shape.qkv_len(), OFFSET_BYTES);
    let (qkv_in, dout_in) = (inputs.qkv_gpu.slice(), inputs.dout_gpu.slice());
    flash.forward(stream, qkv_in, out.slice_mut(), lse.slice_mut()).unwrap();
    let (out_in, lse_in) = (out.slice(), lse.slice());
    flash.backward(stream, qkv_in, out_in, dout_in, lse_in, dqkv.slice_mut()).unwrap();
    device.synchronize().unwrap();
    let outputs = Outputs { out: out.read(device, "out"), dqkv: dqkv.read(device, "dqkv") };
    (outputs, lse.read(device, "lse"))
}

/// Forward then backward of `CudaAttention` on `inputs`.
fn run_cuda_attention(
    device: &CudaDevice,
    blas: &Arc<Blas>,
    shape: Shape,
    inputs: &Inputs,
) -> Outputs {
    let stream = device.stream(StreamKind::Compute);
    let attention = CudaAttention::new(device, blas.clone(), shape.batch, shape.attention());
    let attention = attention.unwrap();
    let out = Placed::<bf16>::poisoned(device, shape.rows() * shape.c, OFFSET_BYTES);
    let att = Placed::<bf16>::poisoned(device, shape.att_len(), OFFSET_BYTES);
    let dqkv = Placed::<bf16>::poisoned(device, shape.qkv_len(), OFFSET_BYTES);
    let dscores = Placed::<bf16>::poisoned(device, shape.att_len(), OFFSET_BYTES);
    let (qkv_in, dout_in) = (inputs.qkv_gpu.slice(), inputs.dout_gpu.slice());
    attention.forward(stream, qkv_in, out.slice_mut(), att.slice_mut()).unwrap();
    let (att_in, dqkv_out, dscores_out) = (att.slice(), dqkv.slice_mut(), dscores.slice_mut());
    attention.backward(stream, dout_in, qkv_in, att_in, dqkv_out, dscores_out).unwrap();
    device.synchronize().unwrap();
    Outputs { out: out.read(device, "out"), dqkv: dqkv.read(device, "dqkv") }
}

/// The CPU reference in f64: out and dqkv.
fn run_reference(shape: Shape, inputs: &Inputs) -> Outputs {
    let (qkv, dout) = (widen(&inputs.qkv), widen(&inputs.dout));
    let mut out = vec![0.0; shape.rows() * shape.c];
    let mut att = vec![0.0; shape.att_len()];
    let heads = shape.attention();
    attention_forward(&mut out, &mut att, &qkv, heads);
    let mut dqkv = vec![0.0; qkv.len()];
    let mut dscores = vec![0.0; shape.att_len()];
    attention_backward(&mut dqkv, &mut dscores, &dout, &qkv, &att, heads);
    Outputs { out, dqkv }
}

/// The relative error of out and of each part of dqkv of `gpu` against `expected`.
fn errors(gpu: &Outputs, expected: &Outputs, shape: Shape) -> [(&'static str, f64); 4] {
    let part = |outputs: &Outputs, index| part(&outputs.dqkv, shape, index);
    [
        ("out", relative_error(&gpu.out, &expected.out)),
        ("dq", relative_error(&part(gpu, 0), &part(expected, 0))),
        ("dk", relative_error(&part(gpu, 1), &part(expected, 1))),
        ("dv", relative_error(&part(gpu, 2), &part(expected, 2))),
    ]
}

#[test]
fn forward_and_backward_match_the_cpu_reference_and_cuda_attention() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    let mut worst: f64 = 0.0;
    for (index, &shape) in SHAPES.iter().enumerate() {
        let Shape { batch, seq, c, n_head, n_kv_head } = shape;
        let inputs = Inputs::new(&device, shape, 100 * index as u64);
        let flash = FlashAttention::new(&device, batch, shape.attention()).unwrap();
        let (outputs, lse) = run_flash(&device, &flash, shape, &inputs);
        let lse_rel = relative_error(&lse, &reference_lse(&widen(&inputs.qkv), shape));
        let hs = shape.head_size();
        let label = format!("B{batch} T{seq} C{c} NH{n_head} NKV{n_kv_head} hs{hs}");
        println!("RESULT flash lse {label} rel={lse_rel:.3e}");
        assert!(lse_rel <= LSE_TOLERANCE, "{shape:?}: lse is off by {lse_rel:.3e} (relative)");
        let expected = [
            ("reference", run_reference(shape, &inputs)),
            ("attention", run_cuda_attention(&device, &blas, shape, &inputs)),
        ];
        for (against, expected) in &expected {
            for (what, rel) in errors(&outputs, expected, shape) {
                println!("RESULT flash {what} vs {against} {label} rel={rel:.3e}");
                assert!(
                    rel <= TOLERANCE,
                    "{shape:?}: {what} is off from {against} by {rel:.3e} (relative)"
                );
                worst = worst.max(rel);
            }
        }
    }
    println!("RESULT flash accuracy max_rel={worst:.3e} over {} shapes", SHAPES.len());
}

/// The bits of widened values (widening bf16 or f32 to f64 is exact and one to one, so equal bits
/// here are equal bits on the GPU, signed zeros and NaN payloads included).
fn bits(values: &[f64]) -> Vec<u64> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// Runs forward and backward twice on the same inputs, at both head sizes and with several query
/// and key blocks, multi-head and grouped-query: the second run sees the delta the first left
/// behind. No kernel uses atomics (a key/value head's dk and dv sum over its group in one block),
/// so out, lse and all of dqkv (dq included) must repeat bit for bit.
#[test]
fn a_second_run_repeats_the_first_bit_for_bit() {
    let Some(device) = gpu() else { return };
    for shape in [SHAPES[4], SHAPES[6], SHAPES[8], SHAPES[11]] {
        let Shape { batch, seq, c, n_head, n_kv_head } = shape;
        let flash = FlashAttention::new(&device, batch, shape.attention()).unwrap();
        let inputs = Inputs::new(&device, shape, 7);
        let (first, first_lse) = run_flash(&device, &flash, shape, &inputs);
        let (second, second_lse) = run_flash(&device, &flash, shape, &inputs);
        assert!(bits(&first.out) == bits(&second.out), "{shape:?}: out differs between two runs");
        assert!(bits(&first_lse) == bits(&second_lse), "{shape:?}: lse differs between two runs");
        for (index, what) in [(0, "dq"), (1, "dk"), (2, "dv")] {
            assert!(
                bits(&part(&first.dqkv, shape, index)) == bits(&part(&second.dqkv, shape, index)),
                "{shape:?}: {what} differs between two runs"
            );
        }
        println!(
            "RESULT flash repeat B{batch} T{seq} C{c} NH{n_head} NKV{n_kv_head}: bit-identical"
        );
    }
}

#[test]
fn unsupported_head_sizes_and_unaligned_tensors_are_refused() {
    let Some(device) = gpu() else { return };
    let refused = FlashAttention::new(&device, 1, AttentionShape::multi_head(8, 96, 2));
    let refused = refused.unwrap_err().to_string();
    assert!(refused.contains("head size 48"), "{refused}");
    let flash = FlashAttention::new(&device, 1, AttentionShape::multi_head(8, 128, 2)).unwrap();
    let qkv = device.alloc::<bf16>(8 * 3 * 128 + 8).unwrap();
    let out = device.alloc::<bf16>(8 * 128).unwrap();
    let lse = device.alloc::<f32>(flash.lse_len() + 1).unwrap();
    let stream = device.stream(StreamKind::Compute);
    let (out_slice, lse_slice) = (out.as_slice_mut(), lse.as_slice_mut());
    let qkv_shifted = qkv.slice(1..qkv.len());
    let unaligned = flash.forward(stream, qkv_shifted, out_slice, lse_slice).unwrap_err();
    assert!(unaligned.to_string().contains("16-byte"), "{unaligned}");
    // An lse off its 4-byte alignment cannot be made any more (an f32 slice starts at an f32),
    // so the lse may start at any element.
    let too_short = flash.forward(stream, qkv.as_slice(), out_slice, lse.slice_mut(2..lse.len()));
    let too_short = too_short.unwrap_err().to_string();
    assert!(too_short.contains("lse holds"), "{too_short}");
    flash.forward(stream, qkv.as_slice(), out_slice, lse.slice_mut(1..lse.len())).unwrap();
    device.synchronize().unwrap();
    println!("RESULT flash refusals ok");
}

/// Runs without a GPU wherever libnvrtc loads (and prints `skipped: libnvrtc not found`
/// elsewhere).
#[test]
fn flash_kernels_compile_for_sm80_and_sm90_and_export_every_kernel() {
    let names = kernel_names();
    let compiled = compile_for_tests("flash_attention", SOURCE, &names, "flash_forward_96");
    for ((major, minor), bytes) in compiled.unwrap_or_else(|e| panic!("{e}")).unwrap_or_default() {
        println!(
            "RESULT flash compile sm_{major}{minor}: {bytes} bytes of cubin, {} kernels",
            names.len()
        );
    }
}

/// The median time of `run` over [`BENCH_RUNS`] runs (after one warm-up), in milliseconds.
fn median_ms(device: &CudaDevice, run: &dyn Fn()) -> f64 {
    run();
    device.synchronize().unwrap();
    let mut times: Vec<f64> = (0..BENCH_RUNS)
        .map(|_| {
            let started = Instant::now();
            run();
            device.synchronize().unwrap();
            started.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[BENCH_RUNS / 2]
}

const BENCH_RUNS: usize = 21;

/// Median forward and backward times of one layer's attention, FlashAttention against
/// CudaAttention, at gpt-1.3b's shapes (B 8, T 1024, C 2048, 16 heads of 128), gpt2-350m's
/// (C 1024, 16 heads of 64) and gpt-1.3b's with 4 key/value heads (grouped-query). TFLOP/s count the causal products only: forward 2·2·B·NH·T²·hs/2,
/// backward 2.5 times that (the products backward needs, not the P and dP that flash computes
/// twice). Prints `RESULT flash-bench ...`; asserts nothing.
#[test]
#[ignore = "a benchmark: run with --ignored on a GPU"]
fn bench_flash_against_cuda_attention() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    let stream = device.stream(StreamKind::Compute);
    for (name, c, n_kv_head) in
        [("gpt-1.3b", 2048, 16), ("gpt2-350m", 1024, 16), ("gqa-4", 2048, 4)]
    {
        let shape = Shape { batch: 8, seq: 1024, c, n_head: 16, n_kv_head };
        let Shape { batch, seq, n_head, .. } = shape;
        let flash = FlashAttention::new(&device, batch, shape.attention()).unwrap();
        let attention = CudaAttention::new(&device, blas.clone(), batch, shape.attention());
        let attention = attention.unwrap();
        let qkv = device.upload(&random_bf16(shape.qkv_len(), 2.0, 1)).unwrap();
        let dout = device.upload(&random_bf16(shape.rows() * c, 1.0, 2)).unwrap();
        let out = device.alloc::<bf16>(shape.rows() * c).unwrap();
        let lse = device.alloc::<f32>(flash.lse_len()).unwrap();
        let dqkv = device.alloc::<bf16>(shape.qkv_len()).unwrap();
        let att = device.alloc::<bf16>(shape.att_len()).unwrap();
        let dscores = device.alloc::<bf16>(shape.att_len()).unwrap();
        let (qkv_in, dout_in, out_in, lse_in) =
            (qkv.as_slice(), dout.as_slice(), out.as_slice(), lse.as_slice());
        let (out_out, dqkv_out, lse_out) =
            (out.as_slice_mut(), dqkv.as_slice_mut(), lse.as_slice_mut());
        let (att_in, att_out, dscores_out) =
            (att.as_slice(), att.as_slice_mut(), dscores.as_slice_mut());
        let times = |forward: &dyn Fn(&CudaStream), backward: &dyn Fn(&CudaStream)| {
            (median_ms(&device, &|| forward(stream)), median_ms(&device, &|| backward(stream)))
        };
        let (flash_fwd, flash_bwd) =
            times(&|s| flash.forward(s, qkv_in, out_out, lse_out).unwrap(), &|s| {
                flash.backward(s, qkv_in, out_in, dout_in, lse_in, dqkv_out).unwrap()
            });
        let (attention_fwd, attention_bwd) =
            times(&|s| attention.forward(s, qkv_in, out_out, att_out).unwrap(), &|s| {
                attention.backward(s, dout_in, qkv_in, att_in, dqkv_out, dscores_out).unwrap()
            });
        let hs = shape.head_size();
        let forward_flops = 2.0 * (batch * n_head * seq * seq * hs) as f64;
        let tflops = |flops: f64, ms: f64| flops / ms / 1e9;
        println!(
            "RESULT flash-bench {name} B{batch} T{seq} C{c} NH{n_head} NKV{n_kv_head} hs{hs}: flash fwd \
             {flash_fwd:.3} ms ({:.0} TFLOP/s) bwd {flash_bwd:.3} ms ({:.0} TFLOP/s); attention \
             fwd {attention_fwd:.3} ms ({:.0}) bwd {attention_bwd:.3} ms ({:.0}); speedup fwd \
             {:.2}x bwd {:.2}x; scratch flash {} KiB + lse {} KiB per layer, attention {} MiB + \
             att {} MiB per layer",
            tflops(forward_flops, flash_fwd),
            tflops(2.5 * forward_flops, flash_bwd),
            tflops(forward_flops, attention_fwd),
            tflops(2.5 * forward_flops, attention_bwd),
            attention_fwd / flash_fwd,
            attention_bwd / flash_bwd,
            flash.scratch_bytes() >> 10,
            (flash.lse_len() * size_of::<f32>()) >> 10,
            attention.scratch_bytes() >> 20,
            (shape.att_len() * size_of::<bf16>()) >> 20,
        );
    }
}
