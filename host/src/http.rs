//! The HTTP endpoint of the agent and the controller: `/metrics`
//! (Prometheus text), `/healthz` (the process serves) and `/readyz` (it
//! can do its job: the socket is up, or the controller reached the API).

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use std::net::SocketAddr;
use std::sync::Arc;

/// Says whether the process is ready, and if not, why.
pub type Readiness = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn route(path: &str, ready: &Readiness) -> Response<Full<Bytes>> {
    match path {
        "/metrics" => reply(
            StatusCode::OK,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            crate::metrics::get().encode(),
        ),
        "/healthz" => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        "/readyz" => match ready() {
            Ok(()) => reply(StatusCode::OK, "text/plain", "ok\n".into()),
            Err(why) => {
                reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", format!("not ready: {why}\n"))
            }
        },
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

/// An endpoint address, `ip:port`; an IPv6 address may come without
/// brackets (as the downward API's `status.hostIP` gives it).
pub fn parse_addr(s: &str) -> Result<SocketAddr, String> {
    if let Ok(a) = s.parse() {
        return Ok(a);
    }
    let (ip, port) = s.rsplit_once(':').ok_or_else(|| format!("{s:?} is not ip:port"))?;
    let ip: std::net::IpAddr = ip.parse().map_err(|e| format!("{s:?}: {e}"))?;
    let port: u16 = port.parse().map_err(|e| format!("{s:?}: port: {e}"))?;
    Ok(SocketAddr::new(ip, port))
}

/// The node agent's endpoint serves on loopback or one of the node's
/// addresses, never on every interface of a host-network pod.
pub fn node_local(addr: SocketAddr) -> Result<SocketAddr, String> {
    if addr.ip().is_unspecified() {
        return Err(format!(
            "{addr} listens on every interface of the node; give loopback or the node's own address (e.g. $(NODE_IP):{})",
            addr.port()
        ));
    }
    Ok(addr)
}

/// Bind `addr` now (so a taken port fails start-up), then serve forever.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("metrics/health endpoint {addr}"))
}

/// Connections served at once; more are closed at once (a scraper and the
/// kubelet's probes need a handful).
pub const MAX_CONNECTIONS: usize = 64;

pub async fn serve(listener: tokio::net::TcpListener, ready: Readiness) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut pause = crate::listener::AcceptPause::default();
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => {
                pause.reset();
                stream
            }
            Err(e) => {
                pause.wait("metrics endpoint", &e).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let ready = ready.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let resp = route(req.uri().path(), &ready);
                async move { Ok::<_, std::convert::Infallible>(resp) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            let _ = tokio::time::timeout(std::time::Duration::from_secs(60), conn).await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn endpoints_answer() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = flag.clone();
        let ready: Readiness = Arc::new(move || {
            if f.load(std::sync::atomic::Ordering::Relaxed) {
                Ok(())
            } else {
                Err("starting".into())
            }
        });
        tokio::spawn(serve(listener, ready));
        let get = |path: &'static str| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        assert!(get("/healthz").await.starts_with("HTTP/1.1 200"));
        let r = get("/readyz").await;
        assert!(r.starts_with("HTTP/1.1 503") && r.contains("not ready: starting"), "{r}");
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
        crate::metrics::get().fence("x", "grant");
        assert!(get("/metrics").await.contains("volagent_fence_decisions_total"));
        assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
    }

    #[test]
    fn addresses() {
        assert_eq!(parse_addr("10.0.0.5:9479").unwrap(), "10.0.0.5:9479".parse().unwrap());
        assert_eq!(parse_addr("fd00::5:9479").unwrap(), "[fd00::5]:9479".parse().unwrap());
        assert_eq!(parse_addr("[::1]:80").unwrap(), "[::1]:80".parse().unwrap());
        assert!(parse_addr("nope").is_err());
        assert!(node_local("0.0.0.0:9479".parse().unwrap()).is_err());
        assert!(node_local("[::]:9479".parse().unwrap()).is_err());
        assert!(node_local("127.0.0.1:9479".parse().unwrap()).is_ok());
    }
}
