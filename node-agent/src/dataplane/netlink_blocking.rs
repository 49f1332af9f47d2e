//! A blocking rtnetlink socket, for ADD's few requests in a row.
//!
//! The kernel handles an rtnetlink request inside the sending syscall, so
//! the answer is already queued when `send` returns. Through the async
//! connection each request also costs a hop to its task and a reactor
//! wake-up (about 0.1 ms each here); on a blocking socket it costs the
//! kernel's work only. Messages are built with rtnetlink's builders.

use std::io;

use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::sys::{Socket, SocketAddr, protocols::NETLINK_ROUTE};

pub struct BlockingNetlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl BlockingNetlink {
    /// A socket in the calling thread's network namespace (it stays bound to
    /// that namespace whichever thread uses it later).
    pub fn new() -> io::Result<Self> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Self { socket, seq: 0, buf: vec![0; 64 * 1024] })
    }

    /// Sends `msg` with `flags` (plus REQUEST and ACK) and returns what the
    /// kernel answered before its acknowledgement; a NACK is the errno.
    pub fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> io::Result<Vec<RouteNetlinkMessage>> {
        let mut answers = Vec::new();
        self.send_all(vec![(msg, flags)])?;
        self.acks(1, &mut answers).map_err(|(_, e)| e)?;
        Ok(answers)
    }

    /// Sends `msgs` in one datagram and waits for all their acknowledgements:
    /// the kernel handles them in order as if each came alone, one syscall
    /// instead of one per request. A refusal does not stop the ones after
    /// it; the first refused message's position and errno come back.
    /// Returns what the kernel answered, in order (e.g. to a GetLink).
    pub fn batch(
        &mut self,
        msgs: Vec<(RouteNetlinkMessage, u16)>,
    ) -> Result<Vec<RouteNetlinkMessage>, (usize, io::Error)> {
        let n = msgs.len();
        self.send_all(msgs).map_err(|e| (0, e))?;
        let mut answers = Vec::new();
        self.acks(n, &mut answers)?;
        Ok(answers)
    }

    fn send_all(&mut self, msgs: Vec<(RouteNetlinkMessage, u16)>) -> io::Result<()> {
        let mut out = Vec::new();
        for (msg, flags) in msgs {
            self.seq = self.seq.wrapping_add(1);
            let mut req = NetlinkMessage::from(msg);
            req.header.flags = flags | NLM_F_REQUEST | NLM_F_ACK;
            req.header.sequence_number = self.seq;
            req.finalize();
            let at = out.len();
            out.resize(at + req.buffer_len(), 0);
            req.serialize(&mut out[at..]);
        }
        self.socket.send(&out, 0)?;
        Ok(())
    }

    /// Reads until the last `count` requests sent are acknowledged, keeping
    /// their answers; the first NACK's position among them and its errno.
    fn acks(&mut self, count: usize, answers: &mut Vec<RouteNetlinkMessage>) -> Result<(), (usize, io::Error)> {
        let last = self.seq;
        let first = last.wrapping_sub(count as u32 - 1);
        let mut pending = count;
        // A request is done at its ACK (or a dump's DONE), counted once.
        let mut done = vec![false; count];
        let mut refused: Option<(usize, io::Error)> = None;
        while pending > 0 {
            let n = self.socket.recv(&mut &mut self.buf[..], 0).map_err(|e| (count - pending, e))?;
            let mut offset = 0;
            while offset < n {
                let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[offset..n])
                    .map_err(|e| (count - pending, io::Error::new(io::ErrorKind::InvalidData, e)))?;
                let len = msg.header.length as usize;
                if len == 0 {
                    break;
                }
                offset += len.next_multiple_of(4);
                // Positions in this batch; anything else is a stale answer.
                let at = msg.header.sequence_number.wrapping_sub(first) as usize;
                if at >= count {
                    continue;
                }
                let refusal = match msg.payload {
                    NetlinkPayload::InnerMessage(m) => {
                        answers.push(m);
                        continue;
                    }
                    NetlinkPayload::Error(e) => e.code.is_some().then(|| e.to_io()),
                    NetlinkPayload::Done(_) => None,
                    _ => continue,
                };
                if !done[at] {
                    done[at] = true;
                    pending -= 1;
                }
                if refused.is_none() {
                    refused = refusal.map(|e| (at, e));
                }
            }
        }
        refused.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::LinkUnspec;

    #[test]
    fn answers_and_errors_come_back() {
        // Reading links needs no privilege and changes nothing.
        let mut nl = BlockingNetlink::new().unwrap();
        let lo = nl.request(RouteNetlinkMessage::GetLink(LinkUnspec::new_with_name("lo").build()), 0).unwrap();
        assert!(matches!(lo.as_slice(), [RouteNetlinkMessage::NewLink(l)] if l.header.index == 1));
        let missing = nl.request(RouteNetlinkMessage::GetLink(LinkUnspec::new_with_name("weft-no-such").build()), 0);
        assert_eq!(missing.unwrap_err().raw_os_error(), Some(libc::ENODEV));
    }

    #[test]
    fn a_batch_reports_its_first_refusal_and_handles_the_rest() {
        let mut nl = BlockingNetlink::new().unwrap();
        let get = |name: &str| (RouteNetlinkMessage::GetLink(LinkUnspec::new_with_name(name).build()), 0);
        let both = nl.batch(vec![get("lo"), get("lo")]).unwrap();
        assert_eq!(both.len(), 2, "one answer per GetLink");
        let (at, e) = nl.batch(vec![get("lo"), get("weft-no-such"), get("weft-no-such-2")]).unwrap_err();
        assert_eq!((at, e.raw_os_error()), (1, Some(libc::ENODEV)));
        // Every acknowledgement of the batch was read: the socket is in step.
        let lo = nl.request(get("lo").0, 0).unwrap();
        assert!(matches!(lo.as_slice(), [RouteNetlinkMessage::NewLink(l)] if l.header.index == 1));
    }
}
