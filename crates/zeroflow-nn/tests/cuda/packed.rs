//! The packed forms of the shared CUDA kernels (several documents per row, each token's position in
//! its document given) against their CPU twins in f64 on the same bf16 inputs: `CudaAttention`'s
//! and `FlashAttention`'s `forward_packed` / `backward_packed` against
//! `attention_{forward,backward}_packed` and `flash_attention_{forward,backward}_packed`, and
//! GPT-2's encoder forward and backward (the position embedding read at, and its gradient summed
//! into, each token's position) against `encoder_{forward,backward}_at`. Rows hold documents of
//! uneven lengths, documents of one token among them, at an odd head count and grouped-query
//! shapes; the flash shapes put document boundaries inside 64-row tiles and leave whole key tiles
//! before a query tile's documents (which the kernels skip). Every tensor of the caller sits
//! between NaN guards and the outputs start as NaN. Also: with one document per row the packed
//! kernels give the plain kernels' bits.

use std::ops::Range;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zeroflow_core::bf16;
use zeroflow_device::cuda::CudaBuffer;
use zeroflow_device::cuda::blas::Blas;
use zeroflow_device::{CudaDevice, Device, StreamKind};
use zeroflow_nn::cuda::attention::CudaAttention;
use zeroflow_nn::cuda::flash::FlashAttention;
use zeroflow_nn::kernels::attention::{
    AttentionShape, attention_backward_packed, attention_forward_packed,
    flash_attention_backward_packed, flash_attention_forward_packed,
};
use zeroflow_nn::kernels::encoder::{encoder_backward_at, encoder_forward_at};
use zeroflow_nn::kernels::{Kernel, NoLayers};
use zeroflow_nn::plan::{read, update, write};
use zeroflow_nn::{Buf, CudaRunner, Launch, Plan, Step};

use crate::gpu;
use crate::support::{Placed, random_bf16, relative_error, widen};

/// The largest relative error (‖gpu − cpu‖ / ‖cpu‖) allowed for out, att and each part of dqkv:
/// the bound of the plain attentions' tests (`attention.rs`, `flash.rs`), the GPU rounding the
/// weights and every intermediate to bf16.
const TOLERANCE: f64 = 2e-2;

/// The largest relative error of flash's log-sum-exp (as `flash.rs`).
const LSE_TOLERANCE: f64 = 1e-4;

/// The largest relative error of the encoder's outputs and gradients: bf16 inputs and outputs,
/// f32 sums (the bound of the family kernels' tests).
const ENCODER_TOLERANCE: f64 = 1e-2;

/// Bytes before each of the caller's tensors in its buffer (flash needs 16-byte alignment).
const OFFSET_BYTES: usize = 16;

/// A packed attention's shape: `batch` rows of `seq` tokens, each row the documents of its
/// lengths, in order.
#[derive(Clone, Copy, Debug)]
struct Packed {
    shape: AttentionShape,
    rows: &'static [&'static [usize]],
}

impl Packed {
    const fn new(c: usize, heads: (usize, usize), rows: &'static [&'static [usize]]) -> Self {
        let seq = sum(rows[0]);
        Packed { shape: AttentionShape { t: seq, c, n_head: heads.0, n_kv_head: heads.1 }, rows }
    }

    fn batch(&self) -> usize {
        self.rows.len()
    }

    fn tokens(&self) -> usize {
        self.batch() * self.shape.t
    }

    fn att_len(&self) -> usize {
        self.batch() * self.shape.n_head * self.shape.t * self.shape.t
    }

    fn qkv_len(&self) -> usize {
        self.tokens() * self.shape.qkv_width()
    }

    /// Each token's position in its document, row by row.
    fn positions(&self) -> Vec<u32> {
        let t = self.shape.t;
        assert!(self.rows.iter().all(|lengths| sum(lengths) == t), "{self:?}: rows of {t}");
        positions_of(self.rows)
    }

    fn label(&self) -> String {
        let AttentionShape { t, c, n_head, n_kv_head } = self.shape;
        let hs = self.shape.head_size();
        format!("B{} T{t} C{c} NH{n_head} NKV{n_kv_head} hs{hs} docs{:?}", self.batch(), self.rows)
    }
}

const fn sum(lengths: &[usize]) -> usize {
    let (mut total, mut i) = (0, 0);
    while i < lengths.len() {
        total += lengths[i];
        i += 1;
    }
    total
}

/// Each token's position in its document, for rows of documents of the given lengths.
fn positions_of(rows: &[&[usize]]) -> Vec<u32> {
    rows.iter().flat_map(|lengths| lengths.iter().flat_map(|&len| 0..len as u32)).collect()
}

/// The gemm attention's shapes: an odd head count (3 heads of 50: 2-element packs), grouped-query
/// heads (6 on 2 of 48; 4 on 2 at sequences of 24, whose rows take 8-element packs), a row of
/// 64 (8-element packs), a sequence of one token; documents of one token everywhere.
const GEMM_SHAPES: [Packed; 5] = [
    Packed::new(150, (3, 3), &[&[1, 17, 1, 18], &[5, 1, 31]]),
    Packed::new(288, (6, 2), &[&[20, 1, 24], &[1, 1, 43]]),
    Packed::new(128, (4, 2), &[&[24], &[1, 23], &[12, 1, 1, 10]]),
    Packed::new(256, (2, 2), &[&[9, 1, 54], &[64], &[32, 32]]),
    Packed::new(200, (4, 4), &[&[1], &[1]]),
];

/// The flash attention's shapes, at head sizes 64 and 128: an odd head count (3 of 64) over
/// sequences of 200 (four 64-row tiles, the last partial) whose documents start inside tiles and
/// leave whole key tiles before the last query tiles' documents; grouped-query (6 on 2 of 64)
/// with a boundary on a tile edge; multi-query (8 on 1 of 128); 2 heads of 128 at 65 tokens
/// (a second tile of one row, a document of one token each side of the edge).
const FLASH_SHAPES: [Packed; 4] = [
    Packed::new(192, (3, 3), &[&[1, 70, 1, 64, 50, 14], &[130, 1, 69]]),
    Packed::new(384, (6, 2), &[&[64, 66], &[1, 128, 1]]),
    Packed::new(1024, (8, 1), &[&[100, 1, 99]]),
    Packed::new(256, (2, 2), &[&[64, 1], &[1, 64]]),
];

/// The inputs of one shape: random `qkv` and `dout` and the positions, on the host and placed on
/// the GPU between NaN guards (the positions between zero guards: any u32 is a position).
struct Inputs {
    qkv: Vec<bf16>,
    dout: Vec<bf16>,
    positions: Vec<u32>,
    qkv_gpu: Placed<bf16>,
    dout_gpu: Placed<bf16>,
    positions_gpu: CudaBuffer<u32>,
}

impl Inputs {
    fn new(device: &CudaDevice, packed: &Packed, offset_bytes: usize, seed: u64) -> Self {
        let qkv = random_bf16(packed.qkv_len(), 2.0, seed);
        let dout = random_bf16(packed.tokens() * packed.shape.c, 1.0, seed + 1);
        let positions = packed.positions();
        Inputs {
            qkv_gpu: Placed::holding(device, &qkv, offset_bytes),
            dout_gpu: Placed::holding(device, &dout, offset_bytes),
            positions_gpu: device.upload(&positions).unwrap(),
            qkv,
            dout,
            positions,
        }
    }
}

/// out, the attention weights (gemm) or the log-sum-exp (flash), and dqkv, widened to f64.
struct Outputs {
    out: Vec<f64>,
    kept: Vec<f64>,
    dqkv: Vec<f64>,
}

/// Part `part` (0 q, 1 k, 2 v) of every row of a `qkv`-shaped tensor.
fn part(rows: &[f64], shape: AttentionShape, part: usize) -> Vec<f64> {
    let (c, kv) = (shape.c, shape.kv_width());
    let columns = [0..c, c..c + kv, c + kv..c + 2 * kv][part].clone();
    rows.chunks(c + 2 * kv).flat_map(|row| &row[columns.clone()]).copied().collect()
}

/// The relative errors of out, of what forward keeps and of each part of dqkv.
fn errors(gpu: &Outputs, cpu: &Outputs, shape: AttentionShape) -> [(&'static str, f64); 5] {
    let [out, dq, dk, dv] = output_errors(gpu, cpu, shape);
    [out, ("kept", relative_error(&gpu.kept, &cpu.kept)), dq, dk, dv]
}

/// [`errors`] without what forward keeps: for two attentions that keep different things (flash
/// its log-sum-exps, the gemm form its weights).
fn output_errors(
    gpu: &Outputs,
    other: &Outputs,
    shape: AttentionShape,
) -> [(&'static str, f64); 4] {
    let dqkv = |outputs: &Outputs, index| part(&outputs.dqkv, shape, index);
    [
        ("out", relative_error(&gpu.out, &other.out)),
        ("dq", relative_error(&dqkv(gpu, 0), &dqkv(other, 0))),
        ("dk", relative_error(&dqkv(gpu, 1), &dqkv(other, 1))),
        ("dv", relative_error(&dqkv(gpu, 2), &dqkv(other, 2))),
    ]
}

/// The packed gemm attention on the GPU, forward then backward; with `packed` false the plain
/// one (for rows of one document each).
fn run_gemm(
    device: &CudaDevice,
    blas: &Arc<Blas>,
    packed: &Packed,
    inputs: &Inputs,
    (offset_bytes, with_positions): (usize, bool),
) -> Outputs {
    let stream = device.stream(StreamKind::Compute);
    let attention = CudaAttention::new(device, blas.clone(), packed.batch(), packed.shape).unwrap();
    let rows_len = packed.tokens() * packed.shape.c;
    let out = Placed::<bf16>::poisoned(device, rows_len, offset_bytes);
    let att = Placed::<bf16>::poisoned(device, packed.att_len(), offset_bytes);
    let dqkv = Placed::<bf16>::poisoned(device, packed.qkv_len(), offset_bytes);
    let dscores = Placed::<bf16>::poisoned(device, packed.att_len(), offset_bytes);
    let (qkv, dout, positions) =
        (inputs.qkv_gpu.slice(), inputs.dout_gpu.slice(), inputs.positions_gpu.as_slice());
    if with_positions {
        attention.forward_packed(stream, qkv, positions, out.slice_mut(), att.slice_mut()).unwrap();
        let (att_in, dqkv_out) = (att.slice(), dqkv.slice_mut());
        attention.backward_packed(stream, dout, qkv, att_in, positions, dqkv_out).unwrap();
    } else {
        attention.forward(stream, qkv, out.slice_mut(), att.slice_mut()).unwrap();
        let (att_in, dqkv_out, scratch) = (att.slice(), dqkv.slice_mut(), dscores.slice_mut());
        attention.backward(stream, dout, qkv, att_in, dqkv_out, scratch).unwrap();
    }
    device.synchronize().unwrap();
    Outputs {
        out: out.read(device, "out"),
        kept: att.read(device, "att"),
        dqkv: dqkv.read(device, "dqkv"),
    }
}

/// The packed flash attention on the GPU, forward then backward; with `packed` false the plain
/// one.
fn run_flash(
    device: &CudaDevice,
    packed: &Packed,
    inputs: &Inputs,
    with_positions: bool,
) -> Outputs {
    let stream = device.stream(StreamKind::Compute);
    let flash = FlashAttention::new(device, packed.batch(), packed.shape).unwrap();
    let rows_len = packed.tokens() * packed.shape.c;
    let out = Placed::<bf16>::poisoned(device, rows_len, OFFSET_BYTES);
    let lse = Placed::<f32>::poisoned(device, flash.lse_len(), OFFSET_BYTES);
    let dqkv = Placed::<bf16>::poisoned(device, packed.qkv_len(), OFFSET_BYTES);
    let (qkv, dout, positions) =
        (inputs.qkv_gpu.slice(), inputs.dout_gpu.slice(), inputs.positions_gpu.as_slice());
    let (out_in, lse_in) = (out.slice(), lse.slice());
    if with_positions {
        flash.forward_packed(stream, qkv, positions, out.slice_mut(), lse.slice_mut()).unwrap();
        let dqkv_out = dqkv.slice_mut();
        flash.backward_packed(stream, qkv, out_in, dout, lse_in, positions, dqkv_out).unwrap();
    } else {
        flash.forward(stream, qkv, out.slice_mut(), lse.slice_mut()).unwrap();
        flash.backward(stream, qkv, out_in, dout, lse_in, dqkv.slice_mut()).unwrap();
    }
    device.synchronize().unwrap();
    Outputs {
        out: out.read(device, "out"),
        kept: lse.read(device, "lse"),
        dqkv: dqkv.read(device, "dqkv"),
    }
}

/// The CPU twins in f64: the gemm form (`kept` the weights) or the flash form (`kept` the lse).
fn run_reference(packed: &Packed, inputs: &Inputs, flash: bool) -> Outputs {
    let (qkv, dout, positions) = (widen(&inputs.qkv), widen(&inputs.dout), &inputs.positions);
    let shape = packed.shape;
    let mut out = vec![0.0; packed.tokens() * shape.c];
    let mut dqkv = vec![0.0; qkv.len()];
    if flash {
        let mut lse = vec![0.0; packed.batch() * shape.n_head * shape.t];
        flash_attention_forward_packed(&mut out, &mut lse, &qkv, positions, shape);
        flash_attention_backward_packed(&mut dqkv, &dout, &qkv, &out, &lse, positions, shape);
        Outputs { out, kept: lse, dqkv }
    } else {
        let (mut att, mut dscores) = (vec![0.0; packed.att_len()], vec![0.0; packed.att_len()]);
        attention_forward_packed(&mut out, &mut att, &qkv, positions, shape);
        attention_backward_packed(&mut dqkv, &mut dscores, &dout, &qkv, &att, positions, shape);
        Outputs { out, kept: att, dqkv }
    }
}

/// The bits of widened values (exact and one to one from bf16 and f32).
fn bits(values: &[f64]) -> Vec<u64> {
    values.iter().map(|x| x.to_bits()).collect()
}

/// `CudaAttention`'s packed forms against the CPU twins, at offsets 0 and 6 bytes (3 bf16: every
/// kernel takes its one-element path); the weights outside each query's document (before it, or
/// after the query) are exactly zero.
#[test]
fn packed_gemm_attention_matches_the_cpu_packed_reference() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    for (index, packed) in GEMM_SHAPES.iter().enumerate() {
        for offset_bytes in [0, 6] {
            let inputs = Inputs::new(&device, packed, offset_bytes, 500 + 10 * index as u64);
            let gpu = run_gemm(&device, &blas, packed, &inputs, (offset_bytes, true));
            let cpu = run_reference(packed, &inputs, false);
            let label = format!("{} offset{offset_bytes}", packed.label()).replace(' ', "_");
            for (what, rel) in errors(&gpu, &cpu, packed.shape) {
                let what = if what == "kept" { "att" } else { what };
                println!("RESULT packed_attention {what} {label} rel={rel:.3e}");
                assert!(rel <= TOLERANCE, "{label}: {what} is off by {rel:.3e} (relative)");
            }
            let t = packed.shape.t;
            let outside = (0..packed.att_len()).filter(|&i| {
                let (b, t1, t2) = (i / (packed.shape.n_head * t * t), (i / t) % t, i % t);
                let first = t1 - inputs.positions[b * t + t1] as usize;
                (t2 > t1 || t2 < first) && gpu.kept[i] != 0.0
            });
            assert_eq!(outside.count(), 0, "{label}: weights outside the documents are not zero");
        }
    }
}

/// `FlashAttention`'s packed forms against the CPU twins, and against `CudaAttention`'s packed
/// forms (out and dqkv).
#[test]
fn packed_flash_attention_matches_the_cpu_packed_reference() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    for (index, packed) in FLASH_SHAPES.iter().enumerate() {
        let inputs = Inputs::new(&device, packed, OFFSET_BYTES, 600 + 10 * index as u64);
        let gpu = run_flash(&device, packed, &inputs, true);
        let label = packed.label().replace(' ', "_");
        let cpu = run_reference(packed, &inputs, true);
        for (what, rel) in errors(&gpu, &cpu, packed.shape) {
            let (what, bound) =
                if what == "kept" { ("lse", LSE_TOLERANCE) } else { (what, TOLERANCE) };
            println!("RESULT packed_flash {what} vs reference {label} rel={rel:.3e}");
            assert!(rel <= bound, "{label}: {what} is off by {rel:.3e} (relative)");
        }
        let gemm = run_gemm(&device, &blas, packed, &inputs, (OFFSET_BYTES, true));
        for (what, rel) in output_errors(&gpu, &gemm, packed.shape) {
            println!("RESULT packed_flash {what} vs attention {label} rel={rel:.3e}");
            assert!(rel <= TOLERANCE, "{label}: {what} is off from CudaAttention by {rel:.3e}");
        }
    }
}

/// Rows of one document each: the packed kernels mask nothing more than the causal mask, so they
/// give the plain kernels' bits (gemm and flash, out, what forward keeps and dqkv).
#[test]
fn packed_kernels_on_one_document_per_row_give_the_plain_kernels_bits() {
    let Some(device) = gpu() else { return };
    let blas = Arc::new(Blas::new(&device).unwrap());
    let gemm = Packed::new(288, (6, 2), &[&[45], &[45]]);
    let flash = Packed::new(192, (3, 3), &[&[200], &[200]]);
    let inputs = Inputs::new(&device, &gemm, 0, 700);
    let runs = [true, false].map(|packed| run_gemm(&device, &blas, &gemm, &inputs, (0, packed)));
    let inputs_flash = Inputs::new(&device, &flash, OFFSET_BYTES, 710);
    let flash_runs = [true, false].map(|packed| run_flash(&device, &flash, &inputs_flash, packed));
    for (what, [packed, plain]) in [("gemm", runs), ("flash", flash_runs)] {
        assert!(bits(&packed.out) == bits(&plain.out), "{what}: out differs");
        assert!(bits(&packed.kept) == bits(&plain.kept), "{what}: att / lse differs");
        assert!(bits(&packed.dqkv) == bits(&plain.dqkv), "{what}: dqkv differs");
        println!("RESULT packed_{what} one document per row: the plain kernels' bits");
    }
}

/// Consecutive ranges of a flat buffer, each starting at a multiple of 64 elements.
#[derive(Default)]
struct Bump(usize);

impl Bump {
    fn take(&mut self, len: usize) -> Range<usize> {
        let start = self.0.next_multiple_of(64);
        self.0 = start + len;
        start..self.0
    }
}

/// Random values in ±`bound`, rounded to bf16, widened.
fn random_values(len: usize, bound: f64, seed: u64) -> Vec<f64> {
    widen(&random_bf16(len, bound, seed))
}

/// GPT-2's encoder on packed rows, forward and backward, in one plan run by the CUDA executor:
/// the weights and `dout` placed in the parameter buffer, `out` and the gradients (starting at
/// random values, which backward adds to) in the gradient buffer.
fn check_encoder(device: &CudaDevice, rows: &[&[usize]], c: usize, seed: u64) {
    let (batch, t, vocab) = (rows.len(), sum(rows[0]), 11);
    let n = batch * t;
    let positions = positions_of(rows);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let tokens: Vec<u32> = (0..n).map(|_| rng.random_range(0..vocab as u32)).collect();
    let (wte, wpe) = (random_values(vocab * c, 1.0, seed + 1), random_values(t * c, 1.0, seed + 2));
    let dout = random_values(n * c, 1.0, seed + 3);
    let (dwte0, dwpe0) =
        (random_values(vocab * c, 0.5, seed + 4), random_values(t * c, 0.5, seed + 5));
    let (mut params, mut grads) = (Bump::default(), Bump::default());
    let (wte_at, wpe_at, dout_at) =
        (params.take(wte.len()), params.take(wpe.len()), params.take(n * c));
    let (out_at, dwte_at, dwpe_at) =
        (grads.take(n * c), grads.take(dwte0.len()), grads.take(dwpe0.len()));
    let (g, p) = (Buf::Grads, Buf::Params);
    let (ids, at) = (read(Buf::Inputs, &(0..n)), read(Buf::Positions, &(0..n)));
    let forward =
        vec![write(g, &out_at), ids.clone(), read(p, &wte_at), read(p, &wpe_at), at.clone()];
    let backward = vec![update(g, &dwte_at), update(g, &dwpe_at), read(p, &dout_at), ids, at];
    let launches = [
        Launch::<NoLayers> { kernel: Kernel::Encoder { t, c, vocab }, args: forward },
        Launch { kernel: Kernel::EncoderBackward { t, c }, args: backward },
    ];
    let loss = 0..1;
    let plan = Plan {
        batch,
        seq: t,
        acts_len: loss.end,
        forward: Vec::new(),
        backward: launches.into_iter().map(Step::Launch).collect(),
        loss: loss.clone(),
        f32_acts: vec![loss],
    };
    let len = params.0.max(grads.0).next_multiple_of(64);
    let fill = |values: &[(&Range<usize>, &[f64])]| {
        let mut flat = vec![bf16::ZERO; len];
        for (range, v) in values {
            for (slot, &x) in flat[(*range).clone()].iter_mut().zip(*v) {
                *slot = bf16::from_f64(x);
            }
        }
        device.upload(&flat).unwrap()
    };
    let params_gpu = fill(&[(&wte_at, &wte[..]), (&wpe_at, &wpe[..]), (&dout_at, &dout[..])]);
    let grads_gpu = fill(&[(&dwte_at, &dwte0[..]), (&dwpe_at, &dwpe0[..])]);
    let blas = Arc::new(Blas::new(device).unwrap());
    let mut runner = CudaRunner::new(device, blas, plan, len, false, ()).unwrap();
    runner.set_packed_batch(&tokens, &tokens, &positions, vocab).unwrap();
    runner.backward(&params_gpu, &grads_gpu, 1.0, |_| {}).unwrap();
    device.synchronize().unwrap();
    let gpu: Vec<f64> = device.download(&grads_gpu).unwrap().iter().map(|x| x.to_f64()).collect();

    let position = |row: usize| positions[row] as usize;
    let mut out = vec![0.0; n * c];
    encoder_forward_at(&mut out, &tokens, &wte, &wpe, c, vocab, position).unwrap();
    let (mut dwte, mut dwpe) = (dwte0, dwpe0);
    encoder_backward_at(&mut dwte, &mut dwpe, &dout, &tokens, c, position);
    for (what, range, expected) in
        [("out", &out_at, &out), ("dwte", &dwte_at, &dwte), ("dwpe", &dwpe_at, &dwpe)]
    {
        let rel = relative_error(&gpu[range.clone()], expected);
        println!("RESULT packed_encoder {what} B{batch} T{t} c{c} docs{rows:?} rel={rel:.3e}");
        assert!(rel <= ENCODER_TOLERANCE, "encoder {what} c{c}: off by {rel:.3e} (relative)");
    }
}

/// Widths 200 (the 16-byte path) and 10 (the scalar path), repeated tokens, documents of one
/// token, rows whose longest document ends before the row (positions past it get no gradient).
#[test]
fn packed_encoder_forward_and_backward_match_the_cpu_twin() {
    let Some(device) = gpu() else { return };
    check_encoder(&device, &[&[1, 17, 1, 18], &[5, 1, 31], &[37]], 200, 800);
    check_encoder(&device, &[&[3, 1, 4], &[1, 1, 6]], 10, 810);
}
