//! STATUS (and /readyz): ready when an ADD could succeed now.

use weft_proto::ErrorCode;
use weft_proto::cni::v1::CniError;

use crate::agent::Agent;

impl Agent {
    pub async fn readiness(&self) -> Result<(), CniError> {
        self.ensure_bridge(true)
            .await
            .map_err(|e| ErrorCode::NotAvailable.error(format!("the pod network is not set up: {}", e.msg)))?;
        let dir = self.config.state_dir.join("ipam");
        if !dir.is_dir() {
            return Err(ErrorCode::NotAvailable.error(format!("IPAM state directory {} is missing", dir.display())));
        }
        let (_, free) = self.ipam.usage();
        if free == 0 {
            return Err(
                ErrorCode::LimitedResources.error(format!("no free pod address left in {}", self.ipam.pool().cidr()))
            );
        }
        Ok(())
    }
}
