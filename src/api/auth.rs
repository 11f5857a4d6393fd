//! The bearer-token check, and the outermost layer that counts responses and turns a panicking
//! handler into a 500.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::FutureExt;

use super::error::ApiError;
use super::state::{AuthScope, Control};

/// Compares without an early exit, so that the time taken says nothing about how much of a guess
/// was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Requires `Authorization: Bearer TOKEN` where the policy asks for it.
pub async fn authorize(
    State(control): State<Arc<Control>>,
    request: Request,
    next: Next,
) -> Response {
    let policy = &control.options.auth;
    let Some(token) = &policy.token else {
        return next.run(request).await;
    };
    let needed = match policy.scope {
        AuthScope::Everything => true,
        AuthScope::Mutating => !matches!(*request.method(), Method::GET | Method::HEAD),
    };
    if !needed {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    match presented {
        Some(presented) if same_secret(presented.trim().as_bytes(), token.as_bytes()) => {
            next.run(request).await
        }
        Some(_) => ApiError::unauthorized("the bearer token is wrong").into_response(),
        None => ApiError::unauthorized(match policy.scope {
            AuthScope::Everything => {
                "this daemon's API listens beyond loopback: every request needs \
                 `Authorization: Bearer TOKEN`"
            }
            AuthScope::Mutating => {
                "this request changes state and needs `Authorization: Bearer TOKEN`"
            }
        })
        .into_response(),
    }
}

/// Counts every response by status class and answers 500 JSON if a handler panics, so that a bug
/// costs one request, not the connection.
pub async fn observe(
    State(control): State<Arc<Control>>,
    request: Request,
    next: Next,
) -> Response {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let response = match AssertUnwindSafe(next.run(request)).catch_unwind().await {
        Ok(response) => response,
        Err(_) => {
            tracing::error!("{method} {path}: the handler panicked");
            ApiError::internal("the request handler failed; see the daemon's log").into_response()
        }
    };
    control
        .metrics
        .count_http_response(response.status().as_u16());
    response
}
