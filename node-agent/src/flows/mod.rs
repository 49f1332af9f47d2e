//! Flow records of this node's pods (`--flows-capacity`): one when a
//! connection of a local pod opens and when it closes (the kernel's
//! connection tracking events, with its counters) and one per packet policy
//! denies (the policy drop log's NFLOG records), each naming both ends' pods
//! and the policy and rule that decided it. Kept in a bounded ring, served
//! over gRPC (`weft.flows.v1.Flows`) on the agent's socket, counted in the
//! metrics.
//!
//! `ring` holds the records, `annotate` turns kernel events into records
//! (pure), `recorder` reads the kernel, `service` serves the records,
//! `metrics` counts them. `remote` serves them over TCP to the operator
//! (`--flows-listen`), whose token `token_review` checks.

pub mod annotate;
pub mod metrics;
pub mod recorder;
pub mod remote;
pub mod ring;
pub mod service;
pub mod token_review;
