//! Netlink handles bound to a network namespace.
//!
//! A netlink socket belongs to the namespace it was created in, whatever
//! thread later uses it. So we create the socket on a short-lived dedicated
//! thread that has `setns`'d into the target namespace; that thread exits
//! right after, and no tokio worker ever changes namespace.

use std::fs::File;
use std::path::{Path, PathBuf};

use nix::sched::{CloneFlags, setns};
use rtnetlink::Handle;

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

/// An open network namespace: its file (for moving links into it) and a
/// netlink handle that operates inside it.
pub struct Netns {
    pub file: File,
    pub handle: Handle,
}

impl Netns {
    /// Opens `path` and a netlink handle inside it.
    pub async fn open(path: &Path) -> Result<Self, NetnsError> {
        let file = File::open(path).map_err(|source| {
            if source.kind() == std::io::ErrorKind::NotFound {
                NetnsError::Missing(path.to_owned())
            } else {
                NetnsError::Open { path: path.to_owned(), source }
            }
        })?;
        let thread_file = file.try_clone().map_err(|source| NetnsError::Open { path: path.to_owned(), source })?;
        let rt = tokio::runtime::Handle::current();
        let owned = path.to_owned();
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("weft-netns".into())
            .spawn(move || {
                let result = (|| {
                    setns(&thread_file, CloneFlags::CLONE_NEWNET)
                        .map_err(|source| NetnsError::Enter { path: owned, source })?;
                    // The socket registers with the runtime's reactor.
                    let _guard = rt.enter();
                    let (conn, handle, _) = rtnetlink::new_connection().map_err(NetnsError::Socket)?;
                    Ok((conn, handle))
                })();
                let _ = tx.send(result);
            })
            .map_err(|_| NetnsError::Thread)?;
        let (conn, handle) = rx.await.map_err(|_| NetnsError::Thread)??;
        // The connection ends when the last handle is dropped.
        tokio::spawn(conn);
        Ok(Self { file, handle })
    }

    /// A handle in the agent's own namespace.
    pub fn current() -> Result<Handle, NetnsError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(NetnsError::Socket)?;
        tokio::spawn(conn);
        Ok(handle)
    }
}
