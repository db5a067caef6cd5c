//! Activation checkpointing for any family: a checkpointed plan keeps each layer's input (the
//! residual stream entering it) from forward to backward, and recomputes the rest of the layer's
//! activations right before the layer's backward.
//!
//! Nothing here, nor in the executors, knows what a layer is. A family allocates each layer's
//! activations through [`layer_acts`], saying which are *kept* (the layer's output, which is the
//! next layer's input) and which are *internal* (everything else its backward reads). Without
//! checkpointing both are ordinary ranges of the activation buffer, one set per layer. With it,
//! every layer's internal activations share one region, so activation memory is one layer's
//! internals plus every layer's kept output, not every layer's internals.
//!
//! The backward of a checkpointed plan re-emits, before each layer's backward, the forward
//! launches of that layer whose outputs its backward reads ([`Checkpointing::layer_backward`]),
//! and a launch zeroing the activation gradients of the shared region that the layer's backward
//! adds to (the layer before left its own there). The executors run them as any other launches;
//! recomputation is the same kernels on the same inputs, so it gives the same values, bit for bit.
//!
//! A family's plan builder uses it in two places (GPT-2's `ActLayout` and `Builder::backward`):
//!
//! ```text
//! let blocks = layer_acts(&mut bump, n_layer, checkpointing, |acts| Block {
//!     norm: acts.internal(n * c), …, output: acts.kept(n * c),
//! });
//! // in backward, for each layer from the last:
//! steps.extend(blocks.checkpointing.layer_backward(&its_forward_launches, its_backward_steps,
//!                                                  layer + 1 != n_layer));
//! ```

use std::ops::Range;

use crate::plan::{Access, ActAllocator, Buf, Launch, Step, zero_launch};

/// Where the internal activations of a model's layers live: with checkpointing, the one region of
/// the activation buffer that every layer's internals share.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checkpointing {
    shared: Option<Range<usize>>,
}

/// Hands out one layer's activations ([`layer_acts`]).
#[derive(Debug)]
pub struct LayerAllocator<'a> {
    kept: &'a mut ActAllocator,
    /// The shared region's allocator, with checkpointing.
    internal: Option<&'a mut ActAllocator>,
}

impl LayerAllocator<'_> {
    /// An activation kept from forward to backward in every plan: the layer's output, the input of
    /// the layer after it (one range per layer).
    pub fn kept(&mut self, len: usize) -> Range<usize> {
        self.kept.take(len)
    }

    /// An activation that a checkpointed plan recomputes in backward: with checkpointing, every
    /// layer gets the same range of the shared region, asking for the same lengths in the same
    /// order; without it, a range of its own.
    pub fn internal(&mut self, len: usize) -> Range<usize> {
        match &mut self.internal {
            Some(shared) => shared.take(len),
            None => self.kept.take(len),
        }
    }
}

/// The activations of each of a model's layers, and where their internals live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerActs<T> {
    pub layers: Vec<T>,
    pub checkpointing: Checkpointing,
}

/// Allocates the activations of `n_layer` layers from `bump`, each by `layer` (which must ask for
/// the same internal lengths, in the same order, for every layer). With `checkpointing`, the
/// internal activations of every layer share one region of `bump`, taken before the first
/// layer's kept activations.
///
/// # Panics
///
/// If `layer` asks for more internal elements for some layer than for the first (a family's bug).
pub fn layer_acts<T>(
    bump: &mut ActAllocator,
    n_layer: usize,
    checkpointing: bool,
    mut layer: impl FnMut(&mut LayerAllocator<'_>) -> T,
) -> LayerActs<T> {
    if !checkpointing {
        let layers = (0..n_layer)
            .map(|_| layer(&mut LayerAllocator { kept: bump, internal: None }))
            .collect();
        return LayerActs { layers, checkpointing: Checkpointing::default() };
    }
    // Measure one layer's internals, from offset 0 (alignment is relative to 16 elements, so the
    // region, which starts 16-aligned, holds them at the same relative offsets).
    let (mut probe_kept, mut probe_internal) = (ActAllocator::default(), ActAllocator::default());
    layer(&mut LayerAllocator { kept: &mut probe_kept, internal: Some(&mut probe_internal) });
    let region = bump.take(probe_internal.len());
    let layers = (0..n_layer)
        .map(|i| {
            let mut internal = ActAllocator::starting_at(region.start);
            let acts = layer(&mut LayerAllocator { kept: bump, internal: Some(&mut internal) });
            assert!(
                internal.len() <= region.end,
                "layer {i} asks for more internal activations than layer 0 ({} > {})",
                internal.len() - region.start,
                region.len()
            );
            acts
        })
        .collect();
    LayerActs { layers, checkpointing: Checkpointing { shared: Some(region) } }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

impl Checkpointing {
    /// Whether the plan recomputes its layers' internals in backward.
    pub fn is_on(&self) -> bool {
        self.shared.is_some()
    }

    /// The region of the activation buffer every layer's internals share (`None` without
    /// checkpointing).
    pub fn shared(&self) -> Option<&Range<usize>> {
        self.shared.as_ref()
    }

    /// One layer's backward steps in the plan: `backward` as it is without checkpointing. With
    /// it, `backward` is preceded by the launches of `forward` (the layer's forward) that compute
    /// an activation `backward` reads, directly or through another of them, unless the layer's
    /// internals are still in place (`recompute` false: its forward was the last to write the
    /// region, as for the last layer, whose backward comes first); and by a launch zeroing the
    /// activation gradients of the region that `backward` adds to.
    pub fn layer_backward<X: Clone>(
        &self,
        forward: &[Launch<X>],
        backward: Vec<Step<X>>,
        recompute: bool,
    ) -> Vec<Step<X>> {
        let Some(shared) = &self.shared else { return backward };
        let mut steps = Vec::new();
        if recompute {
            steps.extend(needed_launches(forward, &backward).into_iter().map(Step::Launch));
        }
        let accumulated: Vec<Range<usize>> = launch_args(&backward)
            .filter(|arg| arg.buf == Buf::ActGrads && arg.access == Access::Update)
            .filter(|arg| overlaps(&arg.range, shared))
            .map(|arg| arg.range.clone())
            .collect();
        if !accumulated.is_empty() {
            steps.push(Step::Launch(zero_launch(accumulated)));
        }
        steps.extend(backward);
        steps
    }
}

fn launch_args<X>(steps: &[Step<X>]) -> impl Iterator<Item = &crate::plan::Arg> {
    steps
        .iter()
        .filter_map(|step| match step {
            Step::Launch(launch) => Some(launch.args.iter()),
            Step::GradsReady(_) => None,
        })
        .flatten()
}

/// The launches of `forward` that write an activation that `backward` reads, or that another
/// such launch reads, in forward order (a layer's last launches, whose outputs only the next
/// layer reads, are left out).
fn needed_launches<X: Clone>(forward: &[Launch<X>], backward: &[Step<X>]) -> Vec<Launch<X>> {
    let reads = |args: &mut dyn Iterator<Item = &crate::plan::Arg>| -> Vec<Range<usize>> {
        args.filter(|arg| arg.buf == Buf::Acts && arg.access != Access::Write)
            .map(|arg| arg.range.clone())
            .collect()
    };
    let mut needed = reads(&mut launch_args(backward));
    let mut kept = Vec::new();
    for launch in forward.iter().rev() {
        let writes_needed = launch.args.iter().any(|arg| {
            arg.buf == Buf::Acts
                && arg.access != Access::Read
                && needed.iter().any(|range| overlaps(range, &arg.range))
        });
        if writes_needed {
            needed.extend(reads(&mut launch.args.iter()));
            kept.push(launch.clone());
        }
    }
    kept.reverse();
    kept
}

#[cfg(test)]
mod tests {
    use super::{layer_acts, needed_launches};
    use crate::kernels::{Kernel, NoLayers};
    use crate::plan::{ActAllocator, Buf, Launch, Step, read, update, write};

    /// Without checkpointing every layer's activations are its own; with it, the internal ranges
    /// are the same for every layer, inside one region, and the kept ones are distinct and
    /// outside it.
    #[test]
    fn internal_activations_are_shared_only_with_checkpointing() {
        for checkpointing in [false, true] {
            let mut bump = ActAllocator::default();
            bump.take(5);
            let acts = layer_acts(&mut bump, 3, checkpointing, |a| {
                (a.internal(7), a.kept(4), a.internal(20))
            });
            let layers = &acts.layers;
            assert_eq!(acts.checkpointing.is_on(), checkpointing);
            assert_eq!(layers[0].0 == layers[2].0 && layers[0].2 == layers[1].2, checkpointing);
            let mut kept: Vec<_> = layers.iter().map(|l| l.1.start).collect();
            kept.dedup();
            assert_eq!(kept.len(), 3);
            if let Some(shared) = acts.checkpointing.shared() {
                assert!(layers.iter().all(|l| l.1.end <= shared.start || l.1.start >= shared.end));
                assert!(shared.start <= layers[0].0.start && layers[0].2.end <= shared.end);
            }
            assert!(layers.iter().all(|l| l.0.start % 16 == 0 && l.2.start % 16 == 0));
        }
    }

    /// Recomputation keeps the launches whose outputs backward reads, directly or through a kept
    /// launch, and leaves out the one whose output only the next layer reads.
    #[test]
    fn recomputation_leaves_out_what_backward_does_not_read() {
        let r = |start: usize| start..start + 4;
        let residual = |out, a, b| Launch::<NoLayers> {
            kernel: Kernel::Residual,
            args: vec![write(Buf::Acts, &r(out)), read(Buf::Acts, &r(a)), read(Buf::Acts, &r(b))],
        };
        // 8 = 0 + 0; 16 = 0 + 8; 32 = 16 + 8 (the layer's output); backward reads 16 only.
        let forward = [residual(8, 0, 0), residual(16, 0, 8), residual(32, 16, 8)];
        let backward = vec![Step::Launch(Launch::<NoLayers> {
            kernel: Kernel::ResidualBackward,
            args: vec![update(Buf::ActGrads, &r(0)), read(Buf::Acts, &r(16))],
        })];
        let needed = needed_launches(&forward, &backward);
        assert_eq!(needed, forward[..2].to_vec());
    }
}
