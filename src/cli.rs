//! The `idpool` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::auth::KeyStore;
use crate::auth::keys::NewKey;
use crate::config::Config;
use crate::sequence::ProjectCode;
use crate::startup::{Application, stop_on_signals};
use crate::{db, http, telemetry};

#[derive(Debug, Parser)]
#[command(
    name = "idpool",
    version,
    about = "Tenant-formatted sequential IDs from Redis pools over Postgres"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    config: Config,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve the HTTP API (the default).
    Serve,
    /// Database tasks.
    Db {
        #[command(subcommand)]
        action: DbAction,
    },
    /// Print the OpenAPI document.
    Openapi,
    /// Import legacy documents (JSON lines or CSV) through the batch API.
    Import(ImportArgs),
    /// API keys: create (the secret is shown once), list, revoke.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
}

#[derive(Debug, clap::Args)]
struct ImportArgs {
    /// JSON lines (`{"source_id": ..., "metadata": {...}}`), CSV with a
    /// `source_id` column (by extension), or `-` for standard input.
    file: String,
    #[arg(long)]
    project: String,
    #[arg(long = "type")]
    doc_type: String,
    /// The idpool to import into.
    #[arg(long, env = "IDPOOL_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The API key (a project key of the project will do).
    #[arg(long, env = "IDPOOL_KEY", hide_env_values = true)]
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
    /// Revoke a key: it is refused at once by every instance.
    Revoke {
        /// The key's id (from `keys list`).
        id: String,
    },
}

#[derive(Debug, Subcommand)]
enum DbAction {
    /// Apply the migrations.
    Migrate,
}

pub fn run() -> ExitCode {
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve) {
        Command::Openapi => match http::openapi().to_pretty_json() {
            Ok(json) => {
                println!("{json}");
                ExitCode::SUCCESS
            }
            Err(e) => fail(e),
        },
        Command::Serve => with_runtime(async move {
            telemetry::init();
            cli.config.check_urls()?;
            cli.config.check_auth_off_is_local()?;
            if !cli.config.auth.is_on() {
                tracing::warn!(
                    listen = %cli.config.listen,
                    "authentication is OFF (IDPOOL_AUTH=off): every caller may use every project, \
                     without limits; for local development only"
                );
            }
            let app = Application::build(&cli.config).await?;
            stop_on_signals(app.stop_token());
            app.run_until_stopped().await
        }),
        Command::Import(args) => import(args),
        Command::Keys { action } => with_runtime(async move {
            let pool = db::connect(
                &cli.config.database_url,
                2,
                db::Limits::default().for_background(),
            )
            .await?;
            if cli.config.migrate.is_on() {
                db::migrate(&pool).await?;
            }
            keys(&KeyStore::new(pool), action).await
        }),
        Command::Db {
            action: DbAction::Migrate,
        } => with_runtime(async move {
            telemetry::init();
            let pool = db::connect(
                &cli.config.database_url,
                2,
                db::Limits::default().for_background(),
            )
            .await?;
            db::migrate(&pool).await?;
            tracing::info!("migrations applied");
            Ok(())
        }),
    }
}

/// Exit 0: all imported; 1: some lines rejected (see the rejects file);
/// 2: the run failed.
fn import(args: ImportArgs) -> ExitCode {
    let settings = || -> anyhow::Result<crate::import::Settings> {
        Ok(crate::import::Settings {
            project: ProjectCode::parse(&args.project)
                .map_err(|e| anyhow::anyhow!("--project: {e}"))?,
            doc_type: crate::sequence::TypeCode::parse(&args.doc_type)
                .map_err(|e| anyhow::anyhow!("--type: {e}"))?,
            file: args.file.clone(),
            url: args.url.clone(),
            key: args.key.clone(),
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
    match runtime.block_on(crate::import::run(settings)) {
        Ok(report) if report.rejected == 0 => ExitCode::SUCCESS,
        Ok(report) => {
            eprintln!(
                "idpool import: {} lines rejected; see {}",
                report.rejected,
                crate::import::rejects_path(args.out.as_deref()).display()
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
