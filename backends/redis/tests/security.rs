//! Security tests: `requirepass`, ACL users and TLS (certificates from `leasehold_test_support::pki`),
//! each against its own redis-server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use common::*;
use futures::StreamExt;
use leasehold::{Error, LeaseStore, WatchEvent};
use leasehold_redis::{RedisConfig, RedisStore};
use leasehold_test_support::pki::{Pki, ca};
use leasehold_test_support::redis as common;

async fn connect(url: &str) -> leasehold::Result<RedisStore> {
    let cfg = RedisConfig::new(url).unwrap().with_prefix(unique_prefix());
    Ok(RedisStore::connect(cfg).await?)
}

fn assert_unauthenticated(r: leasehold::Result<RedisStore>, secret: &str) {
    match r {
        Err(e @ Error::Unauthenticated { .. }) => {
            assert!(!e.is_retryable());
            let text = format!("{e} {e:?}");
            println!("authentication error: {e}");
            assert!(!text.contains(secret), "the password leaked: {text}");
            assert!(
                text.contains("password"),
                "the message says what to fix: {text}"
            );
        }
        other => panic!("expected Unauthenticated, got {other:?}"),
    }
}

async fn exercise(s: &RedisStore) {
    let k = key("secured");
    let v = s.create(&k, &record("a", 1)).await.unwrap();
    let mut w = s.watch(&k, Some(&v)).await.unwrap();
    let v2 = s.update(&k, &record("b", 2), &v).await.unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(30), w.next())
        .await
        .expect("watch event")
        .expect("open")
        .expect("ok");
    match ev {
        WatchEvent::Put(p) => assert_eq!(p.version, v2),
        other => panic!("{other:?}"),
    }
    s.delete(&k, &v2).await.unwrap();
}

#[tokio::test]
async fn requirepass_wrong_or_missing_password_is_a_clear_authentication_error() {
    let srv = Server::start_with(&["--requirepass", "right-horse"], false);
    let base = format!("127.0.0.1:{}", srv.port);
    assert_unauthenticated(
        connect(&format!("redis://:wrong-battery@{base}")).await,
        "wrong-battery",
    );
    assert_unauthenticated(connect(&format!("redis://{base}")).await, "right-horse");
    let s = connect(&format!("redis://:right-horse@{base}"))
        .await
        .unwrap();
    assert!(!format!("{s:?}").contains("right-horse"));
    exercise(&s).await;
}

#[tokio::test]
async fn acl_users_authenticate_and_missing_permissions_are_named() {
    let srv = Server::start_with(
        &[
            "--user",
            "alice",
            "on",
            ">alice-pass",
            "~*",
            "&*",
            "+@all",
            "--user",
            "bob",
            "on",
            ">bob-pass",
            "~*",
            "&*",
            "+@all",
            "-evalsha",
            "-eval",
        ],
        false,
    );
    let base = format!("127.0.0.1:{}", srv.port);
    assert_unauthenticated(
        connect(&format!("redis://alice:bad-pass@{base}")).await,
        "bad-pass",
    );
    assert_unauthenticated(
        connect(&format!("redis://mallory:alice-pass@{base}")).await,
        "alice-pass",
    );
    let s = connect(&format!("redis://alice:alice-pass@{base}/0"))
        .await
        .unwrap();
    exercise(&s).await;

    let bob = connect(&format!("redis://bob:bob-pass@{base}"))
        .await
        .unwrap();
    match bob.get(&key("x")).await {
        Err(e @ Error::PermissionDenied { .. }) => {
            println!("permission error: {e}");
            assert!(!e.is_retryable());
            assert!(e.to_string().contains("EVALSHA"), "{e}");
        }
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
}

fn tls_server(pki: &Pki) -> Server {
    tls_server_with(pki, false)
}

fn tls_server_with(pki: &Pki, auth_clients: bool) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let (cert, key, ca) = (
        write("server.crt", &pki.cert_pem),
        write("server.key", &pki.key_pem),
        write("ca.crt", &pki.ca_pem),
    );
    let srv = Server::start_with(
        &[
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            if auth_clients { "yes" } else { "no" },
        ],
        true,
    );
    // The server has read its files at start; the directory may go.
    drop(dir);
    srv
}

#[tokio::test]
async fn tls_with_the_right_ca_works() {
    let pki = Pki::generate();
    let srv = tls_server(&pki);
    assert!(srv.url().starts_with("rediss://"));
    let cfg = RedisConfig::new(srv.url())
        .unwrap()
        .with_prefix(unique_prefix())
        .with_tls_ca_pem(pki.ca_pem.as_bytes());
    let s = RedisStore::connect(cfg).await.unwrap();
    exercise(&s).await;
}

#[tokio::test]
async fn tls_with_a_wrong_ca_fails_with_a_clear_tls_error() {
    let pki = Pki::generate();
    let srv = tls_server(&pki);
    let other = ca("some other CA");
    let cfg = RedisConfig::new(srv.url())
        .unwrap()
        .with_tls_ca_pem(other.pem().as_bytes());
    match RedisStore::connect(cfg).await.map_err(Error::from) {
        Err(e @ Error::Store { .. }) => {
            assert!(!e.is_retryable(), "{e:?}");
            let text = e.to_string();
            println!("TLS error: {text}");
            assert!(text.contains("TLS"), "{text}");
            assert!(text.to_lowercase().contains("certificate"), "{text}");
        }
        other => panic!("expected a TLS error, got {other:?}"),
    }
    // A plain-text client against the TLS port fails too, and does not hang.
    let plain = format!("redis://127.0.0.1:{}", srv.port);
    let cfg = RedisConfig::new(plain)
        .unwrap()
        .with_connect_timeout(Duration::from_millis(500))
        .with_operation_timeout(Duration::from_millis(500));
    let r = tokio::time::timeout(Duration::from_secs(60), RedisStore::connect(cfg))
        .await
        .expect("no hang");
    assert!(r.is_err());
}

#[tokio::test]
async fn mutual_tls_needs_the_client_certificate_and_says_so_without_it() {
    let pki = Pki::generate();
    let srv = tls_server_with(&pki, true);
    let base = || {
        RedisConfig::new(srv.url())
            .unwrap()
            .with_prefix(unique_prefix())
            .with_tls_ca_pem(pki.ca_pem.as_bytes())
    };
    let r = tokio::time::timeout(Duration::from_secs(60), RedisStore::connect(base()))
        .await
        .expect("no hang")
        .map_err(Error::from);
    match r {
        Err(e @ Error::Store { .. }) => {
            let text = e.to_string();
            println!("mTLS error without a client certificate: {text}");
            assert!(!e.is_retryable(), "{e:?}");
            assert!(text.contains("TLS"), "{text}");
            assert!(text.contains("with_tls_client_identity_pem"), "{text}");
        }
        other => panic!("expected a non-retryable TLS error, got {other:?}"),
    }
    let cfg = base().with_tls_client_identity_pem(
        pki.client_cert_pem.as_bytes(),
        pki.client_key_pem.as_bytes(),
    );
    let s = RedisStore::connect(cfg).await.unwrap();
    exercise(&s).await;
}

#[tokio::test]
async fn the_documented_least_privilege_acl_user_can_do_everything_the_store_does() {
    // The README documents ACL_COMMANDS verbatim: one source of truth.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("read the README");
    assert!(
        readme.contains(leasehold_redis::ACL_COMMANDS),
        "the README must show ACL_COMMANDS verbatim: {}",
        leasehold_redis::ACL_COMMANDS
    );

    let srv = Server::start();
    let admin = srv.url();
    for db in [0, 3] {
        let prefix = unique_prefix();
        let user = format!("app{db}");
        let cfg = RedisConfig::new(format!(
            "redis://{user}:app-pass@127.0.0.1:{}/{db}",
            srv.port
        ))
        .unwrap()
        .with_prefix(prefix.clone());
        let mut setuser = redis::cmd("ACL");
        setuser
            .arg("SETUSER")
            .arg(&user)
            .arg("reset")
            .arg("on")
            .arg(">app-pass");
        for rule in cfg.acl_rules().split_whitespace() {
            setuser.arg(rule);
        }
        raw_cmd(&admin, &setuser).await;
        let s = RedisStore::connect(cfg).await.unwrap();
        exercise(&s).await;

        // Everything else the store does: list, fencing seed, the script-load path after a
        // flushed script cache, corrupt data (TYPE, DUMP) replaced by compare-and-swap, and
        // acquisitions.
        let k = key("least-privilege");
        let seed = s.fencing_seed(&k).await.unwrap();
        let v = s.create(&k, &record("a", seed)).await.unwrap();
        let listed = s
            .list(&leasehold::KeyPrefix::new("least").unwrap())
            .await
            .unwrap();
        assert_eq!(listed.len(), 1);
        raw_cmd(&admin, redis::cmd("SCRIPT").arg("FLUSH")).await;
        let v = s.update(&k, &record("b", seed + 1), &v).await.unwrap();
        let admin_db = format!("{admin}/{db}");
        raw_cmd(
            &admin_db,
            redis::cmd("SET").arg(s.record_key(&k)).arg("junk"),
        )
        .await;
        let version = match s.get(&k).await {
            Err(Error::Corrupt {
                version: Some(v), ..
            }) => v,
            other => panic!("expected Corrupt, got {other:?}"),
        };
        assert_ne!(version, v);
        let v = s
            .update(&k, &record("c", seed + 2), &version)
            .await
            .unwrap();
        s.delete(&k, &v).await.unwrap();
        assert!(s.fencing_seed(&k).await.unwrap() > seed);
        // Acquisitions with tokens assigned at commit (the token high-water mark key).
        let a = s.acquire(&k, &record("d", 0), None).await.unwrap();
        let b = s
            .acquire(&k, &record("e", a.fencing_token + 1), Some(&a.version))
            .await
            .unwrap();
        assert!(b.fencing_token > a.fencing_token);
        s.delete(&k, &b.version).await.unwrap();
    }

    // A command the scripts run that the ACL denies is named as a permission problem.
    let cfg = RedisConfig::new(format!("redis://nohset:pass@127.0.0.1:{}", srv.port))
        .unwrap()
        .with_prefix(unique_prefix());
    let mut setuser = redis::cmd("ACL");
    setuser.arg("SETUSER").arg("nohset").arg("on").arg(">pass");
    for rule in cfg.acl_rules().split_whitespace() {
        setuser.arg(rule);
    }
    setuser.arg("-hset");
    raw_cmd(&admin, &setuser).await;
    let s = RedisStore::connect(cfg).await.unwrap();
    match s.create(&key("denied"), &record("a", 1)).await {
        Err(e @ Error::PermissionDenied { .. }) => {
            println!("permission error in a script: {e}");
            assert!(!e.is_retryable());
        }
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
}
