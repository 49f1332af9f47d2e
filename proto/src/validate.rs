//! The rules for what a container runtime passes in. weft-cni checks them
//! where the values enter (its environment) and the agent checks them again
//! where it decodes a request, since the socket is its own edge. Nothing
//! else may end up in a path, a firewall rule or a log line unchecked.
//!
//! Each check returns a message that names the variable and the rule.

/// The CNI spec's rule for container IDs and network names: a letter or
/// digit followed by letters, digits, `_`, `.` and `-`.
fn cni_name(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

const CNI_NAME_RULE: &str = "it must start with a letter or digit and contain only letters, digits, '_', '.' and '-'";

/// `CNI_CONTAINERID`.
pub fn container_id(id: &str) -> Result<(), String> {
    if cni_name(id) { Ok(()) } else { Err(format!("invalid CNI_CONTAINERID {id:?}: {CNI_NAME_RULE}")) }
}

/// The network configuration's `name`.
pub fn network_name(name: &str) -> Result<(), String> {
    if cni_name(name) { Ok(()) } else { Err(format!("invalid network name {name:?}: {CNI_NAME_RULE}")) }
}

/// `CNI_IFNAME`: a Linux interface name, at most 15 bytes, no `/`, `:` or
/// whitespace, not `.` or `..`.
pub fn ifname(name: &str) -> Result<(), String> {
    let bad = name.is_empty()
        || name.len() > 15
        || name == "."
        || name == ".."
        || name.chars().any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control());
    if bad {
        Err(format!(
            "invalid CNI_IFNAME {name:?}: an interface name has 1 to 15 characters and no '/', ':' or whitespace"
        ))
    } else {
        Ok(())
    }
}

/// Kubernetes' DNS-1123 label: namespaces.
fn dns1123_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Kubernetes' DNS-1123 subdomain: pod names.
fn dns1123_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(dns1123_label)
}

/// A namespace's name, as a user gives it (a DNS-1123 label).
pub fn namespace(s: &str) -> Result<(), String> {
    if dns1123_label(s) {
        Ok(())
    } else {
        Err(format!(
            "invalid namespace {s:?}: it must be a DNS-1123 label (1 to 63 lower-case letters, digits and '-', not starting or ending with '-')"
        ))
    }
}

/// A pod's name, as a user gives it (a DNS-1123 subdomain).
pub fn pod_name(s: &str) -> Result<(), String> {
    if dns1123_subdomain(s) {
        Ok(())
    } else {
        Err(format!(
            "invalid pod name {s:?}: it must be a DNS-1123 subdomain (lower-case letters, digits, '-' and '.')"
        ))
    }
}

/// The keys of `CNI_ARGS` that Kubernetes runtimes set, each checked when
/// present: `K8S_POD_NAMESPACE` (a DNS-1123 label), `K8S_POD_NAME` (a
/// DNS-1123 subdomain), `K8S_POD_UID` and `K8S_POD_INFRA_CONTAINER_ID`
/// (letters, digits and `-`, `_`, `.`). Other keys are passed on unread.
pub fn k8s_args<'a>(args: impl IntoIterator<Item = (&'a str, &'a str)>) -> Result<(), String> {
    for (key, value) in args {
        let (ok, rule) = match key {
            "K8S_POD_NAMESPACE" => (dns1123_label(value), "a DNS-1123 label (lower-case letters, digits, '-')"),
            "K8S_POD_NAME" => (dns1123_subdomain(value), "a DNS-1123 subdomain (lower-case letters, digits, '-', '.')"),
            "K8S_POD_UID" | "K8S_POD_INFRA_CONTAINER_ID" => (
                value.len() <= 128 && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')),
                "at most 128 letters, digits, '-', '_' and '.'",
            ),
            _ => continue,
        };
        if !ok {
            return Err(format!("invalid {key} {value:?} in CNI_ARGS: it must be {rule}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_follow_the_cni_rule() {
        assert!(container_id("abc123").is_ok());
        assert!(container_id("a_b.c-d").is_ok());
        for bad in ["", "../etc", "-a", "a b", "a\"b", "a\nb"] {
            assert!(container_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn interface_names_fit_linux() {
        assert!(ifname("eth0").is_ok());
        for bad in ["", ".", "..", "a/b", "a:b", "a b", "a-very-long-interface-name"] {
            assert!(ifname(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn kubernetes_names_follow_dns_1123() {
        let ok = |k: &str, v: &str| k8s_args([(k, v)]).is_ok();
        assert!(ok("K8S_POD_NAMESPACE", "kube-system"));
        assert!(ok("K8S_POD_NAME", "web-0.abc"));
        assert!(ok("K8S_POD_UID", "2f0d2c1e-8a31-4b7e-9a4f-0e4c7e9b1a22"));
        assert!(ok("IgnoreUnknown", "anything \" goes"));
        assert!(!ok("K8S_POD_NAMESPACE", "Default"));
        assert!(!ok("K8S_POD_NAMESPACE", &"a".repeat(64)));
        assert!(ok("K8S_POD_NAME", &format!("{}.{}", "a".repeat(63), "b".repeat(63))));
        assert!(!ok("K8S_POD_NAME", &"a.".repeat(127)));
        let err = k8s_args([("K8S_POD_NAME", "web\"\n-A INPUT -j ACCEPT")]).expect_err("quote and newline");
        assert!(err.contains("K8S_POD_NAME") && err.contains("DNS-1123"), "{err}");
        assert!(!ok("K8S_POD_UID", "a;b"));
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Whatever a runtime passes: no panic, and what is accepted can
            /// go into a path, a rule or a log line as it is.
            #[test]
            fn accepted_values_carry_no_separator_quote_or_control_character(s in "\\PC{0,80}|[a-zA-Z0-9_.:/ '\"-]{0,20}") {
                let safe = |v: &str| v.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
                if container_id(&s).is_ok() || network_name(&s).is_ok() {
                    prop_assert!(safe(&s) && !s.is_empty(), "{:?}", s);
                }
                if ifname(&s).is_ok() {
                    prop_assert!(!s.contains('/') && s.len() <= 15 && s != "." && s != "..", "{:?}", s);
                }
                for key in ["K8S_POD_NAMESPACE", "K8S_POD_NAME", "K8S_POD_UID"] {
                    if k8s_args([(key, s.as_str())]).is_ok() {
                        prop_assert!(safe(&s), "{} {:?}", key, s);
                    } else {
                        prop_assert!(k8s_args([(key, s.as_str())]).unwrap_err().contains(key));
                    }
                }
            }
        }
    }
}
