//! Postgres as operators run it in production, of the test's own: etcd,
//! three Patroni nodes (Debian's packages) and HAProxy routing to the node
//! whose Patroni `GET /primary` answers 200, on free loopback ports in a
//! temporary directory. `deploy/patroni/` holds the same settings for an
//! operator to copy (there with real addresses and a longer `loop_wait`).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::support::topology::{free_port, is_root, pg_bindir, postgres_dir};

const SCOPE: &str = "idpool-ha";

pub struct PatroniNode {
    pub name: String,
    pub api_port: u16,
    pub pg_port: u16,
    pub config: PathBuf,
    pub data: PathBuf,
    pub log: PathBuf,
    pub patroni: Option<Child>,
}

pub struct PatroniCluster {
    pub nodes: Vec<PatroniNode>,
    /// HAProxy's port: always the primary (once Patroni says which).
    pub port: u16,
    etcd: Child,
    haproxy: Child,
    http: reqwest::Client,
    dir: tempfile::TempDir,
}

/// The uid and gid Postgres runs as: ours, or `postgres` when we are root.
fn postgres_user() -> Option<(u32, u32)> {
    if !is_root() {
        return None;
    }
    let user = nix::unistd::User::from_name("postgres")
        .ok()
        .flatten()
        .expect("a postgres user (Debian's postgresql package makes it)");
    Some((user.uid.as_raw(), user.gid.as_raw()))
}

fn log_file(path: &Path) -> Stdio {
    std::fs::File::create(path).expect("log file").into()
}

impl PatroniNode {
    pub fn start(&mut self) {
        let mut command = Command::new("patroni");
        command
            .arg(&self.config)
            .stdout(log_file(&self.log))
            .stderr(Stdio::null());
        if let Some((uid, gid)) = postgres_user() {
            command
                .uid(uid)
                .gid(gid)
                .env("HOME", self.data.parent().unwrap_or(Path::new("/tmp")));
        }
        self.patroni = Some(command.spawn().expect("patroni"));
    }

    /// The postmaster's pid, from its pid file.
    fn postmaster(&self) -> Option<i32> {
        let text = std::fs::read_to_string(self.data.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// The postmaster and every process it started, SIGKILLed.
    pub fn kill_postgres(&self) {
        if let Some(postmaster) = self.postmaster() {
            for child in children_of(postmaster) {
                let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
            }
            let _ = kill(Pid::from_raw(postmaster), Signal::SIGKILL);
        }
    }

    /// Only the postmaster, SIGKILLed (its backends notice and end).
    pub fn kill_postmaster(&self) {
        if let Some(postmaster) = self.postmaster() {
            let _ = kill(Pid::from_raw(postmaster), Signal::SIGKILL);
        }
    }

    /// The node gone at once: Patroni and its Postgres SIGKILLed.
    pub fn lose(&mut self) {
        if let Some(mut patroni) = self.patroni.take() {
            let _ = patroni.kill();
            let _ = patroni.wait();
        }
        self.kill_postgres();
    }

    /// Stops (SIGSTOP) this primary's WAL senders: its standbys fall
    /// behind while it goes on committing (asynchronous replication).
    /// Returns how many it stopped.
    pub fn stop_wal_senders(&self) -> usize {
        let Some(postmaster) = self.postmaster() else {
            return 0;
        };
        let mut stopped = 0;
        for child in children_of(postmaster) {
            let title = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&title).contains("walsender") {
                let _ = kill(Pid::from_raw(child), Signal::SIGSTOP);
                stopped += 1;
            }
        }
        stopped
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.pg_port)
    }
}

/// The pids whose parent is `parent`.
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    // `pid (comm) state ppid ...`: comm may hold spaces.
                    let after = stat.rsplit_once(')')?.1;
                    after.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect()
}

impl PatroniCluster {
    /// etcd, three nodes (one leader, a synchronous standby, a replica) and
    /// HAProxy, ready: the primary answers through HAProxy.
    pub async fn start() -> Self {
        let dir = postgres_dir();
        let etcd_port = free_port();
        let peer_port = free_port();
        let etcd = Command::new("etcd")
            .args(["--name", "e", "--data-dir"])
            .arg(dir.path().join("etcd"))
            .arg(format!("--listen-client-urls=http://127.0.0.1:{etcd_port}"))
            .arg(format!(
                "--advertise-client-urls=http://127.0.0.1:{etcd_port}"
            ))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{peer_port}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}"
            ))
            .arg(format!("--initial-cluster=e=http://127.0.0.1:{peer_port}"))
            .stdout(log_file(&dir.path().join("etcd.log")))
            .stderr(Stdio::null())
            .spawn()
            .expect("etcd (scripts/dev-services.sh ha-tools installs it)");
        let mut nodes: Vec<PatroniNode> = (1..=3)
            .map(|n| {
                let node = PatroniNode {
                    name: format!("node{n}"),
                    api_port: free_port(),
                    pg_port: free_port(),
                    config: dir.path().join(format!("node{n}.yml")),
                    data: dir.path().join(format!("data{n}")),
                    log: dir.path().join(format!("patroni{n}.log")),
                    patroni: None,
                };
                write_config(&node, etcd_port, dir.path());
                node
            })
            .collect();
        if let Some((uid, _)) = postgres_user() {
            let status = Command::new("chown")
                .args(["-R", &uid.to_string()])
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(status.success());
        }
        let haproxy_port = free_port();
        let haproxy_config = dir.path().join("haproxy.cfg");
        std::fs::write(&haproxy_config, haproxy_config_text(haproxy_port, &nodes))
            .expect("haproxy config");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("client");
        // The first node bootstraps alone, so it is the leader; the others
        // join as its standbys.
        nodes[0].start();
        let mut cluster = Self {
            nodes,
            port: haproxy_port,
            etcd,
            haproxy: Command::new("haproxy")
                .arg("-f")
                .arg(&haproxy_config)
                .arg("-db")
                .stdout(log_file(&dir.path().join("haproxy.log")))
                .stderr(Stdio::null())
                .spawn()
                .expect("haproxy (scripts/dev-services.sh ha-tools installs it)"),
            http,
            dir,
        };
        cluster
            .until(Duration::from_secs(60), "a leader", |members| {
                members
                    .iter()
                    .any(|m| m["role"] == "leader" && m["state"] == "running")
            })
            .await;
        cluster.nodes[1].start();
        cluster.nodes[2].start();
        cluster.wait_healthy().await;
        cluster
    }

    /// The cluster's members as Patroni's `GET /cluster` lists them (asked
    /// of any node that answers).
    pub async fn members(&self) -> Vec<Value> {
        for node in &self.nodes {
            let answer = self
                .http
                .get(format!("http://127.0.0.1:{}/cluster", node.api_port))
                .send()
                .await;
            if let Ok(answer) = answer
                && let Ok(body) = answer.json::<Value>().await
            {
                return body["members"].as_array().cloned().unwrap_or_default();
            }
        }
        Vec::new()
    }

    async fn until(&self, within: Duration, what: &str, check: impl Fn(&[Value]) -> bool) {
        let mut members = Vec::new();
        let reached = crate::support::app::within(within, async || {
            members = self.members().await;
            check(&members).then_some(())
        })
        .await;
        assert!(
            reached.is_some(),
            "Patroni cluster: no {what} within {within:?}: {members:?}\n{}",
            self.logs()
        );
    }

    /// Every node running, one leader, the others streaming from it (one
    /// synchronous in synchronous mode), and the leader answering through
    /// HAProxy.
    pub async fn wait_healthy(&self) {
        self.until(Duration::from_secs(90), "healthy cluster", |members| {
            let running = members
                .iter()
                .filter(|m| m["state"] == "running" || m["state"] == "streaming")
                .count();
            let leader = members.iter().filter(|m| m["role"] == "leader").count();
            let timeline = members
                .iter()
                .find(|m| m["role"] == "leader")
                .map(|m| m["timeline"].clone());
            let caught_up = members.iter().filter(|m| m["role"] != "leader").all(|m| {
                m["timeline"] == timeline.clone().unwrap_or_default()
                    && m["lag"].as_i64().is_some_and(|lag| lag < 1024 * 1024)
            });
            let synchronous = members.iter().any(|m| m["role"] == "sync_standby");
            members.len() == 3
                && running == 3
                && leader == 1
                && caught_up
                && (synchronous || !self.synchronous_mode_wanted())
        })
        .await;
        self.wait_primary_through_haproxy().await;
    }

    fn synchronous_mode_wanted(&self) -> bool {
        !self.dir.path().join("asynchronous").exists()
    }

    async fn wait_primary_through_haproxy(&self) {
        let writable = crate::support::app::within(Duration::from_secs(30), async || {
            let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&self.url("postgres"))
                .await
                .ok()?;
            let primary = sqlx::query_scalar::<_, bool>("SELECT NOT pg_is_in_recovery()")
                .fetch_one(&mut conn)
                .await
                .ok()?;
            primary.then_some(())
        })
        .await;
        assert!(
            writable.is_some(),
            "no primary through HAProxy\n{}",
            self.logs()
        );
    }

    /// The leader's index.
    pub async fn leader(&self) -> usize {
        let members = self.members().await;
        let name = members
            .iter()
            .find(|m| m["role"] == "leader")
            .and_then(|m| m["name"].as_str())
            .unwrap_or_default()
            .to_owned();
        self.nodes
            .iter()
            .position(|n| n.name == name)
            .unwrap_or_else(|| panic!("no leader: {members:?}"))
    }

    /// A replica's index (not the leader).
    pub async fn a_replica(&self) -> usize {
        let leader = self.leader().await;
        (leader + 1) % self.nodes.len()
    }

    /// A planned switchover (Patroni's `POST /switchover`), waited for.
    pub async fn switchover(&self) {
        let leader = self.leader().await;
        let answer = self
            .http
            .post(format!(
                "http://127.0.0.1:{}/switchover",
                self.nodes[leader].api_port
            ))
            .timeout(Duration::from_secs(60))
            .json(&json!({"leader": self.nodes[leader].name}))
            .send()
            .await
            .expect("switchover");
        let status = answer.status();
        let text = answer.text().await.unwrap_or_default();
        assert!(status.is_success(), "switchover: {status} {text}");
        let old = self.nodes[leader].name.clone();
        self.until(Duration::from_secs(60), "new leader", move |members| {
            members
                .iter()
                .any(|m| m["role"] == "leader" && m["name"] != old.as_str())
        })
        .await;
    }

    /// Synchronous replication off, and Patroni allowed to promote a
    /// standby however far behind (an operator choosing availability).
    pub async fn go_asynchronous(&self) {
        std::fs::write(self.dir.path().join("asynchronous"), "").expect("marker");
        let leader = self.leader().await;
        let answer = self
            .http
            .patch(format!(
                "http://127.0.0.1:{}/config",
                self.nodes[leader].api_port
            ))
            .json(&json!({"synchronous_mode": false, "maximum_lag_on_failover": 1_073_741_824_i64}))
            .send()
            .await
            .expect("patch config");
        assert!(answer.status().is_success(), "config: {}", answer.status());
        self.until(
            Duration::from_secs(30),
            "asynchronous replicas",
            |members| !members.iter().any(|m| m["role"] == "sync_standby"),
        )
        .await;
    }

    /// After losing the leader: waits for another node to lead.
    pub async fn wait_new_leader(&self, lost: usize) {
        let old = self.nodes[lost].name.clone();
        self.until(
            Duration::from_secs(60),
            "leader after the loss",
            move |members| {
                members.iter().any(|m| {
                    m["role"] == "leader" && m["name"] != old.as_str() && m["state"] == "running"
                })
            },
        )
        .await;
        self.wait_primary_through_haproxy().await;
    }

    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// Every log of the cluster, for a failure message.
    pub fn logs(&self) -> String {
        let mut text = String::new();
        for name in [
            "patroni1.log",
            "patroni2.log",
            "patroni3.log",
            "haproxy.log",
        ] {
            let log = std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(15).collect();
            text.push_str(&format!("--- {name} (last lines)\n"));
            for line in tail.into_iter().rev() {
                text.push_str(line);
                text.push('\n');
            }
        }
        text
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.lose();
        }
        let _ = self.haproxy.kill();
        let _ = self.haproxy.wait();
        let _ = self.etcd.kill();
        let _ = self.etcd.wait();
    }
}

fn write_config(node: &PatroniNode, etcd_port: u16, dir: &Path) {
    let text = patroni_config_text(node, etcd_port, dir);
    std::fs::write(&node.config, text).expect("patroni config");
}

/// A node's Patroni configuration: `deploy/patroni/patroni.yml`'s settings
/// on loopback addresses, with a quicker `loop_wait`.
pub fn patroni_config_text(node: &PatroniNode, etcd_port: u16, dir: &Path) -> String {
    let bin_dir = pg_bindir();
    format!(
        "scope: {SCOPE}
name: {name}
restapi:
  listen: 127.0.0.1:{api}
  connect_address: 127.0.0.1:{api}
etcd3:
  hosts: 127.0.0.1:{etcd_port}
log:
  level: WARNING
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 1
    retry_timeout: 4
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_log_hints: 'on'
        max_wal_senders: 10
        max_replication_slots: 10
        max_connections: 200
  initdb:
    - encoding: UTF8
  pg_hba:
    - local all all trust
    - host replication postgres 127.0.0.1/32 trust
    - host all all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:{pg}
  connect_address: 127.0.0.1:{pg}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass-{name}
  authentication:
    replication:
      username: postgres
    superuser:
      username: postgres
  parameters:
    unix_socket_directories: {dir}
",
        name = node.name,
        api = node.api_port,
        pg = node.pg_port,
        data = node.data.display(),
        bin = bin_dir.display(),
        dir = dir.display(),
    )
}

pub fn haproxy_config_text(port: u16, nodes: &[PatroniNode]) -> String {
    let mut text = format!(
        "global
    maxconn 1000
defaults
    mode tcp
    timeout connect 2s
    timeout client 30m
    timeout server 30m
    timeout check 1s
listen primary
    bind 127.0.0.1:{port}
    option httpchk GET /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
"
    );
    for node in nodes {
        text.push_str(&format!(
            "    server {} 127.0.0.1:{} check port {}\n",
            node.name, node.pg_port, node.api_port
        ));
    }
    text
}

/// The value of the first `key: value` line (YAML) or `key value` line
/// (HAProxy) of `text`, quotes taken off.
pub fn setting<'t>(text: &'t str, key: &str) -> Option<&'t str> {
    text.lines().find_map(|line| {
        let line = line.trim();
        let rest = line.strip_prefix(key)?;
        let value = rest.strip_prefix(':').unwrap_or(rest);
        (value.starts_with(' ') || value.is_empty())
            .then(|| value.trim().trim_matches(|c| c == '\'' || c == '"'))
    })
}
