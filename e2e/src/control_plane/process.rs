//! Child processes tied to the test binary's lifetime.
//!
//! Children are spawned with `PR_SET_PDEATHSIG(SIGKILL)`, so they die with the
//! test binary even when it is killed. The signal fires when the *thread*
//! that forked exits, so every spawn happens on one thread that lives until
//! the process ends.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::Context;

type SpawnJob = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static std::sync::Mutex<mpsc::Sender<SpawnJob>> {
    static SPAWNER: OnceLock<std::sync::Mutex<mpsc::Sender<SpawnJob>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("weft-e2e-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The sender lives in a static, so this loop never ends
                // before the process does.
            })
            .expect("spawning the weft-e2e-spawner thread");
        std::sync::Mutex::new(tx)
    })
}

/// Spawns `cmd` in a session of its own with stdout and stderr appended to
/// `log`: it outlives the command that started it (the supervisors, the sandbox's
/// agents and responders, the nodes' daemons are long-lived).
pub fn spawn_detached(mut cmd: std::process::Command, log: &std::path::Path) -> anyhow::Result<std::process::Child> {
    use std::os::unix::process::CommandExt;
    let out = std::fs::OpenOptions::new().create(true).append(true).open(log)?;
    cmd.stdin(std::process::Stdio::null()).stdout(out.try_clone()?).stderr(out);
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let program = format!("{:?}", cmd.get_program());
    cmd.spawn().with_context(|| format!("cannot start {program}"))
}

/// `ip netns exec <netns> <program>`: a command that runs inside a named
/// network namespace.
pub fn in_netns(netns: &str, program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", netns]).arg(program);
    c
}

/// Spawns `cmd` so that it is SIGKILLed when the test binary exits. Output
/// goes to `log` (stdout and stderr).
pub fn spawn_tied(mut cmd: Command, log: &Path) -> anyhow::Result<Child> {
    let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let err = out.try_clone().context("duplicating log handle")?;
    cmd.stdin(Stdio::null()).stdout(out).stderr(err);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let program = format!("{:?}", cmd.get_program());
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .map_err(|_| anyhow::anyhow!("spawner lock poisoned"))?
        .send((cmd, tx))
        .map_err(|_| anyhow::anyhow!("spawner thread gone"))?;
    rx.recv().context("spawner thread gone")?.with_context(|| format!("spawning {program}"))
}

/// Sends SIGTERM, waits up to `grace`, then SIGKILLs and reaps the child.
pub fn stop(child: &mut Child, grace: Duration) {
    if let Ok(Some(_)) = child.try_wait() {
        return;
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        // SAFETY: plain kill(2) on our own child's pid, which is not yet reaped.
        unsafe { libc::kill(pid, libc::SIGTERM) };
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// Last `max` bytes of a log file, for error messages.
pub fn log_tail(path: &Path, max: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let start = text.len().saturating_sub(max);
    let start = (start..text.len()).find(|i| text.is_char_boundary(*i)).unwrap_or(text.len());
    text[start..].to_string()
}
