//! The happens-before checker of the CPU device.
//!
//! Every stream has a vector clock: entry `s` is the position (number of queued operations) of
//! stream `s` that this stream is known to run after. Queueing an operation advances the stream's
//! own entry; recording an event snapshots the clock; waiting on an event joins the snapshot into the
//! waiting stream's clock; a host wait joins it into the host's clock, which every later queued
//! operation inherits (the host enqueues it after it saw the wait complete).
//!
//! Every buffer keeps a log of recent accesses (range, stream, position, read or write). An
//! operation that reads or writes a range is admitted only if every earlier conflicting access
//! (overlapping, at least one of the two a write, from another stream) happens before it by that
//! order. Otherwise it is a race that a GPU would turn into a silent wrong value; here it is refused
//! with [`DeviceError::Race`] before it runs. Because the order is decided when operations are
//! queued, the check is deterministic: it does not depend on how the streams happen to be timed.

use std::collections::HashMap;
use std::ops::Range;

use zeroflow_core::DType;

use crate::error::{DeviceError, Race, Result};

/// A vector clock; missing entries are zero.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Clock(Vec<u64>);

impl Clock {
    pub(crate) fn get(&self, stream: usize) -> u64 {
        self.0.get(stream).copied().unwrap_or(0)
    }

    fn set(&mut self, stream: usize, value: u64) {
        if self.0.len() <= stream {
            self.0.resize(stream + 1, 0);
        }
        self.0[stream] = value;
    }

    pub(crate) fn join(&mut self, other: &Clock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (mine, theirs) in self.0.iter_mut().zip(&other.0) {
            *mine = (*mine).max(*theirs);
        }
    }
}

/// One argument of an operation, as the checker sees it.
#[derive(Clone, Debug)]
pub(crate) struct Touch {
    pub buffer: u64,
    pub dtype: DType,
    pub range: Range<usize>,
    pub write: bool,
}

#[derive(Clone, Debug)]
struct Access {
    range: Range<usize>,
    stream: usize,
    position: u64,
    write: bool,
    op: &'static str,
}

impl Access {
    /// True if this access is ordered before anything that runs with clock `clock`.
    fn before(&self, clock: &Clock) -> bool {
        clock.get(self.stream) >= self.position
    }
}

/// Logs longer than this are swept of accesses that the host has seen complete.
const SWEEP_AT: usize = 64;

#[derive(Debug, Default)]
pub(crate) struct Checker {
    streams: Vec<Clock>,
    names: Vec<&'static str>,
    host: Clock,
    logs: HashMap<u64, Vec<Access>>,
}

impl Checker {
    pub(crate) fn add_stream(&mut self, name: &'static str) -> usize {
        self.streams.push(Clock::default());
        self.names.push(name);
        self.streams.len() - 1
    }

    /// Admits an operation on `stream` that touches `touches`, or refuses it as a race. On
    /// success returns its position in the stream (1 for the first operation).
    pub(crate) fn admit(
        &mut self,
        stream: usize,
        op: &'static str,
        touches: &[Touch],
    ) -> Result<u64> {
        let mut clock = self.streams[stream].clone();
        clock.join(&self.host);
        let position = clock.get(stream) + 1;
        clock.set(stream, position);
        for touch in touches {
            let log = self.logs.get(&touch.buffer).map(Vec::as_slice).unwrap_or_default();
            let conflict = log.iter().find(|a| {
                a.stream != stream
                    && (a.write || touch.write)
                    && overlaps(&a.range, &touch.range)
                    && !a.before(&clock)
            });
            if let Some(other) = conflict {
                return Err(DeviceError::Race(Box::new(Race {
                    buffer: touch.buffer,
                    dtype: touch.dtype,
                    range: intersection(&other.range, &touch.range),
                    op,
                    stream: self.names[stream],
                    access: if touch.write { "writes" } else { "reads" },
                    other_op: other.op,
                    other_stream: self.names[other.stream],
                    other_access: if other.write { "writes" } else { "reads" },
                })));
            }
        }
        for touch in touches {
            let access =
                Access { range: touch.range.clone(), stream, position, write: touch.write, op };
            self.log(touch.buffer, access, &clock);
        }
        self.streams[stream] = clock;
        Ok(position)
    }

    fn log(&mut self, buffer: u64, access: Access, clock: &Clock) {
        let log = self.logs.entry(buffer).or_default();
        // An earlier access that happens before this one and lies inside its range can go: any
        // later access that would race with it races with this one too (for a read, only earlier
        // reads are covered that way).
        log.retain(|a| {
            let covered = access.range.start <= a.range.start && a.range.end <= access.range.end;
            !(covered
                && (access.write || !a.write)
                && (a.stream == access.stream || a.before(clock)))
        });
        log.push(access);
        if log.len() >= SWEEP_AT {
            // An access the host has seen complete is ordered before everything queued from now
            // on, on any stream, new streams included: every queued operation inherits the host's
            // clock.
            let host = &self.host;
            log.retain(|a| !a.before(host));
        }
    }

    /// The current clock of `stream`, for an event recorded now.
    pub(crate) fn snapshot(&self, stream: usize) -> Clock {
        let mut clock = self.streams[stream].clone();
        clock.join(&self.host);
        clock
    }

    /// `stream` will run after everything `event` covers.
    pub(crate) fn stream_waits(&mut self, stream: usize, event: &Clock) {
        self.streams[stream].join(event);
    }

    /// The host saw everything `event` covers complete.
    pub(crate) fn host_waits(&mut self, event: &Clock) {
        self.host.join(event);
    }

    /// Forgets a freed buffer.
    pub(crate) fn forget(&mut self, buffer: u64) {
        self.logs.remove(&buffer);
    }
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end && !a.is_empty() && !b.is_empty()
}

fn intersection(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    a.start.max(b.start)..a.end.min(b.end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(range: Range<usize>, write: bool) -> Touch {
        Touch { buffer: 1, dtype: DType::F32, range, write }
    }

    #[test]
    fn a_read_on_another_stream_without_an_event_is_a_race() {
        let mut c = Checker::default();
        let (a, b) = (c.add_stream("a"), c.add_stream("b"));
        c.admit(a, "write", &[touch(0..10, true)]).unwrap();
        let err = c.admit(b, "read", &[touch(5..6, false)]).unwrap_err();
        assert!(matches!(err, DeviceError::Race(race) if race.range == (5..6)));
    }

    #[test]
    fn an_event_orders_a_write_before_a_read_on_another_stream() {
        let mut c = Checker::default();
        let (a, b) = (c.add_stream("a"), c.add_stream("b"));
        c.admit(a, "write", &[touch(0..10, true)]).unwrap();
        let event = c.snapshot(a);
        c.stream_waits(b, &event);
        c.admit(b, "read", &[touch(0..10, false)]).unwrap();
    }

    #[test]
    fn disjoint_ranges_and_concurrent_reads_do_not_conflict() {
        let mut c = Checker::default();
        let (a, b) = (c.add_stream("a"), c.add_stream("b"));
        c.admit(a, "write", &[touch(0..5, true)]).unwrap();
        c.admit(b, "write", &[touch(5..10, true)]).unwrap();
        let mut d = Checker::default();
        let (a, b) = (d.add_stream("a"), d.add_stream("b"));
        d.admit(a, "read", &[touch(0..10, false)]).unwrap();
        d.admit(b, "read", &[touch(0..10, false)]).unwrap();
    }

    #[test]
    fn a_host_wait_orders_later_operations_on_every_stream() {
        let mut c = Checker::default();
        let (a, b) = (c.add_stream("a"), c.add_stream("b"));
        c.admit(a, "write", &[touch(0..10, true)]).unwrap();
        let event = c.snapshot(a);
        c.host_waits(&event);
        c.admit(b, "write", &[touch(0..10, true)]).unwrap();
    }

    #[test]
    fn a_write_after_a_read_on_another_stream_needs_an_event_too() {
        let mut c = Checker::default();
        let (a, b) = (c.add_stream("a"), c.add_stream("b"));
        c.admit(a, "read", &[touch(0..10, false)]).unwrap();
        assert!(c.admit(b, "write", &[touch(9..12, true)]).is_err());
    }

    #[test]
    fn pruned_accesses_still_expose_races_through_the_access_that_covers_them() {
        let mut c = Checker::default();
        let (a, b) = (c.add_stream("a"), c.add_stream("b"));
        for i in 0..200 {
            c.admit(a, "write", &[touch(0..4, true)]).unwrap();
            c.admit(a, "write", &[touch(i % 7..8, true)]).unwrap();
        }
        assert!(c.logs[&1].len() <= 8, "the log stays bounded: {}", c.logs[&1].len());
        assert!(c.admit(b, "read", &[touch(2..3, false)]).is_err());
    }
}
