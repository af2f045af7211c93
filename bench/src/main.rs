//! `make bench`: starts its own Postgres, Redis and idpool (release), runs
//! every scenario of the performance issue, prints one table and writes it
//! to `target/bench/latest.json`, then stops what it started.
//!
//! Absolute rates are noisy on a shared machine, so ratios are measured in
//! alternating rounds (baseline, subject, baseline, subject, ...) and the
//! median of the per-round ratios is reported: a slow phase of the machine
//! hits both sides of a round alike.

mod endpoints;
mod load;
mod neighbour;
mod pooler;
mod registers;
mod services;
mod tenants;
mod webhook;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use clap::Parser;
use hyper::Method;
use serde::Serialize;
use serde_json::json;

use load::{Call, Outcome, Until};
use services::{Idpool, Postgres, Redis, RedisTopology};

/// The projects the scenarios use; every bench key may use all of them.
const PROJECTS: [&str; 11] = [
    "BENCH", "IDLE", "DOCB", "DOCS", "DRAIN", "HOSTILE", "GAPP", "GAPL", "GAPU", "GAPR", "GAPM",
];
/// API keys, one per load connection (64 at most).
const KEYS: usize = 64;

const SCENARIOS: &[&str] = &[
    "delivery",
    "ratio",
    "latency",
    "fallback",
    "topologies",
    "id-batches",
    "doc-batches",
    "doc-single",
    "gapless",
    "drain",
    "neighbour",
    "poolers",
    "webhooks",
    "endpoints",
    "registers",
    "tenants",
];

#[derive(Parser)]
#[command(about = "idpool benchmarks")]
struct Args {
    /// About a tenth of the full size, for a smoke run.
    #[arg(long)]
    quick: bool,
    /// Run only these scenarios (comma separated): delivery, ratio,
    /// latency, fallback, topologies, id-batches, doc-batches, doc-single,
    /// gapless, drain, neighbour, poolers, webhooks, endpoints, registers,
    /// tenants.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The neighbour scenario's floods (comma separated: keys, readers,
    /// trickles, listings, counts); all by default.
    #[arg(long, value_delimiter = ',')]
    floods: Vec<String>,
    /// Extra environment for idpool, KEY=VALUE (repeatable).
    #[arg(long = "idpool-env")]
    idpool_env: Vec<String>,
    /// The idpool binary to start (a release build).
    #[arg(long, default_value = "target/release/idpool")]
    binary: PathBuf,
    /// Where the table goes as JSON.
    #[arg(long, default_value = "target/bench/latest.json")]
    out: PathBuf,
    /// Working directory for the bench's own Postgres.
    #[arg(long, default_value = "target/bench/postgres")]
    pg_dir: PathBuf,
}

/// One row of the table.
#[derive(Serialize, Clone)]
struct Row {
    figure: String,
    value: f64,
    unit: String,
    goal: String,
    /// None for figures shown for context, without a goal.
    pass: Option<bool>,
}

struct Sizes {
    /// Rounds of each alternating ratio measurement, and the length of
    /// each side of a round.
    rounds: usize,
    slice: Duration,
    /// How long the latency scenario runs.
    latency_run: Duration,
    ids_total: u64,
    documents_total: u64,
    drained_sequences: usize,
    /// Documents sent one at a time for the idle delivery figure.
    idle_documents: u64,
    /// Goals in wall time scale with the size.
    scale: f64,
    /// Documents in the hostile neighbour's outbox.
    neighbour_documents: u64,
    /// Documents per round delivered to each webhook target.
    webhook_documents: u64,
    /// Projects of the tenants scenario (ten sequences each).
    tenant_projects: usize,
}

struct Bench {
    addr: SocketAddr,
    db: sqlx::PgPool,
    rows: Vec<Row>,
    /// Every number answered, per sequence, for the duplicate check.
    seen: HashMap<Arc<str>, HashSet<i64>>,
    duplicates: u64,
    checked: u64,
    peak_rss: Vec<(String, f64)>,
}

impl Bench {
    fn row(&mut self, figure: &str, value: f64, unit: &str, goal: &str, pass: Option<bool>) {
        let shown = if value.abs() >= 100.0 {
            format!("{value:.0}")
        } else {
            format!("{value:.3}")
        };
        let verdict = match pass {
            Some(true) => "pass",
            Some(false) => "MISSED",
            None => "",
        };
        println!("{figure:<72} {shown:>10} {unit:<8} {goal:<10} {verdict}");
        self.rows.push(Row {
            figure: figure.to_owned(),
            value,
            unit: unit.to_owned(),
            goal: goal.to_owned(),
            pass,
        });
    }

    /// A figure shown for context, without a goal.
    fn context(&mut self, figure: &str, value: f64, unit: &str) {
        self.row(figure, value, unit, "", None);
    }

    /// A figure whose goal is an upper bound.
    fn at_least(&mut self, figure: &str, value: f64, unit: &str, goal: f64) {
        self.row(
            figure,
            value,
            unit,
            &format!(">= {goal}"),
            Some(value >= goal),
        );
    }

    fn at_most(&mut self, figure: &str, value: f64, unit: &str, goal: f64) {
        self.row(
            figure,
            value,
            unit,
            &format!("<= {goal}"),
            Some(value <= goal),
        );
    }

    /// Adds the numbers of `outcome` to the duplicate check and fails the
    /// run on any answer that was not a success.
    /// Every number answered goes into the duplicate check.
    fn record_numbers(&mut self, outcome: &Outcome) {
        for (sequence, numbers) in &outcome.numbers {
            let seen = self.seen.entry(sequence.clone()).or_default();
            for n in numbers {
                self.checked += 1;
                if !seen.insert(*n) {
                    self.duplicates += 1;
                }
            }
        }
    }

    fn check(&mut self, what: &str, outcome: &Outcome) -> anyhow::Result<()> {
        self.record_numbers(outcome);
        if outcome.failed > 0 {
            bail!(
                "{what}: {} of {} requests failed (statuses {:?})",
                outcome.failed,
                outcome.requests,
                outcome.statuses
            );
        }
        Ok(())
    }

    async fn count(&self, sql: &'static str, project: &str) -> anyhow::Result<i64> {
        Ok(sqlx::query_scalar(sql)
            .bind(project)
            .fetch_one(&self.db)
            .await?)
    }

    /// Waits until every outbox row of `project` is committed.
    async fn all_committed(
        &self,
        project: &str,
        expected: i64,
        limit: Duration,
    ) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let committed = self
                .count(
                    "SELECT count(*) FROM id_outbox WHERE tenant_code = $1 AND status = 'committed'",
                    project,
                )
                .await?;
            if committed >= expected {
                return Ok(());
            }
            if started.elapsed() > limit {
                bail!("{project}: {committed} of {expected} committed after {limit:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn wait_for_mode(&self, mode: &str) -> anyhow::Result<()> {
        wait_for_mode(self.addr, mode).await
    }
}

/// Until the idpool at `addr` says it serves in `mode` (`pool`, `fallback`).
async fn wait_for_mode(addr: SocketAddr, mode: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let now = match load::get(addr, "/readyz").await {
            Ok((_, body)) => serde_json::from_slice::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["mode"].as_str().map(str::to_owned))
                .unwrap_or_default(),
            Err(_) => String::new(),
        };
        if now == mode {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(30) {
            bail!("idpool at {addr} did not reach mode {mode}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn ids_call(sequence: &'static str, count: u64) -> impl Fn(u64) -> Call + Send + Sync + 'static {
    let body =
        Bytes::from(json!({"project": "BENCH", "type": sequence, "count": count}).to_string());
    let name: Arc<str> = format!("BENCH/{sequence}").into();
    move |_| Call {
        method: Method::POST,
        path: "/ids",
        body: body.clone(),
        sequence: Some(name.clone()),
    }
}

/// Every request of `outcome` was answered 400 (a controlled variant).
fn all_refused(what: &str, outcome: &Outcome) -> anyhow::Result<()> {
    let refused = outcome.statuses.get(&400).copied().unwrap_or(0);
    if refused != outcome.requests {
        bail!("{what}: expected 400 only, got {:?}", outcome.statuses);
    }
    Ok(())
}

fn healthz_call(_: u64) -> Call {
    Call {
        method: Method::GET,
        path: "/healthz",
        body: Bytes::new(),
        sequence: None,
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        f64::NAN
    } else if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

/// Rates of a subject and its baseline measured in alternating rounds.
#[derive(Default)]
struct Rounds {
    subject: Vec<f64>,
    baseline: Vec<f64>,
    ratios: Vec<f64>,
}

impl Rounds {
    fn push(&mut self, subject: f64, baseline: f64) {
        self.subject.push(subject);
        self.baseline.push(baseline);
        self.ratios.push(subject / baseline);
    }

    /// Rows for the median of each side, then the median of the per-round
    /// ratios against `goal` (at least).
    fn report(mut self, bench: &mut Bench, subject: &str, baseline: &str, ratio: &str, goal: f64) {
        let n = self.ratios.len();
        let baseline_rate = median(&mut self.baseline);
        bench.context(
            &format!("{baseline} (median of {n} rounds)"),
            baseline_rate,
            "req/s",
        );
        let subject_rate = median(&mut self.subject);
        bench.context(
            &format!("{subject} (median of {n} rounds)"),
            subject_rate,
            "req/s",
        );
        let value = median(&mut self.ratios);
        bench.row(
            &format!("{ratio} (median of per-round ratios)"),
            value,
            "ratio",
            &format!(">= {goal}"),
            Some(value >= goal),
        );
    }

    /// The median of the per-round ratios, for context (no goal).
    fn context(mut self, bench: &mut Bench, ratio: &str) {
        let n = self.ratios.len();
        bench.context(
            &format!("{ratio} (median of {n} rounds)"),
            median(&mut self.ratios),
            "ratio",
        );
    }
}

fn main() {
    let args = Args::parse();
    let outcome = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| runtime.block_on(run(args)));
    if let Err(e) = outcome {
        eprintln!("bench failed: {e:#}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let sizes = if args.quick {
        Sizes {
            rounds: 3,
            slice: Duration::from_millis(700),
            latency_run: Duration::from_secs(2),
            ids_total: 20_000,
            documents_total: 20_000,
            drained_sequences: 100,
            idle_documents: 5,
            scale: 0.1,
            neighbour_documents: 2_000,
            webhook_documents: 500,
            tenant_projects: 1_000,
        }
    } else {
        Sizes {
            rounds: 5,
            slice: Duration::from_secs(2),
            latency_run: Duration::from_secs(10),
            ids_total: 200_000,
            documents_total: 200_000,
            drained_sequences: 1000,
            idle_documents: 20,
            scale: 1.0,
            neighbour_documents: 20_000,
            webhook_documents: 5_000,
            tenant_projects: 10_000,
        }
    };
    for name in &args.only {
        if !SCENARIOS.contains(&name.as_str()) {
            bail!("unknown scenario {name:?}; known: {}", SCENARIOS.join(", "));
        }
    }
    let wanted = |name: &str| args.only.is_empty() || args.only.iter().any(|n| n == name);
    if !args.binary.exists() {
        bail!(
            "{} not found: build it with cargo build --release",
            args.binary.display()
        );
    }
    let mut extra_env = Vec::new();
    for pair in &args.idpool_env {
        let (key, value) = pair
            .split_once('=')
            .with_context(|| format!("--idpool-env {pair:?} is not KEY=VALUE"))?;
        extra_env.push((key.to_owned(), value.to_owned()));
    }

    println!("starting Postgres, Redis and idpool of our own ...");
    let postgres = Postgres::start(&args.pg_dir)?;
    let mut redis = Redis::start()?;
    let database = postgres.url("idpool_bench");
    // The bench measures capacity, not the per-key limit: one load
    // connection sends far more than a customer's default allowance. The
    // limiter still runs on every request.
    let mut env = vec![
        ("DATABASE_URL".to_owned(), database.clone()),
        ("REDIS_URL".to_owned(), redis.url()),
        ("IDPOOL_RATE_LIMIT".to_owned(), "1000000".to_owned()),
    ];
    env.extend(extra_env);
    let idpool = Idpool::start(&args.binary, &env)?;
    let addr: SocketAddr = format!("127.0.0.1:{}", idpool.port).parse()?;
    // Like customers: project keys from the CLI, one per load connection.
    let keys = services::create_keys(&args.binary, &database, &PROJECTS, KEYS)?;
    let admin = services::create_keys(&args.binary, &database, &[], 1)?;
    load::use_keys(&keys, &admin[0])?;
    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&database)
        .await
        .context("bench connection to its Postgres")?;
    let mut bench = Bench {
        addr,
        db,
        rows: Vec::new(),
        seen: HashMap::new(),
        duplicates: 0,
        checked: 0,
        peak_rss: Vec::new(),
    };
    bench.wait_for_mode("pool").await?;
    println!(
        "machine: {} cores; idpool {}, Postgres and Redis of this run share them with this load generator",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        args.binary.display()
    );
    println!();
    println!(
        "{:<72} {:>10} {:<8} {:<10} result",
        "figure", "value", "unit", "goal"
    );

    if wanted("delivery") {
        idle_delivery(&mut bench, &sizes).await?;
    }
    if wanted("ratio") {
        ratio_to_healthz(&mut bench, &idpool, &postgres, &sizes).await?;
    }
    if wanted("latency") {
        light_load_latency(&mut bench, &idpool, &postgres, &sizes).await?;
    }
    if wanted("fallback") {
        redis_up_versus_stopped(&mut bench, &idpool, &mut redis, &sizes).await?;
    }
    if wanted("topologies") {
        redis_topologies(&mut bench, &args.binary, &env, &sizes).await?;
    }
    if wanted("id-batches") {
        id_batches(&mut bench, &idpool, &sizes).await?;
    }
    if wanted("doc-batches") {
        document_batches(&mut bench, &idpool, &sizes).await?;
    }
    if wanted("doc-single") {
        single_documents(&mut bench, &idpool, &postgres, &sizes).await?;
    }
    if wanted("gapless") {
        gapless_documents(&mut bench, &idpool, &postgres, &sizes).await?;
    }
    if wanted("neighbour") {
        let intensity = if args.floods.is_empty() {
            neighbour::INTENSITY
        } else {
            neighbour::Intensity::only(&args.floods)
        };
        hostile_neighbour(&mut bench, &idpool, &sizes, &intensity).await?;
    }
    if wanted("poolers") {
        pooler::many_instances(&mut bench, &args.binary, &env, &postgres, &sizes).await?;
    }
    if wanted("webhooks") {
        webhook::answer_bodies(&mut bench, &args.binary, &env, &postgres, &sizes).await?;
    }
    if wanted("endpoints") {
        endpoints::deliveries(&mut bench, &args.binary, &env, &postgres, &sizes).await?;
    }
    if wanted("registers") {
        registers::chained(&mut bench, &idpool, &args.binary, &database, &sizes).await?;
    }
    if wanted("tenants") {
        tenants::crowd(&mut bench, &args.binary, &env, &postgres, &sizes).await?;
    }
    if !bench.peak_rss.is_empty() {
        let (worst, peak) =
            bench
                .peak_rss
                .iter()
                .cloned()
                .fold((String::new(), 0.0_f64), |acc, (s, v)| {
                    if v > acc.1 { (s, v) } else { acc }
                });
        bench.row(
            &format!("peak RSS of idpool, any scenario (worst: {worst})"),
            peak,
            "MiB",
            "<= 64",
            Some(peak <= 64.0),
        );
    }
    if wanted("drain") {
        drained_pools(&mut bench, &idpool, &sizes).await?;
    }
    let checked = bench.checked;
    let duplicates = bench.duplicates as f64;
    bench.row(
        &format!("duplicates seen by the load generator ({checked} numbers checked)"),
        duplicates,
        "IDs",
        "0",
        Some(duplicates == 0.0),
    );

    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&bench.rows)?)?;
    println!("\nwritten to {}", args.out.display());
    drop(idpool);
    drop(redis);
    drop(postgres);
    let missed = bench.rows.iter().filter(|r| r.pass == Some(false)).count();
    if missed > 0 {
        println!("{missed} goal(s) missed");
    }
    Ok(())
}

/// On an idle system: from the 202 of `POST /documents` until
/// `GET /api/v1/documents/{id}` says `committed` (polled every millisecond),
/// one document at a time.
async fn idle_delivery(bench: &mut Bench, sizes: &Sizes) -> anyhow::Result<()> {
    let mut waits = Vec::new();
    for i in 0..sizes.idle_documents {
        let body = Bytes::from(
            json!({"project": "IDLE", "type": "1", "metadata": metadata(i)}).to_string(),
        );
        let (status, answer) = load::send(bench.addr, Method::POST, "/documents", body).await?;
        let accepted = Instant::now();
        if status != 202 {
            bail!("POST /documents answered {status}");
        }
        let id = serde_json::from_slice::<serde_json::Value>(&answer)?["id"]
            .as_str()
            .context("no id in the 202")?
            .to_owned();
        loop {
            let (_, view) = load::get(bench.addr, &format!("/api/v1/documents/{id}")).await?;
            let view: serde_json::Value = serde_json::from_slice(&view)?;
            if view["status"] == "committed" {
                break;
            }
            if accepted.elapsed() > Duration::from_secs(10) {
                bail!("{id} not committed after 10 s: {view}");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        waits.push(accepted.elapsed().as_secs_f64() * 1000.0);
        // Idle again before the next one.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let n = waits.len();
    let worst = waits.iter().cloned().fold(0.0, f64::max);
    bench.context(
        &format!("202 -> committed on an idle system, median of {n} documents"),
        median(&mut waits),
        "ms",
    );
    bench.row(
        &format!("202 -> committed on an idle system, slowest of {n} documents"),
        worst,
        "ms",
        "< 1000",
        Some(worst < 1000.0),
    );
    Ok(())
}

/// `POST /ids` count 1 against `GET /healthz`, 64 connections, in
/// alternating rounds.
async fn ratio_to_healthz(
    bench: &mut Bench,
    idpool: &Idpool,
    postgres: &Postgres,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    idpool.reset_peak_rss();
    let addr = bench.addr;
    // Warm up: the pool grows to its traffic before anything is measured.
    let warm = load::run(
        addr,
        64,
        Until::Elapsed(Duration::from_secs(1)),
        ids_call("single", 1),
    )
    .await?;
    bench.check("warm-up", &warm)?;
    let mut rounds = Rounds::default();
    // The controlled variant: the same request with count 0, read, parsed
    // and answered 400 by the same stack, issuing nothing: the share of
    // GET /healthz that the HTTP and JSON work alone leaves.
    let mut refused = Rounds::default();
    for _ in 0..sizes.rounds {
        let base = load::run(addr, 64, Until::Elapsed(sizes.slice), healthz_call).await?;
        let subject =
            load::run(addr, 64, Until::Elapsed(sizes.slice), ids_call("single", 1)).await?;
        bench.check("POST /ids count 1", &subject)?;
        rounds.push(subject.per_second(), base.per_second());
        let variant =
            load::run(addr, 64, Until::Elapsed(sizes.slice), ids_call("single", 0)).await?;
        all_refused("POST /ids count 0", &variant)?;
        refused.push(variant.per_second(), base.per_second());
    }
    refused.context(
        bench,
        "controlled variant: POST /ids count 0 (400, nothing issued) ÷ GET /healthz",
    );
    rounds.report(
        bench,
        "POST /ids count 1, 64 connections",
        "GET /healthz, 64 connections",
        "POST /ids count 1 ÷ GET /healthz",
        0.8,
    );
    // Against Postgres handing out numbers itself, on the same server, in
    // alternating rounds.
    let mut rounds = Rounds::default();
    let seconds = sizes.slice.as_secs_f64().ceil().max(1.0) as u64;
    for _ in 0..sizes.rounds {
        let nextval = postgres.pgbench_nextval(64, seconds)?;
        let subject =
            load::run(addr, 64, Until::Elapsed(sizes.slice), ids_call("single", 1)).await?;
        bench.check("POST /ids count 1", &subject)?;
        rounds.push(subject.per_second(), nextval.tps);
    }
    rounds.report(
        bench,
        "POST /ids count 1, 64 connections (beside pgbench)",
        "pgbench SELECT nextval, 64 prepared clients, same Postgres",
        "POST /ids count 1 ÷ pgbench nextval",
        1.0,
    );
    bench
        .peak_rss
        .push(("ids and healthz".into(), idpool.peak_rss_mib()));
    Ok(())
}

/// p99 of `POST /ids` count 1 at 8 connections, beside the p99 of a bare
/// durable single-row INSERT at 8 clients on the same Postgres.
async fn light_load_latency(
    bench: &mut Bench,
    idpool: &Idpool,
    postgres: &Postgres,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    idpool.reset_peak_rss();
    let warm = load::run(
        bench.addr,
        8,
        Until::Elapsed(Duration::from_secs(1)),
        ids_call("light", 1),
    )
    .await?;
    bench.check("warm-up", &warm)?;
    // The tail against the server's own floor: GET /healthz at the same
    // load, in alternating rounds, so a slow phase hits both sides.
    let (mut ids_p99, mut healthz_p99, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut refused_ratios = Vec::new();
    for _ in 0..sizes.rounds {
        let base = load::run(bench.addr, 8, Until::Elapsed(sizes.slice), healthz_call).await?;
        let subject = load::run(
            bench.addr,
            8,
            Until::Elapsed(sizes.slice),
            ids_call("light", 1),
        )
        .await?;
        bench.check("POST /ids count 1, 8 connections", &subject)?;
        let variant = load::run(
            bench.addr,
            8,
            Until::Elapsed(sizes.slice),
            ids_call("light", 0),
        )
        .await?;
        all_refused("POST /ids count 0, 8 connections", &variant)?;
        let (subject, base) = (subject.quantile_ms(0.99), base.quantile_ms(0.99));
        ids_p99.push(subject);
        healthz_p99.push(base);
        ratios.push(subject / base);
        refused_ratios.push(variant.quantile_ms(0.99) / base);
    }
    bench.context(
        "controlled variant: POST /ids count 0 (400) p99 ÷ GET /healthz p99, 8 conn. (median)",
        median(&mut refused_ratios),
        "ratio",
    );
    let n = ratios.len();
    let worst = ratios.iter().copied().fold(0.0, f64::max);
    bench.context(
        &format!("GET /healthz, 8 connections: p99 latency (median of {n} rounds)"),
        median(&mut healthz_p99),
        "ms",
    );
    bench.context(
        &format!("POST /ids count 1, 8 connections: p99 latency (median of {n} rounds)"),
        median(&mut ids_p99),
        "ms",
    );
    bench.context(
        "POST /ids p99 ÷ GET /healthz p99, 8 connections: worst round",
        worst,
        "ratio",
    );
    bench.at_most(
        "POST /ids p99 ÷ GET /healthz p99, 8 connections (median of per-round ratios)",
        median(&mut ratios),
        "ratio",
        1.5,
    );
    let light = load::run(
        bench.addr,
        8,
        Until::Elapsed(sizes.latency_run),
        ids_call("light", 1),
    )
    .await?;
    bench.check("POST /ids count 1, 8 connections", &light)?;
    bench.context(
        "POST /ids count 1, 8 connections",
        light.per_second(),
        "req/s",
    );
    bench.context(
        "POST /ids count 1, 8 connections: p50 latency",
        light.quantile_ms(0.5),
        "ms",
    );
    let p99 = light.quantile_ms(0.99);
    bench.context("POST /ids count 1, 8 connections: p99 latency", p99, "ms");
    let floor = postgres.pgbench_insert(8, sizes.latency_run.as_secs().max(2))?;
    bench.context(
        "pgbench single-row INSERT, 8 clients, same Postgres: p99 latency",
        floor.p99_ms,
        "ms",
    );
    // The floor any response that waits for a durable commit sits on.
    bench.at_most(
        "POST /ids p99 ÷ pgbench INSERT p99, 8 connections",
        p99 / floor.p99_ms,
        "ratio",
        1.0,
    );
    bench
        .peak_rss
        .push(("light load".into(), idpool.peak_rss_mib()));
    Ok(())
}

/// `POST /ids` count 1 with Redis up against the same with Redis stopped
/// (every ID from Postgres), 64 connections, in alternating rounds.
async fn redis_up_versus_stopped(
    bench: &mut Bench,
    idpool: &Idpool,
    redis: &mut Redis,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    idpool.reset_peak_rss();
    let addr = bench.addr;
    let slice = sizes.slice;
    let measure = || load::run(addr, 64, Until::Elapsed(slice), ids_call("fallback", 1));
    let mut rounds = Rounds::default();
    for _ in 0..sizes.rounds {
        bench.wait_for_mode("pool").await?;
        let pooled = measure().await?;
        bench.check("POST /ids, Redis up", &pooled)?;
        redis.stop();
        bench.wait_for_mode("fallback").await?;
        let direct = measure().await?;
        bench.check("POST /ids, Redis stopped", &direct)?;
        redis.restart()?;
        rounds.push(direct.per_second(), pooled.per_second());
    }
    bench.wait_for_mode("pool").await?;
    // Degraded mode must still serve a useful share of normal throughput.
    rounds.report(
        bench,
        "POST /ids count 1, Redis stopped, 64 connections",
        "POST /ids count 1, Redis up, 64 connections",
        "POST /ids count 1: Redis stopped ÷ Redis up",
        0.2,
    );
    bench
        .peak_rss
        .push(("redis stopped".into(), idpool.peak_rss_mib()));
    Ok(())
}

/// `POST /ids` count 1, 64 connections, through three idpools side by side:
/// on the single Redis, on a Redis Cluster of three masters and on a master
/// watched by Sentinel (with a replica), in alternating rounds. All three
/// share the bench's Postgres counter, so the duplicate check spans them.
async fn redis_topologies(
    bench: &mut Bench,
    binary: &std::path::Path,
    env: &[(String, String)],
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let cluster = RedisTopology::cluster()?;
    let sentinel = RedisTopology::sentinel()?;
    let on = |url: &str| {
        let mut env = env.to_vec();
        env.retain(|(key, _)| key != "REDIS_URL");
        env.push(("REDIS_URL".to_owned(), url.to_owned()));
        Idpool::start(binary, &env)
    };
    let on_cluster = on(cluster.url())?;
    let on_sentinel = on(sentinel.url())?;
    let targets: [(&str, SocketAddr); 3] = [
        ("single Redis", bench.addr),
        (
            "Redis Cluster, 3 masters",
            format!("127.0.0.1:{}", on_cluster.port).parse()?,
        ),
        (
            "Sentinel, master + replica",
            format!("127.0.0.1:{}", on_sentinel.port).parse()?,
        ),
    ];
    for (name, addr) in targets {
        wait_for_mode(addr, "pool").await?;
        let warm = load::run(
            addr,
            64,
            Until::Elapsed(Duration::from_secs(1)),
            ids_call("topology", 1),
        )
        .await?;
        bench.check(&format!("warm-up, {name}"), &warm)?;
    }
    let mut rates: [Vec<f64>; 3] = Default::default();
    let mut ratios: [Vec<f64>; 2] = Default::default();
    for _ in 0..sizes.rounds {
        let mut round = [0.0; 3];
        for (i, (name, addr)) in targets.iter().enumerate() {
            let outcome = load::run(
                *addr,
                64,
                Until::Elapsed(sizes.slice),
                ids_call("topology", 1),
            )
            .await?;
            bench.check(&format!("POST /ids, {name}"), &outcome)?;
            round[i] = outcome.per_second();
            rates[i].push(round[i]);
        }
        ratios[0].push(round[1] / round[0]);
        ratios[1].push(round[2] / round[0]);
    }
    let n = sizes.rounds;
    for (i, (name, _)) in targets.iter().enumerate() {
        bench.context(
            &format!("POST /ids count 1, 64 conn., {name} (median of {n} rounds)"),
            median(&mut rates[i]),
            "IDs/s",
        );
    }
    for (i, (name, _)) in targets[1..].iter().enumerate() {
        bench.context(
            &format!("POST /ids count 1: {name} ÷ single Redis (median of per-round ratios)"),
            median(&mut ratios[i]),
            "ratio",
        );
    }
    Ok(())
}

/// IDs in batches of 1,000, 64 connections, wall time.
async fn id_batches(bench: &mut Bench, idpool: &Idpool, sizes: &Sizes) -> anyhow::Result<()> {
    idpool.reset_peak_rss();
    let batches = load::run(
        bench.addr,
        64,
        Until::Count(sizes.ids_total / 1000),
        ids_call("batch", 1000),
    )
    .await?;
    bench.check("POST /ids count 1000", &batches)?;
    let goal = 0.25 * sizes.scale;
    let took = batches.elapsed.as_secs_f64();
    bench.at_most(
        &format!("{} IDs with POST /ids count 1000 (wall)", sizes.ids_total),
        took,
        "s",
        goal,
    );
    bench
        .peak_rss
        .push(("id batches".into(), idpool.peak_rss_mib()));
    Ok(())
}

fn metadata(i: u64) -> serde_json::Value {
    json!({"title": format!("drawing {i}"), "rev": i % 7, "tags": ["bench", "migration"]})
}

/// A document scenario's load and how long it took.
struct DocumentRun {
    load: Outcome,
    /// From the first request until the last was answered.
    accepted_s: f64,
    /// From the first request until every document of `project` was committed.
    committed_s: f64,
}

/// Sends `calls` over 64 connections (numbers checked for duplicates), then
/// waits until all `total` documents of `project` are committed.
async fn documents_until_committed(
    bench: &mut Bench,
    idpool: &Idpool,
    project: &str,
    total: u64,
    until: Until,
    commit_timeout: Duration,
    calls: impl Fn(u64) -> Call + Send + Sync + 'static,
) -> anyhow::Result<DocumentRun> {
    idpool.reset_peak_rss();
    let started = Instant::now();
    let load = load::run(bench.addr, 64, until, calls).await?;
    bench.check(&format!("documents of {project}"), &load)?;
    let accepted_s = started.elapsed().as_secs_f64();
    bench
        .all_committed(project, total as i64, commit_timeout)
        .await?;
    Ok(DocumentRun {
        load,
        accepted_s,
        committed_s: started.elapsed().as_secs_f64(),
    })
}

/// A second tenant's `POST /ids` p99 (8 connections) while a hostile
/// neighbour floods (made-up keys, clients that never read, batch bodies a
/// byte at a time, the largest listings of its own big outbox), against
/// the same p99 without the flood, in alternating rounds.
async fn hostile_neighbour(
    bench: &mut Bench,
    idpool: &Idpool,
    sizes: &Sizes,
    intensity: &neighbour::Intensity,
) -> anyhow::Result<()> {
    idpool.reset_peak_rss();
    let total = sizes.neighbour_documents;
    let seeded = load::run(bench.addr, 8, Until::Count(total / 1000), |i| {
        let documents: Vec<_> = (0..1000)
            .map(|n| json!({"project": "HOSTILE", "type": "1", "metadata": metadata(i * 1000 + n)}))
            .collect();
        Call {
            method: Method::POST,
            path: "/api/v1/documents/batch",
            body: Bytes::from(json!({"documents": documents}).to_string()),
            sequence: None,
        }
    })
    .await?;
    bench.check("the neighbour's documents", &seeded)?;
    bench
        .all_committed("HOSTILE", total as i64, Duration::from_secs(120))
        .await?;
    let hostile_key = load::key_of(KEYS - 1).context("the neighbour's key")?;
    let victim = || ids_call("neighbour", 1);
    let warm = load::run(
        bench.addr,
        8,
        Until::Elapsed(Duration::from_secs(1)),
        victim(),
    )
    .await?;
    bench.check("warm-up", &warm)?;
    let (mut alone, mut flooded, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let mut failed = 0;
    let mut sent = neighbour::Sent::default();
    let mut flood_time = Duration::ZERO;
    for _ in 0..sizes.rounds {
        let base = load::run(bench.addr, 8, Until::Elapsed(sizes.slice), victim()).await?;
        bench.check("POST /ids alone", &base)?;
        let flood = neighbour::start(bench.addr, hostile_key.clone(), "HOSTILE", intensity);
        // The flood is under way (connections open, bodies trickling)
        // before the victim is timed.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let subject = load::run(bench.addr, 8, Until::Elapsed(sizes.slice), victim()).await?;
        let round = flood.stop().await;
        flood_time += sizes.slice + Duration::from_millis(300);
        failed += subject.failed;
        sent.made_up_keys += round.made_up_keys;
        sent.listings += round.listings;
        sent.listed_rows += round.listed_rows;
        sent.numbers += round.numbers;
        bench.record_numbers(&subject);
        let (base_p99, subject_p99) = (base.quantile_ms(0.99), subject.quantile_ms(0.99));
        alone.push(base_p99);
        flooded.push(subject_p99);
        ratios.push(subject_p99 / base_p99);
    }
    let n = ratios.len();
    let seconds = flood_time.as_secs_f64();
    bench.context(
        "neighbour: made-up keys sent (per second of flood)",
        sent.made_up_keys as f64 / seconds,
        "req/s",
    );
    bench.context(
        "neighbour: outbox listings of 1000 answered (per second of flood)",
        sent.listings as f64 / seconds,
        "req/s",
    );
    bench.context(
        "neighbour: rows listed (per second of flood)",
        sent.listed_rows as f64 / seconds,
        "rows/s",
    );
    bench.context(
        "neighbour: numbers taken 10,000 at a time (per second of flood)",
        sent.numbers as f64 / seconds,
        "numbers/s",
    );
    bench.context(
        &format!("second tenant's POST /ids p99, 8 connections, alone (median of {n} rounds)"),
        median(&mut alone),
        "ms",
    );
    bench.context(
        &format!(
            "second tenant's POST /ids p99, 8 connections, beside the flood (median of {n} rounds)"
        ),
        median(&mut flooded),
        "ms",
    );
    bench.at_most(
        "second tenant's POST /ids p99: flooded ÷ alone (median of per-round ratios)",
        median(&mut ratios),
        "ratio",
        1.5,
    );
    bench.row(
        "second tenant's requests that failed beside the flood",
        failed as f64,
        "requests",
        "0",
        Some(failed == 0),
    );
    bench
        .peak_rss
        .push(("hostile neighbour".into(), idpool.peak_rss_mib()));
    Ok(())
}

/// Documents in batches of 1,000, 64 connections, until all committed.
async fn document_batches(bench: &mut Bench, idpool: &Idpool, sizes: &Sizes) -> anyhow::Result<()> {
    let total = sizes.documents_total;
    let run = documents_until_committed(
        bench,
        idpool,
        "DOCB",
        total,
        Until::Count(total / 1000),
        Duration::from_secs(300),
        move |i| {
            let documents: Vec<_> = (0..1000)
                .map(
                    |n| json!({"project": "DOCB", "type": "1", "metadata": metadata(i * 1000 + n)}),
                )
                .collect();
            Call {
                method: Method::POST,
                path: "/api/v1/documents/batch",
                body: Bytes::from(json!({"documents": documents}).to_string()),
                sequence: Some(Arc::from("DOCB/1")),
            }
        },
    )
    .await?;
    let (accepted, took) = (run.accepted_s, run.committed_s);
    bench.context(
        "documents accepted/s, batches of 1000, 64 connections",
        total as f64 / accepted,
        "docs/s",
    );
    let goal = 10.0 * sizes.scale;
    bench.context("document batches: all accepted (wall)", accepted, "s");
    bench.at_most(
        &format!("{total} documents, batches of 1000, until all committed (wall)"),
        took,
        "s",
        goal,
    );
    bench
        .peak_rss
        .push(("document batches".into(), idpool.peak_rss_mib()));
    Ok(())
}

/// Single documents, 64 connections, until all committed; then pgbench on
/// the same Postgres for the ratio.
async fn single_documents(
    bench: &mut Bench,
    idpool: &Idpool,
    postgres: &Postgres,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let total = sizes.documents_total;
    let run = documents_until_committed(
        bench,
        idpool,
        "DOCS",
        total,
        Until::Count(total),
        Duration::from_secs(600),
        move |i| Call {
            method: Method::POST,
            path: "/documents",
            body: Bytes::from(
                json!({"project": "DOCS", "type": "1", "metadata": metadata(i)}).to_string(),
            ),
            sequence: Some(Arc::from("DOCS/1")),
        },
    )
    .await?;
    let (docs, accepted, took) = (run.load, run.accepted_s, run.committed_s);
    bench.context("single documents: all accepted (wall)", accepted, "s");
    let goal = 30.0 * sizes.scale;
    bench.at_most(
        &format!("{total} documents, single POST /documents, until all committed (wall)"),
        took,
        "s",
        goal,
    );
    bench
        .peak_rss
        .push(("single documents".into(), idpool.peak_rss_mib()));
    bench.context(
        "POST /documents, 64 connections",
        docs.per_second(),
        "req/s",
    );
    let pgbench = postgres.pgbench_insert(32, sizes.latency_run.as_secs().max(2))?;
    bench.context(
        "pgbench single-row INSERT, 32 clients, same Postgres",
        pgbench.tps,
        "tps",
    );
    let ratio = docs.per_second() / pgbench.tps;
    bench.row(
        "POST /documents req/s ÷ pgbench INSERT tps",
        ratio,
        "ratio",
        ">= 0.8",
        Some(ratio >= 0.8),
    );
    Ok(())
}

/// Single documents on one hot sequence, 64 connections: pooled, then
/// gapless (numbered in the commit that writes them), side by side in one
/// run, and the serialized row-lock way (pgbench, 32 clients) on the same
/// Postgres.
async fn gapless_documents(
    bench: &mut Bench,
    idpool: &Idpool,
    postgres: &Postgres,
    sizes: &Sizes,
) -> anyhow::Result<()> {
    let total = sizes.documents_total / 4;
    let body = Bytes::from(json!({"numbering": "gapless"}).to_string());
    let (status, answer) =
        load::send(bench.addr, Method::PUT, "/api/v1/sequences/GAPL/1", body).await?;
    if status >= 300 {
        anyhow::bail!("defining the gapless sequence: {status} {answer:?}");
    }
    let mut rates = Vec::new();
    for project in ["GAPP", "GAPL"] {
        let run = documents_until_committed(
            bench,
            idpool,
            project,
            total,
            Until::Count(total),
            Duration::from_secs(600),
            move |i| Call {
                method: Method::POST,
                path: "/documents",
                body: Bytes::from(
                    json!({"project": project, "type": "1", "metadata": metadata(i)}).to_string(),
                ),
                sequence: Some(Arc::from(format!("{project}/1"))),
            },
        )
        .await?;
        rates.push(run.load.per_second());
    }
    let (pooled, gapless) = (rates[0], rates[1]);
    bench.context(
        "pooled POST /documents, one sequence, 64 connections",
        pooled,
        "req/s",
    );
    bench.context(
        "gapless POST /documents, one sequence, 64 connections",
        gapless,
        "req/s",
    );
    let serialized = postgres.pgbench_serialized(32, sizes.latency_run.as_secs().max(2))?;
    bench.context(
        "serialized UPDATE counter RETURNING + INSERT + COMMIT, pgbench 32 clients",
        serialized.tps,
        "tps",
    );
    let of_pooled = gapless / pooled;
    bench.row(
        "gapless ÷ pooled POST /documents",
        of_pooled,
        "ratio",
        ">= 0.6",
        Some(of_pooled >= 0.6),
    );
    let of_serialized = gapless / serialized.tps;
    bench.row(
        "gapless POST /documents ÷ serialized row-lock tps",
        of_serialized,
        "ratio",
        ">= 5",
        Some(of_serialized >= 5.0),
    );
    Ok(())
}

/// Many small pools drained at once: refills per pool never overlap, and
/// memory stays bounded.
async fn drained_pools(bench: &mut Bench, idpool: &Idpool, sizes: &Sizes) -> anyhow::Result<()> {
    idpool.reset_peak_rss();
    let addr = bench.addr;
    let sequences = sizes.drained_sequences;
    for s in 0..sequences {
        let body = Bytes::from(json!({"pool_size": 100}).to_string());
        let (status, _) = load::send(
            addr,
            Method::PUT,
            &format!("/api/v1/sequences/DRAIN/{s}"),
            body,
        )
        .await?;
        if status >= 300 {
            bail!("PUT sequence DRAIN/{s}: {status}");
        }
    }
    let drain = load::run(addr, 64, Until::Count(3 * sequences as u64), move |i| {
        let s = i % sequences as u64;
        Call {
            method: Method::POST,
            path: "/ids",
            body: Bytes::from(
                json!({"project": "DRAIN", "type": s.to_string(), "count": 100}).to_string(),
            ),
            sequence: Some(Arc::from(format!("DRAIN/{s}").as_str())),
        }
    })
    .await?;
    bench.check("drained pools", &drain)?;
    // Let background refills started by the last requests finish.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let overlap = max_refills_in_flight_per_pool(&bench.db).await?;
    bench.row(
        &format!("{sequences} sequences drained at once: refills in flight per pool (max)"),
        overlap as f64,
        "refills",
        "1",
        Some(overlap == 1),
    );
    let peak = idpool.peak_rss_mib();
    bench.row(
        &format!("{sequences} sequences drained at once: peak RSS"),
        peak,
        "MiB",
        "<= 150",
        Some(peak <= 150.0),
    );
    Ok(())
}

/// Largest number of refills of one pool whose lock-to-push intervals overlap.
async fn max_refills_in_flight_per_pool(db: &sqlx::PgPool) -> anyhow::Result<usize> {
    type Refill = (
        i64,
        String,
        chrono::DateTime<chrono::Utc>,
        chrono::DateTime<chrono::Utc>,
    );
    let refills: Vec<Refill> = sqlx::query_as(
        "SELECT sequence_id, period, lock_acquired_at, pushed_at FROM blocks \
         WHERE purpose = 'pool' AND pushed_at IS NOT NULL ORDER BY sequence_id, period, lock_acquired_at",
    )
    .fetch_all(db)
    .await?;
    let mut most = 0;
    for pool in refills.chunk_by(|a, b| a.0 == b.0 && a.1 == b.1) {
        for (i, refill) in pool.iter().enumerate() {
            let overlapping = pool[..i]
                .iter()
                .filter(|earlier| earlier.3 > refill.2)
                .count();
            most = most.max(overlapping + 1);
        }
    }
    Ok(most)
}
