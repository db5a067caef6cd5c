//! One worker thread per stream: operations are queued, and run later, in order, on the worker.
//! In chaos mode the worker sleeps a random short time before each operation, so that an operation
//! that is not ordered by an event may run before or after the one it should wait for.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{DeviceError, Result};
use crate::host::ErrorSink;

/// Random delays before each operation of every stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chaos {
    /// Seeds every stream's delays (stream `i` uses `seed + i`).
    pub seed: u64,
    /// The longest delay.
    pub max_delay: Duration,
    /// The share of operations that are delayed, in percent.
    pub percent_delayed: u32,
}

impl Chaos {
    /// Delays of up to 200 µs before half of all operations.
    pub fn new(seed: u64) -> Self {
        Chaos { seed, max_delay: Duration::from_micros(200), percent_delayed: 50 }
    }
}

/// How far a stream has got: the position of the last operation that finished.
#[derive(Debug, Default)]
pub(crate) struct Progress {
    done: Mutex<u64>,
    advanced: Condvar,
}

impl Progress {
    /// Blocks until the operation at `position` has finished.
    pub(crate) fn wait_for(&self, position: u64) {
        let mut done = self.done.lock().unwrap_or_else(|e| e.into_inner());
        while *done < position {
            done = self.advanced.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// True if the operation at `position` has finished.
    pub(crate) fn reached(&self, position: u64) -> bool {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) >= position
    }

    fn finish(&self, position: u64) {
        *self.done.lock().unwrap_or_else(|e| e.into_inner()) = position;
        self.advanced.notify_all();
    }
}

pub(crate) type Work = Box<dyn FnOnce() -> Result<()> + Send>;

pub(crate) enum Op {
    /// Run `work`, then mark `position` finished.
    Run { position: u64, work: Work },
    /// Wait until another stream has finished `position`, then mark our own `own` finished.
    Wait { own: u64, other: Arc<Progress>, position: u64 },
}

/// The worker thread of one stream.
#[derive(Debug)]
pub(crate) struct Worker {
    pub(crate) name: &'static str,
    pub(crate) progress: Arc<Progress>,
    queue: Mutex<Option<Sender<Op>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Worker {
    pub(crate) fn spawn(
        name: &'static str,
        index: usize,
        chaos: Option<Chaos>,
        sink: Arc<dyn ErrorSink>,
    ) -> Result<Arc<Self>> {
        let (sender, receiver) = channel();
        let progress = Arc::new(Progress::default());
        let thread = std::thread::Builder::new()
            .name(format!("zeroflow-{name}"))
            .spawn({
                let progress = progress.clone();
                move || run(receiver, progress, chaos.map(|c| (c, index)), sink, name)
            })
            .map_err(|e| DeviceError::StreamStopped { stream: name, reason: e.to_string() })?;
        Ok(Arc::new(Worker {
            name,
            progress,
            queue: Mutex::new(Some(sender)),
            thread: Mutex::new(Some(thread)),
        }))
    }

    pub(crate) fn push(&self, op: Op) -> Result<()> {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let stopped = || DeviceError::StreamStopped {
            stream: self.name,
            reason: "the device was shut down".into(),
        };
        queue.as_ref().ok_or_else(stopped)?.send(op).map_err(|_| stopped())
    }

    /// Lets the worker drain its queue and joins it.
    pub(crate) fn shut_down(&self) {
        drop(self.queue.lock().unwrap_or_else(|e| e.into_inner()).take());
        if let Some(thread) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = thread.join();
        }
    }
}

fn run(
    receiver: Receiver<Op>,
    progress: Arc<Progress>,
    chaos: Option<(Chaos, usize)>,
    sink: Arc<dyn ErrorSink>,
    name: &'static str,
) {
    let mut delays = chaos.map(|(c, index)| (c, ChaCha8Rng::seed_from_u64(c.seed + index as u64)));
    for op in receiver {
        if let Some((chaos, rng)) = &mut delays
            && rng.random_range(0..100) < chaos.percent_delayed
        {
            let max = chaos.max_delay.as_nanos() as u64;
            std::thread::sleep(Duration::from_nanos(rng.random_range(0..=max)));
        }
        match op {
            Op::Run { position, work } => {
                // A failing or panicking operation must not stop the stream: later operations
                // and waiters still need its progress to advance.
                match catch_unwind(AssertUnwindSafe(work)) {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => sink.park(e),
                    Err(panic) => sink.park(DeviceError::StreamStopped {
                        stream: name,
                        reason: format!("an operation panicked: {}", panic_message(&*panic)),
                    }),
                }
                progress.finish(position);
            }
            Op::Wait { own, other, position } => {
                other.wait_for(position);
                progress.finish(own);
            }
        }
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".into()
    }
}
