//! Serving the control API's connections with bounds: what `axum::serve` does, plus a limit on the
//! connections served at once, a timeout on a connection that is slow to send a request's headers
//! or idles between requests, and a deadline for a request's body. Idle or stalled local connections
//! (no token is needed to connect) could otherwise take every descriptor of the daemon, and consumer
//! serving with them.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::middleware::{self, Next};
use axum::Router;
use hyper::body::{Frame, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::config::HttpConnections;

/// Pause after an accept error that is not about one connection (out of descriptors, say), so that
/// the loop does not spin while the condition lasts.
const ACCEPT_ERROR_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Serves `app` on `listener` until `stopped` turns true, then waits for the requests in flight
/// (the caller bounds that wait). At most `limits.connections_max` connections are served at once;
/// further ones wait in the listen backlog, where they hold no descriptor of the daemon. A
/// connection that takes longer than `limits.idle_timeout` to send a request's headers, the wait
/// for the next request of a kept-alive connection included, is closed; so is one whose request body
/// has not arrived in full within `limits.idle_timeout` of its headers (the request is answered with
/// an error if its handler was reading the body, and the connection closed).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpConnections,
    mut stopped: watch::Receiver<bool>,
) {
    let body_timeout = limits.idle_timeout;
    let app = app.layer(middleware::from_fn(move |request: Request, next: Next| {
        next.run(request.map(|body| Body::new(BodyDeadline::new(body, body_timeout))))
    }));
    let permits = Arc::new(Semaphore::new(limits.connections_max));
    let graceful = GracefulShutdown::new();
    loop {
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => {
                permit.expect("the semaphore is never closed")
            }
            () = stop_requested(&mut stopped) => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    tracing::warn!("control API: accepting a connection failed: {error}");
                    tokio::time::sleep(ACCEPT_ERROR_PAUSE).await;
                    continue;
                }
            },
            () = stop_requested(&mut stopped) => break,
        };
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.idle_timeout)
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app.clone()));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // The permit goes with the connection, whichever way it ends.
            let _permit = permit;
            if let Err(error) = connection.await {
                tracing::debug!("control API connection ended: {error}");
            }
        });
    }
    graceful.shutdown().await;
}

/// Returns once `stopped` turns true (or its sender is gone).
async fn stop_requested(stopped: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is dropped at once: it may not be held across an await.
    let _ = stopped.wait_for(|stop| *stop).await.map(|_| ());
}

/// A request body that fails with [`BodyTimedOut`] unless it has arrived in full within its
/// deadline, counted from when the request's headers were read: the deadline bounds the whole
/// body, so a client trickling it a byte at a time cannot stretch it (hyper times out only the
/// headers).
struct BodyDeadline {
    body: Body,
    timeout: Duration,
    deadline: Pin<Box<tokio::time::Sleep>>,
}

impl BodyDeadline {
    fn new(body: Body, timeout: Duration) -> BodyDeadline {
        BodyDeadline {
            body,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

/// A request's body did not arrive in full within the deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} s of its headers", .0.as_secs_f64())]
pub struct BodyTimedOut(Duration);

impl HttpBody for BodyDeadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(context) {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        if this.deadline.as_mut().poll(context).is_ready() {
            return Poll::Ready(Some(Err(BodyTimedOut(this.timeout).into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
