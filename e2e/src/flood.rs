//! Request floods as anything that reaches a node could send them (a pod,
//! another machine): for showing that what answers them is no lever.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

/// GETs `http://{to}/readyz` from inside the network namespace at
/// `netns`, one request at a time, `pause` between them (none: as fast as
/// answers come), until `stop`; counts each request in `sent` and returns
/// how many got an answer.
pub fn readyz(
    netns: impl Into<PathBuf>,
    to: SocketAddr,
    pause: Option<Duration>,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
) -> JoinHandle<u64> {
    let netns = netns.into();
    std::thread::spawn(move || {
        let ns = std::fs::File::open(&netns).expect("the flood's network namespace");
        // This thread only; it never returns to the caller's namespace.
        nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let request = format!("GET /readyz HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n");
        let mut answered = 0;
        while !stop.load(Ordering::Relaxed) {
            sent.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut s) = std::net::TcpStream::connect_timeout(&to, Duration::from_secs(1)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = s.write_all(request.as_bytes());
                let mut body = Vec::new();
                if s.read_to_end(&mut body).is_ok() && !body.is_empty() {
                    answered += 1;
                }
            }
            if let Some(pause) = pause {
                // A load generator's pacing, not synchronisation.
                std::thread::sleep(pause);
            }
        }
        answered
    })
}
