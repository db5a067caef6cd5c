//! Helpers for multi-rank tests, this crate's and (with the `test-support` feature) other
//! crates': ports nobody listens on, rendezvous specs on this host, and groups of ranks as
//! threads of one process. They panic on failure, as test code does.

use std::net::TcpListener;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::env::Master;
use super::group::{Group, Heartbeat, Lost};
use super::rendezvous::{Spec, join};

/// A port nobody listens on now (the OS's pick, released), never handed out before in this
/// process: the tests of one binary run at once, and two rendezvous of world size 2 on the same
/// port would take each other's ranks (which showed as two "ranks" starting from different
/// weights under load).
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("0.0.0.0:0").unwrap().local_addr().unwrap().port();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// The rendezvous of `rank` of `world_size` at 127.0.0.1:`port`.
pub fn spec(rank: usize, world_size: usize, port: u16, timeout_ms: u64) -> Spec {
    let master = Master { addr: "127.0.0.1".into(), port };
    Spec { rank, world_size, master, timeout: Duration::from_millis(timeout_ms) }
}

/// A group of `world` ranks in this process, in rank order, with a fast heartbeat; a lost rank
/// is only printed.
pub fn local_groups(world: usize) -> Vec<Group> {
    let port = free_port();
    let fast =
        Heartbeat { interval: Duration::from_millis(50), timeout: Duration::from_millis(1500) };
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            thread::spawn(move || {
                let joined = join(&spec(rank, world, port, 10_000), || Ok(Vec::new())).unwrap();
                let on_lost = Arc::new(|lost: &Lost| eprintln!("lost {lost}"));
                Group::start(rank, world, joined.links, fast, on_lost).unwrap()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}
