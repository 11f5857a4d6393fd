//! `/v1/sessions`: the consumer sessions of the socket server, from the registry's
//! [`SessionDirectory`](crate::registry::SessionDirectory).

use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::extract::State;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::{ApiError, ApiPath, ErrorBody};
use super::state::{rfc3339, Control};
use crate::registry::CloseReason;

/// A consumer session.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionView {
    /// The session id (as sent to the consumer in `Welcome`).
    pub id: u64,
    /// The consumer's uid.
    pub uid: u32,
    /// The consumer's self-description.
    pub client: String,
    /// When the session started (RFC 3339).
    pub started_at: String,
    /// The dataset its stream reads, once it opened one.
    pub dataset: Option<String>,
}

/// The sessions, and whether the socket server lists them.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct SessionList {
    /// True when the socket server lists its sessions here; when false, `sessions` is empty and
    /// only the counts are known.
    pub listed: bool,
    /// The sessions, by id.
    pub sessions: Vec<SessionView>,
    /// Open sessions, from the socket server's counters.
    pub open_sessions: u64,
    /// Open streams, from the socket server's counters.
    pub open_streams: u64,
}

/// What closing a session did.
#[derive(Clone, Debug, Serialize, Deserialize, ToSchema)]
pub struct ClosedSession {
    /// The session.
    pub id: u64,
    /// Always true: the session was told and its socket shut down.
    pub closed: bool,
}

/// Lists the consumer sessions.
#[utoipa::path(
    get, path = "/v1/sessions", tag = "sessions", operation_id = "list_sessions",
    responses(
        (status = 200, description = "The sessions", body = SessionList),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn list(State(control): State<Arc<Control>>) -> Json<SessionList> {
    let directory = control.registry.sessions();
    let sessions = directory
        .list()
        .into_iter()
        .map(|session| SessionView {
            id: session.info.id,
            uid: session.info.uid,
            client: session.info.client,
            started_at: rfc3339(
                session
                    .info
                    .started
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            ),
            dataset: session.dataset,
        })
        .collect();
    let serving = control.metrics.serving();
    Json(SessionList {
        listed: directory.is_attached(),
        sessions,
        open_sessions: serving.sessions,
        open_streams: serving.streams,
    })
}

/// Closes a consumer session: the consumer gets an error frame, its stream stops and its slots are
/// freed.
#[utoipa::path(
    delete, path = "/v1/sessions/{id}", tag = "sessions", operation_id = "close_session",
    params(("id" = u64, Path, description = "The session id")),
    responses(
        (status = 200, description = "Closed", body = ClosedSession),
        (status = 400, description = "The id is malformed", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such session", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn close(
    State(control): State<Arc<Control>>,
    ApiPath(id): ApiPath<u64>,
) -> Result<Json<ClosedSession>, ApiError> {
    let directory = control.registry.sessions();
    if directory.close(id, CloseReason::Operator) {
        return Ok(Json(ClosedSession { id, closed: true }));
    }
    Err(ApiError::not_found(if directory.is_attached() {
        format!("no session {id}")
    } else {
        format!("no session {id}: the socket server of this build does not list its sessions")
    }))
}
