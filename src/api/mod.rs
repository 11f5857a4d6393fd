//! The HTTP control API: datasets, pack jobs, sessions, status, metrics and the OpenAPI document.
//!
//! Operators manage the daemon through it; consumers never do (they use the Unix socket, `ipc`).
//! It is an axum router over one shared [`Control`] state, which holds the registry (shared with
//! the socket server), the catalog, the job table and the metrics. `docs/API.md` describes every
//! endpoint; `GET /openapi.json` is generated from the handlers' annotations here.
//!
//! - Every response is JSON except `/metrics` (Prometheus text); every error is
//!   `{"code", "message"}` ([`ApiError`]), including malformed JSON, unknown fields, oversized bodies,
//!   unknown routes and wrong methods.
//! - Every path a request names is confined to the data root ([`confine`]).
//! - A bearer token, when configured, guards the mutating endpoints, or every endpoint when the API
//!   listens beyond loopback ([`auth`]).
//! - Slow work (opening datasets, packing, verifying, writing the catalog) runs on blocking threads,
//!   bounded: at most `jobs_max` packs and as many verifications at once.
//!
//! *Invariant*: the API never writes dataset files except through `pack` (into a staging directory,
//! renamed into place), and never removes any but the staging directories of its own jobs: removing
//! a dataset unregisters it and leaves its files.

pub mod auth;
pub mod confine;
pub mod datasets;
pub mod device_cache;
pub mod error;
pub mod job_table;
pub mod jobs;
pub mod platform;
pub mod serve;
pub mod sessions;
pub mod state;
pub mod status;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::{delete, get, post, put};
use axum::{middleware, Router};
use utoipa::openapi::security::{Http, HttpAuthScheme, SecurityScheme};
use utoipa::OpenApi;

pub use crate::metrics::Metrics;
use error::blocking;
pub use error::{ApiError, ErrorBody};
pub use state::{ApiOptions, AuthPolicy, AuthScope, Control, StartupError};

use crate::registry::CloseReason;

/// Every route the router serves, as (method, path) in OpenAPI's spelling; the OpenAPI document
/// lists exactly these (a test checks both ways).
pub const ROUTES: [(&str, &str); 19] = [
    ("post", "/v1/datasets"),
    ("get", "/v1/datasets"),
    ("get", "/v1/datasets/{name}"),
    ("delete", "/v1/datasets/{name}"),
    ("post", "/v1/datasets/{name}/verify"),
    ("post", "/v1/rescan"),
    ("get", "/v1/jobs"),
    ("get", "/v1/jobs/{id}"),
    ("delete", "/v1/jobs/{id}"),
    ("get", "/v1/sessions"),
    ("delete", "/v1/sessions/{id}"),
    ("get", "/v1/status"),
    ("get", "/v1/devices/{device}/cache"),
    ("put", "/v1/devices/{device}/cache/{name}/pin"),
    ("delete", "/v1/devices/{device}/cache/{name}/pin"),
    ("delete", "/v1/devices/{device}/cache/{name}"),
    ("get", "/metrics"),
    ("get", "/healthz"),
    ("get", "/openapi.json"),
];

/// The OpenAPI document of the control API.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "gpufeed control API",
        description = "Manage a gpufeed daemon: datasets, pack jobs, consumer sessions, status and \
                       metrics. Errors are JSON objects with a stable `code` and a `message`.",
        license(name = "Apache-2.0")
    ),
    paths(
        datasets::create,
        datasets::list,
        datasets::get_one,
        datasets::remove,
        datasets::verify,
        datasets::rescan,
        jobs::list,
        jobs::get_one,
        jobs::cancel,
        sessions::list,
        sessions::close,
        status::status,
        device_cache::get_one,
        device_cache::pin,
        device_cache::unpin,
        device_cache::evict,
        status::metrics,
        status::healthz,
        openapi_json,
    ),
    modifiers(&BearerScheme),
    tags(
        (name = "datasets", description = "Register, pack, inspect, verify and remove datasets"),
        (name = "jobs", description = "Pack jobs"),
        (name = "sessions", description = "Consumer sessions of the socket server"),
        (name = "daemon", description = "Status, metrics, health and this document"),
    )
)]
pub struct ApiDoc;

struct BearerScheme;

impl utoipa::Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(Http::new(HttpAuthScheme::Bearer)),
        );
    }
}

/// The OpenAPI document (3.1) of this API.
#[utoipa::path(
    get, path = "/openapi.json", tag = "daemon", operation_id = "get_openapi",
    responses(
        (status = 200, description = "The OpenAPI document", body = Object),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn openapi_json() -> impl IntoResponse {
    static DOCUMENT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let text = DOCUMENT.get_or_init(|| openapi_document().to_string());
    ([(header::CONTENT_TYPE, "application/json")], text.as_str())
}

/// The OpenAPI document as JSON.
///
/// utoipa 5 serializes a response link's fields in snake case (`operation_id`), which OpenAPI
/// spells `operationId`; they are renamed here so that tools can follow the links.
pub fn openapi_document() -> serde_json::Value {
    let mut document =
        serde_json::to_value(ApiDoc::openapi()).expect("the OpenAPI document serializes");
    let operations = document["paths"]
        .as_object_mut()
        .into_iter()
        .flat_map(|paths| paths.values_mut())
        .filter_map(|item| item.as_object_mut())
        .flat_map(|item| item.values_mut());
    for operation in operations {
        let links = operation["responses"]
            .as_object_mut()
            .into_iter()
            .flat_map(|responses| responses.values_mut())
            .filter_map(|response| response.get_mut("links"))
            .filter_map(|links| links.as_object_mut())
            .flat_map(|links| links.values_mut())
            .filter_map(|link| link.as_object_mut());
        for link in links {
            for (snake, camel) in [
                ("operation_id", "operationId"),
                ("operation_ref", "operationRef"),
                ("request_body", "requestBody"),
            ] {
                if let Some(value) = link.remove(snake) {
                    link.insert(camel.to_string(), value);
                }
            }
        }
    }
    document
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint; GET /openapi.json lists them")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "this endpoint does not take that method; GET /openapi.json lists them",
    )
}

/// The control API's router over `control`.
pub fn router(control: Arc<Control>) -> Router {
    let body_bytes_max = control.options.body_bytes_max;
    Router::new()
        .route("/v1/datasets", get(datasets::list).post(datasets::create))
        .route(
            "/v1/datasets/{name}",
            get(datasets::get_one).delete(datasets::remove),
        )
        .route("/v1/datasets/{name}/verify", post(datasets::verify))
        .route("/v1/rescan", post(datasets::rescan))
        .route("/v1/jobs", get(jobs::list))
        .route("/v1/jobs/{id}", get(jobs::get_one).delete(jobs::cancel))
        .route("/v1/sessions", get(sessions::list))
        .route("/v1/sessions/{id}", delete(sessions::close))
        .route("/v1/status", get(status::status))
        .route("/v1/devices/{device}/cache", get(device_cache::get_one))
        .route(
            "/v1/devices/{device}/cache/{name}/pin",
            put(device_cache::pin).delete(device_cache::unpin),
        )
        .route(
            "/v1/devices/{device}/cache/{name}",
            delete(device_cache::evict),
        )
        .route("/metrics", get(status::metrics))
        .route("/healthz", get(status::healthz))
        .route("/openapi.json", get(openapi_json))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_bytes_max))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&control),
            auth::authorize,
        ))
        .layer(middleware::from_fn_with_state(
            Arc::clone(&control),
            auth::observe,
        ))
        .with_state(control)
}

/// What [`shutdown`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Pack jobs stopped (recorded as failed: the daemon shut down).
    pub jobs_stopped: usize,
    /// Sessions closed through the session directory.
    pub sessions_closed: usize,
}

/// Stops the API's work for a clean exit: refuses new jobs, stops running ones (waiting up to
/// `grace` for them to remove their staging directories and record their end), closes the sessions
/// the socket server lists, and writes the catalog once more.
pub async fn shutdown(control: &Arc<Control>, grace: Duration) -> Result<ShutdownReport, ApiError> {
    control.begin_shutdown();
    let jobs_stopped = jobs::stop_all(control, grace).await;
    let sessions_closed = control.registry.sessions().close_all(CloseReason::Shutdown);
    let flushed = {
        let control = Arc::clone(control);
        blocking(move || control.catalog.flush()).await?
    };
    flushed?;
    Ok(ShutdownReport {
        jobs_stopped,
        sessions_closed,
    })
}
