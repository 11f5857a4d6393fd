//! Serving the control API's connections with bounds: what `axum::serve` does, plus a limit on the
//! connections served at once, a timeout on a connection that is slow to send a request's headers
//! or idles between requests, and a deadline for a request's body. Idle or stalled local connections
//! (no token is needed to connect) could otherwise take every descriptor of the daemon, and consumer
//! serving with them.
//!
//! A request whose head hyper cannot parse (a malformed or duplicate `Content-Length`, headers too
//! large or too many) never reaches the router: hyper answers it itself, with an empty body, and
//! closes the connection. [`JsonErrors`] gives those answers the JSON error body every other error
//! has.

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
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::error::{BodyTimedOut, ErrorBody};
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
            .serve_connection(
                TokioIo::new(JsonErrors::new(stream)),
                TowerToHyperService::new(app.clone()),
            );
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

/// A connection's stream that rewrites the responses hyper makes up itself for a request head it
/// cannot parse (400, 414 or 431 with `content-length: 0`) into responses with the API's JSON error
/// body (`{"code", "message"}`) and `connection: close` (hyper closes the connection after them).
///
/// Such a response is recognised by its head alone: the router's responses of these statuses always
/// carry a JSON body, and no body the API sends holds a CR LF, so the head cannot be mistaken for
/// part of a body. Writes are not vectored, so that hyper hands over each response head in one
/// buffer.
struct JsonErrors<S> {
    inner: S,
    /// A rewritten response not yet fully written, and how much of it was.
    pending: Vec<u8>,
    written: usize,
}

impl<S> JsonErrors<S> {
    fn new(inner: S) -> JsonErrors<S> {
        JsonErrors {
            inner,
            pending: Vec::new(),
            written: 0,
        }
    }
}

impl<S: AsyncWrite + Unpin> JsonErrors<S> {
    /// Writes what is left of a rewritten response.
    fn poll_pending(&mut self, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while self.written < self.pending.len() {
            let n = std::task::ready!(
                Pin::new(&mut self.inner).poll_write(context, &self.pending[self.written..])
            )?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonErrors<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(context, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonErrors<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_pending(context))?;
        if let Some((head_len, replacement)) = hyper_error_response(buf) {
            this.pending = replacement;
            // Taken whole; what the socket does not take now is written on the next call or flush.
            if let Poll::Ready(Err(error)) = this.poll_pending(context) {
                return Poll::Ready(Err(error));
            }
            return Poll::Ready(Ok(head_len));
        }
        // Up to the next response head that is rewritten, if one follows in this buffer.
        let end = (1..buf.len())
            .find(|&at| {
                buf[at..].starts_with(b"HTTP/1.") && hyper_error_response(&buf[at..]).is_some()
            })
            .unwrap_or(buf.len());
        Pin::new(&mut this.inner).poll_write(context, &buf[..end])
    }

    fn poll_flush(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_pending(context))?;
        Pin::new(&mut this.inner).poll_flush(context)
    }

    fn poll_shutdown(self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_pending(context))?;
        Pin::new(&mut this.inner).poll_shutdown(context)
    }

    fn is_write_vectored(&self) -> bool {
        false
    }
}

/// If `buf` starts with a response head hyper made up for a request it could not parse, the head's
/// length and the response to send instead.
fn hyper_error_response(buf: &[u8]) -> Option<(usize, Vec<u8>)> {
    let head_len = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&buf[..head_len - 4]).ok()?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let status = status_line.strip_prefix("HTTP/1.")?.get(2..5)?;
    let (code, message) = match status {
        "400" => (
            "bad_request",
            "the request's head is malformed: a bad request line or header, such as an \
             unparsable, too large or repeated Content-Length",
        ),
        "414" => ("uri_too_long", "the request's URI is too long"),
        "431" => (
            "headers_too_large",
            "the request's headers are too large or too many",
        ),
        _ => return None,
    };
    let others: Vec<&str> = lines.collect();
    let empty = others.iter().any(|line| {
        line.split_once(':').is_some_and(|(name, value)| {
            name.trim().eq_ignore_ascii_case("content-length") && value.trim() == "0"
        })
    });
    if !empty {
        return None;
    }
    let body = serde_json::to_vec(&ErrorBody {
        code: code.to_string(),
        message: message.to_string(),
    })
    .expect("an error body serializes");
    let mut response = format!(
        "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for line in others {
        let name = line.split_once(':').map_or(line, |(name, _)| name).trim();
        if !["content-length", "content-type", "connection"]
            .iter()
            .any(|skip| name.eq_ignore_ascii_case(skip))
        {
            response.push_str(line);
            response.push_str("\r\n");
        }
    }
    response.push_str("\r\n");
    let mut response = response.into_bytes();
    response.extend_from_slice(&body);
    Some((head_len, response))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hyper_s_empty_error_heads_are_rewritten() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: Sat, 28 Nov 2026 00:00:00 GMT\r\n\r\n";
        let (len, response) = hyper_error_response(head).unwrap();
        assert_eq!(len, head.len());
        let text = String::from_utf8(response).unwrap();
        let (response_head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(response_head.starts_with("HTTP/1.1 431 "), "{text}");
        assert!(response_head.contains("\r\ndate: Sat"), "{text}");
        assert!(
            response_head.contains(&format!("content-length: {}", body.len())),
            "{text}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["code"], "headers_too_large");
        // The router's own errors (with a body) and other statuses pass untouched.
        assert!(hyper_error_response(
            b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 40\r\n\r\n"
        )
        .is_none());
        assert!(hyper_error_response(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(
            hyper_error_response(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n").is_none()
        );
    }
}
