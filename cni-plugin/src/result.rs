//! The ADD result on stdout, in the format of the requested spec version.

use serde_json::{Map, Value, json};
use weft_proto::cni::v1::CniResult;

use crate::error::{CniError, Code};
use crate::version::CniVersion;

/// Renders the agent's result as CNI JSON. When weft runs after another
/// plugin in a chain, its interfaces, IPs and routes are appended to the
/// prevResult (interface indices shifted) so nothing the earlier plugin
/// reported is lost.
pub fn render(
    result: &CniResult,
    version_str: &str,
    version: CniVersion,
    prev: Option<&Value>,
) -> Result<String, CniError> {
    let mut out = match prev {
        Some(Value::Object(p)) => p.clone(),
        Some(other) => {
            return Err(CniError::new(Code::InvalidConfig, format!("prevResult must be an object, got {other}")));
        }
        None => Map::new(),
    };
    out.insert("cniVersion".into(), json!(version_str));

    let interfaces = array(&mut out, "interfaces")?;
    let offset = interfaces.len() as i64;
    for i in &result.interfaces {
        let mut o = Map::new();
        o.insert("name".into(), json!(i.name));
        if !i.mac.is_empty() {
            o.insert("mac".into(), json!(i.mac));
        }
        if i.mtu > 0 && version >= CniVersion::V1_1_0 {
            o.insert("mtu".into(), json!(i.mtu));
        }
        if !i.sandbox.is_empty() {
            o.insert("sandbox".into(), json!(i.sandbox));
        }
        interfaces.push(Value::Object(o));
    }

    let ips = array(&mut out, "ips")?;
    for ip in &result.ips {
        let mut o = Map::new();
        if version < CniVersion::V1_0_0 {
            // 0.3.x and 0.4.0 carry the IP family explicitly.
            o.insert("version".into(), json!(if ip.address.contains(':') { "6" } else { "4" }));
        }
        o.insert("address".into(), json!(ip.address));
        if !ip.gateway.is_empty() {
            o.insert("gateway".into(), json!(ip.gateway));
        }
        if ip.interface >= 0 {
            o.insert("interface".into(), json!(offset + i64::from(ip.interface)));
        }
        ips.push(Value::Object(o));
    }

    let routes = array(&mut out, "routes")?;
    for r in &result.routes {
        let mut o = Map::new();
        o.insert("dst".into(), json!(r.dst));
        if !r.gw.is_empty() {
            o.insert("gw".into(), json!(r.gw));
        }
        routes.push(Value::Object(o));
    }

    if let Some(dns) = &result.dns {
        let empty =
            dns.nameservers.is_empty() && dns.domain.is_empty() && dns.search.is_empty() && dns.options.is_empty();
        if !empty || !out.contains_key("dns") {
            let mut o = Map::new();
            if !dns.nameservers.is_empty() {
                o.insert("nameservers".into(), json!(dns.nameservers));
            }
            if !dns.domain.is_empty() {
                o.insert("domain".into(), json!(dns.domain));
            }
            if !dns.search.is_empty() {
                o.insert("search".into(), json!(dns.search));
            }
            if !dns.options.is_empty() {
                o.insert("options".into(), json!(dns.options));
            }
            out.insert("dns".into(), Value::Object(o));
        }
    }
    Ok(Value::Object(out).to_string())
}

fn array<'a>(obj: &'a mut Map<String, Value>, key: &str) -> Result<&'a mut Vec<Value>, CniError> {
    match obj.entry(key).or_insert_with(|| Value::Array(Vec::new())) {
        Value::Array(a) => Ok(a),
        other => Err(CniError::new(Code::InvalidConfig, format!("prevResult.{key} must be an array, got {other}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weft_proto::cni::v1::{Interface, IpConfig, Route};

    fn sample() -> CniResult {
        CniResult {
            interfaces: vec![
                Interface {
                    name: "weft1234".into(),
                    mac: "aa:bb:cc:dd:ee:01".into(),
                    mtu: 1450,
                    sandbox: String::new(),
                },
                Interface {
                    name: "eth0".into(),
                    mac: "aa:bb:cc:dd:ee:02".into(),
                    mtu: 1450,
                    sandbox: "/var/run/netns/p".into(),
                },
            ],
            ips: vec![IpConfig { address: "10.244.1.5/24".into(), gateway: "10.244.1.1".into(), interface: 1 }],
            routes: vec![Route { dst: "0.0.0.0/0".into(), gw: "10.244.1.1".into() }],
            dns: None,
        }
    }

    #[test]
    fn renders_1_1_with_mtu_and_no_ip_version() {
        let v: Value = serde_json::from_str(&render(&sample(), "1.1.0", CniVersion::V1_1_0, None).unwrap()).unwrap();
        assert_eq!(v["cniVersion"], "1.1.0");
        assert_eq!(v["interfaces"][1]["sandbox"], "/var/run/netns/p");
        assert_eq!(v["interfaces"][1]["mtu"], 1450);
        assert_eq!(v["ips"][0]["interface"], 1);
        assert!(v["ips"][0].get("version").is_none());
        assert_eq!(v["routes"][0]["gw"], "10.244.1.1");
    }

    #[test]
    fn renders_0_3_1_with_ip_version() {
        let v: Value = serde_json::from_str(&render(&sample(), "0.3.1", CniVersion::V0_3_1, None).unwrap()).unwrap();
        assert_eq!(v["ips"][0]["version"], "4");
        assert!(v["interfaces"][1].get("mtu").is_none());
    }

    #[test]
    fn appends_to_prev_result_with_shifted_indices() {
        let prev = json!({"cniVersion":"1.1.0","interfaces":[{"name":"other0"}],"ips":[{"address":"192.0.2.2/24","interface":0}],"dns":{"nameservers":["192.0.2.53"]}});
        let v: Value =
            serde_json::from_str(&render(&sample(), "1.1.0", CniVersion::V1_1_0, Some(&prev)).unwrap()).unwrap();
        assert_eq!(v["interfaces"].as_array().unwrap().len(), 3);
        assert_eq!(v["ips"][0]["address"], "192.0.2.2/24");
        assert_eq!(v["ips"][1]["interface"], 2);
        assert_eq!(v["dns"]["nameservers"][0], "192.0.2.53");
    }
}
