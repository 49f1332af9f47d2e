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
