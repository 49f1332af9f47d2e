//! What the sandbox and the real-node cluster share: a supervisor process
//! started by `up` that writes a JSON state file once everything is ready
//! ([`StateFile`]), is stopped by `down` with SIGTERM, and leaves nothing
//! (its network namespaces share a prefix: [`remove_namespaces`]).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::control_plane::process;

/// The two flocks beside a state directory `<dir>`: `<dir>.lock`, held by
/// the supervisor for its whole life (one per machine), and
/// `<dir>.starting.lock`, held by `up` while it starts a supervisor and by
/// `down` while it removes one, so that neither cleans up the other's state.
/// A supervisor that crashed leaves its state but holds no lock: `up` then
/// removes the leftovers, and nobody needs to wait for them. The supervisor
/// writes its pid into its lock file, so `down` finds it before it has
/// written its state (still starting), and never signals the pid of one that
/// is gone.
pub struct MachineLocks {
    state_dir: PathBuf,
}

impl MachineLocks {
    pub fn new(state_dir: PathBuf) -> MachineLocks {
        MachineLocks { state_dir }
    }

    /// The supervisor's lock without waiting; `Ok(None)` when it is held.
    pub fn try_supervisor(&self) -> anyhow::Result<Option<File>> {
        flock(&self.supervisor_lock(), false)
    }

    fn supervisor_lock(&self) -> PathBuf {
        self.state_dir.with_extension("lock")
    }

    /// The supervisor's lock for the calling process, which is the
    /// supervisor: its pid is written into the lock file. Others probe the
    /// lock by taking it for an instant, so a held lock is tried again for
    /// half a second before another supervisor is taken to hold it.
    pub fn take_supervisor(&self) -> anyhow::Result<Option<File>> {
        use std::io::Write;
        let deadline = Instant::now() + Duration::from_millis(500);
        let mut file = loop {
            match self.try_supervisor()? {
                Some(file) => break file,
                None if Instant::now() > deadline => return Ok(None),
                None => std::thread::sleep(Duration::from_millis(10)),
            }
        };
        let path = self.supervisor_lock();
        file.set_len(0)
            .and_then(|()| write!(file, "{}", std::process::id()))
            .with_context(|| format!("cannot write the supervisor's pid into {}", path.display()))?;
        Ok(Some(file))
    }

    /// The pid of the running supervisor, from its lock file; `None` when no
    /// supervisor holds the lock. A supervisor that has just taken the lock
    /// is given a second to write its pid.
    pub fn supervisor_pid(&self) -> Option<u32> {
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            if !matches!(self.try_supervisor(), Ok(None)) {
                return None;
            }
            if let Some(pid) = self.written_pid() {
                return Some(pid);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pid the last supervisor wrote into its lock file, read without
    /// probing the lock (it may be stale: see `supervisor_pid`).
    pub fn written_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.supervisor_lock()).ok()?.trim().parse().ok()
    }

    /// The starting lock, waiting for whoever holds it.
    pub fn starting(&self) -> anyhow::Result<File> {
        flock(&self.state_dir.with_extension("starting.lock"), true)?.context("flock returned without the lock")
    }

    /// Whether a supervisor runs or is being started or stopped right now.
    /// (Probing takes each lock for a moment; an `up` that meets the probe
    /// fails as if it had lost a race, and its caller retries.)
    pub fn taken(&self) -> bool {
        let free = |path: PathBuf| matches!(flock(&path, false), Ok(Some(_)));
        !(free(self.state_dir.with_extension("starting.lock")) && free(self.supervisor_lock()))
    }
}

/// Opens `path` and takes an exclusive flock on it, waiting for it when
/// `wait`; `Ok(None)` when it is held and we may not wait. The lock lasts as
/// long as the returned file is open.
fn flock(path: &Path, wait: bool) -> anyhow::Result<Option<File>> {
    use std::os::fd::AsRawFd;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let mode = if wait { libc::LOCK_EX } else { libc::LOCK_EX | libc::LOCK_NB };
    // SAFETY: flock on a descriptor we own; released when the file is closed.
    if unsafe { libc::flock(file.as_raw_fd(), mode) } == 0 {
        return Ok(Some(file));
    }
    let e = std::io::Error::last_os_error();
    if e.kind() == std::io::ErrorKind::WouldBlock {
        return Ok(None);
    }
    Err(e).with_context(|| format!("cannot lock {}", path.display()))
}

/// Brings environment `S` up: takes the starting lock, refuses when a
/// supervisor holds the machine, removes a crashed one's leftovers, runs
/// `prepare` in the fresh state directory, starts `weft-<env> supervise
/// <args>` detached and waits for the state it writes.
pub fn up<S: StateFile>(args: &[String], prepare: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<S> {
    let locks = S::locks();
    let _starting = locks.starting()?;
    if locks.try_supervisor()?.is_none() {
        bail!("a {} is already up or starting on this machine; `{}` first", S::WHAT, S::DOWN);
    }
    S::cleanup_leftovers();
    let dir = S::state_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let log = dir.join("supervisor.log");
    prepare()?;
    let mut cmd = std::process::Command::new(std::env::current_exe()?);
    cmd.arg("supervise").args(args);
    let mut child = process::spawn_detached(cmd, &log)?;
    wait_for_ready(S::WHAT, &mut child, &log, S::READY_WAIT, S::load)
}

/// Stops `S`'s supervisor (which tears everything down) and removes leftovers.
pub fn down<S: StateFile>() -> anyhow::Result<()> {
    let locks = S::locks();
    let _starting = locks.starting()?;
    if let Some(pid) = locks.supervisor_pid() {
        stop(pid, S::STOP_WAIT);
    }
    S::cleanup_leftovers();
    Ok(())
}

/// A node of an environment, as its state lists it.
pub trait StateNode {
    fn name(&self) -> &str;
}

/// What `up` leaves for the other commands and the tests: one JSON file in
/// the environment's state directory.
pub trait StateFile: Serialize + DeserializeOwned {
    type Node: StateNode;
    /// What the environment is called in messages ("sandbox", "cluster").
    const WHAT: &'static str;
    /// The commands that bring it up and down.
    const UP: &'static str;
    const DOWN: &'static str;
    /// How long its supervisor may take to be ready, and to tear down.
    const READY_WAIT: Duration;
    const STOP_WAIT: Duration;

    fn state_dir() -> PathBuf;

    /// Removes what a supervisor that is gone may have left.
    fn cleanup_leftovers();

    /// The locks beside the state directory.
    fn locks() -> MachineLocks {
        MachineLocks::new(Self::state_dir())
    }

    fn nodes(&self) -> &[Self::Node];

    fn path() -> PathBuf {
        Self::state_dir().join("state.json")
    }

    fn load() -> anyhow::Result<Self> {
        let path = Self::path();
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("the {} is not up: run `{}` ({} missing)", Self::WHAT, Self::UP, path.display())
        })?;
        serde_json::from_str(&text).with_context(|| format!("corrupt {}", path.display()))
    }

    /// Writes the state atomically.
    fn save(&self) -> anyhow::Result<()> {
        let path = Self::path();
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("saving {}", path.display()))
    }

    fn node(&self, name: &str) -> anyhow::Result<&Self::Node> {
        self.nodes().iter().find(|n| n.name() == name).with_context(|| {
            let names: Vec<_> = self.nodes().iter().map(StateNode::name).collect();
            format!("no node {name:?} in the {} (nodes: {})", Self::WHAT, names.join(", "))
        })
    }
}

/// Names of the network namespaces that exist now and start with `prefix`.
pub fn namespaces_with_prefix(prefix: &str) -> Vec<String> {
    let listed = std::process::Command::new("ip").args(["netns", "list"]).output();
    String::from_utf8_lossy(&listed.map(|o| o.stdout).unwrap_or_default())
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

/// Deletes every network namespace whose name starts with `prefix`.
pub fn remove_namespaces(prefix: &str) {
    for ns in namespaces_with_prefix(prefix) {
        let _ = std::process::Command::new("ip").args(["netns", "del", &ns]).output();
    }
}

/// Waits until `ready` returns the state the supervisor `child` wrote,
/// failing with its log when it exits or `timeout` passes.
pub fn wait_for_ready<T>(
    what: &str,
    child: &mut Child,
    log: &Path,
    timeout: Duration,
    ready: impl Fn() -> anyhow::Result<T>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("the {what} supervisor exited ({status}); its log:\n{}", process::log_tail(log, 8000));
        }
        if let Ok(state) = ready() {
            return Ok(state);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("the {what} was not ready within {timeout:?}; log:\n{}", process::log_tail(log, 8000));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Sends SIGTERM to a supervisor and waits up to `timeout` for it to finish
/// tearing down.
pub fn stop(pid: u32, timeout: Duration) {
    let alive = || running(pid as i32);
    // SAFETY: plain kill(2).
    if unsafe { libc::kill(pid as i32, libc::SIGTERM) } == 0 {
        let deadline = Instant::now() + timeout;
        while alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// Whether `pid` still runs. A process a supervisor started and then
/// exited stays a zombie while the supervisor lives (it does not wait for
/// its daemons): that counts as gone, and is reaped here when it is our
/// child. (`kill(pid, 0)` succeeds on a zombie: waiting on it for a grace
/// period made every teardown tens of seconds long.)
pub fn running(pid: i32) -> bool {
    let mut status = 0;
    // SAFETY: waitpid(2) on one pid with WNOHANG reaps only an exited child of ours.
    if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
        return false;
    }
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    // The state follows the command name, which is in parentheses.
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()).is_some_and(|state| state != "Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exited_child_not_yet_waited_for_is_not_running() {
        let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
        let pid = sleeper.id() as i32;
        assert!(running(pid), "a sleeping child runs");
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Until reaped it is a zombie, which kill(pid, 0) still finds.
        let deadline = Instant::now() + Duration::from_secs(10);
        while running(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!running(pid), "a killed child is gone");
        let _ = sleeper.try_wait();
    }

    #[test]
    fn leftovers_without_a_lock_do_not_take_the_machine_but_a_held_lock_does() {
        let dir = tempfile::tempdir().expect("temp dir");
        let state = dir.path().join("sandbox");
        // What a supervisor killed with SIGKILL leaves: its state, no lock.
        std::fs::create_dir_all(&state).expect("state dir");
        std::fs::write(state.join("state.json"), "{}").expect("state file");
        std::fs::write(state.join("supervisor.log"), "").expect("log");
        let locks = MachineLocks::new(state);
        assert!(!locks.taken());

        assert_eq!(locks.supervisor_pid(), None);
        let supervisor = locks.take_supervisor().expect("lock").expect("free");
        assert!(locks.taken(), "a running supervisor takes the machine");
        assert!(locks.try_supervisor().expect("lock").is_none(), "one supervisor at a time");
        assert_eq!(locks.supervisor_pid(), Some(std::process::id()), "down finds the supervisor by its lock");
        drop(supervisor);
        assert!(!locks.taken());
        assert_eq!(locks.supervisor_pid(), None, "the pid of a supervisor that is gone is nobody's to signal");

        let starting = locks.starting().expect("lock");
        assert!(locks.taken(), "an `up` or `down` in progress takes the machine");
        drop(starting);
        assert!(!locks.taken());
    }
}
