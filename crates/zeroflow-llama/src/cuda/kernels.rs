//! The Llama family's own CUDA kernels (`kernels/rmsnorm.cu`, `kernels/rope.cu`,
//! `kernels/pointwise.cu`): their sources, loaded once per model, and how they run the plan's
//! [`LlamaKernel`] launches on zeroflow-nn's executor ([`CudaLayers`]). bf16 storage, f32 maths,
//! the twins of [`crate::kernels`]:
//!
//! - RMSNorm: one warp per row forward (`rstd` kept in f32) and for the input's gradient; the
//!   weight's gradient by column sums over chunks of rows (the executor's column partials), added
//!   to the bf16 gradient once, in a fixed order.
//! - RoPE: one kernel rotates q and k and packs them with v into attention's `qkv` row (and one
//!   back), from a cos/sin table of every (position, pair) made on the host as the CPU twin makes
//!   its angles, in f32; with packed rows their `_packed` forms, which rotate each token by its
//!   position in its document (the plan's positions, the launch's last argument).
//! - SwiGLU: element-wise forward and backward.
//! - The token embedding: a gather forward; backward is zeroflow-nn's deterministic bucketed sum
//!   ([`LayerCtx::token_embedding_backward`]).

use zeroflow_device::cuda::{CudaBuffer, CudaFunction, CudaModule, KernelParams};
use zeroflow_device::{CudaDevice, Device, DeviceBuffer};
use zeroflow_nn::NnError;
use zeroflow_nn::cuda::kernels::{
    COMMON, ROWS_PER_BLOCK, ROWS_PER_CHUNK, THREADS, blocks_for, chunks_for,
};
use zeroflow_nn::cuda::schedule::Place;
use zeroflow_nn::cuda::{CudaLayerKernel, CudaLayers, LayerCtx};
use zeroflow_nn::kernels::Kernel;

use crate::kernels::{LlamaKernel, Rotary};
use crate::plan::Plan;

/// The sources of the family's modules, each compiled after zeroflow-nn's shared header
/// ([`COMMON`]): [`sources`] puts them together.
const OWN_SOURCES: [(&str, &str); 3] = [
    ("llama_rmsnorm", include_str!("../../kernels/rmsnorm.cu")),
    ("llama_rope", include_str!("../../kernels/rope.cu")),
    ("llama_pointwise", include_str!("../../kernels/pointwise.cu")),
];

/// Each module's name and source (zeroflow-nn's shared header first).
pub fn sources() -> [(&'static str, String); 3] {
    OWN_SOURCES.map(|(name, source)| (name, format!("{COMMON}{source}")))
}

/// Every kernel name of each module of [`sources`], in the same order.
pub const KERNEL_NAMES: [&[&str]; 3] = [
    &["rmsnorm_forward", "rmsnorm_backward_input", "rmsnorm_weight_grad_partial"],
    &["rope_forward", "rope_backward", "rope_forward_packed", "rope_backward_packed"],
    &["swiglu_forward", "swiglu_backward", "embedding_forward"],
];

/// Every kernel of the family's own, looked up once, and the rotary table of the plan.
#[derive(Debug)]
pub struct LlamaKernels {
    rmsnorm_forward: CudaFunction,
    rmsnorm_backward_input: CudaFunction,
    rmsnorm_weight_grad_partial: CudaFunction,
    rope_forward: CudaFunction,
    rope_backward: CudaFunction,
    rope_forward_packed: CudaFunction,
    rope_backward_packed: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    embedding_forward: CudaFunction,
    /// The plan's rotary shape (every `Rope` launch's is the same) and its cos/sin table.
    rope: Option<(Rotary, CudaBuffer<f32>)>,
}

/// The rotary shape of every `Rope` and `RopeBackward` launch of `plan`, or an error if they
/// differ (one table serves them all); `None` for a plan without them.
fn plan_rotary(plan: &Plan) -> Result<Option<Rotary>, NnError> {
    let mut found: Option<Rotary> = None;
    for launch in plan.launches() {
        let (Kernel::Layer(LlamaKernel::Rope(rotary))
        | Kernel::Layer(LlamaKernel::RopeBackward(rotary))) = &launch.kernel
        else {
            continue;
        };
        match &found {
            None => found = Some(rotary.clone()),
            Some(first) if first == rotary => {}
            Some(first) => {
                return Err(NnError::Kernel {
                    kernel: "rope_forward",
                    reason: format!(
                        "the plan's rotary shapes differ ({first:?} and {rotary:?}); the CUDA \
                         kernels take one table for every layer"
                    ),
                });
            }
        }
    }
    Ok(found)
}

/// Elements of the cos/sin table of `rotary`: `2 · t · head_dim / 2`.
fn table_len(rotary: &Rotary) -> usize {
    rotary.t * rotary.head_dim()
}

/// The table `rope.cu` reads: the cosines of every (position `p < t`, pair `i < head_dim / 2`)
/// at `p · head_dim/2 + i`, then the sines. Each angle is `f32(inv_freq[i]) · f32(p)` and its
/// cosine and sine are taken in f32, as the CPU twin does in f32.
pub fn rope_table(rotary: &Rotary) -> Vec<f32> {
    let inv_freq = rotary.freqs.inv_freq();
    let angles = || (0..rotary.t).flat_map(|p| inv_freq.iter().map(move |&f| f as f32 * p as f32));
    angles().map(f32::cos).chain(angles().map(f32::sin)).collect()
}

/// Bytes of GPU memory [`LlamaKernels`] holds for `plan`: the rotary table.
pub fn table_bytes(plan: &Plan) -> Result<usize, NnError> {
    Ok(plan_rotary(plan)?.map_or(0, |rotary| table_len(&rotary) * size_of::<f32>()))
}

impl LlamaKernels {
    /// Compiles (or takes from the kernel cache) and loads the family's modules, and uploads the
    /// rotary table of `plan`'s `Rope` launches.
    pub fn load(device: &CudaDevice, plan: &Plan) -> Result<Self, NnError> {
        let [rmsnorm, rope, pointwise] =
            sources().map(|(name, source)| device.load_module(name, &source));
        let (rmsnorm, rope, pointwise) = (rmsnorm?, rope?, pointwise?);
        let rotary = match plan_rotary(plan)? {
            Some(rotary) => {
                let table = device.upload(&rope_table(&rotary))?;
                Some((rotary, table))
            }
            None => None,
        };
        let function =
            |module: &CudaModule, name: &str| module.function(name).map_err(NnError::from);
        Ok(LlamaKernels {
            rmsnorm_forward: function(&rmsnorm, "rmsnorm_forward")?,
            rmsnorm_backward_input: function(&rmsnorm, "rmsnorm_backward_input")?,
            rmsnorm_weight_grad_partial: function(&rmsnorm, "rmsnorm_weight_grad_partial")?,
            rope_forward: function(&rope, "rope_forward")?,
            rope_backward: function(&rope, "rope_backward")?,
            rope_forward_packed: function(&rope, "rope_forward_packed")?,
            rope_backward_packed: function(&rope, "rope_backward_packed")?,
            swiglu_forward: function(&pointwise, "swiglu_forward")?,
            swiglu_backward: function(&pointwise, "swiglu_backward")?,
            embedding_forward: function(&pointwise, "embedding_forward")?,
            rope: rotary,
        })
    }

    /// Bytes of GPU memory these kernels hold (the rotary table).
    pub fn bytes(&self) -> usize {
        self.rope.as_ref().map_or(0, |(_, table)| table.len() * size_of::<f32>())
    }

    /// The table of `rotary`, which must be the plan's.
    fn table(&self, rotary: &Rotary) -> Result<&CudaBuffer<f32>, NnError> {
        match &self.rope {
            Some((loaded, table)) if loaded == rotary => Ok(table),
            _ => Err(NnError::Kernel {
                kernel: "rope_forward",
                reason: format!("no rotary table for {rotary:?}: it is not the plan's"),
            }),
        }
    }
}

impl CudaLayerKernel for LlamaKernel {
    /// RMSNorm's backward sums its weight gradient through the partials: `c` columns per chunk
    /// of rows.
    fn column_partials_len(&self, args: &[Place]) -> usize {
        match *self {
            LlamaKernel::RmsNormBackward { c } => chunks_for(args[0].len / c) * c,
            _ => 0,
        }
    }
}

impl CudaLayers<LlamaKernel> for LlamaKernels {
    fn run(&self, ctx: &LayerCtx<'_>, kernel: &LlamaKernel, a: &[Place]) -> Result<(), NnError> {
        match *kernel {
            LlamaKernel::Embedding { c, .. } => self.embedding_forward(ctx, a, c),
            LlamaKernel::EmbeddingBackward { c } => {
                // [dwte, dout, tokens]: the tokens must be the inputs (at 0 of the token ids),
                // whose buckets `set_batch` sorted.
                if a[2].offset != 0 {
                    return Err(NnError::Kernel {
                        kernel: "embedding_backward",
                        reason: "the tokens are not the batch's inputs".into(),
                    });
                }
                ctx.token_embedding_backward(&a[0], &a[1], c)
            }
            LlamaKernel::RmsNorm { c, eps } => self.rmsnorm_forward(ctx, a, c, eps),
            LlamaKernel::RmsNormBackward { c } => self.rmsnorm_backward(ctx, a, c),
            LlamaKernel::Rope(ref rotary) => self.rope(ctx, a, rotary, false),
            LlamaKernel::RopeBackward(ref rotary) => self.rope(ctx, a, rotary, true),
            // SAFETY: `swiglu_forward(bf16_t* out, const bf16_t* gate, const bf16_t* up, u64 n,
            // u32 vec)` is an element-wise kernel of the form `elementwise` asks for, its output
            // first.
            LlamaKernel::SwiGlu => unsafe { ctx.elementwise(&self.swiglu_forward, a, 1, &[]) },
            LlamaKernel::SwiGluBackward => {
                let flags = [a[0].accumulate, a[1].accumulate];
                // SAFETY: `swiglu_backward(bf16_t* dgate, bf16_t* dup, const bf16_t* dout, const
                // bf16_t* gate, const bf16_t* up, u64 n, u32 vec, u32 accumulate_gate, u32
                // accumulate_up)`: element-wise, its two outputs first, two flags.
                unsafe { ctx.elementwise(&self.swiglu_backward, a, 2, &flags) }
            }
        }
    }
}

fn flag(value: bool) -> u32 {
    u32::from(value)
}

impl LlamaKernels {
    /// [out, tokens, wte]
    fn embedding_forward(&self, ctx: &LayerCtx<'_>, a: &[Place], c: usize) -> Result<(), NnError> {
        let [out, tokens, wte] = [0, 1, 2].map(|i| &a[i]);
        let rows = out.len / c;
        let vec = c.is_multiple_of(8) && ctx.aligned(&[out, wte]);
        let params = ctx.places(&[out], &[tokens, wte]).u32(rows as u32).u32(c as u32);
        let params = params.u32(flag(vec));
        let work = if vec { rows * c / 8 } else { rows * c };
        // SAFETY: the parameters match `embedding_forward(bf16_t* out, const u32* tokens, const
        // bf16_t* wte, u32 rows, u32 c, u32 vec)`; it writes the `rows` rows of `c` of out and
        // reads as many token ids (a place of the token ids) and rows of wte (the ids were
        // checked against the vocabulary on upload, and wte holds `vocab` rows); `vec` only where
        // out and wte are 16-byte aligned and `c` a multiple of 8.
        unsafe { ctx.launch(&self.embedding_forward, blocks_for(work), THREADS, params) }
    }

    /// [out, rstd, inp, weight]
    fn rmsnorm_forward(
        &self,
        ctx: &LayerCtx<'_>,
        a: &[Place],
        c: usize,
        eps: f64,
    ) -> Result<(), NnError> {
        let [out, rstd, inp, weight] = [0, 1, 2, 3].map(|i| &a[i]);
        let rows = out.len / c;
        let vec = c.is_multiple_of(8) && ctx.aligned(&[out, inp, weight]);
        let params = ctx.places(&[out, rstd], &[inp, weight]).u32(rows as u32).u32(c as u32);
        let params = params.u32(flag(vec)).f32(eps as f32);
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        // SAFETY: the parameters match `rmsnorm_forward(bf16_t* out, float* rstd, const bf16_t*
        // inp, const bf16_t* weight, u32 rows, u32 c, u32 vec, float eps)`; each warp normalises
        // one of the `rows` rows of `c` of inp into out and writes its rstd (an f32 place of
        // `rows`), reading `c` of weight; `vec` only where every bf16 place is 16-byte aligned
        // and `c` a multiple of 8.
        unsafe { ctx.launch(&self.rmsnorm_forward, grid, THREADS, params) }
    }

    /// [dinp, dweight, dout, inp, weight, rstd]
    fn rmsnorm_backward(&self, ctx: &LayerCtx<'_>, a: &[Place], c: usize) -> Result<(), NnError> {
        let [dinp, dweight, dout, inp, weight, rstd] = [0, 1, 2, 3, 4, 5].map(|i| &a[i]);
        let rows = dinp.len / c;
        let vec = c.is_multiple_of(8) && ctx.aligned(&[dinp, dout, inp, weight]);
        let params = ctx.places(&[dinp], &[dout, inp, weight, rstd]).u32(rows as u32);
        let params = params.u32(c as u32).u32(flag(vec)).u32(flag(dinp.accumulate));
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        // SAFETY: the parameters match `rmsnorm_backward_input(bf16_t* dinp, const bf16_t* dout,
        // const bf16_t* inp, const bf16_t* weight, const float* rstd, u32 rows, u32 c, u32 vec,
        // u32 accumulate)`; each warp writes (or adds to) one row of dinp from the same row of
        // dout and inp and its rstd, reading `c` of weight.
        unsafe { ctx.launch(&self.rmsnorm_backward_input, grid, THREADS, params) }?;
        let chunks = chunks_for(rows);
        let partials = ctx.column_partials();
        if chunks * c > partials.len() {
            return Err(NnError::Kernel {
                kernel: "rmsnorm_backward",
                reason: format!("{chunks} chunks of {c} columns exceed the partials"),
            });
        }
        let params = KernelParams::new().slice_mut(partials);
        let params = [dout, inp, rstd].iter().fold(params, |p, place| ctx.read(p, place));
        let params = params.u32(rows as u32).u32(c as u32).u32(ROWS_PER_CHUNK as u32);
        let grid = (c.div_ceil(32) as u32, chunks as u32);
        // SAFETY: the parameters match `rmsnorm_weight_grad_partial(float* partial, const bf16_t*
        // dout, const bf16_t* inp, const float* rstd, u32 rows, u32 c, u32 rows_per_chunk)`;
        // block (x, y) reads the rows of chunk y of columns 32x .. 32x + 31 and writes
        // `partial[y · c + column]`, inside the partials (checked above).
        unsafe { ctx.launch(&self.rmsnorm_weight_grad_partial, grid, (32, 8), params) }?;
        ctx.column_sum_finish(ctx.bf16_mut(dweight), 0, chunks, c, c)
    }

    /// Forward [qkv, q, k, v, (positions)], or backward [dq, dk, dv, dqkv, (positions)].
    fn rope(
        &self,
        ctx: &LayerCtx<'_>,
        a: &[Place],
        rotary: &Rotary,
        backward: bool,
    ) -> Result<(), NnError> {
        let table = self.table(rotary)?;
        let qkv = if backward { &a[3] } else { &a[0] };
        let rows = qkv.len / rotary.qkv_width();
        let (half, kv_width) = (rotary.head_dim() / 2, rotary.kv_width());
        let per_row = (rotary.n_head + rotary.n_kv_head) * half + kv_width;
        let params = if backward {
            ctx.places(&[&a[0], &a[1], &a[2]], &[&a[3]])
        } else {
            ctx.places(&[&a[0]], &[&a[1], &a[2], &a[3]])
        };
        // Packed rows: the positions come before the table.
        let positions = a.get(4);
        let params = match positions {
            Some(positions) => ctx.read(params, positions),
            None => params,
        };
        let params = params.ptr(table, 0).u32(rows as u32).u32(rotary.t as u32);
        let params = params
            .u32(rotary.n_head as u32)
            .u32(rotary.n_kv_head as u32)
            .u32(rotary.head_dim() as u32);
        let grid = blocks_for(rows * per_row);
        let (forward_kernel, backward_kernel) = match positions {
            None => (&self.rope_forward, &self.rope_backward),
            Some(_) => (&self.rope_forward_packed, &self.rope_backward_packed),
        };
        if backward {
            let params = [0, 1, 2].iter().fold(params, |p, &i| p.u32(flag(a[i].accumulate)));
            // SAFETY: the parameters match `rope_backward(bf16_t* dq, bf16_t* dk, bf16_t* dv,
            // const bf16_t* dqkv, const float* table, u32 rows, u32 t, u32 n_head, u32
            // n_kv_head, u32 head_dim, u32 accumulate_q, u32 accumulate_k, u32 accumulate_v)`,
            // or with positions `rope_backward_packed` (`const u32* positions` before the table);
            // it reads the `rows` rows of `W = qkv_width` of dqkv (its place) and writes (or adds
            // to) as many rows of `n_head · d` of dq and of `n_kv_head · d` of dk and dv (their
            // places, the plan's for these sizes), reading `t · d` entries of the table (ours,
            // made for this rotary shape) and, packed, `rows` positions (a place of the token
            // ids, checked by the plan: each below `t`, so the entries read are those the plain
            // kernel reads).
            unsafe { ctx.launch(backward_kernel, grid, THREADS, params) }
        } else {
            // SAFETY: the parameters match `rope_forward(bf16_t* qkv, const bf16_t* q, const
            // bf16_t* k, const bf16_t* v, const float* table, u32 rows, u32 t, u32 n_head, u32
            // n_kv_head, u32 head_dim)`, or with positions `rope_forward_packed` (`const u32*
            // positions` before the table); it writes the `rows` rows of `W` of qkv and reads as
            // many rows of q, k and v (their places), `t · d` entries of the table and, packed,
            // `rows` positions, as backward.
            unsafe { ctx.launch(forward_kernel, grid, THREADS, params) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{rope_table, table_len};
    use crate::kernels::Rotary;
    use crate::rope::RopeFreqs;

    /// The table holds the cosines then the sines of every (position, pair), position-major, in
    /// f32: position 0 rotates by nothing, and each entry is the angle of its pair.
    #[test]
    fn the_rope_table_holds_cosines_then_sines_position_major() {
        let freqs = RopeFreqs { head_dim: 6, theta: 50.0, scaling: None };
        let rotary = Rotary { t: 5, n_head: 2, n_kv_head: 1, freqs: freqs.clone() };
        let table = rope_table(&rotary);
        assert_eq!(table.len(), table_len(&rotary));
        assert_eq!(table.len(), 2 * 5 * 3);
        let inv_freq = freqs.inv_freq();
        let (cosines, sines) = table.split_at(15);
        assert!(cosines[..3].iter().all(|&c| c == 1.0) && sines[..3].iter().all(|&s| s == 0.0));
        for p in 0..5 {
            for i in 0..3 {
                let angle = inv_freq[i] as f32 * p as f32;
                assert_eq!(cosines[p * 3 + i], angle.cos(), "cos p{p} i{i}");
                assert_eq!(sines[p * 3 + i], angle.sin(), "sin p{p} i{i}");
            }
        }
    }
}
