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
