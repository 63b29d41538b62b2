//! The accept loop: HTTP/1.1 connections under a cap, with a header/idle
//! timeout, a stalled-write timeout and a back-off on accept errors.
//!
//! `axum::serve` sets no timeouts and no cap, so idle sockets could hold
//! every descriptor the process has (#28). Here each connection holds a
//! permit of `max_connections`; one over the cap gets a canned 503 and is
//! closed at once (its descriptor is back within the accept). hyper's header
//! read timeout runs from the moment it waits for a request head, so it
//! bounds a slow first request and the idle time between keep-alive
//! requests alike. A response the client stops reading fails after
//! `write_timeout` without progress, which drops the request and frees its
//! sequence slot. Bodies have their own deadline in the handlers.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::Sleep;

/// Connection limits (see [`super::ServeOptions`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub write_timeout: Duration,
}

/// What a connection over the cap reads before it is closed.
const BUSY: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\nretry-after: 1\r\ncontent-length: 127\r\n\r\n{\"error\":{\"message\":\"too many open connections: retry later\",\"type\":\"server_error\",\"param\":null,\"code\":\"too_many_connections\"}}";

/// Serve `app` on `listener` until `shutdown` resolves; then stop accepting,
/// let each connection finish its request in flight, and return once all
/// have closed.
pub async fn serve(listener: TcpListener, app: Router, limits: Limits, shutdown: impl Future<Output = ()>) {
    let cap = limits.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let open = Arc::new(Semaphore::new(cap));
    let (closing_tx, closing_rx) = watch::channel(());
    let mut shutdown = std::pin::pin!(shutdown);
    let mut backoff = Duration::ZERO;
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((s, _)) => {
                backoff = Duration::ZERO;
                s
            }
            // The peer gave up before we accepted: nothing to do.
            Err(e) if matches!(e.kind(), io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused) => continue,
            Err(e) => {
                // EMFILE / ENFILE / ENOBUFS: wait for descriptors to come back
                // (connections close, timeouts fire) instead of spinning.
                backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tracing::warn!("accept failed ({e}): retrying in {backoff:?}");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => continue,
                    _ = &mut shutdown => break,
                }
            }
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            // Best effort: the socket buffer takes the 503 without waiting.
            let _ = stream.try_write(BUSY);
            tracing::debug!("connection refused: {cap} already open (--max-connections)");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut closing = closing_rx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let mut builder = http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
            let io = TokioIo::new(Stalling::new(stream, limits.write_timeout));
            let mut conn = std::pin::pin!(builder.serve_connection(io, service));
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!("connection ended: {e}");
                    }
                }
                _ = closing.changed() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
    // Stop accepting now (a connect after this is refused), then wait for
    // every connection to finish.
    drop(listener);
    drop(closing_tx);
    let _ = open.acquire_many(cap as u32).await;
}

/// A TCP stream whose writes fail after `limit` without progress.
struct Stalling {
    io: TcpStream,
    limit: Duration,
    stalled: Option<Pin<Box<Sleep>>>,
}

impl Stalling {
    fn new(io: TcpStream, limit: Duration) -> Stalling {
        Stalling { io, limit, stalled: None }
    }

    /// Pending writes start (or keep) the clock; any progress resets it.
    fn watch<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        if r.is_ready() {
            self.stalled = None;
            return r;
        }
        let limit = self.limit;
        let clock = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if clock.as_mut().poll(cx).is_ready() {
            self.stalled = None;
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, format!("the client read nothing for {limit:?}"))));
        }
        Poll::Pending
    }
}

impl AsyncRead for Stalling {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Stalling {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_busy_reply_is_a_well_formed_response() {
        let text = std::str::from_utf8(super::BUSY).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length: ")).unwrap().parse().unwrap();
        assert_eq!(len, body.len(), "content-length");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "too_many_connections");
    }
}
