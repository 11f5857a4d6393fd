//! The API's one error type and the extractors that turn every rejection into it.
//!
//! Every error response is `{"code": "...", "message": "..."}` with a status that fits. `code` is
//! stable (clients branch on it); `message` is for people and may change.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;
use serde::Serialize;
use utoipa::ToSchema;

use super::confine::ConfineError;
use crate::catalog::CatalogError;

/// A request's body did not arrive in full within the deadline (the HTTP server's body deadline
/// fails the body with it; the JSON extractor's rejection is answered 408).
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} s of its headers", .0.as_secs_f64())]
pub struct BodyTimedOut(pub(crate) std::time::Duration);

/// The body of every error response.
#[derive(Clone, Debug, Serialize, serde::Deserialize, ToSchema)]
pub struct ErrorBody {
    /// A stable machine-readable code: `bad_request`, `invalid_json`, `unsupported_media_type`,
    /// `unauthorized`, `path_outside_root`, `path_not_found`, `not_found`, `method_not_allowed`,
    /// `conflict`, `in_use`, `dataset_unavailable`, `payload_too_large`, `invalid_dataset`,
    /// `invalid_input`, `too_many_requests`, `shutting_down`, `internal`, and for requests whose
    /// head cannot be parsed `bad_request`, `uri_too_long` and `headers_too_large`.
    pub code: String,
    /// What went wrong, for people.
    pub message: String,
}

/// An error answered to an API request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The stable code.
    pub code: &'static str,
    /// The human message.
    pub message: String,
}

impl ApiError {
    /// An error with this status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// 400 `bad_request`: the request is well-formed JSON but breaks a rule.
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    /// 404 `not_found`.
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 409 `conflict`: the name or directory is taken, or the object is in the wrong state.
    pub fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, "conflict", message)
    }

    /// 401 `unauthorized`.
    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
    }

    /// 429 `too_many_requests`: a bounded resource (job queue, verify slots) is full.
    pub fn too_many_requests(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", message)
    }

    /// 500 `internal`.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let unauthorized = self.status == StatusCode::UNAUTHORIZED;
        let body = ErrorBody {
            code: self.code.to_string(),
            message: self.message,
        };
        let mut response = (self.status, Json(body)).into_response();
        if unauthorized {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"gpufeed\""),
            );
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        if let Some(timed_out) = body_timed_out(&rejection) {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "request_timeout",
                timed_out.to_string(),
            );
        }
        let status = rejection.status();
        let text = rejection.body_text();
        match status {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
                status,
                "payload_too_large",
                "the request body is larger than the daemon's body limit",
            ),
            StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::new(
                status,
                "unsupported_media_type",
                "the body must be JSON with `Content-Type: application/json`",
            ),
            // Syntax errors (400) and data errors such as unknown fields or wrong types (422) are
            // both a body that is not the JSON the endpoint takes.
            s if s.is_client_error() => {
                ApiError::new(StatusCode::BAD_REQUEST, "invalid_json", text)
            }
            _ => ApiError::internal(text),
        }
    }
}

/// The body deadline that made reading the body fail, if that is why (see `api::serve`).
fn body_timed_out(rejection: &JsonRejection) -> Option<&BodyTimedOut> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = source {
        if let Some(timed_out) = error.downcast_ref::<BodyTimedOut>() {
            return Some(timed_out);
        }
        source = error.source();
    }
    None
}

impl From<ConfineError> for ApiError {
    fn from(error: ConfineError) -> ApiError {
        let message = error.to_string();
        match error {
            ConfineError::Outside { .. } => {
                ApiError::new(StatusCode::FORBIDDEN, "path_outside_root", message)
            }
            ConfineError::NotFound { .. } => {
                ApiError::new(StatusCode::BAD_REQUEST, "path_not_found", message)
            }
            ConfineError::Unusable { .. } => ApiError::bad_request(message),
            // A name too long, a file where a directory should be, a loop of links, no permission:
            // the requested path is unusable. Anything else is the machine's fault.
            ConfineError::Io { source, .. } if source.raw_os_error() == Some(libc::ELOOP) => {
                ApiError::bad_request(message)
            }
            ConfineError::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::InvalidFilename
                | std::io::ErrorKind::NotADirectory
                | std::io::ErrorKind::InvalidInput
                | std::io::ErrorKind::PermissionDenied => ApiError::bad_request(message),
                _ => ApiError::internal(message),
            },
        }
    }
}

impl From<CatalogError> for ApiError {
    fn from(error: CatalogError) -> ApiError {
        ApiError::internal(format!("the catalog could not be written: {error}"))
    }
}

/// `Json<T>` whose rejections are [`ApiError`]s.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => Ok(ApiJson(value)),
            Err(rejection) => Err(rejection.into()),
        }
    }
}

/// `Path<T>` whose rejections are [`ApiError`]s.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(ApiPath(value)),
            Err(rejection) => Err(path_rejection(rejection)),
        }
    }
}

fn path_rejection(rejection: PathRejection) -> ApiError {
    if rejection.status().is_server_error() {
        ApiError::internal(rejection.body_text())
    } else {
        ApiError::bad_request(rejection.body_text())
    }
}

/// `Query<T>` whose rejections are [`ApiError`]s.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(ApiQuery(value)),
            Err(rejection) => Err(query_rejection(rejection)),
        }
    }
}

fn query_rejection(rejection: QueryRejection) -> ApiError {
    ApiError::bad_request(rejection.body_text())
}

/// Runs `work` on a blocking thread; a panic in it is a 500. (Here rather than in the module's root,
/// which routes to the handlers that call it: the handlers' files do not import back up.)
pub(crate) async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|error| ApiError::internal(format!("a blocking task failed: {error}")))
}
