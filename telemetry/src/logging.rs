//! Log set-up shared by both daemons: the filter from an environment variable
//! (the chart's `logLevel`), written to stderr, colours only on a terminal
//! (kubelet keeps container logs as plain text).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Libraries that log every frame or poll at debug: a bare `debug` would
/// bury the daemon's own lines under theirs (h2 alone writes 13 lines per
/// CNI ADD) and slow every request. Named in the filter, they log as asked.
const CHATTY: &[&str] = &["h2", "hyper", "hyper_util", "tower", "tonic", "rustls"];

/// Logs to stderr at the filter in `var` (default info). An invalid filter
/// is reported and replaced by info rather than silently ignored.
pub fn init(var: &str) {
    let spec = std::env::var(var).unwrap_or_default();
    let (filter, invalid) = match EnvFilter::try_new(directives(&spec)) {
        Ok(f) => (f, None),
        Err(e) => (EnvFilter::new("info"), Some(e)),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if let Some(e) = invalid {
        tracing::warn!("{var}={spec:?} is not a valid log filter ({e}); logging at info");
    }
}

/// `spec` (empty: info), with the chatty libraries kept at info when a bare
/// debug or trace level would include them and the spec does not name them.
fn directives(spec: &str) -> String {
    let spec = if spec.trim().is_empty() { "info" } else { spec.trim() };
    let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
    let verbose = parts.iter().any(|p| matches!(p.to_ascii_lowercase().as_str(), "debug" | "trace"));
    let named = |t: &str| parts.iter().any(|p| p.split(['=', '[', ':']).next() == Some(t));
    let mut out = spec.to_owned();
    if verbose {
        for t in CHATTY.iter().filter(|t| !named(t)) {
            out.push_str(&format!(",{t}=info"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_debug_keeps_the_chatty_libraries_at_info() {
        let d = directives("debug");
        assert!(d.starts_with("debug,") && d.contains(",h2=info") && d.contains(",tower=info"), "{d}");
        EnvFilter::try_new(&d).unwrap();
    }

    #[test]
    fn named_libraries_and_quieter_levels_are_left_as_asked() {
        let d = directives("debug,h2=trace");
        assert!(!d.contains("h2=info") && d.contains("hyper=info"), "{d}");
        assert_eq!(directives("warn"), "warn");
        assert_eq!(directives("info,weft_agent=debug"), "info,weft_agent=debug");
        assert_eq!(directives(""), "info");
    }

    #[test]
    fn an_invalid_filter_is_an_error_to_report() {
        assert!(EnvFilter::try_new(directives("weft_agent=loud")).is_err());
    }
}
