//! A packet capture on one interface of a test namespace (AF_PACKET, every
//! protocol), without tcpdump: what crosses an underlay, for tests that
//! assert what must not be on it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// Frames seen on the interface until [`Capture::stop`].
pub struct Capture {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<anyhow::Result<Vec<Vec<u8>>>>>,
}

impl Capture {
    /// Starts capturing on `iface` of network namespace `netns` (a name
    /// under /run/netns). Returns once the socket is bound.
    pub fn start(netns: &str, iface: &str) -> anyhow::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (path, iface, flag) = (format!("/run/netns/{netns}"), iface.to_owned(), Arc::clone(&stop));
        let thread = std::thread::spawn(move || {
            let socket = match open(&path, &iface) {
                Ok(s) => {
                    let _ = ready_tx.send(Ok(()));
                    s
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return Err(e);
                }
            };
            let mut frames = Vec::new();
            let mut buf = vec![0u8; 65_536];
            while !flag.load(Ordering::Relaxed) {
                // SAFETY: reading into a buffer of the given length.
                let n = unsafe { libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
                if n > 0 {
                    frames.push(buf[..n as usize].to_vec());
                }
            }
            Ok(frames)
        });
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Capture { stop, thread: Some(thread) }),
            Ok(Err(e)) => anyhow::bail!("capture on {netns}: {e}"),
            Err(_) => anyhow::bail!("the capture thread ended before it was ready"),
        }
    }

    /// Stops and returns the frames (link-layer headers included).
    pub fn stop(mut self) -> anyhow::Result<Vec<Vec<u8>>> {
        self.stop.store(true, Ordering::Relaxed);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(frames)) => frames,
            _ => anyhow::bail!("the capture thread panicked"),
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Enters `netns` (this thread only) and opens a packet socket bound to
/// `iface`, with a 100 ms receive timeout so that a stop is seen.
fn open(netns: &str, iface: &str) -> anyhow::Result<OwnedFd> {
    let ns = std::fs::File::open(netns).map_err(|e| anyhow::anyhow!("open {netns}: {e}"))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| anyhow::anyhow!("setns {netns}: {e}"))?;
    let name = std::ffi::CString::new(iface)?;
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    anyhow::ensure!(index != 0, "no interface {iface} in {netns}");
    let all = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: plain socket(2); the descriptor is owned right after.
    let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, i32::from(all)) };
    anyhow::ensure!(raw >= 0, "packet socket: {}", std::io::Error::last_os_error());
    // SAFETY: fresh descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid start.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = all;
    addr.sll_ifindex = index as i32;
    // SAFETY: binding with a sockaddr_ll of its size.
    let bound = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        )
    };
    anyhow::ensure!(bound == 0, "bind to {iface}: {}", std::io::Error::last_os_error());
    let timeout = libc::timeval { tv_sec: 0, tv_usec: 100_000 };
    // SAFETY: SO_RCVTIMEO takes a timeval.
    let set = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    anyhow::ensure!(set == 0, "receive timeout: {}", std::io::Error::last_os_error());
    Ok(fd)
}

/// Whether `needle` occurs in any of `frames`.
pub fn contains(frames: &[Vec<u8>], needle: &[u8]) -> bool {
    frames.iter().any(|f| f.windows(needle.len()).any(|w| w == needle))
}
