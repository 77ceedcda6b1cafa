//! TLS with client certificates (certificates from `leasehold_test_support::pki`) and etcd's
//! user/password authentication with a role limited to the prefix.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use common::{Etcd, ServerTls, record};
use futures::StreamExt;
use leasehold::{Error, KeyPrefix, LeaseKey, LeaseStore, WatchEvent};
use leasehold_etcd::etcd_client::{Permission, TlsOptions};
use leasehold_etcd::{EtcdConfig, EtcdStore, TlsConfig};
use leasehold_test_support::etcd as common;
use leasehold_test_support::pki::Pki;

fn key(s: &str) -> LeaseKey {
    LeaseKey::new(s).unwrap()
}

fn quick(config: EtcdConfig) -> EtcdConfig {
    config
        .with_operation_timeout(Duration::from_secs(2))
        .with_connect_timeout(Duration::from_secs(1))
}

/// Exercises every operation once.
async fn round_trip(store: &EtcdStore) {
    let k = key("secure");
    let mut w = store.watch(&k, None).await.unwrap();
    let v1 = store.create(&k, &record("a", 1)).await.unwrap();
    let v2 = store.update(&k, &record("b", 2), &v1).await.unwrap();
    assert_eq!(store.get(&k).await.unwrap().unwrap().version, v2);
    let listed = store.list(&KeyPrefix::new("").unwrap()).await.unwrap();
    assert_eq!(listed.len(), 1);
    for expected in [&v1, &v2] {
        match tokio::time::timeout(Duration::from_secs(20), w.next()).await {
            Ok(Some(Ok(WatchEvent::Put(v)))) => assert_eq!(&v.version, expected),
            other => panic!("expected a Put, got {other:?}"),
        }
    }
    store.delete(&k, &v2).await.unwrap();
}

#[tokio::test]
async fn tls_with_client_certificates() {
    let p = Pki::with_client_cn("lh-client");
    let etcd = Etcd::start_tls(ServerTls {
        ca_pem: p.ca_pem.clone(),
        cert_pem: p.cert_pem.clone(),
        key_pem: p.key_pem.clone(),
        client_cert_auth: true,
        client_identity: Some((p.client_cert_pem.clone(), p.client_key_pem.clone())),
    })
    .await;
    assert!(etcd.endpoints()[0].starts_with("https://"));

    // The right CA and a client certificate: everything works.
    let config = quick(
        EtcdConfig::new(etcd.endpoints())
            .with_tls_ca_pem(p.ca_pem.clone())
            .with_tls_client_identity_pem(p.client_cert_pem.clone(), p.client_key_pem.clone()),
    );
    assert!(!format!("{config:?}").contains(&p.client_key_pem));
    let store = EtcdStore::connect(config).await.unwrap();
    assert!(!format!("{store:?}").contains(&p.client_key_pem));
    round_trip(&store).await;
    // The same through a TlsConfig.
    let tls = TlsConfig::new()
        .with_ca_pem(p.ca_pem.clone())
        .with_client_identity_pem(p.client_cert_pem.clone(), p.client_key_pem.clone());
    let config = quick(EtcdConfig::new(etcd.endpoints()).with_tls(tls));
    round_trip(&EtcdStore::connect(config).await.unwrap()).await;

    // No client certificate: the server refuses the handshake, and connect says so.
    let e: Error = EtcdStore::connect(quick(
        EtcdConfig::new(etcd.endpoints()).with_tls_ca_pem(p.ca_pem.clone()),
    ))
    .await
    .unwrap_err()
    .into();
    eprintln!("without a client certificate: {e:?}");
    // TLS 1.3 reports the server's refusal after the handshake: the client sees either the
    // server's alert (a certificate error, not retryable, saying what to fix) or, when the
    // connection closes first, only a closed connection (retryable).
    match &e {
        Error::Store { message, .. } => {
            assert!(!e.is_retryable(), "{e:?}");
            assert!(message.contains("with_client_identity_pem"), "{message}");
        }
        _ => assert!(
            matches!(e, Error::Unavailable { .. } | Error::Timeout { .. }),
            "{e:?}"
        ),
    }

    // A server certificate from an unknown CA is rejected at connect, the error says what to
    // fix, and it is not retryable (as on every store): retrying cannot make the CA trust the
    // server.
    let other = Pki::with_client_cn("lh-client");
    let e: Error = EtcdStore::connect(quick(
        EtcdConfig::new(etcd.endpoints()).with_tls(
            TlsConfig::new()
                .with_ca_pem(other.ca_pem.clone())
                .with_client_identity_pem(
                    other.client_cert_pem.clone(),
                    other.client_key_pem.clone(),
                ),
        ),
    ))
    .await
    .unwrap_err()
    .into();
    eprintln!("with the wrong CA: {e}");
    assert!(matches!(e, Error::Store { .. }), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    let text = e.to_string();
    assert!(
        text.contains("not trusted by the configured CA") && text.contains("with_ca_pem"),
        "{text}"
    );

    // Plain HTTP to a TLS endpoint does not work either.
    let plain = etcd.endpoints()[0].replace("https://", "http://");
    assert!(
        EtcdStore::connect(quick(EtcdConfig::new([plain])))
            .await
            .is_err()
    );
    let _ = TlsOptions::new();
}

/// etcd with authentication on: `root` and a user `app` whose role may only touch `/app/`.
async fn auth_etcd() -> Etcd {
    let etcd = Etcd::start().await;
    let store = EtcdStore::connect(etcd.config()).await.unwrap();
    let mut c = store.client().clone();
    c.user_add("root", "root-secret-pw", None).await.unwrap();
    c.user_grant_role("root", "root").await.unwrap();
    c.role_add("lh-app").await.unwrap();
    c.role_grant_permission("lh-app", Permission::read_write("/app/").with_prefix())
        .await
        .unwrap();
    c.user_add("app", "app-secret-pw", None).await.unwrap();
    c.user_grant_role("app", "lh-app").await.unwrap();
    c.auth_enable().await.unwrap();
    etcd
}

#[tokio::test]
async fn auth_with_a_role_limited_to_the_prefix() {
    let etcd = auth_etcd().await;

    // The app user works under its prefix.
    let config = etcd
        .config()
        .with_prefix("/app/")
        .with_user("app", "app-secret-pw");
    let store = EtcdStore::connect(config).await.unwrap();
    let debug = format!("{store:?}");
    assert!(
        debug.contains("app") && !debug.contains("app-secret-pw"),
        "{debug}"
    );
    round_trip(&store).await;

    // A prefix it may not read fails at connect, as a clear PermissionDenied.
    let e = EtcdStore::connect(
        etcd.config()
            .with_prefix("/elsewhere/")
            .with_user("app", "app-secret-pw"),
    )
    .await
    .unwrap_err();
    match e {
        leasehold_etcd::Error::Connect(e @ Error::PermissionDenied { .. }) => {
            println!("connect without permission: {e}");
            assert!(e.to_string().contains("permission"), "{e}");
        }
        other => panic!("expected Connect(PermissionDenied), got {other:?}"),
    }

    // A permission taken away after connect: every operation is a clear PermissionDenied.
    let root = EtcdStore::connect(etcd.config().with_user("root", "root-secret-pw"))
        .await
        .unwrap();
    let mut admin = root.client().clone();
    admin
        .role_grant_permission("lh-app", Permission::read_write("/later/").with_prefix())
        .await
        .unwrap();
    let store = EtcdStore::connect(
        etcd.config()
            .with_prefix("/later/")
            .with_user("app", "app-secret-pw"),
    )
    .await
    .unwrap();
    admin
        .role_revoke_permission(
            "lh-app",
            "/later/",
            Some(leasehold_etcd::etcd_client::RoleRevokePermissionOptions::new().with_prefix()),
        )
        .await
        .unwrap();
    let k = key("k");
    let results = [
        store.get(&k).await.map(|_| ()),
        store.create(&k, &record("a", 1)).await.map(|_| ()),
        store.list(&KeyPrefix::new("").unwrap()).await.map(|_| ()),
        store.watch(&k, None).await.map(|_| ()),
    ];
    for r in results {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("permission"), "{e}");
    }
    // A watch from a known version (no initial read) is refused as well.
    let e = store
        .watch(&k, Some(&leasehold::Version::from(1u64)))
        .await
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(e, Error::PermissionDenied { .. }), "{e:?}");
}

#[tokio::test]
async fn wrong_or_missing_credentials_are_clear_errors() {
    let etcd = auth_etcd().await;

    // A wrong password fails at connect, says what to fix, and does not echo the password.
    let e = EtcdStore::connect(
        etcd.config()
            .with_prefix("/app/")
            .with_user("app", "not-the-password"),
    )
    .await
    .unwrap_err();
    let text = format!("{e} {e:?}");
    assert!(!text.contains("not-the-password"), "{text}");
    let e: Error = e.into();
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e:?}");
    assert!(e.to_string().contains("user name and password"), "{e}");
    assert!(!e.is_retryable());

    // An unknown user likewise.
    let e: Error = EtcdStore::connect(etcd.config().with_user("nobody", "x"))
        .await
        .unwrap_err()
        .into();
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e:?}");

    // No credentials at all: connect says that the server wants them.
    let e: Error = EtcdStore::connect(etcd.config().with_prefix("/app/"))
        .await
        .unwrap_err()
        .into();
    assert!(matches!(e, Error::Unauthenticated { .. }), "{e:?}");
    assert!(e.to_string().contains("with_user"), "{e}");

    // The crate's error converts into the core error type.
    let e: Error = leasehold_etcd::Error::InvalidConfig("x".into()).into();
    assert!(matches!(e, Error::InvalidConfig(_)));
}
