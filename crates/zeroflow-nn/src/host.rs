//! A plan run directly on host vectors, in any [`Float`]: the f64 oracle of the tests (finite
//! differences) and a device-free reference. Launches run synchronously, one after the other.

use std::ops::Range;

use crate::error::NnError;
use crate::float::Float;
use crate::kernels::{self, ArgSlices, LayerKernel, Slot};
use crate::plan::{Access, Buf, GradsReady, Launch, Plan, Step};

/// A plan for one (batch, seq) whose activations live in host vectors.
#[derive(Debug)]
pub struct HostRunner<F, X> {
    padded_len: usize,
    plan: Plan<X>,
    acts: Vec<F>,
    act_grads: Vec<F>,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// Each token's position in its document: `[batch, seq]` for a packed plan, else empty.
    positions: Vec<u32>,
}

/// The buffers one launch may touch.
struct Buffers<'a, F> {
    params: &'a [F],
    grads: &'a mut [F],
    acts: &'a mut [F],
    act_grads: &'a mut [F],
    inputs: &'a [u32],
    targets: &'a [u32],
    positions: &'a [u32],
}

impl<F: Float, X: LayerKernel> HostRunner<F, X> {
    /// Allocates the activations of `plan`, whose flat parameter and gradient buffers have
    /// `padded_len` elements.
    pub fn new(plan: Plan<X>, padded_len: usize) -> Self {
        let len = plan.acts_len;
        HostRunner {
            padded_len,
            acts: vec![F::zero(); len],
            act_grads: vec![F::zero(); len],
            inputs: vec![0; plan.tokens()],
            targets: vec![0; plan.tokens()],
            positions: Vec::new(),
            plan,
        }
    }

    pub fn plan(&self) -> &Plan<X> {
        &self.plan
    }

    /// The activations of the last forward, laid out as the family's plan says.
    pub fn activations(&self) -> &[F] {
        &self.acts
    }

    /// Runs forward on `inputs` → `targets` (each `[batch, seq]`) and returns the mean loss.
    pub fn forward(&mut self, params: &[F], inputs: &[u32], targets: &[u32]) -> Result<F, NnError> {
        self.forward_with(params, inputs, targets, None)
    }

    /// [`HostRunner::forward`] of packed rows (a plan built with
    /// [`crate::plan::PlanOptions::packed`]): `positions [batch, seq]`, each token's position in
    /// its document.
    pub fn forward_packed(
        &mut self,
        params: &[F],
        inputs: &[u32],
        targets: &[u32],
        positions: &[u32],
    ) -> Result<F, NnError> {
        self.forward_with(params, inputs, targets, Some(positions))
    }

    fn forward_with(
        &mut self,
        params: &[F],
        inputs: &[u32],
        targets: &[u32],
        positions: Option<&[u32]>,
    ) -> Result<F, NnError> {
        check_len("parameter buffer", params.len(), self.padded_len)?;
        check_len("inputs", inputs.len(), self.plan.tokens())?;
        check_len("targets", targets.len(), self.plan.tokens())?;
        self.plan.check_positions(positions)?;
        self.inputs.copy_from_slice(inputs);
        self.targets.copy_from_slice(targets);
        self.positions.clear();
        self.positions.extend_from_slice(positions.unwrap_or_default());
        let mut no_grads: [F; 0] = [];
        for launch in &self.plan.forward {
            let mut buffers = Buffers {
                params,
                grads: &mut no_grads,
                acts: &mut self.acts,
                act_grads: &mut self.act_grads,
                inputs: &self.inputs,
                targets: &self.targets,
                positions: &self.positions,
            };
            execute(launch, &launch.kernel, &mut buffers)?;
        }
        Ok(self.acts[self.plan.loss.start])
    }

    /// Adds the gradient of `loss_scale` × (the last forward's mean loss) to `grads`. After each
    /// group's launches, `on_ready` gets the group and the gradient buffer.
    pub fn backward(
        &mut self,
        params: &[F],
        grads: &mut [F],
        loss_scale: f64,
        mut on_ready: impl FnMut(&GradsReady, &[F]),
    ) -> Result<(), NnError> {
        check_len("parameter buffer", params.len(), self.padded_len)?;
        check_len("gradient buffer", grads.len(), self.padded_len)?;
        for step in &self.plan.backward {
            match step {
                Step::Launch(launch) => {
                    let mut buffers = Buffers {
                        params,
                        grads: &mut *grads,
                        acts: &mut self.acts,
                        act_grads: &mut self.act_grads,
                        inputs: &self.inputs,
                        targets: &self.targets,
                        positions: &self.positions,
                    };
                    execute(launch, &launch.kernel.with_loss_scale(loss_scale), &mut buffers)?;
                }
                Step::GradsReady(ready) => on_ready(ready, grads),
            }
        }
        Ok(())
    }
}

impl<F: Float, X: LayerKernel> HostRunner<F, X> {
    /// Runs forward and backward once more on the last batch and returns the time each kernel
    /// took, summed by kernel name, in first-launch order (for benchmarks).
    pub fn profile(
        &mut self,
        params: &[F],
        grads: &mut [F],
    ) -> Result<Vec<(&'static str, std::time::Duration)>, NnError> {
        let mut times: Vec<(&'static str, std::time::Duration)> = Vec::new();
        let launches =
            self.plan.forward.iter().chain(self.plan.backward.iter().filter_map(|s| match s {
                Step::Launch(launch) => Some(launch),
                Step::GradsReady(_) => None,
            }));
        let mut no_grads: [F; 0] = [];
        let forward_len = self.plan.forward.len();
        for (i, launch) in launches.enumerate() {
            let grads = if i < forward_len { &mut no_grads[..] } else { &mut *grads };
            let mut buffers = Buffers {
                params,
                grads,
                acts: &mut self.acts,
                act_grads: &mut self.act_grads,
                inputs: &self.inputs,
                targets: &self.targets,
                positions: &self.positions,
            };
            let start = std::time::Instant::now();
            execute(launch, &launch.kernel, &mut buffers)?;
            let name = launch.kernel.name();
            match times.iter_mut().find(|(n, _)| *n == name) {
                Some((_, total)) => *total += start.elapsed(),
                None => times.push((name, start.elapsed())),
            }
        }
        Ok(times)
    }
}

fn check_len(what: &'static str, found: usize, expected: usize) -> Result<(), NnError> {
    if found == expected { Ok(()) } else { Err(NnError::Length { what, expected, found }) }
}

/// Runs one launch: hands each argument its slice and calls the kernel.
fn execute<F: Float, X: LayerKernel>(
    launch: &Launch<X>,
    kernel: &kernels::Kernel<X>,
    b: &mut Buffers<'_, F>,
) -> Result<(), NnError> {
    let mut slots: Vec<Option<Slot<'_, F>>> = launch.args.iter().map(|_| None).collect();
    for (i, arg) in launch.args.iter().enumerate() {
        match arg.buf {
            Buf::Params => {
                assert_eq!(arg.access, Access::Read, "the model never writes parameters");
                slots[i] = Some(Slot::Read(&b.params[arg.range.clone()]));
            }
            Buf::Inputs => slots[i] = Some(Slot::Tokens(&b.inputs[arg.range.clone()])),
            Buf::Targets => slots[i] = Some(Slot::Tokens(&b.targets[arg.range.clone()])),
            Buf::Positions => slots[i] = Some(Slot::Tokens(&b.positions[arg.range.clone()])),
            Buf::Grads | Buf::Acts | Buf::ActGrads => {}
        }
    }
    for (buf, data) in
        [(Buf::Grads, &mut *b.grads), (Buf::Acts, &mut *b.acts), (Buf::ActGrads, &mut *b.act_grads)]
    {
        let mine: Vec<(usize, Range<usize>)> = launch
            .args
            .iter()
            .enumerate()
            .filter(|(_, a)| a.buf == buf)
            .map(|(i, a)| (i, a.range.clone()))
            .collect();
        for (i, slice) in split_disjoint(data, mine) {
            slots[i] = Some(match launch.args[i].access {
                Access::Read => Slot::Read(slice),
                Access::Write | Access::Update => Slot::Write(Some(slice)),
            });
        }
    }
    let slots = slots.into_iter().map(|s| s.expect("every argument has a buffer")).collect();
    kernels::run(kernel, &mut ArgSlices::new(slots))
        .map_err(|reason| NnError::Kernel { kernel: kernel.name(), reason })
}

/// Splits `data` into the given disjoint ranges, returned with their argument indices.
///
/// # Panics
/// If two ranges overlap (a plan bug: the device would refuse the launch as aliased).
fn split_disjoint<F>(
    data: &mut [F],
    mut ranges: Vec<(usize, Range<usize>)>,
) -> Vec<(usize, &mut [F])> {
    ranges.sort_by_key(|(_, r)| r.start);
    let mut out = Vec::with_capacity(ranges.len());
    let mut rest = data;
    let mut consumed = 0;
    for (i, range) in ranges {
        assert!(range.start >= consumed, "arguments overlap at element {}", range.start);
        let (_, tail) = rest.split_at_mut(range.start - consumed);
        let (mine, tail) = tail.split_at_mut(range.len());
        consumed = range.end;
        rest = tail;
        out.push((i, mine));
    }
    out
}
