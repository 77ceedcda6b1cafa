//! A test PKI made with rcgen: a CA, a server certificate for `localhost` and `127.0.0.1`, and a
//! client certificate (mutual TLS), all PEM. Used by the Redis and etcd TLS tests and by the
//! CLI's `rediss://` end-to-end test; every call makes fresh keys.

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// The client certificate's common name [`Pki::generate`] uses.
pub const CLIENT_CN: &str = "leasehold-client";

/// A CA with a server and a client certificate it signed, all PEM.
pub struct Pki {
    /// The CA certificate.
    pub ca_pem: String,
    /// The server certificate (`localhost`, `127.0.0.1`; server and client authentication).
    pub cert_pem: String,
    /// The server certificate's private key.
    pub key_pem: String,
    /// The client certificate (client authentication).
    pub client_cert_pem: String,
    /// The client certificate's private key.
    pub client_key_pem: String,
}

// === impl Pki ===

impl Pki {
    /// A fresh PKI whose client certificate is named [`CLIENT_CN`].
    pub fn generate() -> Pki {
        Pki::with_client_cn(CLIENT_CN)
    }

    /// A fresh PKI whose client certificate has the common name `client_cn` (etcd maps it to a
    /// user).
    ///
    /// # Panics
    /// When rcgen cannot make a key or a certificate.
    pub fn with_client_cn(client_cn: &str) -> Pki {
        let ca = ca("leasehold test CA");

        let mut server = CertificateParams::new(vec!["localhost".to_owned()]).expect("server SANs");
        server
            .subject_alt_names
            .push(SanType::IpAddress([127, 0, 0, 1].into()));
        server
            .distinguished_name
            .push(DnType::CommonName, "leasehold test server");
        // etcd also presents its server certificate as a client (its own health checks).
        server.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate().expect("a server key");
        let cert = server.signed_by(&key, &ca).expect("the server certificate");

        let mut client = CertificateParams::new(vec![client_cn.to_owned()]).expect("client SANs");
        client
            .distinguished_name
            .push(DnType::CommonName, client_cn);
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client_key = KeyPair::generate().expect("a client key");
        let client_cert = client
            .signed_by(&client_key, &ca)
            .expect("the client certificate");

        Pki {
            ca_pem: ca.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            client_cert_pem: client_cert.pem(),
            client_key_pem: client_key.serialize_pem(),
        }
    }
}

/// A self-signed CA named `name` (for a certificate chain the server does not trust).
///
/// # Panics
/// When rcgen cannot make the key or the certificate.
pub fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("no SANs");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("a CA key"))
        .expect("the CA certificate")
}
