//! The rendezvous: rank 0 listens on `MASTER_PORT`, every other rank connects to
//! `MASTER_ADDR:MASTER_PORT` (retrying until the timeout) and says who it is (its rank and the
//! world size it was given); once all `world_size - 1` peers are there, rank 0 sends each the same
//! opaque payload (the bytes of the NCCL unique id). The connections stay open afterwards: they
//! carry the [`super::Group`]'s barriers and heartbeats.
//!
//! On the wire, the peer says `ZFRV`, the protocol version, its rank and world size (4 bytes each,
//! little-endian); rank 0 answers `ZFRV`, a status byte (0: the payload follows, 1: a refusal
//! message follows), a length and that many bytes.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::env::Master;

const MAGIC: [u8; 4] = *b"ZFRV";
const VERSION: u32 = 1;
/// How long rank 0 waits for a connection's greeting before dropping it (a stray connection
/// must not hold up the others).
const GREETING_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a peer waits for rank 0's answer beyond the timeout: rank 0 started waiting before the
/// peer connected, so it answers (the payload or a refusal) within the timeout.
const ANSWER_GRACE: Duration = Duration::from_secs(5);
/// The largest payload or message accepted.
const MAX_LEN: u32 = 1 << 20;

/// Who meets whom, and for how long they wait.
#[derive(Clone, Debug)]
pub struct Spec {
    pub rank: usize,
    pub world_size: usize,
    pub master: Master,
    pub timeout: Duration,
}

/// The outcome of a rendezvous: the payload, and the open connections (rank 0: one per peer, in
/// rank order; a peer: the one to rank 0).
#[derive(Debug)]
pub struct Joined {
    pub payload: Vec<u8>,
    pub links: Vec<(usize, TcpStream)>,
}

/// Why a rendezvous failed.
#[derive(Debug)]
pub enum RendezvousError {
    /// `MASTER_ADDR` does not resolve.
    Resolve { master: String, reason: String },
    /// Rank 0 cannot listen: the port is in use.
    PortTaken { port: u16 },
    /// Rank 0 cannot listen for another reason.
    Listen { port: u16, source: io::Error },
    /// Rank 0 could not make the payload.
    Payload(String),
    /// Rank 0: these ranks did not connect within the timeout.
    Missing { missing: Vec<usize>, world_size: usize, timeout: Duration, port: u16 },
    /// A peer: rank 0 could not be reached within the timeout.
    Unreachable { master: String, timeout: Duration, last_error: String },
    /// Rank 0: a peer was given another world size.
    WorldMismatch { rank: usize, theirs: usize, ours: usize },
    /// Rank 0: two processes claim the same rank.
    DuplicateRank { rank: usize, first: SocketAddr, second: SocketAddr },
    /// Rank 0: a peer claims a rank outside the job (or rank 0 itself).
    BadRank { rank: usize, world_size: usize, from: SocketAddr },
    /// A peer: rank 0 refused it, or gave up, with this message.
    Refused { reason: String },
    /// A peer: rank 0's answer did not come or was not one.
    Protocol { master: String, reason: String },
}

impl fmt::Display for RendezvousError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RendezvousError::Resolve { master, reason } => write!(
                f,
                "rendezvous: cannot resolve MASTER_ADDR {master} ({reason}); set MASTER_ADDR to \
                 the address of rank 0's host"
            ),
            RendezvousError::PortTaken { port } => write!(
                f,
                "rendezvous: rank 0 cannot listen on port {port}: it is in use (another job, or \
                 a previous run still exiting); choose another MASTER_PORT"
            ),
            RendezvousError::Listen { port, source } => {
                write!(f, "rendezvous: rank 0 cannot listen on port {port}: {source}")
            }
            RendezvousError::Payload(reason) => {
                write!(f, "rendezvous: rank 0 cannot make the group's id: {reason}")
            }
            RendezvousError::Missing { missing, world_size, timeout, port } => write!(
                f,
                "rendezvous: {} of {world_size} did not join within {} s (rank 0 listened on \
                 port {port}); check that every rank was started with the same MASTER_ADDR and \
                 MASTER_PORT, or raise ZEROFLOW_RENDEZVOUS_TIMEOUT",
                rank_list(missing),
                timeout.as_secs_f64()
            ),
            RendezvousError::Unreachable { master, timeout, last_error } => write!(
                f,
                "rendezvous: rank 0 at {master} did not answer within {} s (last error: \
                 {last_error}); check that rank 0 is running and that MASTER_ADDR and \
                 MASTER_PORT are the same on every rank, or raise ZEROFLOW_RENDEZVOUS_TIMEOUT",
                timeout.as_secs_f64()
            ),
            RendezvousError::WorldMismatch { rank, theirs, ours } => write!(
                f,
                "rendezvous: rank {rank} was started for a job of {theirs} processes, rank 0 for \
                 {ours}; WORLD_SIZE must be the same on every rank"
            ),
            RendezvousError::DuplicateRank { rank, first, second } => write!(
                f,
                "rendezvous: two processes claim rank {rank} (from {first} and from {second}); \
                 every process needs its own RANK"
            ),
            RendezvousError::BadRank { rank, world_size, from } => write!(
                f,
                "rendezvous: a process at {from} claims rank {rank}, which is not a peer rank of \
                 a job of {world_size} (1 to {})",
                world_size - 1
            ),
            RendezvousError::Refused { reason } => write!(f, "rendezvous: rank 0 says: {reason}"),
            RendezvousError::Protocol { master, reason } => {
                write!(f, "rendezvous: no valid answer from rank 0 at {master}: {reason}")
            }
        }
    }
}

impl std::error::Error for RendezvousError {}

/// "rank 3" or "ranks 1, 2".
pub fn rank_list(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

/// Meets the other ranks. Rank 0 calls `payload` once it listens and sends the bytes to every
/// peer; a peer returns the bytes it received. A job of one returns `payload()` with no links.
pub fn join(
    spec: &Spec,
    payload: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Joined, RendezvousError> {
    if spec.world_size <= 1 {
        let payload = payload().map_err(RendezvousError::Payload)?;
        return Ok(Joined { payload, links: Vec::new() });
    }
    if spec.rank == 0 { lead(spec, payload) } else { follow(spec) }
}

/// Rank 0: listens, makes the payload, waits for every peer, answers them all.
fn lead(
    spec: &Spec,
    payload: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Joined, RendezvousError> {
    let listener = listen(&spec.master)?;
    let payload = payload().map_err(RendezvousError::Payload)?;
    let mut peers: Peers = (0..spec.world_size).map(|_| None).collect();
    let accepted = accept_peers(&listener, spec, &mut peers);
    let links: Vec<(usize, TcpStream)> =
        peers.into_iter().enumerate().filter_map(|(r, p)| p.map(|(s, _)| (r, s))).collect();
    if let Err(error) = accepted {
        // Every peer that came fails with the same message.
        let message = error.to_string();
        for (_, stream) in &links {
            let _ = answer(stream, 1, message.as_bytes());
        }
        return Err(error);
    }
    for (rank, stream) in &links {
        if let Err(e) = answer(stream, 0, &payload) {
            tracing::error!("rendezvous: rank {rank} was lost while receiving the group's id: {e}");
            let (world_size, timeout, port) = (spec.world_size, spec.timeout, spec.master.port);
            return Err(RendezvousError::Missing {
                missing: vec![*rank],
                world_size,
                timeout,
                port,
            });
        }
    }
    Ok(Joined { payload, links })
}

/// The peers that have greeted rank 0, by rank, with their addresses.
type Peers = Vec<Option<(TcpStream, SocketAddr)>>;

/// Accepts connections until every peer has greeted, the timeout has passed (an error naming the
/// missing ranks), or a greeting is refused (the newcomer is told why).
fn accept_peers(
    listener: &TcpListener,
    spec: &Spec,
    peers: &mut Peers,
) -> Result<(), RendezvousError> {
    let deadline = Instant::now() + spec.timeout;
    while peers[1..].iter().any(Option::is_none) {
        let (stream, from) = match listener.accept() {
            Ok(connection) => connection,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (1..spec.world_size).filter(|&r| peers[r].is_none()).collect();
                    let (world_size, timeout, port) =
                        (spec.world_size, spec.timeout, spec.master.port);
                    return Err(RendezvousError::Missing { missing, world_size, timeout, port });
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => {
                tracing::warn!("rendezvous: a connection failed: {e}");
                continue;
            }
        };
        let Some((rank, world)) = greeting(&stream) else {
            tracing::warn!("rendezvous: dropped a connection from {from} that is not a rank");
            continue;
        };
        if let Some(error) = refusal(spec, peers, rank, world, from) {
            let _ = answer(&stream, 1, error.to_string().as_bytes());
            return Err(error);
        }
        peers[rank] = Some((stream, from));
    }
    Ok(())
}

/// Why a greeting from `from` claiming `rank` of `world` cannot join, if it cannot.
fn refusal(
    spec: &Spec,
    peers: &Peers,
    rank: usize,
    world: usize,
    from: SocketAddr,
) -> Option<RendezvousError> {
    if world != spec.world_size {
        return Some(RendezvousError::WorldMismatch { rank, theirs: world, ours: spec.world_size });
    }
    if rank == 0 || rank >= spec.world_size {
        return Some(RendezvousError::BadRank { rank, world_size: spec.world_size, from });
    }
    let (_, first) = peers[rank].as_ref()?;
    Some(RendezvousError::DuplicateRank { rank, first: *first, second: from })
}

/// Listens on the master port on every interface of the master address's family.
fn listen(master: &Master) -> Result<TcpListener, RendezvousError> {
    let port = master.port;
    let address = resolve(master)?;
    let any: SocketAddr = match address {
        SocketAddr::V4(_) => (std::net::Ipv4Addr::UNSPECIFIED, port).into(),
        SocketAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, port).into(),
    };
    let listener = TcpListener::bind(any).map_err(|source| match source.kind() {
        io::ErrorKind::AddrInUse => RendezvousError::PortTaken { port },
        _ => RendezvousError::Listen { port, source },
    })?;
    listener.set_nonblocking(true).map_err(|source| RendezvousError::Listen { port, source })?;
    Ok(listener)
}

fn resolve(master: &Master) -> Result<SocketAddr, RendezvousError> {
    let shown = format!("{}:{}", master.addr, master.port);
    let resolve_error = |reason: String| RendezvousError::Resolve { master: shown.clone(), reason };
    (master.addr.as_str(), master.port)
        .to_socket_addrs()
        .map_err(|e| resolve_error(e.to_string()))?
        .next()
        .ok_or_else(|| resolve_error("no address".into()))
}

/// A connection's rank and world size, or `None` for one that is not a rank's.
fn greeting(stream: &TcpStream) -> Option<(usize, usize)> {
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(GREETING_TIMEOUT)).ok()?;
    let mut hello = [0u8; 16];
    (&*stream).read_exact(&mut hello).ok()?;
    stream.set_read_timeout(None).ok()?;
    let word = |i: usize| u32::from_le_bytes(hello[i..i + 4].try_into().expect("4 bytes"));
    (hello[..4] == MAGIC && word(4) == VERSION).then(|| (word(8) as usize, word(12) as usize))
}

fn answer(mut stream: &TcpStream, status: u8, bytes: &[u8]) -> io::Result<()> {
    let mut frame = Vec::with_capacity(9 + bytes.len());
    frame.extend_from_slice(&MAGIC);
    frame.push(status);
    frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    frame.extend_from_slice(bytes);
    stream.write_all(&frame)
}

/// A peer: connects (retrying until the timeout), greets, and reads rank 0's answer.
fn follow(spec: &Spec) -> Result<Joined, RendezvousError> {
    let shown = format!("{}:{}", spec.master.addr, spec.master.port);
    let deadline = Instant::now() + spec.timeout;
    let stream = loop {
        let attempt = resolve(&spec.master).map_err(|e| e.to_string()).and_then(|address| {
            let left = deadline.saturating_duration_since(Instant::now()).max(MIN_CONNECT);
            TcpStream::connect_timeout(&address, left.min(Duration::from_secs(5)))
                .map_err(|e| e.to_string())
        });
        let last_error = match attempt {
            Ok(stream) => break stream,
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            let timeout = spec.timeout;
            return Err(RendezvousError::Unreachable { master: shown, timeout, last_error });
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let protocol = |reason: String| RendezvousError::Protocol { master: shown.clone(), reason };
    let mut hello = Vec::with_capacity(16);
    hello.extend_from_slice(&MAGIC);
    for word in [VERSION, spec.rank as u32, spec.world_size as u32] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    (&stream).write_all(&hello).map_err(|e| protocol(format!("cannot greet it: {e}")))?;
    stream
        .set_read_timeout(Some(spec.timeout + ANSWER_GRACE))
        .map_err(|e| protocol(e.to_string()))?;
    let mut head = [0u8; 9];
    (&stream).read_exact(&mut head).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => protocol(
            "it closed the connection without answering (it failed or gave up; its log says \
             why)"
                .into(),
        ),
        _ => protocol(format!("no answer: {e}")),
    })?;
    let len = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes"));
    if head[..4] != MAGIC || head[4] > 1 || len > MAX_LEN {
        return Err(protocol("the answer is not zeroflow's rendezvous protocol".into()));
    }
    let mut bytes = vec![0u8; len as usize];
    (&stream).read_exact(&mut bytes).map_err(|e| protocol(format!("a cut answer: {e}")))?;
    stream.set_read_timeout(None).map_err(|e| protocol(e.to_string()))?;
    if head[4] == 1 {
        return Err(RendezvousError::Refused { reason: String::from_utf8_lossy(&bytes).into() });
    }
    Ok(Joined { payload: bytes, links: vec![(0, stream)] })
}

/// The shortest wait for one connection attempt.
const MIN_CONNECT: Duration = Duration::from_millis(100);

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::thread;
    use std::time::{Duration, Instant};

    use super::{Joined, RendezvousError, Spec, join};
    use crate::dist::testing::{free_port, spec};

    const PAYLOAD: &[u8] = b"the group's id";

    fn payload() -> Result<Vec<u8>, String> {
        Ok(PAYLOAD.to_vec())
    }

    /// Runs a rendezvous with one thread per spec; results in the specs' order.
    fn meet(specs: Vec<Spec>) -> Vec<Result<Joined, RendezvousError>> {
        let handles: Vec<_> =
            specs.into_iter().map(|s| thread::spawn(move || join(&s, payload))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn every_rank_receives_rank_0s_payload_and_keeps_a_link() {
        let port = free_port();
        // The peers start first: they retry until rank 0 listens.
        let mut specs: Vec<Spec> = (1..4).map(|r| spec(r, 4, port, 10_000)).collect();
        specs.push(spec(0, 4, port, 10_000));
        let results = meet(specs);
        for joined in &results {
            let joined = joined.as_ref().unwrap();
            assert_eq!(joined.payload, PAYLOAD);
        }
        let lead = results[3].as_ref().unwrap();
        let ranks: Vec<usize> = lead.links.iter().map(|(r, _)| *r).collect();
        assert_eq!(ranks, [1, 2, 3]);
        assert_eq!(results[0].as_ref().unwrap().links[0].0, 0);
    }

    #[test]
    fn a_job_of_one_needs_no_network() {
        let joined = join(&spec(0, 1, 0, 10), payload).unwrap();
        assert_eq!((joined.payload.as_slice(), joined.links.len()), (PAYLOAD, 0));
    }

    #[test]
    fn rank_0_names_the_ranks_that_never_joined() {
        let port = free_port();
        let results = meet(vec![spec(0, 4, port, 500), spec(2, 4, port, 5_000)]);
        let error = results[0].as_ref().unwrap_err();
        assert!(
            matches!(error, RendezvousError::Missing { missing, .. } if missing == &[1, 3]),
            "{error:?}"
        );
        assert!(error.to_string().contains("ranks 1, 3 of 4 did not join"), "{error}");
        // The peer that came is told why the job will not start.
        let peer = results[1].as_ref().unwrap_err().to_string();
        assert!(peer.contains("rank 0 says") && peer.contains("ranks 1, 3"), "{peer}");
    }

    #[test]
    fn a_peer_without_rank_0_gives_up_at_the_timeout() {
        let port = free_port();
        let start = Instant::now();
        let error = join(&spec(1, 2, port, 300), payload).unwrap_err();
        assert!(matches!(error, RendezvousError::Unreachable { .. }), "{error:?}");
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        assert!(error.to_string().contains("did not answer within 0.3 s"), "{error}");
    }

    #[test]
    fn a_taken_port_is_named() {
        let taken = TcpListener::bind("0.0.0.0:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let error = join(&spec(0, 2, port, 300), payload).unwrap_err();
        assert!(matches!(error, RendezvousError::PortTaken { port: p } if p == port), "{error:?}");
        assert!(error.to_string().contains("choose another MASTER_PORT"), "{error}");
    }

    #[test]
    fn disagreeing_world_sizes_fail_every_rank() {
        let port = free_port();
        let results = meet(vec![spec(0, 2, port, 5_000), spec(1, 3, port, 5_000)]);
        let lead = results[0].as_ref().unwrap_err();
        assert!(
            matches!(lead, RendezvousError::WorldMismatch { rank: 1, theirs: 3, ours: 2 }),
            "{lead:?}"
        );
        let peer = results[1].as_ref().unwrap_err();
        assert!(matches!(peer, RendezvousError::Refused { .. }), "{peer:?}");
        assert!(peer.to_string().contains("WORLD_SIZE must be the same"), "{peer}");
    }

    #[test]
    fn a_duplicate_rank_fails_every_rank() {
        let port = free_port();
        let lead = thread::spawn(move || join(&spec(0, 3, port, 5_000), payload));
        let first = thread::spawn(move || join(&spec(1, 3, port, 5_000), payload));
        // The first rank 1 waits for rank 0's answer; the second one makes rank 0 give up.
        thread::sleep(Duration::from_millis(300));
        let second = join(&spec(1, 3, port, 5_000), payload).unwrap_err();
        let lead = lead.join().unwrap().unwrap_err();
        assert!(matches!(lead, RendezvousError::DuplicateRank { rank: 1, .. }), "{lead:?}");
        for peer in [second, first.join().unwrap().unwrap_err()] {
            assert!(peer.to_string().contains("two processes claim rank 1"), "{peer}");
        }
    }

    #[test]
    fn a_peer_claiming_rank_0_or_beyond_the_world_is_refused() {
        for rank in [0, 5] {
            let port = free_port();
            let lead = thread::spawn(move || join(&spec(0, 2, port, 5_000), payload));
            // Greet with the bad rank by hand: `join` as rank 0 would listen instead.
            let peer = super::follow(&spec(rank, 2, port, 5_000)).unwrap_err();
            let lead = lead.join().unwrap().unwrap_err();
            assert!(matches!(lead, RendezvousError::BadRank { rank: r, .. } if r == rank));
            assert!(matches!(peer, RendezvousError::Refused { .. }), "{peer:?}");
        }
    }

    #[test]
    fn a_stray_connection_does_not_stop_the_rendezvous() {
        let port = free_port();
        let lead = thread::spawn(move || join(&spec(0, 2, port, 5_000), payload));
        let stray = loop {
            match std::net::TcpStream::connect(("127.0.0.1", port)) {
                Ok(stream) => break stream,
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        };
        std::io::Write::write_all(&mut &stray, b"GET / HTTP/1.0\r\n\r\n").unwrap();
        drop(stray);
        let peer = join(&spec(1, 2, port, 5_000), payload).unwrap();
        assert_eq!(peer.payload, PAYLOAD);
        assert!(lead.join().unwrap().is_ok());
    }
}
