//! Deployments of the tests' own, on free ports, ended by PID: a Redis
//! Cluster of three masters, a master with a replica behind a Sentinel, a
//! Postgres primary with a streaming standby, and a TCP proxy that can cut
//! idpool off from Redis. Nothing here touches the shared servers.

use crate::support::app::{eventually, eventually_blocking};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// A port whose cluster bus port (+10000) is free too.
fn cluster_port() -> u16 {
    loop {
        let port = free_port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

fn wait_for_port(port: u16) {
    eventually_blocking(
        Duration::from_secs(15),
        &format!("port {port} opens"),
        || std::net::TcpStream::connect(("127.0.0.1", port)).ok(),
    );
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn signal(child: &Child, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal);
}

/// One redis-server of ours.
pub struct RedisNode {
    pub port: u16,
    dir: PathBuf,
    args: Vec<String>,
    child: Option<Child>,
}

impl RedisNode {
    fn start(dir: &Path, port: u16, args: &[&str]) -> Self {
        let dir = dir.join(port.to_string());
        std::fs::create_dir_all(&dir).expect("node dir");
        let mut node = Self {
            port,
            dir,
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
        };
        node.launch();
        node
    }

    fn launch(&mut self) {
        let child = Command::new("redis-server")
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--appendonly", "no", "--save", ""])
            .arg("--dir")
            .arg(&self.dir)
            .args(&self.args)
            .stdout(crate::support::app::child_output())
            .stderr(crate::support::app::child_output())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        wait_for_port(self.port);
    }

    /// SIGKILL: the node and its data are gone.
    pub fn kill(&mut self) {
        crate::support::app::expect_redis_trouble();
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Writes its data, stops, and starts again on the same port with it:
    /// the same lists, a new run_id (what a stale node looks like).
    pub fn restart_with_data(&mut self) {
        crate::support::app::expect_redis_trouble();
        redis_cli(self.port, &["SAVE"]);
        self.kill();
        let mut args = std::mem::take(&mut self.args);
        args.extend(["--dbfilename".into(), "dump.rdb".into()]);
        self.args = args;
        self.launch();
    }

    pub fn pause(&self) {
        crate::support::app::expect_redis_trouble();
        if let Some(child) = &self.child {
            signal(child, nix::sys::signal::Signal::SIGSTOP);
        }
    }

    pub fn resume(&self) {
        if let Some(child) = &self.child {
            signal(child, nix::sys::signal::Signal::SIGCONT);
        }
    }

    pub fn run_id(&self) -> String {
        redis_cli(self.port, &["INFO", "server"])
            .lines()
            .find_map(|l| l.strip_prefix("run_id:"))
            .unwrap_or_default()
            .trim()
            .to_owned()
    }

    /// Keys of this node matching `pattern`.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        redis_cli(self.port, &["--scan", "--pattern", pattern])
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for RedisNode {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// Three masters sharing the slots, no replicas; a master that dies takes
/// only its slots with it (full coverage is not required).
pub struct RedisCluster {
    pub nodes: Vec<RedisNode>,
    _dir: tempfile::TempDir,
}

impl RedisCluster {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let nodes: Vec<RedisNode> = (0..3)
            .map(|_| {
                let port = cluster_port();
                RedisNode::start(
                    dir.path(),
                    port,
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "1000",
                        "--cluster-require-full-coverage",
                        "no",
                    ],
                )
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-yes"])
            .stdout(crate::support::app::child_output())
            .stderr(crate::support::app::child_output())
            .status()
            .expect("redis-cli --cluster create");
        assert!(status.success(), "cluster create failed");
        eventually_blocking(Duration::from_secs(15), "the cluster comes up", || {
            nodes
                .iter()
                .all(|n| redis_cli(n.port, &["CLUSTER", "INFO"]).contains("cluster_state:ok"))
                .then_some(())
        });
        Self { nodes, _dir: dir }
    }

    /// The comma-list form SPEC documents.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis-cluster://{}", nodes.join(","))
    }
}

/// A master, a replica of it, and one Sentinel watching them.
pub struct RedisSentinel {
    pub master: RedisNode,
    pub replica: RedisNode,
    pub sentinel: RedisNode,
    _dir: tempfile::TempDir,
}

impl RedisSentinel {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let master = RedisNode::start(dir.path(), free_port(), &[]);
        let replica_port = free_port();
        let replica = RedisNode::start(
            dir.path(),
            replica_port,
            &["--replicaof", "127.0.0.1", &master.port.to_string()],
        );
        let sentinel_port = free_port();
        let config = dir.path().join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {sentinel_port}\nbind 127.0.0.1\n\
                 sentinel monitor idpool 127.0.0.1 {} 1\n\
                 sentinel down-after-milliseconds idpool 500\n\
                 sentinel failover-timeout idpool 2000\n\
                 sentinel parallel-syncs idpool 1\n",
                master.port
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&config)
            .arg("--sentinel")
            .current_dir(dir.path())
            .stdout(crate::support::app::child_output())
            .stderr(crate::support::app::child_output())
            .spawn()
            .expect("sentinel starts");
        wait_for_port(sentinel_port);
        let sentinel = RedisNode {
            port: sentinel_port,
            dir: dir.path().to_owned(),
            args: Vec::new(),
            child: Some(child),
        };
        // The replica has caught up before anything else happens.
        eventually_blocking(Duration::from_secs(15), "the replica syncs", || {
            redis_cli(replica.port, &["INFO", "replication"])
                .contains("master_link_status:up")
                .then_some(())
        });
        Self {
            master,
            replica,
            sentinel,
            _dir: dir,
        }
    }

    /// The comma-list form SPEC documents (one sentinel here).
    pub fn url(&self) -> String {
        format!(
            "redis-sentinel://127.0.0.1:{}/?sentinelServiceName=idpool",
            self.sentinel.port
        )
    }

    /// The port of the master Sentinel names now.
    pub fn master_port(&self) -> u16 {
        redis_cli(
            self.sentinel.port,
            &["SENTINEL", "get-master-addr-by-name", "idpool"],
        )
        .lines()
        .nth(1)
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or(0)
    }
}

/// A redis-server speaking only TLS, with a certificate of a CA made for it.
pub struct TlsRedis {
    pub port: u16,
    _node: RedisNode,
    dir: tempfile::TempDir,
}

impl TlsRedis {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let openssl = |args: &[&str]| {
            let output = Command::new("openssl")
                .args(args)
                .current_dir(dir.path())
                .output()
                .expect("openssl");
            assert!(
                output.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=idpool test CA",
        ]);
        openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        std::fs::write(
            dir.path().join("san"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
        )
        .expect("san");
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "san",
        ]);
        let port = free_port();
        let file = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
        let (cert, key, ca) = (file("server.crt"), file("server.key"), file("ca.crt"));
        let tls_port = port.to_string();
        // The later --port 0 turns the plain port off.
        let node = RedisNode::start(
            dir.path(),
            port,
            &[
                "--port",
                "0",
                "--tls-port",
                &tls_port,
                "--tls-cert-file",
                &cert,
                "--tls-key-file",
                &key,
                "--tls-ca-cert-file",
                &ca,
                "--tls-auth-clients",
                "no",
            ],
        );
        Self {
            port,
            _node: node,
            dir,
        }
    }

    /// The CA certificate clients must trust.
    pub fn ca(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Keys matching `pattern`, read over TLS.
    pub fn keys(&self, pattern: &str) -> Vec<String> {
        let output = Command::new("redis-cli")
            .args(["--tls", "--cacert"])
            .arg(self.ca())
            .args(["-p", &self.port.to_string(), "--scan", "--pattern", pattern])
            .output()
            .expect("redis-cli");
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

pub fn pg_bindir() -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("Postgres server binaries under /usr/lib/postgresql")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    dirs.sort();
    dirs.pop().expect("initdb")
}

pub fn is_root() -> bool {
    nix::unistd::Uid::effective().is_root()
}

/// A Postgres tool, as the `postgres` user when we are root.
fn pg_tool(tool: &str) -> Command {
    let path = pg_bindir().join(tool);
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(path);
        command
    } else {
        Command::new(path)
    }
}

fn run_pg(command: &mut Command, what: &str) {
    let output = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A Postgres cluster of ours: a data directory and a port.
pub struct PostgresServer {
    pub port: u16,
    data: PathBuf,
    log: PathBuf,
    running: bool,
}

impl PostgresServer {
    fn options(port: u16, socket: &Path) -> String {
        format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c max_connections=100 \
             -c wal_level=replica -c max_wal_senders=4 -c fsync=off",
            socket.display()
        )
    }

    /// A primary that streams to standbys.
    pub fn primary(dir: &Path) -> Self {
        let data = dir.join("primary");
        run_pg(
            pg_tool("initdb").arg("-D").arg(&data).args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
            ]),
            "initdb",
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("pg_hba.conf"))
            .and_then(|mut f| {
                use std::io::Write;
                writeln!(f, "host replication postgres 127.0.0.1/32 trust")
            })
            .expect("pg_hba");
        let mut server = Self {
            port: free_port(),
            log: dir.join("primary.log"),
            data,
            running: false,
        };
        server.start();
        server
    }

    /// A streaming standby of `primary`, copied by pg_basebackup.
    pub fn standby_of(primary: &PostgresServer, dir: &Path) -> Self {
        let data = dir.join("standby");
        run_pg(
            pg_tool("pg_basebackup")
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &primary.port.to_string(),
                    "-U",
                    "postgres",
                ])
                .arg("-D")
                .arg(&data)
                .args(["-R", "-X", "stream"]),
            "pg_basebackup",
        );
        let mut server = Self {
            port: free_port(),
            log: dir.join("standby.log"),
            data,
            running: false,
        };
        server.start();
        server
    }

    pub fn start(&mut self) {
        let socket = self.data.parent().expect("dir").to_owned();
        run_pg(
            pg_tool("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(&self.log)
                .args([
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    &Self::options(self.port, &socket),
                    "start",
                ]),
            "pg_ctl start",
        );
        self.running = true;
    }

    /// `fast` lets sessions end cleanly; `immediate` is a crash.
    pub fn stop(&mut self, mode: &str) {
        crate::support::app::expect_postgres_trouble();
        if self.running {
            let _ = pg_tool("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-w", "-m", mode, "stop"])
                .output();
            self.running = false;
        }
    }

    pub fn promote(&self) {
        crate::support::app::expect_postgres_trouble();
        run_pg(
            pg_tool("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .args(["-w", "promote"]),
            "pg_ctl promote",
        );
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Waits until every standby has replayed all the primary wrote so far.
    pub async fn wait_for_standbys(&self) {
        let db = sqlx::PgPool::connect(&self.url("postgres"))
            .await
            .expect("primary");
        eventually(Duration::from_secs(5), "the standby catches up", async || {
            let behind: bool = sqlx::query_scalar(
                "SELECT count(*) = 0 OR bool_or(replay_lsn IS NULL OR replay_lsn < pg_current_wal_lsn()) \
                 FROM pg_stat_replication",
            )
            .fetch_one(&db)
            .await
            .expect("pg_stat_replication");
            (!behind).then_some(())
        })
        .await;
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.stop("immediate");
    }
}

/// A temporary directory Postgres (run as `postgres` when we are root) may
/// write in.
pub fn postgres_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    if is_root() {
        let status = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(dir.path())
            .status()
            .expect("chown");
        assert!(status.success());
    }
    dir
}

/// A TCP proxy to `target` whose traffic can be stopped: connections stay
/// open, bytes stop flowing both ways (a network partition, not a reset).
pub struct Partition {
    pub port: u16,
    cut: Arc<AtomicBool>,
}

impl Partition {
    pub async fn start(target: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicBool::new(false));
        let flag = cut.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", target)).await else {
                    continue;
                };
                let flag = flag.clone();
                tokio::spawn(async move {
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut server_read, mut server_write) = server.into_split();
                    let up = pump(&mut client_read, &mut server_write, flag.clone());
                    let down = pump(&mut server_read, &mut client_write, flag);
                    tokio::select! { _ = up => {}, _ = down => {} }
                });
            }
        });
        Self { port, cut }
    }

    pub fn cut(&self) {
        crate::support::app::expect_redis_trouble();
        self.cut.store(true, Ordering::SeqCst);
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// One address in front of a server that can be moved to another, like a
/// virtual IP or a DNS name that follows the primary: moving it closes
/// every connection through it, new ones reach the new server.
pub struct MovableAddress {
    pub port: u16,
    target: Arc<std::sync::Mutex<(u16, tokio_util::sync::CancellationToken)>>,
}

impl MovableAddress {
    pub async fn start(target: u16) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(std::sync::Mutex::new((
            target,
            tokio_util::sync::CancellationToken::new(),
        )));
        let current = target.clone();
        tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let (port, moved) = current.lock().unwrap().clone();
                tokio::spawn(async move {
                    let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = moved.cancelled() => {}
                    }
                });
            }
        });
        Self { port, target }
    }

    /// New connections reach `port`; those open stay where they were (a
    /// proxy that does not end sessions on a node marked down).
    pub fn redirect(&self, port: u16) {
        crate::support::app::expect_postgres_trouble();
        self.target.lock().unwrap().0 = port;
    }

    pub fn move_to(&self, port: u16) {
        crate::support::app::expect_postgres_trouble();
        let mut target = self.target.lock().unwrap();
        target.1.cancel();
        *target = (port, tokio_util::sync::CancellationToken::new());
    }
}

/// Copies bytes while the link is up; while it is cut, holds them.
async fn pump(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    cut: Arc<AtomicBool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buffer = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        while cut.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await; // the test proxy holds bytes while the link is cut
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            return;
        }
    }
}
