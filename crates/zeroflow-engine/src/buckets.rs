//! Buckets: the gradient ranges the model reports complete during backward, grouped into
//! contiguous stretches of at most `reduce_bucket_size` elements, each reduced as one.

use std::ops::Range;

use zeroflow_core::layout::FlatLayout;

use crate::EngineError;

/// Groups reported ranges into buckets and checks that every parameter is reported exactly once
/// per backward.
#[derive(Debug)]
pub(crate) struct Bucketer {
    /// The configured size (`reduce_bucket_size`).
    size: usize,
    /// The size in a backward whose pieces go to the host (no larger).
    to_host: usize,
    /// This backward's ([`Bucketer::reset`]).
    limit: usize,
    open: Option<Range<usize>>,
    reported: Vec<bool>,
}

impl Bucketer {
    /// Buckets of at most `size` elements, and of at most `to_host` (where less) in a backward
    /// whose pieces go to the host.
    pub(crate) fn new(size: usize, to_host: usize, params: usize) -> Self {
        let size = size.max(1);
        let to_host = to_host.clamp(1, size);
        Bucketer { size, to_host, limit: size, open: None, reported: vec![false; params] }
    }

    /// Starts a new backward, whose pieces go to the host where `to_host` says so.
    pub(crate) fn reset(&mut self, to_host: bool) {
        self.limit = if to_host { self.to_host } else { self.size };
        self.open = None;
        self.reported.fill(false);
    }

    /// Records that the gradients of `range` (whole parameters, with any padding between them)
    /// are complete, and calls `flush` with each bucket that is now ready.
    pub(crate) fn report(
        &mut self,
        layout: &FlatLayout,
        range: Range<usize>,
        flush: &mut impl FnMut(Range<usize>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        for index in layout.params_in(range.clone()) {
            let param = &layout.params()[index];
            let whole = param.flat_range();
            if whole.start < range.start || whole.end > range.end {
                return Err(EngineError::PartialGradient { param: param.name.clone(), range });
            }
            if std::mem::replace(&mut self.reported[index], true) {
                return Err(EngineError::DuplicateGradient { param: param.name.clone() });
            }
        }
        let merged = match self.open.take() {
            Some(open) => {
                let gap = if open.start >= range.end {
                    range.end..open.start
                } else {
                    open.end..range.start
                };
                let union = open.start.min(range.start)..open.end.max(range.end);
                if !layout.holds_parameters(gap) && union.len() <= self.limit {
                    union
                } else {
                    flush(open)?;
                    range
                }
            }
            None => range,
        };
        // A stretch longer than a bucket is reduced in bucket-sized pieces (all of it is ready).
        let mut rest = merged;
        while rest.len() > self.limit {
            flush(rest.start..rest.start + self.limit)?;
            rest.start += self.limit;
        }
        self.open = Some(rest);
        Ok(())
    }

    /// Ends the backward: flushes the last bucket, then fails if a parameter got no gradient.
    pub(crate) fn finish(
        &mut self,
        layout: &FlatLayout,
        flush: &mut impl FnMut(Range<usize>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        if let Some(open) = self.open.take() {
            flush(open)?;
        }
        match self.reported.iter().position(|done| !done) {
            Some(index) => {
                Err(EngineError::MissingGradient { param: layout.params()[index].name.clone() })
            }
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use zeroflow_core::layout::{Alignment, ParamSpec};

    use super::*;

    fn layout() -> FlatLayout {
        let specs: Vec<_> = (0..4).map(|i| ParamSpec::new(format!("p{i}"), [10])).collect();
        FlatLayout::new(&specs, 1, Alignment { param: 16, partition: 16 }).unwrap()
    }

    fn run(limit: usize, reports: &[Range<usize>]) -> Result<Vec<Range<usize>>, EngineError> {
        backward(&mut Bucketer::new(limit, limit, 4), false, reports)
    }

    /// One backward's buckets, its pieces going to the host where `to_host` says so.
    fn backward(
        bucketer: &mut Bucketer,
        to_host: bool,
        reports: &[Range<usize>],
    ) -> Result<Vec<Range<usize>>, EngineError> {
        let layout = layout();
        let mut buckets = Vec::new();
        let mut flush = |b: Range<usize>| {
            buckets.push(b);
            Ok(())
        };
        bucketer.reset(to_host);
        for r in reports {
            bucketer.report(&layout, r.clone(), &mut flush)?;
        }
        bucketer.finish(&layout, &mut flush)?;
        Ok(buckets)
    }

    #[test]
    fn adjacent_reports_across_padding_merge_up_to_the_bucket_size() {
        // Parameters at 0, 16, 32, 48, each 10 long, reported in backward order.
        let buckets = run(40, &[48..58, 32..42, 16..26, 0..10]).unwrap();
        assert_eq!(buckets, [32..58, 0..26]);
    }

    #[test]
    fn a_backward_to_the_host_cuts_its_own_size_and_never_a_larger_one() {
        let reports = [48..58, 32..42, 16..26, 0..10];
        let (small, whole) = (vec![48..58, 32..42, 16..26, 0..10], vec![32..58, 0..26]);
        let mut bucketer = Bucketer::new(40, 12, 4);
        for (to_host, expected) in [(true, &small), (false, &whole), (true, &small)] {
            let buckets = backward(&mut bucketer, to_host, &reports).unwrap();
            assert_eq!(&buckets, expected, "to the host: {to_host}");
        }
        // A larger size for the host's backwards is the configured one.
        let buckets = backward(&mut Bucketer::new(40, 100, 4), true, &reports).unwrap();
        assert_eq!(buckets, whole);
    }

    #[test]
    fn a_report_that_skips_a_parameter_starts_a_new_bucket() {
        let buckets = run(100, &[48..58, 16..26, 32..42, 0..10]).unwrap();
        assert_eq!(buckets, [48..58, 0..42]);
    }

    #[test]
    fn a_missing_gradient_names_the_parameter() {
        let err = run(100, &[48..58, 0..10, 16..26]).unwrap_err();
        assert!(matches!(err, EngineError::MissingGradient { param } if param == "p2"));
    }

    #[test]
    fn reporting_a_parameter_twice_or_in_part_is_an_error() {
        assert!(matches!(run(100, &[0..10, 0..10]), Err(EngineError::DuplicateGradient { .. })));
        let partial: &[Range<usize>] = &[Range { start: 0, end: 5 }];
        assert!(matches!(run(100, partial), Err(EngineError::PartialGradient { .. })));
    }

    #[test]
    fn a_stretch_longer_than_a_bucket_is_cut_into_buckets() {
        let buckets = run(12, &[48..58, 32..42]).unwrap_err();
        assert!(matches!(buckets, EngineError::MissingGradient { .. }));
        let buckets = run(12, &[48..58, 32..42, 16..26, 0..10]).unwrap();
        assert!(buckets.iter().all(|b| b.len() <= 12));
        let covered: usize = buckets.iter().map(|b| b.len()).sum();
        assert!(covered >= 40);
    }
}
