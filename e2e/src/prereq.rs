//! Prerequisite checks. A test that needs root or a tool never skips silently:
//! under `CI=true` a missing prerequisite fails the test.

/// True when running in CI, where every prerequisite must be present.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Returns `true` when the test may run. When a prerequisite is missing it
/// panics in CI and otherwise prints a loud notice and returns `false`.
pub fn require(what: &str, present: bool) -> bool {
    if present {
        return true;
    }
    if in_ci() {
        panic!("prerequisite missing under CI=true: {what}");
    }
    eprintln!("SKIPPED: prerequisite missing: {what} (this would fail under CI=true)");
    false
}

/// The test needs root (network namespaces, netlink, iptables).
pub fn require_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    require("root (euid 0)", unsafe { libc::geteuid() } == 0)
}

/// Whether `cmd` is on the PATH.
pub fn have(cmd: &str) -> bool {
    std::process::Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .output()
        .is_ok_and(|o| o.status.success())
}
