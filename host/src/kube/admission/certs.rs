//! The webhook's TLS: a CA of its own and a serving certificate it signs,
//! kept in one Secret in the controller's namespace (so that every replica
//! serves the same certificate, and a restart keeps it), and the CA put
//! into the `ValidatingWebhookConfiguration` as its `caBundle`, so that the
//! API server trusts exactly this CA for this webhook.
//!
//! The serving certificate lasts a year and is issued again, by the same
//! CA, when a month of it is left or when the names it must carry change;
//! the CA lasts ten years.

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use std::collections::BTreeMap;
use time::OffsetDateTime;

const CA_CERT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
const TLS_CERT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";
/// When the serving certificate ends (RFC 3339), and the names it carries.
const NOT_AFTER: &str = "volagent.io/serving-not-after";
const NAMES: &str = "volagent.io/serving-names";

const CA_LIFETIME: time::Duration = time::Duration::days(3650);
const SERVING_LIFETIME: time::Duration = time::Duration::days(365);
/// Issued again when this little of it is left.
const RENEW_BEFORE: time::Duration = time::Duration::days(30);

#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("Secret {secret}: {source}")]
    Api { secret: String, source: kube::Error },
    #[error("Secret {secret}: {what}")]
    Damaged { secret: String, what: String },
    #[error("making the webhook's certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("ValidatingWebhookConfiguration {name}: {source}")]
    Webhook { name: String, source: kube::Error },
    #[error("ValidatingWebhookConfiguration {name} keeps changing under the controller")]
    WebhookBusy { name: String },
}

/// What the webhook serves with, as PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct Material {
    pub ca_cert: String,
    pub cert: String,
    pub key: String,
}

impl std::fmt::Debug for Material {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Material")
            .field("ca_cert", &self.ca_cert)
            .field("cert", &self.cert)
            .finish_non_exhaustive()
    }
}

/// The CA's parameters: the same every time, so that a CA key read back
/// signs certificates that chain to the CA certificate stored beside it.
fn ca_params(not_before: OffsetDateTime) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "volagent admission webhook CA");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = not_before;
    params.not_after = not_before + CA_LIFETIME;
    params
}

/// A serving certificate for `names` (DNS names or IP addresses) signed by
/// the CA key `ca_key`.
fn serving(
    names: &[String],
    ca_key: &KeyPair,
    now: OffsetDateTime,
) -> Result<(String, String, OffsetDateTime), CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(names.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names.first().cloned().unwrap_or_else(|| "volagent-webhook".into()),
    );
    params.distinguished_name = dn;
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + SERVING_LIFETIME;
    let issuer = Issuer::new(ca_params(now), ca_key);
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem(), params.not_after))
}

/// A new CA and a serving certificate for `names`.
fn fresh(
    names: &[String],
    now: OffsetDateTime,
) -> Result<(BTreeMap<String, String>, OffsetDateTime), CertError> {
    let ca_key = KeyPair::generate()?;
    let ca = ca_params(now).self_signed(&ca_key)?;
    let (cert, key, not_after) = serving(names, &ca_key, now)?;
    let data = BTreeMap::from([
        (CA_CERT.into(), ca.pem()),
        (CA_KEY.into(), ca_key.serialize_pem()),
        (TLS_CERT.into(), cert),
        (TLS_KEY.into(), key),
    ]);
    Ok((data, not_after))
}

fn rfc3339(t: OffsetDateTime) -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::from(t)).to_string()
}

fn text(secret: &Secret, key: &str) -> Option<String> {
    let bytes = secret.data.as_ref()?.get(key)?;
    String::from_utf8(bytes.0.clone()).ok()
}

/// The names a serving certificate carries, as stored.
fn names_label(names: &[String]) -> String {
    names.join(",")
}

/// What `secret` needs: nothing (None), a new serving certificate, or
/// everything anew (its CA is missing or damaged).
fn needs(secret: &Secret, names: &[String], now: OffsetDateTime) -> Option<bool> {
    let complete = [CA_CERT, CA_KEY, TLS_CERT, TLS_KEY]
        .iter()
        .all(|k| text(secret, k).is_some_and(|v| !v.is_empty()));
    if !complete || text(secret, CA_KEY).is_none_or(|k| KeyPair::from_pem(&k).is_err()) {
        return Some(true);
    }
    let annotations = secret.metadata.annotations.clone().unwrap_or_default();
    let not_after = annotations
        .get(NOT_AFTER)
        .and_then(|t| humantime::parse_rfc3339(t).ok())
        .map(OffsetDateTime::from);
    let renew = not_after.is_none_or(|t| t - now < RENEW_BEFORE)
        || annotations.get(NAMES) != Some(&names_label(names));
    renew.then_some(false)
}

fn with_serving(
    secret: &Secret,
    names: &[String],
    now: OffsetDateTime,
) -> Result<(BTreeMap<String, String>, OffsetDateTime), CertError> {
    let name = secret.metadata.name.clone().unwrap_or_default();
    let ca_key = text(secret, CA_KEY)
        .ok_or_else(|| CertError::Damaged { secret: name.clone(), what: format!("no {CA_KEY}") })?;
    let ca_key = KeyPair::from_pem(&ca_key)
        .map_err(|e| CertError::Damaged { secret: name.clone(), what: format!("{CA_KEY}: {e}") })?;
    let (cert, key, not_after) = serving(names, &ca_key, now)?;
    let mut data: BTreeMap<String, String> =
        [CA_CERT, CA_KEY].iter().filter_map(|k| Some((k.to_string(), text(secret, k)?))).collect();
    data.insert(TLS_CERT.into(), cert);
    data.insert(TLS_KEY.into(), key);
    Ok((data, not_after))
}

fn secret_of(
    namespace: &str,
    name: &str,
    data: BTreeMap<String, String>,
    names: &[String],
    not_after: OffsetDateTime,
    version: Option<String>,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            resource_version: version,
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/part-of".to_string(),
                "volagent".to_string(),
            )])),
            annotations: Some(BTreeMap::from([
                (NOT_AFTER.to_string(), rfc3339(not_after)),
                (NAMES.to_string(), names_label(names)),
            ])),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(data.into_iter().map(|(k, v)| (k, ByteString(v.into_bytes()))).collect()),
        ..Default::default()
    }
}

/// The webhook's material from Secret `namespace/name`, made (or its
/// serving certificate issued again) when needed. Replicas racing to make
/// it settle on whichever write the API server took first.
pub async fn ensure(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    names: &[String],
) -> Result<Material, CertError> {
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let what = format!("{namespace}/{name}");
    let api_error = |source| CertError::Api { secret: what.clone(), source };
    for _ in 0..5 {
        let now = OffsetDateTime::now_utc();
        let current = api.get_opt(name).await.map_err(api_error)?;
        let result = match &current {
            None => {
                let (data, not_after) = fresh(names, now)?;
                api.create(
                    &PostParams::default(),
                    &secret_of(namespace, name, data, names, not_after, None),
                )
                .await
            }
            Some(secret) => match needs(secret, names, now) {
                None => return material(secret, &what),
                Some(all) => {
                    let (data, not_after) =
                        if all { fresh(names, now)? } else { with_serving(secret, names, now)? };
                    tracing::warn!(secret = %what, new_ca = all, "issuing the admission webhook's serving certificate");
                    api.replace(
                        name,
                        &PostParams::default(),
                        &secret_of(
                            namespace,
                            name,
                            data,
                            names,
                            not_after,
                            secret.metadata.resource_version.clone(),
                        ),
                    )
                    .await
                }
            },
        };
        match result {
            Ok(secret) => return material(&secret, &what),
            // Another replica wrote it first: use theirs.
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(api_error(e)),
        }
    }
    Err(CertError::Damaged { secret: what, what: "keeps changing under the controller".into() })
}

fn material(secret: &Secret, what: &str) -> Result<Material, CertError> {
    let get = |k: &str| {
        text(secret, k)
            .ok_or_else(|| CertError::Damaged { secret: what.to_string(), what: format!("no {k}") })
    };
    Ok(Material { ca_cert: get(CA_CERT)?, cert: get(TLS_CERT)?, key: get(TLS_KEY)? })
}

/// Put `ca` into every webhook of configuration `name` that lacks it.
pub async fn publish_ca(client: &kube::Client, name: &str, ca: &str) -> Result<bool, CertError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let error = |source| CertError::Webhook { name: name.to_string(), source };
    for _ in 0..5 {
        let mut config = api.get(name).await.map_err(error)?;
        let mut changed = false;
        for hook in config.webhooks.iter_mut().flatten() {
            let bundle = Some(ByteString(ca.as_bytes().to_vec()));
            if hook.client_config.ca_bundle != bundle {
                hook.client_config.ca_bundle = bundle;
                changed = true;
            }
        }
        if !changed {
            return Ok(false);
        }
        match api.replace(name, &PostParams::default(), &config).await {
            Ok(_) => {
                tracing::info!(
                    webhook = name,
                    "the admission webhook's CA published in its configuration"
                );
                return Ok(true);
            }
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(error(e)),
        }
    }
    Err(CertError::WebhookBusy { name: name.to_string() })
}

/// A rustls server configuration serving `material`.
pub fn server_config(material: &Material) -> Result<std::sync::Arc<rustls::ServerConfig>, String> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_slice_iter(material.cert.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("serving certificate: {e}"))?;
    let key = PrivateKeyDer::from_pem_slice(material.key.as_bytes())
        .map_err(|e| format!("serving key: {e}"))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("serving certificate: {e}"))?;
    Ok(std::sync::Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(
        data: BTreeMap<String, String>,
        names: &[String],
        not_after: OffsetDateTime,
    ) -> Secret {
        secret_of("ns", "tls", data, names, not_after, None)
    }

    #[test]
    fn a_serving_certificate_chains_to_its_ca_and_is_renewed_in_time() {
        let names =
            vec!["volagent-webhook.volagent-controller.svc".to_string(), "127.0.0.1".to_string()];
        let now = OffsetDateTime::now_utc();
        let (data, not_after) = fresh(&names, now).unwrap();
        let secret = stored(data.clone(), &names, not_after);
        assert_eq!(needs(&secret, &names, now), None, "fresh material is kept");
        assert_eq!(
            needs(&secret, &names, now + SERVING_LIFETIME - time::Duration::days(10)),
            Some(false),
            "renewed a month before it ends"
        );
        assert_eq!(needs(&secret, &names[..1], now), Some(false), "renewed when the names change");
        let mut broken = data.clone();
        broken.insert(CA_KEY.into(), "not a key".into());
        assert_eq!(
            needs(&stored(broken, &names, not_after), &names, now),
            Some(true),
            "a damaged CA is made anew"
        );

        // A certificate issued again by the stored CA key verifies against
        // the stored CA certificate: what the API server's caBundle holds.
        let (renewed, _) = with_serving(&secret, &names, now).unwrap();
        assert_eq!(renewed[CA_CERT], data[CA_CERT], "the CA stays");
        assert_ne!(renewed[TLS_CERT], data[TLS_CERT]);
        for served in [&data, &renewed] {
            let material = Material {
                ca_cert: served[CA_CERT].clone(),
                cert: served[TLS_CERT].clone(),
                key: served[TLS_KEY].clone(),
            };
            handshake(&material, "127.0.0.1")
                .expect("a client trusting the CA accepts the serving certificate for its IP");
            handshake(&material, "volagent-webhook.volagent-controller.svc")
                .expect("and for its service name");
            assert!(handshake(&material, "elsewhere.example").is_err(), "not for another name");
        }
    }

    /// A TLS handshake in memory between a server with `material` and a
    /// client that trusts only its CA, connecting to `name`.
    fn handshake(material: &Material, name: &str) -> Result<(), String> {
        use rustls::pki_types::pem::PemObject;
        let server_config = server_config(material)?;
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls::pki_types::CertificateDer::pem_slice_iter(material.ca_cert.as_bytes()) {
            roots.add(c.map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let client_config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let server_name =
            rustls::pki_types::ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
        let mut client =
            rustls::ClientConnection::new(std::sync::Arc::new(client_config), server_name)
                .map_err(|e| e.to_string())?;
        let mut server = rustls::ServerConnection::new(server_config).map_err(|e| e.to_string())?;
        for _ in 0..10 {
            let mut buf = Vec::new();
            client.write_tls(&mut buf).map_err(|e| e.to_string())?;
            server.read_tls(&mut buf.as_slice()).map_err(|e| e.to_string())?;
            server.process_new_packets().map_err(|e| e.to_string())?;
            let mut buf = Vec::new();
            server.write_tls(&mut buf).map_err(|e| e.to_string())?;
            client.read_tls(&mut buf.as_slice()).map_err(|e| e.to_string())?;
            client.process_new_packets().map_err(|e| e.to_string())?;
            if !client.is_handshaking() && !server.is_handshaking() {
                return Ok(());
            }
        }
        Err("handshake did not finish".into())
    }
}
