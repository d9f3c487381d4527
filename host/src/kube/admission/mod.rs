//! The controller's validating admission webhook: node restriction for
//! volagent's own objects. The API server asks it about every write to
//! Attachments, NodeCleanups, NodeLocalVolumes and FenceRequests
//! (`deploy/admission-webhook.yaml`, failurePolicy Fail); writes by anyone
//! but the agents' ServiceAccount are allowed here (RBAC governs them), an
//! agent's only when [`rules`] allow them for the node its token's pod runs
//! on ([`caller`]). The webhook serves TLS with a CA of its own
//! ([`certs`]), which it puts into its configuration's `caBundle`.

pub mod caller;
pub mod certs;
pub mod rules;

use anyhow::Context;
use caller::{AgentAccount, Callers};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, DynamicObject};
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The path the webhook configuration names.
pub const PATH: &str = "/validate";
/// An AdmissionReview carries the old and the new object (each at most the
/// API server's 3 MiB): anything larger is not one.
const MAX_BODY: usize = 8 << 20;
const MAX_CONNECTIONS: usize = 64;
/// How often the serving certificate is checked for renewal.
const RENEW_EVERY: Duration = Duration::from_secs(3600);

#[derive(Debug, Clone)]
pub struct WebhookConfig {
    pub addr: SocketAddr,
    /// Where the TLS Secret lives: the controller's own namespace.
    pub namespace: String,
    pub secret: String,
    /// The names the serving certificate carries: the Service's DNS names,
    /// or an address a `url` webhook configuration names.
    pub names: Vec<String>,
    /// The ValidatingWebhookConfiguration whose `caBundle` is ours.
    pub configuration: String,
    pub agent: AgentAccount,
}

impl WebhookConfig {
    /// The DNS names of Service `service` in `namespace`, as the API server
    /// calls it.
    pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
        vec![
            format!("{service}.{namespace}.svc"),
            format!("{service}.{namespace}.svc.cluster.local"),
            format!("{service}.{namespace}"),
        ]
    }
}

/// Reviews agents' writes.
pub struct Webhook {
    client: kube::Client,
    callers: Callers,
}

impl Webhook {
    pub fn new(client: kube::Client, agent: AgentAccount) -> Webhook {
        Webhook { callers: Callers::new(client.clone(), agent), client }
    }

    /// The answer to one request.
    pub async fn review(&self, request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
        let response = AdmissionResponse::from(request);
        let Some(kind) = rules::Kind::of(&request.resource.group, &request.resource.resource)
        else {
            return response;
        };
        let node = match self.callers.node_of(&request.user_info).await {
            Ok(None) => return response,
            Ok(Some(node)) => node,
            Err(why) => {
                return denied(response, &request.resource.resource, &request.name, "?", why);
            }
        };
        let (old, new) =
            (request.old_object.as_ref().map(to_value), request.object.as_ref().map(to_value));
        let change = rules::Change {
            kind,
            operation: match request.operation {
                Operation::Create => rules::Operation::Create,
                Operation::Update => rules::Operation::Update,
                Operation::Delete => rules::Operation::Delete,
                Operation::Connect => rules::Operation::Connect,
            },
            sub_resource: request.sub_resource.as_deref(),
            name: &request.name,
            old: old.as_ref(),
            new: new.as_ref(),
        };
        let mut gone = std::collections::BTreeSet::new();
        for other in rules::nodes_to_check(&node, &change) {
            match Api::<Node>::all(self.client.clone()).get_opt(&other).await {
                Ok(found) if is_gone(found.as_ref()) => {
                    gone.insert(other);
                }
                Ok(_) => {}
                Err(e) => {
                    let why = format!("cannot tell whether node {other} is gone: {e}");
                    return denied(response, &request.resource.resource, &request.name, &node, why);
                }
            }
        }
        match rules::review(&node, &change, &|n: &str| gone.contains(n)) {
            Ok(()) => {
                crate::metrics::get().agent_write(&request.resource.resource, true);
                response
            }
            Err(why) => denied(response, &request.resource.resource, &request.name, &node, why),
        }
    }
}

fn to_value(o: &DynamicObject) -> serde_json::Value {
    serde_json::to_value(o).unwrap_or_default()
}

/// No Node object, or tainted out-of-service: what a take-over needs.
fn is_gone(node: Option<&Node>) -> bool {
    let facts = crate::kube::cluster::facts_of("", node);
    !facts.exists || facts.out_of_service
}

fn denied(
    response: AdmissionResponse,
    resource: &str,
    name: &str,
    node: &str,
    why: String,
) -> AdmissionResponse {
    crate::metrics::get().agent_write(resource, false);
    tracing::warn!(resource, name, node, "refused an agent's write: {why}");
    let mut response = response.deny(why);
    // Forbidden, as RBAC says it (the API server's default would be 400).
    response.result.code = 403;
    response.result.reason = "Forbidden".into();
    response
}

/// What a serving replica reports for its readiness.
#[derive(Default)]
pub struct Serving {
    /// Listening with its certificate, and its CA published.
    pub ready: AtomicBool,
}

/// Serve the webhook on `config.addr` until cancelled. The listener is
/// bound first (a taken port fails the start); certificates and the
/// `caBundle` are retried while the API server cannot be reached.
pub async fn run(
    client: kube::Client,
    config: WebhookConfig,
    serving: Arc<Serving>,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .with_context(|| format!("admission webhook {}", config.addr))?;
    let material = loop {
        match certs::ensure(&client, &config.namespace, &config.secret, &config.names).await {
            Ok(m) => break m,
            Err(e) => {
                tracing::error!("admission webhook: {e} (retrying)");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    };
    let tls = Arc::new(RwLock::new(certs::server_config(&material).map_err(anyhow::Error::msg)?));
    tokio::spawn(maintain(client.clone(), config.clone(), material, tls.clone(), serving.clone()));
    let webhook = Arc::new(Webhook::new(client, config.agent.clone()));
    tracing::info!(addr = %config.addr, agent = %config.agent.username(), "admission webhook serving");
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut pause = crate::listener::AcceptPause::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                pause.reset();
                stream
            }
            Err(e) => {
                pause.wait("admission webhook", &e).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else { continue };
        let acceptor =
            tokio_rustls::TlsAcceptor::from(tls.read().unwrap_or_else(|e| e.into_inner()).clone());
        let webhook = webhook.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let Ok(Ok(stream)) =
                tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await
            else {
                return;
            };
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let webhook = webhook.clone();
                async move { Ok::<_, std::convert::Infallible>(handle(&webhook, req).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(Duration::from_secs(120), conn).await;
        });
    }
}

/// Publish the CA, and renew the serving certificate in time (swapping it
/// in for new connections).
async fn maintain(
    client: kube::Client,
    config: WebhookConfig,
    mut material: certs::Material,
    tls: Arc<RwLock<Arc<rustls::ServerConfig>>>,
    serving: Arc<Serving>,
) {
    loop {
        match certs::publish_ca(&client, &config.configuration, &material.ca_cert).await {
            Ok(_) => serving.ready.store(true, Ordering::Relaxed),
            Err(e) => {
                tracing::error!("admission webhook: {e} (retrying)");
                tokio::time::sleep(Duration::from_secs(5)).await;
                continue;
            }
        }
        tokio::time::sleep(RENEW_EVERY).await;
        match certs::ensure(&client, &config.namespace, &config.secret, &config.names).await {
            Ok(fresh) if fresh != material => match certs::server_config(&fresh) {
                Ok(c) => {
                    *tls.write().unwrap_or_else(|e| e.into_inner()) = c;
                    material = fresh;
                    tracing::info!("admission webhook: serving a renewed certificate");
                }
                Err(e) => tracing::error!("admission webhook: the renewed certificate: {e}"),
            },
            Ok(_) => {}
            Err(e) => tracing::error!("admission webhook: {e}"),
        }
    }
}

async fn handle(webhook: &Webhook, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    if req.method() != hyper::Method::POST || req.uri().path() != PATH {
        return reply(StatusCode::NOT_FOUND, "not found\n".into());
    }
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return reply(StatusCode::PAYLOAD_TOO_LARGE, format!("{e}\n")),
    };
    let review: AdmissionReview<DynamicObject> = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("not an AdmissionReview: {e}\n")),
    };
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(r) => r,
        Err(e) => return reply(StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    let answer = webhook.review(&request).await.into_review();
    match serde_json::to_vec(&answer) {
        Ok(json) => {
            let mut r = Response::new(Full::new(Bytes::from(json)));
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("application/json"),
            );
            r
        }
        Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

fn reply(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r
}
