//! Connectivity: the responder each sandbox pod runs, and the probe that
//! tries every ordered pair of pods and reports an allow/deny matrix.
//!
//! A connection counts as allowed only when the reply names the pod that was
//! addressed, so a reply from anything else is a deny.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Serialize;

use super::pods::{PodRecord, PortSpec};

/// Serves `ports` forever, answering each connection or datagram with `name`,
/// over IPv4 and IPv6 (one socket on `[::]`, which takes both, or on
/// 0.0.0.0 where the namespace has no IPv6).
/// Creates `ready_file` once every socket is bound, so callers can wait for it.
pub fn respond(name: &str, ports: &[PortSpec], ready_file: Option<&std::path::Path>) -> anyhow::Result<()> {
    let mut threads = Vec::new();
    for p in ports {
        let name = format!("{name}\n");
        let any6 = SocketAddr::from((Ipv6Addr::UNSPECIFIED, p.port));
        let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, p.port));
        match p.protocol.as_str() {
            "tcp" => {
                let l = TcpListener::bind(any6).or_else(|_| TcpListener::bind(addr));
                let l = l.with_context(|| format!("listen tcp {addr}"))?;
                threads.push(std::thread::spawn(move || {
                    for mut c in l.incoming().flatten() {
                        let _ = c.write_all(name.as_bytes());
                    }
                }));
            }
            "udp" => {
                let s = UdpSocket::bind(any6).or_else(|_| UdpSocket::bind(addr));
                let s = s.with_context(|| format!("bind udp {addr}"))?;
                threads.push(std::thread::spawn(move || {
                    let mut buf = [0u8; 512];
                    while let Ok((_, from)) = s.recv_from(&mut buf) {
                        let _ = s.send_to(name.as_bytes(), from);
                    }
                }));
            }
            other => bail!("{other} is not supported by this kernel or responder (port {})", p.port),
        }
    }
    if let Some(f) = ready_file {
        std::fs::write(f, b"").with_context(|| format!("cannot write {}", f.display()))?;
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

#[derive(Debug, Serialize)]
pub struct Matrix {
    pub port: u16,
    pub protocol: String,
    pub pods: Vec<String>,
    /// `matrix[from][to]`: whether `from` reached `to`.
    pub matrix: BTreeMap<String, BTreeMap<String, bool>>,
}

/// Which of a pod's addresses a probe connects to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Family {
    Ipv4,
    Ipv6,
}

impl Family {
    /// The pod's address of this family (a pod without one is never reached).
    pub fn address_of(self, pod: &PodRecord) -> Option<&str> {
        // An IPv6-only pod's one address is its `ip`.
        let v6 = pod.ip.contains(':');
        match self {
            Family::Ipv4 => Some(pod.ip.as_str()).filter(|_| !v6),
            Family::Ipv6 => pod.ip6.as_deref().or(Some(pod.ip.as_str()).filter(|_| v6)),
        }
    }
}

/// Tries every ordered pair of `pods` (itself excluded) on `port`/`protocol`,
/// at their addresses of `family`.
pub fn probe(
    pods: &[PodRecord],
    port: u16,
    protocol: &str,
    family: Family,
    timeout: Duration,
) -> anyhow::Result<Matrix> {
    if !["tcp", "udp"].contains(&protocol) {
        bail!("protocol {protocol} cannot be probed here (tcp or udp)");
    }
    let results = std::thread::scope(|s| -> anyhow::Result<Vec<(String, BTreeMap<String, bool>)>> {
        let handles: Vec<_> = pods
            .iter()
            .map(|src| {
                s.spawn(move || -> anyhow::Result<(String, BTreeMap<String, bool>)> {
                    // This thread moves into the source pod's namespace for good.
                    let netns = src.workload_netns();
                    let file = File::open(format!("/run/netns/{netns}"))
                        .with_context(|| format!("pod {} has no namespace", src.key()))?;
                    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
                        .with_context(|| format!("entering {netns}"))?;
                    let row = pods
                        .iter()
                        .filter(|dst| dst.key() != src.key())
                        .map(|dst| {
                            let answer = family.address_of(dst).and_then(|ip| reach(ip, port, protocol, timeout));
                            (dst.key(), answer.as_deref() == Some(&*dst.key()))
                        })
                        .collect();
                    Ok((src.key(), row))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("probe thread panicked"))?).collect()
    })?;
    Ok(Matrix {
        port,
        protocol: protocol.to_owned(),
        pods: pods.iter().map(PodRecord::key).collect(),
        matrix: results.into_iter().collect(),
    })
}

/// The name the responder at `ip:port` answered with, if any.
pub fn reach(ip: &str, port: u16, protocol: &str, timeout: Duration) -> Option<String> {
    let addr = SocketAddr::new(ip.parse::<IpAddr>().ok()?, port);
    let mut buf = [0u8; 256];
    let n = match protocol {
        "tcp" => {
            let mut c = TcpStream::connect_timeout(&addr, timeout).ok()?;
            c.set_read_timeout(Some(timeout)).ok()?;
            c.read(&mut buf).ok()?
        }
        _ => {
            let local = if addr.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
            let s = UdpSocket::bind(local).ok()?;
            s.set_read_timeout(Some(timeout)).ok()?;
            s.send_to(b"probe", addr).ok()?;
            s.recv(&mut buf).ok()?
        }
    };
    Some(String::from_utf8_lossy(&buf[..n]).trim().to_owned())
}

/// Connects from inside `netns` to `ip:port` and returns the responder's
/// answer (`None`: no answer within `timeout`).
pub fn reach_from(
    netns: &str,
    ip: &str,
    port: u16,
    protocol: &str,
    timeout: Duration,
) -> anyhow::Result<Option<String>> {
    let (netns, ip, protocol) = (netns.to_owned(), ip.to_owned(), protocol.to_owned());
    std::thread::spawn(move || -> anyhow::Result<Option<String>> {
        // This thread moves into the namespace for good.
        let file = File::open(format!("/run/netns/{netns}")).with_context(|| format!("no namespace {netns}"))?;
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).with_context(|| format!("entering {netns}"))?;
        Ok(reach(&ip, port, &protocol, timeout))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("connect thread panicked"))?
}
