//! The `idpool` command line.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;
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
            let app = Application::build(&cli.config).await?;
            stop_on_signals(app.stop_token());
            app.run_until_stopped().await
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
