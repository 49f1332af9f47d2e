//! What both daemons share about being observed: the metrics exposition and
//! the log set-up.

pub mod logging;

mod exposition;
pub use exposition::{OPENMETRICS, PROMETHEUS_TEXT, negotiate, to_prometheus_text};
