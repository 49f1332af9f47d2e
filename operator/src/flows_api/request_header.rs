//! Who is asking: the apiserver forwards each request of the flows API over
//! its front-proxy client certificate, naming the caller in headers. The
//! CA, the certificate names it may carry and the header names are what the
//! apiserver publishes in `kube-system/extension-apiserver-authentication`.
//! Headers are believed only on a connection that presented such a
//! certificate; anyone else reaching the port is refused before HTTP.

use std::collections::BTreeMap;

use http::HeaderMap;

/// The ConfigMap's keys (as kube-apiserver writes them).
const CLIENT_CA: &str = "requestheader-client-ca-file";
const ALLOWED_NAMES: &str = "requestheader-allowed-names";
const USERNAME_HEADERS: &str = "requestheader-username-headers";
const GROUP_HEADERS: &str = "requestheader-group-headers";
const EXTRA_PREFIXES: &str = "requestheader-extra-headers-prefix";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestHeaderError {
    #[error(
        "the apiserver publishes no front-proxy CA ({CLIENT_CA} in kube-system/extension-apiserver-authentication): start kube-apiserver with --requestheader-client-ca-file and --proxy-client-cert-file"
    )]
    NoClientCa,
    #[error("{key} in kube-system/extension-apiserver-authentication is not a JSON list of strings: {detail}")]
    NotAList { key: &'static str, detail: String },
    #[error("the front-proxy certificate's name {0:?} is not one the apiserver allows")]
    NameNotAllowed(String),
    #[error("the request names no user")]
    NoUser,
    #[error("the request's {0} header is not text")]
    NotText(String),
}

/// What the apiserver published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeaderConfig {
    /// PEM.
    pub client_ca: String,
    /// Names the front-proxy certificate may carry (empty: any the CA signed).
    pub allowed_names: Vec<String>,
    pub username_headers: Vec<String>,
    pub group_headers: Vec<String>,
    pub extra_prefixes: Vec<String>,
}

fn list(data: &BTreeMap<String, String>, key: &'static str) -> Result<Vec<String>, RequestHeaderError> {
    match data.get(key).map(String::as_str) {
        None | Some("") => Ok(Vec::new()),
        Some(text) => serde_json::from_str::<Option<Vec<String>>>(text)
            .map(Option::unwrap_or_default)
            .map_err(|e| RequestHeaderError::NotAList { key, detail: e.to_string() }),
    }
}

impl RequestHeaderConfig {
    /// From the ConfigMap's data.
    pub fn from_data(data: &BTreeMap<String, String>) -> Result<Self, RequestHeaderError> {
        let client_ca = data.get(CLIENT_CA).filter(|c| !c.trim().is_empty()).ok_or(RequestHeaderError::NoClientCa)?;
        let lower = |v: Vec<String>| v.into_iter().map(|h| h.to_ascii_lowercase()).collect::<Vec<_>>();
        Ok(RequestHeaderConfig {
            client_ca: client_ca.clone(),
            allowed_names: list(data, ALLOWED_NAMES)?,
            username_headers: lower(list(data, USERNAME_HEADERS)?),
            group_headers: lower(list(data, GROUP_HEADERS)?),
            extra_prefixes: lower(list(data, EXTRA_PREFIXES)?),
        })
    }

    /// Refuses a certificate (already verified against the CA) whose
    /// common name the apiserver does not list.
    pub fn check_name(&self, common_name: &str) -> Result<(), RequestHeaderError> {
        if self.allowed_names.is_empty() || self.allowed_names.iter().any(|n| n == common_name) {
            Ok(())
        } else {
            Err(RequestHeaderError::NameNotAllowed(common_name.to_owned()))
        }
    }

    /// The caller the headers name.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Caller, RequestHeaderError> {
        let text = |name: &str, v: &http::HeaderValue| {
            v.to_str().map(str::to_owned).map_err(|_| RequestHeaderError::NotText(name.to_owned()))
        };
        let mut user = None;
        for h in &self.username_headers {
            if let Some(v) = headers.get(h.as_str()) {
                let v = text(h, v)?;
                if !v.is_empty() {
                    user = Some(v);
                    break;
                }
            }
        }
        let user = user.ok_or(RequestHeaderError::NoUser)?;
        let mut groups = Vec::new();
        for h in &self.group_headers {
            for v in headers.get_all(h.as_str()) {
                groups.push(text(h, v)?);
            }
        }
        let mut extra: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, v) in headers {
            for prefix in &self.extra_prefixes {
                if let Some(key) = name.as_str().strip_prefix(prefix.as_str()) {
                    extra.entry(unescape(key)).or_default().push(text(name.as_str(), v)?);
                }
            }
        }
        Ok(Caller { user, groups, extra })
    }
}

/// Extra keys travel percent-encoded in header names (as the apiserver
/// writes them); anything not decodable is kept as sent.
fn unescape(key: &str) -> String {
    let bytes = key.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| key.to_owned())
}

/// The user the apiserver authenticated.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Caller {
    pub user: String,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> BTreeMap<String, String> {
        [
            (CLIENT_CA, "-----BEGIN CERTIFICATE-----\n…"),
            (ALLOWED_NAMES, r#"["front-proxy-client"]"#),
            (USERNAME_HEADERS, r#"["X-Remote-User"]"#),
            (GROUP_HEADERS, r#"["X-Remote-Group"]"#),
            (EXTRA_PREFIXES, r#"["X-Remote-Extra-"]"#),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    #[test]
    fn the_caller_is_read_from_the_published_headers() {
        let config = RequestHeaderConfig::from_data(&data()).unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-remote-user", "alice".parse().unwrap());
        h.append("x-remote-group", "dev".parse().unwrap());
        h.append("x-remote-group", "system:authenticated".parse().unwrap());
        h.insert("x-remote-extra-scopes%2fa", "x".parse().unwrap());
        // Not one of the published headers: ignored.
        h.insert("x-user", "root".parse().unwrap());
        let c = config.caller(&h).unwrap();
        assert_eq!(c.user, "alice");
        assert_eq!(c.groups, ["dev", "system:authenticated"]);
        assert_eq!(c.extra["scopes/a"], ["x"]);
    }

    #[test]
    fn no_user_no_caller() {
        let config = RequestHeaderConfig::from_data(&data()).unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-remote-user", "".parse().unwrap());
        assert_eq!(config.caller(&h), Err(RequestHeaderError::NoUser));
    }

    #[test]
    fn only_listed_certificate_names_pass() {
        let config = RequestHeaderConfig::from_data(&data()).unwrap();
        config.check_name("front-proxy-client").unwrap();
        assert!(matches!(config.check_name("system:node:n1"), Err(RequestHeaderError::NameNotAllowed(_))));
        let mut any = data();
        any.remove(ALLOWED_NAMES);
        RequestHeaderConfig::from_data(&any).unwrap().check_name("whoever").unwrap();
    }

    #[test]
    fn an_apiserver_without_a_front_proxy_ca_is_named_as_the_problem() {
        let mut d = data();
        d.remove(CLIENT_CA);
        assert_eq!(RequestHeaderConfig::from_data(&d), Err(RequestHeaderError::NoClientCa));
        let mut d = data();
        d.insert(GROUP_HEADERS.into(), "X-Remote-Group".into());
        assert!(matches!(RequestHeaderConfig::from_data(&d), Err(RequestHeaderError::NotAList { .. })));
    }
}
