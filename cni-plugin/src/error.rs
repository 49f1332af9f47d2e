//! CNI error codes and the error object printed on stdout.
//!
//! Every failure of weft-cni ends up here, and is turned into the spec's
//! `{cniVersion, code, msg, details}` object in one place ([`CniError::to_json`]).

use serde::Serialize;
pub use weft_proto::ErrorCode as Code;

/// A failure to report to the runtime.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CNI error {code}: {msg}{}", if details.is_empty() { String::new() } else { format!(" ({details})") })]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: Code, msg: impl Into<String>) -> Self {
        Self { code: code.as_u32(), msg: msg.into(), details: String::new() }
    }

    pub fn with_details(mut self, details: impl Into<String>) -> Self {
        self.details = details.into();
        self
    }

    /// The error object of the spec, for stdout.
    pub fn to_json(&self, cni_version: &str) -> String {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct Wire<'a> {
            cni_version: &'a str,
            code: u32,
            msg: &'a str,
            #[serde(skip_serializing_if = "str::is_empty")]
            details: &'a str,
        }
        let wire = Wire { cni_version, code: self.code, msg: &self.msg, details: &self.details };
        // Serializing plain strings and integers cannot fail.
        serde_json::to_string(&wire).unwrap_or_else(|_| format!("{{\"code\":{}}}", self.code))
    }
}

impl From<weft_proto::cni::v1::CniError> for CniError {
    fn from(e: weft_proto::cni::v1::CniError) -> Self {
        Self { code: e.code, msg: e.msg, details: e.details }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json_has_the_spec_fields() {
        let e = CniError::new(Code::InvalidEnv, "CNI_IFNAME is missing").with_details("set it");
        let v: serde_json::Value = serde_json::from_str(&e.to_json("1.1.0")).unwrap();
        assert_eq!(v["cniVersion"], "1.1.0");
        assert_eq!(v["code"], 4);
        assert_eq!(v["msg"], "CNI_IFNAME is missing");
        assert_eq!(v["details"], "set it");
    }

    #[test]
    fn empty_details_are_omitted() {
        let e = CniError::new(Code::TryAgainLater, "agent down");
        let v: serde_json::Value = serde_json::from_str(&e.to_json("1.0.0")).unwrap();
        assert!(v.get("details").is_none());
        assert_eq!(v["code"], 11);
    }
}
