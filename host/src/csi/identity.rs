//! The CSI Identity service of one backend's driver.

use super::proto::csi::identity_server::Identity;
use super::proto::csi::*;
use crate::ops::Agent;
use std::sync::Arc;
use tonic::{Request, Response, Status};

pub struct IdentityService {
    pub agent: Arc<Agent>,
    pub backend: String,
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn get_plugin_info(
        &self,
        _req: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        let mut manifest =
            std::collections::HashMap::from([("backend".to_string(), self.backend.clone())]);
        // Which policy serves the driver now (it changes with a reload).
        if let Ok(plugin) = self.agent.plugin(&self.backend) {
            manifest.insert("policy-sha256".into(), plugin.sha256().to_string());
        }
        Ok(Response::new(GetPluginInfoResponse {
            name: super::driver_name(&self.backend),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest,
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _req: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        // A node plugin only: no controller service, and volumes are
        // reachable where their PVs' node affinity says.
        Ok(Response::new(GetPluginCapabilitiesResponse { capabilities: Vec::new() }))
    }

    async fn probe(&self, _req: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        match self.agent.plugin(&self.backend) {
            Ok(_) => Ok(Response::new(ProbeResponse { ready: Some(true) })),
            Err(f) => Err(Status::failed_precondition(f.message)),
        }
    }
}
