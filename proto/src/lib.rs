//! The contract between `weft-cni` (client) and `weft-agent` (server).
//!
//! weft-cni stays thin: it parses the CNI environment and stdin into a
//! [`cni::v1::CniRequest`] and turns the reply back into CNI JSON. All decisions
//! are the agent's. `flows::v1` is the agent's flow records service.

pub mod flows_json;
pub mod unix;
pub mod validate;

pub mod cni {
    pub mod v1 {
        tonic::include_proto!("weft.cni.v1");
    }
}

pub mod flows {
    pub mod v1 {
        tonic::include_proto!("weft.flows.v1");
    }
}

/// Default path of the agent's Unix socket on a node.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/weft/agent.sock";

/// Error codes of the CNI specification 1.1 (1-99) and Weft's own (100+),
/// shared by the agent (which chooses them) and weft-cni (which prints them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ErrorCode {
    IncompatibleVersion = 1,
    UnsupportedField = 2,
    UnknownContainer = 3,
    InvalidEnv = 4,
    Io = 5,
    Decode = 6,
    InvalidConfig = 7,
    TryAgainLater = 11,
    NotAvailable = 50,
    LimitedResources = 51,
    /// Weft: an internal failure of the agent (dataplane, disk).
    Internal = 100,
    /// Weft: an ADD for a container+ifname that already has an attachment.
    AlreadyExists = 101,
    /// Weft: the node's pod address pool is exhausted.
    PoolExhausted = 102,
    /// Weft: CHECK found the attachment differs from what it should be.
    CheckFailed = 103,
    /// Weft: every port of the node's host port range is taken.
    HostPortsExhausted = 104,
    /// Weft: a requested host port is taken by another pod or a host process.
    HostPortConflict = 105,
}

impl ErrorCode {
    pub fn as_u32(self) -> u32 {
        self as u32
    }

    /// A wire error with this code.
    pub fn error(self, msg: impl Into<String>) -> cni::v1::CniError {
        cni::v1::CniError { code: self.as_u32(), msg: msg.into(), details: String::new() }
    }
}
