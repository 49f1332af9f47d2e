//! Flow records as JSON: what `weft flows -o json` prints and what the
//! `flows.weft.dev` API returns (the fields of `weft.flows.v1.Flow` in
//! camelCase, enums by name), and back.

use serde_json::{Value, json};

use crate::flows::v1::{Endpoint, Event, Flow, Verdict};

pub fn event_name(e: i32) -> &'static str {
    match Event::try_from(e) {
        Ok(Event::Opened) => "opened",
        Ok(Event::Closed) => "closed",
        Ok(Event::Denied) => "denied",
        _ => "unspecified",
    }
}

pub fn verdict_name(v: i32) -> &'static str {
    match Verdict::try_from(v) {
        Ok(Verdict::Forwarded) => "forwarded",
        Ok(Verdict::Dropped) => "dropped",
        Ok(Verdict::Rejected) => "rejected",
        _ => "unspecified",
    }
}

fn event_of(name: &str) -> Event {
    match name {
        "opened" => Event::Opened,
        "closed" => Event::Closed,
        "denied" => Event::Denied,
        _ => Event::Unspecified,
    }
}

fn verdict_of(name: &str) -> Verdict {
    match name {
        "forwarded" => Verdict::Forwarded,
        "dropped" => Verdict::Dropped,
        "rejected" => Verdict::Rejected,
        _ => Verdict::Unspecified,
    }
}

fn endpoint_json(e: Option<&Endpoint>) -> Value {
    let e = e.cloned().unwrap_or_default();
    json!({"address": e.address, "port": e.port, "namespace": e.namespace, "pod": e.pod})
}

/// A record as JSON.
pub fn to_json(f: &Flow) -> Value {
    json!({
        "seq": f.seq,
        "timeUnixMs": f.time_unix_ms,
        "node": f.node,
        "event": event_name(f.event),
        "protocol": f.protocol,
        "source": endpoint_json(f.source.as_ref()),
        "destination": endpoint_json(f.destination.as_ref()),
        "verdict": verdict_name(f.verdict),
        "policy": f.policy,
        "direction": f.direction,
        "rule": f.rule,
        "packets": f.packets,
        "bytes": f.bytes,
    })
}

fn field<'a>(v: &'a Value, name: &str) -> Result<&'a Value, String> {
    v.get(name).ok_or_else(|| format!("a flow record has no {name:?}"))
}

fn u64_of(v: &Value, name: &str) -> Result<u64, String> {
    field(v, name)?.as_u64().ok_or_else(|| format!("a flow record's {name:?} is not a count"))
}

fn u32_of(v: &Value, name: &str) -> Result<u32, String> {
    u32::try_from(u64_of(v, name)?).map_err(|_| format!("a flow record's {name:?} is out of range"))
}

fn str_of(v: &Value, name: &str) -> Result<String, String> {
    Ok(field(v, name)?.as_str().ok_or_else(|| format!("a flow record's {name:?} is not text"))?.to_owned())
}

fn endpoint_of(v: &Value) -> Result<Endpoint, String> {
    Ok(Endpoint {
        address: str_of(v, "address")?,
        port: u32_of(v, "port")?,
        namespace: str_of(v, "namespace")?,
        pod: str_of(v, "pod")?,
    })
}

/// A record from its JSON ([`to_json`]'s shape).
pub fn from_json(v: &Value) -> Result<Flow, String> {
    let rule = field(v, "rule")?.as_i64().ok_or("a flow record's \"rule\" is not a number")?;
    Ok(Flow {
        seq: u64_of(v, "seq")?,
        time_unix_ms: u64_of(v, "timeUnixMs")?,
        node: str_of(v, "node")?,
        event: event_of(&str_of(v, "event")?) as i32,
        protocol: u32_of(v, "protocol")?,
        source: Some(endpoint_of(field(v, "source")?)?),
        destination: Some(endpoint_of(field(v, "destination")?)?),
        verdict: verdict_of(&str_of(v, "verdict")?) as i32,
        policy: str_of(v, "policy")?,
        direction: str_of(v, "direction")?,
        rule: i32::try_from(rule).map_err(|_| "a flow record's \"rule\" is out of range")?,
        packets: u64_of(v, "packets")?,
        bytes: u64_of(v, "bytes")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_survives_json_both_ways() {
        let end = |address: &str, port, ns: &str, pod: &str| Endpoint {
            address: address.into(),
            port,
            namespace: ns.into(),
            pod: pod.into(),
        };
        let f = Flow {
            seq: 3,
            time_unix_ms: 1000,
            node: "n1".into(),
            event: Event::Denied as i32,
            protocol: 6,
            source: Some(end("10.0.1.3", 40000, "dev", "client")),
            destination: Some(end("10.0.2.7", 80, "prod", "db")),
            verdict: Verdict::Rejected as i32,
            policy: "prod/db".into(),
            direction: "ingress".into(),
            rule: -1,
            packets: 1,
            bytes: 0,
        };
        let v = to_json(&f);
        assert_eq!(v["verdict"], "rejected");
        assert_eq!(v["destination"]["pod"], "db");
        assert_eq!(from_json(&v).unwrap(), f);
    }

    #[test]
    fn a_record_missing_a_field_is_refused_by_name() {
        let mut v = to_json(&Flow::default());
        v.as_object_mut().unwrap().remove("timeUnixMs");
        assert!(from_json(&v).unwrap_err().contains("timeUnixMs"));
        let mut v = to_json(&Flow::default());
        v["rule"] = json!(1u64 << 40);
        assert!(from_json(&v).unwrap_err().contains("out of range"));
    }
}
