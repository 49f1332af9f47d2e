//! Netlink sockets bound to a network namespace.
//!
//! A netlink socket belongs to the namespace it was created in, whatever
//! thread later uses it. [`Netns`] creates its async handle on a short-lived
//! thread that has `setns`'d into the target namespace and exits right after.
//! [`BlockingNetns`], on ADD's hot path, enters the namespace on the calling
//! thread for the two syscalls that make the socket and returns at once (the
//! pattern of the reference plugins' `ns.Do`); should returning ever fail,
//! the agent aborts rather than go on working inside a pod.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::sched::{CloneFlags, setns};
use rtnetlink::Handle;

use super::netlink_blocking::BlockingNetlink;

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error("network namespace {0} does not exist")]
    Missing(PathBuf),
    #[error("cannot open network namespace {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("cannot enter network namespace {path}: {source}")]
    Enter { path: PathBuf, source: nix::Error },
    #[error("cannot open a netlink socket: {0}")]
    Socket(std::io::Error),
    #[error("the netlink helper thread failed")]
    Thread,
}

/// A netlink handle that operates inside a network namespace.
pub struct Netns {
    pub handle: Handle,
}

impl Netns {
    /// Opens `path` and a netlink handle inside it.
    pub async fn open(path: &Path) -> Result<Self, NetnsError> {
        let rt = tokio::runtime::Handle::current();
        let (conn, handle) = inside(path, move || {
            // The socket registers with the runtime's reactor.
            let _guard = rt.enter();
            let (conn, handle, _) = rtnetlink::new_connection().map_err(NetnsError::Socket)?;
            Ok((conn, handle))
        })
        .await?;
        // The connection ends when the last handle is dropped.
        tokio::spawn(conn);
        Ok(Self { handle })
    }

    /// A handle in the agent's own namespace.
    pub fn current() -> Result<Handle, NetnsError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetnsError::Socket)?;
        tokio::spawn(conn);
        Ok(handle)
    }
}

/// An open network namespace with a blocking netlink socket inside it: what
/// ADD needs (see [`BlockingNetlink`]).
pub struct BlockingNetns {
    pub file: File,
    pub netlink: BlockingNetlink,
}

impl BlockingNetns {
    /// Opens `path` and a socket inside it. Unlike [`Netns::open`] this
    /// enters the namespace on the calling thread, for the two syscalls that
    /// make the socket (a thread of its own costs ADD 0.2 ms); there is no
    /// await in between, so no other task runs on the thread meanwhile.
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = open_file(path)?;
        let home = File::open("/proc/thread-self/ns/net")
            .map_err(|source| NetnsError::Open { path: "/proc/thread-self/ns/net".into(), source })?;
        setns(&file, CloneFlags::CLONE_NEWNET).map_err(|source| NetnsError::Enter { path: path.to_owned(), source })?;
        let netlink = BlockingNetlink::new().map_err(NetnsError::Socket);
        if let Err(e) = setns(&home, CloneFlags::CLONE_NEWNET) {
            // This thread would go on working inside the pod: stop instead;
            // start-up reconciliation cleans up after the restart.
            tracing::error!(error = %e, "cannot return to the agent's network namespace");
            std::process::abort();
        }
        Ok(Self { file, netlink: netlink? })
    }
}

fn open_file(path: &Path) -> Result<File, NetnsError> {
    File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            NetnsError::Missing(path.to_owned())
        } else {
            NetnsError::Open { path: path.to_owned(), source }
        }
    })
}

/// Runs `make` on a short-lived thread inside the namespace at `path`
/// (for what must be made there: a socket stays in the namespace it was
/// made in, whichever thread uses it later).
pub async fn inside<T: Send + 'static>(
    path: &Path,
    make: impl FnOnce() -> Result<T, NetnsError> + Send + 'static,
) -> Result<T, NetnsError> {
    let file = open_file(path)?;
    let owned = path.to_owned();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("weft-netns".into())
        .spawn(move || {
            let result = setns(&file, CloneFlags::CLONE_NEWNET)
                .map_err(|source| NetnsError::Enter { path: owned, source })
                .and_then(|()| make());
            let _ = tx.send(result);
        })
        .map_err(|_| NetnsError::Thread)?;
    rx.await.map_err(|_| NetnsError::Thread)?
}
