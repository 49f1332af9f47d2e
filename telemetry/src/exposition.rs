//! The metrics exposition both daemons serve: OpenMetrics for Prometheus,
//! the classic text format for everything else (curl, `promtool check metrics`).

/// Content type of the OpenMetrics exposition prometheus-client writes.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// Content type of the classic Prometheus text format.
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Picks the exposition format from the request's `Accept` header, as the
/// official client libraries do: OpenMetrics when asked for (Prometheus asks
/// for it), else the classic text format (curl, `promtool check metrics`).
/// Returns the content type and the body.
pub fn negotiate(accept: Option<&str>, openmetrics: String) -> (&'static str, String) {
    if accept.is_some_and(|a| a.contains("application/openmetrics-text")) {
        (OPENMETRICS, openmetrics)
    } else {
        (PROMETHEUS_TEXT, to_prometheus_text(&openmetrics))
    }
}

/// Converts OpenMetrics text into the Prometheus text format 0.0.4: a counter
/// family is named with its `_total` suffix (as its samples are), and the
/// `# UNIT` and `# EOF` lines, which that format does not have, are dropped.
pub fn to_prometheus_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> =
        openmetrics.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| Some((p, line.strip_prefix(p)?.split_once(' ')?)));
        match meta {
            Some((prefix, (name, rest))) if counters.contains(name) => {
                out.push_str(prefix);
                out.push_str(name);
                out.push_str("_total ");
                out.push_str(rest);
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classic_text_names_counter_families_with_total() {
        let om = "# HELP x_requests Requests.\n# TYPE x_requests counter\nx_requests_total{a=\"b\"} 1\n\
                  # HELP x_duration_seconds Time.\n# TYPE x_duration_seconds histogram\n# UNIT x_duration_seconds seconds\n\
                  x_duration_seconds_count 0\n# EOF\n";
        let text = to_prometheus_text(om);
        assert_eq!(
            text,
            "# HELP x_requests_total Requests.\n# TYPE x_requests_total counter\nx_requests_total{a=\"b\"} 1\n\
             # HELP x_duration_seconds Time.\n# TYPE x_duration_seconds histogram\nx_duration_seconds_count 0\n"
        );
        assert_eq!(
            negotiate(Some("application/openmetrics-text;version=1.0.0,text/plain;q=0.5"), om.into()).0,
            OPENMETRICS
        );
        assert_eq!(negotiate(Some("*/*"), om.into()).0, PROMETHEUS_TEXT);
        assert_eq!(negotiate(None, om.into()).1, text);
    }
}
