//! The flat layout: every named parameter is a view (offset, shape) into one padded flat buffer,
//! and the buffer splits into `world_size` equal partitions, one per rank.
//!
//! Parameters are packed in the order given, each starting at a multiple of `param_alignment`
//! elements. The buffer is then padded so that it divides into `world_size` partitions whose length
//! is a multiple of `partition_alignment`. Elements not covered by any parameter (the gaps before
//! aligned parameters and the tail) are padding: zero-filled, owned by nobody, never updated. A
//! parameter may straddle partitions; [`FlatLayout::owned_pieces`] says which rank owns which part.

use std::ops::Range;

use thiserror::Error;

/// A parameter to place: its name and shape, and ZenFlow's split axis.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// The axis whose slices ZenFlow ranks and selects (the columns of a weight; `None`: the
    /// last axis). Meaningful for two or more dimensions.
    pub split_axis: Option<usize>,
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>) -> Self {
        ParamSpec { name: name.into(), shape: shape.into(), split_axis: None }
    }

    /// The spec with ZenFlow's split axis `axis` (`None`: the last).
    pub fn with_split_axis(self, axis: Option<usize>) -> Self {
        ParamSpec { split_axis: axis, ..self }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A placed parameter: where it lives in the flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamView {
    pub name: String,
    pub shape: Vec<usize>,
    /// First element in the flat buffer.
    pub offset: usize,
    /// ZenFlow's split axis ([`ParamSpec::split_axis`]), checked to be one of `shape`'s.
    pub split_axis: Option<usize>,
}

impl ParamView {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// ZenFlow's split of the parameter as `(outer, slices, inner)`: `outer × slices × inner`
    /// elements, row-major, with `slices` the length of the split axis (the last by default):
    /// slice `j` is the elements `[o, j, i]` for every `o < outer` and `i < inner`. Columns of a
    /// `[rows, cols]` weight are `(rows, cols, 1)`; its rows (axis 0) are `(1, rows, cols)`.
    pub fn split(&self) -> (usize, usize, usize) {
        let axis = self.split_axis.unwrap_or(self.shape.len().saturating_sub(1));
        let Some(&slices) = self.shape.get(axis) else { return (1, 1, 1) };
        let outer = self.shape[..axis].iter().product();
        (outer, slices, self.shape[axis + 1..].iter().product())
    }

    /// Whether AdamW's weight decay applies to it: to matrices and embeddings, not to the 1-D
    /// parameters (norms' weights, biases), as `transformers`' `Trainer`, nanoGPT, llm.c and
    /// Megatron-LM leave those out.
    pub fn takes_weight_decay(&self) -> bool {
        self.shape.len() >= 2
    }

    /// The elements of the flat buffer that hold this parameter.
    pub fn flat_range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// The part of one parameter that one rank owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedPiece {
    /// Index of the parameter in [`FlatLayout::params`].
    pub param: usize,
    /// The owning rank.
    pub rank: usize,
    /// The piece's elements in the flat buffer.
    pub flat: Range<usize>,
    /// The same elements counted from the start of the parameter.
    pub within_param: Range<usize>,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum LayoutError {
    #[error("world size must be at least 1")]
    ZeroWorldSize,
    #[error("alignment must be at least 1, found {0}")]
    ZeroAlignment(&'static str),
    #[error("parameter `{0}` appears twice")]
    DuplicateName(String),
    #[error("parameter `{name}` has no elements (shape {shape:?})")]
    EmptyParameter { name: String, shape: Vec<usize> },
    #[error("the layout needs more than usize::MAX elements")]
    Overflow,
    #[error("parameter `{name}` has no axis {axis} to split (shape {shape:?})")]
    SplitAxis { name: String, axis: usize, shape: Vec<usize> },
}

/// Named parameters placed in one padded flat buffer, split into equal partitions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatLayout {
    params: Vec<ParamView>,
    padded_len: usize,
    world_size: usize,
}

/// Alignments used by [`FlatLayout::new`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alignment {
    /// Every parameter starts at a multiple of this many elements.
    pub param: usize,
    /// Every partition's length is a multiple of this many elements.
    pub partition: usize,
}

impl Default for Alignment {
    /// 64 elements: a 128-byte line of bf16, a whole number of AVX-512 vectors of f32, and an
    /// even count, so that every bf16 partition boundary falls on a 4-byte boundary.
    fn default() -> Self {
        Alignment { param: 64, partition: 64 }
    }
}

impl FlatLayout {
    /// Places `specs` in order and pads the buffer for `world_size` partitions.
    pub fn new(
        specs: &[ParamSpec],
        world_size: usize,
        align: Alignment,
    ) -> Result<Self, LayoutError> {
        if world_size == 0 {
            return Err(LayoutError::ZeroWorldSize);
        }
        if align.param == 0 {
            return Err(LayoutError::ZeroAlignment("param"));
        }
        if align.partition == 0 {
            return Err(LayoutError::ZeroAlignment("partition"));
        }
        let mut seen = std::collections::HashSet::new();
        let mut params = Vec::with_capacity(specs.len());
        let mut end = 0usize;
        for spec in specs {
            if !seen.insert(spec.name.as_str()) {
                return Err(LayoutError::DuplicateName(spec.name.clone()));
            }
            let numel = checked_numel(&spec.shape).ok_or(LayoutError::Overflow)?;
            if numel == 0 {
                return Err(LayoutError::EmptyParameter {
                    name: spec.name.clone(),
                    shape: spec.shape.clone(),
                });
            }
            if let Some(axis) = spec.split_axis.filter(|&a| a >= spec.shape.len()) {
                let (name, shape) = (spec.name.clone(), spec.shape.clone());
                return Err(LayoutError::SplitAxis { name, axis, shape });
            }
            let offset = round_up(end, align.param).ok_or(LayoutError::Overflow)?;
            end = offset.checked_add(numel).ok_or(LayoutError::Overflow)?;
            let (name, shape, split_axis) =
                (spec.name.clone(), spec.shape.clone(), spec.split_axis);
            params.push(ParamView { name, shape, offset, split_axis });
        }
        let unit = world_size.checked_mul(align.partition).ok_or(LayoutError::Overflow)?;
        // An empty model still gets one aligned partition per rank, so no partition is empty.
        let padded_len = round_up(end.max(1), unit).ok_or(LayoutError::Overflow)?;
        Ok(FlatLayout { params, padded_len, world_size })
    }

    pub fn params(&self) -> &[ParamView] {
        &self.params
    }

    /// The parameter called `name`.
    pub fn param(&self, name: &str) -> Option<&ParamView> {
        self.params.iter().find(|p| p.name == name)
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Length of the flat buffer, padding included.
    pub fn padded_len(&self) -> usize {
        self.padded_len
    }

    /// Number of parameter elements (padding excluded).
    pub fn numel(&self) -> usize {
        self.params.iter().map(ParamView::numel).sum()
    }

    /// Length of every partition.
    pub fn partition_len(&self) -> usize {
        self.padded_len / self.world_size
    }

    /// The elements of the flat buffer that `rank` owns.
    ///
    /// # Panics
    /// If `rank` is not below the world size.
    pub fn partition_range(&self, rank: usize) -> Range<usize> {
        assert!(
            rank < self.world_size,
            "rank {rank} out of range for world size {}",
            self.world_size
        );
        let len = self.partition_len();
        rank * len..(rank + 1) * len
    }

    /// The rank that owns flat element `index`.
    pub fn owner_of(&self, index: usize) -> usize {
        index / self.partition_len()
    }

    /// The pieces of parameter `param` and the ranks that own them, in order.
    pub fn owned_pieces(&self, param: usize) -> impl Iterator<Item = OwnedPiece> + '_ {
        let range = self.params[param].flat_range();
        let len = self.partition_len();
        let first_rank = range.start / len;
        let last_rank = (range.end - 1) / len;
        (first_rank..=last_rank).map(move |rank| {
            let start = range.start.max(rank * len);
            let end = range.end.min((rank + 1) * len);
            OwnedPiece {
                param,
                rank,
                flat: start..end,
                within_param: start - range.start..end - range.start,
            }
        })
    }

    /// The pieces of every parameter that `rank` owns, in flat order.
    pub fn pieces_of_rank(&self, rank: usize) -> impl Iterator<Item = OwnedPiece> + '_ {
        let partition = self.partition_range(rank);
        let first = self.params.partition_point(|p| p.flat_range().end <= partition.start);
        self.params[first..]
            .iter()
            .take_while(move |p| p.offset < partition.end)
            .enumerate()
            .filter_map(move |(i, _)| self.owned_pieces(first + i).find(|piece| piece.rank == rank))
    }

    /// True if any element of `range` belongs to a parameter.
    pub fn holds_parameters(&self, range: Range<usize>) -> bool {
        let first = self.params.partition_point(|p| p.flat_range().end <= range.start);
        self.params.get(first).is_some_and(|p| p.offset < range.end) && !range.is_empty()
    }

    /// Indices of the parameters that overlap `range`.
    pub fn params_in(&self, range: Range<usize>) -> Range<usize> {
        let first = self.params.partition_point(|p| p.flat_range().end <= range.start);
        let end = self.params.partition_point(|p| p.offset < range.end);
        first..end.max(first)
    }

    /// The padding: every range of the flat buffer that no parameter covers, in order.
    pub fn padding_ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        let starts = std::iter::once(0).chain(self.params.iter().map(|p| p.flat_range().end));
        let ends = self.params.iter().map(|p| p.offset).chain(std::iter::once(self.padded_len));
        starts.zip(ends).filter(|(s, e)| s < e).map(|(s, e)| s..e)
    }
}

fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

fn round_up(x: usize, to: usize) -> Option<usize> {
    x.div_ceil(to).checked_mul(to)
}

/// The parts `ranges` of `buffer`, each mutable at once, in the order of `ranges` (what a reader
/// that fills several parameters of a flat buffer in one pass takes); `None` where two overlap
/// or one runs past the buffer's end.
pub fn ranges_mut<'a, T>(buffer: &'a mut [T], ranges: &[Range<usize>]) -> Option<Vec<&'a mut [T]>> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| ranges[i].start);
    let mut parts: Vec<Option<&'a mut [T]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut rest, mut at) = (buffer, 0);
    for i in order {
        let range = &ranges[i];
        if range.start < at || range.end < range.start || range.end - at > rest.len() {
            return None;
        }
        let (_, from_start) = std::mem::take(&mut rest).split_at_mut(range.start - at);
        let (part, after) = from_start.split_at_mut(range.len());
        parts[i] = Some(part);
        (rest, at) = (after, range.end);
    }
    parts.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ranges in any order, empty ones included, give their parts in that order; an overlap or
    /// a range past the end gives none.
    #[test]
    fn ranges_mut_lends_each_range_or_none_where_they_overlap() {
        let mut buffer: Vec<u32> = (0..10).collect();
        let parts = ranges_mut(&mut buffer, &[6..9, 0..2, 2..2, 3..6]).unwrap();
        let lens: Vec<Vec<u32>> = parts.iter().map(|p| p.to_vec()).collect();
        assert_eq!(lens, [vec![6, 7, 8], vec![0, 1], vec![], vec![3, 4, 5]]);
        for part in ranges_mut(&mut buffer, &[4..5, 9..10]).unwrap() {
            part[0] += 100;
        }
        assert_eq!((buffer[4], buffer[9], buffer[5]), (104, 109, 5));
        assert!(ranges_mut(&mut buffer, &[0..3, 2..4]).is_none());
        assert!(ranges_mut(&mut buffer, &[0..1, 8..11]).is_none());
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = 5..4;
        assert!(ranges_mut(&mut buffer, &[0..1, backwards]).is_none());
    }

    fn specs(shapes: &[&[usize]]) -> Vec<ParamSpec> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| ParamSpec::new(format!("p{i}"), s.to_vec()))
            .collect()
    }

    #[test]
    fn parameters_start_at_aligned_offsets_in_order() {
        let layout = FlatLayout::new(&specs(&[&[3], &[2, 5], &[7]]), 1, Alignment::default())
            .expect("valid layout");
        let offsets: Vec<_> = layout.params().iter().map(|p| p.offset).collect();
        assert_eq!(offsets, [0, 64, 128]);
        assert_eq!(layout.padded_len(), 192);
        assert_eq!(layout.numel(), 20);
    }

    #[test]
    fn a_parameter_straddling_two_partitions_has_one_piece_per_owner() {
        let align = Alignment { param: 1, partition: 1 };
        let layout = FlatLayout::new(&specs(&[&[3], &[6], &[3]]), 3, align).expect("valid layout");
        // 12 elements in 3 partitions of 4: p1 occupies 3..9, owned by ranks 0, 1 and 2.
        let pieces: Vec<_> =
            layout.owned_pieces(1).map(|p| (p.rank, p.flat, p.within_param)).collect();
        assert_eq!(pieces, [(0, 3..4, 0..1), (1, 4..8, 1..5), (2, 8..9, 5..6)]);
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        let align = Alignment::default();
        assert_eq!(FlatLayout::new(&specs(&[&[1]]), 0, align), Err(LayoutError::ZeroWorldSize));
        let dup = vec![ParamSpec::new("w", [2]), ParamSpec::new("w", [3])];
        assert_eq!(FlatLayout::new(&dup, 1, align), Err(LayoutError::DuplicateName("w".into())));
        assert!(matches!(
            FlatLayout::new(&specs(&[&[4, 0]]), 1, align),
            Err(LayoutError::EmptyParameter { .. })
        ));
        assert_eq!(
            FlatLayout::new(&specs(&[&[usize::MAX, 2]]), 1, align),
            Err(LayoutError::Overflow)
        );
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        fn arb_specs() -> impl Strategy<Value = Vec<ParamSpec>> {
            let shape = prop::collection::vec(1usize..40, 1..4);
            prop::collection::vec(shape, 0..12).prop_map(|shapes| {
                shapes
                    .into_iter()
                    .enumerate()
                    .map(|(i, s)| ParamSpec::new(format!("p{i}"), s))
                    .collect()
            })
        }

        fn arb_alignment() -> impl Strategy<Value = Alignment> {
            (
                prop::sample::select(vec![1usize, 2, 8, 64]),
                prop::sample::select(vec![1usize, 2, 64]),
            )
                .prop_map(|(param, partition)| Alignment { param, partition })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(512))]

            /// Partitions are equal, contiguous, in rank order, and cover the buffer exactly.
            #[test]
            fn partitions_tile_the_buffer(specs in arb_specs(), world in 1usize..=64, align in arb_alignment()) {
                let layout = FlatLayout::new(&specs, world, align).unwrap();
                prop_assert_eq!(layout.padded_len() % (world * align.partition), 0);
                let mut next = 0;
                for rank in 0..world {
                    let range = layout.partition_range(rank);
                    prop_assert_eq!(range.start, next);
                    prop_assert_eq!(range.len(), layout.partition_len());
                    prop_assert!(!range.is_empty());
                    next = range.end;
                }
                prop_assert_eq!(next, layout.padded_len());
            }

            /// Every parameter element has exactly one owner, the rank whose partition holds it, and
            /// the pieces of a rank are exactly the parameter elements inside its partition.
            #[test]
            fn every_parameter_element_has_exactly_one_owner(specs in arb_specs(), world in 1usize..=64, align in arb_alignment()) {
                let layout = FlatLayout::new(&specs, world, align).unwrap();
                let mut owners = vec![0u32; layout.padded_len()];
                for (i, view) in layout.params().iter().enumerate() {
                    prop_assert_eq!(view.numel(), specs[i].numel());
                    prop_assert_eq!(view.offset % align.param, 0);
                    let mut covered = 0;
                    for piece in layout.owned_pieces(i) {
                        prop_assert_eq!(piece.flat.len(), piece.within_param.len());
                        prop_assert_eq!(piece.flat.start - view.offset, piece.within_param.start);
                        for e in piece.flat.clone() {
                            prop_assert_eq!(layout.owner_of(e), piece.rank);
                            owners[e] += 1;
                        }
                        covered += piece.flat.len();
                    }
                    prop_assert_eq!(covered, view.numel());
                }
                let mut from_ranks = vec![0u32; layout.padded_len()];
                for rank in 0..world {
                    for piece in layout.pieces_of_rank(rank) {
                        prop_assert_eq!(piece.rank, rank);
                        for e in piece.flat { from_ranks[e] += 1; }
                    }
                }
                prop_assert_eq!(&owners, &from_ranks);
                for view in layout.params() {
                    for e in view.flat_range() { prop_assert_eq!(owners[e], 1); }
                }
            }

            /// Padding and parameters are disjoint and together tile the buffer; an update that every
            /// rank applies to the pieces it owns changes every parameter element once and leaves
            /// the zero-filled padding zero.
            #[test]
            fn padding_is_zero_and_never_updated(specs in arb_specs(), world in 1usize..=64, align in arb_alignment()) {
                let layout = FlatLayout::new(&specs, world, align).unwrap();
                let mut buffer = vec![0.0f32; layout.padded_len()];
                for rank in 0..world {
                    for piece in layout.pieces_of_rank(rank) {
                        for x in &mut buffer[piece.flat] { *x += 1.0; }
                    }
                }
                let mut kind = vec![0u8; layout.padded_len()];
                for range in layout.padding_ranges() {
                    for e in range { kind[e] += 1; prop_assert_eq!(buffer[e], 0.0); }
                }
                for view in layout.params() {
                    for e in view.flat_range() { kind[e] += 2; prop_assert_eq!(buffer[e], 1.0); }
                }
                prop_assert!(kind.iter().all(|&k| k == 1 || k == 2));
            }
        }
    }

    /// ZenFlow's split of a parameter: by its last axis unless told, `(outer, slices, inner)`
    /// with the split axis's slices in the middle; an axis the shape lacks is refused.
    #[test]
    fn a_parameter_splits_along_its_split_axis() {
        let specs = [
            ParamSpec::new("w", [4, 3]),
            ParamSpec::new("rows", [4, 3]).with_split_axis(Some(0)),
            ParamSpec::new("middle", [2, 5, 3]).with_split_axis(Some(1)),
            ParamSpec::new("v", [7]),
        ];
        let layout = FlatLayout::new(&specs, 1, Alignment { param: 1, partition: 1 }).unwrap();
        let splits: Vec<_> = layout.params().iter().map(ParamView::split).collect();
        assert_eq!(splits, [(4, 3, 1), (1, 4, 3), (2, 5, 3), (1, 7, 1)]);
        let bad = [ParamSpec::new("w", [4, 3]).with_split_axis(Some(2))];
        let err = FlatLayout::new(&bad, 1, Alignment { param: 1, partition: 1 }).unwrap_err();
        assert!(matches!(err, LayoutError::SplitAxis { axis: 2, .. }), "{err}");
    }
}
