//! kubelet's plugin-registration service for one driver: kubelet's plugin
//! watcher finds the socket in `plugins_registry`, asks what it is and
//! where the driver listens, and says whether it registered it.

use super::proto::registration::registration_server::Registration;
use super::proto::registration::*;
use std::sync::{Arc, Mutex};
use tonic::{Request, Response, Status};

/// What kubelet last said of a driver's registration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Registered {
    #[default]
    NotYet,
    Yes,
    Refused(String),
}

pub struct RegistrationService {
    pub driver: String,
    /// The driver's socket as kubelet reaches it.
    pub endpoint: String,
    pub state: Arc<Mutex<Registered>>,
}

#[tonic::async_trait]
impl Registration for RegistrationService {
    async fn get_info(&self, _req: Request<InfoRequest>) -> Result<Response<PluginInfo>, Status> {
        Ok(Response::new(PluginInfo {
            r#type: "CSIPlugin".into(),
            name: self.driver.clone(),
            endpoint: self.endpoint.clone(),
            supported_versions: super::SUPPORTED_VERSIONS.iter().map(|v| v.to_string()).collect(),
        }))
    }

    async fn notify_registration_status(
        &self,
        req: Request<RegistrationStatus>,
    ) -> Result<Response<RegistrationStatusResponse>, Status> {
        let r = req.into_inner();
        let state = if r.plugin_registered {
            tracing::info!(driver = %self.driver, "kubelet registered the CSI driver");
            Registered::Yes
        } else {
            let error = crate::text::bounded(r.error, 1024);
            tracing::error!(driver = %self.driver, "kubelet did not register the CSI driver: {error}");
            Registered::Refused(error)
        };
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = state;
        Ok(Response::new(RegistrationStatusResponse {}))
    }
}
