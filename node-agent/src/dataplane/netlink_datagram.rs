//! One datagram from a netlink socket the kernel sends records on (NFLOG,
//! conntrack events), waited for with a deadline; the kernel's "records
//! dropped" (ENOBUFS) is a result, not an error.

use std::io;
use std::time::{Duration, Instant};

use netlink_sys::Socket;

use super::exec;

/// The largest datagram the kernel sends (it batches records up to this).
const DATAGRAM: usize = 64 * 1024;

pub enum Read {
    /// `buf` holds one datagram.
    Bytes,
    /// Nothing came within the timeout.
    Nothing,
    /// The kernel dropped records: the socket was read too slowly.
    Lost,
}

/// Reads one datagram into `buf`, waiting up to `timeout` for it.
pub fn read(socket: &Socket, buf: &mut Vec<u8>, timeout: Duration) -> io::Result<Read> {
    if !exec::readable_before(socket, Instant::now() + timeout)? {
        return Ok(Read::Nothing);
    }
    read_now(socket, buf)
}

/// Reads one datagram into `buf` if one is queued (`Nothing` if not).
pub fn read_now(socket: &Socket, buf: &mut Vec<u8>) -> io::Result<Read> {
    // Into the spare capacity, unzeroed: conntrack sends a datagram per
    // event, and zeroing 64 KiB for each was most of the reader's work.
    buf.clear();
    buf.reserve(DATAGRAM);
    match socket.recv(buf, libc::MSG_DONTWAIT) {
        Ok(_) => Ok(Read::Bytes),
        Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => Ok(Read::Lost),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Read::Nothing),
        Err(e) => Err(e),
    }
}

/// Datagrams one [`Batch`] takes per system call, and the room for each.
const BATCH_COUNT: usize = 64;
const BATCH_SLOT: usize = 4096;

/// Many small datagrams per system call (`recvmmsg`), for sockets the
/// kernel sends one small datagram per record on (conntrack events: a few
/// hundred bytes each, where a `recv` per event was most of the reader's
/// cost). A datagram larger than its slot is cut short by the kernel; it
/// counts as lost.
pub struct Batch {
    buf: Vec<u8>,
    /// Slot and length of each datagram the last read took whole.
    whole: Vec<(usize, usize)>,
    /// How many the last read took, whole or not.
    taken: usize,
}

impl Default for Batch {
    fn default() -> Self {
        Batch { buf: vec![0; BATCH_COUNT * BATCH_SLOT], whole: Vec::with_capacity(BATCH_COUNT), taken: 0 }
    }
}

impl Batch {
    /// Takes the datagrams queued now (up to [`BATCH_COUNT`]): `Bytes` when
    /// at least one came whole, `Lost` when the kernel dropped some or one
    /// was cut short (those that came whole are still there).
    pub fn read_now(&mut self, socket: &Socket) -> io::Result<Read> {
        use std::os::fd::AsRawFd;
        self.whole.clear();
        self.taken = 0;
        // The headers point into `buf`; made afresh per call, so nothing
        // refers into this struct between calls.
        let mut iov: Vec<libc::iovec> = self
            .buf
            .chunks_exact_mut(BATCH_SLOT)
            .map(|slot| libc::iovec { iov_base: slot.as_mut_ptr().cast(), iov_len: BATCH_SLOT })
            .collect();
        let mut hdrs: Vec<libc::mmsghdr> = iov
            .iter_mut()
            .map(|v| {
                // SAFETY: an all-zero msghdr is valid (no name, no control data).
                let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
                h.msg_hdr.msg_iov = v;
                h.msg_hdr.msg_iovlen = 1;
                h
            })
            .collect();
        // SAFETY: `hdrs` holds BATCH_COUNT headers, each with one iovec
        // over its own BATCH_SLOT bytes of `buf`; all outlive the call.
        let n = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                hdrs.as_mut_ptr(),
                BATCH_COUNT as libc::c_uint,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOBUFS) => Ok(Read::Lost),
                _ if e.kind() == io::ErrorKind::WouldBlock => Ok(Read::Nothing),
                _ => Err(e),
            };
        }
        self.taken = n as usize;
        let mut cut = false;
        for (slot, h) in hdrs[..self.taken].iter().enumerate() {
            if h.msg_hdr.msg_flags & libc::MSG_TRUNC != 0 {
                cut = true;
            } else {
                self.whole.push((slot, h.msg_len as usize));
            }
        }
        Ok(if cut { Read::Lost } else { Read::Bytes })
    }

    /// The datagrams the last read took whole.
    pub fn datagrams(&self) -> impl Iterator<Item = &[u8]> {
        self.whole.iter().map(|&(slot, len)| &self.buf[slot * BATCH_SLOT..slot * BATCH_SLOT + len])
    }

    /// Whether the last read took all it could: more may be queued.
    pub fn was_full(&self) -> bool {
        self.taken == BATCH_COUNT
    }
}
