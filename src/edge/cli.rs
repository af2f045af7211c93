//! The `idpool` command line.

use crate::infra::db::Db;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::domain::sequence::ProjectCode;
use crate::edge::config::Config;
use crate::edge::startup::{Application, stop_on_signals};
use crate::records::auth::KeyStore;
use crate::records::auth::keys::NewKey;
use crate::{edge::http, infra::db, infra::telemetry};

#[derive(Debug, Parser)]
#[command(
    name = "idpool",
    version,
    about = "Tenant-formatted sequential IDs from Redis pools over Postgres",
    long_about = "Tenant-formatted sequential IDs from Redis pools over Postgres.\n\n\
                  Without a command, `idpool` serves (as `idpool serve`) with the options below.",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// The settings of `serve`, for `idpool` without a command.
    #[command(flatten)]
    config: Config,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant)]
enum Command {
    /// Serve the HTTP API, the outbox processor and reconciliation (the
    /// default).
    Serve(Config),
    /// Database tasks.
    Db {
        #[command(subcommand)]
        action: DbAction,
    },
    /// Print the OpenAPI document.
    Openapi,
    /// Import legacy documents (JSON lines or CSV) through the batch API.
    Import(ImportArgs),
    /// Registers: write a project's evidence bundle, or check one with
    /// no database.
    Register {
        #[command(subcommand)]
        action: RegisterAction,
    },
    /// API keys: create (the secret is shown once), list, revoke.
    Keys {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(subcommand)]
        action: KeysAction,
    },
}

/// The database a maintenance command works on.
#[derive(Debug, clap::Args)]
struct DatabaseArgs {
    /// Postgres, as `serve` uses it.
    #[arg(
        long = "database-url",
        env = "DATABASE_URL",
        value_name = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/idpool",
        global = true
    )]
    database_url: String,

    /// none, session or transaction, as for `serve`.
    #[arg(
        long = "pg-pooler",
        env = "IDPOOL_PG_POOLER",
        value_name = "MODE",
        value_enum,
        hide_possible_values = true,
        default_value = "none",
        global = true
    )]
    pg_pooler: db::Pooler,
}

#[derive(Debug, clap::Args)]
struct ImportArgs {
    /// JSON lines (`{"source_id": ..., "metadata": {...}}`), CSV with a
    /// `source_id` column (by extension), or `-` for standard input.
    file: String,
    /// The project the documents belong to.
    #[arg(long)]
    project: String,
    /// Their document type.
    #[arg(long = "type")]
    doc_type: String,
    /// The idpool to import into.
    #[arg(long, env = "IDPOOL_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// A file holding the API key (a project key of the project will do).
    /// Without it, the key comes from IDPOOL_KEY.
    #[arg(long = "key-file", value_name = "PATH")]
    key_file: Option<std::path::PathBuf>,
    /// The API key itself: it shows in the process list, so prefer
    /// --key-file or IDPOOL_KEY.
    #[arg(long)]
    key: Option<String>,
    /// Documents per batch (1 to 1000).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1000))]
    batch: u64,
    /// Batches in flight at once.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    concurrency: u64,
    /// Where the mapping goes (JSON lines, in input order); standard output
    /// by default. Rejects go to `<name>.rejects.jsonl` beside it.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

#[derive(Debug, Subcommand)]
enum KeysAction {
    /// Create a key; prints it as one JSON object, secret included.
    Create {
        /// A project the key may use (repeat for more).
        #[arg(long = "project", value_name = "P")]
        projects: Vec<String>,
        /// The key may use every project, define sequences and reconcile.
        #[arg(long)]
        admin: bool,
        /// What the key is for.
        #[arg(long)]
        name: Option<String>,
    },
    /// Every key as JSON lines, without secrets.
    List,
    /// Revoke a key: it is refused at once by every instance (within a
    /// second by one that polls behind a transaction pooler).
    Revoke {
        /// The key's id (from `keys list`).
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum RegisterAction {
    /// Write a project's evidence bundle: its entries, checkpoints and
    /// public keys (JSON lines).
    Export {
        #[command(flatten)]
        database: DatabaseArgs,
        /// The project whose registers to export.
        #[arg(long)]
        project: String,
        /// Where the bundle goes.
        #[arg(long)]
        out: std::path::PathBuf,
    },
    /// Check a bundle with no database: every chain, the tree at every
    /// checkpoint, every signature. Exit 0, or 1 naming the first bad
    /// entry.
    Verify {
        /// The bundle (`idpool register export`).
        file: std::path::PathBuf,
        /// A verifier key to trust (`<name>+<hash>+<key>`, as
        /// `GET /api/v1/registers/public-key` lists them; repeat for
        /// more). Without one, the bundle's own keys are trusted.
        #[arg(long = "key", value_name = "VERIFIER")]
        keys: Vec<String>,
        /// A signed checkpoint kept from before (a file holding
        /// `GET /api/v1/registers/{project}/checkpoint`'s note; repeat for
        /// more): the bundle must reach its size with its root.
        #[arg(long = "checkpoint", value_name = "FILE")]
        checkpoints: Vec<std::path::PathBuf>,
    },
}

#[derive(Debug, Subcommand)]
enum DbAction {
    /// Create the database if it does not exist and apply the migrations.
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

pub fn run() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Openapi) => match http::openapi().to_pretty_json() {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        None => serve(cli.config),
        Some(Command::Serve(config)) => serve(config),
        Some(Command::Import(args)) => import(args),
        Some(Command::Register {
            action:
                RegisterAction::Verify {
                    file,
                    keys,
                    checkpoints,
                },
        }) => verify_bundle(&file, &keys, &checkpoints),
        Some(Command::Register {
            action:
                RegisterAction::Export {
                    database,
                    project,
                    out,
                },
        }) => with_runtime(async move {
            check_database_url(&database.database_url)?;
            let project =
                ProjectCode::parse(&project).map_err(|e| anyhow::anyhow!("--project: {e}"))?;
            let options = db::connect_options(&database.database_url)?;
            let pool = db::pool(
                options,
                2,
                db::Limits::default().for_background(),
                database.pg_pooler,
            )
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach the database of DATABASE_URL: {e}"))?;
            require_migrated(&pool).await?;
            let file = std::fs::File::create(&out)
                .map_err(|e| anyhow::anyhow!("{}: {e}", out.display()))?;
            let mut writer = std::io::BufWriter::new(file);
            let written =
                crate::features::registers::bundle::export(&pool, project.as_str(), &mut writer)
                    .await?;
            eprintln!(
                "{written} entries of {project} written to {}",
                out.display()
            );
            Ok(())
        }),
        Some(Command::Keys { database, action }) => with_runtime(async move {
            check_database_url(&database.database_url)?;
            // Keys live in a database `serve` or `db migrate` made: a
            // mistyped URL is an error, never a new empty database.
            let options = db::connect_options(&database.database_url)?;
            let pool = db::pool(
                options,
                2,
                db::Limits::default().for_background(),
                database.pg_pooler,
            )
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach the database of DATABASE_URL: {e}"))?;
            require_migrated(&pool).await?;
            keys(&KeyStore::new(pool), action).await
        }),
        Some(Command::Db {
            action: DbAction::Migrate { database },
        }) => with_runtime(async move {
            let _logs = telemetry::init();
            check_database_url(&database.database_url)?;
            let pool = db::connect(
                &database.database_url,
                2,
                db::Limits::default().for_background(),
                database.pg_pooler,
            )
            .await?;
            db::migrate(&pool).await?;
            tracing::info!("migrations applied");
            Ok(())
        }),
    }
}

fn serve(config: Config) -> ExitCode {
    let _logs = telemetry::init();
    with_runtime(async move {
        config.check_urls()?;
        config.check_outbox_backoff()?;
        config.check_auth_off_is_local()?;
        if !config.auth.is_on() {
            tracing::warn!(
                listen = %config.listen,
                "authentication is OFF (IDPOOL_AUTH=off): every caller may use every project, \
                 without limits; for local development only"
            );
        }
        let app = Application::build(&config).await?;
        stop_on_signals(app.stop_token());
        app.run_until_stopped().await
    })
}

/// `idpool register verify`: exit 0 when the bundle holds, 1 naming the
/// first thing wrong, 2 when it cannot be read.
fn verify_bundle(
    file: &std::path::Path,
    keys: &[String],
    checkpoints: &[std::path::PathBuf],
) -> ExitCode {
    use crate::features::registers::bundle::{self, Fault};
    let unusable = |what: String| {
        eprintln!("{what}");
        ExitCode::from(2)
    };
    let mut kept = Vec::new();
    for path in checkpoints {
        match std::fs::read_to_string(path) {
            Ok(note) => kept.push(note),
            Err(e) => return unusable(format!("--checkpoint {}: {e}", path.display())),
        }
    }
    let reader = match std::fs::File::open(file) {
        Ok(f) => std::io::BufReader::with_capacity(1 << 20, f),
        Err(e) => return unusable(format!("{}: {e}", file.display())),
    };
    match bundle::verify(reader, keys, &kept) {
        Ok(checked) => {
            let unsigned = checked.entries - checked.signed_size;
            println!(
                "ok: {} entries in {} chains; {} checkpoints verified, signed up to {} entries{}",
                checked.entries,
                checked.chains,
                checked.checkpoints,
                checked.signed_size,
                match unsigned {
                    0 => String::new(),
                    n => format!(" ({n} later entries chained but not signed yet)"),
                }
            );
            ExitCode::SUCCESS
        }
        Err(Fault::Bad(why)) => {
            println!("bad: {why}");
            ExitCode::from(1)
        }
        Err(Fault::Unusable(why)) => unusable(why),
    }
}

fn check_database_url(url: &str) -> anyhow::Result<()> {
    crate::edge::config::check_database_url(url)
}

/// Fails unless the database holds idpool's tables.
async fn require_migrated(pool: &Db) -> anyhow::Result<()> {
    let migrated =
        sqlx::query_scalar!(r#"SELECT to_regclass('api_keys') IS NOT NULL AS "migrated!""#)
            .fetch_one(pool)
            .await?;
    if !migrated {
        anyhow::bail!(
            "the database of DATABASE_URL holds no idpool tables; is the URL right? \
             (`idpool db migrate` or `idpool serve` creates them)"
        );
    }
    Ok(())
}

/// Exit 0: all imported; 1: some lines rejected (see the rejects file);
/// 2: the run failed.
/// The importer's API key: `--key-file`, else `--key` (with a warning: a
/// command line shows in the process list), else `IDPOOL_KEY`.
fn import_key(args: &ImportArgs) -> anyhow::Result<Option<String>> {
    if let Some(path) = &args.key_file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("--key-file {}: {e}", path.display()))?;
        let key = text.trim();
        if key.is_empty() {
            anyhow::bail!("--key-file {} is empty", path.display());
        }
        return Ok(Some(key.to_owned()));
    }
    if let Some(key) = &args.key {
        eprintln!(
            "idpool import: warning: --key shows the key to everyone who can list processes; \
             use --key-file or IDPOOL_KEY"
        );
        return Ok(Some(key.clone()));
    }
    Ok(std::env::var("IDPOOL_KEY")
        .ok()
        .map(|k| k.trim().to_owned())
        .filter(|k| !k.is_empty()))
}

fn import(args: ImportArgs) -> ExitCode {
    let settings = || -> anyhow::Result<crate::edge::import::Settings> {
        Ok(crate::edge::import::Settings {
            project: ProjectCode::parse(&args.project)
                .map_err(|e| anyhow::anyhow!("--project: {e}"))?,
            doc_type: crate::domain::sequence::TypeCode::parse(&args.doc_type)
                .map_err(|e| anyhow::anyhow!("--type: {e}"))?,
            file: args.file.clone(),
            url: args.url.clone(),
            key: import_key(&args)?,
            batch: args.batch as usize,
            concurrency: args.concurrency as usize,
            out: args.out.clone(),
        })
    };
    let settings = match settings() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("idpool import: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("idpool import: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(crate::edge::import::run(settings)) {
        Ok(report) if report.rejected == 0 => ExitCode::SUCCESS,
        Ok(report) => {
            eprintln!(
                "idpool import: {} lines rejected; see {}",
                report.rejected,
                crate::edge::import::rejects_path(args.out.as_deref()).display()
            );
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("idpool import: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn keys(store: &KeyStore, action: KeysAction) -> anyhow::Result<()> {
    match action {
        KeysAction::Create {
            projects,
            admin,
            name,
        } => {
            let projects = projects
                .iter()
                .map(|p| ProjectCode::parse(p).map_err(|e| anyhow::anyhow!("--project {p:?}: {e}")))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let created = store
                .create(&NewKey {
                    name,
                    admin,
                    projects,
                })
                .await?;
            println!("{}", serde_json::to_string(&created)?);
        }
        KeysAction::List => {
            for key in store.list().await? {
                println!("{}", serde_json::to_string(&key)?);
            }
        }
        KeysAction::Revoke { id } => {
            let revoked = store.revoke(&id).await?;
            println!("{}", serde_json::to_string(&revoked)?);
        }
    }
    Ok(())
}

fn with_runtime(work: impl Future<Output = anyhow::Result<()>>) -> ExitCode {
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => return fail(e),
    };
    match runtime.block_on(work) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

fn fail(e: impl std::fmt::Display) -> ExitCode {
    tracing::error!(error = %e, "idpool failed");
    eprintln!("idpool: {e}");
    ExitCode::FAILURE
}
