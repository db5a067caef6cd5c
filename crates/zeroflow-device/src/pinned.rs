//! How much page-locked host memory a device may hold, and what it does when asked for more.
//!
//! Page-locked ("pinned") memory is what the copy engines reach directly, but it cannot be
//! swapped out: a process that pins tens of GiB can make the machine swap everything else, and
//! `cuMemHostAlloc` of that much often fails outright. So every device counts the pinned bytes
//! it holds against a [`PinnedBudget`]; an `alloc_host(len, HostMemory::Pinned)` that would pass
//! the budget, or whose pinned allocation fails, gets ordinary pageable memory instead (copies
//! from and to it are correct, only slower), and the device warns once, with the bytes that fell
//! back and what to do ([`PinnedBudget::warn_fallback`]).

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use crate::error::{DeviceError, Result};
use crate::host::{HeapMemory, RawHostMemory};

/// The setting that raises the budget, as the warning names it.
pub const BUDGET_SETTING: &str = "--pinned-budget-mib (ZEROFLOW_PINNED_BUDGET_MIB, \
                                  zeroflow.offload.pinned_budget_mib)";

const MIB: f64 = (1u64 << 20) as f64;

/// The pinned host memory a device holds against its limit (shared by the device's clones).
#[derive(Debug)]
pub struct PinnedBudget {
    /// At most this many bytes pinned at once; `usize::MAX`: no limit (only failures fall back).
    limit: AtomicUsize,
    /// Bytes of pinned memory allocated and not yet freed.
    held: AtomicUsize,
    /// Bytes asked for as pinned that were given pageable memory, since the device was opened.
    fell_back: AtomicUsize,
    /// Pinned allocations that the driver refused (as opposed to the budget).
    refused: AtomicUsize,
    warned: AtomicBool,
    warnings: AtomicU32,
}

/// A reading of a device's [`PinnedBudget`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PinnedUse {
    /// `None`: no limit.
    pub limit: Option<usize>,
    /// Pinned bytes held now.
    pub held: usize,
    /// Bytes asked for as pinned that got pageable memory.
    pub fell_back: usize,
    /// How many of those allocations the driver refused (the rest passed the budget).
    pub refused: usize,
    /// Warnings emitted about it (at most one per device).
    pub warnings: u32,
}

impl Default for PinnedBudget {
    fn default() -> Self {
        PinnedBudget::new(None)
    }
}

impl PinnedBudget {
    /// A budget of `limit` bytes (`None`: no limit).
    pub fn new(limit: Option<usize>) -> Self {
        PinnedBudget {
            limit: AtomicUsize::new(limit.unwrap_or(usize::MAX)),
            held: AtomicUsize::new(0),
            fell_back: AtomicUsize::new(0),
            refused: AtomicUsize::new(0),
            warned: AtomicBool::new(false),
            warnings: AtomicU32::new(0),
        }
    }

    /// Sets the limit for allocations from now on (`None`: no limit). Memory already pinned
    /// stays pinned.
    pub fn set_limit(&self, limit: Option<usize>) {
        self.limit.store(limit.unwrap_or(usize::MAX), Ordering::Relaxed);
    }

    /// What the budget holds and gave up so far.
    pub fn usage(&self) -> PinnedUse {
        let limit = self.limit.load(Ordering::Relaxed);
        PinnedUse {
            limit: (limit != usize::MAX).then_some(limit),
            held: self.held.load(Ordering::Relaxed),
            fell_back: self.fell_back.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            warnings: self.warnings.load(Ordering::Relaxed),
        }
    }

    /// Takes `bytes` of the budget for a pinned allocation, or `None` where that would pass the
    /// limit. The reservation gives them back when dropped (with the memory, or at once where the
    /// allocation then fails).
    pub(crate) fn reserve(self: &Arc<Self>, bytes: usize) -> Option<Reservation> {
        let limit = self.limit.load(Ordering::Relaxed);
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&after| after <= limit)
            })
            .ok()?;
        Some(Reservation { budget: self.clone(), bytes })
    }

    /// Counts `bytes` asked for as pinned and given pageable memory (`refused`: the driver
    /// failed the pinned allocation; else it passed the budget).
    pub(crate) fn fall_back(&self, bytes: usize, refused: bool) {
        self.fell_back.fetch_add(bytes, Ordering::Relaxed);
        if refused {
            self.refused.fetch_add(1, Ordering::Relaxed);
        }
        tracing::debug!(bytes, refused, "a pinned host allocation fell back to pageable memory");
    }

    /// Warns, once for the device, where some memory asked for as pinned is pageable: how much,
    /// the budget, what it costs and what to do. Callers call it once their set-up has allocated
    /// (the engine at the end of its construction), so that the warning names the total; later
    /// fallbacks on a device that warned already are only counted ([`PinnedBudget::usage`]).
    pub fn warn_fallback(&self) {
        let usage = self.usage();
        if usage.fell_back == 0 || self.warned.swap(true, Ordering::AcqRel) {
            return;
        }
        self.warnings.fetch_add(1, Ordering::Relaxed);
        tracing::warn!("{}", fallback_message(&usage));
    }
}

/// The warning [`PinnedBudget::warn_fallback`] gives for `usage`.
pub fn fallback_message(usage: &PinnedUse) -> String {
    let mib = |bytes: usize| bytes as f64 / MIB;
    let budget = match usage.limit {
        Some(limit) => format!("the pinned budget of {:.1} MiB", mib(limit)),
        None => "no pinned budget".to_owned(),
    };
    let refused = match usage.refused {
        0 => String::new(),
        n => format!(", the driver refused {n} pinned allocation(s)"),
    };
    format!(
        "{:.1} MiB of host buffers that the GPU copies to or from are pageable, not pinned \
         ({:.1} MiB pinned within {budget}{refused}). Training goes on and the results are the \
         same, but copies from and to pageable memory go through the driver's own staging: \
         estimated at about half the PCIe speed, and they block the thread that queues them, so \
         they do not overlap compute. To pin them, raise {BUDGET_SETTING} if the host has the \
         memory to spare; or pin less: a smaller --stream-chunk-mib (staging holds six chunks), \
         or more ranks (the upload buffer holds the rank's partition).",
        mib(usage.fell_back),
        mib(usage.held),
    )
}

/// Bytes of a [`PinnedBudget`] held by one pinned allocation; given back on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    budget: Arc<PinnedBudget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// Host memory held against the pinned budget: page-locked memory on a GPU, a stand-in (heap
/// memory that counts as pinned) on the CPU device. The reservation is given back after the
/// memory is freed (fields drop in order).
#[derive(Debug)]
struct Reserved<M> {
    memory: M,
    _reservation: Reservation,
}

// SAFETY: `Reserved` forwards to the memory it owns, which upholds the contract itself.
unsafe impl<M: RawHostMemory> RawHostMemory for Reserved<M> {
    fn ptr(&self) -> NonNull<u8> {
        self.memory.ptr()
    }
    fn bytes(&self) -> usize {
        self.memory.bytes()
    }
    fn pinned(&self) -> bool {
        true
    }
}

/// The memory of an `alloc_host(_, HostMemory::Pinned)` of `bytes`: `pin`'s where the budget
/// has room, else pageable heap memory, counted as a fallback. `pin` returns `Ok(Err(reason))`
/// where the pinned allocation itself was refused (that falls back too), and `Err` for a failure
/// that is not about the memory (returned).
pub(crate) fn pinned_or_pageable<M: RawHostMemory + 'static>(
    budget: &Arc<PinnedBudget>,
    bytes: usize,
    pin: impl FnOnce(usize) -> Result<std::result::Result<M, DeviceError>>,
) -> Result<Box<dyn RawHostMemory>> {
    match budget.reserve(bytes) {
        Some(reservation) => match pin(bytes)? {
            Ok(memory) => return Ok(Box::new(Reserved { memory, _reservation: reservation })),
            Err(refused) => {
                drop(reservation);
                tracing::debug!(%refused, bytes, "pinned host allocation refused");
                budget.fall_back(bytes, true);
            }
        },
        None => budget.fall_back(bytes, false),
    }
    Ok(Box::new(HeapMemory::zeroed(bytes)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The budget admits allocations until the next would pass it, and a freed reservation
    /// makes room again.
    #[test]
    fn reservations_stay_within_the_limit_and_are_given_back_on_drop() {
        let budget = Arc::new(PinnedBudget::new(Some(100)));
        let first = budget.reserve(60).expect("60 of 100");
        assert!(budget.reserve(41).is_none(), "60 + 41 passes 100");
        let second = budget.reserve(40).expect("60 + 40 fits exactly");
        assert_eq!(budget.usage().held, 100);
        drop(first);
        assert_eq!(budget.usage().held, 40);
        assert!(budget.reserve(60).is_some());
        drop(second);
        assert_eq!(budget.usage().held, 0);
        budget.set_limit(None);
        assert!(budget.reserve(usize::MAX).is_some(), "no limit");
    }

    /// One warning per budget, however many allocations fell back, and none without a fallback.
    #[test]
    fn the_fallback_is_warned_about_once_and_only_when_something_fell_back() {
        let budget = PinnedBudget::new(Some(0));
        budget.warn_fallback();
        assert_eq!(budget.usage().warnings, 0);
        budget.fall_back(3 << 20, false);
        budget.fall_back(1 << 20, true);
        budget.warn_fallback();
        budget.warn_fallback();
        let usage = budget.usage();
        assert_eq!((usage.fell_back, usage.refused, usage.warnings), (4 << 20, 1, 1));
        let message = fallback_message(&usage);
        assert!(message.starts_with("4.0 MiB of host buffers"), "{message}");
        assert!(message.contains("the pinned budget of 0.0 MiB"), "{message}");
        assert!(message.contains("the driver refused 1 pinned allocation(s)"), "{message}");
        assert!(message.contains("--pinned-budget-mib"), "{message}");
    }
}
