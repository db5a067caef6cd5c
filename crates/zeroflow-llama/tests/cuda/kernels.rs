//! Each of the family's CUDA kernels against its CPU twin (`zeroflow_llama::kernels`, in f64 on
//! the same bf16 inputs), run by zeroflow-nn's CUDA executor on a plan of just those launches:
//! the inputs are placed in the parameter buffer and the outputs in the gradient buffer (which
//! the test uploads and downloads; RMSNorm's rstd lies in the f32 statistics, read back by its
//! backward in the same plan). The gradient buffer starts with random values: every backward
//! kernel adds to it (the executor's accumulate path), and so does its twin. Sizes with and
//! without the 16-byte paths (widths that are and are not multiples of 8). RoPE also on packed
//! rows: each token rotated by its position in its document (`rope_*_packed`). Also: the modules
//! compile with NVRTC for sm_80 and sm_90 without a GPU.

use std::ops::Range;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::bf16;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::cuda::module::compile_for_tests;
use zeroflow_device::{CudaDevice, Device};
use zeroflow_llama::cuda::kernels::{KERNEL_NAMES, LlamaKernels, sources};
use zeroflow_llama::kernels::embedding::{embedding_backward, embedding_forward};
use zeroflow_llama::kernels::rmsnorm::{rmsnorm_backward, rmsnorm_forward};
use zeroflow_llama::kernels::rope::{
    rope_backward, rope_backward_at, rope_forward, rope_forward_at,
};
use zeroflow_llama::kernels::swiglu::{swiglu_backward, swiglu_forward};
use zeroflow_llama::kernels::{LlamaKernel, Rotary};
use zeroflow_llama::{Llama3RopeScaling, RopeFreqs};
use zeroflow_nn::plan::{read, update, write};
use zeroflow_nn::{Arg, Buf, CudaRunner, Kernel, Launch, Plan, Step};

use crate::gpu;
use crate::support::relative_error;

/// The largest relative error (‖gpu − cpu‖ / max(‖gpu‖, ‖cpu‖)) allowed per output: the GPU
/// rounds every input and output to bf16.
const TOLERANCE: f64 = 1e-2;

/// Random values in ±`bound`, rounded to bf16 (so the CPU twin sees exactly the GPU's inputs).
fn random_bf16(len: usize, bound: f64, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| bf16::from_f64(rng.random_range(-bound..bound)).to_f64()).collect()
}

/// Consecutive ranges of a flat buffer, each starting at a multiple of 64 elements (so every
/// place is 16-byte aligned and the kernels may take their vector paths).
#[derive(Default)]
struct Bump(usize);

impl Bump {
    fn take(&mut self, len: usize) -> Range<usize> {
        let start = self.0.next_multiple_of(64);
        self.0 = start + len;
        start..self.0
    }
}

/// A plan of family launches over values placed in the parameter buffer (the inputs) and the
/// gradient buffer (the outputs), run once by the CUDA executor.
struct OneShot {
    params: Bump,
    param_values: Vec<(Range<usize>, Vec<f64>)>,
    grads: Bump,
    grad_values: Vec<(Range<usize>, Vec<f64>)>,
    stats: Bump,
    launches: Vec<Launch<LlamaKernel>>,
}

impl OneShot {
    fn new() -> Self {
        OneShot {
            params: Bump::default(),
            param_values: Vec::new(),
            grads: Bump::default(),
            grad_values: Vec::new(),
            stats: Bump::default(),
            launches: Vec::new(),
        }
    }

    /// An input holding `values`.
    fn input(&mut self, values: &[f64]) -> Range<usize> {
        let range = self.params.take(values.len());
        self.param_values.push((range.clone(), values.to_vec()));
        range
    }

    /// An output of the gradient buffer, starting as `values`.
    fn output(&mut self, values: &[f64]) -> Range<usize> {
        let range = self.grads.take(values.len());
        self.grad_values.push((range.clone(), values.to_vec()));
        range
    }

    /// `len` f32 activations (kept with the statistics).
    fn stat(&mut self, len: usize) -> Range<usize> {
        self.stats.take(len)
    }

    fn launch(&mut self, kernel: LlamaKernel, args: Vec<Arg>) {
        self.launches.push(Launch { kernel: Kernel::Layer(kernel), args });
    }

    /// Runs the launches on `batch · seq` tokens (`inputs`, below `vocab`) and returns the
    /// gradient buffer.
    fn run(self, device: &CudaDevice, batch_seq: (usize, usize), inputs: &[u32]) -> Vec<f64> {
        self.run_packed(device, batch_seq, inputs, None)
    }

    /// [`OneShot::run`], on packed rows where `positions` are given (each token's position in its
    /// document; the launches read them as [`Buf::Positions`]).
    fn run_packed(
        self,
        device: &CudaDevice,
        (batch, seq): (usize, usize),
        inputs: &[u32],
        positions: Option<&[u32]>,
    ) -> Vec<f64> {
        let loss = self.stats.0.next_multiple_of(64)..self.stats.0.next_multiple_of(64) + 1;
        let mut f32_acts: Vec<Range<usize>> = Vec::new();
        for launch in &self.launches {
            for arg in launch.args.iter().filter(|arg| arg.buf == Buf::Acts) {
                if !f32_acts.contains(&arg.range) {
                    f32_acts.push(arg.range.clone());
                }
            }
        }
        f32_acts.push(loss.clone());
        let plan = Plan {
            batch,
            seq,
            acts_len: loss.end,
            forward: Vec::new(),
            backward: self.launches.into_iter().map(Step::Launch).collect(),
            loss,
            f32_acts,
        };
        let len = self.params.0.max(self.grads.0).next_multiple_of(64);
        let fill = |values: &[(Range<usize>, Vec<f64>)]| {
            let mut flat = vec![bf16::ZERO; len];
            for (range, v) in values {
                for (slot, &x) in flat[range.clone()].iter_mut().zip(v) {
                    *slot = bf16::from_f64(x);
                }
            }
            device.upload(&flat).unwrap()
        };
        let (params, grads) = (fill(&self.param_values), fill(&self.grad_values));
        let blas = Arc::new(Blas::new(device).unwrap());
        let layers = LlamaKernels::load(device, &plan).unwrap();
        let mut runner = CudaRunner::new(device, blas, plan, len, false, layers).unwrap();
        match positions {
            None => runner.set_batch(inputs, inputs, 1 << 20).unwrap(),
            Some(positions) => runner.set_packed_batch(inputs, inputs, positions, 1 << 20).unwrap(),
        }
        runner.backward(&params, &grads, 1.0, |_| {}).unwrap();
        device.synchronize().unwrap();
        device.download(&grads).unwrap().iter().map(|x| x.to_f64()).collect()
    }
}

/// Checks `gpu[range]` against `expected`, printing the error as `RESULT llama_kernel {what}`.
fn check(what: &str, gpu: &[f64], range: &Range<usize>, expected: &[f64]) {
    let rel = relative_error(&gpu[range.clone()], expected);
    println!("RESULT llama_kernel {what} rel={rel:.3e}");
    assert!(rel <= TOLERANCE, "{what}: off by {rel:.3e} (relative)");
}

/// RMSNorm forward and backward on `rows` rows of width `c`: out, and dinp and dweight added to
/// random starting values (rstd is checked through them: backward reads the GPU's).
fn check_rmsnorm(device: &CudaDevice, rows: usize, c: usize, seed: u64) {
    let eps = 1e-5;
    let (x, w, dy) = (
        random_bf16(rows * c, 2.0, seed),
        random_bf16(c, 1.5, seed + 1),
        random_bf16(rows * c, 1.0, seed + 2),
    );
    let (dx0, dw0) = (random_bf16(rows * c, 0.5, seed + 3), random_bf16(c, 0.5, seed + 4));
    let mut shot = OneShot::new();
    let (x_at, w_at, dy_at) = (shot.input(&x), shot.input(&w), shot.input(&dy));
    let out_at = shot.output(&vec![0.0; rows * c]);
    let (dx_at, dw_at) = (shot.output(&dx0), shot.output(&dw0));
    let rstd_at = shot.stat(rows);
    let (g, a, p) = (Buf::Grads, Buf::Acts, Buf::Params);
    let forward = vec![write(g, &out_at), write(a, &rstd_at), read(p, &x_at), read(p, &w_at)];
    shot.launch(LlamaKernel::RmsNorm { c, eps }, forward);
    let backward = vec![
        update(g, &dx_at),
        update(g, &dw_at),
        read(p, &dy_at),
        read(p, &x_at),
        read(p, &w_at),
        read(a, &rstd_at),
    ];
    shot.launch(LlamaKernel::RmsNormBackward { c }, backward);
    let gpu = shot.run(device, (1, rows), &vec![0; rows]);

    let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
    rmsnorm_forward(&mut out, &mut rstd, &x, &w, c, eps);
    let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
    rmsnorm_backward(&mut dx, &mut dw, &dy, &x, &w, &rstd, c);
    check(&format!("rmsnorm out rows{rows} c{c}"), &gpu, &out_at, &out);
    check(&format!("rmsnorm dinp rows{rows} c{c}"), &gpu, &dx_at, &dx);
    check(&format!("rmsnorm dweight rows{rows} c{c}"), &gpu, &dw_at, &dw);
}

/// Widths of the layer norms (200: vectors; 10: hidden of the tiny models, scalar), of Qwen3's
/// per-head norms (rows of head_dim 6 and 128), over rows that fill several column-sum chunks
/// (600 > 256) or one partly.
#[test]
fn rmsnorm_forward_and_backward_match_the_cpu_twin() {
    let Some(device) = gpu() else { return };
    for (index, (rows, c)) in [(37, 200), (600, 10), (111, 6), (300, 128)].into_iter().enumerate() {
        check_rmsnorm(&device, rows, c, 10 * index as u64);
    }
}

/// RoPE forward (rotate and pack into qkv) and backward (added to random dq, dk, dv); on packed
/// rows where `positions` are given.
fn check_rope(
    device: &CudaDevice,
    (batch, seq): (usize, usize),
    rotary: Rotary,
    positions: Option<&[u32]>,
    seed: u64,
) {
    let rows = batch * seq;
    let (qw, kw) = (rotary.q_width(), rotary.kv_width());
    let (q, k, v) = (
        random_bf16(rows * qw, 2.0, seed),
        random_bf16(rows * kw, 2.0, seed + 1),
        random_bf16(rows * kw, 2.0, seed + 2),
    );
    let dqkv = random_bf16(rows * rotary.qkv_width(), 1.0, seed + 3);
    let (dq0, dk0, dv0) = (
        random_bf16(rows * qw, 0.5, seed + 4),
        random_bf16(rows * kw, 0.5, seed + 5),
        random_bf16(rows * kw, 0.5, seed + 6),
    );
    let mut shot = OneShot::new();
    let (q_at, k_at, v_at, dqkv_at) =
        (shot.input(&q), shot.input(&k), shot.input(&v), shot.input(&dqkv));
    let qkv_at = shot.output(&vec![0.0; rows * rotary.qkv_width()]);
    let (dq_at, dk_at, dv_at) = (shot.output(&dq0), shot.output(&dk0), shot.output(&dv0));
    let (g, p) = (Buf::Grads, Buf::Params);
    let mut forward = vec![write(g, &qkv_at), read(p, &q_at), read(p, &k_at), read(p, &v_at)];
    let mut backward =
        vec![update(g, &dq_at), update(g, &dk_at), update(g, &dv_at), read(p, &dqkv_at)];
    if positions.is_some() {
        forward.push(read(Buf::Positions, &(0..rows)));
        backward.push(read(Buf::Positions, &(0..rows)));
    }
    shot.launch(LlamaKernel::Rope(rotary.clone()), forward);
    shot.launch(LlamaKernel::RopeBackward(rotary.clone()), backward);
    let gpu = shot.run_packed(device, (batch, seq), &vec![0; rows], positions);

    let mut qkv = vec![0.0; rows * rotary.qkv_width()];
    let (mut dq, mut dk, mut dv) = (dq0, dk0, dv0);
    match positions {
        None => {
            rope_forward(&mut qkv, &q, &k, &v, &rotary);
            rope_backward(&mut dq, &mut dk, &mut dv, &dqkv, &rotary);
        }
        Some(positions) => {
            let position = |row: usize| positions[row] as usize;
            rope_forward_at(&mut qkv, &q, &k, &v, &rotary, position);
            rope_backward_at(&mut dq, &mut dk, &mut dv, &dqkv, &rotary, position);
        }
    }
    let label = format!(
        "B{batch} T{seq} NH{} NKV{} d{}{}",
        rotary.n_head,
        rotary.n_kv_head,
        rotary.head_dim(),
        if positions.is_some() { " packed" } else { "" }
    );
    check(&format!("rope qkv {label}"), &gpu, &qkv_at, &qkv);
    check(&format!("rope dq {label}"), &gpu, &dq_at, &dq);
    check(&format!("rope dk {label}"), &gpu, &dk_at, &dk);
    check(&format!("rope dv {label}"), &gpu, &dv_at, &dv);
}

/// The shapes of both RoPE tests, as `((batch, seq), rotary)`: grouped-query heads (6 on 2) of a
/// tiny head of 6 at rows of 37, and multi-query heads (8 on 1) of Llama's 64 with llama3 scaling
/// at rows of 70 (positions past the scaling's original context).
fn rope_cases() -> [((usize, usize), Rotary); 2] {
    let scaling = Llama3RopeScaling {
        factor: 4.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    };
    let freqs = |head_dim, scaling| RopeFreqs { head_dim, theta: 500.0, scaling };
    [
        ((2, 37), Rotary { t: 37, n_head: 6, n_kv_head: 2, freqs: freqs(6, None) }),
        ((3, 70), Rotary { t: 70, n_head: 8, n_kv_head: 1, freqs: freqs(64, Some(scaling)) }),
    ]
}

/// RoPE forward and backward at [`rope_cases`]' shapes.
#[test]
fn rope_forward_and_backward_match_the_cpu_twin() {
    let Some(device) = gpu() else { return };
    for (index, (batch_seq, rotary)) in rope_cases().into_iter().enumerate() {
        check_rope(&device, batch_seq, rotary, None, 100 + 10 * index as u64);
    }
}

/// RoPE on packed rows (each token rotated by its position in its document, the `_packed`
/// kernels): grouped-query heads of 6 at rows of 37 and multi-query heads of 64 with llama3
/// scaling at rows of 70, documents of uneven lengths, one token among them.
#[test]
fn rope_with_positions_matches_the_cpu_twin() {
    let Some(device) = gpu() else { return };
    let positions = |rows: &[&[u32]]| -> Vec<u32> {
        rows.iter().flat_map(|lengths| lengths.iter().flat_map(|&len| 0..len)).collect()
    };
    // The documents' lengths in each row of each case.
    let documents = [
        positions(&[&[1, 20, 16], &[5, 1, 31]]),
        positions(&[&[70], &[1, 40, 29], &[33, 1, 1, 35]]),
    ];
    let cases = rope_cases().into_iter().zip(documents);
    for (index, ((batch_seq, rotary), positions)) in cases.enumerate() {
        check_rope(&device, batch_seq, rotary, Some(&positions), 400 + 10 * index as u64);
    }
}

/// SwiGLU forward and backward on `n` elements (gradients added to random values).
fn check_swiglu(device: &CudaDevice, n: usize, seed: u64) {
    let (gate, up, dout) =
        (random_bf16(n, 6.0, seed), random_bf16(n, 2.0, seed + 1), random_bf16(n, 1.0, seed + 2));
    let (dgate0, dup0) = (random_bf16(n, 0.5, seed + 3), random_bf16(n, 0.5, seed + 4));
    let mut shot = OneShot::new();
    let (gate_at, up_at, dout_at) = (shot.input(&gate), shot.input(&up), shot.input(&dout));
    let out_at = shot.output(&vec![0.0; n]);
    let (dgate_at, dup_at) = (shot.output(&dgate0), shot.output(&dup0));
    let (g, p) = (Buf::Grads, Buf::Params);
    shot.launch(LlamaKernel::SwiGlu, vec![write(g, &out_at), read(p, &gate_at), read(p, &up_at)]);
    let backward = vec![
        update(g, &dgate_at),
        update(g, &dup_at),
        read(p, &dout_at),
        read(p, &gate_at),
        read(p, &up_at),
    ];
    shot.launch(LlamaKernel::SwiGluBackward, backward);
    let gpu = shot.run(device, (1, 1), &[0]);

    let mut out = vec![0.0; n];
    swiglu_forward(&mut out, &gate, &up);
    let (mut dgate, mut dup) = (dgate0, dup0);
    swiglu_backward(&mut dgate, &mut dup, &dout, &gate, &up);
    check(&format!("swiglu out n{n}"), &gpu, &out_at, &out);
    check(&format!("swiglu dgate n{n}"), &gpu, &dgate_at, &dgate);
    check(&format!("swiglu dup n{n}"), &gpu, &dup_at, &dup);
}

/// 8-element vectors and a tail (1003 = 125 · 8 + 3), and the scalar path alone (7).
#[test]
fn swiglu_forward_and_backward_match_the_cpu_twin() {
    let Some(device) = gpu() else { return };
    for (index, n) in [1003, 7, 4096].into_iter().enumerate() {
        check_swiglu(&device, n, 200 + 10 * index as u64);
    }
}

/// The token embedding forward (a gather) and backward (added to a random gradient), with
/// repeated tokens.
fn check_embedding(device: &CudaDevice, (batch, seq): (usize, usize), c: usize, seed: u64) {
    let (vocab, rows) = (11, batch * seq);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tokens: Vec<u32> = (0..rows).map(|_| rng.random_range(0..vocab as u32)).collect();
    let (wte, dout) = (random_bf16(vocab * c, 1.0, seed + 1), random_bf16(rows * c, 1.0, seed + 2));
    let dwte0 = random_bf16(vocab * c, 0.5, seed + 3);
    let mut shot = OneShot::new();
    let (wte_at, dout_at) = (shot.input(&wte), shot.input(&dout));
    let (out_at, dwte_at) = (shot.output(&vec![0.0; rows * c]), shot.output(&dwte0));
    let (g, p, t) = (Buf::Grads, Buf::Params, Buf::Inputs);
    let forward = vec![write(g, &out_at), read(t, &(0..rows)), read(p, &wte_at)];
    shot.launch(LlamaKernel::Embedding { c, vocab }, forward);
    let backward = vec![update(g, &dwte_at), read(p, &dout_at), read(t, &(0..rows))];
    shot.launch(LlamaKernel::EmbeddingBackward { c }, backward);
    let gpu = shot.run(device, (batch, seq), &tokens);

    let mut out = vec![0.0; rows * c];
    embedding_forward(&mut out, &tokens, &wte, c, vocab).unwrap();
    let mut dwte = dwte0;
    embedding_backward(&mut dwte, &dout, &tokens, c);
    // A gather of bf16 values is exact.
    assert_eq!(&gpu[out_at.clone()], &out[..], "embedding out c{c}");
    check(&format!("embedding dwte B{batch} T{seq} c{c}"), &gpu, &dwte_at, &dwte);
}

#[test]
fn embedding_forward_and_backward_match_the_cpu_twin() {
    let Some(device) = gpu() else { return };
    check_embedding(&device, (3, 37), 10, 300);
    check_embedding(&device, (2, 40), 64, 310);
}

/// Runs without a GPU wherever libnvrtc loads (and prints `skipped: libnvrtc not found`
/// elsewhere).
#[test]
fn the_family_kernels_compile_for_sm80_and_sm90_and_export_every_kernel() {
    for ((name, source), kernels) in sources().into_iter().zip(KERNEL_NAMES) {
        let kernels: Vec<String> = kernels.iter().map(|k| (*k).to_string()).collect();
        let compiled = compile_for_tests(name, &source, &kernels, "rmsnorm_forward_8");
        if compiled.unwrap_or_else(|e| panic!("{e}")).is_none() {
            return;
        }
    }
}
