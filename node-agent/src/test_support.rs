//! Helpers shared by the agent's kernel tests.

/// Whether the test can run as root; under CI=true a missing root fails the
/// test instead of skipping it.
pub fn require_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        return true;
    }
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("prerequisite missing under CI=true: root (euid 0)");
    }
    eprintln!("SKIPPED: prerequisite missing: root (euid 0) (this would fail under CI=true)");
    false
}

/// A network namespace a test creates and deletes when dropped.
pub struct TestNetns(String);

impl TestNetns {
    pub fn new() -> TestNetns {
        use std::sync::atomic::{AtomicU32, Ordering};
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!("wtest-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        let ok = std::process::Command::new("ip").args(["netns", "add", &name]).status().expect("ip").success();
        assert!(ok, "ip netns add {name}");
        TestNetns(name)
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    /// Runs `f` on a thread inside the namespace (its child processes too).
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let path = format!("/run/netns/{}", self.0);
        std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("open netns");
            nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}
