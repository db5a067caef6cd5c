//! The plan IR: a model as a list of kernel launches over four flat buffers (parameters,
//! gradients, activations, activation gradients) and the token buffers (inputs, targets and, in
//! a packed plan, positions), for one (batch, sequence length). A model family builds its
//! [`Plan`] from its shapes and parameter layout; the executors run any plan:
//!
//! - [`crate::host::HostRunner`] on host vectors, in any [`crate::Float`] (the f64 oracle);
//! - [`crate::cpu::CpuRunner`] on the `CpuDevice`'s compute stream, in f32;
//! - [`crate::cuda::CudaRunner`] on a GPU, through a schedule ([`crate::cuda::schedule`]) that
//!   places the plan's ranges in the GPU's buffers.
//!
//! Every launch names its kernel ([`Kernel`], with the family's own kernels as
//! [`Kernel::Layer`]) and its arguments in the order the kernel documents.

use std::ops::Range;

use crate::error::NnError;
use crate::kernels::{Kernel, LayerKernel};

/// The buffers a launch can touch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The flat parameter buffer (read-only to the model).
    Params,
    /// The flat gradient buffer (the model adds to it).
    Grads,
    /// The activations of the current micro-batch.
    Acts,
    /// The gradients of the activations (same layout as `Acts`).
    ActGrads,
    /// Input token ids `[batch, seq]`.
    Inputs,
    /// Target token ids `[batch, seq]`.
    Targets,
    /// Each token's position in its own document, `[batch, seq]`, read only by a packed plan
    /// ([`PlanOptions::packed`]): 0 at a document's first token in the row, then 1, 2, ... A
    /// query at row index `t` attends the keys `t − positions[t] ..= t` only (its document's
    /// tokens up to its own), and the position embedding (GPT-2's `wpe`, the Llama family's
    /// rotation) is that of `positions[t]` rather than of `t`.
    Positions,
}

/// How a launch uses an argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Overwritten.
    Write,
    /// Read and updated in place (gradient accumulation: `+=`).
    Update,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arg {
    pub buf: Buf,
    pub range: Range<usize>,
    pub access: Access,
}

/// A forward's opening of the flat weights (the runners' `forward_opening`): before each launch,
/// `open(end)` where the launch reads weights up to `end` beyond those opened so far.
pub(crate) fn open_before(
    opened: &mut usize,
    params_end: Option<usize>,
    open: &mut dyn FnMut(usize),
) {
    if let Some(end) = params_end.filter(|&end| end > *opened) {
        open(end);
        *opened = end;
    }
}

/// An argument `range` of `buf` that the launch reads.
pub fn read(buf: Buf, range: &Range<usize>) -> Arg {
    Arg { buf, range: range.clone(), access: Access::Read }
}

/// An argument `range` of `buf` that the launch overwrites.
pub fn write(buf: Buf, range: &Range<usize>) -> Arg {
    Arg { buf, range: range.clone(), access: Access::Write }
}

/// An argument `range` of `buf` that the launch adds to.
pub fn update(buf: Buf, range: &Range<usize>) -> Arg {
    Arg { buf, range: range.clone(), access: Access::Update }
}

/// One kernel launch and its arguments, in the order [`Kernel`] documents.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch<X> {
    pub kernel: Kernel<X>,
    pub args: Vec<Arg>,
}

/// Which parameters a [`GradsReady`] notice is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradGroup {
    /// The final norm (GPT-2's `transformer.ln_f.*`).
    FinalNorm,
    /// Transformer block `i` (GPT-2's `transformer.h.{i}.*`).
    Block(usize),
    /// The token and position embeddings (GPT-2's `transformer.wte`, `transformer.wpe`); a token
    /// embedding tied to the LM head is complete only here, because the head also writes it.
    Embeddings,
}

/// A group of parameters whose gradients are complete: every kernel that adds to them has been
/// queued on the compute stream. Sent during backward, in backward order (for a transformer:
/// `FinalNorm`, the blocks from last to first, `Embeddings`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GradsReady {
    pub group: GradGroup,
    /// The elements of the flat buffer the group spans, from its first parameter's first element to
    /// its last parameter's last (alignment gaps between them included; they stay zero).
    pub flat_range: Range<usize>,
}

/// One step of backward: a launch, or a notice that a group's gradients are complete.
#[derive(Clone, Debug, PartialEq)]
pub enum Step<X> {
    Launch(Launch<X>),
    GradsReady(GradsReady),
}

impl<X> Step<X> {
    /// The launch, if the step is one.
    pub fn into_launch(self) -> Option<Launch<X>> {
        match self {
            Step::Launch(launch) => Some(launch),
            Step::GradsReady(_) => None,
        }
    }
}

/// How the attention of every block keeps what its backward needs. The CUDA model takes it from
/// its options; the CPU models use [`AttentionKind::Gemm`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// The softmax weights `att [batch, n_head, seq, seq]` ([`Kernel::Attention`]; on the GPU,
    /// `CudaAttention`'s cuBLASLt products and softmax kernels). The default.
    #[default]
    Gemm,
    /// Only the log-sum-exp of each query row, `lse [batch, n_head, seq]`, from which backward
    /// recomputes the weights ([`Kernel::FlashAttention`]; on the GPU, `FlashAttention`, for head
    /// sizes 64 and 128).
    Flash,
}

impl AttentionKind {
    /// Its name in the settings (`--attention`, `zeroflow.attention`): `gemm` or `flash`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionKind::Gemm => "gemm",
            AttentionKind::Flash => "flash",
        }
    }
}

/// How a family builds its plan: the options every family's plan takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PlanOptions {
    /// What each layer's attention keeps for backward.
    pub attention: AttentionKind,
    /// Keep only each layer's output from forward to backward and recompute the rest of the
    /// layer right before its backward ([`crate::checkpoint`]): every layer's internal
    /// activations share one region. Off by default.
    pub activation_checkpointing: bool,
    /// Sequence packing: every row holds several documents, with no attention across their
    /// boundaries and positions restarting at each ([`Buf::Positions`]). The attention, the
    /// position embedding and the rotary embedding read the positions; a plan built without it
    /// reads none and is the same plan as before packing existed. Off by default. Every executor
    /// runs a packed plan (the CUDA one through the packed forms of its kernels).
    pub packed: bool,
}

/// Hands out consecutive ranges of the activation buffer, each starting at a multiple of 16
/// elements (64 bytes of f32).
#[derive(Debug, Default)]
pub struct ActAllocator(usize);

impl ActAllocator {
    /// An allocator whose first range starts at `offset` (or the next multiple of 16): for a
    /// region of a buffer that another allocator handed out.
    pub fn starting_at(offset: usize) -> Self {
        ActAllocator(offset)
    }

    /// The next `len` elements.
    pub fn take(&mut self, len: usize) -> Range<usize> {
        let start = self.0.div_ceil(16) * 16;
        self.0 = start + len;
        start..self.0
    }

    /// Elements handed out so far (the length of the buffer).
    pub fn len(&self) -> usize {
        self.0
    }

    pub fn is_empty(&self) -> bool {
        self.0 == 0
    }
}

/// The launches of forward and backward for micro-batches of `batch` sequences of `seq` tokens,
/// and what the executors must know of the activation buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan<X> {
    pub batch: usize,
    pub seq: usize,
    /// Elements of the activation buffer (and of the activation-gradient buffer).
    pub acts_len: usize,
    pub forward: Vec<Launch<X>>,
    pub backward: Vec<Step<X>>,
    /// The mean loss (one element of the activations).
    pub loss: Range<usize>,
    /// The activation ranges that the CUDA executor keeps in f32 rather than bf16 (norm
    /// statistics, attention's log-sum-exp, the losses, the mean loss), in the order they are
    /// placed in its f32 buffer (a range listed again, as the layers of a checkpointed plan list
    /// the internals they share, is placed once).
    pub f32_acts: Vec<Range<usize>>,
}

impl<X: LayerKernel> Plan<X> {
    /// Tokens per micro-batch.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Whether some launch reads the tokens' positions ([`Buf::Positions`]): the plan was built
    /// for packed rows.
    pub fn is_packed(&self) -> bool {
        self.launches().any(|launch| launch.args.iter().any(|arg| arg.buf == Buf::Positions))
    }

    /// Checks a micro-batch's positions against the plan: a packed plan needs them (`[batch,
    /// seq]`, each 0 at a document's first token in its row and one more than the previous
    /// token's otherwise), a plan built without packing takes none.
    pub fn check_positions(&self, positions: Option<&[u32]>) -> Result<(), NnError> {
        let positions = match (self.is_packed(), positions) {
            (false, None) => return Ok(()),
            (true, Some(positions)) => positions,
            (true, None) => {
                return Err(NnError::Batch(
                    "the plan is packed (PlanOptions::packed): give each token's position in its \
                     document"
                        .into(),
                ));
            }
            (false, Some(_)) => {
                return Err(NnError::Batch(
                    "positions were given to a plan built without packing; build it with \
                     PlanOptions::packed to run packed rows"
                        .into(),
                ));
            }
        };
        if positions.len() != self.tokens() {
            let (expected, found) = (self.tokens(), positions.len());
            return Err(NnError::Length { what: "positions", expected, found });
        }
        for (b, row) in positions.chunks(self.seq).enumerate() {
            let mut previous = None;
            for (t, &position) in row.iter().enumerate() {
                if !(position == 0 || previous == Some(position - 1)) {
                    return Err(NnError::Batch(format!(
                        "position {position} of token {t} of row {b}: a token's position is 0 \
                         at its document's first token in the row and one more than the \
                         previous token's otherwise"
                    )));
                }
                previous = Some(position);
            }
        }
        Ok(())
    }

    /// Every launch of forward and then backward.
    pub fn launches(&self) -> impl Iterator<Item = &Launch<X>> {
        self.forward.iter().chain(self.backward.iter().filter_map(|step| match step {
            Step::Launch(launch) => Some(launch),
            Step::GradsReady(_) => None,
        }))
    }
}

/// A launch that zeroes every activation gradient that `backward` adds to (and no other), to put
/// first: the gradients that backward only overwrites, or never forms, stay as they are.
pub fn zero_accumulated_activation_grads<X>(backward: &[Step<X>]) -> Launch<X> {
    let ranges: Vec<Range<usize>> = backward
        .iter()
        .filter_map(|step| match step {
            Step::Launch(launch) => Some(launch.args.iter()),
            Step::GradsReady(_) => None,
        })
        .flatten()
        .filter(|arg| arg.buf == Buf::ActGrads && arg.access == Access::Update)
        .map(|arg| arg.range.clone())
        .collect();
    zero_launch(ranges)
}

/// A launch that zeroes the activation gradients `ranges` (sorted and merged first).
pub fn zero_launch<X>(mut ranges: Vec<Range<usize>>) -> Launch<X> {
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::new();
    for range in ranges {
        match merged.last_mut() {
            // Ranges start 16-aligned: zero the alignment gap too rather than split.
            Some(last) if range.start <= last.end + 16 => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    let args: Vec<Arg> = merged.iter().map(|range| write(Buf::ActGrads, range)).collect();
    Launch { kernel: Kernel::Zero { ranges: args.len() }, args }
}
