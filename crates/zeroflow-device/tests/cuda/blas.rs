//! cuBLASLt matmuls against a CPU reference in f64, on random inputs at odd sizes: every
//! transpose, every epilogue the GPT model uses, strided batches, accumulation, and the checks
//! that refuse bad operands. Outputs are poisoned with NaN before each run, so an element the GPU
//! does not write fails the comparison. Each case prints `RESULT blas <case> rel_err=...` (the
//! norm of the error over the norm of the reference).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::DType;
use zeroflow_core::dtype::bf16;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::cuda::blas::{
    Blas, BlasType, Epilogue, Matmul, MatmulOperands, Operand, bench_gemm,
};
use zeroflow_device::{CudaDevice, Device, DeviceError, StreamKind};

use crate::gpu;

/// A device buffer of either element type, with the values it holds as f64.
enum Buf {
    Bf16(CudaBuffer<bf16>),
    F32(CudaBuffer<f32>),
}

impl Buf {
    fn upload(device: &CudaDevice, values: &[f64], ty: BlasType) -> Buf {
        match ty {
            BlasType::Bf16 => {
                let v: Vec<bf16> = values.iter().map(|&x| bf16::from_f64(x)).collect();
                Buf::Bf16(device.upload(&v).unwrap())
            }
            BlasType::F32 => {
                let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
                Buf::F32(device.upload(&v).unwrap())
            }
        }
    }

    fn operand(&self, index: usize) -> Operand<'_> {
        match self {
            Buf::Bf16(b) => Operand::of(b, index),
            Buf::F32(b) => Operand::of(b, index),
        }
    }

    fn download(&self, device: &CudaDevice) -> Vec<f64> {
        match self {
            Buf::Bf16(b) => device.download(b).unwrap().iter().map(|x| x.to_f64()).collect(),
            Buf::F32(b) => device.download(b).unwrap().iter().map(|&x| f64::from(x)).collect(),
        }
    }
}

/// `len` values uniform in [-scale, scale), rounded to `ty` so that the reference sees exactly
/// what the GPU sees. Never zeros.
fn random(len: usize, scale: f64, ty: BlasType, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len)
        .map(|_| {
            let x = rng.random_range(-scale..scale);
            match ty {
                BlasType::Bf16 => bf16::from_f64(x).to_f64(),
                BlasType::F32 => f64::from(x as f32),
            }
        })
        .collect()
}

/// Elements spanned by a column-major `rows × cols` matrix with leading dimension `ld`, `batch`
/// of them `stride` apart.
fn span(rows: usize, cols: usize, ld: usize, batch: usize, stride: i64) -> usize {
    (batch - 1) * stride as usize + (cols - 1) * ld + rows
}

fn a_span(p: &Matmul) -> usize {
    let (rows, cols) = if p.trans_a { (p.k, p.m) } else { (p.m, p.k) };
    span(rows, cols, p.lda, p.batch, p.stride_a)
}

fn b_span(p: &Matmul) -> usize {
    let (rows, cols) = if p.trans_b { (p.n, p.k) } else { (p.k, p.n) };
    span(rows, cols, p.ldb, p.batch, p.stride_b)
}

fn c_span(p: &Matmul) -> usize {
    span(p.m, p.n, p.ldc, p.batch, p.stride_c)
}

/// GPT-2's GELU (tanh approximation) and its derivative.
fn gelu(x: f64) -> f64 {
    let s = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (s * (x + 0.044715 * x * x * x)).tanh())
}

fn gelu_grad(x: f64) -> f64 {
    let s = (2.0 / std::f64::consts::PI).sqrt();
    let t = (s * (x + 0.044715 * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x)
}

/// The inputs of one case. `d` is also C (in place): its initial contents matter when beta ≠ 0,
/// and are NaN otherwise (cuBLASLt must not read C when beta = 0).
struct Inputs {
    a: Vec<f64>,
    b: Vec<f64>,
    d: Vec<f64>,
    bias: Option<Vec<f64>>,
    aux: Option<Vec<f64>>,
}

/// What a case produces: D, and the bias or aux where the epilogue writes them.
#[derive(Debug)]
struct Outputs {
    d: Vec<f64>,
    bias: Option<Vec<f64>>,
    aux: Option<Vec<f64>>,
}

impl Inputs {
    /// Random inputs for `p` (inputs in [-1, 1), GELU inputs in [-3, 3)), seeded by `seed`.
    fn random(p: &Matmul, seed: u64) -> Inputs {
        let e = p.epilogue;
        let d = if p.beta == 0.0 {
            vec![f64::NAN; c_span(p)]
        } else {
            random(c_span(p), 1.0, p.c_type, seed + 2)
        };
        let bias_read = matches!(e, Epilogue::Bias | Epilogue::BiasGelu);
        let bias = if bias_read {
            Some(random(e.bias_len(p.m, p.n), 1.0, p.c_type, seed + 3))
        } else if e.uses_bias() {
            Some(vec![f64::NAN; e.bias_len(p.m, p.n)])
        } else {
            None
        };
        let aux_len = span(p.m, p.n, p.aux_ld, 1, 0);
        let aux = match e {
            Epilogue::DGelu | Epilogue::DGeluBGrad => {
                Some(random(aux_len, 3.0, p.c_type, seed + 4))
            }
            Epilogue::BiasGelu => Some(vec![f64::NAN; aux_len]),
            _ => None,
        };
        Inputs {
            a: random(a_span(p), 1.0, p.ab_type, seed),
            b: random(b_span(p), 1.0, p.ab_type, seed + 1),
            d,
            bias,
            aux,
        }
    }
}

/// op(A)[i, l] of batch `batch`.
fn op_a(p: &Matmul, a: &[f64], batch: usize, i: usize, l: usize) -> f64 {
    let base = batch * p.stride_a as usize;
    if p.trans_a { a[base + l + i * p.lda] } else { a[base + i + l * p.lda] }
}

/// op(B)[l, j] of batch `batch`.
fn op_b(p: &Matmul, b: &[f64], batch: usize, l: usize, j: usize) -> f64 {
    let base = batch * p.stride_b as usize;
    if p.trans_b { b[base + j + l * p.ldb] } else { b[base + l + j * p.ldb] }
}

/// The CPU reference, in f64, of everything the epilogue writes.
fn reference(p: &Matmul, x: &Inputs) -> Outputs {
    let mut d = x.d.clone();
    let mut aux = x.aux.clone();
    let mut bias_grad = vec![0.0; p.epilogue.bias_len(p.m, p.n)];
    for batch in 0..p.batch {
        for j in 0..p.n {
            for i in 0..p.m {
                let index = batch * p.stride_c as usize + i + j * p.ldc;
                let dot: f64 =
                    (0..p.k).map(|l| op_a(p, &x.a, batch, i, l) * op_b(p, &x.b, batch, l, j)).sum();
                let mut v = f64::from(p.alpha) * dot;
                if p.beta != 0.0 {
                    v += f64::from(p.beta) * x.d[index];
                }
                let bias = || x.bias.as_ref().unwrap()[i];
                let aux_index = i + j * p.aux_ld;
                d[index] = match p.epilogue {
                    Epilogue::None | Epilogue::BGradA | Epilogue::BGradB => v,
                    Epilogue::Bias => v + bias(),
                    Epilogue::Gelu => gelu(v),
                    Epilogue::BiasGelu => {
                        let pre = v + bias();
                        aux.as_mut().unwrap()[aux_index] = pre;
                        gelu(pre)
                    }
                    Epilogue::DGelu | Epilogue::DGeluBGrad => {
                        v * gelu_grad(x.aux.as_ref().unwrap()[aux_index])
                    }
                };
            }
        }
    }
    if p.epilogue == Epilogue::DGeluBGrad {
        for (i, g) in bias_grad.iter_mut().enumerate() {
            *g = (0..p.n).map(|j| d[i + j * p.ldc]).sum();
        }
    }
    if p.epilogue == Epilogue::BGradA {
        for (i, g) in bias_grad.iter_mut().enumerate() {
            *g = (0..p.k).map(|l| op_a(p, &x.a, 0, i, l)).sum();
        }
    }
    if p.epilogue == Epilogue::BGradB {
        for (j, g) in bias_grad.iter_mut().enumerate() {
            *g = (0..p.k).map(|l| op_b(p, &x.b, 0, l, j)).sum();
        }
    }
    Outputs {
        d,
        bias: writes_bias(p.epilogue).then_some(bias_grad),
        aux: if p.epilogue == Epilogue::BiasGelu { aux } else { None },
    }
}

/// Runs `p` on the GPU with `x` as its inputs (outputs poisoned with NaN, as `Inputs` makes
/// them) and downloads what the epilogue writes.
fn on_gpu(device: &CudaDevice, blas: &Blas, p: &Matmul, x: &Inputs) -> Outputs {
    let a = Buf::upload(device, &x.a, p.ab_type);
    let b = Buf::upload(device, &x.b, p.ab_type);
    let d = Buf::upload(device, &x.d, p.c_type);
    let bias = x.bias.as_ref().map(|v| Buf::upload(device, v, p.c_type));
    let aux = x.aux.as_ref().map(|v| Buf::upload(device, v, p.c_type));
    let mut operands = MatmulOperands::new(a.operand(0), b.operand(0), d.operand(0));
    if let Some(bias) = &bias {
        operands = operands.with_bias(bias.operand(0));
    }
    if let Some(aux) = &aux {
        operands = operands.with_aux(aux.operand(0));
    }
    let stream = device.stream(StreamKind::Compute);
    blas.matmul(stream, p, operands).unwrap_or_else(|e| panic!("matmul {p:?}: {e}"));
    device.synchronize().unwrap();
    Outputs {
        d: d.download(device),
        bias: bias.filter(|_| writes_bias(p.epilogue)).map(|b| b.download(device)),
        aux: aux.filter(|_| p.epilogue == Epilogue::BiasGelu).map(|a| a.download(device)),
    }
}

/// Whether the epilogue writes a bias gradient into the bias operand.
fn writes_bias(epilogue: Epilogue) -> bool {
    matches!(epilogue, Epilogue::DGeluBGrad | Epilogue::BGradA | Epilogue::BGradB)
}

/// ‖got − want‖ / ‖want‖ over the elements of the matrices (not the padding between columns).
fn rel_err(got: &[f64], want: &[f64], positions: &[usize]) -> f64 {
    let (mut err, mut norm) = (0.0, 0.0);
    for &i in positions {
        let e = got[i] - want[i];
        err += if e.is_nan() { f64::INFINITY } else { e * e };
        norm += want[i] * want[i];
    }
    (err / norm).sqrt()
}

/// The positions of an m×n matrix with leading dimension `ld`, `batch` of them `stride` apart.
fn positions(m: usize, n: usize, ld: usize, batch: usize, stride: i64) -> Vec<usize> {
    let mut out = Vec::with_capacity(m * n * batch);
    for b in 0..batch {
        for j in 0..n {
            out.extend((0..m).map(|i| b * stride as usize + i + j * ld));
        }
    }
    out
}

fn tolerance(ty: BlasType) -> f64 {
    match ty {
        BlasType::Bf16 => 1e-2,
        BlasType::F32 => 1e-5,
    }
}

/// Runs one case and checks D, and the bias or aux the epilogue writes, against the reference.
/// Also checks that the padding between D's columns is left as it was.
fn check_case(device: &CudaDevice, blas: &Blas, name: &str, p: &Matmul, seed: u64) {
    let inputs = Inputs::random(p, seed);
    let got = on_gpu(device, blas, p, &inputs);
    let want = reference(p, &inputs);
    let tol = tolerance(p.c_type);
    let inside = positions(p.m, p.n, p.ldc, p.batch, p.stride_c);
    let err = rel_err(&got.d, &want.d, &inside);
    println!("RESULT blas {name} rel_err={err:.2e}");
    assert!(
        err < tol,
        "{name}: D differs from the reference by {err:e} (tolerance {tol:e}): {p:?}"
    );
    let mut is_inside = vec![false; got.d.len()];
    inside.iter().for_each(|&i| is_inside[i] = true);
    for (i, (g, w)) in got.d.iter().zip(&inputs.d).enumerate() {
        let same = g == w || (g.is_nan() && w.is_nan());
        assert!(is_inside[i] || same, "{name}: padding element {i} of D was overwritten");
    }
    if let Some(want_bias) = &want.bias {
        let got_bias = got.bias.as_ref().unwrap();
        let all: Vec<usize> = (0..want_bias.len()).collect();
        let err = rel_err(got_bias, want_bias, &all);
        println!("RESULT blas {name}.bias_grad rel_err={err:.2e}");
        assert!(err < tol, "{name}: the bias gradient differs by {err:e} (tolerance {tol:e})");
    }
    if let Some(want_aux) = &want.aux {
        let got_aux = got.aux.as_ref().unwrap();
        let err = rel_err(got_aux, want_aux, &positions(p.m, p.n, p.aux_ld, 1, 0));
        println!("RESULT blas {name}.aux rel_err={err:.2e}");
        assert!(err < tol, "{name}: the pre-GELU aux differs by {err:e} (tolerance {tol:e})");
    }
}

fn blas(device: &CudaDevice) -> Blas {
    Blas::new(device).unwrap_or_else(|e| panic!("cuBLASLt: {e}"))
}

#[test]
fn matmul_matches_the_reference_for_every_transpose_at_odd_sizes() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    for (trans_a, trans_b) in [(false, false), (false, true), (true, false), (true, true)] {
        let p = Matmul::col_major(77, 130, 33, trans_a, trans_b);
        let name = format!(
            "{}{}_77x130x33",
            if trans_a { "t" } else { "n" },
            if trans_b { "t" } else { "n" }
        );
        check_case(&device, &blas, &name, &p, 10);
    }
}

#[test]
fn matmul_respects_leading_dimensions_larger_than_the_rows() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    // Padding between columns: the GPU must neither read A's nor write D's.
    let p = Matmul { lda: 40, ldb: 136, ldc: 88, ..Matmul::col_major(77, 130, 33, true, true) };
    check_case(&device, &blas, "tt_padded_ld", &p, 20);
}

#[test]
fn matmul_writes_f32_outputs_from_bf16_and_from_f32_inputs() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::col_major(77, 130, 200, true, false);
    check_case(&device, &blas, "bf16_in_f32_out", &p.with_types(BlasType::Bf16, BlasType::F32), 30);
    check_case(&device, &blas, "f32_in_f32_out", &p.with_types(BlasType::F32, BlasType::F32), 31);
}

#[test]
fn beta_one_accumulates_into_the_output() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    // The weight gradient of a linear layer, accumulated as gradient accumulation does.
    let p = Matmul::linear_backward_weight(77, 200, 136).with_beta(1.0);
    check_case(&device, &blas, "accumulate_bf16", &p, 40);
    let p = p.with_types(BlasType::Bf16, BlasType::F32);
    check_case(&device, &blas, "accumulate_f32", &p, 41);
    let p = Matmul::col_major(77, 130, 33, false, false).with_alpha(0.5).with_beta(-2.0);
    check_case(&device, &blas, "alpha_beta", &p, 42);
}

#[test]
fn linear_forward_adds_the_bias_per_output_feature() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::linear_forward(77, 200, 136).with_epilogue(Epilogue::Bias);
    check_case(&device, &blas, "linear_forward_bias", &p, 50);
    // The same problem again: the cached plan takes the new call's bias.
    check_case(&device, &blas, "linear_forward_bias_again", &p, 51);
}

#[test]
fn bias_gelu_writes_gelu_and_the_pre_gelu_values() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::linear_forward(77, 200, 136).with_epilogue(Epilogue::BiasGelu);
    check_case(&device, &blas, "linear_forward_bias_gelu", &p, 60);
    let p = Matmul::col_major(77, 130, 33, true, false).with_epilogue(Epilogue::Gelu);
    check_case(&device, &blas, "gelu", &p, 61);
}

#[test]
fn dgelu_multiplies_by_the_gelu_derivative_of_aux() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::linear_backward_input(77, 136, 200).with_epilogue(Epilogue::DGelu);
    check_case(&device, &blas, "linear_backward_input_dgelu", &p, 70);
    let p = p.with_epilogue(Epilogue::DGeluBGrad);
    check_case(&device, &blas, "linear_backward_input_dgelu_bgrad", &p, 71);
}

#[test]
fn bgradb_writes_the_bias_gradient_of_a_linear_layer() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::linear_backward_weight(77, 136, 200).with_epilogue(Epilogue::BGradB);
    check_case(&device, &blas, "linear_backward_weight_bgradb", &p, 80);
}

#[test]
fn bgradb_writes_an_f32_bias_gradient_while_accumulating_f32_weight_gradients() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::linear_backward_weight(77, 136, 200)
        .with_epilogue(Epilogue::BGradB)
        .with_types(BlasType::Bf16, BlasType::F32)
        .with_beta(1.0);
    check_case(&device, &blas, "linear_backward_weight_bgradb_f32_accumulate", &p, 81);
}

#[test]
fn bgrada_writes_the_bias_gradient_over_the_rows_of_a() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let p = Matmul::col_major(136, 200, 77, false, true).with_epilogue(Epilogue::BGradA);
    check_case(&device, &blas, "bgrada", &p, 82);
}

#[test]
fn strided_batches_compute_attention_scores_and_values() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let (heads, t, hs) = (6, 77, 40);
    let (qk, tt) = ((t * hs) as i64, (t * t) as i64);
    // att[h] = q[h] · k[h]ᵀ / √hs, all [T, hs] row-major, att [T, T].
    let scores = Matmul::row_major(t, t, hs, false, true)
        .batched_row_major(heads, qk, qk, tt)
        .with_alpha(1.0 / (hs as f32).sqrt());
    check_case(&device, &blas, "attention_qkt_batched", &scores, 90);
    // out[h] = att[h] · v[h].
    let values = Matmul::row_major(t, hs, t, false, false).batched_row_major(heads, tt, qk, qk);
    check_case(&device, &blas, "attention_pv_batched", &values, 91);
}

#[test]
fn bad_operands_are_refused_before_reaching_cublaslt() {
    let Some(device) = gpu() else { return };
    let blas = blas(&device);
    let stream = device.stream(StreamKind::Compute);
    let p = Matmul::col_major(16, 16, 16, false, false);
    let x = device.alloc::<bf16>(16 * 16 + 8).unwrap();
    let floats = device.alloc::<f32>(16 * 16).unwrap();
    let out = device.alloc::<bf16>(16 * 16).unwrap();
    let ok = |a| MatmulOperands::new(a, Operand::of(&x, 0), Operand::of(&out, 0));
    blas.matmul(stream, &p, ok(Operand::of(&x, 0))).unwrap();

    let misaligned = blas.matmul(stream, &p, ok(Operand::of(&x, 1))).unwrap_err();
    assert!(misaligned.to_string().contains("aligned"), "{misaligned}");
    let beyond = blas.matmul(stream, &p, ok(Operand::of(&x, 16))).unwrap_err();
    assert!(matches!(beyond, DeviceError::OutOfBounds { .. }), "{beyond}");
    // An f32 buffer where the problem says bf16 (Matmul::col_major's default types).
    let wrong_type = blas.matmul(stream, &p, ok(Operand::of(&floats, 0))).unwrap_err();
    assert!(
        matches!(
            wrong_type,
            DeviceError::DTypeMismatch {
                what: "matmul operand a",
                expected: DType::Bf16,
                found: DType::F32
            }
        ),
        "{wrong_type}"
    );
    let no_bias = blas.matmul(stream, &p.with_epilogue(Epilogue::Bias), ok(Operand::of(&x, 0)));
    assert!(no_bias.unwrap_err().to_string().contains("bias"));
    let in_place =
        MatmulOperands::new(Operand::of(&out, 0), Operand::of(&x, 0), Operand::of(&out, 0));
    let aliased = blas.matmul(stream, &p, in_place).unwrap_err();
    assert!(matches!(aliased, DeviceError::AliasedArguments { .. }), "{aliased}");
    let short_ld = Matmul { lda: 8, ..p };
    assert!(blas.matmul(stream, &short_ld, ok(Operand::of(&x, 0))).is_err());
    device.synchronize().unwrap();
}

#[test]
#[ignore = "a benchmark: run with --ignored; `zeroflow bench gemm` is the same"]
fn gemm_8192_throughput() {
    let Some(device) = gpu() else { return };
    let bench = bench_gemm(&device, 8192, 8192, 8192, 50).unwrap();
    println!("{bench}");
    println!("RESULT gemm_8192 tflops={:.1}", bench.tflops);
}
