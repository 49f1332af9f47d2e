//! Parsing of the CNI environment and the network configuration on stdin into
//! one typed [`Command`]. No I/O happens here: the environment is behind the
//! [`EnvSource`] seam so all of it is unit-tested without exec.

use std::collections::BTreeMap;

use serde::Deserialize;
use weft_proto::validate;

use crate::error::{CniError, Code};
use crate::version::{self, CniVersion};

/// Where CNI_* variables come from: the process, or a map in tests.
pub trait EnvSource {
    fn var(&self, key: &str) -> Option<String>;
}

/// The real process environment.
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn var(&self, key: &str) -> Option<String> {
        self.get(key).cloned()
    }
}

/// The keys of the network configuration that weft-cni itself reads. The raw
/// bytes are forwarded to the agent as well, so plugin-specific keys need not
/// be listed here.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetConf {
    pub cni_version: String,
    pub name: String,
    /// Required by the spec; the runtime used it to find this binary.
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The agent's Unix socket; defaults to [`weft_proto::DEFAULT_AGENT_SOCKET`].
    #[serde(default)]
    pub agent_socket: Option<String>,
    /// MTU for pod interfaces; the agent's own default when absent.
    #[serde(default)]
    pub mtu: Option<u32>,
    #[serde(default)]
    pub prev_result: Option<serde_json::Value>,
    /// GC: attachments to keep (CNI 1.1 key, and the older draft key).
    #[serde(default, rename = "cni.dev/valid-attachments")]
    pub valid_attachments: Option<Vec<Attachment>>,
    #[serde(default, rename = "cni.dev/attachments")]
    pub legacy_attachments: Option<Vec<Attachment>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Attachment {
    #[serde(rename = "containerID")]
    pub container_id: String,
    pub ifname: String,
}

/// What a container verb needs besides the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Container {
    pub id: String,
    /// `None` only for DEL, where CNI_NETNS is optional.
    pub netns: Option<String>,
    pub ifname: String,
    /// CNI_ARGS as key/value pairs.
    pub args: BTreeMap<String, String>,
}

/// One CNI invocation, fully validated.
#[derive(Debug, Clone)]
pub enum Command {
    Add(Invocation),
    Del(Invocation),
    Check(Invocation),
    Status(ConfOnly),
    Gc(ConfOnly),
    Version { requested: Option<String> },
}

#[derive(Debug, Clone)]
pub struct Invocation {
    pub container: Container,
    pub conf: NetConf,
    pub version: CniVersion,
    /// The configuration exactly as received.
    pub raw: Vec<u8>,
}

#[derive(Debug, Clone)]
pub struct ConfOnly {
    pub conf: NetConf,
    pub raw: Vec<u8>,
}

impl Command {
    /// The cniVersion to put on an error object for this command.
    pub fn version_str(&self) -> &str {
        match self {
            Command::Add(i) | Command::Del(i) | Command::Check(i) => &i.conf.cni_version,
            Command::Status(c) | Command::Gc(c) => &c.conf.cni_version,
            Command::Version { .. } => version::LATEST,
        }
    }
}

/// Parses the invocation. Errors carry the spec's code and name the problem.
pub fn parse(env: &impl EnvSource, stdin: &[u8]) -> Result<Command, CniError> {
    let verb = required(env, "CNI_COMMAND")?;
    match verb.as_str() {
        "VERSION" => {
            // The requested version is informational; VERSION never fails on config.
            let requested = serde_json::from_slice::<serde_json::Value>(stdin)
                .ok()
                .and_then(|v| v.get("cniVersion").and_then(|s| s.as_str()).map(str::to_owned));
            Ok(Command::Version { requested })
        }
        "ADD" | "DEL" | "CHECK" => {
            let (conf, version) = parse_conf(stdin)?;
            let netns = if verb == "DEL" { optional(env, "CNI_NETNS") } else { Some(required(env, "CNI_NETNS")?) };
            let container = Container { id: container_id(env)?, netns, ifname: ifname(env)?, args: cni_args(env)? };
            if verb == "CHECK" && version < CniVersion::V0_4_0 {
                return Err(verb_too_new("CHECK", &conf.cni_version, "0.4.0"));
            }
            let inv = Invocation { container, conf, version, raw: stdin.to_vec() };
            Ok(match verb.as_str() {
                "ADD" => Command::Add(inv),
                "DEL" => Command::Del(inv),
                _ => Command::Check(inv),
            })
        }
        "STATUS" | "GC" => {
            let (conf, version) = parse_conf(stdin)?;
            if version < CniVersion::V1_1_0 {
                return Err(verb_too_new(&verb, &conf.cni_version, "1.1.0"));
            }
            let c = ConfOnly { conf, raw: stdin.to_vec() };
            Ok(if verb == "STATUS" { Command::Status(c) } else { Command::Gc(c) })
        }
        other => Err(CniError::new(Code::InvalidEnv, format!("unknown CNI_COMMAND {other:?}"))
            .with_details("expected one of ADD, DEL, CHECK, STATUS, GC, VERSION")),
    }
}

fn verb_too_new(verb: &str, have: &str, need: &str) -> CniError {
    CniError::new(
        Code::IncompatibleVersion,
        format!("{verb} needs cniVersion {need} or newer; the configuration says {have}"),
    )
}

fn parse_conf(stdin: &[u8]) -> Result<(NetConf, CniVersion), CniError> {
    if stdin.iter().all(u8::is_ascii_whitespace) {
        return Err(CniError::new(Code::Decode, "no network configuration on stdin"));
    }
    let value: serde_json::Value = serde_json::from_slice(stdin)
        .map_err(|e| CniError::new(Code::Decode, format!("network configuration on stdin is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(CniError::new(Code::InvalidConfig, "network configuration must be a JSON object"));
    }
    // cniVersion first, so that an unknown version is reported as such even
    // when other keys are also off.
    let version_str = match value.get("cniVersion") {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(CniError::new(Code::InvalidConfig, format!("cniVersion must be a string, got {other}")));
        }
        None => {
            return Err(CniError::new(Code::InvalidConfig, "network configuration has no cniVersion"));
        }
    };
    let version = CniVersion::parse(&version_str).ok_or_else(|| {
        CniError::new(Code::IncompatibleVersion, format!("incompatible CNI version {version_str:?}"))
            .with_details(format!("weft-cni supports {}", version::SUPPORTED.join(", ")))
    })?;
    let conf: NetConf = serde_json::from_value(value)
        .map_err(|e| CniError::new(Code::InvalidConfig, format!("invalid network configuration: {e}")))?;
    validate::network_name(&conf.name).map_err(|msg| CniError::new(Code::InvalidConfig, msg))?;
    if conf.plugin_type.is_empty() {
        return Err(CniError::new(Code::InvalidConfig, "network configuration has an empty type"));
    }
    if conf.mtu.is_some_and(|m| !(68..=65535).contains(&m)) {
        return Err(CniError::new(
            Code::InvalidConfig,
            format!("mtu {} is out of range 68-65535", conf.mtu.unwrap_or(0)),
        ));
    }
    Ok((conf, version))
}

fn required(env: &impl EnvSource, key: &str) -> Result<String, CniError> {
    match env.var(key) {
        Some(v) if !v.is_empty() => Ok(v),
        _ => Err(CniError::new(Code::InvalidEnv, format!("required environment variable {key} is missing or empty"))),
    }
}

fn optional(env: &impl EnvSource, key: &str) -> Option<String> {
    env.var(key).filter(|v| !v.is_empty())
}

fn container_id(env: &impl EnvSource) -> Result<String, CniError> {
    let id = required(env, "CNI_CONTAINERID")?;
    validate::container_id(&id).map_err(|msg| CniError::new(Code::InvalidEnv, msg))?;
    Ok(id)
}

fn ifname(env: &impl EnvSource) -> Result<String, CniError> {
    let name = required(env, "CNI_IFNAME")?;
    validate::ifname(&name).map_err(|msg| CniError::new(Code::InvalidEnv, msg))?;
    Ok(name)
}

/// CNI_ARGS is `K1=V1;K2=V2`.
fn cni_args(env: &impl EnvSource) -> Result<BTreeMap<String, String>, CniError> {
    let mut out = BTreeMap::new();
    let Some(raw) = optional(env, "CNI_ARGS") else {
        return Ok(out);
    };
    for pair in raw.split(';').filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| CniError::new(Code::InvalidEnv, format!("CNI_ARGS entry {pair:?} is not KEY=VALUE")))?;
        out.insert(k.to_owned(), v.to_owned());
    }
    // The pod's names end up in rule comments and Events: refuse what is not a name.
    validate::k8s_args(out.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .map_err(|msg| CniError::new(Code::InvalidEnv, msg))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONF: &str = r#"{"cniVersion":"1.1.0","name":"weft","type":"weft-cni"}"#;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    fn add_env() -> BTreeMap<String, String> {
        env(&[
            ("CNI_COMMAND", "ADD"),
            ("CNI_CONTAINERID", "abc123"),
            ("CNI_NETNS", "/var/run/netns/x"),
            ("CNI_IFNAME", "eth0"),
            ("CNI_ARGS", "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;IgnoreUnknown=1"),
        ])
    }

    fn code_of(r: Result<Command, CniError>) -> u32 {
        r.expect_err("expected an error").code
    }

    #[test]
    fn add_parses_env_and_args() {
        let Command::Add(inv) = parse(&add_env(), CONF.as_bytes()).unwrap() else { panic!("not ADD") };
        assert_eq!(inv.container.id, "abc123");
        assert_eq!(inv.container.ifname, "eth0");
        assert_eq!(inv.container.args["K8S_POD_NAME"], "web-0");
        assert_eq!(inv.version, CniVersion::V1_1_0);
    }

    #[test]
    fn del_without_netns_is_fine_but_add_needs_it() {
        let mut e = add_env();
        e.remove("CNI_NETNS");
        assert_eq!(code_of(parse(&e, CONF.as_bytes())), 4);
        e.insert("CNI_COMMAND".into(), "DEL".into());
        let Command::Del(inv) = parse(&e, CONF.as_bytes()).unwrap() else { panic!("not DEL") };
        assert_eq!(inv.container.netns, None);
    }

    #[test]
    fn missing_env_names_the_variable() {
        let mut e = add_env();
        e.remove("CNI_IFNAME");
        let err = parse(&e, CONF.as_bytes()).unwrap_err();
        assert_eq!(err.code, 4);
        assert!(err.msg.contains("CNI_IFNAME"), "{}", err.msg);
    }

    #[test]
    fn bad_ifname_and_container_id_are_invalid_env() {
        let mut e = add_env();
        e.insert("CNI_IFNAME".into(), "a-very-long-interface-name".into());
        assert_eq!(code_of(parse(&e, CONF.as_bytes())), 4);
        let mut e = add_env();
        e.insert("CNI_CONTAINERID".into(), "../etc".into());
        assert_eq!(code_of(parse(&e, CONF.as_bytes())), 4);
    }

    #[test]
    fn a_pod_name_with_a_quote_and_a_newline_is_invalid_env() {
        let mut e = add_env();
        e.insert("CNI_ARGS".into(), "K8S_POD_NAMESPACE=default;K8S_POD_NAME=web\" -j ACCEPT\n-A X".into());
        let err = parse(&e, CONF.as_bytes()).unwrap_err();
        assert_eq!(err.code, 4);
        assert!(err.msg.contains("K8S_POD_NAME"), "{}", err.msg);
    }

    #[test]
    fn malformed_json_is_a_decode_failure() {
        let err = parse(&add_env(), b"{\"cniVersion\": ").unwrap_err();
        assert_eq!(err.code, 6);
        assert!(err.msg.contains("not valid JSON"), "{}", err.msg);
    }

    #[test]
    fn unknown_version_is_incompatible() {
        let err = parse(&add_env(), br#"{"cniVersion":"9.9.9","name":"weft","type":"weft-cni"}"#).unwrap_err();
        assert_eq!(err.code, 1);
        assert!(err.msg.contains("9.9.9"));
        assert!(err.details.contains("1.1.0"));
    }

    #[test]
    fn wrong_types_are_invalid_config_naming_the_field() {
        let err =
            parse(&add_env(), br#"{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","mtu":"big"}"#).unwrap_err();
        assert_eq!(err.code, 7);
        assert!(err.msg.contains("invalid type"), "{}", err.msg);
        let err = parse(&add_env(), br#"{"cniVersion":"1.1.0","type":"weft-cni"}"#).unwrap_err();
        assert_eq!(err.code, 7);
        assert!(err.msg.contains("name"), "{}", err.msg);
    }

    #[test]
    fn status_and_gc_need_1_1() {
        let e = env(&[("CNI_COMMAND", "STATUS")]);
        assert!(matches!(parse(&e, CONF.as_bytes()), Ok(Command::Status(_))));
        let old = br#"{"cniVersion":"1.0.0","name":"weft","type":"weft-cni"}"#;
        assert_eq!(code_of(parse(&e, old)), 1);
    }

    #[test]
    fn gc_reads_both_attachment_keys() {
        let e = env(&[("CNI_COMMAND", "GC")]);
        let conf = br#"{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","cni.dev/attachments":[{"containerID":"c1","ifname":"eth0"}]}"#;
        let Command::Gc(c) = parse(&e, conf).unwrap() else { panic!("not GC") };
        assert_eq!(c.conf.legacy_attachments.unwrap()[0].container_id, "c1");
    }

    #[test]
    fn version_needs_no_config() {
        let e = env(&[("CNI_COMMAND", "VERSION")]);
        assert!(matches!(parse(&e, b""), Ok(Command::Version { requested: None })));
    }

    #[test]
    fn unknown_command_is_invalid_env() {
        let e = env(&[("CNI_COMMAND", "FROB")]);
        assert_eq!(code_of(parse(&e, CONF.as_bytes())), 4);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        fn conf() -> impl Strategy<Value = Vec<u8>> {
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..200),
                ("[0-9.]{0,8}", "\\PC{0,20}", "\\PC{0,12}", prop::option::of(any::<i64>())).prop_map(
                    |(v, name, ty, mtu)| {
                        serde_json::json!({"cniVersion": v, "name": name, "type": ty, "mtu": mtu})
                            .to_string()
                            .into_bytes()
                    }
                ),
            ]
        }

        proptest! {
            /// Whatever the runtime's environment and stdin: no panic, an
            /// error has a spec code, and an accepted invocation's values
            /// pass the same checks the agent applies.
            #[test]
            fn any_invocation_parses_or_fails_with_a_code(
                verb in prop_oneof![Just("ADD".to_owned()), Just("DEL".to_owned()), Just("CHECK".to_owned()),
                                    Just("STATUS".to_owned()), Just("GC".to_owned()), Just("VERSION".to_owned()), "\\PC{0,8}"],
                id in "\\PC{0,20}|[a-z0-9]{1,12}",
                ifname_v in "\\PC{0,20}|eth[0-9]",
                args in "\\PC{0,60}|K8S_POD_NAME=[a-z.-]{0,10};K8S_POD_NAMESPACE=[a-z-]{0,8}",
                netns in "\\PC{0,20}",
                stdin in conf(),
            ) {
                let env: BTreeMap<String, String> = [
                    ("CNI_COMMAND", verb), ("CNI_CONTAINERID", id), ("CNI_IFNAME", ifname_v),
                    ("CNI_ARGS", args), ("CNI_NETNS", netns), ("CNI_PATH", "/opt/cni/bin".to_owned()),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect();
                match parse(&env, &stdin) {
                    Ok(Command::Add(i) | Command::Del(i) | Command::Check(i)) => {
                        prop_assert!(validate::container_id(&i.container.id).is_ok());
                        prop_assert!(validate::ifname(&i.container.ifname).is_ok());
                        prop_assert!(validate::network_name(&i.conf.name).is_ok());
                        let pairs: Vec<(&str, &str)> = i.container.args.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                        prop_assert!(validate::k8s_args(pairs).is_ok());
                    }
                    Ok(_) => {}
                    Err(e) => prop_assert!((1..=7).contains(&e.code) || e.code == 11, "code {} for {}", e.code, e.msg),
                }
            }
        }
    }
}
