//! Throwaway PKI for a test control plane: a CA, the apiserver's serving
//! certificate and a service-account signing key, all written as PEM files.

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

/// Generates the PKI into `dir`.
pub fn generate(dir: &Path) -> anyhow::Result<Pki> {
    generate_with_sans(dir, &[], &[])
}

/// Generates the PKI with extra names or addresses on the serving
/// certificate (the sandbox's apiserver address on its underlay) and client
/// certificates for `clients` (kubelets, kube-proxy).
pub fn generate_with_sans(dir: &Path, extra_sans: &[String], clients: &[ClientIdentity]) -> anyhow::Result<Pki> {
    let ca_key = KeyPair::generate().context("generating CA key")?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).context("CA params")?;
    ca_params.distinguished_name = dn("weft-test-ca");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages =
        vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca_params.self_signed(&ca_key).context("self-signing CA")?;
    let issuer = Issuer::new(ca_params, ca_key);

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

    let pki = Pki {
        ca_cert: dir.join("ca.crt"),
        serving_cert: dir.join("apiserver.crt"),
        serving_key: dir.join("apiserver.key"),
        service_account_key: dir.join("sa.key"),
        service_account_pub: dir.join("sa.pub"),
        ca_pem: ca_cert.pem(),
        clients: issued,
    };
    write(&pki.ca_cert, &pki.ca_pem)?;
    write(&pki.serving_cert, &serving_cert.pem())?;
    write(&pki.serving_key, &serving_key.serialize_pem())?;
    write(&pki.service_account_key, &sa_key.serialize_pem())?;
    write(&pki.service_account_pub, &sa_key.public_key_pem())?;
    Ok(pki)
}

fn dn(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

fn write(path: &Path, contents: &str) -> anyhow::Result<()> {
    std::fs::write(path, contents).with_context(|| format!("writing {}", path.display()))
}
