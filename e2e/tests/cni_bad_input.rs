//! Bad input to weft-cni: the documented error code and a message that names
//! the problem. No agent is needed: these fail before any request is sent.

use std::process::{Command, Stdio};

use serde_json::Value;
use std::io::Write;
use weft_e2e::bins;

fn run(env: &[(&str, &str)], stdin: &str) -> (bool, Value) {
    let mut child = Command::new(bins::weft("weft-cni"))
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("exec weft-cni");
    child.stdin.take().expect("stdin").write_all(stdin.as_bytes()).expect("write stdin");
    let out = child.wait_with_output().expect("weft-cni output");
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {:?}", String::from_utf8_lossy(&out.stdout)));
    (out.status.success(), v)
}

const ADD: &[(&str, &str)] =
    &[("CNI_COMMAND", "ADD"), ("CNI_CONTAINERID", "c1"), ("CNI_NETNS", "/run/netns/x"), ("CNI_IFNAME", "eth0")];
const CONF: &str = r#"{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","agentSocket":"/nonexistent/agent.sock"}"#;

fn expect(env: &[(&str, &str)], stdin: &str, code: u64, msg_part: &str) {
    let (ok, v) = run(env, stdin);
    assert!(!ok, "expected failure for {stdin}");
    assert_eq!(v["code"], code, "{v}");
    let msg = v["msg"].as_str().unwrap_or_default();
    assert!(msg.contains(msg_part), "message {msg:?} should mention {msg_part:?}");
    assert!(v["cniVersion"].is_string(), "{v}");
}

#[test]
fn malformed_json_is_code_6() {
    expect(ADD, "{\"cniVersion\":", 6, "not valid JSON");
    expect(ADD, "", 6, "no network configuration");
}

#[test]
fn missing_env_is_code_4_naming_the_variable() {
    for var in ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"] {
        let env: Vec<_> = ADD.iter().copied().filter(|(k, _)| *k != var).collect();
        expect(&env, CONF, 4, var);
    }
    expect(&[], CONF, 4, "CNI_COMMAND");
    expect(&[("CNI_COMMAND", "EXPLODE")], CONF, 4, "EXPLODE");
}

#[test]
fn unknown_version_is_code_1() {
    expect(ADD, r#"{"cniVersion":"7.0.0","name":"weft","type":"weft-cni"}"#, 1, "7.0.0");
}

#[test]
fn wrong_types_are_code_7_naming_the_field() {
    expect(ADD, r#"{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","mtu":"large"}"#, 7, "invalid type");
    expect(ADD, r#"{"cniVersion":"1.1.0","name":42,"type":"weft-cni"}"#, 7, "invalid type");
    expect(ADD, r#"{"cniVersion":"1.1.0","type":"weft-cni"}"#, 7, "name");
    expect(ADD, r#"{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","mtu":9}"#, 7, "mtu 9");
}

#[test]
fn error_output_uses_the_configured_version() {
    let (_, v) = run(&ADD[..1], r#"{"cniVersion":"1.0.0","name":"weft","type":"weft-cni"}"#);
    assert_eq!(v["cniVersion"], "1.0.0");
}

#[test]
fn version_is_answered_without_an_agent() {
    let (ok, v) = run(&[("CNI_COMMAND", "VERSION")], r#"{"cniVersion":"1.0.0"}"#);
    assert!(ok);
    assert_eq!(v["cniVersion"], "1.0.0");
    let supported: Vec<&str> = v["supportedVersions"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
    assert!(supported.contains(&"1.1.0") && supported.contains(&"0.4.0"), "{v}");
}

/// A hung agent (its socket accepts, nothing answers) fails STATUS with 50
/// within the STATUS timeout: containerd waits on STATUS for every status
/// query of kubelet's, and a slow answer makes the whole runtime look down.
#[test]
fn status_of_a_hung_agent_is_code_50_quickly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let socket = dir.path().join("agent.sock");
    // Bound and listening, never accepted: connections wait in the backlog.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).expect("bind socket");
    let conf =
        format!(r#"{{"cniVersion":"1.1.0","name":"weft","type":"weft-cni","agentSocket":"{}"}}"#, socket.display());
    let started = std::time::Instant::now();
    expect(&[("CNI_COMMAND", "STATUS")], &conf, 50, "did not");
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(12), "STATUS took {took:?}");
}
