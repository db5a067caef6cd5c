//! [`Group`]: the rendezvous connections, kept open for the whole job, as a side channel beside
//! NCCL: barriers that also gather one number from every rank (the checkpoint protocol, "stop
//! after this step", the step's mean loss),
//! and the watch on every rank's liveness.
//!
//! NCCL waits forever for a rank that died, so liveness cannot come from it. Rank 0 holds one
//! connection per peer and every peer one to rank 0; a process that ends (crash, `kill -9`, an
//! error) closes its connection at once, and one that falls silent (its host or the network gone)
//! stops sending the heartbeats a background thread sends every few seconds. Rank 0 sees either
//! directly and tells the other peers; a peer sees rank 0's. The first loss is reported once, to
//! the `on_lost` callback, from a reader thread, because the main thread may be stuck in a
//! collective that will never finish: the binary's callback ends the process.
//!
//! On the wire, after the rendezvous, a frame is a tag byte and its fields (little-endian):
//! heartbeat; arrive (last, this rank's value); release (last, every rank's value in rank order);
//! lost (the rank, the reason).

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often heartbeats go out, and after how long without any frame a rank counts as lost.
#[derive(Clone, Copy, Debug)]
pub struct Heartbeat {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Heartbeat { interval: Duration::from_secs(5), timeout: Duration::from_secs(30) }
    }
}

/// A rank that is gone, and how that was seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lost {
    pub rank: usize,
    pub reason: String,
}

impl fmt::Display for Lost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} {}", self.rank, self.reason)
    }
}

impl std::error::Error for Lost {}

/// Called once, from a background thread, with the first rank lost.
pub type OnLost = Arc<dyn Fn(&Lost) + Send + Sync>;

/// This process's end of the side channel. Drop it only when the job is over ([`Group::finish`])
/// or failing: the other ranks then see this one as lost.
pub struct Group {
    rank: usize,
    world_size: usize,
    shared: Arc<Shared>,
    events: Receiver<Event>,
}

impl fmt::Debug for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish_non_exhaustive()
    }
}

struct Shared {
    rank: usize,
    /// The connections, by the rank at their other end; written under `write_lock` so that
    /// frames from different threads never interleave.
    links: Vec<(usize, TcpStream)>,
    write_lock: Mutex<()>,
    /// Set before the last barrier's frame goes out: no heartbeat follows it.
    finishing: AtomicBool,
    /// Set when the group is dropped: the readers stop without reporting a loss.
    dropped: AtomicBool,
    lost: Mutex<Option<Lost>>,
    on_lost: OnLost,
}

#[derive(Debug)]
enum Event {
    Arrived { rank: usize, value: u64 },
    Released { values: Vec<u64> },
    Lost(Lost),
}

#[derive(Debug, PartialEq)]
enum Frame {
    Heartbeat,
    Arrive { value: u64, last: bool },
    Release { values: Vec<u64>, last: bool },
    Lost(Lost),
}

const HEARTBEAT: u8 = 1;
const ARRIVE: u8 = 2;
const RELEASE: u8 = 3;
const LOST: u8 = 4;
/// The longest loss reason accepted.
const MAX_REASON: usize = 4096;

impl Group {
    /// Starts the readers and the heartbeat over the rendezvous `links` (rank 0: one per peer; a
    /// peer: the one to rank 0). A job of one has no links and never loses a rank.
    pub fn start(
        rank: usize,
        world_size: usize,
        links: Vec<(usize, TcpStream)>,
        heartbeat: Heartbeat,
        on_lost: OnLost,
    ) -> io::Result<Group> {
        let (events_tx, events) = mpsc::channel();
        let mut readers = Vec::with_capacity(links.len());
        for (peer, stream) in &links {
            stream.set_nodelay(true)?;
            // A peer that stops reading must not block the writers (and the loss report) forever.
            stream.set_write_timeout(Some(heartbeat.timeout))?;
            let reader = stream.try_clone()?;
            reader.set_read_timeout(Some(heartbeat.timeout))?;
            readers.push((*peer, reader));
        }
        let shared = Arc::new(Shared {
            rank,
            links,
            write_lock: Mutex::new(()),
            finishing: AtomicBool::new(false),
            dropped: AtomicBool::new(false),
            lost: Mutex::new(None),
            on_lost,
        });
        for (peer, stream) in readers {
            let (shared, events) = (Arc::clone(&shared), events_tx.clone());
            std::thread::Builder::new()
                .name(format!("zeroflow-watch-{peer}"))
                .spawn(move || read_frames(&shared, peer, &stream, heartbeat.timeout, &events))?;
        }
        if !shared.links.is_empty() {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("zeroflow-heartbeat".into())
                .spawn(move || send_heartbeats(&shared, heartbeat.interval))?;
        }
        Ok(Group { rank, world_size, shared, events })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// A barrier that also gives every rank each rank's `value`, in rank order. Every rank must
    /// call the same barriers in the same order. Fails with the lost rank if one is gone.
    pub fn gather(&mut self, value: u64) -> Result<Vec<u64>, Lost> {
        self.barrier(value, false)
    }

    /// A barrier that also tells every rank which ranks raised `flag` (sorted).
    pub fn exchange(&mut self, flag: bool) -> Result<Vec<usize>, Lost> {
        let values = self.gather(u64::from(flag))?;
        Ok(values.iter().enumerate().filter(|(_, v)| **v != 0).map(|(rank, _)| rank).collect())
    }

    /// The mean of every rank's `value` (exact in bits: each rank's `f64` travels unchanged).
    pub fn mean(&mut self, value: f64) -> Result<f64, Lost> {
        let values = self.gather(value.to_bits())?;
        Ok(values.iter().map(|v| f64::from_bits(*v)).sum::<f64>() / values.len() as f64)
    }

    /// Whether any rank raised `flag`.
    pub fn any(&mut self, flag: bool) -> Result<bool, Lost> {
        Ok(!self.exchange(flag)?.is_empty())
    }

    /// The last barrier: after it, connections closing are the job ending, not ranks lost.
    pub fn finish(mut self) -> Result<(), Lost> {
        self.barrier(0, true).map(drop)
    }

    fn barrier(&mut self, value: u64, last: bool) -> Result<Vec<u64>, Lost> {
        if self.world_size == 1 {
            return Ok(vec![value]);
        }
        if let Some(lost) = self.shared.lost() {
            return Err(lost);
        }
        if last {
            self.shared.finishing.store(true, Ordering::SeqCst);
        }
        if self.rank == 0 {
            let mut values = vec![0; self.world_size];
            values[0] = value;
            for _ in 1..self.world_size {
                match self.next_event()? {
                    Event::Arrived { rank, value } => values[rank] = value,
                    Event::Released { .. } => unreachable!("only rank 0 releases"),
                    Event::Lost(lost) => return Err(lost),
                }
            }
            // A peer that cannot be written to is gone; its reader reports it.
            let _ = self.shared.send(&Frame::Release { values: values.clone(), last });
            return Ok(values);
        }
        let _ = self.shared.send(&Frame::Arrive { value, last });
        match self.next_event()? {
            Event::Released { values } if values.len() == self.world_size => Ok(values),
            Event::Released { values } => Err(Lost {
                rank: 0,
                reason: format!("sent {} values for a job of {}", values.len(), self.world_size),
            }),
            Event::Arrived { .. } => unreachable!("only rank 0 hears arrivals"),
            Event::Lost(lost) => Err(lost),
        }
    }

    fn next_event(&self) -> Result<Event, Lost> {
        self.events.recv().map_err(|_| {
            // Every reader has stopped without a loss: only after an earlier last barrier.
            self.shared.lost().unwrap_or_else(|| Lost {
                rank: usize::from(self.rank == 0),
                reason: "is no longer connected (a barrier after the last one)".into(),
            })
        })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        self.shared.dropped.store(true, Ordering::SeqCst);
        self.shared.finishing.store(true, Ordering::SeqCst);
        for (_, stream) in &self.shared.links {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl Shared {
    fn lost(&self) -> Option<Lost> {
        self.lost.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Writes `frame` to every link.
    fn send(&self, frame: &Frame) -> io::Result<()> {
        let bytes = encode(frame);
        let _guard = self.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut result = Ok(());
        for (_, mut stream) in self.links.iter().map(|(r, s)| (r, s)) {
            if let Err(e) = stream.write_all(&bytes) {
                result = Err(e);
            }
        }
        result
    }

    /// Records the first loss, tells (on rank 0) the other peers, calls `on_lost`, then fails
    /// the barrier. Later losses are the same failure seen again and are ignored.
    fn report(&self, lost: Lost, events: &Sender<Event>) {
        {
            let mut slot = self.lost.lock().unwrap_or_else(|e| e.into_inner());
            if slot.is_some() || self.dropped.load(Ordering::SeqCst) {
                return;
            }
            *slot = Some(lost.clone());
        }
        if self.rank == 0 {
            let _ = self.send(&Frame::Lost(lost.clone()));
        }
        // Before the barrier hears of it: the binary's `on_lost` ends the process, which must
        // not race with the main thread failing the barrier and exiting on its own.
        (self.on_lost)(&lost);
        let _ = events.send(Event::Lost(lost));
    }
}

/// One link's reader: hands barrier frames to the group and reports the link's loss.
fn read_frames(
    shared: &Shared,
    peer: usize,
    stream: &TcpStream,
    timeout: Duration,
    events: &Sender<Event>,
) {
    loop {
        let frame = match read_frame(stream) {
            Ok(frame) => frame,
            Err(_) if shared.dropped.load(Ordering::SeqCst) => return,
            Err(e) => {
                let lost = Lost { rank: peer, reason: describe(&e, timeout) };
                return shared.report(lost, events);
            }
        };
        match frame {
            Frame::Heartbeat => {}
            Frame::Arrive { value, last } => {
                let _ = events.send(Event::Arrived { rank: peer, value });
                if last {
                    return;
                }
            }
            Frame::Release { values, last } => {
                let _ = events.send(Event::Released { values });
                if last {
                    return;
                }
            }
            Frame::Lost(lost) => {
                let reason = format!("{} (seen by rank 0)", lost.reason);
                return shared.report(Lost { rank: lost.rank, reason }, events);
            }
        }
    }
}

fn describe(error: &io::Error, timeout: Duration) -> String {
    match error.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => "is gone: its process ended (its log says why)".into(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => format!(
            "sent no heartbeat for {} s: its host or the network is down, or the process is \
             stopped",
            timeout.as_secs_f64()
        ),
        io::ErrorKind::InvalidData => format!("sent garbage on the side channel: {error}"),
        _ => format!("is unreachable: {error}"),
    }
}

fn send_heartbeats(shared: &Shared, interval: Duration) {
    let bytes = encode(&Frame::Heartbeat);
    loop {
        std::thread::sleep(interval);
        let _guard = shared.write_lock.lock().unwrap_or_else(|e| e.into_inner());
        // Checked under the lock: no heartbeat follows the last barrier's frame.
        if shared.finishing.load(Ordering::SeqCst) {
            return;
        }
        for (_, mut stream) in shared.links.iter().map(|(r, s)| (r, s)) {
            let _ = stream.write_all(&bytes);
        }
    }
}

fn encode(frame: &Frame) -> Vec<u8> {
    let mut out = Vec::new();
    let word =
        |out: &mut Vec<u8>, value: usize| out.extend_from_slice(&(value as u32).to_le_bytes());
    match frame {
        Frame::Heartbeat => out.push(HEARTBEAT),
        Frame::Arrive { value, last } => {
            out.extend_from_slice(&[ARRIVE, u8::from(*last)]);
            out.extend_from_slice(&value.to_le_bytes());
        }
        Frame::Release { values, last } => {
            out.extend_from_slice(&[RELEASE, u8::from(*last)]);
            word(&mut out, values.len());
            values.iter().for_each(|value| out.extend_from_slice(&value.to_le_bytes()));
        }
        Frame::Lost(lost) => {
            let reason = &lost.reason.as_bytes()[..lost.reason.len().min(MAX_REASON)];
            out.push(LOST);
            word(&mut out, lost.rank);
            word(&mut out, reason.len());
            out.extend_from_slice(reason);
        }
    }
    out
}

fn read_frame(mut stream: &TcpStream) -> io::Result<Frame> {
    let byte = |stream: &mut &TcpStream| -> io::Result<u8> {
        let mut b = [0u8; 1];
        stream.read_exact(&mut b)?;
        Ok(b[0])
    };
    let word = |stream: &mut &TcpStream| -> io::Result<usize> {
        let mut w = [0u8; 4];
        stream.read_exact(&mut w)?;
        Ok(u32::from_le_bytes(w) as usize)
    };
    let long = |stream: &mut &TcpStream| -> io::Result<u64> {
        let mut w = [0u8; 8];
        stream.read_exact(&mut w)?;
        Ok(u64::from_le_bytes(w))
    };
    let invalid = |what: String| io::Error::new(io::ErrorKind::InvalidData, what);
    Ok(match byte(&mut stream)? {
        HEARTBEAT => Frame::Heartbeat,
        ARRIVE => Frame::Arrive { last: byte(&mut stream)? != 0, value: long(&mut stream)? },
        RELEASE => {
            let last = byte(&mut stream)? != 0;
            let n = word(&mut stream)?;
            if n > 1 << 20 {
                return Err(invalid(format!("a release of {n} values")));
            }
            let values = (0..n).map(|_| long(&mut stream)).collect::<io::Result<_>>()?;
            Frame::Release { values, last }
        }
        LOST => {
            let rank = word(&mut stream)?;
            let len = word(&mut stream)?;
            if len > MAX_REASON {
                return Err(invalid(format!("a loss reason of {len} bytes")));
            }
            let mut reason = vec![0u8; len];
            stream.read_exact(&mut reason)?;
            Frame::Lost(Lost { rank, reason: String::from_utf8_lossy(&reason).into() })
        }
        tag => return Err(invalid(format!("an unknown frame tag {tag}"))),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};
    use std::thread;
    use std::time::{Duration, Instant};

    use super::{Group, Heartbeat, Lost, OnLost};
    use crate::dist::rendezvous::join;
    use crate::dist::testing::{free_port, spec};

    const FAST: Heartbeat =
        Heartbeat { interval: Duration::from_millis(50), timeout: Duration::from_millis(1500) };

    /// The losses a rank was told about.
    type Seen = Arc<Mutex<Vec<Lost>>>;

    fn recorder() -> (OnLost, Seen) {
        let seen: Seen = Arc::default();
        let sink = Arc::clone(&seen);
        (Arc::new(move |lost: &Lost| sink.lock().unwrap().push(lost.clone())), seen)
    }

    /// Forms a group of `world` ranks, one thread each, and runs `body` on every rank.
    fn run_group<T: Send + 'static>(
        world: usize,
        body: impl Fn(Group, Seen) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let port = free_port();
        let body = Arc::new(body);
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let body = Arc::clone(&body);
                thread::spawn(move || {
                    let joined = join(&spec(rank, world, port, 10_000), || Ok(vec![7])).unwrap();
                    let (on_lost, seen) = recorder();
                    let group = Group::start(rank, world, joined.links, FAST, on_lost).unwrap();
                    body(group, seen)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn an_exchange_tells_every_rank_who_raised_the_flag() {
        let results = run_group(4, |mut group, seen| {
            let rank = group.rank();
            let first = group.exchange(rank % 2 == 1).unwrap();
            let none = group.any(false).unwrap();
            let some = group.any(rank == 2).unwrap();
            // Slower than the heartbeat timeout: heartbeats keep the ranks alive meanwhile.
            thread::sleep(Duration::from_millis(2000));
            group.finish().unwrap();
            assert!(seen.lock().unwrap().is_empty(), "{:?}", seen.lock().unwrap());
            (first, none, some)
        });
        for result in results {
            assert_eq!(result, (vec![1, 3], false, true));
        }
    }

    #[test]
    fn every_rank_gets_the_same_mean() {
        let means = run_group(3, |mut group, _| {
            let values = group.gather(10 + group.rank() as u64).unwrap();
            let mean = group.mean([0.5, 1.25, 4.0][group.rank()]).unwrap();
            group.finish().unwrap();
            (values, mean)
        });
        for result in means {
            assert_eq!(result, (vec![10, 11, 12], 5.75 / 3.0));
        }
    }

    #[test]
    fn ranks_that_finish_at_different_times_lose_nobody() {
        let seen = run_group(3, |group, seen| {
            let rank = group.rank();
            thread::sleep(Duration::from_millis(100 * rank as u64));
            group.finish().unwrap();
            // After the last barrier the others close their connections: not a loss.
            thread::sleep(Duration::from_millis(800));
            seen.lock().unwrap().clone()
        });
        assert!(seen.iter().all(Vec::is_empty), "{seen:?}");
    }

    #[test]
    fn a_peer_that_ends_is_reported_to_every_other_rank_and_fails_their_barrier() {
        let results = run_group(3, |mut group, seen| {
            if group.rank() == 2 {
                // The process of rank 2 "ends": its connection closes.
                drop(group);
                return (None, Vec::new(), Duration::ZERO);
            }
            let start = Instant::now();
            let barrier = group.exchange(false).err();
            let elapsed = start.elapsed();
            thread::sleep(Duration::from_millis(100));
            (barrier, seen.lock().unwrap().clone(), elapsed)
        });
        for (barrier, seen, elapsed) in &results[..2] {
            let lost = barrier.as_ref().expect("the barrier fails");
            assert_eq!(lost.rank, 2, "{lost}");
            assert!(lost.reason.contains("its process ended"), "{lost}");
            assert_eq!(seen.len(), 1, "{seen:?}");
            assert_eq!(seen[0].rank, 2);
            assert!(*elapsed < Duration::from_secs(5), "{elapsed:?}");
        }
        assert!(results[1].1[0].reason.contains("seen by rank 0"), "{:?}", results[1].1);
    }

    #[test]
    fn rank_0_ending_is_reported_to_the_peers() {
        let results = run_group(3, |mut group, seen| {
            if group.rank() == 0 {
                drop(group);
                return None;
            }
            let lost = group.exchange(true).unwrap_err();
            assert_eq!(seen.lock().unwrap().as_slice(), std::slice::from_ref(&lost));
            Some(lost.rank)
        });
        assert_eq!(results, [None, Some(0), Some(0)]);
    }

    #[test]
    fn a_silent_peer_is_lost_after_the_heartbeat_timeout() {
        let port = free_port();
        let (tx, rx) = mpsc::channel();
        let lead = thread::spawn(move || {
            let joined = join(&spec(0, 2, port, 10_000), || Ok(Vec::new())).unwrap();
            let (on_lost, _seen) = recorder();
            let mut group = Group::start(0, 2, joined.links, FAST, on_lost).unwrap();
            let start = Instant::now();
            let lost = group.exchange(false).unwrap_err();
            tx.send(()).unwrap();
            (lost, start.elapsed())
        });
        // Rank 1 joins but never starts its group: no heartbeat, no barrier, connection open.
        let silent = join(&spec(1, 2, port, 10_000), || Ok(Vec::new())).unwrap();
        rx.recv_timeout(Duration::from_secs(10)).expect("rank 0 gives up");
        let (lost, elapsed) = lead.join().unwrap();
        assert_eq!(lost.rank, 1);
        assert!(lost.reason.contains("sent no heartbeat for 1.5 s"), "{lost}");
        assert!(elapsed >= Duration::from_millis(1400), "{elapsed:?}");
        drop(silent);
    }

    #[test]
    fn frames_survive_the_wire() {
        use super::{Frame, encode, read_frame};
        let frames = [
            Frame::Heartbeat,
            Frame::Arrive { value: u64::MAX - 1, last: false },
            Frame::Release { values: vec![0, 3, 1 << 40], last: true },
            Frame::Lost(Lost { rank: 5, reason: "is gone".into() }),
        ];
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut writer = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        for frame in &frames {
            std::io::Write::write_all(&mut writer, &encode(frame)).unwrap();
        }
        std::io::Write::write_all(&mut writer, &[99]).unwrap();
        for frame in frames {
            assert_eq!(read_frame(&reader).unwrap(), frame);
        }
        assert_eq!(read_frame(&reader).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
    }
}
