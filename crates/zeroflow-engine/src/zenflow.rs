//! ZenFlow (DESIGN.md §6): the importance-aware split of every weight by columns.
//!
//! Every parameter is a row-major matrix: `[rows, cols]` with `cols` the last dimension (and
//! `rows` the product of the others); a 1-D parameter of `n` elements is `[n, 1]`, so that its one
//! column is always selected. At a selection the columns of each matrix are ranked by the L1 norm
//! of their gradient (summed over ranks) and the top `k = max(1, round(topk_ratio × cols))` are
//! selected; `topk_ratio: 0` selects nothing at all, 1-D parameters included, so that ZenFlow then
//! is ZeRO-Offload with a window of `update_interval` steps (DeepSpeed's stage 1/2 code lets `k`
//! be zero too).
//!
//! The selected elements of this rank's partition live in compact device buffers, block by block
//! ([`Block`]): their fp32 master weights and moments, the gathered gradients and the updated
//! weights, which are scattered back into the flat weights every step. Everything else goes
//! through the offload path: the host accumulator sums the gradients of a window of
//! `update_interval` steps and the CPU steps the whole partition once per window, its results for
//! the selected columns discarded (the device's weights are scattered over them again).
//!
//! Selections happen at the start of a window (the first step, then the first window start at
//! least `select_interval` steps after the last selection), from the gradients of that step. They
//! re-synchronise the state: the columns leaving the selection take their master weights and
//! moments from the device into the host optimizer (the device's are current, the host's were
//! stepped with gradients the device had already applied), the columns entering take them from
//! the host optimizer into the device. With `overlap_step` a selection is the one point where the
//! GPU waits for the CPU step still running: the state it exchanges must be current.

use std::ops::Range;

use zeroflow_core::config::{Selection, UpdateInterval};
use zeroflow_core::layout::FlatLayout;
use zeroflow_core::{Element, Float};
use zeroflow_device::{Device, Kernels, Matrix};

use crate::EngineError;
use crate::device_adamw::DeviceAdamState;

/// ZenFlow's settings (from `zero_optimization.zenflow`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZenFlowOptions {
    /// The fraction of each weight's columns updated on the device every step; 0 selects none.
    pub topk_ratio: f64,
    /// When the columns are selected again. With DeepSpeed's `"auto"` and `"epoch"` strategies,
    /// whose epoch length the engine is not told, the columns are selected once (at the first
    /// step), as DeepSpeed does when it does not own the dataloader.
    pub selection: Selection,
    /// Steps per CPU update. Only [`UpdateInterval::Every`] is supported.
    pub update_interval: UpdateInterval,
    /// Run the CPU update on a worker thread; its result reaches the weights one window later.
    pub overlap_step: bool,
    /// The first this many steps end a window each (the CPU updates everything every step), as
    /// DeepSpeed's `full_warm_up_rounds`; the windows of `update_interval` steps start after them.
    pub full_warm_up_rounds: u64,
}

/// A select interval that is never reached: the columns chosen at the first step stay.
const NEVER: u64 = u64::MAX;

impl ZenFlowOptions {
    /// The select and update intervals in steps, or why the engine cannot run these settings.
    pub(crate) fn intervals(&self) -> Result<(u64, u64), EngineError> {
        if !(0.0..=1.0).contains(&self.topk_ratio) {
            return Err(EngineError::Usage("ZenFlow's topk_ratio must lie in [0, 1]"));
        }
        let UpdateInterval::Every(update) = self.update_interval else {
            return Err(EngineError::Usage(
                "ZenFlow's update_interval \"auto\" is not supported; give a number of steps",
            ));
        };
        let select = match self.selection {
            Selection::Step { interval } => interval,
            Selection::Auto | Selection::Epoch { .. } => {
                // DeepSpeed reselects once per epoch (or every `select_interval` epochs) when it
                // owns the dataloader, and otherwise selects once and never again; the engine is
                // never told the epoch's length, so it does the latter, and says so.
                tracing::warn!(
                    "ZenFlow: select_strategy \"auto\"/\"epoch\" reselects once per epoch, whose \
                     length the engine does not know: the columns are selected at the first step \
                     and kept (as DeepSpeed does without a dataloader); use select_strategy \
                     \"step\" with a select_interval to reselect"
                );
                NEVER
            }
        };
        if update == 0 || select == 0 {
            return Err(EngineError::Usage("ZenFlow's intervals must be at least 1"));
        }
        if select != NEVER && select < update {
            return Err(EngineError::Usage(
                "ZenFlow's select_interval must be at least its update_interval",
            ));
        }
        Ok((select, update))
    }
}

/// One parameter as a row-major matrix, and the part of it this rank owns.
#[derive(Clone, Debug)]
pub(crate) struct MatrixParam {
    /// Its index in the layout.
    param: usize,
    /// The flat index of element `[0, 0]`.
    start: usize,
    cols: usize,
    /// Selected columns per selection.
    k: usize,
    /// This rank's elements of it, counted from `start`.
    owned: Range<usize>,
    /// Where its columns' importance goes in the model-wide importance vector (`None`: 1-D,
    /// always selected when anything is).
    importance_at: Option<usize>,
}

/// A row-major block of this rank's elements of one matrix: whole rows, or part of one row. The
/// selected columns of the block are `indices[index]` (relative to the block's first column), and
/// its selected elements are `[rows, index.len()]` at `compact` in the compact buffers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// The flat index of the block's first element.
    pub start: usize,
    pub rows: usize,
    pub cols: usize,
    pub index: Range<usize>,
    pub compact: usize,
}

impl Block {
    /// The block in a buffer whose element 0 is flat element `shift`.
    pub fn full<'a, D: Device, T: Element>(
        &self,
        buffer: &'a D::Buffer<T>,
        shift: usize,
    ) -> Matrix<'a, D, T> {
        Matrix { buffer, offset: self.start - shift, rows: self.rows, cols: self.cols }
    }

    /// The block's selected elements in a compact buffer.
    pub fn compact<'a, D: Device, T: Element>(&self, buffer: &'a D::Buffer<T>) -> Matrix<'a, D, T> {
        Matrix { buffer, offset: self.compact, rows: self.rows, cols: self.index.len() }
    }

    /// The flat indices of the block's selected elements, in compact order.
    pub fn selected<'a>(&'a self, indices: &'a [u32]) -> impl Iterator<Item = usize> + 'a {
        let columns = &indices[self.index.clone()];
        (0..self.rows).flat_map(move |r| {
            columns.iter().map(move |&c| self.start + r * self.cols + c as usize)
        })
    }
}

/// The device side of ZenFlow for one rank: the selection and the compact state.
pub(crate) struct ZenFlow<D: Device, P: Float> {
    pub select_interval: u64,
    pub update_interval: u64,
    pub full_warm_up_rounds: u64,
    pub overlap: bool,
    /// False with `topk_ratio: 0`: nothing is ever selected.
    pub selects: bool,
    pub matrices: Vec<MatrixParam>,
    /// The selected columns of each matrix, ascending (empty before the first selection).
    pub selected: Vec<Vec<u32>>,
    pub blocks: Vec<Block>,
    /// The selected columns of every block, relative to its first column (host copy of `index`).
    pub indices: Vec<u32>,
    /// Selected elements now (the used prefix of the compact buffers).
    pub compact_len: usize,
    pub index: D::Buffer<u32>,
    pub state: DeviceAdamState<D>,
    pub grads: D::Buffer<P>,
    pub grads_f32: D::Buffer<f32>,
    pub weights: D::Buffer<P>,
    /// Σ|g| per column of every 2-D parameter, model-wide, for the all-reduce.
    pub importance: D::Buffer<f32>,
    pub importance_host: zeroflow_device::HostBuffer<f32>,
    /// The CPU's AdamW schedule: one step per window.
    pub cpu_adamw: zeroflow_optim::AdamW,
    /// Steps taken in the current window.
    pub steps_in_window: u64,
    /// Steps since the last selection (`None` before the first).
    pub since_selection: Option<u64>,
    /// Compute → h2d: the device step has written the weights and the compact weights.
    pub device_done: Option<D::Event>,
}

impl<D: Device + Kernels, P: Float> ZenFlow<D, P> {
    /// Allocates the compact buffers for the largest selection `ratio` can make in `owned`.
    pub fn new(
        device: &D,
        layout: &FlatLayout,
        owned: &Range<usize>,
        options: &ZenFlowOptions,
        adamw: zeroflow_optim::AdamWConfig,
    ) -> Result<Self, EngineError> {
        let (select_interval, update_interval) = options.intervals()?;
        let matrices = matrices(layout, owned, options.topk_ratio);
        // The largest selection: every block holds min(k, its columns) selected columns.
        let (mut capacity, mut index_capacity) = (0, 0);
        for m in &matrices {
            for (rows, cols, _) in block_shapes(m) {
                capacity += rows * m.k.min(cols);
                index_capacity += m.k.min(cols);
            }
        }
        // Model-wide, so that every rank all-reduces the same length.
        let columns = layout_columns(layout);
        let alloc = |len: usize| device.alloc::<f32>(len.max(1));
        Ok(ZenFlow {
            select_interval,
            update_interval,
            full_warm_up_rounds: options.full_warm_up_rounds,
            overlap: options.overlap_step,
            selects: options.topk_ratio > 0.0,
            selected: vec![Vec::new(); matrices.len()],
            matrices,
            blocks: Vec::new(),
            indices: Vec::new(),
            compact_len: 0,
            index: device.alloc(index_capacity.max(1))?,
            state: DeviceAdamState {
                master: alloc(capacity)?,
                exp_avg: alloc(capacity)?,
                exp_avg_sq: alloc(capacity)?,
            },
            grads: device.alloc(capacity.max(1))?,
            grads_f32: alloc(capacity)?,
            weights: device.alloc(capacity.max(1))?,
            importance: alloc(columns)?,
            importance_host: device
                .alloc_host(columns.max(1), zeroflow_device::HostMemory::Pageable)?,
            cpu_adamw: zeroflow_optim::AdamW::new(adamw)?,
            steps_in_window: 0,
            since_selection: None,
            device_done: None,
        })
    }

    /// True if the step about to be taken starts a window that selects again.
    pub fn selection_due(&self) -> bool {
        self.selects
            && self.steps_in_window == 0
            && self.since_selection.is_none_or(|since| since >= self.select_interval)
    }

    /// This rank's partial column importances (Σ|g| over its elements of each column) from the
    /// host accumulator of `owned`, into `importance_host`.
    pub fn local_importance(&mut self, grad_acc: &[f32], owned_start: usize) {
        self.importance_host.fill(0.0);
        for m in &self.matrices {
            let Some(at) = m.importance_at else { continue };
            let mut sums = vec![0f64; m.cols];
            for i in m.owned.clone() {
                sums[i % m.cols] += f64::from(grad_acc[m.start + i - owned_start].abs());
            }
            for (c, sum) in sums.into_iter().enumerate() {
                self.importance_host[at + c] = sum as f32;
            }
        }
    }

    /// Selects from the model-wide importances in `importance_host` and lays out the blocks.
    pub fn select(&mut self) {
        for (m, selected) in self.matrices.iter().zip(&mut self.selected) {
            *selected = match m.importance_at {
                None => (0..m.k as u32).collect(),
                Some(at) => {
                    let importance = &self.importance_host[at..at + m.cols];
                    let mut order: Vec<u32> = (0..m.cols as u32).collect();
                    // Descending importance, ties to the lower column: the same on every rank.
                    order.sort_by(|&a, &b| {
                        importance[b as usize].total_cmp(&importance[a as usize]).then(a.cmp(&b))
                    });
                    order.truncate(m.k);
                    order
                }
            };
            selected.sort_unstable();
        }
        self.lay_out();
        self.since_selection = Some(0);
    }

    /// The blocks and compact offsets of the selection in `selected`.
    fn lay_out(&mut self) {
        self.blocks.clear();
        self.indices.clear();
        let mut compact = 0;
        for (m, columns) in self.matrices.iter().zip(&self.selected) {
            for (rows, cols, first) in block_shapes(m) {
                let in_block: Vec<u32> = columns
                    .iter()
                    .filter(|&&c| (first.1..first.1 + cols).contains(&(c as usize)))
                    .map(|&c| c - first.1 as u32)
                    .collect();
                if in_block.is_empty() {
                    continue;
                }
                let index = self.indices.len()..self.indices.len() + in_block.len();
                self.indices.extend_from_slice(&in_block);
                let start = m.start + first.0 * m.cols + first.1;
                self.blocks.push(Block { start, rows, cols, index: index.clone(), compact });
                compact += rows * index.len();
            }
        }
        self.compact_len = compact;
    }

    /// The selection by parameter index, for a checkpoint.
    pub fn selection(&self) -> Vec<(usize, Vec<u32>)> {
        let matrices = self.matrices.iter().zip(&self.selected);
        matrices.filter(|(_, s)| !s.is_empty()).map(|(m, s)| (m.param, s.clone())).collect()
    }

    /// Takes the selection of a checkpoint (saved by any number of ranks), or an error naming a
    /// column that cannot be selected.
    pub fn restore_selection(&mut self, saved: &[(usize, Vec<u32>)]) -> Result<(), EngineError> {
        for (m, selected) in self.matrices.iter().zip(&mut self.selected) {
            selected.clear();
            if let Some((_, columns)) = saved.iter().find(|(param, _)| *param == m.param) {
                if columns.len() > m.k || columns.iter().any(|&c| c as usize >= m.cols) {
                    return Err(EngineError::Usage(
                        "a checkpoint's ZenFlow selection does not fit this model and topk_ratio",
                    ));
                }
                selected.clone_from(columns);
            }
        }
        self.lay_out();
        Ok(())
    }

    /// Writes the selected columns' updated weights into the flat weights on `stream`.
    pub fn scatter_weights(
        &self,
        device: &D,
        stream: &D::Stream,
        params: &D::Buffer<P>,
    ) -> Result<(), EngineError> {
        for block in &self.blocks {
            let (weights, index) = (block.compact(&self.weights), block.index.clone());
            device.scatter_columns(stream, weights, &self.index, index, block.full(params, 0))?;
        }
        Ok(())
    }

    /// The flat indices of the selected elements, in compact order.
    pub fn selected_elements(&self) -> impl Iterator<Item = usize> + '_ {
        self.blocks.iter().flat_map(|b| b.selected(&self.indices))
    }
}

/// ZenFlow's state besides the optimizer's (DESIGN.md §7: ZenFlow state is part of checkpoints).
#[derive(Clone, Debug, PartialEq)]
pub struct ZenFlowSnapshot {
    /// The selected columns of each parameter this rank holds part of, by index in the layout
    /// (a 1-D parameter's one column is `0`); the same on every rank that holds it.
    pub selection: Vec<(usize, Vec<u32>)>,
    /// Steps taken in the current window, and since the last selection (`None`: none yet).
    pub steps_in_window: u64,
    pub since_selection: Option<u64>,
    /// CPU steps (windows) taken.
    pub cpu_steps: u64,
    /// The host accumulator of the window so far: the gradients of `window_flat` (this rank's
    /// partition, global flat indices), summed over ranks and the window's steps.
    pub window_flat: Range<usize>,
    pub window_grads: Vec<f32>,
}

/// Every parameter with elements in `owned`, as a matrix, with its `k` for `ratio`.
fn matrices(layout: &FlatLayout, owned: &Range<usize>, ratio: f64) -> Vec<MatrixParam> {
    let mut importance_at = 0;
    let mut out = Vec::new();
    for (index, param) in layout.params().iter().enumerate() {
        let cols = match param.shape.as_slice() {
            [_] | [] => 1,
            [.., cols] => *cols,
        };
        let two_d = param.shape.len() >= 2;
        let at = two_d.then_some(importance_at);
        if two_d {
            importance_at += cols;
        }
        let range = param.flat_range();
        let inside = range.start.max(owned.start)..range.end.min(owned.end);
        if inside.is_empty() || ratio == 0.0 {
            continue;
        }
        let k = if two_d { ((ratio * cols as f64).round() as usize).clamp(1, cols) } else { 1 };
        let owned = inside.start - range.start..inside.end - range.start;
        out.push(MatrixParam {
            param: index,
            start: range.start,
            cols,
            k,
            owned,
            importance_at: at,
        });
    }
    out
}

/// Columns of every parameter of two or more dimensions: the length of the importance vector.
fn layout_columns(layout: &FlatLayout) -> usize {
    layout.params().iter().filter(|p| p.shape.len() >= 2).map(|p| p.shape[p.shape.len() - 1]).sum()
}

/// The row-major blocks of a matrix's owned elements: `(rows, cols, (first row, first column))`.
/// A partial first row, then whole rows, then a partial last row.
fn block_shapes(m: &MatrixParam) -> Vec<(usize, usize, (usize, usize))> {
    let (mut lo, hi, c) = (m.owned.start, m.owned.end, m.cols);
    let mut blocks = Vec::new();
    if lo % c != 0 {
        let end = hi.min(lo.next_multiple_of(c));
        blocks.push((1, end - lo, (lo / c, lo % c)));
        lo = end;
    }
    if lo < hi && hi / c > lo / c {
        blocks.push((hi / c - lo / c, c, (lo / c, 0)));
        lo = hi / c * c;
    }
    if lo < hi {
        blocks.push((1, hi - lo, (lo / c, 0)));
    }
    blocks
}

#[cfg(test)]
mod tests {
    use zeroflow_core::layout::{Alignment, ParamSpec};

    use super::*;

    /// The blocks of every rank cover each rank's elements of every parameter exactly once.
    #[test]
    fn blocks_cover_the_owned_elements_of_every_parameter() {
        let specs = [ParamSpec::new("a", vec![7, 5]), ParamSpec::new("b", vec![13])];
        for world in 1..=5 {
            let layout = FlatLayout::new(&specs, world, Alignment { param: 4, partition: 2 })
                .expect("a valid layout");
            let mut seen = vec![0; layout.padded_len()];
            for rank in 0..world {
                let owned = layout.partition_range(rank);
                for m in matrices(&layout, &owned, 1.0) {
                    for (rows, cols, (r, c)) in block_shapes(&m) {
                        for i in 0..rows {
                            for j in 0..cols {
                                let flat = m.start + (r + i) * m.cols + c + j;
                                assert!(owned.contains(&flat), "world {world} rank {rank}");
                                seen[flat] += 1;
                            }
                        }
                    }
                }
            }
            for p in layout.params() {
                assert!(p.flat_range().all(|i| seen[i] == 1), "world {world}: {seen:?}");
            }
        }
    }
}
