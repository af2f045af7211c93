//! A TCP proxy that can refuse: open, it forwards; shut, it ends every
//! connection it carries and ends each new one as soon as it is accepted
//! (a server that turns every client away). It notes when each connection
//! was attempted, so a test counts how hard a client keeps trying.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Gate {
    pub port: u16,
    open: watch::Sender<bool>,
    attempts: Arc<Mutex<Vec<Instant>>>,
    accepting: tokio::task::JoinHandle<()>,
}

impl Gate {
    /// An open gate on a free port of 127.0.0.1 to `target` (host:port).
    pub async fn start(target: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("gate port");
        let port = listener.local_addr().expect("gate address").port();
        let (open, watching) = watch::channel(true);
        let attempts: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let target: Arc<str> = target.into();
        let noted = attempts.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                noted.lock().unwrap().push(Instant::now());
                let mut watching = watching.clone();
                if !*watching.borrow() {
                    continue;
                }
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut server) = TcpStream::connect(&*target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = watching.wait_for(|open| !*open) => {}
                    }
                });
            }
        });
        Self {
            port,
            open,
            attempts,
            accepting,
        }
    }

    /// `url` through the gate.
    pub fn url_for(&self, url: &str) -> String {
        crate::support::stall::url_through(self.port, url)
    }

    /// Ends every connection through the gate and turns new ones away.
    pub fn shut(&self) {
        self.open.send_replace(false);
    }

    pub fn open(&self) {
        self.open.send_replace(true);
    }

    /// Connections attempted in `[from, to)`.
    pub fn attempts_between(&self, from: Instant, to: Instant) -> usize {
        let attempts = self.attempts.lock().unwrap();
        attempts
            .iter()
            .filter(|at| **at >= from && **at < to)
            .count()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}
