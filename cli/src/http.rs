//! `leasehold run --http ADDR`: `/healthz` and `/metrics` (Prometheus text).
//!
//! `/healthz` answers 200 `ok` while [`Elector::check_health_within`] (with `--healthz-timeout`)
//! is fine, and 500 with its message when the elector believes it leads but its last confirmed
//! renewal is older than the renew deadline plus that timeout (client-go's `HealthzAdaptor`), or
//! when it failed. `/metrics` renders every metric
//! emitted through the `metrics` facade (the library's own, and the command's
//! `leasehold_command_running{lease}` gauge and `leasehold_command_starts_total{lease}` counter).

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use leasehold::{Elector, LeaseKey};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

use crate::exit::{self, CliError};

/// A bound listener with the installed Prometheus recorder.
pub(crate) struct Server {
    listener: TcpListener,
    metrics: PrometheusHandle,
}

impl Server {
    /// Binds `addr` and installs the Prometheus recorder (before the elector starts, so that
    /// nothing it emits is lost).
    pub(crate) async fn bind(addr: SocketAddr) -> Result<Server, CliError> {
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            CliError::new(
                exit::OSERR,
                format!("cannot listen on {addr} (--http): {e}"),
            )
        })?;
        let metrics = PrometheusBuilder::new().install_recorder().map_err(|e| {
            CliError::new(
                exit::SOFTWARE,
                format!("cannot install the metrics recorder: {e}"),
            )
        })?;
        Ok(Server { listener, metrics })
    }

    /// The address it listens on.
    pub(crate) fn local_addr(&self) -> String {
        self.listener
            .local_addr()
            .map_or_else(|e| format!("<unknown: {e}>"), |a| a.to_string())
    }

    /// Serves in the background (on the current runtime) for as long as the process lives.
    pub(crate) fn serve(self, elector: Elector, healthz_timeout: std::time::Duration) {
        let Server { listener, metrics } = self;
        tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                let elector = elector.clone();
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req: Request<Incoming>| {
                        let r = respond(
                            req.method(),
                            req.uri().path(),
                            &elector,
                            healthz_timeout,
                            &metrics,
                        );
                        async move { Ok::<_, Infallible>(r) }
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn respond(
    method: &Method,
    path: &str,
    elector: &Elector,
    healthz_timeout: std::time::Duration,
    metrics: &PrometheusHandle,
) -> Response<Full<Bytes>> {
    if method != Method::GET {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET\n".into());
    }
    match path {
        "/healthz" => healthz(elector.check_health_within(healthz_timeout)),
        "/metrics" => {
            metrics.run_upkeep();
            let mut r = text(StatusCode::OK, metrics.render());
            r.headers_mut().insert(
                hyper::header::CONTENT_TYPE,
                hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
            );
            r
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "not found: try /healthz or /metrics\n".into(),
        ),
    }
}

/// `/healthz`: 200 `ok`, or 500 with the reason.
fn healthz(health: leasehold::Result<()>) -> Response<Full<Bytes>> {
    match health {
        Ok(()) => text(StatusCode::OK, "ok\n".into()),
        Err(e) => text(StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")),
    }
}

/// Records whether the command runs (no-op without an installed recorder).
pub(crate) fn command_running(key: &LeaseKey, running: bool) {
    let lease = key.to_string();
    metrics::gauge!("leasehold_command_running", "lease" => lease.clone()).set(if running {
        1.0
    } else {
        0.0
    });
    if running {
        metrics::counter!("leasehold_command_starts_total", "lease" => lease).increment(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unhealthy_elector_answers_500_with_the_reason() {
        let r = healthz(Err(leasehold::Error::Unhealthy {
            key: "k".into(),
            identity: "me".into(),
            since: std::time::Duration::from_secs(12),
            renew_deadline: std::time::Duration::from_secs(10),
        }));
        assert_eq!(r.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = format!("{:?}", r.body());
        assert!(body.contains("believes it leads"), "{body}");
        assert_eq!(healthz(Ok(())).status(), StatusCode::OK);
    }
}
