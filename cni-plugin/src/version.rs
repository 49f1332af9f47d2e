//! CNI specification versions weft-cni speaks.

/// Versions answered by VERSION, oldest first.
pub const SUPPORTED: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];
pub const LATEST: &str = "1.1.0";

/// A supported spec version; ordered so that features can be gated on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CniVersion {
    V0_3_0,
    V0_3_1,
    V0_4_0,
    V1_0_0,
    V1_1_0,
}

impl CniVersion {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "0.3.0" => Self::V0_3_0,
            "0.3.1" => Self::V0_3_1,
            "0.4.0" => Self::V0_4_0,
            "1.0.0" => Self::V1_0_0,
            "1.1.0" => Self::V1_1_0,
            _ => return None,
        })
    }
}

/// The VERSION reply.
pub fn version_json(requested: Option<&str>) -> String {
    let cni_version = requested.filter(|r| CniVersion::parse(r).is_some()).unwrap_or(LATEST);
    serde_json::json!({ "cniVersion": cni_version, "supportedVersions": SUPPORTED }).to_string()
}
