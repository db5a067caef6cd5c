//! ZenFlow (DESIGN.md §6): the importance-aware split of every weight by columns.
//!
//! Every parameter is a row-major matrix: `[rows, cols]` with `cols` the last dimension (and
//! `rows` the product of the others); a 1-D parameter of `n` elements is `[n, 1]`, so that its one
//! column is always selected. What ZenFlow calls a weight's columns are the slices along its split
//! axis (`ParamView::split_axis`, the last by default): with another axis the matrix is
//! `[outer, slices × inner]` ([`ParamView::split`]) and slice `j` its columns
//! `j × inner .. (j + 1) × inner` (a `[rows, cols]` weight split by axis 0 is `[1, rows × cols]`, its
//! rows the slices); the text below says columns for slices. At a selection the columns of each matrix are ranked by the L1 norm
//! of their gradient (summed over ranks) and the top `k = max(1, round(topk_ratio × cols))` are
//! selected; `topk_ratio: 0` selects nothing at all, 1-D parameters included, so that ZenFlow then
//! is ZeRO-Offload with a window of `update_interval` steps (DeepSpeed's stage 1/2 code lets `k`
//! be zero too).
//!
//! The selected elements of this rank's partition live in compact device buffers, block by block
//! ([`Block`]): their fp32 master weights and moments, the gathered gradients and the updated
//! weights, which are scattered back into the flat weights every step. Everything else goes
//! through the offload path: the device window sums the gradients of a window of
//! `update_interval` steps (or a Zen-auto window, [`AutoWindow`]), and the CPU steps the whole
//! partition once per window with the window streamed to the host chunk by chunk, its results
//! for the selected columns discarded (the device's weights are scattered over them again).
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
use zeroflow_core::layout::{FlatLayout, ParamView};
use zeroflow_core::{Element, Float};
use zeroflow_device::{Device, DeviceBuffer, Kernels, Matrix};
use zeroflow_optim::NoDecay;

use crate::EngineError;
use crate::device_adamw::DeviceAdamState;

/// ZenFlow's settings (from `zero_optimization.zenflow`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ZenFlowOptions {
    /// The fraction of each weight's columns updated on the device every step; 0 selects none.
    pub topk_ratio: f64,
    /// When the columns are selected again. With DeepSpeed's `"auto"` and `"epoch"` strategies
    /// the trainer reports the epochs ([`crate::Engine::end_epoch`]): the columns are selected
    /// again at the first window start after every `select_interval` epochs (one for `"auto"`);
    /// without such reports they are selected once, at the first step, as DeepSpeed does when it
    /// does not own the dataloader.
    pub selection: Selection,
    /// Steps per CPU update: a fixed number, or Zen-auto (the crate's `AutoWindow`).
    pub update_interval: UpdateInterval,
    /// Zen-auto's threshold: a window ends once this fraction of the model's 2-D weights have
    /// left at least as much gradient to the CPU as they gave the device (DeepSpeed's 0.99).
    pub auto_ratio: f64,
    /// Run the CPU update on a worker thread; its result reaches the weights one window later.
    pub overlap_step: bool,
    /// The first this many steps end a window each (the CPU updates everything every step), as
    /// DeepSpeed's `full_warm_up_rounds`; the windows of `update_interval` steps start after them.
    pub full_warm_up_rounds: u64,
}

/// A select interval that is never reached: the columns chosen at the first step stay.
const NEVER: u64 = u64::MAX;

impl ZenFlowOptions {
    /// The select and update intervals in steps (an update interval of `u64::MAX` with
    /// Zen-auto: its windows end by the crate's `AutoWindow`), or why the engine cannot run these
    /// settings.
    pub fn intervals(&self) -> Result<(u64, u64), EngineError> {
        if !(0.0..=1.0).contains(&self.topk_ratio) {
            return Err(EngineError::Config("ZenFlow's topk_ratio must lie in [0, 1]"));
        }
        if !(0.0..=1.0).contains(&self.auto_ratio) {
            return Err(EngineError::Config("ZenFlow's auto_ratio must lie in [0, 1]"));
        }
        let update = match self.update_interval {
            UpdateInterval::Every(update) => update,
            UpdateInterval::Auto => NEVER,
        };
        let select = match self.selection {
            Selection::Step { interval } => interval,
            // By epochs, as the trainer reports them (`select_epochs`), not by steps.
            Selection::Auto | Selection::Epoch { .. } => NEVER,
        };
        if update == 0 || select == 0 || self.select_epochs() == Some(0) {
            return Err(EngineError::Config("ZenFlow's intervals must be at least 1"));
        }
        if select != NEVER && update != NEVER && select < update {
            return Err(EngineError::Config(
                "ZenFlow's select_interval must be at least its update_interval",
            ));
        }
        Ok((select, update))
    }

    /// Epochs between selections with the `"auto"` (one) and `"epoch"` strategies.
    pub fn select_epochs(&self) -> Option<u64> {
        match self.selection {
            Selection::Auto => Some(1),
            Selection::Epoch { interval } => Some(interval),
            Selection::Step { .. } => None,
        }
    }
}

/// One parameter as a row-major matrix, and the part of it this rank owns.
#[derive(Clone, Debug)]
pub(crate) struct MatrixParam {
    /// Its index in the layout.
    param: usize,
    /// The flat index of element `[0, 0]`.
    start: usize,
    /// The matrix's width: `slices × inner`.
    cols: usize,
    /// Slices along the split axis (columns with the last), and the contiguous elements of one
    /// slice in a matrix row (1 with the last axis).
    slices: usize,
    inner: usize,
    /// Selected slices per selection.
    k: usize,
    /// This rank's elements of it, counted from `start`.
    owned: Range<usize>,
    /// Whether AdamW's weight decay applies to it ([`ParamView::takes_weight_decay`]).
    decays: bool,
    /// Where its columns' importance goes in the model-wide importance vector (`None`: 1-D,
    /// always selected when anything is).
    importance_at: Option<usize>,
}

/// Selected elements whose device state a new selection hands to the host optimizer at a time:
/// the three fp32 pieces (and one download's staging) are the exchange's host memory, 16 B per
/// element of the piece, not of the whole selection (some 6 GiB at llama-8b).
pub(crate) const EXCHANGE_PIECE: usize = 4 << 20;

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
    /// The row-major blocks of this rank's elements of every 2-D parameter, as `(flat index of
    /// the first element, rows, cols, where its first column's sum goes in importance)`.
    importance_blocks: Vec<(usize, usize, usize, usize)>,
    pub importance_host: zeroflow_device::HostBuffer<f32>,
    /// The window: this rank's partition of the gradients summed over the window's steps, in
    /// `f32` on the device. Streamed through the CPU step when the window ends, then cleared.
    pub window: std::sync::Arc<D::Buffer<f32>>,
    /// With `overlap_step` (the window aside on the device): the window that ended last, which
    /// the worker's CPU step streams from while the next window fills `window` (the two are
    /// swapped at each window end).
    pub window_aside: Option<std::sync::Arc<D::Buffer<f32>>>,
    pub overlap_step: bool,
    /// Compute → d2h (and comm): the window holds this step's gradients.
    pub window_ready: D::Event,
    /// D2h → compute, with the window aside on the host: the last window has been copied out
    /// and cleared.
    pub window_copied: Option<D::Event>,
    /// With `overlap_step` and the window aside on the device: where the worker uploads the
    /// weights of its CPU step (this rank's partition), so that applying them is a copy on the
    /// device; `aside_ready` says they are there and not yet applied. (The host path's are in
    /// its upload buffer.)
    pub aside: Option<std::sync::Arc<D::Buffer<P>>>,
    pub aside_ready: bool,
    /// The CPU's AdamW schedule: one step per window.
    pub cpu_adamw: zeroflow_optim::AdamW,
    /// Zen-auto's state (`update_interval: "auto"`).
    pub auto: Option<AutoWindow>,
    /// Steps taken in the current window.
    pub steps_in_window: u64,
    /// Steps since the last selection (`None` before the first).
    pub since_selection: Option<u64>,
    /// With epoch-based selection: epochs between selections, and the epochs the trainer has
    /// reported since the last one.
    pub select_epochs: Option<u64>,
    pub epochs_since_selection: u64,
    /// Compute → h2d: the device step has written the weights and the compact weights.
    pub device_done: Option<D::Event>,
}

impl<D: Device + Kernels, P: Float> ZenFlow<D, P> {
    /// Allocates the compact buffers for the largest selection `ratio` can make in `owned`, and
    /// the aside window and weights on the device where `device_aside` says so.
    pub fn new(
        device: &D,
        layout: &FlatLayout,
        owned: &Range<usize>,
        options: &ZenFlowOptions,
        adamw: zeroflow_optim::AdamWConfig,
        device_aside: bool,
    ) -> Result<Self, EngineError> {
        let (select_interval, update_interval) = options.intervals()?;
        let matrices = matrices(layout, owned, options.topk_ratio);
        let importance_blocks = importance_blocks(&matrices);
        let (capacity, index_capacity) = compact_capacity(&matrices);
        // Model-wide, so that every rank all-reduces the same length.
        let columns = layout_columns(layout);
        let alloc = |len: usize| device.alloc::<f32>(len.max(1));
        Ok(ZenFlow {
            select_interval,
            update_interval,
            full_warm_up_rounds: options.full_warm_up_rounds,
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
                no_decay: NoDecay::default(),
            },
            grads: device.alloc(capacity.max(1))?,
            grads_f32: alloc(capacity)?,
            weights: device.alloc(capacity.max(1))?,
            importance: alloc(columns)?,
            importance_blocks,
            importance_host: device
                .alloc_host(columns.max(1), zeroflow_device::HostMemory::Pinned)?,
            window: std::sync::Arc::new(device.alloc(owned.len().max(1))?),
            window_aside: match device_aside {
                true => Some(std::sync::Arc::new(device.alloc(owned.len().max(1))?)),
                false => None,
            },
            overlap_step: options.overlap_step,
            window_ready: device.new_event()?,
            window_copied: None,
            aside: match device_aside {
                true => Some(std::sync::Arc::new(device.alloc(owned.len().max(1))?)),
                false => None,
            },
            aside_ready: false,
            cpu_adamw: zeroflow_optim::AdamW::new(adamw)?,
            auto: match options.update_interval {
                UpdateInterval::Auto => Some(AutoWindow::new(layout, options)),
                UpdateInterval::Every(_) => None,
            },
            steps_in_window: 0,
            since_selection: None,
            select_epochs: options.select_epochs(),
            epochs_since_selection: 0,
            device_done: None,
        })
    }

    /// True if the step about to be taken starts a window that selects again.
    pub fn selection_due(&self) -> bool {
        self.selects
            && self.steps_in_window == 0
            && (self.since_selection.is_none_or(|since| since >= self.select_interval)
                || self.select_epochs.is_some_and(|e| self.epochs_since_selection >= e))
    }

    /// Queues this rank's partial column importances (Σ|g| over its elements of each column)
    /// into `importance` on `stream`, from the gradients of `owned` in `source`, whose element 0
    /// is flat element `shift`.
    pub fn queue_importance(
        &self,
        device: &D,
        stream: &D::Stream,
        source: &D::Buffer<P>,
        shift: usize,
    ) -> Result<(), EngineError> {
        device.fill(stream, &self.importance, 0..self.importance.len(), 0.0)?;
        for &(start, rows, cols, at) in &self.importance_blocks {
            let block = Matrix { buffer: source, offset: start - shift, rows, cols };
            device.column_abs_sums(stream, block, &self.importance, at)?;
        }
        Ok(())
    }

    /// Selects from the model-wide importances in `importance_host` and lays out the blocks.
    pub fn select(&mut self) {
        for (m, selected) in self.matrices.iter().zip(&mut self.selected) {
            *selected = match m.importance_at {
                None => (0..m.k as u32).collect(),
                Some(at) => top_k(&self.importance_host[at..at + m.slices], m.k),
            };
        }
        if let Some(auto) = &mut self.auto {
            for p in &mut auto.params {
                p.selected = top_k(&self.importance_host[p.at..p.at + p.cols], p.k);
            }
        }
        self.lay_out();
        self.since_selection = Some(0);
        self.epochs_since_selection = 0;
    }

    /// The blocks and compact offsets of the selection in `selected` (and the compact elements
    /// of 1-D parameters, which take no weight decay).
    fn lay_out(&mut self) {
        self.blocks.clear();
        self.indices.clear();
        let mut no_decay = Vec::new();
        let mut compact = 0;
        for (m, slices) in self.matrices.iter().zip(&self.selected) {
            // A slice is `inner` adjacent columns of the matrix.
            let inner = m.inner as u32;
            let columns: Vec<u32> =
                slices.iter().flat_map(|&j| j * inner..(j + 1) * inner).collect();
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
                if !m.decays {
                    no_decay.push(compact..compact + rows * index.len());
                }
                compact += rows * index.len();
            }
        }
        self.compact_len = compact;
        self.state.no_decay = NoDecay::new(no_decay);
    }

    /// The selection by parameter index, for a checkpoint.
    pub fn selection(&self) -> Vec<(usize, Vec<u32>)> {
        let matrices = self.matrices.iter().zip(&self.selected);
        matrices.filter(|(_, s)| !s.is_empty()).map(|(m, s)| (m.param, s.clone())).collect()
    }

    /// Takes the selection of a checkpoint (saved by any number of ranks), or an error naming a
    /// column that cannot be selected.
    pub fn restore_selection(
        &mut self,
        saved: &[(usize, Vec<u32>)],
        rank: usize,
    ) -> Result<(), EngineError> {
        for (m, selected) in self.matrices.iter().zip(&mut self.selected) {
            selected.clear();
            if let Some((_, columns)) = saved.iter().find(|(param, _)| *param == m.param) {
                if columns.len() > m.k || columns.iter().any(|&c| c as usize >= m.slices) {
                    return Err(EngineError::Restore {
                        rank,
                        reason: "its ZenFlow selection does not fit this model and topk_ratio",
                    });
                }
                selected.clone_from(columns);
            }
        }
        if let Some(auto) = &mut self.auto {
            for p in &mut auto.params {
                let saved = saved.iter().find(|(param, _)| *param == p.param);
                p.selected = saved.map(|(_, columns)| columns.clone()).unwrap_or_default();
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
        self.scatter_weights_ending(device, stream, params, 0..usize::MAX)
    }

    /// [`ZenFlow::scatter_weights`] of the blocks whose last element is in `last` (flat): the
    /// blocks a piece of the flat weights completes.
    pub fn scatter_weights_ending(
        &self,
        device: &D,
        stream: &D::Stream,
        params: &D::Buffer<P>,
        last: Range<usize>,
    ) -> Result<(), EngineError> {
        let ending = |block: &&Block| last.contains(&(block.start + block.rows * block.cols - 1));
        for block in self.blocks.iter().filter(ending) {
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
    /// Epochs reported since the last selection (epoch-based selection).
    pub epochs_since_selection: u64,
    /// CPU steps (windows) taken.
    pub cpu_steps: u64,
    /// The window so far: the gradients of `window_flat` (this rank's partition, global flat
    /// indices), summed over ranks and the window's steps (empty in a checkpoint opened with
    /// `checkpoint::open`, which reads them from the file when restoring).
    pub window_flat: Range<usize>,
    pub window_grads: Vec<f32>,
    /// Zen-auto's window state (empty without it): model-wide, the same on every rank.
    pub auto: Vec<f64>,
}

/// The largest selection's elements and column indices: every block holds min(k, its columns)
/// selected columns (the compact buffers' lengths; [`compact_elements`] for the memory plan).
fn compact_capacity(matrices: &[MatrixParam]) -> (usize, usize) {
    // The largest selection: every block holds min(k, its columns) selected columns (of `inner`
    // elements each where the split axis is not the last).
    let (mut capacity, mut index_capacity) = (0, 0);
    for m in matrices {
        for (rows, cols, _) in block_shapes(m) {
            capacity += rows * (m.k * m.inner).min(cols);
            index_capacity += (m.k * m.inner).min(cols);
        }
    }
    (capacity, index_capacity)
}

/// What [`ZenFlow::new`] allocates for `owned` of `layout` at `ratio`: (the compact buffers'
/// elements, their column indices, the model's columns).
pub(crate) fn compact_elements(
    layout: &FlatLayout,
    owned: &Range<usize>,
    ratio: f64,
) -> (usize, usize, usize) {
    let (capacity, index_capacity) = compact_capacity(&matrices(layout, owned, ratio));
    (capacity.max(1), index_capacity.max(1), layout_columns(layout).max(1))
}

/// Every parameter with elements in `owned`, as a matrix, with its `k` for `ratio`.
fn matrices(layout: &FlatLayout, owned: &Range<usize>, ratio: f64) -> Vec<MatrixParam> {
    let mut importance_at = 0;
    let mut out = Vec::new();
    for (index, param) in layout.params().iter().enumerate() {
        let two_d = param.shape.len() >= 2;
        let (slices, inner) = match two_d {
            true => (split_slices(param), param.split().2),
            false => (1, 1),
        };
        let cols = slices * inner;
        let at = two_d.then_some(importance_at);
        if two_d {
            importance_at += slices;
        }
        let range = param.flat_range();
        let inside = range.start.max(owned.start)..range.end.min(owned.end);
        if inside.is_empty() || ratio == 0.0 {
            continue;
        }
        let k = if two_d { selected_columns(ratio, slices) } else { 1 };
        let owned = inside.start - range.start..inside.end - range.start;
        out.push(MatrixParam {
            param: index,
            start: range.start,
            cols,
            slices,
            inner,
            k,
            owned,
            decays: param.takes_weight_decay(),
            importance_at: at,
        });
    }
    out
}

/// The blocks [`ZenFlow::queue_importance`] sums, once per ZenFlow (see its field).
fn importance_blocks(matrices: &[MatrixParam]) -> Vec<(usize, usize, usize, usize)> {
    let mut blocks = Vec::new();
    for m in matrices {
        let Some(at) = m.importance_at else { continue };
        for (rows, cols, (row, col)) in block_shapes(m) {
            if m.inner == 1 {
                blocks.push((m.start + row * m.cols + col, rows, cols, at + col));
                continue;
            }
            // A slice's elements in a row are contiguous: one `[len, 1]` sum per row and slice.
            for r in row..row + rows {
                let mut c = col;
                while c < col + cols {
                    let slice = c / m.inner;
                    let end = ((slice + 1) * m.inner).min(col + cols);
                    blocks.push((m.start + r * m.cols + c, end - c, 1, at + slice));
                    c = end;
                }
            }
        }
    }
    blocks
}

/// How many of a weight's `cols` columns a selection takes: `round(ratio × cols)`, at least one
/// (none with `ratio` 0).
fn selected_columns(ratio: f64, cols: usize) -> usize {
    if ratio == 0.0 { 0 } else { ((ratio * cols as f64).round() as usize).clamp(1, cols) }
}

/// The `k` most important columns, ascending. Descending importance, ties to the lower column:
/// the same on every rank.
fn top_k(importance: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..importance.len() as u32).collect();
    order.sort_by(|&a, &b| {
        importance[b as usize].total_cmp(&importance[a as usize]).then(a.cmp(&b))
    });
    order.truncate(k);
    order.sort_unstable();
    order
}

/// Zen-auto (`update_interval: "auto"`): the window ends when enough of the model's weights have
/// left as much gradient mass to the CPU as they give the device. Per 2-D weight with `k` of `n`
/// columns selected, after the window's `u`-th step: `critic` is the mean over the window's steps
/// of the selected columns' L1 mass per column, `left` the unselected columns' L1 mass per column
/// summed over the window; the weight is ready when `left ≥ critic`, and the window ends when at
/// least `⌊auto_ratio × (2-D weights)⌋` are ready (a weight with every or no column selected is
/// always ready: nothing of it waits for the CPU, or nothing goes to the device).
///
/// This is DeepSpeed's rule (`zenflow_stage_1_and_2.py`) with its scale made explicit: DeepSpeed
/// divides the selected mass by `10 × topk_ratio` and the unselected by `10 × (1 − topk_ratio)`,
/// which is the per-column normalisation above up to a common factor, except that it divides the
/// running mean again at every step (so its windows depend on `topk_ratio` beyond the
/// normalisation unless `topk_ratio` is 0.1). The masses are the gradients summed over ranks, so
/// every rank ends the same windows.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AutoWindow {
    /// The number of ready weights that ends a window.
    threshold: usize,
    /// Every 2-D weight of the model.
    pub(crate) params: Vec<AutoParam>,
    /// Per weight: the selected columns' mean mass per column, the unselected columns' summed
    /// mass per column (the window's so far).
    pub(crate) critic: Vec<f64>,
    pub(crate) left: Vec<f64>,
}

/// One 2-D weight as Zen-auto sees it: model-wide, whichever rank holds it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AutoParam {
    /// Its index in the layout.
    param: usize,
    /// Where its columns are in the importance vector.
    at: usize,
    cols: usize,
    k: usize,
    /// Its selected columns (the same on every rank).
    selected: Vec<u32>,
}

impl AutoWindow {
    fn new(layout: &FlatLayout, options: &ZenFlowOptions) -> Self {
        let mut at = 0;
        let mut params = Vec::new();
        for (param, spec) in layout.params().iter().enumerate() {
            if spec.shape.len() < 2 {
                continue;
            }
            let cols = split_slices(spec);
            let k = selected_columns(options.topk_ratio, cols);
            params.push(AutoParam { param, at, cols, k, selected: Vec::new() });
            at += cols;
        }
        let threshold = (options.auto_ratio * params.len() as f64) as usize;
        let n = params.len();
        AutoWindow { threshold, params, critic: vec![0.0; n], left: vec![0.0; n] }
    }

    /// Takes the column masses of the window's `step`-th step (from 1; `importance`: Σ|g| per
    /// column, model-wide, summed over ranks) and says whether the window ends with it.
    pub(crate) fn observe(&mut self, importance: &[f32], step: u64) -> bool {
        let u = step.max(1) as f64;
        let mut ready = 0;
        for (i, p) in self.params.iter().enumerate() {
            let (k, n) = (p.selected.len(), p.cols);
            if k == 0 || k == n {
                ready += 1;
                continue;
            }
            let masses = &importance[p.at..p.at + n];
            let total: f64 = masses.iter().map(|&m| f64::from(m)).sum();
            let critic: f64 = p.selected.iter().map(|&c| f64::from(masses[c as usize])).sum();
            self.critic[i] = (self.critic[i] * (u - 1.0) + critic / k as f64) / u;
            self.left[i] += (total - critic) / (n - k) as f64;
            if self.left[i] >= self.critic[i] {
                ready += 1;
            }
        }
        ready >= self.threshold
    }

    /// A new window.
    pub(crate) fn reset(&mut self) {
        self.critic.fill(0.0);
        self.left.fill(0.0);
    }

    /// The state a checkpoint keeps: `critic` then `left`.
    pub(crate) fn state(&self) -> Vec<f64> {
        self.critic.iter().chain(&self.left).copied().collect()
    }

    /// Takes a checkpoint's state back, or an error if it is for another model.
    pub(crate) fn restore(&mut self, state: &[f64], rank: usize) -> Result<(), EngineError> {
        let n = self.params.len();
        if state.len() != 2 * n {
            let reason = "its Zen-auto state does not fit this model";
            return Err(EngineError::Restore { rank, reason });
        }
        self.critic.copy_from_slice(&state[..n]);
        self.left.copy_from_slice(&state[n..]);
        Ok(())
    }
}

/// Columns (slices) of every parameter of two or more dimensions: the length of the importance
/// vector.
fn layout_columns(layout: &FlatLayout) -> usize {
    layout.params().iter().filter(|p| p.shape.len() >= 2).map(split_slices).sum()
}

/// A parameter's slices along its split axis: the columns ZenFlow ranks.
fn split_slices(param: &ParamView) -> usize {
    param.split().1
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
    use zeroflow_core::config::Selection;
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

    /// Zen-auto's rule, step by step on hand-computed masses: a weight is ready once the mass
    /// per unselected column summed over the window reaches the selected columns' mean mass per
    /// column; the window ends at ⌊auto_ratio × weights⌋ ready weights; a weight whose columns
    /// are all selected is always ready.
    #[test]
    fn zen_auto_ends_the_window_when_the_left_mass_catches_up() {
        let specs = [
            ParamSpec::new("a", vec![3, 4]),
            ParamSpec::new("b", vec![5]),
            ParamSpec::new("c", vec![2, 2]),
        ];
        let layout =
            FlatLayout::new(&specs, 1, Alignment { param: 1, partition: 1 }).expect("a layout");
        let options = |auto_ratio| ZenFlowOptions {
            topk_ratio: 0.25,
            selection: Selection::Step { interval: 8 },
            update_interval: UpdateInterval::Auto,
            auto_ratio,
            overlap_step: false,
            full_warm_up_rounds: 0,
        };
        let window = |auto_ratio| {
            let mut auto = AutoWindow::new(&layout, &options(auto_ratio));
            // a: 1 of 4 columns (column 2), c: 1 of 2 (column 0); b is 1-D and not weighed.
            assert_eq!(
                auto.params.iter().map(|p| (p.at, p.cols, p.k)).collect::<Vec<_>>(),
                [(0, 4, 1), (4, 2, 1)]
            );
            auto.params[0].selected = vec![2];
            auto.params[1].selected = vec![0];
            auto
        };
        // Step by step: a's (critic, left) = (4, 1), (4, 3), (4, 4): ready at step 3;
        // c's = (2, 1), (2, 4), (2, 4): ready from step 2.
        let steps: [[f32; 6]; 3] =
            [[1., 1., 4., 1., 2., 1.], [2., 2., 4., 2., 2., 3.], [1., 1., 4., 1., 2., 0.]];
        let mut all = window(1.0);
        let ends: Vec<bool> = steps.iter().zip(1..).map(|(m, u)| all.observe(m, u)).collect();
        assert_eq!(ends, [false, false, true]);
        assert_eq!((all.critic.clone(), all.left.clone()), (vec![4.0, 2.0], vec![4.0, 4.0]));
        let mut half = window(0.5);
        let ends: Vec<bool> = steps.iter().zip(1..).map(|(m, u)| half.observe(m, u)).collect();
        assert_eq!(ends, [false, true, true]);
        // A new window starts from nothing; a state round-trips through a checkpoint.
        let state = all.state();
        all.reset();
        assert!(!all.observe(&steps[0], 1));
        all.restore(&state, 0).expect("the same model");
        assert_eq!(all.state(), state);
        assert!(all.restore(&state[1..], 0).is_err());
        // Every column of c selected: c is always ready, which is enough at threshold 1.
        let mut full = window(0.5);
        full.params[1].selected = vec![0, 1];
        let ends: Vec<bool> = steps.iter().zip(1..).map(|(m, u)| full.observe(m, u)).collect();
        assert_eq!(ends, [true, true, true]);
    }
}
