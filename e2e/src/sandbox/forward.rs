//! A TCP forwarder from this namespace's loopback into another network
//! namespace: how the host reaches the sandbox's apiserver without any link
//! in the root namespace. Outgoing sockets are created by a thread that lives
//! inside the target namespace; the accepted and connected streams are then
//! spliced by ordinary threads.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context;

type Dial = (SocketAddr, mpsc::Sender<std::io::Result<TcpStream>>);

/// Serves `listen` (in this namespace) forever, forwarding each connection
/// to `target` as seen from inside `netns`.
pub fn serve(listen: SocketAddr, netns: &str, target: SocketAddr) -> anyhow::Result<()> {
    serve_between(None, listen, Some(netns), target)
}

/// Like [`serve`], with the listening socket inside `listen_ns` and the
/// outgoing connections made from `dial_ns` (`None`: this namespace).
pub fn serve_between(
    listen_ns: Option<&str>,
    listen: SocketAddr,
    dial_ns: Option<&str>,
    target: SocketAddr,
) -> anyhow::Result<()> {
    let listener = match listen_ns {
        None => TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))?,
        Some(ns) => {
            let file = File::open(format!("/run/netns/{ns}")).with_context(|| format!("no network namespace {ns}"))?;
            // A socket stays in the namespace it was created in; the thread that
            // created it ends right after.
            std::thread::spawn(move || -> anyhow::Result<TcpListener> {
                nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).context("setns")?;
                TcpListener::bind(listen).with_context(|| format!("cannot listen on {listen}"))
            })
            .join()
            .map_err(|_| anyhow::anyhow!("listener thread panicked"))??
        }
    };
    let dialer = spawn_dialer(dial_ns)?;
    std::thread::Builder::new().name("forward-accept".into()).spawn(move || {
        for client in listener.incoming().flatten() {
            let (tx, rx) = mpsc::channel();
            if dialer.send((target, tx)).is_err() {
                return;
            }
            match rx.recv() {
                Ok(Ok(upstream)) => splice(client, upstream),
                _ => drop(client),
            }
        }
    })?;
    Ok(())
}

fn spawn_dialer(netns: Option<&str>) -> anyhow::Result<mpsc::Sender<Dial>> {
    let file = match netns {
        Some(ns) => Some(File::open(format!("/run/netns/{ns}")).with_context(|| format!("no network namespace {ns}"))?),
        None => None,
    };
    let (tx, rx) = mpsc::channel::<Dial>();
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::Builder::new().name("forward-dial".into()).spawn(move || {
        // This thread stays in the target namespace for its whole life.
        let entered = match &file {
            Some(f) => nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET),
            None => Ok(()),
        };
        let _ = ready_tx.send(entered.map_err(|e| e.to_string()));
        for (addr, reply) in rx {
            let _ = reply.send(TcpStream::connect_timeout(&addr, Duration::from_secs(5)));
        }
    })?;
    ready_rx.recv().context("dialer thread died")?.map_err(|e| anyhow::anyhow!("cannot enter {netns:?}: {e}"))?;
    Ok(tx)
}

fn splice(a: TcpStream, b: TcpStream) {
    let (Ok(a2), Ok(b2)) = (a.try_clone(), b.try_clone()) else { return };
    std::thread::spawn(move || pump(a, b2));
    std::thread::spawn(move || pump(b, a2));
}

fn pump(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}
