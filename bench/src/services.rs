//! The servers a bench run starts for itself, on free ports, and stops.
//! Servers it did not start are never touched.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_for_port(port: u16, what: &str, limit: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if started.elapsed() > limit {
            bail!("{what} did not open port {port} within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

fn is_root() -> bool {
    // SAFETY-free check: the effective user id from /proc.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2).map(|u| u == "0"))
        })
        .unwrap_or(false)
}

fn pg_bindir() -> anyhow::Result<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .context(
            "Postgres server binaries not found under /usr/lib/postgresql (apt install postgresql)",
        )?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    dirs.sort();
    dirs.pop()
        .context("no initdb under /usr/lib/postgresql/*/bin")
}

/// Runs a Postgres tool, as the `postgres` user when we are root (Postgres
/// refuses to run as root).
fn pg_command(tool: &Path) -> Command {
    if is_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(tool);
        command
    } else {
        Command::new(tool)
    }
}

/// What one pgbench run measured.
pub struct Pgbench {
    pub tps: f64,
    pub p99_ms: f64,
}

pub struct Postgres {
    pub port: u16,
    dir: PathBuf,
    bindir: PathBuf,
}

impl Postgres {
    /// initdb in `dir` (wiped first) and start with settings for a write-heavy run.
    pub fn start(dir: &Path) -> anyhow::Result<Self> {
        let bindir = pg_bindir()?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::create_dir_all(dir)?;
        let dir = &dir.canonicalize()?;
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir)
                .status()?;
            if !status.success() {
                bail!("chown of {} to postgres failed", dir.display());
            }
        }
        let data = dir.join("data");
        let status = pg_command(&bindir.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8"])
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            bail!("initdb failed");
        }
        let port = free_port()?;
        // BENCH_PG_OPTIONS: more settings of this server for a diagnosis
        // (`-c shared_preload_libraries=pg_stat_statements`, say), never
        // for a figure that is compared with another run's.
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c max_connections=300 -c shared_buffers=256MB \
             -c max_wal_size=4GB -c checkpoint_timeout=30min -c wal_buffers=16MB {}",
            dir.display(),
            std::env::var("BENCH_PG_OPTIONS").unwrap_or_default()
        );
        let status = pg_command(&bindir.join("pg_ctl"))
            .arg("-D")
            .arg(&data)
            .arg("-l")
            .arg(dir.join("server.log"))
            .args(["-w", "-t", "60", "-o", &options, "start"])
            .stdout(Stdio::null())
            .status()?;
        if !status.success() {
            bail!(
                "pg_ctl start failed; see {}",
                dir.join("server.log").display()
            );
        }
        Ok(Self {
            port,
            dir: dir.to_owned(),
            bindir,
        })
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// pgbench: durable single-row INSERT transactions with `clients` for
    /// `seconds`: transactions per second and the p99 latency.
    pub fn pgbench_insert(&self, clients: u32, seconds: u64) -> anyhow::Result<Pgbench> {
        self.pgbench(
            "CREATE TABLE IF NOT EXISTS bench_insert (id bigserial PRIMARY KEY, v int NOT NULL, at timestamptz NOT NULL DEFAULT now())",
            "INSERT INTO bench_insert (v) VALUES (1);\n",
            clients,
            seconds,
            &[],
        )
    }

    /// pgbench: Postgres handing out numbers itself, `SELECT nextval(…)`
    /// on one sequence, prepared, with `clients` for `seconds`: what an ID
    /// service straight on Postgres could do at best.
    pub fn pgbench_nextval(&self, clients: u32, seconds: u64) -> anyhow::Result<Pgbench> {
        self.pgbench(
            "CREATE SEQUENCE IF NOT EXISTS bench_ids",
            "SELECT nextval('bench_ids');\n",
            clients,
            seconds,
            &["-M", "prepared"],
        )
    }

    /// The way registers without holes are numbered elsewhere: one
    /// transaction holds the counter row from the number to the commit
    /// (`UPDATE … RETURNING`, `INSERT`, `COMMIT`), one document a commit.
    pub fn pgbench_serialized(&self, clients: u32, seconds: u64) -> anyhow::Result<Pgbench> {
        self.pgbench(
            "CREATE TABLE IF NOT EXISTS bench_counter (id int PRIMARY KEY, next bigint NOT NULL); \
             INSERT INTO bench_counter VALUES (1, 1) ON CONFLICT DO NOTHING; \
             CREATE TABLE IF NOT EXISTS bench_register (id bigserial PRIMARY KEY, n bigint NOT NULL UNIQUE, \
                 payload jsonb NOT NULL, at timestamptz NOT NULL DEFAULT now())",
            "BEGIN;\n\
             UPDATE bench_counter SET next = next + 1 WHERE id = 1 RETURNING next - 1 AS n \\gset\n\
             INSERT INTO bench_register (n, payload) VALUES (:n, '{\"total\": 1}');\n\
             COMMIT;\n",
            clients,
            seconds,
            &[],
        )
    }

    /// pgbench running `script` at `clients` for `seconds`, after `setup`,
    /// in a database of its own.
    fn pgbench(
        &self,
        setup: &str,
        script_text: &str,
        clients: u32,
        seconds: u64,
        extra_args: &[&str],
    ) -> anyhow::Result<Pgbench> {
        let psql = self.bindir.join("psql");
        let port = self.port.to_string();
        let _ = pg_command(&psql)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-qc",
                "CREATE DATABASE pgbench_insert",
            ])
            .stderr(Stdio::null())
            .status()?;
        let status = pg_command(&psql)
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-d",
                "pgbench_insert",
            ])
            .stderr(Stdio::null())
            .args(["-qc", setup])
            .status()?;
        if !status.success() {
            bail!("pgbench table setup failed");
        }
        let script = self.dir.join("insert.sql");
        std::fs::write(&script, script_text)?;
        let logs = self.dir.join("pgbench-logs");
        let _ = std::fs::remove_dir_all(&logs);
        std::fs::create_dir_all(&logs)?;
        if is_root() {
            let _ = Command::new("chown")
                .arg("-R")
                .arg("postgres")
                .arg(&script)
                .arg(&logs)
                .status();
        }
        let pgbench = if self.bindir.join("pgbench").exists() {
            self.bindir.join("pgbench")
        } else {
            PathBuf::from("pgbench")
        };
        let output = pg_command(&pgbench)
            .current_dir(&logs)
            .args(["-n", "-h", "127.0.0.1", "-p", &port, "-U", "postgres"])
            .args([
                "-c",
                &clients.to_string(),
                "-j",
                "2",
                "-T",
                &seconds.to_string(),
            ])
            .args(extra_args)
            .args(["-l", "--log-prefix", "tx", "-f"])
            .arg(&script)
            .arg("pgbench_insert")
            .output()?;
        let text = String::from_utf8_lossy(&output.stdout);
        let tps = text
            .lines()
            .find_map(|l| l.strip_prefix("tps = "))
            .and_then(|l| l.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .with_context(|| format!("no tps in pgbench output: {text}"))?;
        // Per-transaction log lines: client, transaction, latency (µs), ...
        let mut latencies: Vec<u64> = Vec::new();
        for entry in std::fs::read_dir(&logs)? {
            let log = std::fs::read_to_string(entry?.path())?;
            latencies.extend(
                log.lines()
                    .filter_map(|l| l.split_whitespace().nth(2)?.parse::<u64>().ok()),
            );
        }
        latencies.sort_unstable();
        let p99_ms = latencies
            .get((latencies.len() as f64 * 0.99) as usize)
            .map(|us| *us as f64 / 1000.0)
            .unwrap_or(f64::NAN);
        Ok(Pgbench { tps, p99_ms })
    }

    pub fn stop(&self) {
        let _ = pg_command(&self.bindir.join("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "stop"])
            .stdout(Stdio::null())
            .status();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

pub struct Redis {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl Redis {
    pub fn start() -> anyhow::Result<Self> {
        let mut redis = Self {
            port: free_port()?,
            child: None,
            dir: tempfile::tempdir()?,
        };
        redis.launch()?;
        Ok(redis)
    }

    fn launch(&mut self) -> anyhow::Result<()> {
        self.child = Some(spawn_redis(self.port, self.dir.path(), &[])?);
        Ok(())
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.stop();
        self.launch()
    }

    /// The server's `used_memory` (bytes).
    pub fn used_memory(&self) -> anyhow::Result<u64> {
        let info = redis_cli(self.port, &["INFO", "memory"])?;
        info.lines()
            .find_map(|l| l.strip_prefix("used_memory:"))
            .and_then(|v| v.trim().parse().ok())
            .context("used_memory in INFO memory")
    }

    /// Up to `n` keys matching `pattern`, each with its type and the
    /// fields or elements it holds (for a failure's message).
    pub fn some_keys(&self, pattern: &str, n: usize) -> anyhow::Result<Vec<String>> {
        let keys = redis_cli(self.port, &["--scan", "--pattern", pattern])?;
        keys.lines()
            .take(n)
            .map(|key| {
                let kind = redis_cli(self.port, &["TYPE", key])?;
                let shown = match kind.trim() {
                    "hash" => redis_cli(self.port, &["HGETALL", key])?,
                    "list" => redis_cli(self.port, &["LRANGE", key, "0", "5"])?,
                    _ => redis_cli(self.port, &["GET", key])?,
                };
                Ok(format!(
                    "{key} ({}): {}",
                    kind.trim(),
                    shown.replace('\n', " ")
                ))
            })
            .collect()
    }

    /// How many keys match `pattern`, and their `MEMORY USAGE` summed
    /// (bytes), in one script on the server.
    pub fn keys_memory(&self, pattern: &str) -> anyhow::Result<(u64, u64)> {
        const SUM: &str = "local cursor, keys, bytes = '0', 0, 0 \
            repeat \
              local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000) \
              cursor = page[1] \
              for _, key in ipairs(page[2]) do \
                keys = keys + 1 \
                bytes = bytes + (redis.call('MEMORY', 'USAGE', key) or 0) \
              end \
            until cursor == '0' \
            return {keys, bytes}";
        let out = redis_cli(self.port, &["EVAL", SUM, "0", pattern])?;
        let mut numbers = out.lines().filter_map(|l| l.trim().parse::<u64>().ok());
        match (numbers.next(), numbers.next()) {
            (Some(keys), Some(bytes)) => Ok((keys, bytes)),
            _ => bail!("keys_memory {pattern}: {out:?}"),
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A redis-server without persistence on `port`, working in `dir` (a
/// replica writes the copy it receives there), once it accepts connections.
fn spawn_redis(port: u16, dir: &Path, extra: &[&str]) -> anyhow::Result<Child> {
    let child = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .context("redis-server (apt install redis-server)")?;
    wait_for_port(port, "redis-server", Duration::from_secs(10))?;
    Ok(child)
}

fn redis_cli(port: u16, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .context("redis-cli")?;
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

fn wait_until(what: &str, mut ready: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let started = Instant::now();
    while !ready()? {
        if started.elapsed() > Duration::from_secs(20) {
            bail!("{what} not ready after 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Redis processes of a topology, ended together.
pub struct RedisTopology {
    url: String,
    children: Vec<Child>,
    dir: tempfile::TempDir,
}

impl RedisTopology {
    /// Three masters sharing the slots, no replicas.
    pub fn cluster() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut ports = Vec::new();
        while ports.len() < 3 {
            let port = free_port()?;
            // The cluster bus listens on port + 10000.
            if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
                ports.push(port);
            }
        }
        let mut topology = Self {
            url: String::new(),
            children: Vec::new(),
            dir,
        };
        for port in &ports {
            let config = topology.dir.path().join(format!("nodes-{port}.conf"));
            let config = config.to_string_lossy();
            topology.children.push(spawn_redis(
                *port,
                topology.dir.path(),
                &["--cluster-enabled", "yes", "--cluster-config-file", &config],
            )?);
        }
        let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .arg("--cluster-yes")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .context("redis-cli --cluster create")?;
        if !created.success() {
            bail!("redis-cli --cluster create failed");
        }
        wait_until("Redis Cluster", || {
            for port in &ports {
                if !redis_cli(*port, &["CLUSTER", "INFO"])?.contains("cluster_state:ok") {
                    return Ok(false);
                }
            }
            Ok(true)
        })?;
        topology.url = format!("redis-cluster://{}", nodes.join(","));
        Ok(topology)
    }

    /// A master, a replica of it and one Sentinel watching them.
    pub fn sentinel() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let (master, replica, sentinel) = (free_port()?, free_port()?, free_port()?);
        let mut topology = Self {
            url: format!("redis-sentinel://127.0.0.1:{sentinel}/?sentinelServiceName=bench"),
            children: Vec::new(),
            dir,
        };
        let master_dir = topology.dir.path().join("master");
        let replica_dir = topology.dir.path().join("replica");
        std::fs::create_dir_all(&master_dir)?;
        std::fs::create_dir_all(&replica_dir)?;
        topology
            .children
            .push(spawn_redis(master, &master_dir, &[])?);
        topology.children.push(spawn_redis(
            replica,
            &replica_dir,
            &["--replicaof", "127.0.0.1", &master.to_string()],
        )?);
        let config = topology.dir.path().join("sentinel.conf");
        std::fs::write(
            &config,
            format!(
                "port {sentinel}\nbind 127.0.0.1\nsentinel monitor bench 127.0.0.1 {master} 1\n"
            ),
        )?;
        let child = Command::new("redis-server")
            .arg(&config)
            .arg("--sentinel")
            .current_dir(topology.dir.path())
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server --sentinel")?;
        topology.children.push(child);
        wait_for_port(sentinel, "redis sentinel", Duration::from_secs(10))?;
        wait_until("Redis replica", || {
            Ok(redis_cli(replica, &["INFO", "replication"])?.contains("master_link_status:up"))
        })?;
        Ok(topology)
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for RedisTopology {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `n` keys made with `idpool keys create`, of `projects` (an admin key
/// when there are none); their secrets.
pub fn create_keys(
    binary: &Path,
    database_url: &str,
    projects: &[&str],
    n: usize,
) -> anyhow::Result<Vec<String>> {
    (0..n)
        .map(|i| {
            let mut command = Command::new(binary);
            command
                .args(["keys", "create", "--name", &format!("bench-{i}")])
                .env("DATABASE_URL", database_url);
            for project in projects {
                command.args(["--project", project]);
            }
            if projects.is_empty() {
                command.arg("--admin");
            }
            let output = command.output().context("idpool keys create")?;
            if !output.status.success() {
                bail!(
                    "idpool keys create failed: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            let created: serde_json::Value = serde_json::from_slice(&output.stdout)?;
            created["key"]
                .as_str()
                .map(str::to_owned)
                .context("no key in the output of idpool keys create")
        })
        .collect()
}

pub struct Idpool {
    pub port: u16,
    child: Child,
}

impl Idpool {
    pub fn start(binary: &Path, env: &[(String, String)]) -> anyhow::Result<Self> {
        let port = free_port()?;
        let child = Command::new(binary)
            .arg("serve")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env("IDPOOL_LISTEN", format!("127.0.0.1:{port}"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        wait_for_port(port, "idpool", Duration::from_secs(60))?;
        Ok(Self { port, child })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Peak resident memory since the last reset, in MiB (VmHWM).
    pub fn peak_rss_mib(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .ok()
            .and_then(|s| {
                s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|kb| kb.parse::<f64>().ok())
                })
            })
            .map(|kb| kb / 1024.0)
            .unwrap_or(f64::NAN)
    }

    /// Starts a new peak measurement (Linux: writing 5 to clear_refs).
    pub fn reset_peak_rss(&self) {
        let _ = std::fs::write(format!("/proc/{}/clear_refs", self.pid()), "5");
    }

    pub fn stop(&mut self) {
        // Stopped already (stop, then drop): nothing to signal.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Idpool {
    fn drop(&mut self) {
        self.stop();
    }
}

/// PgBouncer in front of `postgres`, on a free port, in `pool_mode` with
/// `pool_size` server connections (for all its clients); stopped when
/// dropped.
pub struct PgBouncer {
    pub port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl PgBouncer {
    pub fn start(postgres: &Postgres, pool_mode: &str, pool_size: u32) -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let port = free_port()?;
        let path = |name: &str| dir.path().join(name).display().to_string();
        std::fs::write(dir.path().join("users.txt"), "\"postgres\" \"\"\n")?;
        std::fs::write(
            dir.path().join("pgbouncer.ini"),
            format!(
                "[databases]\n* = host=127.0.0.1 port={server}\n\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {users}\nadmin_users = postgres\n\
                 pool_mode = {pool_mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 5000\n\
                 ignore_startup_parameters = extra_float_digits,options\n\
                 logfile = {log}\npidfile = {pid}\n",
                server = postgres.port,
                users = path("users.txt"),
                log = path("pgbouncer.log"),
                pid = path("pgbouncer.pid"),
            ),
        )?;
        let mut command = Command::new("pgbouncer");
        // PgBouncer refuses to run as root.
        if is_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(dir.path())
                .status()?;
            if !status.success() {
                bail!("chown of {} to postgres failed", dir.path().display());
            }
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(dir.path().join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting pgbouncer (scripts/dev-services.sh ha-tools installs it)")?;
        wait_for_port(port, "pgbouncer", Duration::from_secs(10))?;
        Ok(Self {
            port,
            child,
            _dir: dir,
        })
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Server connections open for `database` now. PgBouncer opens one
    /// only when a transaction finds none free and keeps it for
    /// `server_idle_timeout` (10 min): the most ever in use at once.
    pub async fn servers(&self, database: &str) -> anyhow::Result<usize> {
        use sqlx::{Connection, Row};
        let admin: sqlx::postgres::PgConnectOptions = self.url("pgbouncer").parse()?;
        let mut conn = sqlx::PgConnection::connect_with(&admin.extra_float_digits(None)).await?;
        // The console speaks the simple protocol only.
        let rows = sqlx::raw_sql("SHOW SERVERS").fetch_all(&mut conn).await?;
        Ok(rows
            .iter()
            .filter(|row| row.try_get::<String, _>("database").ok().as_deref() == Some(database))
            .count())
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
