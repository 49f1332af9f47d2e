//! `flows.weft.dev`: every node's flow records through the Kubernetes API,
//! as the caller may read them. The apiserver authenticates the caller,
//! authorizes `list` on `flows` in the namespace asked for (RBAC, like any
//! resource: the chart's reader role joins `view`), and forwards the request
//! here over its front-proxy certificate; the operator checks that
//! certificate, asks the apiserver again whether this caller may (a
//! SubjectAccessReview, as every aggregated server does), then gathers the
//! agents' records of that namespace only.

pub mod agents;
pub mod request_header;
pub mod routes;
mod server;

pub use server::{Settings, run};
