//! Throwaway PKI for a test control plane: a CA, the apiserver's serving
//! certificate, a service-account signing key and a separate front-proxy CA
//! with the client certificate the aggregator presents to extension
//! apiservers, all written as PEM files.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// Paths of the generated files.
#[derive(Debug, Clone)]
pub struct Pki {
    pub ca_cert: PathBuf,
    pub serving_cert: PathBuf,
    pub serving_key: PathBuf,
    pub service_account_key: PathBuf,
    pub service_account_pub: PathBuf,
    /// CA of the front proxy (the aggregator): extension apiservers trust
    /// the request headers of clients it signed
    /// (`--requestheader-client-ca-file`).
    pub front_proxy_ca_cert: PathBuf,
    /// The aggregator's client certificate (CN `front-proxy-client`) and key
    /// (`--proxy-client-cert-file`, `--proxy-client-key-file`).
    pub front_proxy_client_cert: PathBuf,
    pub front_proxy_client_key: PathBuf,
    /// CA certificate as PEM, for kubeconfigs.
    pub ca_pem: String,
    /// Client certificates issued with the PKI, in the order requested.
    pub clients: Vec<ClientCert>,
}

/// Who a client certificate names: the apiserver reads the user from the
/// common name and a group from the organization (one: rcgen keeps one value
/// per name type).
#[derive(Debug, Clone)]
pub struct ClientIdentity {
    /// File stem of the certificate and key (`<stem>.crt`, `<stem>.key`).
    pub stem: String,
    pub user: String,
    pub group: Option<String>,
}

/// A client certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct ClientCert {
    pub stem: String,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Common name the front proxy's client certificate holds
/// (`--requestheader-allowed-names`).
pub const FRONT_PROXY_CLIENT_CN: &str = "front-proxy-client";

/// Generates the PKI into `dir`.
pub fn generate(dir: &Path) -> anyhow::Result<Pki> {
    generate_with_sans(dir, &[], &[])
}

/// Generates the PKI with extra names or addresses on the serving
/// certificate (the sandbox's apiserver address on its underlay) and client
/// certificates for `clients` (kubelets, kube-proxy).
pub fn generate_with_sans(dir: &Path, extra_sans: &[String], clients: &[ClientIdentity]) -> anyhow::Result<Pki> {
    let (ca_cert, issuer) = new_ca("weft-test-ca")?;

    // The apiserver is reached as 127.0.0.1 by tests and as the first
    // service IP / kubernetes.default by in-cluster clients.
    let sans = [
        "localhost",
        "127.0.0.1",
        "10.96.0.1",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    .map(String::from)
    .into_iter()
    .chain(extra_sans.iter().cloned())
    .collect::<Vec<_>>();
    let serving_key = KeyPair::generate().context("generating serving key")?;
    let mut serving_params = CertificateParams::new(sans).context("serving params")?;
    serving_params.distinguished_name = dn("kube-apiserver");
    serving_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let serving_cert = serving_params.signed_by(&serving_key, &issuer).context("signing serving certificate")?;

    let sa_key = KeyPair::generate().context("generating service-account key")?;

    let mut issued = Vec::new();
    for client in clients {
        let key = KeyPair::generate().context("generating client key")?;
        let mut params = CertificateParams::new(Vec::<String>::new()).context("client params")?;
        params.distinguished_name = dn(&client.user);
        if let Some(group) = &client.group {
            params.distinguished_name.push(DnType::OrganizationName, group.as_str());
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params.signed_by(&key, &issuer).with_context(|| format!("signing {}'s certificate", client.user))?;
        let issued_cert = ClientCert {
            stem: client.stem.clone(),
            cert: dir.join(format!("{}.crt", client.stem)),
            key: dir.join(format!("{}.key", client.stem)),
        };
        write(&issued_cert.cert, &cert.pem())?;
        write(&issued_cert.key, &key.serialize_pem())?;
        issued.push(issued_cert);
    }

    // A CA of its own, as kubeadm does: a certificate the cluster CA signed
    // must not be able to assert request headers to extension apiservers.
    let (front_proxy_ca, front_proxy_issuer) = new_ca("weft-front-proxy-ca")?;
    let front_proxy_key = KeyPair::generate().context("generating front-proxy client key")?;
    let mut front_proxy_params = CertificateParams::new(Vec::<String>::new()).context("front-proxy client params")?;
    front_proxy_params.distinguished_name = dn(FRONT_PROXY_CLIENT_CN);
    front_proxy_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let front_proxy_client = front_proxy_params
        .signed_by(&front_proxy_key, &front_proxy_issuer)
        .context("signing the front-proxy client certificate")?;

    let pki = Pki {
        ca_cert: dir.join("ca.crt"),
        serving_cert: dir.join("apiserver.crt"),
        serving_key: dir.join("apiserver.key"),
        service_account_key: dir.join("sa.key"),
        service_account_pub: dir.join("sa.pub"),
        front_proxy_ca_cert: dir.join("front-proxy-ca.crt"),
        front_proxy_client_cert: dir.join("front-proxy-client.crt"),
        front_proxy_client_key: dir.join("front-proxy-client.key"),
        ca_pem: ca_cert.pem(),
        clients: issued,
    };
    write(&pki.ca_cert, &pki.ca_pem)?;
    write(&pki.serving_cert, &serving_cert.pem())?;
    write(&pki.serving_key, &serving_key.serialize_pem())?;
    write(&pki.service_account_key, &sa_key.serialize_pem())?;
    write(&pki.service_account_pub, &sa_key.public_key_pem())?;
    write(&pki.front_proxy_ca_cert, &front_proxy_ca.pem())?;
    write(&pki.front_proxy_client_cert, &front_proxy_client.pem())?;
    write(&pki.front_proxy_client_key, &front_proxy_key.serialize_pem())?;
    Ok(pki)
}

/// A self-signed CA named `common_name` and the issuer that signs with it.
fn new_ca(common_name: &str) -> anyhow::Result<(rcgen::Certificate, Issuer<'static, KeyPair>)> {
    let key = KeyPair::generate().with_context(|| format!("generating {common_name}'s key"))?;
    let mut params = CertificateParams::new(Vec::<String>::new()).with_context(|| format!("{common_name} params"))?;
    params.distinguished_name = dn(common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let cert = params.self_signed(&key).with_context(|| format!("self-signing {common_name}"))?;
    Ok((cert, Issuer::new(params, key)))
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

fn write(path: &Path, contents: &str) -> anyhow::Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}
