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
    /// API keys: create (the secret is shown once), list, revoke.
    Keys {
        #[command(subcommand)]
        action: KeysAction,
    },
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
