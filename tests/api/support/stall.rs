//! A TCP proxy that can stall: while stalled it forwards nothing in either
//! direction and closes nothing (a network that hangs, not one that fails),
//! then resumes where it stopped. Put between an instance and Postgres.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct StallingProxy {
    pub port: u16,
    stalled: Arc<watch::Sender<bool>>,
    /// See [`StallingProxy::mark_connections_sending`].
    trigger: Arc<std::sync::Mutex<Trigger>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl StallingProxy {
    /// A proxy on a free port of 127.0.0.1 to `target` (host:port).
    pub async fn start(target: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy port");
        let port = listener.local_addr().expect("proxy address").port();
        let (stalled, watching) = watch::channel(false);
        let stalled = Arc::new(stalled);
        let trigger: Arc<std::sync::Mutex<Trigger>> = Arc::default();
        let target: Arc<str> = target.into();
        let (stalling, armed) = (stalled.clone(), trigger.clone());
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (target, watching) = (target.clone(), watching.clone());
                let commits = Commits {
                    stalled: stalling.clone(),
                    trigger: armed.clone(),
                    marked: false,
                };
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(&*target).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    tokio::join!(
                        forward(client_read, server_write, watching.clone(), Some(commits)),
                        forward(server_read, client_write, watching, None),
                    );
                });
            }
        });
        Self {
            port,
            stalled,
            trigger,
            accepting,
        }
    }

    /// Marks every connection that sends a statement containing
    /// `statement` from now on (its text goes once per connection, when it
    /// is prepared: call this before the instance starts).
    pub fn mark_connections_sending(&self, statement: &str) {
        self.trigger.lock().unwrap().statement = Some(statement.as_bytes().to_vec());
    }

    /// Stalls right after the next `COMMIT` a marked connection sends has
    /// been forwarded to the server: that transaction commits, and its
    /// answer is held with everything else until [`StallingProxy::resume`].
    pub fn stall_after_next_marked_commit(&self) {
        self.trigger.lock().unwrap().armed = true;
    }

    pub fn is_stalled(&self) -> bool {
        *self.stalled.borrow()
    }

    /// `url` (a postgres:// URL) with its host and port replaced by the
    /// proxy's.
    pub fn url_for(&self, url: &str) -> String {
        url_through(self.port, url)
    }

    /// Stops forwarding; nothing is closed.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    pub fn resume(&self) {
        self.stalled.send_replace(false);
    }
}

impl Drop for StallingProxy {
    fn drop(&mut self) {
        self.accepting.abort();
        self.resume();
    }
}

#[derive(Default)]
struct Trigger {
    statement: Option<Vec<u8>>,
    armed: bool,
}

/// A client-to-server direction watched for the armed `COMMIT`.
struct Commits {
    stalled: Arc<watch::Sender<bool>>,
    trigger: Arc<std::sync::Mutex<Trigger>>,
    /// This connection sent the marked statement.
    marked: bool,
}

impl Commits {
    /// Whether `chunk`, just forwarded, starts the armed stall.
    fn stalls_after(&mut self, chunk: &[u8]) -> bool {
        let contains = |needle: &[u8]| chunk.windows(needle.len()).any(|w| w == needle);
        let mut trigger = self.trigger.lock().unwrap_or_else(|e| e.into_inner());
        let Some(statement) = trigger.statement.as_deref() else {
            return false;
        };
        self.marked |= contains(statement);
        if self.marked && trigger.armed && contains(b"COMMIT") {
            trigger.armed = false;
            return true;
        }
        false
    }
}

/// Copies `from` to `to`, holding every chunk while the proxy is stalled.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
    mut commits: Option<Commits>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        let read = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        // Read while running, held if a stall began meanwhile.
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if to.write_all(&buffer[..read]).await.is_err() {
            return;
        }
        if let Some(commits) = commits.as_mut()
            && commits.stalls_after(&buffer[..read])
        {
            commits.stalled.send_replace(true);
        }
    }
}

/// `url` with its host and port replaced by a proxy's on 127.0.0.1.
pub fn url_through(port: u16, url: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let user = authority
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    format!("{scheme}://{user}127.0.0.1:{port}/{path}")
}
