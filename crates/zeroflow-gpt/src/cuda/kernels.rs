//! GPT-2's own CUDA kernels (`kernels/layernorm.cu`, `kernels/gelu.cu`): their sources, loaded
//! once per model, and how they run the plan's [`GptKernel`] launches on zeroflow-nn's executor
//! ([`CudaLayers`]).

use zeroflow_device::cuda::{CudaFunction, KernelParams};
use zeroflow_device::{CudaDevice, DeviceError};
use zeroflow_nn::NnError;
use zeroflow_nn::cuda::kernels::{COMMON, ROWS_PER_BLOCK, ROWS_PER_CHUNK, THREADS, chunks_for};
use zeroflow_nn::cuda::schedule::Place;
use zeroflow_nn::cuda::{CudaLayerKernel, CudaLayers, LayerCtx};

use crate::kernels::GptKernel;

/// The sources of GPT-2's modules, each compiled after zeroflow-nn's shared header
/// ([`COMMON`]): [`sources`] puts them together.
const OWN_SOURCES: [(&str, &str); 2] = [
    ("gpt_layernorm", include_str!("../../kernels/layernorm.cu")),
    ("gpt_gelu", include_str!("../../kernels/gelu.cu")),
];

/// Each module's name and source (zeroflow-nn's shared header first).
pub fn sources() -> [(&'static str, String); 2] {
    OWN_SOURCES.map(|(name, source)| (name, format!("{COMMON}{source}")))
}

/// Every kernel of GPT-2's own, looked up once.
#[derive(Debug)]
pub struct GptKernels {
    pub layernorm_forward: CudaFunction,
    pub layernorm_backward_input: CudaFunction,
    pub layernorm_param_grads_partial: CudaFunction,
    pub gelu_forward: CudaFunction,
    pub gelu_backward: CudaFunction,
}

impl GptKernels {
    /// Compiles (or takes from the kernel cache) and loads the model's modules.
    pub fn load(device: &CudaDevice) -> Result<Self, DeviceError> {
        let [layernorm, gelu] = sources().map(|(name, source)| device.load_module(name, &source));
        let (layernorm, gelu) = (layernorm?, gelu?);
        Ok(GptKernels {
            layernorm_forward: layernorm.function("layernorm_forward")?,
            layernorm_backward_input: layernorm.function("layernorm_backward_input")?,
            layernorm_param_grads_partial: layernorm.function("layernorm_param_grads_partial")?,
            gelu_forward: gelu.function("gelu_forward")?,
            gelu_backward: gelu.function("gelu_backward")?,
        })
    }
}

impl CudaLayerKernel for GptKernel {
    /// LayerNorm's backward sums its weight and bias gradients through the partials: `2c`
    /// columns per chunk of rows.
    fn column_partials_len(&self, args: &[Place]) -> usize {
        match *self {
            GptKernel::LayerNormBackward { c } => chunks_for(args[0].len / c) * 2 * c,
            _ => 0,
        }
    }
}

impl CudaLayers<GptKernel> for GptKernels {
    fn run(&self, ctx: &LayerCtx<'_>, kernel: &GptKernel, a: &[Place]) -> Result<(), NnError> {
        match *kernel {
            GptKernel::LayerNorm { c } => self.layernorm_forward(ctx, a, c),
            GptKernel::LayerNormBackward { c } => self.layernorm_backward(ctx, a, c),
            // SAFETY: `gelu_forward(bf16_t* out, const bf16_t* inp, u64 n, u32 vec)` is an
            // element-wise kernel of the form `elementwise` asks for, its output first.
            GptKernel::Gelu => unsafe { ctx.elementwise(&self.gelu_forward, a, 1, &[]) },
            GptKernel::GeluBackward => {
                let flags = [a[0].accumulate];
                // SAFETY: `gelu_backward(bf16_t* dinp, const bf16_t* inp, const bf16_t* dout, u64
                // n, u32 vec, u32 accumulate)`: element-wise, its output first, one flag.
                unsafe { ctx.elementwise(&self.gelu_backward, a, 1, &flags) }
            }
        }
    }
}

fn flag(value: bool) -> u32 {
    u32::from(value)
}

impl GptKernels {
    /// [out, mean, rstd, inp, weight, bias]
    fn layernorm_forward(&self, ctx: &LayerCtx<'_>, a: &[Place], c: usize) -> Result<(), NnError> {
        let rows = a[0].len / c;
        let [out, mean, rstd, inp, weight, bias] = [0, 1, 2, 3, 4, 5].map(|i| &a[i]);
        let vec = c.is_multiple_of(8) && ctx.aligned(&[out, inp, weight, bias]);
        let params = ctx
            .places(&[out, mean, rstd], &[inp, weight, bias])
            .u32(rows as u32)
            .u32(c as u32)
            .u32(flag(vec));
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        // SAFETY: the parameters match `layernorm_forward(bf16_t* out, float* mean, float* rstd,
        // const bf16_t* inp, const bf16_t* weight, const bf16_t* bias, u32 rows, u32 c, u32
        // vec)`; each warp normalises one of the `rows` rows of `c` of inp into out and writes its
        // mean and rstd (f32 places), reading `c` of weight and bias; `vec` only where every bf16
        // place is 16-byte aligned and `c` a multiple of 8.
        unsafe { ctx.launch(&self.layernorm_forward, grid, THREADS, params) }
    }

    /// [dinp, dweight, dbias, dout, inp, weight, mean, rstd]
    fn layernorm_backward(&self, ctx: &LayerCtx<'_>, a: &[Place], c: usize) -> Result<(), NnError> {
        let rows = a[0].len / c;
        let [dinp, dweight, dbias, dout, inp, weight, mean, rstd] =
            [0, 1, 2, 3, 4, 5, 6, 7].map(|i| &a[i]);
        let vec = c.is_multiple_of(8) && ctx.aligned(&[dinp, dout, inp, weight]);
        let params = ctx
            .places(&[dinp], &[dout, inp, weight, mean, rstd])
            .u32(rows as u32)
            .u32(c as u32)
            .u32(flag(vec))
            .u32(flag(a[0].accumulate));
        let grid = rows.div_ceil(ROWS_PER_BLOCK as usize) as u32;
        // SAFETY: the parameters match `layernorm_backward_input(bf16_t* dinp, const bf16_t*
        // dout, const bf16_t* inp, const bf16_t* weight, const float* mean, const float* rstd, u32
        // rows, u32 c, u32 vec, u32 accumulate)`; each warp writes (or adds to) one row of dinp
        // from the same row of dout and inp and its statistics.
        unsafe { ctx.launch(&self.layernorm_backward_input, grid, THREADS, params) }?;
        let chunks = chunks_for(rows);
        let partials = ctx.column_partials();
        if chunks * 2 * c > partials.len() {
            return Err(NnError::Kernel {
                kernel: "layernorm_backward",
                reason: format!("{chunks} chunks of 2 × {c} columns exceed the partials"),
            });
        }
        let params = KernelParams::new().slice_mut(partials);
        let params = [dout, inp, mean, rstd].iter().fold(params, |p, place| ctx.read(p, place));
        let params = params.u32(rows as u32).u32(c as u32).u32(ROWS_PER_CHUNK as u32);
        let grid = (c.div_ceil(32) as u32, chunks as u32);
        // SAFETY: the parameters match `layernorm_param_grads_partial(float* partial, const
        // bf16_t* dout, const bf16_t* inp, const float* mean, const float* rstd, u32 rows, u32 c,
        // u32 rows_per_chunk)`; block (x, y) reads the rows of chunk y of columns 32x .. 32x + 31
        // and writes `partial[y · 2c + column]` and `partial[y · 2c + c + column]`, inside the
        // partials (checked above).
        unsafe { ctx.launch(&self.layernorm_param_grads_partial, grid, (32, 8), params) }?;
        ctx.column_sum_finish(ctx.bf16_mut(dweight), 0, chunks, 2 * c, c)?;
        ctx.column_sum_finish(ctx.bf16_mut(dbias), c, chunks, 2 * c, c)
    }
}
