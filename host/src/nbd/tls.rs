//! TLS for NBD (STARTTLS during option haggling), with rustls: the server's
//! certificate chain and key from PEM files, and optionally the CA that
//! client certificates must chain to (mutual TLS).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub type ServerConfig = Arc<rustls::ServerConfig>;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {what}", path.display())]
    Pem { path: PathBuf, what: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

fn pem_error(path: &Path) -> impl Fn(rustls::pki_types::pem::Error) -> TlsError + '_ {
    move |e| TlsError::Pem { path: path.to_path_buf(), what: e.to_string() }
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem_error(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error(path))?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_path_buf(),
            what: "no certificate in it".into(),
        });
    }
    Ok(certs)
}

/// The server side: `cert` (a chain, leaf first) and `key`; with
/// `client_ca`, clients must present a certificate it signed.
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
) -> Result<ServerConfig, TlsError> {
    let chain = certificates(cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(pem_error(key))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certificates(ca)? {
                roots
                    .add(c)
                    .map_err(|e| TlsError::Pem { path: ca.to_path_buf(), what: e.to_string() })?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(format!("{}: {e}", cert.display())))?;
    Ok(Arc::new(config))
}
