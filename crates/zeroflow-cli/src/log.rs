//! Where the log and the notices go: stderr, with the progress bar on screen (if any) taken off
//! while a line is written and drawn again below it, so that a warning from the library (a
//! refused save, pageable memory) never lands in the middle of the bar.

use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use indicatif::ProgressBar;

/// The bar on screen, if any, with the number of its [`Shown`].
static ON_SCREEN: Mutex<Option<(u64, ProgressBar)>> = Mutex::new(None);

fn on_screen() -> std::sync::MutexGuard<'static, Option<(u64, ProgressBar)>> {
    ON_SCREEN.lock().unwrap_or_else(|e| e.into_inner())
}

/// A bar on screen while this lives: what [`line()`] and the log write goes above it. Dropping it
/// clears the bar.
#[derive(Debug)]
pub struct Shown {
    bar: ProgressBar,
    number: u64,
}

impl Shown {
    pub fn new(bar: ProgressBar) -> Shown {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let number = NEXT.fetch_add(1, Ordering::Relaxed);
        *on_screen() = Some((number, bar.clone()));
        Shown { bar, number }
    }

    pub fn bar(&self) -> &ProgressBar {
        &self.bar
    }
}

impl Drop for Shown {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
        let mut shown = on_screen();
        // A newer bar stays on screen.
        if shown.as_ref().is_some_and(|(number, _)| *number == self.number) {
            *shown = None;
        }
    }
}

/// Whether a bar is on screen now.
#[cfg(test)]
pub fn bar_on_screen() -> bool {
    on_screen().is_some()
}

/// Writes `bytes` to stderr in one piece, with the bar (if any) off the screen meanwhile.
fn write_stderr(bytes: &[u8]) {
    let write = || {
        let mut stderr = std::io::stderr().lock();
        // Nowhere to say that stderr failed.
        let _ = stderr.write_all(bytes);
        let _ = stderr.flush();
    };
    // Cloned out of the lock: a line written while the bar is cleared must not hold it.
    let bar = on_screen().as_ref().map(|(_, bar)| bar.clone());
    match bar {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

/// Prints a line on stderr, above the bar if one is on screen.
pub fn line(text: &str) {
    write_stderr(format!("{text}\n").as_bytes());
}

/// The log's writer: an event formatted into it is written when it is dropped, in one piece.
#[derive(Default)]
pub struct EventWriter(Vec<u8>);

impl Write for EventWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            write_stderr(&self.0);
        }
    }
}

/// Logs to stderr at `ZEROFLOW_LOG`'s level (default `info`), above the bar.
pub fn init() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("ZEROFLOW_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(EventWriter::default)
        .with_ansi(ansi)
        .init();
}

#[cfg(test)]
mod tests {
    use indicatif::ProgressBar;

    use super::{Shown, bar_on_screen};

    #[test]
    fn a_bar_is_on_screen_while_shown_and_cleared_when_dropped() {
        // One test: the bar on screen is the process's.
        assert!(!bar_on_screen());
        let (first_bar, second_bar) = (ProgressBar::hidden(), ProgressBar::hidden());
        let first = Shown::new(first_bar.clone());
        assert!(bar_on_screen());
        let second = Shown::new(second_bar.clone());
        // The older one's end leaves the newer one on screen.
        drop(first);
        assert!(first_bar.is_finished());
        assert!(bar_on_screen());
        drop(second);
        assert!(second_bar.is_finished());
        assert!(!bar_on_screen());
    }
}
