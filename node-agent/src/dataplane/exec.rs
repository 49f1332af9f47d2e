//! Running the external programs the dataplane needs (`iptables-restore`,
//! `ipset`, `conntrack`) with a deadline: a program stuck on a lock or a
//! wedged kernel is killed and reported, so no request or reconcile loop
//! waits on it for ever. Blocking: call from a blocking context. The child
//! runs in the calling thread's network namespace.
//!
//! The wait uses a pidfd: it refers to exactly this child until it is
//! reaped, so there is no race with pid reuse and no SIGCHLD handler to
//! share with tokio.

use std::io::{Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::process::{Pid, PidfdFlags, pidfd_open};

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("cannot run {cmd}: {source}")]
    Spawn { cmd: &'static str, source: std::io::Error },
    #[error("{cmd} did not finish within {timeout:?} and was killed")]
    TimedOut { cmd: &'static str, timeout: Duration },
    #[error("{cmd} failed ({status}): {stderr}")]
    Failed { cmd: &'static str, status: ExitStatus, stderr: String },
}

/// What a program printed, once it exited.
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `cmd args`, feeding it `input` on stdin when given, and waits at most
/// `timeout`. Returns its output whatever its exit status.
pub fn run(cmd: &'static str, args: &[&str], input: Option<&[u8]>, timeout: Duration) -> Result<Output, ExecError> {
    let spawn_err = |source| ExecError::Spawn { cmd, source };
    let mut child = Command::new(cmd)
        .args(args)
        .stdin(if input.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_err)?;
    let (stdin, stdout, stderr) = (child.stdin.take(), child.stdout.take(), child.stderr.take());
    std::thread::scope(|s| {
        // Pipes are fed and drained on their own threads, so a program that
        // writes much before reading all its input cannot deadlock with us.
        s.spawn(move || {
            if let (Some(mut pipe), Some(data)) = (stdin, input) {
                // A program that exits early closes the pipe: its status says why.
                let _ = pipe.write_all(data);
            }
        });
        let out = s.spawn(move || drain(stdout));
        let err = s.spawn(move || drain(stderr));
        let status = match wait_until(&mut child, Instant::now() + timeout) {
            Ok(Some(status)) => status,
            Ok(None) => {
                // Killing closes its pipes, which ends the threads above.
                let _ = child.kill();
                let _ = child.wait();
                return Err(ExecError::TimedOut { cmd, timeout });
            }
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(spawn_err(source));
            }
        };
        let stdout = out.join().unwrap_or_default();
        let stderr = err.join().unwrap_or_default();
        Ok(Output { status, stdout, stderr })
    })
}

/// Like [`run`], but an exit status other than 0 (or one of `ok_codes`) is
/// an error carrying the program's stderr.
pub fn run_ok(
    cmd: &'static str,
    args: &[&str],
    input: Option<&[u8]>,
    timeout: Duration,
    ok_codes: &[i32],
) -> Result<Output, ExecError> {
    let out = run(cmd, args, input, timeout)?;
    if out.status.success() || out.status.code().is_some_and(|c| ok_codes.contains(&c)) {
        return Ok(out);
    }
    Err(ExecError::Failed { cmd, status: out.status, stderr: out.stderr.trim().to_owned() })
}

fn drain(pipe: Option<impl Read>) -> String {
    let mut buf = Vec::new();
    if let Some(mut p) = pipe {
        let _ = p.read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Waits for `child` to exit until `deadline`; `None` when it is still running.
fn wait_until(child: &mut Child, deadline: Instant) -> std::io::Result<Option<ExitStatus>> {
    let pidfd = pidfd_open(Pid::from_child(child), PidfdFlags::empty())?;
    // The pidfd is readable once the process has exited.
    match readable_before(&pidfd, deadline)? {
        true => child.wait().map(Some),
        false => Ok(None),
    }
}

/// Waits until `fd` has something to read (true) or `deadline` passes (false).
pub fn readable_before(fd: &impl std::os::fd::AsFd, deadline: Instant) -> std::io::Result<bool> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let timeout = Timespec::try_from(left).map_err(|_| std::io::Error::other("timeout out of range"))?;
        let mut fds = [PollFd::new(fd, PollFlags::IN)];
        match poll(&mut fds, Some(&timeout)) {
            Ok(n) => return Ok(n > 0),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_status_come_back() {
        let out = run("cat", &[], Some(b"hello"), Duration::from_secs(10)).expect("cat");
        assert!(out.status.success());
        assert_eq!(out.stdout, "hello");
        let big = vec![b'x'; 1 << 20];
        let out = run("cat", &[], Some(&big), Duration::from_secs(10)).expect("cat 1 MiB");
        assert_eq!(out.stdout.len(), 1 << 20, "large output is drained while input is fed");
    }

    #[test]
    fn a_failure_carries_stderr_unless_its_code_is_accepted() {
        let e = run_ok("sh", &["-c", "echo broken >&2; exit 3"], None, Duration::from_secs(10), &[]).err();
        assert!(matches!(&e, Some(ExecError::Failed { stderr, .. }) if stderr == "broken"), "{e:?}");
        assert!(run_ok("sh", &["-c", "exit 1"], None, Duration::from_secs(10), &[1]).is_ok());
    }

    #[test]
    fn a_stuck_program_is_killed_at_the_deadline() {
        let started = Instant::now();
        let e = run("sleep", &["30"], None, Duration::from_millis(200)).err();
        assert!(matches!(e, Some(ExecError::TimedOut { cmd: "sleep", .. })), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(10), "waited {:?}", started.elapsed());
    }

    #[test]
    fn a_missing_program_is_a_spawn_error() {
        let e = run("weft-no-such-program", &[], None, Duration::from_secs(1)).err();
        assert!(matches!(e, Some(ExecError::Spawn { .. })), "{e:?}");
    }
}
