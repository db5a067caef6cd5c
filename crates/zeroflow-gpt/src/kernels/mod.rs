//! GPT-2's own kernels, beside zeroflow-nn's shared ones: LayerNorm and GELU, pure functions over
//! slices generic over [`Float`], and [`GptKernel`], their launches in the plan.

pub mod gelu;
pub mod layernorm;

use zeroflow_nn::{ArgSlices, Float, Fusable, LayerKernel};

/// A launch of the plan: a shared kernel of zeroflow-nn or one of GPT-2's.
pub type Kernel = zeroflow_nn::Kernel<GptKernel>;

/// One launch of a GPT-2 kernel and its sizes. The comment lists the arguments in order (W:
/// written or updated, R: read).
#[derive(Clone, Debug, PartialEq)]
pub enum GptKernel {
    /// W out, W mean, W rstd, R inp, R weight, R bias.
    LayerNorm { c: usize },
    /// W dinp, W dweight, W dbias, R dout, R inp, R weight, R mean, R rstd.
    LayerNormBackward { c: usize },
    /// W out, R inp.
    Gelu,
    /// W dinp, R inp, R dout.
    GeluBackward,
}

impl LayerKernel for GptKernel {
    fn name(&self) -> &'static str {
        match self {
            GptKernel::LayerNorm { .. } => "layernorm_forward",
            GptKernel::LayerNormBackward { .. } => "layernorm_backward",
            GptKernel::Gelu => "gelu_forward",
            GptKernel::GeluBackward => "gelu_backward",
        }
    }

    fn run<F: Float>(&self, a: &mut ArgSlices<'_, F>) -> Result<(), String> {
        match *self {
            GptKernel::LayerNorm { c } => {
                let (out, mean, rstd) = (a.write(0), a.write(1), a.write(2));
                layernorm::layernorm_forward(out, mean, rstd, a.read(3), a.read(4), a.read(5), c);
            }
            GptKernel::LayerNormBackward { c } => {
                let (dinp, dweight, dbias) = (a.write(0), a.write(1), a.write(2));
                let (dout, inp, weight, mean, rstd) =
                    (a.read(3), a.read(4), a.read(5), a.read(6), a.read(7));
                layernorm::layernorm_backward(
                    dinp, dweight, dbias, dout, inp, weight, mean, rstd, c,
                );
            }
            GptKernel::Gelu => gelu::gelu_forward(a.write(0), a.read(1)),
            GptKernel::GeluBackward => gelu::gelu_backward(a.write(0), a.read(1), a.read(2)),
        }
        Ok(())
    }

    fn fusable(&self) -> Option<Fusable> {
        match self {
            GptKernel::Gelu => Some(Fusable::Gelu),
            GptKernel::GeluBackward => Some(Fusable::GeluBackward),
            GptKernel::LayerNorm { .. } | GptKernel::LayerNormBackward { .. } => None,
        }
    }
}
