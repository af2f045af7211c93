//! Deadlines on one client connection, whatever the client does: a request
//! head must arrive within the header timeout of its first byte (or of the
//! connection's start), a keep-alive connection may sit idle between
//! requests only so long, and an answer whose bytes stop leaving (a client
//! that does not read) ends the connection after the write timeout.
//!
//! hyper's own header timer counts idle keep-alive time as header time and
//! it has no write timer, so the socket is wrapped: the wrapper sees every
//! read and write, and the server tells it when a request starts and when
//! its answer is done ([`Activity`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// From a connection's start, or a request's first byte, to its last
    /// header byte.
    pub header: Duration,
    /// Between the end of an answer and the first byte of the next request.
    pub idle: Duration,
    /// Longest a write may make no progress.
    pub write: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for a request's head; it must be complete by the deadline.
    Head { by: Instant },
    /// Between requests: the next one must start by the deadline.
    Idle { until: Instant },
    /// A request is being served: the request timeout bounds it.
    Serving,
}

/// Where a connection is between requests, shared by its socket wrapper
/// and the service that answers its requests.
#[derive(Debug)]
pub struct Activity {
    phase: Mutex<Phase>,
    deadlines: Deadlines,
    /// Set when a deadline ended the connection.
    timed_out: AtomicBool,
    /// The request being served has a body not read to its end yet.
    body_unread: AtomicBool,
    /// The first key a request on this connection was served under.
    key: OnceLock<Arc<str>>,
    /// Since when a write has been waiting for the client to read.
    stalled_since: Mutex<Option<Instant>>,
}

impl Activity {
    pub fn new(deadlines: Deadlines) -> Self {
        Self {
            phase: Mutex::new(Phase::Head {
                by: Instant::now() + deadlines.header,
            }),
            deadlines,
            timed_out: AtomicBool::new(false),
            body_unread: AtomicBool::new(false),
            key: OnceLock::new(),
            stalled_since: Mutex::new(None),
        }
    }

    /// A request on this connection was served under `key`.
    pub fn carried_key(&self, key: &str) {
        if self.key.get().is_none() {
            let _ = self.key.set(Arc::from(key));
        }
    }

    /// The first key served on this connection; `None` for a connection
    /// that never carried a valid key.
    pub fn key(&self) -> Option<&Arc<str>> {
        self.key.get()
    }

    /// Since when the connection has done nothing for its client, if it
    /// does nothing now: it waits between requests or for a request head,
    /// or its answer has not left for `stall` or longer. A connection
    /// serving a request is busy.
    pub fn unused_since(&self, now: Instant, stall: Duration) -> Option<Instant> {
        match *self.phase() {
            Phase::Head { by } => Some(by - self.deadlines.header),
            Phase::Idle { until } => Some(until - self.deadlines.idle),
            Phase::Serving => {
                let stalled = *self.stalled_since.lock().unwrap_or_else(|e| e.into_inner());
                stalled.filter(|since| now.saturating_duration_since(*since) >= stall)
            }
        }
    }

    fn write_stalled(&self, since: Option<Instant>) {
        *self.stalled_since.lock().unwrap_or_else(|e| e.into_inner()) = since;
    }

    /// Whether the request being served has a body still to read.
    pub fn body_unread(&self, unread: bool) {
        self.body_unread.store(unread, Ordering::Relaxed);
    }

    pub fn is_body_unread(&self) -> bool {
        self.body_unread.load(Ordering::Relaxed)
    }

    /// Whether a request is being served whose body has not all arrived:
    /// nothing was done for it yet, so closing it costs only a resend.
    pub fn receiving_body(&self) -> bool {
        matches!(*self.phase(), Phase::Serving) && self.is_body_unread()
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A request's head was read: it is being served.
    pub fn request_started(&self) {
        *self.phase() = Phase::Serving;
    }

    /// Its answer was written (or dropped): the connection is idle.
    pub fn answer_done(&self) {
        *self.phase() = Phase::Idle {
            until: Instant::now() + self.deadlines.idle,
        };
    }

    /// Bytes arrived: an idle connection's next request has begun.
    fn bytes_read(&self) {
        let mut phase = self.phase();
        if let Phase::Idle { .. } = *phase {
            *phase = Phase::Head {
                by: Instant::now() + self.deadlines.header,
            };
        }
    }

    /// When reading stops being allowed to wait, if it is bounded now.
    fn read_deadline(&self) -> Option<Instant> {
        match *self.phase() {
            Phase::Head { by } => Some(by),
            Phase::Idle { until } => Some(until),
            Phase::Serving => None,
        }
    }

    pub fn timed_out(&self) -> bool {
        self.timed_out.load(Ordering::Relaxed)
    }
}

/// A socket whose reads and writes keep [`Activity`]'s deadlines.
pub struct Guarded<T> {
    inner: T,
    activity: Arc<Activity>,
    read_timer: Pin<Box<Sleep>>,
    /// Set while a write is waiting for the client to read.
    write_stalled_since: Option<Instant>,
    write_timer: Pin<Box<Sleep>>,
}

impl<T> Guarded<T> {
    pub fn new(inner: T, activity: Arc<Activity>) -> Self {
        let far = Instant::now() + Duration::from_secs(86_400);
        Self {
            inner,
            activity,
            read_timer: Box::pin(tokio::time::sleep_until(far)),
            write_stalled_since: None,
            write_timer: Box::pin(tokio::time::sleep_until(far)),
        }
    }

    fn write_progressed(&mut self) {
        if self.write_stalled_since.take().is_some() {
            self.activity.write_stalled(None);
        }
    }

    fn timed_out(&self, what: &'static str) -> io::Error {
        self.activity.timed_out.store(true, Ordering::Relaxed);
        io::Error::new(io::ErrorKind::TimedOut, what)
    }

    /// A write that returned Pending: fails once it has made no progress
    /// for the write timeout.
    fn write_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let since = match self.write_stalled_since {
            Some(since) => since,
            None => {
                let now = Instant::now();
                self.write_stalled_since = Some(now);
                self.activity.write_stalled(Some(now));
                now
            }
        };
        let deadline = since + self.activity.deadlines.write;
        if self.write_timer.deadline() != deadline {
            self.write_timer.as_mut().reset(deadline);
        }
        match self.write_timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(self.timed_out("the client stopped reading the answer")),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Guarded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.activity.bytes_read();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                let Some(deadline) = self.activity.read_deadline() else {
                    return Poll::Pending;
                };
                // The timer is moved only to an earlier deadline: an idle
                // deadline moves later with every request, so the timer
                // fires at an old one at most once per idle spell and is
                // set again then, instead of being reset for every request.
                loop {
                    if self.read_timer.deadline() > deadline {
                        self.read_timer.as_mut().reset(deadline);
                    }
                    match self.read_timer.as_mut().poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(()) if Instant::now() >= deadline => {
                            return Poll::Ready(Err(
                                self.timed_out("the client sent no complete request in time")
                            ));
                        }
                        Poll::Ready(()) => self.read_timer.as_mut().reset(deadline),
                    }
                }
            }
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Guarded<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(result) => {
                self.write_progressed();
                Poll::Ready(result)
            }
            Poll::Pending => self.write_pending(cx).map(Err),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write_vectored(cx, bufs) {
            Poll::Ready(result) => {
                self.write_progressed();
                Poll::Ready(result)
            }
            Poll::Pending => self.write_pending(cx).map(Err),
        }
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Ready(result) => {
                self.write_progressed();
                Poll::Ready(result)
            }
            Poll::Pending => self.write_pending(cx).map(Err),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match Pin::new(&mut self.inner).poll_shutdown(cx) {
            Poll::Ready(result) => Poll::Ready(result),
            Poll::Pending => self.write_pending(cx).map(Err),
        }
    }
}

/// Tells the connection its answer is done when dropped (the answer's body
/// was sent in full, or dropped with the connection).
pub struct AnswerDone(pub Arc<Activity>);

impl Drop for AnswerDone {
    fn drop(&mut self) {
        self.0.answer_done();
    }
}

/// An answer's body that holds `guard` until it is sent in full or
/// dropped: what an answer still occupies (its connection's state, its
/// key's share of requests in flight) lasts as long as its bytes.
pub struct Holding<B, G> {
    inner: B,
    _guard: G,
}

impl<B, G> Holding<B, G> {
    pub fn new(inner: B, guard: G) -> Self {
        Self {
            inner,
            _guard: guard,
        }
    }
}

impl<B: http_body::Body + Unpin, G: Unpin> http_body::Body for Holding<B, G> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that tells the connection when it has been read to its
/// end.
pub struct ReadToEnd<B> {
    inner: B,
    activity: Arc<Activity>,
}

impl<B> ReadToEnd<B> {
    pub fn new(inner: B, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl<B: http_body::Body + Unpin> http_body::Body for ReadToEnd<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.activity.body_unread(false);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
