//! The sandbox's own lifecycle as a person drives it: `down` while `up` is
//! still starting (its terminal closed, say) stops the starting supervisor
//! and leaves nothing behind. The real-node cluster's `down` uses the same
//! supervisor locks.

use std::process::{Command, Stdio};
use std::time::Duration;

use weft_e2e::sandbox::testing::{Up, ok, run, turn};
use weft_e2e::sandbox::{State, cluster, existing_namespaces, state_dir};
use weft_e2e::supervisor::StateFile;
use weft_e2e::{bins, wait};

/// `down` once more when the test ends, also on a panic.
struct DownAtEnd;

impl Drop for DownAtEnd {
    fn drop(&mut self) {
        let _ = run(&["down"]);
    }
}

#[test]
fn down_stops_a_sandbox_that_is_still_starting() {
    let Some(turn) = turn(&[]) else { return };
    let _down = DownAtEnd;
    wait::until("no other sandbox to be up or starting", Duration::from_secs(600), || {
        (!cluster::locks().taken()).then_some(())
    });
    let mut up = Command::new(bins::weft("weft-sandbox"))
        .args(["up", "--nodes", "2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cannot start weft-sandbox up");
    // The supervisor is `up`'s child; it has taken the machine once its pid
    // is in the lock file. (Read, not probed: a probe takes the lock for an
    // instant and could make the starting `up` give up.)
    let children = format!("/proc/{0}/task/{0}/children", up.id());
    let supervisor =
        wait::until_every("the supervisor to start", Duration::from_secs(30), Duration::from_millis(10), || {
            let pid: u32 = std::fs::read_to_string(&children).ok()?.split_whitespace().next()?.parse().ok()?;
            (cluster::locks().written_pid() == Some(pid)).then_some(pid)
        });
    assert_eq!(cluster::locks().supervisor_pid(), Some(supervisor), "the supervisor holds its lock");
    // The client goes away; the supervisor it started goes on building.
    up.kill().expect("cannot kill weft-sandbox up");
    let _ = up.wait();
    assert!(!State::path().exists(), "the sandbox was up already: this test needs it still starting");

    ok(&["down"]);
    // (Having lost its parent, it may stay a zombie for a moment after it
    // exited, until init reaps it: that does not count as running.)
    let alive = weft_e2e::supervisor::running(supervisor as i32);
    assert!(!alive, "the starting supervisor (pid {supervisor}) survived `down`");
    assert_eq!(existing_namespaces(), Vec::<String>::new(), "namespaces left behind");
    assert!(!state_dir().exists(), "{} left behind", state_dir().display());
    assert!(!cluster::locks().taken(), "the machine is still taken");
    // And a sandbox comes up again (and goes down with `_up`).
    drop(turn);
    let _up = Up::start(&["--nodes", "1"], &[]).expect("prerequisites were present a moment ago");
}
