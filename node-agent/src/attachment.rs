//! How a pod's host veth joins the node: plugged into the bridge, or routed.
//!
//! - `bridge` (the default): host veths are ports of `weft0`, which carries
//!   the gateway address; pods share the pod CIDR as one L2 segment.
//! - `routed`: host veths have no master. Each pod gets its address as a /32
//!   and a default route via the gateway (on-link); the node routes to it
//!   with a /32 route on its host veth. Both ends know each other's MAC from
//!   the start (permanent neighbour entries), so nothing depends on ARP
//!   settings of the node. It saves the bridge hop at both ends of every
//!   packet; `weft0` stays, holding the gateway address.
//!
//! Each IPAM record keeps the mode its pod was attached with, so CHECK and
//! start-up adoption judge a pod by how it was made. What each mode does is
//! its driver's (`attach::bridge`, `attach::routed`).

use std::fmt;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Attachment {
    #[default]
    Bridge,
    Routed,
}

impl Attachment {
    pub fn is_bridge(&self) -> bool {
        *self == Attachment::Bridge
    }
}

impl fmt::Display for Attachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Attachment::Bridge => "bridge",
            Attachment::Routed => "routed",
        })
    }
}

/// The mode new pods get. A bridged pod on the pod CIDR's shared segment
/// ARPs for its neighbours directly, and a routed pod is not on that segment:
/// the two cannot reach each other on one node. So while pods of the other
/// mode still run here, new pods join them, and the configured mode takes
/// effect when the agent starts on a node without them (drain, then restart
/// the agent).
pub fn effective(configured: Attachment, existing: impl IntoIterator<Item = Attachment>) -> Attachment {
    existing.into_iter().find(|a| *a != configured).unwrap_or(configured)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_mode_applies_unless_pods_of_the_other_run() {
        use Attachment::*;
        assert_eq!(effective(Routed, []), Routed);
        assert_eq!(effective(Routed, [Routed, Routed]), Routed);
        assert_eq!(effective(Routed, [Routed, Bridge]), Bridge);
        assert_eq!(effective(Bridge, [Routed]), Routed);
        assert_eq!(effective(Bridge, [Bridge]), Bridge);
    }

    #[test]
    fn records_without_the_field_are_bridged() {
        #[derive(Deserialize)]
        struct R {
            #[serde(default)]
            attachment: Attachment,
        }
        let r: R = serde_json::from_str("{}").expect("json");
        assert_eq!(r.attachment, Attachment::Bridge);
        let r: R = serde_json::from_str(r#"{"attachment":"routed"}"#).expect("json");
        assert_eq!(r.attachment, Attachment::Routed);
    }
}
