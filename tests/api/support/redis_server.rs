//! A redis-server of the test's own, on a free port, that the test may kill
//! and restart without touching the shared one.

use std::net::TcpListener;
use std::process::{Child, Command};
use std::time::Duration;

pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    child: Option<Child>,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

impl RedisServer {
    /// Starts an empty server without persistence.
    pub fn start() -> Self {
        let mut server = Self {
            port: free_port(),
            dir: tempfile::tempdir().expect("tempdir"),
            child: None,
        };
        server.launch(false);
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// With `persist`, the server loads and saves `dump.rdb` in its
    /// directory, so a restart brings the old data back under a new run_id
    /// (what a failover to a lagging replica looks like to clients).
    fn launch(&mut self, persist: bool) {
        let mut command = Command::new("redis-server");
        command
            .arg("--port")
            .arg(self.port.to_string())
            .args([
                "--bind",
                "127.0.0.1",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(crate::support::app::child_output())
            .stderr(crate::support::app::child_output());
        if persist {
            command.args(["--dbfilename", "dump.rdb"]);
        } else {
            command.args(["--save", ""]);
        }
        let child = command
            .spawn()
            .expect("redis-server starts (is it installed?)");
        self.child = Some(child);
        let port = self.port;
        crate::support::app::eventually_blocking(
            Duration::from_secs(10),
            "redis-server comes up",
            || std::net::TcpStream::connect(("127.0.0.1", port)).ok(),
        );
    }

    /// SIGSTOP: the server hangs, connections stay open.
    pub fn pause(&self) {
        crate::support::app::expect_redis_trouble();
        if let Some(child) = &self.child {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGSTOP,
            );
        }
    }

    pub fn resume(&self) {
        if let Some(child) = &self.child {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
    }

    /// SIGKILL: the server and everything in it are gone.
    pub fn kill(&mut self) {
        crate::support::app::expect_redis_trouble();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Runs `redis-cli` against this server; its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Starts `MONITOR`: every command the server runs from now on, as
    /// it prints them (scripts' own calls marked `lua`).
    pub fn monitor(&self) -> Monitor {
        let mut child = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "monitor"])
            .stdout(std::process::Stdio::piped())
            .stderr(crate::support::app::child_output())
            .spawn()
            .expect("redis-cli monitor");
        let stdout = child.stdout.take().expect("monitor's stdout");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });
        let monitor = Monitor {
            port: self.port,
            child,
            lines,
        };
        // Watching once its "OK" is printed: nothing run later is missed.
        crate::support::app::eventually_blocking(Duration::from_secs(10), "MONITOR begins", || {
            monitor.lines_now().iter().any(|l| l == "OK").then_some(())
        });
        monitor
    }

    /// Starts again on the same port, empty.
    pub fn restart_empty(&mut self) {
        crate::support::app::expect_redis_trouble();
        self.kill();
        let _ = std::fs::remove_file(self.dir.path().join("dump.rdb"));
        self.launch(false);
    }

    /// Saves the data, stops, and starts again on the same port with the
    /// data loaded: same lists, new run_id.
    pub fn restart_with_data(&mut self) {
        crate::support::app::expect_redis_trouble();
        let status = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "SAVE"])
            .stdout(crate::support::app::child_output())
            .status()
            .expect("redis-cli");
        assert!(status.success(), "SAVE failed");
        self.kill();
        self.launch(true);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A `redis-cli monitor` of one server (see [`RedisServer::monitor`]).
pub struct Monitor {
    port: u16,
    child: Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Monitor {
    fn lines_now(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Every command the server ran up to now: a marker is sent and
    /// waited for, and what came before it returned (the server runs and
    /// reports commands in one order).
    pub fn seen_so_far(&self) -> Vec<String> {
        let marker = format!("monitor-mark-{}", uuid::Uuid::new_v4().simple());
        let status = Command::new("redis-cli")
            .args(["-p", &self.port.to_string(), "ECHO", &marker])
            .stdout(crate::support::app::child_output())
            .status()
            .expect("redis-cli");
        assert!(status.success(), "ECHO failed");
        crate::support::app::eventually_blocking(
            Duration::from_secs(10),
            "the monitor sees its marker",
            || {
                let lines = self.lines_now();
                let at = lines.iter().position(|l| l.contains(&marker))?;
                Some(lines[..at].to_vec())
            },
        )
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
