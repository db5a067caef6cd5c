//! The engine's kernels (`kernels/engine.cu`) on the GPU against their CPU twins: the CPU
//! device's `Kernels`, zeroflow-optim's `CpuAdam`, or a plain loop here.
//!
//! Inputs are fresh random non-zero values from a seeded generator; sizes are not multiples of
//! the block size; offsets cover the three paths of the element-wise kernels (16-byte aligned,
//! aligned after a head of single elements, and one element at a time where the pointers'
//! alignments disagree). Outputs are poisoned with NaN first, and whole buffers are compared, so
//! an element left unwritten or a write outside the range fails. Each test prints one
//! `RESULT kernels <name> max_rel_err=...` line.

use std::ops::Range;
use std::time::Instant;

use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::dtype::{bf16, f16};
use zeroflow_core::{DType, Float};
use zeroflow_device::cuda::kernels::{Accumulation, AdamWBuffers, RowMajor};
use zeroflow_device::{CpuDevice, CudaDevice, Device, DeviceError, Kernels, StreamKind};
use zeroflow_optim::{
    AdamState, AdamW, AdamWConfig, CpuAdam, Grads, Output, SimdLevel, WeightDecayMode,
};

use crate::{env_usize, gpu};

/// Range lengths: one element, less than a block, and a prime far beyond a grid's first pass.
const SIZES: [usize; 3] = [1, 1000, 1_000_003];
/// (source offset, destination offset) in elements: 16-byte aligned; aligned after a head of 5
/// (f32 at +12 bytes and 16-bit types at +6 bytes line up after 5 elements); never aligned
/// together (one element at a time).
const OFFSETS: [(usize, usize); 3] = [(0, 0), (3, 3), (1, 2)];
/// Elements after each range, which must stay untouched.
const GUARD: usize = 13;

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` random non-zero values `±(1 + u) 2^e`, `e` uniform in `exponents`. One in four is made an
/// exact rounding tie for bf16 or for f16, to check round-to-nearest-even.
fn random_f32(rng: &mut ChaCha8Rng, n: usize, exponents: Range<i32>) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let magnitude =
                (1.0 + rng.random::<f32>()) * 2f32.powi(rng.random_range(exponents.clone()));
            let x = if rng.random::<bool>() { -magnitude } else { magnitude };
            match rng.random_range(0..8) {
                0 => f32::from_bits((x.to_bits() & !0xffff) | 0x8000),
                1 => f32::from_bits((x.to_bits() & !0x1fff) | 0x1000),
                _ => x,
            }
        })
        .collect()
}

/// Random values of `T` in a range every type holds as normal numbers (no zeros, no infinities).
fn random<T: Float>(rng: &mut ChaCha8Rng, n: usize) -> Vec<T> {
    random_f32(rng, n, -12..13).into_iter().map(T::from_f32).collect()
}

fn poisoned<T: Float>(n: usize) -> Vec<T> {
    vec![T::from_f32(f32::NAN); n]
}

/// The relative difference of two values: 0 for equal values (NaN equals NaN), infinite where
/// exactly one is NaN or infinite.
fn rel_err(got: f64, want: f64) -> f64 {
    if got == want || (got.is_nan() && want.is_nan()) {
        0.0
    } else if !got.is_finite() || !want.is_finite() {
        f64::INFINITY
    } else {
        (got - want).abs() / want.abs().max(f64::MIN_POSITIVE)
    }
}

/// The worst relative error of one kernel over all its cases.
struct Tally {
    name: &'static str,
    max_rel_err: f64,
    cases: usize,
    elements: usize,
    inexact: usize,
}

impl Tally {
    fn new(name: &'static str) -> Self {
        Tally { name, max_rel_err: 0.0, cases: 0, elements: 0, inexact: 0 }
    }

    /// Compares whole buffers; fails with the first element beyond `tolerance`.
    fn check<T: Float>(&mut self, case: &str, got: &[T], want: &[T], tolerance: f64) {
        assert_eq!(got.len(), want.len(), "{case}: buffer lengths");
        let mut worst = (0.0f64, 0usize);
        let mut inexact = 0;
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let err = rel_err(g.to_f64(), w.to_f64());
            if err > 0.0 {
                inexact += 1;
            }
            if err > worst.0 || err.is_nan() {
                worst = (err, i);
            }
        }
        let (err, i) = worst;
        assert!(
            err <= tolerance,
            "{case}: element {i} of {} is {:?}, the CPU twin says {:?} (relative error {err:e} > \
             {tolerance:e}; {inexact} elements differ)",
            got.len(),
            got[i],
            want[i]
        );
        self.max_rel_err = self.max_rel_err.max(err);
        self.cases += 1;
        self.elements += got.len();
        self.inexact += inexact;
    }

    fn report(&self) {
        println!(
            "RESULT kernels {} max_rel_err={:.3e} cases={} inexact={}/{}",
            self.name, self.max_rel_err, self.cases, self.inexact, self.elements
        );
    }
}

// ---- The same call on either device ----

fn run_cast<D: Kernels, S: Float, T: Float>(
    device: &D,
    src: &[S],
    range: Range<usize>,
    dst: &[T],
    dst_offset: usize,
) -> Vec<T> {
    let src_buf = device.upload(src).unwrap();
    let dst_buf = device.upload(dst).unwrap();
    device.cast(device.stream(StreamKind::Compute), &src_buf, range, &dst_buf, dst_offset).unwrap();
    device.download(&dst_buf).unwrap()
}

fn run_scale<D: Kernels, S: Float>(
    device: &D,
    buf: &[S],
    range: Range<usize>,
    alpha: f32,
) -> Vec<S> {
    let buffer = device.upload(buf).unwrap();
    device.scale(device.stream(StreamKind::Compute), &buffer, range, alpha).unwrap();
    device.download(&buffer).unwrap()
}

fn run_accumulate<D: Kernels, S: Float>(
    device: &D,
    src: &[S],
    range: Range<usize>,
    dst: &[f32],
    dst_offset: usize,
    scale: f32,
) -> Vec<f32> {
    let src_buf = device.upload(src).unwrap();
    let dst_buf = device.upload(dst).unwrap();
    let stream = device.stream(StreamKind::Compute);
    device.accumulate(stream, &src_buf, range, &dst_buf, dst_offset, scale).unwrap();
    device.download(&dst_buf).unwrap()
}

fn run_sum_squares<D: Kernels, S: Float>(device: &D, src: &[S], range: Range<usize>) -> Vec<f32> {
    let src_buf = device.upload(src).unwrap();
    let out = device.upload(&poisoned::<f32>(8)).unwrap();
    device.sum_squares(device.stream(StreamKind::Compute), &src_buf, range, &out, 3).unwrap();
    device.download(&out).unwrap()
}

/// The helpers above queue work on the compute stream right after `upload` and read it back with
/// `download`; on the CPU device, whose checker refuses unordered accesses, that must be race
/// free (this runs everywhere, GPU or not).
#[test]
fn twin_helpers_are_race_free_on_the_cpu_device() {
    let cpu = CpuDevice::new().unwrap();
    let src = [1.5f32, -2.0, 3.0];
    let cast = run_cast(&cpu, &src, 1..3, &poisoned::<bf16>(3), 0);
    assert_eq!(cast[..2], [bf16::from_f32(-2.0), bf16::from_f32(3.0)]);
    assert_eq!(run_scale(&cpu, &src, 0..2, 2.0), [3.0, -4.0, 3.0]);
    assert_eq!(run_accumulate(&cpu, &src, 0..1, &[1.0, 1.0], 1, 2.0), [1.0, 4.0]);
    assert_eq!(run_sum_squares(&cpu, &src, 0..3)[3], 15.25);
}

// ---- Casts, scale, accumulate ----

fn check_cast<S: Float, T: Float>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    rng: &mut ChaCha8Rng,
    tally: &mut Tally,
) {
    // From f32, values from 2^-30 to 2^31: f16 overflows and goes subnormal, bf16 rounds.
    let exponents = if S::DTYPE == DType::F32 { -30..31 } else { -12..13 };
    for n in SIZES {
        for (src_offset, dst_offset) in OFFSETS {
            let src: Vec<S> = random_f32(rng, src_offset + n + GUARD, exponents.clone())
                .into_iter()
                .map(S::from_f32)
                .collect();
            let dst = poisoned::<T>(dst_offset + n + GUARD);
            let range = src_offset..src_offset + n;
            let got = run_cast(gpu, &src, range.clone(), &dst, dst_offset);
            let want = run_cast(cpu, &src, range, &dst, dst_offset);
            let case =
                format!("cast {}→{} n={n} offsets {src_offset},{dst_offset}", S::DTYPE, T::DTYPE);
            // Both sides round to nearest even: bit for bit.
            tally.check(&case, &got, &want, 0.0);
        }
    }
}

#[test]
fn casts_match_the_cpu_device_bit_for_bit() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuDevice::new().unwrap();
    let mut rng = rng(1);
    let mut tally = Tally::new("cast");
    check_cast::<f32, f32>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<f32, bf16>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<f32, f16>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<bf16, f32>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<bf16, bf16>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<bf16, f16>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<f16, f32>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<f16, bf16>(&gpu, &cpu, &mut rng, &mut tally);
    check_cast::<f16, f16>(&gpu, &cpu, &mut rng, &mut tally);
    tally.report();
}

fn check_scale<S: Float>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    rng: &mut ChaCha8Rng,
    tally: &mut Tally,
) {
    for n in SIZES {
        for (offset, _) in OFFSETS {
            // Every element random, so that a write outside the range changes a guard.
            let buf = random::<S>(rng, offset + n + GUARD);
            let alpha = rng.random_range(0.5f32..2.0);
            let range = offset..offset + n;
            let got = run_scale(gpu, &buf, range.clone(), alpha);
            let want = run_scale(cpu, &buf, range, alpha);
            let tolerance = if S::DTYPE == DType::F32 { 1e-6 } else { 1e-2 };
            tally.check(
                &format!("scale {} n={n} offset {offset}", S::DTYPE),
                &got,
                &want,
                tolerance,
            );
        }
    }
}

#[test]
fn scale_matches_the_cpu_device() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuDevice::new().unwrap();
    let mut rng = rng(2);
    let mut tally = Tally::new("scale");
    check_scale::<f32>(&gpu, &cpu, &mut rng, &mut tally);
    check_scale::<bf16>(&gpu, &cpu, &mut rng, &mut tally);
    check_scale::<f16>(&gpu, &cpu, &mut rng, &mut tally);
    tally.report();
}

fn check_accumulate<S: Float>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    rng: &mut ChaCha8Rng,
    tally: &mut Tally,
) {
    for n in SIZES {
        for (src_offset, dst_offset) in OFFSETS {
            let src = random::<S>(rng, src_offset + n + GUARD);
            let dst = random::<f32>(rng, dst_offset + n + GUARD);
            let scale = rng.random_range(0.1f32..2.0);
            let range = src_offset..src_offset + n;
            let got = run_accumulate(gpu, &src, range.clone(), &dst, dst_offset, scale);
            let want = run_accumulate(cpu, &src, range, &dst, dst_offset, scale);
            let case = format!("accumulate {} n={n} offsets {src_offset},{dst_offset}", S::DTYPE);
            tally.check(&case, &got, &want, 1e-6);
        }
    }
}

#[test]
fn accumulate_matches_the_cpu_device() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuDevice::new().unwrap();
    let mut rng = rng(3);
    let mut tally = Tally::new("accumulate");
    check_accumulate::<f32>(&gpu, &cpu, &mut rng, &mut tally);
    check_accumulate::<bf16>(&gpu, &cpu, &mut rng, &mut tally);
    check_accumulate::<f16>(&gpu, &cpu, &mut rng, &mut tally);
    tally.report();
}

// ---- Sum of squares ----

fn sum_squares_on_gpu<S: Float>(
    gpu: &CudaDevice,
    src: &[S],
    range: Range<usize>,
    accumulation: Accumulation,
) -> Vec<f32> {
    let src_buf = gpu.upload(src).unwrap();
    let out = gpu.upload(&poisoned::<f32>(8)).unwrap();
    let stream = gpu.stream(StreamKind::Compute);
    gpu.sum_squares_with(stream, &src_buf, range, &out, 3, accumulation).unwrap();
    gpu.download(&out).unwrap()
}

fn check_sum_squares<S: Float>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    rng: &mut ChaCha8Rng,
    tallies: &mut [Tally; 2],
) {
    let large = env_usize("ZEROFLOW_SUM_SQUARES_LARGE", 100_000_007);
    for n in SIZES.into_iter().chain([large]) {
        let offsets: &[usize] = if n == large { &[1] } else { &[0, 1, 3] };
        for &offset in offsets {
            // Magnitudes 2^-4..2^4: the sum stays far from overflow.
            let src: Vec<S> =
                random_f32(rng, offset + n + GUARD, -4..4).into_iter().map(S::from_f32).collect();
            let range = offset..offset + n;
            let want = run_sum_squares(cpu, &src, range.clone());
            let got = sum_squares_on_gpu(gpu, &src, range.clone(), Accumulation::F64);
            let case = format!("sum_squares (f64) {} n={n} offset {offset}", S::DTYPE);
            tallies[0].check(&case, &got, &want, 1e-6);
            // Through the trait as well (the same kernel, so the same bits).
            let bits = |sums: &[f32]| sums.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let through_trait = run_sum_squares(gpu, &src, range.clone());
            assert_eq!(bits(&through_trait), bits(&got), "{case}: through Kernels");
            // f32 within threads: about n / (threads) additions each, so a looser bound.
            let got = sum_squares_on_gpu(gpu, &src, range, Accumulation::F32);
            let case = format!("sum_squares (f32) {} n={n} offset {offset}", S::DTYPE);
            tallies[1].check(&case, &got, &want, 1e-4);
        }
    }
}

#[test]
fn sum_squares_matches_the_cpu_device_up_to_1e8_elements() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuDevice::new().unwrap();
    let mut rng = rng(4);
    let mut tallies = [Tally::new("sum_squares_f64"), Tally::new("sum_squares_f32")];
    let started = Instant::now();
    check_sum_squares::<f32>(&gpu, &cpu, &mut rng, &mut tallies);
    check_sum_squares::<bf16>(&gpu, &cpu, &mut rng, &mut tallies);
    check_sum_squares::<f16>(&gpu, &cpu, &mut rng, &mut tallies);
    println!("sum_squares: {:.1} s", started.elapsed().as_secs_f64());
    tallies.iter().for_each(Tally::report);
}

#[test]
fn sum_squares_is_non_finite_for_inf_nan_and_overflow() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng(5);
    let accumulations = [Accumulation::F64, Accumulation::F32];
    for n in SIZES {
        let range = 2..2 + n;
        for (what, value) in
            [("inf", f32::INFINITY), ("-inf", f32::NEG_INFINITY), ("nan", f32::NAN)]
        {
            let mut src = random::<f32>(&mut rng, n + 2 + GUARD);
            let at = rng.random_range(range.clone());
            src[at] = value;
            let src16: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
            let srch: Vec<f16> = src.iter().map(|&x| f16::from_f32(x)).collect();
            for accumulation in accumulations {
                let sums = [
                    sum_squares_on_gpu(&gpu, &src, range.clone(), accumulation)[3],
                    sum_squares_on_gpu(&gpu, &src16, range.clone(), accumulation)[3],
                    sum_squares_on_gpu(&gpu, &srch, range.clone(), accumulation)[3],
                ];
                for (sum, dtype) in sums.into_iter().zip(["f32", "bf16", "f16"]) {
                    assert!(
                        !sum.is_finite() && (value.is_finite() || sum.is_nan() == value.is_nan()),
                        "{what} at {at} of {n} {dtype} elements ({accumulation:?}): sum {sum}"
                    );
                }
            }
        }
        // Finite elements whose squares add up beyond f32's range (1e20² = 1e40).
        let src: Vec<f32> =
            (0..n + 2 + GUARD).map(|i| if i % 2 == 0 { 1e20 } else { -3e19 }).collect();
        let src16: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
        for accumulation in accumulations {
            let sum = sum_squares_on_gpu(&gpu, &src, range.clone(), accumulation)[3];
            assert_eq!(sum, f32::INFINITY, "f32 overflow, {n} elements, {accumulation:?}");
            let sum = sum_squares_on_gpu(&gpu, &src16, range.clone(), accumulation)[3];
            assert_eq!(sum, f32::INFINITY, "bf16 overflow, {n} elements, {accumulation:?}");
        }
    }
    println!(
        "RESULT kernels sum_squares_nonfinite max_rel_err=0 (inf, nan and overflow give inf/nan)"
    );
}

// ---- Non-finite count ----

fn check_nonfinite<S: Float>(gpu: &CudaDevice, rng: &mut ChaCha8Rng) -> usize {
    let mut cases = 0;
    for n in SIZES {
        for (offset, _) in OFFSETS {
            let len = offset + n + GUARD;
            let mut src = random::<S>(rng, len);
            let range = offset..offset + n;
            // Distinct positions inside the range, and non-finite guards that must not count.
            let mut positions: Vec<usize> = range.clone().collect();
            positions.shuffle(rng);
            let injected = rng.random_range(0..=5usize).min(n);
            let bad = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN];
            for &at in &positions[..injected] {
                src[at] = S::from_f32(bad[rng.random_range(0..3)]);
            }
            src[offset + n] = S::from_f32(f32::NAN);
            if offset > 0 {
                src[offset - 1] = S::from_f32(f32::INFINITY);
            }
            let src_buf = gpu.upload(&src).unwrap();
            let out = gpu.upload(&[0xdead_beef_u32; 4]).unwrap();
            gpu.nonfinite(gpu.stream(StreamKind::Compute), &src_buf, range, &out, 1).unwrap();
            let counts = gpu.download(&out).unwrap();
            assert_eq!(
                counts,
                [0xdead_beef, injected as u32, 0xdead_beef, 0xdead_beef],
                "nonfinite {}: {injected} injected into {n} elements at offset {offset}",
                S::DTYPE
            );
            cases += 1;
        }
    }
    cases
}

#[test]
fn nonfinite_counts_injected_inf_and_nan_exactly() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng(6);
    let cases = check_nonfinite::<f32>(&gpu, &mut rng)
        + check_nonfinite::<bf16>(&gpu, &mut rng)
        + check_nonfinite::<f16>(&gpu, &mut rng);
    println!("RESULT kernels nonfinite max_rel_err=0 cases={cases} (counts exact)");
}

// ---- AdamW ----

/// Three AdamW steps over `state[offset..offset + n]` on the GPU and with `CpuAdam`.
fn check_adamw<P: Float>(
    gpu: &CudaDevice,
    adam: &CpuAdam,
    rng: &mut ChaCha8Rng,
    tallies: &mut [Tally; 2],
) {
    let configs = [
        AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() },
        AdamWConfig {
            lr: 3e-4,
            weight_decay: 0.1,
            mode: WeightDecayMode::L2,
            ..Default::default()
        },
        AdamWConfig { lr: 1e-2, bias_correction: false, weight_decay: 0.0, ..Default::default() },
    ];
    for (case_index, (n, (offset, out_offset))) in
        SIZES.into_iter().flat_map(|n| OFFSETS.map(|o| (n, o))).enumerate()
    {
        let config = configs[case_index % configs.len()];
        let len = offset + n + GUARD;
        let mut master = random::<f32>(rng, len);
        let mut exp_avg: Vec<f32> = random_f32(rng, len, -16..-4);
        let mut exp_avg_sq: Vec<f32> =
            random_f32(rng, len, -30..-10).into_iter().map(f32::abs).collect();
        let buffers = [&master, &exp_avg, &exp_avg_sq].map(|v| gpu.upload(v).unwrap());
        let out = gpu.upload(&poisoned::<P>(out_offset + n + GUARD)).unwrap();
        let mut optimizer = AdamW::new(config).unwrap();
        let range = offset..offset + n;
        for _ in 0..3 {
            let grads = random_f32(rng, len, -10..0);
            let step = optimizer.next_step(rng.random_range(0.25f32..1.0));
            let grads_buf = gpu.upload(&grads).unwrap();
            let gpu_buffers = AdamWBuffers {
                master: &buffers[0],
                exp_avg: &buffers[1],
                exp_avg_sq: &buffers[2],
                grads: &grads_buf,
            };
            let (stream, scalars) = (gpu.stream(StreamKind::Compute), step.scalars());
            gpu.adamw_step(stream, &scalars, gpu_buffers, range.clone(), &out, out_offset).unwrap();
            let state = AdamState {
                params: &mut master[range.clone()],
                exp_avg: &mut exp_avg[range.clone()],
                exp_avg_sq: &mut exp_avg_sq[range.clone()],
            };
            adam.step(&step, state, Grads::F32(&grads[range.clone()]), Output::MasterOnly).unwrap();
        }
        let mut want_out = poisoned::<P>(out_offset + n + GUARD);
        for (o, m) in want_out[out_offset..].iter_mut().zip(&master[range.clone()]) {
            *o = P::from_f32(*m);
        }
        let case = format!(
            "adamw {} ({:?}, bias correction {}) n={n} offsets {offset},{out_offset}",
            P::DTYPE,
            config.mode,
            config.bias_correction
        );
        let [got_master, got_m, got_v] = [0, 1, 2].map(|i| gpu.download(&buffers[i]).unwrap());
        tallies[0].check(&format!("{case}: master"), &got_master, &master, 1e-6);
        tallies[0].check(&format!("{case}: exp_avg"), &got_m, &exp_avg, 1e-6);
        tallies[0].check(&format!("{case}: exp_avg_sq"), &got_v, &exp_avg_sq, 1e-6);
        let tolerance = if P::DTYPE == DType::F32 { 1e-6 } else { 1e-2 };
        tallies[1].check(
            &format!("{case}: output"),
            &gpu.download(&out).unwrap(),
            &want_out,
            tolerance,
        );
    }
}

#[test]
fn adamw_matches_cpu_adam() {
    let Some(gpu) = gpu() else { return };
    let level = SimdLevel::detect();
    // The AVX2 and AVX-512 kernels fuse exactly as the GPU does; the portable one does not.
    println!("adamw: CPU reference at SIMD level {level:?}");
    let adam = CpuAdam::new(1, level).unwrap();
    let mut rng = rng(7);
    let mut tallies = [Tally::new("adamw_state"), Tally::new("adamw_output")];
    check_adamw::<f32>(&gpu, &adam, &mut rng, &mut tallies);
    check_adamw::<bf16>(&gpu, &adam, &mut rng, &mut tallies);
    check_adamw::<f16>(&gpu, &adam, &mut rng, &mut tallies);
    tallies.iter().for_each(Tally::report);
}

// ---- Column gather and scatter ----

/// (rows, cols, selected columns): a single element, a few rows, more than a block of columns,
/// and more rows than a grid's y dimension holds (65 535).
const SHAPES: [(usize, usize, usize); 4] =
    [(1, 1, 1), (37, 1000, 100), (1001, 1003, 333), (70_001, 64, 5)];

fn check_columns<T: Float>(gpu: &CudaDevice, rng: &mut ChaCha8Rng, tally: &mut Tally) {
    let stream = gpu.stream(StreamKind::Compute);
    for (rows, cols, k) in SHAPES {
        let mut columns: Vec<u32> = (0..cols as u32).collect();
        columns.shuffle(rng);
        // The index list sits at offset 2 of its buffer.
        let index: Vec<u32> = [7, 7].into_iter().chain(columns[..k].iter().copied()).collect();
        let index_buf = gpu.upload(&index).unwrap();
        let selected = &index[2..];
        let (full_offset, part_offset) = (3, 5);
        let full = random::<T>(rng, full_offset + rows * cols + GUARD);
        let full_buf = gpu.upload(&full).unwrap();

        // Gather into a poisoned [rows, k].
        let part_buf = gpu.upload(&poisoned::<T>(part_offset + rows * k + GUARD)).unwrap();
        let src = RowMajor { buffer: &full_buf, offset: full_offset, rows, cols };
        let dst = RowMajor { buffer: &part_buf, offset: part_offset, rows, cols: k };
        gpu.gather_columns(stream, src, &index_buf, 2..2 + k, dst).unwrap();
        let mut want = poisoned::<T>(part_offset + rows * k + GUARD);
        for r in 0..rows {
            for (j, &c) in selected.iter().enumerate() {
                want[part_offset + r * k + j] = full[full_offset + r * cols + c as usize];
            }
        }
        let case = format!("gather_columns {} [{rows}, {cols}] k={k}", T::DTYPE);
        tally.check(&case, &gpu.download(&part_buf).unwrap(), &want, 0.0);

        // Scatter fresh values back into the full matrix.
        let part = random::<T>(rng, part_offset + rows * k + GUARD);
        let part_buf = gpu.upload(&part).unwrap();
        let full_buf = gpu.upload(&full).unwrap();
        let src = RowMajor { buffer: &part_buf, offset: part_offset, rows, cols: k };
        let dst = RowMajor { buffer: &full_buf, offset: full_offset, rows, cols };
        gpu.scatter_columns(stream, src, &index_buf, 2..2 + k, dst).unwrap();
        let mut want = full.clone();
        for r in 0..rows {
            for (j, &c) in selected.iter().enumerate() {
                want[full_offset + r * cols + c as usize] = part[part_offset + r * k + j];
            }
        }
        let case = format!("scatter_columns {} [{rows}, {cols}] k={k}", T::DTYPE);
        tally.check(&case, &gpu.download(&full_buf).unwrap(), &want, 0.0);
    }

    // An index beyond the columns: NaN when gathering, skipped when scattering.
    let (rows, cols) = (4, 10);
    let index_buf = gpu.upload(&[3u32, 10, 0]).unwrap();
    let full = random::<T>(rng, rows * cols);
    let full_buf = gpu.upload(&full).unwrap();
    let part_buf = gpu.alloc::<T>(rows * 3).unwrap();
    let src = RowMajor { buffer: &full_buf, offset: 0, rows, cols };
    let dst = RowMajor { buffer: &part_buf, offset: 0, rows, cols: 3 };
    gpu.gather_columns(stream, src, &index_buf, 0..3, dst).unwrap();
    let part = gpu.download(&part_buf).unwrap();
    for r in 0..rows {
        assert!(part[r * 3 + 1].to_f32().is_nan(), "gather with index 10 of 10 columns, row {r}");
        assert_eq!(part[r * 3], full[r * cols + 3]);
    }
    let src = RowMajor { buffer: &part_buf, offset: 0, rows, cols: 3 };
    let dst = RowMajor { buffer: &full_buf, offset: 0, rows, cols };
    gpu.scatter_columns(stream, src, &index_buf, 0..3, dst).unwrap();
    let scattered = gpu.download(&full_buf).unwrap();
    assert!(scattered.iter().all(|x| !x.to_f32().is_nan()), "scatter wrote an out-of-range column");
}

#[test]
fn column_gather_and_scatter_match_a_loop() {
    let Some(gpu) = gpu() else { return };
    let mut rng = rng(8);
    let mut tally = Tally::new("gather_scatter_columns");
    check_columns::<f32>(&gpu, &mut rng, &mut tally);
    check_columns::<bf16>(&gpu, &mut rng, &mut tally);
    check_columns::<f16>(&gpu, &mut rng, &mut tally);
    tally.report();
}

// ---- Column sums of absolute values ----

/// (rows, cols) of `column_abs_sums`: one element; fewer rows than the kernel's 8 row groups and
/// one column past a stripe of 32; a ragged last stripe; a tall matrix (a vocabulary's rows).
const ABS_SUM_SHAPES: [(usize, usize); 4] = [(1, 1), (7, 33), (1000, 37), (50_257, 64)];

/// `out` after `column_abs_sums` of the `[rows, cols]` matrix at `src[offset..]` into
/// `out[out_offset..]`, through the `Kernels` trait.
fn run_column_abs_sums<D: Kernels, S: Float>(
    device: &D,
    src: &[S],
    (offset, rows, cols): (usize, usize, usize),
    out: &[f32],
    out_offset: usize,
) -> Vec<f32> {
    let src_buf = device.upload(src).unwrap();
    let out_buf = device.upload(out).unwrap();
    let matrix = zeroflow_device::Matrix { buffer: &src_buf, offset, rows, cols };
    device
        .column_abs_sums(device.stream(StreamKind::Compute), matrix, &out_buf, out_offset)
        .unwrap();
    device.download(&out_buf).unwrap()
}

/// `n` random multiples of 2^-8 in [-1, 1]: every partial sum of up to 2^16 of their magnitudes
/// is exact in f32 (and every value in bf16 and f16), so any summation order gives the same bits.
fn random_exact<S: Float>(rng: &mut ChaCha8Rng, n: usize) -> Vec<S> {
    (0..n).map(|_| S::from_f32(rng.random_range(-256i32..=256) as f32 / 256.0)).collect()
}

fn check_column_abs_sums<S: Float>(
    gpu: &CudaDevice,
    cpu: &CpuDevice,
    rng: &mut ChaCha8Rng,
    tallies: &mut [Tally; 2],
) {
    let (offset, out_offset) = (3, 5);
    for (rows, cols) in ABS_SUM_SHAPES {
        let shape = (offset, rows, cols);
        // Every element of `out` random and finite: the sums are added to what it holds, and a
        // write outside `out_offset..out_offset + cols` changes a guard.
        let out = random::<f32>(rng, out_offset + cols + GUARD);
        // Exactly summable values: the GPU's order must give the CPU's bits.
        let src = random_exact::<S>(rng, offset + rows * cols + GUARD);
        let got = run_column_abs_sums(gpu, &src, shape, &out, out_offset);
        let want = run_column_abs_sums(cpu, &src, shape, &out, out_offset);
        let case = format!("column_abs_sums {} [{rows}, {cols}] exact sums", S::DTYPE);
        tallies[0].check(&case, &got, &want, 0.0);

        // Values over 25 binades: the GPU adds 8 row groups and then their sums, the CPU the rows
        // in order. The CPU's sequential f32 sum of positive terms drifts by about rows × 1e-9
        // relative (4.7e-5 seen on an H200 at 50 257 rows), so 1e-5 holds to 1000 rows and
        // the bound grows with the rows beyond.
        let src = random::<S>(rng, offset + rows * cols + GUARD);
        let got = run_column_abs_sums(gpu, &src, shape, &out, out_offset);
        let want = run_column_abs_sums(cpu, &src, shape, &out, out_offset);
        let case = format!("column_abs_sums {} [{rows}, {cols}]", S::DTYPE);
        let tolerance = 1e-5 * (rows as f64 / 1000.0).max(1.0);
        tallies[1].check(&case, &got, &want, tolerance);

        // Deterministic: a second run gives the same bits.
        let again = run_column_abs_sums(gpu, &src, shape, &out, out_offset);
        let bits = |sums: &[f32]| sums.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&again), bits(&got), "{case}: a second run differs");
    }

    // A NaN and an infinity make exactly their own columns non-finite.
    let (rows, cols) = (1000, 37);
    let mut src = random::<S>(rng, offset + rows * cols);
    src[offset + 500 * cols + 4] = S::from_f32(f32::NAN);
    src[offset + 999 * cols + 36] = S::from_f32(f32::NEG_INFINITY);
    let out = random::<f32>(rng, out_offset + cols + GUARD);
    let got = run_column_abs_sums(gpu, &src, (offset, rows, cols), &out, out_offset);
    for (c, sum) in got[out_offset..out_offset + cols].iter().enumerate() {
        match c {
            4 => assert!(sum.is_nan(), "{} column 4 with a NaN: {sum}", S::DTYPE),
            36 => assert_eq!(*sum, f32::INFINITY, "{} column 36 with -inf", S::DTYPE),
            _ => assert!(sum.is_finite(), "{} column {c}: {sum}", S::DTYPE),
        }
    }
}

#[test]
fn column_abs_sums_match_the_cpu_device_and_are_deterministic() {
    let Some(gpu) = gpu() else { return };
    let cpu = CpuDevice::new().unwrap();
    let mut rng = rng(9);
    let mut tallies = [Tally::new("column_abs_sums_exact"), Tally::new("column_abs_sums")];
    check_column_abs_sums::<f32>(&gpu, &cpu, &mut rng, &mut tallies);
    check_column_abs_sums::<bf16>(&gpu, &cpu, &mut rng, &mut tallies);
    check_column_abs_sums::<f16>(&gpu, &cpu, &mut rng, &mut tallies);

    // Refused like on the CPU device: `out` too short, the matrix beyond its buffer, and `out`
    // overlapping the matrix.
    let stream = gpu.stream(StreamKind::Compute);
    let a = gpu.upload(&[1.0f32; 64]).unwrap();
    let out = gpu.upload(&[2.0f32; 8]).unwrap();
    let matrix = RowMajor { buffer: &a, offset: 0, rows: 8, cols: 8 };
    let err = gpu.column_abs_sums(stream, matrix, &out, 1).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let beyond = RowMajor { buffer: &a, offset: 1, rows: 8, cols: 8 };
    let err = gpu.column_abs_sums(stream, beyond, &out, 0).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let huge = RowMajor { buffer: &a, offset: 0, rows: usize::MAX, cols: 2 };
    let err = gpu.column_abs_sums(stream, huge, &out, 0).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let part = RowMajor { buffer: &a, offset: 0, rows: 4, cols: 8 };
    let err = gpu.column_abs_sums(stream, part, &a, 16).unwrap_err();
    assert!(matches!(err, DeviceError::AliasedArguments { .. }), "{err}");
    gpu.synchronize().unwrap();
    assert_eq!(gpu.download(&out).unwrap(), [2.0f32; 8], "a refused call changed memory");
    tallies.iter().for_each(Tally::report);
}

// ---- Refusals ----

#[test]
fn kernels_refuse_bad_ranges_and_aliasing_before_queueing() {
    let Some(gpu) = gpu() else { return };
    let stream = gpu.stream(StreamKind::Compute);
    let a = gpu.upload(&[1.0f32; 64]).unwrap();
    let b = gpu.alloc::<bf16>(64).unwrap();
    let out = gpu.alloc::<f32>(4).unwrap();
    let err = gpu.cast(stream, &a, 10..70, &b, 0).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let err = gpu.cast(stream, &a, 0..10, &b, 60).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let err = gpu.cast(stream, &a, 0..10, &b, usize::MAX).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let err = gpu.accumulate(stream, &a, 0..16, &a, 8, 1.0).unwrap_err();
    assert!(matches!(err, DeviceError::AliasedArguments { .. }), "{err}");
    let err = gpu.sum_squares(stream, &a, 0..64, &out, 4).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    let err = gpu.sum_squares(stream, &a, 0..64, &a, 3).unwrap_err();
    assert!(matches!(err, DeviceError::AliasedArguments { .. }), "{err}");
    let scalars = AdamW::new(AdamWConfig::default()).unwrap().next_step(1.0).scalars();
    let buffers = AdamWBuffers { master: &a, exp_avg: &out, exp_avg_sq: &out, grads: &out };
    let err = gpu.adamw_step(stream, &scalars, buffers, 0..4, &b, 0).unwrap_err();
    assert!(matches!(err, DeviceError::AliasedArguments { .. }), "{err}");
    let index = gpu.upload(&[0u32, 1]).unwrap();
    let src = RowMajor { buffer: &a, offset: 0, rows: 8, cols: 8 };
    let dst = RowMajor { buffer: &out, offset: 0, rows: 2, cols: 2 };
    let err = gpu.gather_columns(stream, src, &index, 0..2, dst).unwrap_err();
    assert!(matches!(err, DeviceError::LengthMismatch { .. }), "{err}");
    let src = RowMajor { buffer: &a, offset: 0, rows: 9, cols: 8 };
    let err = gpu.gather_columns(stream, src, &index, 0..2, dst).unwrap_err();
    assert!(matches!(err, DeviceError::OutOfBounds { .. }), "{err}");
    gpu.synchronize().unwrap();
    assert_eq!(gpu.download(&a).unwrap(), [1.0f32; 64], "a refused call changed memory");
    println!("RESULT kernels refusals max_rel_err=0 (bounds, aliasing, shapes)");
}

// ---- Bandwidth ----

/// Seconds of the best of `repeats` runs of `run` (after one warm-up), each ended by a device
/// synchronisation.
fn best_seconds(gpu: &CudaDevice, repeats: usize, mut run: impl FnMut()) -> f64 {
    run();
    gpu.synchronize().unwrap();
    (0..repeats)
        .map(|_| {
            let started = Instant::now();
            run();
            gpu.synchronize().unwrap();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

#[test]
#[ignore = "a measurement: run with --ignored on a GPU machine"]
fn kernel_bandwidth_on_1e9_elements() {
    let Some(gpu) = gpu() else { return };
    let n = env_usize("ZEROFLOW_KERNEL_BENCH_ELEMENTS", 1_000_000_000);
    let repeats = env_usize("ZEROFLOW_BANDWIDTH_REPEATS", 5);
    let stream = gpu.stream(StreamKind::Compute);
    let [a, b, c, d] = [0.5f32, 0.25, 0.125, 1.0].map(|value| {
        let buffer = gpu.alloc::<f32>(n).unwrap();
        gpu.fill(stream, &buffer, 0..n, value).unwrap();
        buffer
    });
    let half = gpu.alloc::<bf16>(n).unwrap();
    let out = gpu.alloc::<f32>(1).unwrap();
    let flags = gpu.alloc::<u32>(1).unwrap();
    let scalars = AdamW::new(AdamWConfig::default()).unwrap().next_step(1.0).scalars();
    let copy = best_seconds(&gpu, repeats, || gpu.copy_d2d(stream, &a, 0..n, &b, 0).unwrap());
    let copy_gbps = 8.0 * n as f64 / copy / 1e9;
    println!("RESULT kernels_gbps copy_d2d_f32 gbps={copy_gbps:.0}");
    let measure = |name: &str, bytes_per_element: f64, run: &mut dyn FnMut()| {
        let seconds = best_seconds(&gpu, repeats, run);
        let gbps = bytes_per_element * n as f64 / seconds / 1e9;
        println!(
            "RESULT kernels_gbps {name} gbps={gbps:.0} of_copy={:.0}% ms={:.2}",
            100.0 * gbps / copy_gbps,
            seconds * 1e3
        );
    };
    measure("cast_f32_bf16", 6.0, &mut || gpu.cast(stream, &a, 0..n, &half, 0).unwrap());
    measure("cast_bf16_f32", 6.0, &mut || gpu.cast(stream, &half, 0..n, &b, 0).unwrap());
    measure("accumulate_bf16", 10.0, &mut || {
        gpu.accumulate(stream, &half, 0..n, &b, 0, 0.5).unwrap()
    });
    measure("accumulate_f32", 12.0, &mut || gpu.accumulate(stream, &a, 0..n, &b, 0, 0.5).unwrap());
    measure("scale_f32", 8.0, &mut || gpu.scale(stream, &b, 0..n, 1.0).unwrap());
    measure("sum_squares_f32", 4.0, &mut || gpu.sum_squares(stream, &a, 0..n, &out, 0).unwrap());
    measure("nonfinite_f32", 4.0, &mut || gpu.nonfinite(stream, &a, 0..n, &flags, 0).unwrap());
    measure("adamw_bf16", 30.0, &mut || {
        let buffers = AdamWBuffers { master: &a, exp_avg: &b, exp_avg_sq: &c, grads: &d };
        gpu.adamw_step(stream, &scalars, buffers, 0..n, &half, 0).unwrap();
    });
    // Unaligned: one element at a time (f32 at +4 bytes, bf16 at +4 bytes never line up).
    measure("cast_f32_bf16_unaligned", 6.0, &mut || {
        gpu.cast(stream, &a, 1..n - 1, &half, 2).unwrap();
    });
}
