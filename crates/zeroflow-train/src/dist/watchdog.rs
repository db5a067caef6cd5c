//! [`Watchdog`]: ends the process when the training loop stops making progress, for the one
//! failure the side channel cannot see: a rank that is alive (it heartbeats) but stuck, leaving
//! the others waiting in a collective forever. Off unless `ZEROFLOW_STEP_TIMEOUT` is set, since
//! only the user knows how long the slowest step, evaluation or checkpoint of a run may take.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Called once, from the watchdog's thread, with the time since the last progress.
pub type OnStall = Arc<dyn Fn(Duration) + Send + Sync>;

/// Watches the time between [`Watchdog::tick`]s; stops watching when dropped.
pub struct Watchdog {
    shared: Arc<Shared>,
}

struct Shared {
    start: Instant,
    /// Milliseconds since `start` at the last tick.
    last_tick_ms: AtomicU64,
    stopped: AtomicBool,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").finish_non_exhaustive()
    }
}

impl Watchdog {
    /// Starts watching: `on_stall` runs once if `timeout` passes without a tick.
    pub fn start(timeout: Duration, on_stall: OnStall) -> std::io::Result<Watchdog> {
        let shared = Arc::new(Shared {
            start: Instant::now(),
            last_tick_ms: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        });
        let watched = Arc::clone(&shared);
        let period = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        std::thread::Builder::new().name("zeroflow-watchdog".into()).spawn(move || {
            while !watched.stopped.load(Ordering::SeqCst) {
                std::thread::sleep(period);
                let now = watched.start.elapsed();
                let last = Duration::from_millis(watched.last_tick_ms.load(Ordering::SeqCst));
                let idle = now.saturating_sub(last);
                if idle > timeout && !watched.stopped.load(Ordering::SeqCst) {
                    return on_stall(idle);
                }
            }
        })?;
        Ok(Watchdog { shared })
    }

    /// Records progress.
    pub fn tick(&self) {
        let now = self.shared.start.elapsed().as_millis();
        self.shared.last_tick_ms.store(u64::try_from(now).unwrap_or(u64::MAX), Ordering::SeqCst);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use super::Watchdog;

    fn recorder() -> (super::OnStall, Arc<Mutex<Vec<Duration>>>) {
        let stalls = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&stalls);
        (Arc::new(move |idle| sink.lock().unwrap().push(idle)), stalls)
    }

    #[test]
    fn a_loop_that_ticks_is_left_alone_and_one_that_stops_is_reported_once() {
        let (on_stall, stalls) = recorder();
        let watchdog = Watchdog::start(Duration::from_millis(300), on_stall).unwrap();
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(50));
            watchdog.tick();
        }
        assert!(stalls.lock().unwrap().is_empty());
        std::thread::sleep(Duration::from_millis(900));
        let stalls = stalls.lock().unwrap().clone();
        assert_eq!(stalls.len(), 1, "{stalls:?}");
        assert!(stalls[0] > Duration::from_millis(300), "{stalls:?}");
    }

    #[test]
    fn a_dropped_watchdog_reports_nothing() {
        let (on_stall, stalls) = recorder();
        drop(Watchdog::start(Duration::from_millis(100), on_stall).unwrap());
        std::thread::sleep(Duration::from_millis(400));
        assert!(stalls.lock().unwrap().is_empty());
    }
}
