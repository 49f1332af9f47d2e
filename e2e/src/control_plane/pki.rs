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
}

/// Generates the PKI into `dir`.
pub fn generate(dir: &Path) -> anyhow::Result<Pki> {
    generate_with_sans(dir, &[])
}

/// Generates the PKI with extra names or addresses on the serving
/// certificate (the sandbox's apiserver address on its underlay).
pub fn generate_with_sans(dir: &Path, extra_sans: &[String]) -> anyhow::Result<Pki> {
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

    let pki = Pki {
        ca_cert: dir.join("ca.crt"),
        serving_cert: dir.join("apiserver.crt"),
        serving_key: dir.join("apiserver.key"),
        service_account_key: dir.join("sa.key"),
        service_account_pub: dir.join("sa.pub"),
        ca_pem: ca_cert.pem(),
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
