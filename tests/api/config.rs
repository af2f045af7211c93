//! Configuration that says no: bad values stop `idpool serve` naming the
//! variable and what it accepts; secrets never appear in help or errors.

use std::process::{Command, Output};

fn idpool(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idpool"));
    command.args(args).env_remove("RUST_LOG");
    for (name, value) in env {
        command.env(name, value);
    }
    command.output().expect("idpool runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn out_of_range_values_stop_serve_naming_the_variable_and_the_range() {
    for (variable, value, accepted) in [
        ("IDPOOL_DB_POOL_SIZE", "9", "10..=10000"),
        ("IDPOOL_OUTBOX_BATCH", "0", "1..=10000"),
        ("IDPOOL_REQUEST_TIMEOUT_S", "0", "1..=3600"),
        ("IDPOOL_REDIS_CLIENTS", "0", "1..=64"),
        ("IDPOOL_RECONCILE_INTERVAL_S", "0", "1..=86400"),
    ] {
        let output = idpool(&["serve"], &[(variable, value)]);
        assert!(!output.status.success(), "{variable}={value} was accepted");
        let message = stderr(&output);
        assert!(
            message.contains(variable),
            "{variable} not named: {message}"
        );
        assert!(
            message.contains(accepted),
            "{accepted} not named: {message}"
        );
    }
    let output = idpool(&["serve"], &[("IDPOOL_OUTBOX_POLL_MS", "-5")]);
    assert!(!output.status.success(), "a negative interval was accepted");
    assert!(stderr(&output).contains("IDPOOL_OUTBOX_POLL_MS"));
}

#[test]
fn unusable_urls_stop_serve_without_showing_their_password() {
    let output = idpool(
        &["serve"],
        &[("DATABASE_URL", "mysql://app:hunter2secret@db.example/app")],
    );
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(
        message.contains("DATABASE_URL must be postgres://"),
        "{message}"
    );
    assert!(!message.contains("hunter2secret"), "{message}");

    let output = idpool(
        &["serve"],
        &[("REDIS_URL", "redis-cluster://:hunter2secret@a:1,b")],
    );
    assert!(!output.status.success());
    let message = stderr(&output);
    assert!(message.contains("REDIS_URL"), "{message}");
    assert!(!message.contains("hunter2secret"), "{message}");

    for sink in [
        "webhook:ftp://u:hunter2secret@hooks.example/in?token=hunter2token",
        "webhook:https://u:12#hunter2secret@hooks.example/in?token=hunter2token",
    ] {
        let output = idpool(&["serve"], &[("IDPOOL_SINK", sink)]);
        assert!(!output.status.success());
        let message = stderr(&output);
        assert!(message.contains("IDPOOL_SINK"), "{message}");
        assert!(!message.contains("hunter2"), "{message}");
    }
}

#[test]
fn help_never_prints_the_value_of_a_url_or_secret() {
    let output = idpool(
        &["serve", "--help"],
        &[
            ("DATABASE_URL", "postgres://app:hunter2db@127.0.0.1/app"),
            ("REDIS_URL", "redis://:hunter2redis@127.0.0.1:6379"),
            ("IDPOOL_WEBHOOK_SECRET", "whsec_hunter2webhook"),
            (
                "IDPOOL_REGISTER_KEY",
                "PRIVATE+KEY+hunter2key+00000000+AQ==",
            ),
        ],
    );
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(help.contains("DATABASE_URL"), "{help}");
    for secret in ["hunter2db", "hunter2redis", "hunter2webhook", "hunter2key"] {
        assert!(!help.contains(secret), "help shows {secret}");
    }
}
