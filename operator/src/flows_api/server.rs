//! The flows API's listener: TLS that only the apiserver's front-proxy
//! certificate gets through, then one HTTP/1.1 request after another.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use prometheus_client::metrics::gauge::Gauge;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use super::agents::Agents;
use super::request_header::{Caller, RequestHeaderConfig};
use super::routes::{self, Route};

/// How long a client may take over its TLS handshake; the apiserver and the
/// agents, to answer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const REVIEW_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the API waits before trying again to serve.
const RETRY: Duration = Duration::from_secs(30);

pub struct Settings {
    pub addr: SocketAddr,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub agents: Agents,
}

type Body = UnsyncBoxBody<Bytes, Infallible>;

struct State {
    client: kube::Client,
    request_header: RequestHeaderConfig,
    agents: Agents,
}

/// Serves the flows API until the process ends. While it cannot (the
/// apiserver publishes no front-proxy settings yet, the serving certificate
/// is unreadable, the port taken) it says why and tries again; `serving`
/// is 1 while it listens.
pub async fn run(settings: Settings, client: kube::Client, serving: Gauge) {
    loop {
        let outcome = async {
            let request_header = front_proxy_settings(&client).await?;
            serve(&settings, client.clone(), request_header, &serving).await
        }
        .await;
        serving.set(0);
        if let Err(e) = outcome {
            tracing::warn!(error = %format!("{e:#}"), retry_in = ?RETRY, "flows API: not serving");
        }
        tokio::time::sleep(RETRY).await;
    }
}

async fn front_proxy_settings(client: &kube::Client) -> anyhow::Result<RequestHeaderConfig> {
    let api = Api::<ConfigMap>::namespaced(client.clone(), "kube-system");
    let cm = tokio::time::timeout(REVIEW_TIMEOUT, api.get("extension-apiserver-authentication"))
        .await
        .context("reading kube-system/extension-apiserver-authentication timed out")?
        .context("reading kube-system/extension-apiserver-authentication")?;
    Ok(RequestHeaderConfig::from_data(&cm.data.unwrap_or_default())?)
}

/// TLS that asks for a client certificate signed by `client_ca` and refuses
/// connections without one.
pub fn tls_config(cert: &[u8], key: &[u8], client_ca: &[u8]) -> anyhow::Result<rustls::ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_slice_iter(client_ca) {
        roots.add(ca.context("reading the front-proxy CA")?).context("using the front-proxy CA")?;
    }
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .context("the front-proxy CA")?;
    let certs = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .context("reading the serving certificate")?;
    let key = PrivateKeyDer::from_pem_slice(key).context("reading the serving key")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS versions")?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)
        .context("the serving certificate and key")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The common name of a verified client certificate.
fn common_name(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    parsed.subject().iter_common_name().next()?.as_str().ok().map(str::to_owned)
}

async fn serve(
    settings: &Settings,
    client: kube::Client,
    request_header: RequestHeaderConfig,
    serving: &Gauge,
) -> anyhow::Result<()> {
    let read = |p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    let tls = tls_config(&read(&settings.cert)?, &read(&settings.key)?, request_header.client_ca.as_bytes())?;
    let acceptor = TlsAcceptor::from(Arc::new(tls));
    let listener = tokio::net::TcpListener::bind(settings.addr)
        .await
        .with_context(|| format!("listening on {} for the flows API", settings.addr))?;
    tracing::info!(addr = %settings.addr, "flows API serving");
    serving.set(1);
    let state = Arc::new(State { client, request_header, agents: settings.agents.clone() });
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "flows API: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (acceptor, state) = (acceptor.clone(), Arc::clone(&state));
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "flows API: TLS refused"),
                Err(_) => return tracing::debug!(%peer, "flows API: TLS handshake timed out"),
            };
            let name = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(common_name);
            if let Err(e) = state.request_header.check_name(name.as_deref().unwrap_or("")) {
                return tracing::warn!(%peer, error = %e, "flows API: connection refused");
            }
            let service = hyper::service::service_fn(move |req| {
                let state = Arc::clone(&state);
                async move { Ok::<_, Infallible>(respond(&state, req).await) }
            });
            if let Err(e) =
                hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(tls), service).await
            {
                tracing::debug!(%peer, error = %e, "flows API: connection ended");
            }
        });
    }
}

fn json(code: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(Full::new(Bytes::from(value.to_string())).boxed_unsync());
    *r.status_mut() = code;
    r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    r
}

fn failure(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json(code, &routes::status(code.as_u16(), reason, message))
}

async fn respond(state: &State, req: Request<Incoming>) -> Response<Body> {
    if req.method() != Method::GET {
        return failure(StatusCode::METHOD_NOT_ALLOWED, "MethodNotAllowed", "the flows API is read-only");
    }
    let route = match routes::route(req.uri().path()) {
        Ok(r) => r,
        Err(e @ routes::RouteError::NotFound(_)) => return failure(StatusCode::NOT_FOUND, "NotFound", &e.to_string()),
        Err(e) => return failure(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let namespace = match route {
        Route::Health => return json(StatusCode::OK, &serde_json::json!("ok")),
        Route::GroupList => return json(StatusCode::OK, &routes::group_list()),
        Route::Group => return json(StatusCode::OK, &routes::group()),
        Route::Resources => return json(StatusCode::OK, &routes::resources()),
        Route::Flows { namespace } => namespace,
    };
    let caller = match state.request_header.caller(req.headers()) {
        Ok(c) => c,
        Err(e) => return failure(StatusCode::UNAUTHORIZED, "Unauthorized", &e.to_string()),
    };
    let query = match routes::query(req.uri().query(), namespace.as_deref()) {
        Ok(q) => q,
        Err(e) => return failure(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    let verb = if query.watch { "watch" } else { "list" };
    match may(&state.client, &caller, verb, namespace.as_deref()).await {
        Ok(true) => {}
        Ok(false) => {
            let where_ =
                namespace.as_deref().map_or("at the cluster scope".to_owned(), |n| format!("in the namespace {n:?}"));
            let message = format!(
                "flows.weft.dev is forbidden: User {:?} cannot {verb} resource \"flows\" {where_}",
                caller.user
            );
            return failure(StatusCode::FORBIDDEN, "Forbidden", &message);
        }
        Err(e) => return failure(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable", &format!("{e:#}")),
    }
    let filter = routes::filter(namespace.as_deref(), &query);
    if query.watch {
        return match state.agents.follow(filter, query.limit).await {
            Ok(flows) => {
                let lines = flows.map(move |f| {
                    let f = match &namespace {
                        Some(ns) => routes::redact(ns, f),
                        None => f,
                    };
                    let mut line = weft_proto::flows_json::to_json(&f).to_string();
                    line.push('\n');
                    Ok::<_, Infallible>(Frame::data(Bytes::from(line)))
                });
                let mut r = Response::new(BodyExt::boxed_unsync(StreamBody::new(lines)));
                r.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
                r
            }
            Err(e) => failure(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable", &format!("{e:#}")),
        };
    }
    match state.agents.list(filter, query.limit).await {
        Ok((flows, nodes)) => {
            let flows = match &namespace {
                Some(ns) => flows.into_iter().map(|f| routes::redact(ns, f)).collect(),
                None => flows,
            };
            json(StatusCode::OK, &routes::flow_list(flows, &nodes, query.limit))
        }
        Err(e) => failure(StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailable", &format!("{e:#}")),
    }
}

/// Whether the apiserver lets `caller` `verb` flows in `namespace` (all: None).
async fn may(client: &kube::Client, caller: &Caller, verb: &str, namespace: Option<&str>) -> anyhow::Result<bool> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(caller.user.clone()),
            groups: Some(caller.groups.clone()),
            extra: Some(caller.extra.clone().into_iter().collect::<BTreeMap<_, _>>()),
            resource_attributes: Some(ResourceAttributes {
                group: Some(routes::GROUP.to_owned()),
                version: Some(routes::VERSION.to_owned()),
                resource: Some(routes::RESOURCE.to_owned()),
                verb: Some(verb.to_owned()),
                namespace: namespace.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let api = Api::<SubjectAccessReview>::all(client.clone());
    let answer = tokio::time::timeout(REVIEW_TIMEOUT, api.create(&PostParams::default(), &review))
        .await
        .context("the apiserver took too long to review access")?
        .context("asking the apiserver whether the caller may read flows")?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

#[cfg(test)]
mod tests {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
    use tokio_rustls::TlsConnector;

    use super::*;

    struct Ca {
        pem: String,
        issuer: Issuer<'static, KeyPair>,
    }

    fn ca(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let pem = params.self_signed(&key).unwrap().pem();
        Ca { pem, issuer: Issuer::new(params, key) }
    }

    /// A certificate and key (PEM) signed by `ca`.
    fn issue(ca: &Ca, name: &str, client: bool) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(if client { vec![] } else { vec!["flows.test".to_owned()] }).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages =
            vec![if client { ExtendedKeyUsagePurpose::ClientAuth } else { ExtendedKeyUsagePurpose::ServerAuth }];
        (params.signed_by(&key, &ca.issuer).unwrap().pem(), key.serialize_pem())
    }

    /// What the server makes of one connection from a client presenting
    /// `client` (cert and key PEM): the certificate's name, or the refusal.
    async fn server_sees(
        server: &rustls::ServerConfig,
        serving_ca: &str,
        client: Option<(String, String)>,
    ) -> Result<Option<String>, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(serving_ca.as_bytes()).unwrap()).unwrap();
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots);
        let config = match client {
            Some((cert, key)) => builder
                .with_client_auth_cert(
                    vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                    PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
                )
                .unwrap(),
            None => builder.with_no_client_auth(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(server.clone()));
        let accepted = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            match acceptor.accept(tcp).await {
                Ok(tls) => Ok(tls.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(common_name)),
                Err(e) => Err(e.to_string()),
            }
        });
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("flows.test").unwrap();
        // The client's side may finish before the server refuses its certificate (TLS 1.3).
        let _ = TlsConnector::from(Arc::new(config)).connect(name, tcp).await;
        accepted.await.unwrap()
    }

    #[tokio::test]
    async fn only_the_front_proxys_certificate_gets_through() {
        let serving_ca = ca("serving");
        let front_proxy = ca("front-proxy-ca");
        let stranger = ca("somebody-else");
        let (cert, key) = issue(&serving_ca, "flows.test", false);
        let server = tls_config(cert.as_bytes(), key.as_bytes(), front_proxy.pem.as_bytes()).unwrap();

        let apiserver = issue(&front_proxy, "front-proxy-client", true);
        assert_eq!(server_sees(&server, &serving_ca.pem, Some(apiserver)).await, Ok(Some("front-proxy-client".into())));
        assert!(server_sees(&server, &serving_ca.pem, None).await.is_err(), "no certificate: refused");
        let forged = issue(&stranger, "front-proxy-client", true);
        assert!(server_sees(&server, &serving_ca.pem, Some(forged)).await.is_err(), "another CA: refused");
    }

    #[test]
    fn a_bad_front_proxy_ca_or_serving_pair_is_an_error_that_says_which() {
        let serving_ca = ca("serving");
        let (cert, key) = issue(&serving_ca, "flows.test", false);
        let e = tls_config(cert.as_bytes(), b"not a key", serving_ca.pem.as_bytes()).unwrap_err();
        assert!(format!("{e:#}").contains("serving key"), "{e:#}");
        let e = tls_config(cert.as_bytes(), key.as_bytes(), b"").unwrap_err();
        assert!(format!("{e:#}").contains("front-proxy CA"), "{e:#}");
    }
}
