//! Serving the control API's connections with bounds: what `axum::serve` does, plus a limit on the
//! connections served at once and a timeout on a connection that is slow to send a request's
//! headers or idles between requests. Idle local connections (no token is needed to connect) could
//! otherwise take every descriptor of the daemon, and consumer serving with them.

use std::sync::Arc;

use axum::Router;
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
/// for the next request of a kept-alive connection included, is closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpConnections,
    mut stopped: watch::Receiver<bool>,
) {
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
