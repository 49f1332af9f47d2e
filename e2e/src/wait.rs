//! Waiting on a condition with a deadline (never a bare sleep).

use std::time::{Duration, Instant};

/// Polls `cond` until it returns `Some`, or panics with `what` after `timeout`.
pub fn until<T>(what: &str, timeout: Duration, cond: impl FnMut() -> Option<T>) -> T {
    poll(what, timeout, Duration::from_millis(100), cond)
}

/// As [`until`], looking at most `every` apart (for measurements, where
/// the pause is the error).
pub fn until_every<T>(what: &str, timeout: Duration, every: Duration, cond: impl FnMut() -> Option<T>) -> T {
    poll(what, timeout, every, cond)
}

/// As [`until`], but `None` after `timeout`: the caller reports what it
/// saw last.
pub fn try_until<T>(timeout: Duration, cond: impl FnMut() -> Option<T>) -> Option<T> {
    poll_for(timeout, Duration::from_millis(100), cond)
}

fn poll<T>(what: &str, timeout: Duration, longest: Duration, cond: impl FnMut() -> Option<T>) -> T {
    poll_for(timeout, longest, cond).unwrap_or_else(|| panic!("timed out after {timeout:?} waiting for {what}"))
}

fn poll_for<T>(timeout: Duration, longest: Duration, mut cond: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(2).min(longest);
    loop {
        if let Some(v) = cond() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(longest);
    }
}
